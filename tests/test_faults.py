"""Faults and bad input: damaged checkpoints, changed settings on resume,
file-system errors, interrupts and kills. A run is never lost or mixed."""
import dataclasses
import glob
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import train
from capsnet import model
from capsnet import runs
from conftest import ROOT, SMALL, cli, last_line, needs_mnist
from test_regression import _weights_sha256

# 320 training images of 32: 10 steps an epoch.
QUICK = [*SMALL, "--train_size=320"]
TIMING = ("wall_s", "images_per_sec")


def rows(logdir, name="metrics.jsonl"):
  with open(os.path.join(logdir, name)) as f:
    return [json.loads(l) for l in f if l.strip()]


def listed(folder):
  """The checkpoints a `checkpoint` file lists, each of which must load."""
  state = tf.compat.v1.train.get_checkpoint_state(folder)
  return [os.path.join(folder, os.path.basename(p))
          for p in (state.all_model_checkpoint_paths if state else [])]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  """Two epochs (20 steps), a latest checkpoint every 5 steps; the model
  asked for on /gpu:0, which this machine does not have."""
  logdir = str(tmp_path_factory.mktemp("quick") / "run")
  proc = cli("train.py", *QUICK, f"--logdir={logdir}", "--epochs=2", "--save_every=5",
             "--device=/gpu:0", tf_log_level=None)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return logdir, proc


def copy_of(quick_run, tmp_path, name="copy"):
  target = str(tmp_path / name)
  shutil.copytree(quick_run[0], target)
  return target


@needs_mnist
def test_gpu_asked_for_without_one_says_so_in_one_line(quick_run):
  if tf.config.list_physical_devices("GPU"):
    pytest.skip("this machine has a GPU")
  _, proc = quick_run
  assert proc.stdout.splitlines()[0] == (
      "train.py: TensorFlow sees no GPU: the model runs on /cpu:0 instead of /gpu:0")
  assert len(proc.stdout.splitlines()) < 10 and not proc.stderr.strip()


def test_tensorflow_start_up_notices_hidden_unless_asked_for(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  args = [sys.executable, os.path.join(ROOT, "eval.py"), f"--checkpoint={tmp_path}/x"]
  proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env)
  assert proc.returncode == 1
  assert proc.stderr.splitlines() == [
      f"eval.py: error: {tmp_path}/x: no such checkpoint (expected {tmp_path}/x.index) "
      "or logdir"]
  proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT,
                        env=dict(env, TF_CPP_MIN_LOG_LEVEL="0"))
  assert len(proc.stderr.splitlines()) > 1     # the user asked for them


@needs_mnist
@pytest.mark.parametrize("damage", ["index missing", "data truncated"])
def test_damaged_newest_checkpoint_falls_back_to_an_intact_one(quick_run, tmp_path, damage):
  logdir = copy_of(quick_run, tmp_path)
  latest = os.path.join(logdir, "latest")
  assert [runs.step_of(p) for p in listed(latest)] == [15, 20]
  if damage == "index missing":
    os.remove(os.path.join(latest, "model.ckpt-20.index"))
  else:
    (data_file,) = glob.glob(os.path.join(latest, "model.ckpt-20.data-*"))
    with open(data_file, "r+b") as f:
      f.truncate(os.path.getsize(data_file) // 2)
  best_before = sorted(os.listdir(os.path.join(logdir, "best")))
  proc = cli("train.py", *QUICK, f"--logdir={logdir}", "--epochs=2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout.splitlines()
  assert any(re.fullmatch(rf"{latest}/model\.ckpt-20: damaged \(.+\); passed over", l)
             for l in out), out
  # The newest intact one: latest's 15, or best's if that is newer.
  best = listed(os.path.join(logdir, "best"))[-1]
  expected = best if runs.step_of(best) > 15 else f"{latest}/model.ckpt-15"
  assert f"Resuming from {expected}" in out
  assert sorted(os.listdir(os.path.join(logdir, "best"))) == best_before
  assert [(r["epoch"], r["step"]) for r in rows(logdir)] == [(1, 10), (2, 20)]
  for prefix in listed(latest) + listed(os.path.join(logdir, "best")):
    assert runs.damage(prefix) is None, prefix


@needs_mnist
def test_no_intact_checkpoint_stops_in_one_line_and_deletes_nothing(quick_run, tmp_path):
  logdir = copy_of(quick_run, tmp_path)
  for index in glob.glob(os.path.join(logdir, "*", "model.ckpt-*.index")):
    with open(index, "r+b") as f:
      f.truncate(10)
  before = sorted(glob.glob(os.path.join(logdir, "**"), recursive=True))
  proc = cli("train.py", *QUICK, f"--logdir={logdir}", "--epochs=3")
  assert proc.returncode == 1
  assert last_line(proc) == (f"train.py: error: {logdir}: no intact checkpoint "
                             "(3 damaged); move the logdir away to start again")
  assert sorted(glob.glob(os.path.join(logdir, "**"), recursive=True)) == before
  proc = cli("eval.py", f"--checkpoint={logdir}")
  assert proc.returncode == 1
  best = tf.train.latest_checkpoint(os.path.join(logdir, "best")) or "?"
  assert re.fullmatch(rf"eval\.py: error: {best}: damaged checkpoint \(.+\)",
                      last_line(proc)), last_line(proc)


def _settings(**changes):
  values = dict(logdir="", dataset="mnist", data_dir="", download=False, val_size=500,
                train_size=320, epochs=2, max_steps=0, batch_size=32,
                eval_batch_size=300, learning_rate=0.001, decay_steps=2000,
                decay_rate=0.96, seed=0, device="/cpu:0", num_gpus=1,
                log_device_placement=False, save_every=5, summary_every=100,
                diag_every=0, val_every=0, progress=False)
  return train.Settings(**dict(values, **changes))


@pytest.mark.parametrize("field,value", [
    ("dataset", "fashion_mnist"), ("seed", 1), ("batch_size", 64), ("val_size", 0),
    ("train_size", 640), ("learning_rate", 0.01), ("decay_steps", 143),
    ("decay_rate", 0.9)])
def test_other_training_settings_refused_on_resume(tmp_path, field, value):
  cfg = model.ModelConfig(**TINY_MODEL)
  s = _settings(logdir=str(tmp_path))
  train.write_config(str(tmp_path), cfg, s)
  before = (tmp_path / "config.json").read_text()
  with pytest.raises(ValueError, match=re.escape(
      f"{tmp_path}/config.json has {field}={getattr(s, field)!r}, the flags give "
      f"{value!r}: use another --logdir or the same value")):
    train.check_logdir(str(tmp_path), cfg, dataclasses.replace(s, **{field: value}))
  assert (tmp_path / "config.json").read_text() == before
  # --epochs and --max_steps may change, and so may precision and conv_impl.
  train.check_logdir(str(tmp_path), dataclasses.replace(cfg, precision="bf16",
                                                        conv_impl="conv2d"),
                     dataclasses.replace(s, epochs=5, max_steps=7))


TINY_MODEL = dict(conv1_channels=16, primary_types=4, primary_dim=4, digit_dim=8,
                  decoder_units=(32,))


def test_logdir_that_is_a_file_or_under_a_file(tmp_path):
  cfg, path = model.ModelConfig(), tmp_path / "file"
  path.write_text("x")
  with pytest.raises(ValueError, match=f"--logdir={path}: is a file, expected a folder"):
    train.check_logdir(str(path), cfg, _settings())
  with pytest.raises(ValueError, match=f"--logdir={path}/run: {path} is a file, "
                     "expected a folder"):
    train.check_logdir(str(path / "run"), cfg, _settings())


@pytest.fixture
def small_disk(tmp_path):
  """A tmpfs folder (needs mount rights, as root in CI); yields a function
  that remounts it with other options."""
  folder = tmp_path / "mnt"
  folder.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)],
                    capture_output=True).returncode:
    pytest.skip("cannot mount a tmpfs here")
  remount = lambda opts: subprocess.run(
      ["mount", "-o", f"remount,{opts}", str(folder)], check=True)
  yield folder, remount
  subprocess.run(["umount", str(folder)])


def test_logdir_in_a_read_only_folder(small_disk):
  folder, remount = small_disk
  remount("ro")
  with pytest.raises(ValueError, match=re.escape(
      f"--logdir={folder}/run: cannot write in {folder} (Read-only file system)")):
    train.check_logdir(str(folder / "run"), model.ModelConfig(), _settings())


@needs_mnist
def test_full_disk_while_saving_ends_in_one_line_and_listed_checkpoints_load(small_disk):
  folder, _ = small_disk
  logdir = str(folder / "run")
  proc = cli("train.py", *QUICK, f"--logdir={logdir}", "--epochs=50", "--save_every=1",
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


@needs_mnist
def test_eval_output_folder_not_writable_found_before_scoring(quick_run, small_disk):
  folder, remount = small_disk
  remount("ro")
  proc = cli("eval.py", f"--checkpoint={quick_run[0]}", f"--out_dir={folder}/eval")
  assert proc.returncode == 1
  assert last_line(proc) == (f"eval.py: error: --out_dir={folder}/eval: cannot write "
                             "there (Read-only file system)")
  assert "checkpoint:" not in proc.stdout      # nothing was scored


@needs_mnist
def test_image_size_the_data_does_not_have_leaves_nothing(tmp_path):
  logdir = tmp_path / "run"
  proc = cli("train.py", *QUICK, "--image_size=32", f"--logdir={logdir}")
  assert proc.returncode == 1
  assert last_line(proc) == ("train.py: error: --dataset=mnist has 28x28x1 images, "
                             "the model takes 32x32x1 (--image_size, --image_channels)")
  assert not logdir.exists()
  proc = cli("train.py", *QUICK, "--num_classes=5", f"--logdir={logdir}")
  assert last_line(proc) == ("train.py: error: --dataset=mnist has labels up to 9, the "
                             "model has --num_classes=5")
  assert not logdir.exists()


@needs_mnist
def test_eval_validation_split_of_a_run_without_one(quick_run, tmp_path):
  logdir = copy_of(quick_run, tmp_path)
  path = os.path.join(logdir, "config.json")
  saved = json.load(open(path))
  saved["train"]["val_size"] = 0
  open(path, "w").write(json.dumps(saved))
  proc = cli("eval.py", f"--checkpoint={logdir}", "--split=validation")
  assert proc.returncode == 1
  assert last_line(proc) == (f"eval.py: error: --split=validation: {logdir} was "
                             "trained with --val_size=0, so it has no validation split")


@needs_mnist
def test_resume_of_a_checkpoint_without_the_epoch_sums(quick_run, tmp_path):
  """Checkpoints written before the epoch sums existed still resume, the
  sums starting at zero, and such a best checkpoint is tested at the end;
  the older checkpoints the run supersedes go."""
  logdir = copy_of(quick_run, tmp_path)
  latest = os.path.join(logdir, "latest")
  for prefix in listed(latest) + listed(os.path.join(logdir, "best")):
    reader = tf.train.load_checkpoint(prefix)
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
      old = [tf.Variable(reader.get_tensor(n), name=n)
             for n in reader.get_variable_to_shape_map() if "epoch_" not in n
             or n == "state/epoch_examples"]
      sess.run(tf.compat.v1.global_variables_initializer())
      tf.compat.v1.train.Saver(old).save(sess, prefix, write_meta_graph=False,
                                         write_state=False)
    assert "state/epoch_loss_sum" not in tf.train.load_checkpoint(prefix) \
        .get_variable_to_shape_map()
  proc = cli("train.py", *QUICK, f"--logdir={logdir}", "--epochs=3")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"Resuming from {latest}/model.ckpt-20" in proc.stdout
  assert [(r["epoch"], r["step"]) for r in rows(logdir)] == [(1, 10), (2, 20), (3, 30)]
  # The run supersedes 15 and 20: latest/ holds what its Saver keeps, no more.
  names = sorted(n for n in os.listdir(latest) if n.endswith(".index"))
  assert names == ["model.ckpt-20.index", "model.ckpt-30.index"]


def test_second_ctrl_c_waits_for_the_checkpoint_being_written():
  stop = train.StopRequest()
  stop(signal.SIGINT, None)
  assert stop.requested
  with pytest.raises(KeyboardInterrupt):
    with stop.deferred():
      stop(signal.SIGINT, None)          # during the save: no exception here
      finished = True                    # ...so the save completes
  assert finished
  with pytest.raises(KeyboardInterrupt):
    stop(signal.SIGINT, None)            # outside a save: at once


@needs_mnist
def test_ctrl_c_twice_no_traceback_and_listed_checkpoints_load(tmp_path):
  logdir = str(tmp_path / "run")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
  proc = subprocess.Popen(
      [sys.executable, os.path.join(ROOT, "train.py"), *QUICK, f"--logdir={logdir}",
       "--epochs=50", "--save_every=1"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
  deadline = time.time() + 120
  while not os.path.exists(os.path.join(logdir, "latest")) and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGINT)
  time.sleep(0.02)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err[-3000:]
  assert "Traceback" not in err
  for prefix in listed(os.path.join(logdir, "latest")):
    assert runs.damage(prefix) is None, prefix


@needs_mnist
def test_sigkill_at_random_moments_changes_nothing(tmp_path):
  """A run killed (SIGKILL) several times, once while writing a checkpoint,
  and resumed each time ends with the uninterrupted run's weights, bit for
  bit, and its metrics rows (timing aside)."""
  args = [*QUICK, "--epochs=3", "--save_every=1", "--summary_every=1000"]
  reference = str(tmp_path / "reference")
  proc = cli("train.py", *args, f"--logdir={reference}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  logdir = str(tmp_path / "killed")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
  rng = random.Random(0)
  kills = 0
  for attempt in range(4):
    start = _latest_step(logdir)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args,
                             f"--logdir={logdir}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
    deadline = time.time() + 120
    if attempt == 0:   # while a checkpoint is being written
      done = lambda: glob.glob(os.path.join(logdir, "latest", "*temp*"))
    else:              # a few steps on, at a random moment of a step
      target = start + rng.randint(2, 6)
      done = lambda: _latest_step(logdir) >= target
    while not done() and time.time() < deadline and proc.poll() is None:
      time.sleep(0.001)
    time.sleep(0 if attempt == 0 else rng.uniform(0.0, 0.05))
    if proc.poll() is None:
      proc.kill()
      kills += 1
    proc.wait()
  assert kills >= 3
  proc = cli("train.py", *args, f"--logdir={logdir}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  ckpt = lambda d: tf.train.latest_checkpoint(os.path.join(d, "latest"))
  assert ckpt(logdir).endswith("-30") and ckpt(reference).endswith("-30")
  assert _weights_sha256(ckpt(logdir)) == _weights_sha256(ckpt(reference))
  strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING} for r in rs]
  assert strip(rows(logdir)) == strip(rows(reference))
  test = lambda d: json.load(open(os.path.join(d, "test_results.json")))
  assert os.path.basename(test(logdir)["checkpoint"]) == os.path.basename(
      test(reference)["checkpoint"]), (rows(logdir), rows(reference))
  assert test(logdir)["accuracy"] == test(reference)["accuracy"]
  np.testing.assert_equal(test(logdir)["confusion"], test(reference)["confusion"])


def _latest_step(logdir):
  try:
    with open(os.path.join(logdir, "latest", "checkpoint")) as f:
      return runs.step_of(f.readline().split('"')[1])
  except (OSError, IndexError, ValueError):
    return 0
