"""The end-to-end numerical regression test: a fixed-seed tiny run's weights,
bit for bit."""
import json
import os

import pytest
import tensorflow as tf

from conftest import FLOAT64_WEIGHTS_SHA256
from conftest import SMALL
from conftest import needs_mnist
from conftest import train_here
from conftest import weights_sha256

# Weights of a fixed-seed tiny run (SMALL, 320 training images, 12 steps), a
# sha256 over the model variables in name order: any change to what is
# computed (layers, initialisation, data order, augmentation, optimizer)
# changes them. Recorded at commit 8739eda, before the layers were reshaped
# (issue 14), and unchanged since. How oneDNN rounds in bfloat16 depends on
# the CPU's instructions, so the bf16 value is per kind of CPU (the bf16
# instructions it has) and checked only where one was recorded.
WEIGHTS_SHA256 = {"float64": FLOAT64_WEIGHTS_SHA256}
BF16_WEIGHTS_SHA256 = {   # CPU bf16 instructions: sha256
    "avx512_bf16": "25360c1e0bed34fe978546a89d2f03028cd49809fcaaf3f2aee196514b7c63d3",
    # recorded at commit 3866746 (before the official layers and weight averaging)
    "avx512_bf16,amx_bf16": "389aa19701adcbca7027e016c82e9d135f644cb7143c3cea06ddb4d5ce8e5187",
}


def _cpu_bf16_instructions():
  try:
    cpu_flags = set(open("/proc/cpuinfo").read().split())
  except OSError:
    return "unknown"
  return ",".join(f for f in ("avx512_bf16", "amx_bf16") if f in cpu_flags) or "none"


if _cpu_bf16_instructions() in BF16_WEIGHTS_SHA256:
  WEIGHTS_SHA256["bf16"] = BF16_WEIGHTS_SHA256[_cpu_bf16_instructions()]


@needs_mnist
@pytest.mark.parametrize("mode", [
    "float64", pytest.param("bf16", marks=pytest.mark.skipif(
        "bf16" not in WEIGHTS_SHA256, reason="no bf16 checksum recorded for a CPU "
        f"with bf16 instructions {_cpu_bf16_instructions()!r}"))])
def test_max_steps_and_bit_identical_weights(tmp_path, mode):
  """--max_steps stops mid-epoch (10 steps an epoch, stop at 12) and the
  weights are bit for bit those recorded."""
  logdir = str(tmp_path / mode)
  flag = "--dtype=float64" if mode == "float64" else "--precision=bf16"
  proc = train_here(*SMALL, "--train_size=320", "--max_steps=12", flag,
                    f"--logdir={logdir}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  ckpt = tf.train.latest_checkpoint(os.path.join(logdir, "latest"))
  assert ckpt.endswith("-12")
  reader = tf.train.load_checkpoint(ckpt)
  assert (reader.get_tensor("state/epoch"), reader.get_tensor("state/epoch_examples")) == (1, 64)
  rows = [json.loads(line) for line in open(os.path.join(logdir, "metrics.jsonl"))]
  assert [(r["epoch"], r["step"]) for r in rows] == [(1, 10)]
  test = json.load(open(os.path.join(logdir, "test_results.json")))
  assert test["checkpoint"].endswith("best/model.ckpt-10")
  assert weights_sha256(ckpt) == WEIGHTS_SHA256[mode]
