"""Bad input refused in one line before anything is written: changed
settings on resume, unusable logdirs, data the model cannot take; and how
the programs import TensorFlow (its start-up notices, Keras held back)."""
import dataclasses
import os
import re
import subprocess
import sys

import pytest

from capsnet.model import network
from capsnet.running import runs
import config
from conftest import QUICK
from conftest import ROOT
from conftest import last_line
from conftest import needs_mnist
from conftest import train_here


@pytest.mark.integration
def test_tensorflow_imported_quietly_unless_asked_and_without_keras(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  args = [sys.executable, os.path.join(ROOT, "eval.py"), f"--checkpoint={tmp_path}/x"]
  proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env)
  assert proc.returncode == 1
  assert proc.stderr.splitlines() == [   # no start-up notices
      f"eval.py: error: {tmp_path}/x: no such checkpoint (expected {tmp_path}/x.index) "
      "or logdir"]
  script = ("import importlib.util, sys\n"
            "from capsnet.running import startup\n"
            "startup.import_tensorflow()\n"
            "import tensorflow as tf\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('keras', 'matplotlib')), importlib.util.find_spec('keras') is not None, "
            "tf.zeros([2]).shape)\n")
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        cwd=ROOT, env=dict(env, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="0"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.split("\n") == ["[] True (2,)", ""]   # keras still importable
  assert len(proc.stderr.splitlines()) > 1     # notices: the user asked for them


def _settings(**changes):
  values = dict(logdir="", dataset="mnist", data_dir="", download=False, val_size=500,
                train_size=320, epochs=2, max_steps=0, batch_size=32,
                eval_batch_size=300, learning_rate=0.001, decay_steps=2000,
                decay_rate=0.96, seed=0, device="/cpu:0", num_gpus=1,
                log_device_placement=False, save_every=5, summary_every=100,
                diag_every=0, val_every=0, progress=False, cluster=None, workers=1,
                sync=True, cluster_wait_secs=60, multimnist_shift=4, ema_decay=0.0,
                adopt_checkpoints=False)
  return config.Settings(**dict(values, **changes))


@pytest.mark.parametrize("field,value", [
    ("dataset", "fashion_mnist"), ("seed", 1), ("batch_size", 64), ("val_size", 0),
    ("train_size", 640), ("learning_rate", 0.01), ("decay_steps", 143),
    ("decay_rate", 0.9), ("workers", 2), ("sync", False), ("multimnist_shift", 6),
    ("ema_decay", 0.999)])
def test_other_training_settings_refused_on_resume(tmp_path, field, value):
  cfg = network.ModelConfig(**TINY_MODEL)
  s = _settings(logdir=str(tmp_path))
  s.write_config(cfg)
  before = (tmp_path / "config.json").read_text()
  with pytest.raises(ValueError, match=re.escape(
      f"{tmp_path}/config.json has {field}={getattr(s, field)!r}, the flags give "
      f"{value!r}: use another --logdir or the same value")):
    dataclasses.replace(s, **{field: value}).check_resume(runs.RunFolder(s.logdir), cfg)
  assert (tmp_path / "config.json").read_text() == before
  # --epochs and --max_steps may change, and so may precision and conv_impl.
  dataclasses.replace(s, epochs=5, max_steps=7).check_resume(
      runs.RunFolder(s.logdir), dataclasses.replace(cfg, precision="bf16", conv_impl="conv2d"))


TINY_MODEL = dict(conv1_channels=16, primary_types=4, primary_dim=4, digit_dim=8,
                  decoder_units=(32,))


def test_logdir_that_is_a_file_or_under_a_file(tmp_path):
  path = tmp_path / "file"
  path.write_text("x")
  with pytest.raises(ValueError, match=f"--logdir={path}: is a file, expected a folder"):
    runs.RunFolder(str(path)).check_writable()
  with pytest.raises(ValueError, match=f"--logdir={path}/run: {path} is a file, "
                     "expected a folder"):
    runs.RunFolder(str(path / "run")).check_writable()


def test_logdir_in_a_read_only_folder(small_disk):
  folder, remount = small_disk
  remount("ro")
  with pytest.raises(ValueError, match=re.escape(
      f"--logdir={folder}/run: cannot write in {folder} (Read-only file system)")):
    runs.RunFolder(str(folder / "run")).check_writable()


@needs_mnist
def test_image_size_the_data_does_not_have_leaves_nothing(tmp_path):
  logdir = tmp_path / "run"
  proc = train_here(*QUICK, "--image_size=32", f"--logdir={logdir}")
  assert proc.returncode == 1
  assert last_line(proc) == ("train.py: error: --dataset=mnist has 28x28x1 images, "
                             "the model takes 32x32x1 (--image_size, --image_channels)")
  assert not logdir.exists()
  proc = train_here(*QUICK, "--num_classes=5", f"--logdir={logdir}")
  assert last_line(proc) == ("train.py: error: --dataset=mnist has labels up to 9, the "
                             "model has --num_classes=5")
  assert not logdir.exists()


def test_each_settings_field_made_by_flag_is_one_flag_with_its_bounds():
  """config.Settings' and eval.py's Settings' fields made by config.flag are
  their programs' flags (one list), with their kinds, defaults and bounds."""
  from absl import flags

  import eval as eval_py
  fv = flags.FlagValues()
  config.define_flags_of(config.Settings, fv)
  made = {f.name for f in dataclasses.fields(config.Settings) if "flag" in f.metadata}
  assert set(fv) == made and {"epochs", "keep_epochs", "sync", "replan", "dataset",
                              "val_size"} <= made
  assert not made & {"cluster", "workers", "precision_auto"}
  fv(["train.py", "--keep_epochs=1,5", "--epochs=3", "--nosync"])
  assert (fv.keep_epochs, fv.epochs, fv.sync, fv.logdir) == (["1", "5"], 3, False,
                                                             "logs/run")
  assert (fv.dataset, fv.val_size, fv.multimnist_shift) == ("mnist", 5000, 4)
  for name, bad in (("epochs", "0"), ("ema_decay", "1.0"), ("cluster_wait_secs", "0"),
                    ("val_size", "-1"), ("multimnist_shift", "17"), ("dataset", "cifar")):
    with pytest.raises(flags.IllegalFlagValueError):
      fv[name].parse(bad)
  fv = flags.FlagValues()
  config.define_flags_of(eval_py.Settings, fv)
  assert fv["which"].default == "best" and fv["affine_sweep"].default == []
  assert fv["dataset"].default is None and fv["download"].default is True
  with pytest.raises(flags.IllegalFlagValueError):
    fv["which"].parse("newest")
