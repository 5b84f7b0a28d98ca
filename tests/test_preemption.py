"""Preemption and concurrent runs: SIGTERM and SIGHUP save as Ctrl-C does,
one trainer a run folder, checkpoints without config.json, a damaged newest
checkpoint in a finished run, and a model override that does not fit."""
import json
import os
import re
import signal
import subprocess

import pytest
import tensorflow as tf

from capsnet.running import runs
from conftest import QUICK
from conftest import THREE_EPOCHS
from conftest import TIMING
from conftest import eval_here
from conftest import last_line
from conftest import latest_step
from conftest import listed
from conftest import needs_mnist
from conftest import rows
from conftest import start
from conftest import train_here
from conftest import wait_until
from conftest import weights_sha256


def _stop_with(sig, logdir, args, after_step):
  """Starts train.py, sends `sig` once `after_step` is saved; returns the
  finished process's (status, stdout, stderr)."""
  proc = start("train.py", *args, f"--logdir={logdir}", stdout=subprocess.PIPE,
               stderr=subprocess.PIPE, text=True)
  assert wait_until(lambda: latest_step(logdir) >= after_step, proc=proc), \
      proc.communicate()[1][-3000:]
  proc.send_signal(sig)
  out, err = proc.communicate(timeout=120)
  return proc.returncode, out, err


@pytest.mark.integration
@needs_mnist
def test_sigterm_and_sighup_save_and_the_resume_is_bit_identical(tmp_path, trained_once):
  args = THREE_EPOCHS
  reference = trained_once(*args)
  logdir = str(tmp_path / "preempted")
  for sig, status, after in ((signal.SIGTERM, 143, 3), (signal.SIGHUP, 129, 14)):
    before = latest_step(logdir)
    code, out, err = _stop_with(sig, logdir, args, after)
    assert code == status, err[-3000:]
    assert "Traceback" not in err
    assert f"{sig.name}: saving a checkpoint at the end of this step" in out + err
    saved = latest_step(logdir)
    assert saved > before and f"Saved {logdir}/latest/model.ckpt-{saved}" in out
    for prefix in listed(os.path.join(logdir, "latest")):
      assert runs.damage(prefix) is None, prefix
  proc = train_here(*args, f"--logdir={logdir}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  def ckpt(d):
    return tf.train.latest_checkpoint(os.path.join(d, "latest"))
  assert ckpt(logdir).endswith("-30")
  assert weights_sha256(ckpt(logdir)) == weights_sha256(ckpt(reference))
  def strip(rs):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rs]
  assert strip(rows(logdir)) == strip(rows(reference))


@pytest.mark.integration
@needs_mnist
def test_one_trainer_a_run_folder(tmp_path):
  logdir = str(tmp_path / "run")
  first = start("train.py", *QUICK, "--epochs=50", f"--logdir={logdir}",
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    assert wait_until(lambda: latest_step(logdir) >= 1, proc=first)
    before = sorted(os.listdir(logdir))
    metrics = open(os.path.join(logdir, "metrics.jsonl")).read() if os.path.exists(
        os.path.join(logdir, "metrics.jsonl")) else ""
    proc = train_here(*QUICK, "--epochs=50", f"--logdir={logdir}")
    assert proc.returncode == 1
    assert re.fullmatch(
        rf"train\.py: error: --logdir={re.escape(logdir)} is in use by pid "
        rf"{first.pid} on \S+, started \S+: one trainer a run folder; wait for it "
        r"to end or stop it \(it saves on SIGTERM\)", last_line(proc)), last_line(proc)
    assert "Resuming" not in proc.stdout
    assert len([f for f in os.listdir(logdir) if f.startswith("events.")]) == 1
    assert set(before) <= set(os.listdir(logdir))
  finally:
    first.kill()   # SIGKILL: the lock goes with the process
    first.wait()
  assert metrics in open(os.path.join(logdir, "metrics.jsonl")).read() or not metrics
  proc = train_here(*QUICK, "--epochs=50", "--max_steps=3", f"--logdir={logdir}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Resuming from" in proc.stdout


@needs_mnist
def test_checkpoints_without_config_json(tmp_path):
  logdir = str(tmp_path / "run")
  assert train_here(*QUICK, "--max_steps=3", f"--logdir={logdir}").returncode == 0
  os.remove(os.path.join(logdir, "config.json"))
  latest = os.path.join(logdir, "latest")
  before = {f: open(os.path.join(latest, f), "rb").read() for f in os.listdir(latest)}
  proc = train_here(*QUICK, "--max_steps=6", "--seed=5", f"--logdir={logdir}")
  assert proc.returncode == 1
  assert last_line(proc) == (
      f"train.py: error: {logdir} has checkpoints (latest/model.ckpt-3) but no "
      "config.json, so the settings they were trained with cannot be checked: "
      "restore config.json, or pass --adopt_checkpoints to resume them with these "
      "flags (the variables' shapes are checked against the model)")
  assert not os.path.exists(os.path.join(logdir, "config.json"))
  assert {f: open(os.path.join(latest, f), "rb").read() for f in os.listdir(latest)} == before
  # Adopted with a model that does not fit: one line naming the variable.
  proc = train_here(*QUICK, "--max_steps=6", "--primary_types=8", "--adopt_checkpoints",
                    f"--logdir={logdir}")
  assert proc.returncode == 1
  assert re.fullmatch(rf"train\.py: error: {re.escape(latest)}/model\.ckpt-3: checkpoint "
                      r"of another architecture: capsnet/\S+ is \[.*\] in the "
                      r"checkpoint, \[.*\] in config\.json", last_line(proc)), last_line(proc)
  proc = train_here(*QUICK, "--max_steps=6", "--adopt_checkpoints", f"--logdir={logdir}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"Resuming from {latest}/model.ckpt-3" in proc.stdout
  assert json.load(open(os.path.join(logdir, "config.json")))["train"]["seed"] == 0


@needs_mnist
def test_damaged_newest_checkpoint_of_a_finished_run_leaves_the_index(tmp_path):
  logdir = str(tmp_path / "run")
  args = [*QUICK, "--epochs=1", "--save_every=5"]
  assert train_here(*args, f"--logdir={logdir}").returncode == 0
  latest = os.path.join(logdir, "latest")
  assert [os.path.basename(p) for p in listed(latest)] == ["model.ckpt-5", "model.ckpt-10"]
  damaged = os.path.join(latest, "model.ckpt-10.data-00000-of-00001")
  with open(damaged, "r+b") as f:
    f.truncate(100)
  proc = train_here(*args, f"--logdir={logdir}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"{latest}/model.ckpt-10: damaged (" in proc.stdout
  assert [os.path.basename(p) for p in listed(latest)] == ["model.ckpt-5"]
  assert tf.train.latest_checkpoint(latest).endswith("model.ckpt-5")
  assert os.path.getsize(damaged) == 100   # kept on disk, not deleted


@needs_mnist
def test_eval_override_that_does_not_fit_the_checkpoint(tmp_path):
  logdir = str(tmp_path / "run")
  assert train_here(*QUICK, "--max_steps=2", f"--logdir={logdir}").returncode == 0
  proc = eval_here(f"--checkpoint={logdir}", "--which=latest", "--dtype=float64",
                   f"--out_dir={tmp_path / 'eval'}")
  assert proc.returncode == 1
  assert last_line(proc) == (
      f"eval.py: error: {logdir}/latest/model.ckpt-2: capsnet/conv1/weights is float32 "
      "in the checkpoint, float64 in the model (a --dtype or --precision that does "
      "not fit the run?)")
  assert "Traceback" not in proc.stderr
