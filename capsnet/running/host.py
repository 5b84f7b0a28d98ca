"""The machine a program runs on: the CPU and TensorFlow build a measurement
depends on (`describe`, without importing TensorFlow: host.json, the planner's
cache key), and whether other programs were busy (`others_busy`)."""
import functools
import importlib.metadata
import os
import platform
import time

# The CPU flags that decide which kernels oneDNN can use.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni",
                "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8")


def _cpuinfo(path="/proc/cpuinfo"):
  """(model name, flags, "<vendor> family F model M" or None) of the first CPU
  in /proc/cpuinfo (without it: the platform's name, no flags)."""
  model, found = platform.processor() or platform.machine(), set()
  ident = {}
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model in ("", platform.machine(), platform.processor()):
          model = value.strip()
        elif key in ("vendor_id", "cpu family", "model"):
          ident.setdefault(key, value.strip())
        elif key == "flags":
          found = set(value.split())
          break
  cpu_id = (f"{ident['vendor_id']} family {ident['cpu family']} model {ident['model']}"
            if len(ident) == 3 else None)
  return model, found, cpu_id


def version(package):
  """An installed package's version, or None."""
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


@functools.lru_cache(maxsize=None)
def describe():
  """{"cpu", "cpu_id" ("<vendor> family F model M" or None), "cores", "flags"
  (the KERNEL_FLAGS it has), "tensorflow", "onednn" (as `startup` sets it)}."""
  model, found, cpu_id = _cpuinfo()
  return {"cpu": model, "cpu_id": cpu_id, "cores": os.cpu_count(),
          "flags": [f for f in KERNEL_FLAGS if f in found],
          "tensorflow": version("tensorflow"),
          "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1")}


def _cpu_ticks(path="/proc/stat"):
  """(busy, total) clock ticks of all CPUs since boot, or None."""
  try:
    with open(path) as f:
      values = [int(v) for v in f.readline().split()[1:]]
  except (OSError, ValueError):
    return None
  idle = values[3] + (values[4] if len(values) > 4 else 0)   # idle, iowait
  return sum(values) - idle, sum(values)


def _own_ticks():
  """Clock ticks this process and its waited-for children have used."""
  times = os.times()
  return (times.user + times.system + times.children_user + times.children_system) \
      * os.sysconf("SC_CLK_TCK")


# Cores other programs may keep busy before a timing is marked as not idle.
BUSY_CORES = 0.3


def others_busy(seconds=0.5):
  """How many cores other programs kept busy over the next `seconds` (this
  process sleeping), from /proc/stat; None without it; 0 with
  CAPSNET_ASSUME_IDLE=1 (the test suite)."""
  if os.environ.get("CAPSNET_ASSUME_IDLE") == "1":
    return 0.0
  start, own = _cpu_ticks(), _own_ticks()
  if start is None:
    return None
  time.sleep(seconds)
  end, own_end = _cpu_ticks(), _own_ticks()
  busy = (end[0] - start[0]) - (own_end - own)
  total = end[1] - start[1]
  return max(0.0, busy / total * (os.cpu_count() or 1)) if total else 0.0


def busy_line(who, cores):
  """The one line a timing prints when the machine was not idle, or None."""
  if not cores or cores < BUSY_CORES:
    return None
  return (f"{who}: the machine was not idle: other programs kept {cores:.1f} of "
          f"{os.cpu_count()} cores busy")
