"""Kills, interrupts and a full disk during training: the run resumes to the
uninterrupted run's result, and every listed checkpoint loads."""
import glob
import json
import os
import random
import re
import signal
import subprocess
import time

import numpy as np
import pytest
import tensorflow as tf

from capsnet.running import runs
from capsnet.running import stopping
from conftest import QUICK
from conftest import THREE_EPOCHS
from conftest import TIMING
from conftest import last_line
from conftest import latest_step
from conftest import listed
from conftest import needs_mnist
from conftest import rows
from conftest import start
from conftest import train_here
from conftest import wait_until
from conftest import weights_sha256


@needs_mnist
def test_full_disk_while_saving_ends_in_one_line_and_listed_checkpoints_load(small_disk):
  folder, _ = small_disk
  logdir = str(folder / "run")
  proc = train_here(*QUICK, f"--logdir={logdir}", "--epochs=50", "--save_every=1",
             "--summary_every=1000")
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert re.fullmatch(r"train\.py: error: could not write the checkpoint of step \d+ "
                      rf"to {logdir}/(latest|best) \(.+\); the last complete one is "
                      rf"{logdir}/(latest|best)/model\.ckpt-\d+", last_line(proc)), \
      last_line(proc)
  assert "Traceback" not in proc.stderr
  for which in ("latest", "best"):
    for prefix in listed(os.path.join(logdir, which)):
      assert runs.damage(prefix) is None, prefix


def test_second_ctrl_c_waits_for_the_checkpoint_being_written():
  stop = stopping.StopRequest()
  stop(signal.SIGINT, None)
  assert stop.requested
  with pytest.raises(KeyboardInterrupt):
    with stop.deferred():
      stop(signal.SIGINT, None)          # during the save: no exception here
      finished = True                    # ...so the save completes
  assert finished
  with pytest.raises(KeyboardInterrupt):
    stop(signal.SIGINT, None)            # outside a save: at once


def test_after_a_stop_signal_a_later_one_changes_nothing():
  """Leaving the run's session after a stop signal must not put the default
  handlers back: a second Ctrl-C arriving after the save (while the run
  prints where it saved) would raise a bare KeyboardInterrupt, a traceback."""
  before = {sig: signal.getsignal(sig) for sig in stopping.STOP_SIGNALS}
  try:
    with stopping.StopRequest().installed():
      pass
    assert {sig: signal.getsignal(sig) for sig in stopping.STOP_SIGNALS} == before
    with stopping.StopRequest().installed() as stop:
      stop(signal.SIGINT, None)
    for sig in stopping.STOP_SIGNALS:
      assert signal.getsignal(sig) == signal.SIG_IGN, sig
    os.kill(os.getpid(), signal.SIGINT)   # ignored: no KeyboardInterrupt
    time.sleep(0.01)
  finally:
    for sig, handler in before.items():
      signal.signal(sig, handler)


@pytest.mark.integration
@needs_mnist
def test_ctrl_c_twice_no_traceback_and_listed_checkpoints_load(tmp_path):
  logdir = str(tmp_path / "run")
  proc = start("train.py", *QUICK, f"--logdir={logdir}", "--epochs=50",
               "--save_every=1", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
               text=True)
  wait_until(lambda: os.path.exists(os.path.join(logdir, "latest")))
  proc.send_signal(signal.SIGINT)
  time.sleep(0.02)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err[-3000:]
  assert "Traceback" not in err
  for prefix in listed(os.path.join(logdir, "latest")):
    assert runs.damage(prefix) is None, prefix


@pytest.mark.integration
@needs_mnist
def test_sigkill_at_random_moments_changes_nothing(tmp_path, trained_once):
  """A run killed (SIGKILL) several times, once while writing a checkpoint,
  and resumed each time ends with the uninterrupted run's weights, bit for
  bit, and its metrics rows (timing aside)."""
  args = THREE_EPOCHS
  reference = trained_once(*args)
  logdir = str(tmp_path / "killed")
  rng = random.Random(0)
  kills = 0
  for attempt in range(3):
    start_step = latest_step(logdir)
    proc = start("train.py", *args, f"--logdir={logdir}", stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)
    if attempt == 0:   # while a checkpoint is being written
      wait_until(lambda: glob.glob(os.path.join(logdir, "latest", "*temp*")),
                 poll=0.001, proc=proc)
    else:              # a few steps on, at a random moment of a step
      target = start_step + rng.randint(2, 5)
      wait_until(lambda target=target: latest_step(logdir) >= target, poll=0.001, proc=proc)
    time.sleep(0 if attempt == 0 else rng.uniform(0.0, 0.05))
    if proc.poll() is None:
      proc.kill()
      kills += 1
    proc.wait()
  assert kills >= 3
  proc = train_here(*args, f"--logdir={logdir}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  def ckpt(d):
    return tf.train.latest_checkpoint(os.path.join(d, "latest"))
  assert ckpt(logdir).endswith("-30") and ckpt(reference).endswith("-30")
  assert weights_sha256(ckpt(logdir)) == weights_sha256(ckpt(reference))
  def strip(rs):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rs]
  assert strip(rows(logdir)) == strip(rows(reference))
  def tested(d):
    return json.load(open(os.path.join(d, "test_results.json")))
  assert os.path.basename(tested(logdir)["checkpoint"]) == os.path.basename(
      tested(reference)["checkpoint"]), (rows(logdir), rows(reference))
  assert tested(logdir)["accuracy"] == tested(reference)["accuracy"]
  np.testing.assert_equal(tested(logdir)["confusion"], tested(reference)["confusion"])
