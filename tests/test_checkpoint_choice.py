"""Which checkpoints a run keeps: the best-checkpoint rule with its ties
(`recording.validate`, `run_state.is_better`) and the weights at the end of
the --keep_epochs epochs (epochs/), resumed or not."""
import collections
import json
import os

import numpy as np
import pytest

from capsnet.running import recording
from capsnet.running import run_state
from capsnet.running import runs
import config
from conftest import QUICK
from conftest import needs_mnist
from conftest import train_here
from conftest import weights_sha256


def test_is_better_accuracy_then_loss_then_the_later():
  assert run_state.is_better(0.99, 0.9, 0.98, 0.1)          # higher accuracy
  assert not run_state.is_better(0.97, 0.01, 0.98, 0.1)     # lower accuracy
  assert run_state.is_better(0.98, 0.05, 0.98, 0.1)         # tie: lower loss
  assert not run_state.is_better(0.98, 0.2, 0.98, 0.1)      # tie: higher loss
  assert run_state.is_better(0.98, 0.1, 0.98, 0.1)          # all tied: the later
  assert not run_state.is_better(0.98, 0.1, 0.98, 0.1, tie_wins=False)
  assert run_state.is_better(0.5, 0.3, -1.0, float("inf"))  # the first validation
  # Compared as the checkpoint keeps them (float32): a float64 loss that only
  # differs below float32's precision is a tie, and the later one wins.
  assert run_state.is_better(0.98, 0.1 + 1e-12, 0.98, float(np.float32(0.1)),
                             tie_wins=True)


FakeGraph = collections.namedtuple("FakeGraph", ["eval", "eval_averaged"])
FakeRun = collections.namedtuple("FakeRun", ["sess", "g", "splits", "writer", "folder"])


class FakeFolder:
  def __init__(self):
    self.rows = []

  def append_metrics(self, row, kind):
    self.rows.append(dict(row, kind=kind))


@pytest.mark.parametrize("averaging", [False, True])
def test_validate_keeps_the_best_by_the_tie_rule(monkeypatch, averaging):
  """A sequence of validations (accuracy, loss) and, for each, whether
  `recording.validate` saves best/ after it."""
  sequence = [((0.90, 0.50), True), ((0.90, 0.60), False), ((0.90, 0.40), True),
              ((0.90, 0.40), True), ((0.80, 0.10), False), ((0.95, 0.90), True)]
  figures = iter([])
  def fake_eval(sess, graph, images, labels):
    acc, loss = next(figures)
    return {"accuracy": acc, "loss": loss, "error_percent": 100 * (1 - acc)}
  saved = []
  monkeypatch.setattr(recording.evaluation, "run", fake_eval)
  monkeypatch.setattr(recording, "save", lambda run, which, pos: saved.append(which))
  monkeypatch.setattr(recording, "add_scalars", lambda *a: None)
  run = FakeRun(None, FakeGraph("raw", "averaged" if averaging else None),
                {"validation": (np.zeros(3), np.zeros(3))}, None, FakeFolder())
  pos = run_state.Position()
  for (acc, loss), expected in sequence:
    # With averaging, the averaged weights trail the raw by 0.01 in accuracy.
    figures = iter([(acc, loss)] + ([(acc - 0.01, 0.0)] if averaging else []))
    saved.clear()
    recording.validate(run, pos, {"epoch": 1, "step": 1}, kind="epoch")
    assert saved == (["best"] if expected else []), (acc, loss)
  assert (pos.best_val, pos.best_val_loss) == (np.float32(0.95), np.float32(0.9))
  assert pos.best_averaged is False


def test_averaged_weights_win_a_tie_only_by_a_lower_loss(monkeypatch):
  figures = iter([(0.9, 0.5), (0.9, 0.5),      # tied: the raw weights
                  (0.92, 0.5), (0.92, 0.4)])   # same accuracy, lower loss: averaged
  monkeypatch.setattr(recording.evaluation, "run", lambda s, g, i, line: dict(
      zip(("accuracy", "loss"), next(figures), strict=True), error_percent=0.0))
  monkeypatch.setattr(recording, "save", lambda run, which, pos: None)
  monkeypatch.setattr(recording, "add_scalars", lambda *a: None)
  run = FakeRun(None, FakeGraph("raw", "averaged"),
                {"validation": (np.zeros(3), np.zeros(3))}, None, FakeFolder())
  pos = run_state.Position()
  recording.validate(run, pos, {"epoch": 1, "step": 1}, kind="epoch")
  assert pos.best_averaged is False
  recording.validate(run, pos, {"epoch": 2, "step": 2}, kind="epoch")
  assert pos.best_averaged is True and pos.best_val_loss == np.float32(0.4)


def test_keep_epochs_refuses_a_bad_value():
  assert config.parse_epochs(["10", "1", "5", "2", "5"]) == (1, 2, 5, 10)
  for bad in (["0"], ["x"], ["1", "-2"]):
    with pytest.raises(ValueError, match=r"^--keep_epochs=.*: expected positive integers"):
      config.parse_epochs(bad)


def test_a_kept_epoch_past_the_last_is_said_at_the_start(tmp_path):
  assert config.kept_past_the_end((1, 2), 2) is None
  assert config.kept_past_the_end((1, 5), 2) == (
      "train.py: --keep_epochs: epoch 5 is past the run's last (--epochs=2): nothing "
      "is kept for it unless the run is resumed with more epochs")
  assert config.kept_past_the_end((5, 7), 2).startswith(
      "train.py: --keep_epochs: epoch 5, 7 are past")


@needs_mnist
def test_train_says_a_kept_epoch_past_the_last(tmp_path):
  proc = train_here(*QUICK, "--epochs=1", "--keep_epochs=1,5", "--save_every=1000",
                    f"--logdir={tmp_path / 'run'}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.splitlines()[0] == config.kept_past_the_end((1, 5), 1)
  assert _epoch_checkpoints(tmp_path / "run") == [10]


def _epoch_checkpoints(logdir):
  return [runs.step_of(p) for p in runs.checkpoints_in(os.path.join(logdir, "epochs"))]


@needs_mnist
def test_kept_epochs_are_the_epoch_ends_and_survive_a_resume(tmp_path):
  """Three epochs of 10 steps kept at 1 and 3: epochs/ holds steps 10 and
  30, the weights of latest/ at those steps. A run trained one epoch without
  --keep_epochs and resumed with it writes epoch 1's on resuming (its
  checkpoint of that step is the same state), then epoch 3's."""
  whole = tmp_path / "whole"
  proc = train_here(*QUICK, "--epochs=3", "--keep_epochs=3,1", "--save_every=1000",
                    f"--logdir={whole}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert _epoch_checkpoints(whole) == [10, 30]
  ends = [r["step"] for r in map(json.loads, open(whole / "metrics.jsonl"))]
  assert ends == [10, 20, 30]
  assert weights_sha256(str(whole / "epochs" / "model.ckpt-30")) == weights_sha256(
      str(whole / "latest" / "model.ckpt-30"))
  split = tmp_path / "split"
  proc = train_here(*QUICK, "--epochs=1", "--save_every=1000", f"--logdir={split}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert not (split / "epochs").exists()
  proc = train_here(*QUICK, "--epochs=3", "--keep_epochs=1,3", "--save_every=1000",
                    f"--logdir={split}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert _epoch_checkpoints(split) == [10, 30]
  for step in (10, 30):
    assert weights_sha256(str(split / "epochs" / f"model.ckpt-{step}")) == weights_sha256(
        str(whole / "epochs" / f"model.ckpt-{step}"))
  # A resume that finds epochs/ written leaves it as it is.
  stamp = os.stat(split / "epochs" / "model.ckpt-30.index").st_mtime_ns
  proc = train_here(*QUICK, "--epochs=3", "--keep_epochs=1,3", "--save_every=1000",
                    f"--logdir={split}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert os.stat(split / "epochs" / "model.ckpt-30.index").st_mtime_ns == stamp
