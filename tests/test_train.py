"""train.py and eval.py through their command lines, towers and placement.

The CLI tests train a small CapsNet on real MNIST from data/mnist (.ci/run
seeds it from ../shared) for a few dozen steps.
"""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from capsnet import model
from conftest import ROOT, TINY

MNIST = os.path.join(ROOT, "data", "mnist")
needs_mnist = pytest.mark.skipif(
    not os.path.isdir(MNIST) or len(glob.glob(os.path.join(MNIST, "*.gz"))) < 4,
    reason=f"real MNIST files not in {MNIST} (.ci/run seeds them)")

SMALL = ["--conv1_channels=16", "--primary_types=4", "--primary_dim=4",
         "--digit_dim=8", "--decoder_units=32", "--batch_size=32",
         "--val_size=500", "--eval_batch_size=300", "--progress=false",
         f"--data_dir={MNIST}", "--download=false"]


def cli(script, *args, timeout=300, **kwargs):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, os.path.join(ROOT, script), *args],
                        capture_output=True, text=True, timeout=timeout, env=env,
                        cwd=ROOT, **kwargs)


def last_line(proc):
  lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
  return lines[-1] if lines else ""


def scalars(logdir, tag):
  values = []
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.*"))):
    for event in tf.compat.v1.train.summary_iterator(path):
      for v in event.summary.value:
        if v.tag == tag:
          values.append((event.step, v.simple_value))
  return sorted(values)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """One epoch of 50 steps on 1,600 images with two towers on the CPU."""
  logdir = str(tmp_path_factory.mktemp("run"))
  proc = cli("train.py", *SMALL, f"--logdir={logdir}", "--epochs=1",
             "--train_size=1600", "--learning_rate=0.01", "--summary_every=5",
             "--num_gpus=2", "--device=/cpu:0", "--diag_every=25")
  assert proc.returncode == 0, proc.stderr[-3000:]
  return logdir, proc


@needs_mnist
def test_training_writes_everything_and_learns(run_dir):
  logdir, proc = run_dir
  for name in ("config.json", "metrics.jsonl", "test_results.json",
               "diagnostics.jsonl", "latest/checkpoint", "best/checkpoint"):
    assert os.path.exists(os.path.join(logdir, name)), name
  assert glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
  assert tf.train.latest_checkpoint(os.path.join(logdir, "latest")).endswith("-50")
  rows = [json.loads(l) for l in open(os.path.join(logdir, "metrics.jsonl"))]
  assert [(r["epoch"], r["step"]) for r in rows] == [(1, 50)]
  assert 0.0 <= rows[0]["val_error_percent"] <= 100.0
  test = json.load(open(os.path.join(logdir, "test_results.json")))
  assert test["count"] == 10000 and test["split"] == "test"
  assert "test (" in proc.stdout and "validation accuracy" in proc.stdout
  cfg = json.load(open(os.path.join(logdir, "config.json")))
  assert cfg["model"]["primary_types"] == 4 and cfg["train"]["batch_size"] == 32
  losses = scalars(logdir, "loss/total")
  assert [s for s, _ in losses] == list(range(5, 51, 5))
  assert losses[-1][1] < 0.75 * losses[0][1], losses
  entropy = scalars(logdir, "routing/entropy_iter_0")
  np.testing.assert_allclose(entropy[0][1], np.log(10), rtol=1e-5)  # uniform c
  assert scalars(logdir, "routing/entropy_iter_2")[-1][1] < np.log(10)
  diag = [json.loads(l) for l in open(os.path.join(logdir, "diagnostics.jsonl"))]
  assert [d["step"] for d in diag] == [1, 25, 50]
  assert all(0 < d["digit_caps/weights"] < 2 for d in diag)


@needs_mnist
def test_resume_continues_step_and_optimizer_state(run_dir, tmp_path):
  logdir, _ = run_dir
  resumed = str(tmp_path / "resumed")
  shutil.copytree(logdir, resumed)
  proc = cli("train.py", *SMALL, f"--logdir={resumed}", "--epochs=2",
             "--train_size=1600", "--learning_rate=0.01", "--num_gpus=2",
             "--device=/cpu:0")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Resuming from" in proc.stdout
  ckpt = tf.train.latest_checkpoint(os.path.join(resumed, "latest"))
  assert ckpt.endswith("-100")
  reader = tf.train.load_checkpoint(ckpt)
  # Adam's beta1 power is 0.9^(steps + 1): 100 steps, not 50 after a re-init.
  np.testing.assert_allclose(reader.get_tensor("beta1_power"), 0.9 ** 101, rtol=1e-4)
  assert reader.get_tensor("state/epoch") == 2
  rows = [json.loads(l) for l in open(os.path.join(resumed, "metrics.jsonl"))]
  assert [(r["epoch"], r["step"]) for r in rows] == [(1, 50), (2, 100)]


@needs_mnist
def test_refuses_logdir_of_another_architecture(run_dir):
  logdir, _ = run_dir
  before = sorted(os.listdir(os.path.join(logdir, "latest")))
  proc = cli("train.py", *SMALL, "--primary_types=8", f"--logdir={logdir}")
  assert proc.returncode != 0
  assert last_line(proc) == (
      f"train.py: error: {logdir}/config.json has primary_types=4, the flags give 8: "
      "use another --logdir or the same value")
  assert sorted(os.listdir(os.path.join(logdir, "latest"))) == before


@needs_mnist
def test_nan_loss_stops_without_touching_checkpoints(run_dir, tmp_path):
  logdir = str(tmp_path / "nan")
  shutil.copytree(run_dir[0], logdir)
  latest = os.path.join(logdir, "latest")
  before = {f: open(os.path.join(latest, f), "rb").read() for f in os.listdir(latest)}
  proc = cli("train.py", *SMALL, f"--logdir={logdir}", "--epochs=2",
             "--train_size=1600", "--learning_rate=1e12", "--num_gpus=2",
             "--device=/cpu:0")
  assert proc.returncode != 0
  assert "train.py: error: loss is nan at step" in last_line(proc)
  assert "stopped without saving" in last_line(proc)
  after = {f: open(os.path.join(latest, f), "rb").read() for f in os.listdir(latest)}
  assert after == before


@needs_mnist
def test_eval_cli_scores_every_image_and_writes_files(run_dir, tmp_path):
  logdir, _ = run_dir
  out = str(tmp_path / "eval")
  proc = cli("eval.py", f"--checkpoint={logdir}", "--batch_size=300",
             f"--out_dir={out}", "--iter_routing=2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.load(open(os.path.join(out, "results.json")))
  assert res["count"] == 10000 and res["iter_routing"] == 2
  assert sum(map(sum, res["confusion"])) == 10000
  lines = open(os.path.join(out, "predictions.csv")).read().splitlines()
  assert len(lines) == 10001 and lines[0].startswith("index,label,prediction,length_0")
  preds = np.array([int(l.split(",")[2]) for l in lines[1:]])
  labels = np.array([int(l.split(",")[1]) for l in lines[1:]])
  np.testing.assert_allclose(res["accuracy"], np.mean(preds == labels))
  with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
    recon = sess.run(tf.io.decode_png(open(os.path.join(out, "reconstructions.png"), "rb").read()))
    fig4 = sess.run(tf.io.decode_png(open(os.path.join(out, "figure4.png"), "rb").read()))
  assert recon.shape == (4 * 30 - 2, 8 * 30 - 2, 1)       # 16 pairs, 8 columns
  assert fig4.shape == (8 * 30 - 2, 3 * (11 * 30 - 2) + 2 * 8, 1)  # 8 dims x 11
  assert "error" in proc.stdout and "confusion matrix" in proc.stdout


@needs_mnist
def test_eval_latest_of_a_checkpoint_prefix(run_dir, tmp_path):
  logdir, _ = run_dir
  ckpt = tf.train.latest_checkpoint(os.path.join(logdir, "latest"))
  proc = cli("eval.py", f"--checkpoint={ckpt}", f"--out_dir={tmp_path}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.load(open(tmp_path / "results.json"))["checkpoint"] == ckpt


@needs_mnist
def test_eval_errors(tmp_path, run_dir):
  logdir, _ = run_dir
  missing = str(tmp_path / "nothing")
  proc = cli("eval.py", f"--checkpoint={missing}")
  assert proc.returncode != 0
  assert last_line(proc) == (f"eval.py: error: {missing}: no such checkpoint "
                             f"(expected {missing}.index) or logdir")
  empty = tmp_path / "empty"
  empty.mkdir()
  proc = cli("eval.py", f"--checkpoint={empty}")
  assert proc.returncode != 0
  assert last_line(proc) == (f"eval.py: error: {empty}: no checkpoint in "
                             f"{empty}/best (try --which=latest)")
  other = tmp_path / "other"
  shutil.copytree(logdir, other)
  cfg = json.load(open(other / "config.json"))
  cfg["model"]["digit_dim"] = 6
  (other / "config.json").write_text(json.dumps(cfg))
  proc = cli("eval.py", f"--checkpoint={other}")
  assert proc.returncode != 0
  assert last_line(proc).startswith(f"eval.py: error: {other}/best/model.ckpt-50: "
                                    "checkpoint of another architecture: ")
  assert "in the checkpoint" in last_line(proc)
  (other / "config.json").write_text('{"model": {"conv1_chan')
  proc = cli("eval.py", f"--checkpoint={other}")
  assert proc.returncode != 0
  assert last_line(proc).startswith(f"eval.py: error: {other}/config.json: "
                                    "not a valid config.json")


def test_train_flag_and_data_errors(tmp_path):
  proc = cli("train.py", "--iter_routing=0", f"--logdir={tmp_path}/a")
  assert proc.returncode != 0
  assert last_line(proc) == ("train.py: error: ModelConfig.iter_routing must be "
                             "a positive int, got 0")
  assert not os.path.exists(f"{tmp_path}/a")
  proc = cli("train.py", "--decoder_units=512,x", f"--logdir={tmp_path}/a")
  assert proc.returncode != 0
  assert last_line(proc) == ("train.py: error: ModelConfig.decoder_units must be "
                             "positive ints, got ['512', 'x']")
  proc = cli("train.py", "--m_minus=0.95", f"--logdir={tmp_path}/a")
  assert last_line(proc) == ("train.py: error: ModelConfig.m_minus must be in "
                             "[0, m_plus), got 0.95")
  proc = cli("train.py", f"--data_dir={tmp_path}/none", "--download=false",
             f"--logdir={tmp_path}/a")
  assert proc.returncode != 0
  assert last_line(proc).startswith(
      f"train.py: error: missing train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
      f"t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz in {tmp_path}/none: "
      "downloads are off")
  assert not os.path.exists(f"{tmp_path}/a")


@needs_mnist
def test_sigint_saves_a_loadable_checkpoint(tmp_path):
  logdir = str(tmp_path / "sigint")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
  proc = subprocess.Popen(
      [sys.executable, os.path.join(ROOT, "train.py"), *SMALL, f"--logdir={logdir}",
       "--epochs=50", "--summary_every=1"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
  deadline = time.time() + 120
  while not glob.glob(os.path.join(logdir, "events.out.*")) and time.time() < deadline:
    time.sleep(0.5)
  time.sleep(3)   # well into the first epoch
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err[-3000:]
  assert "run again with" in out
  ckpt = tf.train.latest_checkpoint(os.path.join(logdir, "latest"))
  assert ckpt is not None
  step = int(ckpt.rsplit("-", 1)[1])
  assert 0 < step < 59500 // 32         # saved part-way through epoch 1
  reader = tf.train.load_checkpoint(ckpt)
  assert reader.get_tensor("state/epoch_examples") == 32 * step
  proc = cli("eval.py", f"--checkpoint={logdir}", "--which=latest",
             f"--out_dir={tmp_path}/eval")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.load(open(tmp_path / "eval" / "results.json"))["count"] == 10000


def _tower_graph(devices, cfg):
  rng = np.random.RandomState(0)
  images = tf.constant(rng.rand(4, cfg.image_size, cfg.image_size, 1))
  labels = tf.constant([0, 1, 2, 1])
  opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
  grads, outs = model.tower_gradients(images, labels, cfg, opt, devices)
  return grads, outs


def test_two_towers_same_variables_and_full_batch_gradient():
  cfg = model.ModelConfig(**TINY)
  proto = tf.compat.v1.ConfigProto(device_count={"CPU": 2}, allow_soft_placement=True)
  results = {}
  for devices in (["/cpu:0"], ["/cpu:0", "/cpu:1"]):
    with tf.Graph().as_default() as graph:
      tf.compat.v1.set_random_seed(0)
      grads, outs = _tower_graph(devices, cfg)
      names = sorted((v.op.name, tuple(v.shape.as_list()))
                     for v in tf.compat.v1.global_variables())
      with tf.compat.v1.Session(config=proto) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        values = sess.run([g for g, _ in grads])
      ops = {op.name: op.device for op in graph.get_operations()}
    results[len(devices)] = (names, values, ops)
  assert results[1][0] == results[2][0]
  assert len(results[2][0]) == 9
  for one, two in zip(results[1][1], results[2][1]):
    assert np.abs(one).max() > 0
    np.testing.assert_allclose(two, one, rtol=1e-10, atol=1e-16)
  ops = results[2][2]
  assert "CPU:1" in ops["tower_1/capsnet/digit_caps/u_hat"].upper()
  assert "CPU:0" in ops["capsnet/digit_caps/weights"].upper()


def test_gpu_placement_recorded_and_soft_placed_on_cpu():
  cfg = model.ModelConfig(**TINY)
  with tf.Graph().as_default() as graph:
    grads, outs = _tower_graph(["/gpu:0"], cfg)
    compute = [op for op in graph.get_operations()
               if op.name.startswith("tower_0/capsnet/") and op.type in
               ("Conv2D", "Einsum", "BatchMatMulV2", "MatMul", "Softmax")]
    assert len(compute) > 5
    assert all(op.device.upper().endswith("GPU:0") for op in compute)
    var_ops = [v.op for v in tf.compat.v1.global_variables()]
    assert all(op.device.upper().endswith("GPU:0") for op in var_ops)
    proto = tf.compat.v1.ConfigProto(allow_soft_placement=True)
    with tf.compat.v1.Session(config=proto) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      loss = sess.run(outs[0].loss)
  assert np.isfinite(loss) and loss > 0
