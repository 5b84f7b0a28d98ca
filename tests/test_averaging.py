"""Weight averaging (--ema_decay): the raw trajectory unchanged, the moving
average's update, the choice of weights by validation, and its readers."""
import json
import os

from absl import flags
import numpy as np
import pytest
import tensorflow as tf

from capsnet import pretrained
from capsnet.running import runs
from conftest import FLOAT64_WEIGHTS_SHA256
from conftest import QUICK
from conftest import eval_here
from conftest import last_line
from conftest import needs_mnist
from conftest import train_here
from conftest import weights_sha256


def _model_tensors(ckpt, suffix=""):
  reader = tf.train.load_checkpoint(ckpt)
  return {n[:len(n) - len(suffix)]: reader.get_tensor(n)
          for n in reader.get_variable_to_shape_map()
          if n.startswith("capsnet/") and "Adam" not in n and n.endswith(suffix)
          and (suffix or not n.endswith(runs.AVERAGE_SUFFIX))}


@needs_mnist
def test_weight_averaging(tmp_path):
  # The regression run's flags (tests/test_regression.py), with averaging.
  averaged = str(tmp_path / "ema")
  proc = train_here(*QUICK, "--dtype=float64", "--max_steps=12", "--save_every=11",
                    "--ema_decay=0.5", f"--logdir={averaged}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  def latest(d, step):
    return os.path.join(d, "latest", f"model.ckpt-{step}")
  # The raw weights are the regression run's, bit for bit: its recorded sha256.
  assert weights_sha256(latest(averaged, 12)) == FLOAT64_WEIGHTS_SHA256
  raw = _model_tensors(latest(averaged, 12))
  assert len(raw) == 9
  # The average's update at step 12: decay min(0.5, 13 / 22) = 0.5 of the
  # step-11 average plus 0.5 of the step-12 weights (checkpoints at step 11,
  # --save_every, and 12, where --max_steps stops).
  before = _model_tensors(latest(averaged, 11), runs.AVERAGE_SUFFIX)
  after = _model_tensors(latest(averaged, 12), runs.AVERAGE_SUFFIX)
  assert sorted(after) == sorted(raw)
  for name in raw:
    np.testing.assert_allclose(after[name], 0.5 * before[name] + 0.5 * raw[name],
                               rtol=1e-12, err_msg=name)
    assert not np.array_equal(after[name], raw[name])
  # Validation scores both; the best checkpoint is the better of the two.
  rows = [json.loads(line) for line in open(os.path.join(averaged, "metrics.jsonl"))]
  assert [r["step"] for r in rows] == [10]
  for r in rows:
    assert {"val_error_percent", "val_error_percent_averaged", "val_loss_averaged",
            "val_accuracy_averaged"} <= set(r)
  test = json.load(open(os.path.join(averaged, "test_results.json")))
  best = test["checkpoint"]
  reader = tf.train.load_checkpoint(best)
  best_row = rows[[r["step"] for r in rows].index(runs.step_of(best))]
  won = best_row["val_accuracy_averaged"] > best_row["val_accuracy"]
  assert test["weights"] == ("averaged" if won else "raw") == runs.chosen_weights(best)
  assert bool(reader.get_tensor("state/best_averaged")) == won
  np.testing.assert_allclose(reader.get_tensor("state/best_val_accuracy"), max(
      max(r["val_accuracy"], r["val_accuracy_averaged"]) for r in rows), rtol=1e-6)
  # eval.py scores the chosen weights by default, either on request (on the
  # validation split, whose figures metrics.jsonl has).
  results = {}
  for weights in ("auto", "raw", "averaged"):
    out = str(tmp_path / f"eval_{weights}")
    proc = eval_here(f"--checkpoint={averaged}", f"--weights={weights}", f"--out_dir={out}",
                     "--split=validation", "--num_images=2", "--figure4_images=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results[weights] = json.load(open(os.path.join(out, "results.json")))
  assert results["auto"]["weights"] == test["weights"]
  assert results["raw"]["accuracy"] == best_row["val_accuracy"]
  assert results["averaged"]["accuracy"] == best_row["val_accuracy_averaged"]
  assert results["raw"]["weights"] == "raw" and results["averaged"]["weights"] == "averaged"
  assert results["raw"]["loss"] != results["averaged"]["loss"]
  # Shipped weights: the chosen ones, under the model's names.
  prefix = pretrained.ship(averaged, str(tmp_path / "shipped"))
  shipped = _model_tensors(prefix)
  chosen = _model_tensors(best, runs.AVERAGE_SUFFIX if won else "")
  assert sorted(shipped) == sorted(raw)
  for name in shipped:
    np.testing.assert_array_equal(shipped[name], chosen[name].astype(np.float32))
  config = json.load(open(tmp_path / "shipped" / "config.json"))
  assert config["shipped_from"]["weights"] == test["weights"]


@needs_mnist
def test_averaging_stays_as_the_run_started(tmp_path):
  """A run without weight averaging has no averaged weights to evaluate, and
  one recorded without it (config.json from before it existed) refuses it
  on resume; an out-of-range decay is refused."""
  logdir = str(tmp_path / "run")
  assert train_here(*QUICK, "--max_steps=3", f"--logdir={logdir}").returncode == 0
  proc = eval_here(f"--checkpoint={logdir}", "--which=latest", "--weights=averaged",
                   f"--out_dir={tmp_path / 'x'}")
  assert proc.returncode != 0 and last_line(proc).endswith(
      "--weights=averaged, but the run kept no averaged weights (it trained "
      "without --ema_decay)")
  path = os.path.join(logdir, "config.json")
  saved = json.load(open(path))
  del saved["train"]["ema_decay"]
  open(path, "w").write(json.dumps(saved))
  proc = train_here(*QUICK, "--max_steps=6", "--ema_decay=0.999", f"--logdir={logdir}")
  assert proc.returncode != 0
  assert last_line(proc) == (f"train.py: error: {path} has ema_decay=0.0, the flags "
                             "give 0.999: use another --logdir or the same value")
  with pytest.raises(flags.IllegalFlagValueError, match="--ema_decay=1.5: 1.5 is not "
                     "a number in the range"):
    train_here(*QUICK, "--ema_decay=1.5", f"--logdir={logdir}")
