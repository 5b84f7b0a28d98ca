"""train.py and eval.py on one small trained run, towers and placement.

The CLI tests share one run of a small CapsNet trained on real MNIST from
data/mnist (.ci/run seeds it from ../shared) for 50 steps.
"""
import functools
import glob
import json
import os
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf

from capsnet.data import mnist
from capsnet.model import network
from capsnet.running import runs
from conftest import MNIST
from conftest import SMALL
from conftest import TINY
from conftest import TWO_TOWERS
from conftest import cli
from conftest import last_line
from conftest import needs_mnist
from conftest import train_here
from conftest import trained_stdout


def scalars(logdir, tag):
  values = []
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.*"))):
    for event in tf.compat.v1.train.summary_iterator(path):
      for v in event.summary.value:
        if v.tag == tag:
          values.append((event.step, v.simple_value))
  return sorted(values)


@pytest.fixture(scope="module")
def run_dir(trained_once):
  """One epoch of 50 steps on 1,600 images with two towers on the CPU
  (`TWO_TOWERS`, trained once for the session); (logdir, its stdout)."""
  logdir = trained_once(*TWO_TOWERS)
  return logdir, trained_stdout(logdir)


@needs_mnist
def test_training_writes_everything_and_learns(run_dir):
  logdir, stdout = run_dir
  for name in ("config.json", "metrics.jsonl", "test_results.json",
               "diagnostics.jsonl", "latest/checkpoint", "best/checkpoint"):
    assert os.path.exists(os.path.join(logdir, name)), name
  assert glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
  assert tf.train.latest_checkpoint(os.path.join(logdir, "latest")).endswith("-50")
  rows = [json.loads(line) for line in open(os.path.join(logdir, "metrics.jsonl"))]
  assert [(r["epoch"], r["step"]) for r in rows] == [(1, 50)]
  assert rows[0]["val_error_percent"] == pytest.approx(100 * (1 - rows[0]["val_accuracy"]))
  assert rows[0]["val_accuracy"] > 0.5          # learned: chance is 0.1
  # wall_s and images_per_sec are each rounded to 0.1
  wall, speed = rows[0]["wall_s"], rows[0]["images_per_sec"]
  assert 1600 / (wall + 0.05) - 0.05 <= speed <= 1600 / (wall - 0.05) + 0.05
  test = json.load(open(os.path.join(logdir, "test_results.json")))
  assert test["count"] == 10000 and test["split"] == "test"
  assert "test (" in stdout and "validation accuracy" in stdout
  cfg = json.load(open(os.path.join(logdir, "config.json")))
  assert cfg["model"]["primary_types"] == 4 and cfg["train"]["batch_size"] == 32
  losses = scalars(logdir, "loss/total")
  assert [s for s, _ in losses] == list(range(5, 51, 5))
  assert losses[-1][1] < 0.75 * losses[0][1], losses
  entropy = scalars(logdir, "routing/entropy_iter_0")
  np.testing.assert_allclose(entropy[0][1], np.log(10), rtol=1e-5)  # uniform c
  assert scalars(logdir, "routing/entropy_iter_2")[-1][1] < np.log(10)
  diag = [json.loads(line) for line in open(os.path.join(logdir, "diagnostics.jsonl"))]
  assert [(d["step"], d["epoch"]) for d in diag] == [(1, 0.02), (25, 0.5), (50, 1.0)]


@needs_mnist
def test_diagnostic_rows_are_the_gradient_share_of_the_fixed_batch(run_dir):
  """The last diagnostic row, recomputed from the step-50 checkpoint on the
  same fixed batch (the first 32 training images)."""
  logdir, _ = run_dir
  cfg = network.ModelConfig(**json.load(open(os.path.join(logdir, "config.json")))["model"])
  images, labels = mnist.load("mnist", MNIST, 500, download_missing=False)["train"]
  with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
    diag = network.gradient_diagnostic(tf.constant(images[:32], tf.float32) / 255.0,
                                     tf.constant(labels[:32]), cfg)
    model_vars = [v for v in tf.compat.v1.global_variables()]
    tf.compat.v1.train.Saver(model_vars).restore(
        sess, tf.train.latest_checkpoint(os.path.join(logdir, "latest")))
    values = sess.run(diag)
  row = [json.loads(line) for line in open(os.path.join(logdir, "diagnostics.jsonl"))][-1]
  assert row["step"] == 50
  for name, value in values.items():
    assert value > 1e-3, name                   # r = 3: some gradient goes through c
    assert row[name] == pytest.approx(value, rel=1e-3), name


@needs_mnist
def test_resume_continues_step_and_optimizer_state(run_dir, tmp_path):
  logdir, _ = run_dir
  resumed = str(tmp_path / "resumed")
  shutil.copytree(logdir, resumed)
  # precision and conv_impl (MAY_CHANGE_ON_RESUME) may change on resume.
  proc = train_here(*SMALL, f"--logdir={resumed}", "--epochs=2",
             "--train_size=1600", "--learning_rate=0.01", "--num_gpus=2",
             "--device=/cpu:0", "--precision=bf16", "--conv_impl=conv2d")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"Resuming from {logdir}" not in proc.stdout
  assert f"Resuming from {resumed}/latest/model.ckpt-50" in proc.stdout
  saved = json.load(open(os.path.join(resumed, "config.json")))
  assert (saved["model"]["precision"], saved["model"]["conv_impl"]) == ("bf16", "conv2d")
  assert saved["train"]["epochs"] == 2
  ckpt = tf.train.latest_checkpoint(os.path.join(resumed, "latest"))
  assert ckpt.endswith("-100")
  reader = tf.train.load_checkpoint(ckpt)
  # Adam's beta1 power is 0.9^(steps + 1): 100 steps, not 50 after a re-init.
  np.testing.assert_allclose(reader.get_tensor("beta1_power"), 0.9 ** 101, rtol=1e-4)
  assert reader.get_tensor("state/epoch") == 2
  rows = [json.loads(line) for line in open(os.path.join(resumed, "metrics.jsonl"))]
  assert [(r["epoch"], r["step"]) for r in rows] == [(1, 50), (2, 100)]


@needs_mnist
def test_refuses_logdir_of_another_architecture(run_dir):
  logdir, _ = run_dir
  before = sorted(os.listdir(os.path.join(logdir, "latest")))
  proc = train_here(*SMALL, "--primary_types=8", f"--logdir={logdir}")
  assert proc.returncode != 0
  assert last_line(proc) == (
      f"train.py: error: {logdir}/config.json has primary_types=4, the flags give 8: "
      "use another --logdir or the same value")
  assert sorted(os.listdir(os.path.join(logdir, "latest"))) == before


@needs_mnist
def test_config_without_a_newer_field_reads_as_its_default(run_dir, tmp_path):
  """A run started before a model field existed (capsule_layers) resumes as
  the field's default, and refuses another value."""
  logdir = str(tmp_path / "old")
  shutil.copytree(run_dir[0], logdir)
  path = os.path.join(logdir, "config.json")
  saved = json.load(open(path))
  del saved["model"]["capsule_layers"]
  open(path, "w").write(json.dumps(saved))
  proc = train_here(*SMALL, "--capsule_layers=official", f"--logdir={logdir}")
  assert proc.returncode != 0
  assert last_line(proc) == (
      f"train.py: error: {path} has capsule_layers='paper', the flags give "
      "'official': use another --logdir or the same value")


@needs_mnist
def test_nan_loss_stops_without_touching_checkpoints(run_dir, tmp_path):
  logdir = str(tmp_path / "nan")
  shutil.copytree(run_dir[0], logdir)
  # A run whose learning rate makes the loss blow up (a changed learning
  # rate is refused on resume, so the run's own config.json has it).
  path = os.path.join(logdir, "config.json")
  saved = json.load(open(path))
  saved["train"]["learning_rate"] = 1e12
  open(path, "w").write(json.dumps(saved))
  latest = os.path.join(logdir, "latest")
  before = {f: open(os.path.join(latest, f), "rb").read() for f in os.listdir(latest)}
  proc = train_here(*SMALL, f"--logdir={logdir}", "--epochs=2",
             "--train_size=1600", "--learning_rate=1e12", "--num_gpus=2",
             "--device=/cpu:0")
  assert proc.returncode != 0
  assert re.fullmatch(r"train\.py: error: loss is (nan|inf) at step 5\d; stopped "
                      r"without saving, the last good checkpoint is .*/latest/"
                      r"model\.ckpt-50", last_line(proc)), last_line(proc)
  after = {f: open(os.path.join(latest, f), "rb").read() for f in os.listdir(latest)}
  assert after == before


@pytest.mark.integration
@needs_mnist
def test_eval_cli_scores_every_image_and_writes_files(run_dir, tmp_path):
  logdir, _ = run_dir
  out = str(tmp_path / "eval")
  proc = cli("eval.py", f"--checkpoint={logdir}", "--batch_size=300",
             f"--out_dir={out}", "--split=validation")
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.load(open(os.path.join(out, "results.json")))
  assert res["count"] == 500 and res["iter_routing"] == 3
  assert sum(map(sum, res["confusion"])) == 500
  # The best checkpoint is the epoch-1 one, scored on the same 500 images.
  row = json.loads(open(os.path.join(logdir, "metrics.jsonl")).readline())
  assert res["accuracy"] == row["val_accuracy"]
  assert res["loss"] == pytest.approx(row["val_loss"], rel=1e-6)
  lines = open(os.path.join(out, "predictions.csv")).read().splitlines()
  assert len(lines) == 501 and lines[0].startswith("index,label,prediction,length_0")
  preds = np.array([int(line.split(",")[2]) for line in lines[1:]])
  labels = np.array([int(line.split(",")[1]) for line in lines[1:]])
  np.testing.assert_allclose(res["accuracy"], np.mean(preds == labels))
  with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
    recon = sess.run(tf.io.decode_png(open(os.path.join(out, "reconstructions.png"), "rb").read()))
    fig4 = sess.run(tf.io.decode_png(open(os.path.join(out, "figure4.png"), "rb").read()))
  assert recon.shape == (4 * 30 - 2, 8 * 30 - 2, 1)       # 16 pairs, 8 columns
  assert fig4.shape == (8 * 30 - 2, 3 * (11 * 30 - 2) + 2 * 8, 1)  # 8 dims x 11
  assert "error" in proc.stdout and "confusion matrix" in proc.stdout


@needs_mnist
def test_run_folder_errors(tmp_path, run_dir):
  """What eval.py reports (as `eval.py: error: <message>`) for run folders
  and checkpoints it cannot use."""
  logdir, _ = run_dir
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(runs.RunError, match=re.escape(
      f"{empty}: no checkpoint in {empty}/best (try --which=latest)")):
    runs.resolve(str(empty), "best")
  ckpt = tf.train.latest_checkpoint(os.path.join(logdir, "latest"))
  assert runs.resolve(ckpt, "best") == (ckpt, logdir)   # a prefix: the run above
  other = tmp_path / "other"
  shutil.copytree(logdir, other)
  cfg = json.load(open(other / "config.json"))
  cfg["model"]["digit_dim"] = 6
  (other / "config.json").write_text(json.dumps(cfg))
  ckpt, run = runs.resolve(str(other), "best")
  assert ckpt == f"{other}/best/model.ckpt-50"
  with tf.Graph().as_default():
    network.forward(tf.zeros([1, 28, 28, 1]), tf.zeros([1], tf.int32),
                  runs.RunFolder(run).load_config()[0], training=False)
    with pytest.raises(runs.RunError, match=re.escape(
        f"{ckpt}: checkpoint of another architecture: capsnet/digit_caps/weights "
        "is [144, 10, 4, 8] in the checkpoint, [144, 10, 4, 6] in config.json")):
      runs.check_matches(ckpt, tf.compat.v1.global_variables())
  (other / "config.json").write_text('{"model": {"conv1_chan')
  with pytest.raises(runs.RunError, match=re.escape(
      f"{other}/config.json: not a valid config.json (")):
    runs.RunFolder(str(other)).load_config()


def test_eval_folder_predictions_round_trip_by_column_name(tmp_path):
  """eval.py's predictions.csv is written and read by runs.EvalFolder alone:
  read back by its header's names, for one digit and two an image; a
  damaged file is one RunError naming it."""
  lengths = np.array([[0.9, 0.1], [0.2, 0.8]], np.float32)
  one = runs.EvalFolder(str(tmp_path))
  one.write_predictions(np.array([0, 1]), np.array([0, 0]), lengths)
  assert open(one.file("predictions.csv")).read().splitlines() == [
      "index,label,prediction,length_0,length_1", "0,0,0,0.90000,0.10000",
      "1,1,0,0.20000,0.80000"]
  got = one.predictions()
  assert got["label"] == [0, 1] and got["prediction"] == [0, 0]
  assert got["length_1"] == [0.1, 0.8]
  two = runs.EvalFolder(str(tmp_path / "two"))
  os.makedirs(two.path)
  two.write_predictions(np.array([[0, 1], [1, 0]]), np.array([[0, 1], [0, 1]]), lengths)
  assert two.predictions()["label_b"] == [1, 0]
  assert two.predictions()["prediction_b"] == [1, 1]
  with open(two.file("predictions.csv"), "a") as f:
    f.write("2,x\n")
  with pytest.raises(runs.RunError, match=re.escape(
      f"{two.file('predictions.csv')}: not a valid predictions.csv (")):
    two.predictions()
  with pytest.raises(runs.RunError, match=re.escape(
      f"{tmp_path / 'none' / 'results.json'}: missing")):
    runs.EvalFolder(str(tmp_path / "none")).results()
  folder = runs.RunFolder(str(tmp_path / "run"))
  assert folder.eval_folder("a/best/model.ckpt-50", 3, "affine").path == str(
      tmp_path / "run" / "eval_model.ckpt-50_r3_affine")
  assert folder.own_images_folder().path == str(tmp_path / "run" / "own_images")


def _tower_graph(devices, cfg):
  rng = np.random.RandomState(0)
  images = tf.constant(rng.rand(4, cfg.image_size, cfg.image_size, 1))
  labels = tf.constant([0, 1, 2, 1])
  opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
  grads, outs = network.tower_gradients(images, labels, cfg, opt, devices)
  return grads, outs


def test_two_towers_same_variables_and_full_batch_gradient():
  cfg = network.ModelConfig(**TINY)
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
  for one, two in zip(results[1][1], results[2][1], strict=True):
    assert np.abs(one).max() > 0
    np.testing.assert_allclose(two, one, rtol=1e-10, atol=1e-16)
  ops = results[2][2]
  assert "CPU:1" in ops["tower_1/capsnet/digit_caps/u_hat"].upper()
  assert "CPU:0" in ops["capsnet/digit_caps/weights"].upper()


def test_gpu_placement_recorded_and_soft_placed_on_cpu():
  cfg = network.ModelConfig(**TINY)
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


@functools.lru_cache(maxsize=None)
def _registered_kernels(op_type):
  """The kernels TensorFlow registers for an op type (a registry lookup of
  several ms: once a type, not once an op)."""
  from tensorflow.python.framework import kernels
  return kernels.get_registered_kernels_for_op(op_type).kernel


def _ops_without_gpu_kernel(graph):
  """Ops placed on a GPU for which the installed TensorFlow registers no
  kernel of device type GPU or DEFAULT that accepts the op's dtypes."""
  missing = []
  for op in graph.get_operations():
    if "GPU" not in op.device.upper():
      continue
    ok = False
    for kernel in _registered_kernels(op.type):
      if kernel.device_type not in ("GPU", "DEFAULT"):
        continue
      fits = True
      for constraint in kernel.constraint:
        allowed = constraint.allowed_values.list.type
        if allowed and op.get_attr(constraint.name) not in allowed:
          fits = False
      ok = ok or fits
    if not ok:
      missing.append(f"{op.type} ({op.name})")
  return missing


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("conv_impl", ["auto", "custom_grad", "conv2d"])
def test_training_graph_for_gpu_has_gpu_kernels(precision, conv_impl):
  """The paper model's training step built for /gpu:0 (no GPU needed: the
  wheel registers its GPU kernels anyway): every op there can run on a GPU."""
  cfg = network.ModelConfig(precision=precision, conv_impl=conv_impl)
  with tf.Graph().as_default() as graph:
    images = tf.compat.v1.placeholder(tf.float32, [None, 28, 28, 1])
    labels = tf.compat.v1.placeholder(tf.int32, [None])
    opt = tf.compat.v1.train.AdamOptimizer(1e-3)
    grads, _ = network.tower_gradients(images, labels, cfg, opt, ["/gpu:0"])
    with tf.compat.v1.device("/gpu:0"):
      opt.apply_gradients(grads)
    on_gpu = [op for op in graph.get_operations() if "GPU" in op.device.upper()]
    assert len(on_gpu) > 200
    assert _ops_without_gpu_kernel(graph) == []
    custom = any(op.type == "IdentityN" for op in on_gpu)   # custom gradients
    assert custom == (conv_impl == "custom_grad")           # auto: cuDNN's


def test_gpu_kernel_check_finds_an_op_without_one():
  with tf.Graph().as_default() as graph:
    blob, x = tf.constant(b""), tf.constant([1.0])
    with tf.compat.v1.device("/gpu:0"):
      tf.io.decode_png(blob, name="png")                  # a CPU-only kernel
      tf.square(x, name="fine")
    assert _ops_without_gpu_kernel(graph) == ["DecodePng (png)"]
