"""The machine a program runs on: the facts a measurement depends on.

A training step's speed, and which convolution method or precision wins,
depend on the CPU (model and instruction sets) and on the TensorFlow build;
`describe` reads them without importing TensorFlow, so that capsnet.study
can record them beside each run (host.json) and the convolution planner can
key its cache by them.
"""
import functools
import importlib.metadata
import os
import platform

# The CPU flags that decide which kernels oneDNN can use.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni",
                "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8")


def _cpuinfo(path="/proc/cpuinfo"):
  """(model name, set of flags) of the first CPU in /proc/cpuinfo; the
  platform's processor name and no flags where there is no such file."""
  model, found = platform.processor() or platform.machine(), set()
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model in ("", platform.machine(), platform.processor()):
          model = value.strip()
        elif key == "flags":
          found = set(value.split())
          break
  return model, found


def _version(package):
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


@functools.lru_cache(maxsize=None)
def describe():
  """{"cpu": model name, "cores": logical CPUs, "flags": the KERNEL_FLAGS the
  CPU has, "tensorflow": the installed version, "onednn": TF_ENABLE_ONEDNN_OPTS
  as the project's programs import TensorFlow with it (`startup`: the user's
  value, else "1")}."""
  model, found = _cpuinfo()
  return {"cpu": model, "cores": os.cpu_count(),
          "flags": [f for f in KERNEL_FLAGS if f in found],
          "tensorflow": _version("tensorflow"),
          "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1")}


def has_amx():
  """The CPU has AMX tiles for bfloat16 (where bf16 beats fp32)."""
  return "amx_bf16" in describe()["flags"]
