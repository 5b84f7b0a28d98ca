"""Damaged checkpoints and what eval.py checks before it scores; one small
trained run shared by the tests. A run is never lost or mixed."""
import glob
import json
import os
import re
import shutil

import pytest
import tensorflow as tf

from capsnet.running import runs
from conftest import QUICK
from conftest import eval_here
from conftest import last_line
from conftest import listed
from conftest import needs_mnist
from conftest import rows
from conftest import train_here


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  """Two epochs (20 steps), a latest checkpoint every 5 steps; the model
  asked for on /gpu:0, which this machine does not have."""
  logdir = str(tmp_path_factory.mktemp("quick") / "run")
  proc = train_here(*QUICK, f"--logdir={logdir}", "--epochs=2", "--save_every=5",
                    "--device=/gpu:0")
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
  proc = train_here(*QUICK, f"--logdir={logdir}", "--epochs=2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout.splitlines()
  assert any(re.fullmatch(rf"{latest}/model\.ckpt-20: damaged \(.+\); passed over", line)
             for line in out), out
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
  proc = train_here(*QUICK, f"--logdir={logdir}", "--epochs=3")
  assert proc.returncode == 1
  assert last_line(proc) == (f"train.py: error: {logdir}: no intact checkpoint "
                             "(3 damaged); move the logdir away to start again")
  assert sorted(glob.glob(os.path.join(logdir, "**"), recursive=True)) == before
  proc = eval_here(f"--checkpoint={logdir}")
  assert proc.returncode == 1
  best = tf.train.latest_checkpoint(os.path.join(logdir, "best")) or "?"
  assert re.fullmatch(rf"eval\.py: error: {best}: damaged checkpoint \(.+\)",
                      last_line(proc)), last_line(proc)


@needs_mnist
def test_eval_output_folder_not_writable_found_before_scoring(quick_run, small_disk):
  folder, remount = small_disk
  remount("ro")
  proc = eval_here(f"--checkpoint={quick_run[0]}", f"--out_dir={folder}/eval")
  assert proc.returncode == 1
  assert last_line(proc) == (f"eval.py: error: --out_dir={folder}/eval: cannot write "
                             "there (Read-only file system)")
  assert "checkpoint:" not in proc.stdout      # nothing was scored


@needs_mnist
def test_eval_validation_split_of_a_run_without_one(quick_run, tmp_path):
  logdir = copy_of(quick_run, tmp_path)
  path = os.path.join(logdir, "config.json")
  saved = json.load(open(path))
  saved["train"]["val_size"] = 0
  open(path, "w").write(json.dumps(saved))
  proc = eval_here(f"--checkpoint={logdir}", "--split=validation")
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
  proc = train_here(*QUICK, f"--logdir={logdir}", "--epochs=3")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"Resuming from {latest}/model.ckpt-20" in proc.stdout
  assert [(r["epoch"], r["step"]) for r in rows(logdir)] == [(1, 10), (2, 20), (3, 30)]
  # The run supersedes 15 and 20: latest/ holds what its Saver keeps, no more.
  names = sorted(n for n in os.listdir(latest) if n.endswith(".index"))
  assert names == ["model.ckpt-20.index", "model.ckpt-30.index"]
