"""Command lines on their own: errors, Ctrl-C."""
import json
import os
import signal
import subprocess

import pytest
import tensorflow as tf

from conftest import SMALL
from conftest import cli
from conftest import eval_here
from conftest import needs_mnist
from conftest import start
from conftest import wait_until


@pytest.mark.integration
def test_train_flag_error_is_one_line_and_writes_nothing(tmp_path):
  proc = cli("train.py", "--decoder_units=512,x", f"--logdir={tmp_path}/a")
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == (
      "train.py: error: ModelConfig.decoder_units must be positive ints, got "
      "['512', 'x']")
  assert not os.path.exists(f"{tmp_path}/a")


@pytest.mark.integration
@needs_mnist
def test_sigint_saves_a_loadable_checkpoint(tmp_path):
  logdir = str(tmp_path / "sigint")
  proc = start("train.py", *SMALL, f"--logdir={logdir}", "--epochs=50",
               "--summary_every=1", "--diag_every=1000", stdout=subprocess.PIPE,
               stderr=subprocess.PIPE, text=True)
  # The diagnostic's first row is written after step 1: into the first epoch.
  wait_until(lambda: os.path.exists(os.path.join(logdir, "diagnostics.jsonl")),
             proc=proc)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err[-3000:]
  ckpt = tf.train.latest_checkpoint(os.path.join(logdir, "latest"))
  assert f"Saved {ckpt}; run again with --logdir={logdir} to resume" in out
  step = int(ckpt.rsplit("-", 1)[1])
  assert 0 < step < 59500 // 32         # saved part-way through epoch 1
  reader = tf.train.load_checkpoint(ckpt)
  assert reader.get_tensor("state/epoch_examples") == 32 * step
  assert reader.get_tensor("global_step") == step
  # eval.py takes the checkpoint prefix (config.json one folder up) and
  # another number of routing iterations.
  proc = eval_here(f"--checkpoint={ckpt}", f"--out_dir={tmp_path}/eval",
                   "--iter_routing=2", "--num_images=4", "--split=validation")
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.load(open(tmp_path / "eval" / "results.json"))
  assert (res["count"], res["checkpoint"], res["iter_routing"]) == (500, ckpt, 2)
