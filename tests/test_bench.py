"""The benchmark: its FLOP count, its baseline's math, its CLI."""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from capsnet import bench
from capsnet import roofline
from capsnet.model import layers
from capsnet.model import network
from conftest import ROOT


def test_nominal_flops_of_the_paper_model():
  """Counted by hand from the layer shapes, the convolutions as direct ones:
  the forward; a training step is 3 x the forward of every layer but Conv1
  (no input gradient: 2 x), routing with the stop once backward, and Adam's
  10 FLOPs a weight (biases not counted)."""
  cfg = network.ModelConfig()
  conv1 = 2 * 20 * 20 * 81 * 256                      # 16,588,800
  routing = 2 * 1152 * 10 * 16                        # one pass over u_hat
  rest = (2 * 6 * 6 * 81 * 256 * 256                   # PrimaryCaps
          + 2 * 1152 * 10 * 8 * 16                     # u_hat
          + 2 * (160 * 512 + 512 * 1024 + 1024 * 784))  # decoder
  assert roofline.nominal_flops(cfg, 1, train=False) == conv1 + rest + 5 * routing \
      == 406_405_120                                   # 3 sums + 2 agreements
  assert roofline.nominal_flops(cfg, 128, train=False) == 128 * 406_405_120
  assert roofline.nominal_flops(cfg, 128, train=True) == 128 * (
      2 * conv1 + 3 * rest + 6 * routing) + 10 * (8_215_568 - 2_832)
  no_dec = network.ModelConfig(use_decoder=False)
  assert roofline.nominal_flops(cfg, 1, False) - roofline.nominal_flops(no_dec, 1, False) \
      == 2 * (160 * 512 + 512 * 1024 + 1024 * 784)


@pytest.mark.parametrize("iters,stop", [(1, True), (3, True), (3, False)])
def test_tiled_baseline_computes_the_same_capsules(tiny_cfg, iters, stop):
  """Same W and u: the baseline's v, coefficients, predictions and the
  gradient equal ours."""
  cfg = dataclasses.replace(tiny_cfg, iter_routing=iters, stop_gradient=stop)
  rng = np.random.RandomState(0)
  u0 = rng.randn(3, cfg.in_caps, cfg.primary_dim) * 0.5        # float64
  w0 = rng.randn(cfg.in_caps, cfg.num_classes, cfg.primary_dim, cfg.digit_dim) * 0.3
  out = {}
  for variant in ("ours", "tiled"):
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
      u = tf.constant(u0)
      layer = layers.digit_caps if variant == "ours" else bench.tiled_digit_caps
      v, couplings, u_hat = layer(u, cfg.num_classes, cfg.digit_dim, iters, stop)
      w = tf.compat.v1.global_variables()[0]
      w.load(w0, sess)
      grad = tf.gradients(tf.reduce_sum(v * np.arange(v.shape[-1])), [w, u])
      out[variant] = sess.run([v, u_hat, *couplings, *grad])
  assert len(out["ours"]) == 4 + iters
  for a, b in zip(out["ours"], out["tiled"], strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_the_baseline_model_is_ours_with_the_tiled_digit_caps(tiny_cfg):
  """bench.model: the baseline has our model's variables, and with the same
  weights the same training loss and predictions (float64)."""
  cfg = dataclasses.replace(tiny_cfg, conv_impl="conv2d")
  rng = np.random.RandomState(1)
  images = rng.rand(4, cfg.image_size, cfg.image_size, 1)
  labels = np.array([0, 1, 2, 1])
  weights, out = None, {}
  for variant in ("ours", "tiled"):
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
      predictions, loss = bench.model(variant, cfg, tf.constant(images),
                                      tf.constant(labels), False)
      variables = {v.op.name: v for v in tf.compat.v1.trainable_variables()}
      sess.run(tf.compat.v1.global_variables_initializer())
      if weights is None:
        weights = sess.run(variables)
      assert {k: v.shape.as_list() for k, v in variables.items()} == {
          k: list(w.shape) for k, w in weights.items()}
      for name, var in variables.items():
        var.load(weights[name], sess)
      out[variant] = sess.run([predictions, loss])
  np.testing.assert_array_equal(out["ours"][0], out["tiled"][0])
  np.testing.assert_allclose(out["ours"][1], out["tiled"][1], rtol=1e-10)


def test_routing_mode_times_both_forms_in_float32():
  """--modes=routing: the paper's sums and the model's matmuls, each a
  positive time, at the paper's capsule counts, in float32 (routing's dtype
  under both precisions)."""
  import queue
  out = queue.Queue()
  bench._measure_routing({"batch_size": 2, "iter_routing": 3}, out, repeats=2)
  r = out.get()
  assert (r["mode"], r["precision"], r["shape"]) == ("routing", "float32", [2, 1152, 10, 16])
  assert set(r["ms"]) == {"procedure_1", "matmuls"} and min(r["ms"].values()) > 0


def _bench(*args, quiet=True, env=None):
  """quiet=False: TF_CPP_MIN_LOG_LEVEL unset, as a user's shell has it; env:
  more variables."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **(env or {}))
  if not quiet:
    del env["TF_CPP_MIN_LOG_LEVEL"]
  return subprocess.run([sys.executable, "-m", "capsnet.bench", *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=600)


def test_cli_rejects_unknown_precision():
  proc = _bench("--precision=fp16")
  assert proc.returncode != 0
  assert "--precision: 'fp16' is not one of fp32, bf16" in proc.stderr


@pytest.mark.integration
def test_cli_small_run_writes_json(tmp_path):
  """One round, tiny batch: the report's figures and how they relate."""
  path = tmp_path / "bench.json"
  proc = _bench("--batch_size=4", "--steps=1", "--warmup=0", "--rounds=1",
                "--modes=infer,layers", "--precision=fp32", "--peak_size=256",
                "--convs=planned,conv2d", f"--json={path}", quiet=False,
                env={"CAPSNET_CACHE_DIR": str(tmp_path / "cache")})
  assert proc.returncode == 0, proc.stderr[-2000:]
  report = json.loads(path.read_text())
  assert report["settings"]["rounds"] == 1 and len(report["rounds"]) == 1
  assert report["settings"]["peak_size"] == 256
  assert report["host"]["cpu"]
  (layers,) = [r for r in report["results"] if r["mode"] == "layers"]
  assert set(layers["ms"]) == {"conv2d", "dilated", "folded", "dft"}
  assert report["ratios"]["layers_fp32_conv2d_over_dft"] == pytest.approx(
      layers["ms"]["conv2d"] / layers["ms"]["dft"])
  report["results"].remove(layers)
  assert {(r["variant"], r["conv"], r["mode"]) for r in report["results"]} == {
      ("ours", "planned", "infer"), ("ours", "conv2d", "infer"), ("tiled", "conv2d", "infer")}
  planned = next(r for r in report["results"] if r["conv"] == "planned")
  assert planned["plan"].startswith("conv1:") and planned["planning_s"] > 0
  assert f"plan {planned['plan']}" in proc.stdout
  assert os.path.exists(tmp_path / "cache" / "conv_plans.json")
  peak = report["matmul_peak_gflops"]["fp32"]
  for r in report["results"]:
    assert r["images_per_sec"] == pytest.approx(4 / (r["step_ms"] / 1000))
    assert r["gflops"] == pytest.approx(r["gflop_per_image"] * r["images_per_sec"])
    assert r["fraction_of_fp32_peak"] == pytest.approx(r["gflops"] / peak)
    assert r["gflop_per_image"] == pytest.approx(406_405_120 / 1e9)   # the nominal count
  by = {r["conv"] if r["variant"] == "ours" else "tiled": r["images_per_sec"]
        for r in report["results"]}
  assert report["ratios"]["infer_fp32_ours_over_tiled"] == pytest.approx(
      by["planned"] / by["tiled"])
  assert report["ratios"]["infer_fp32_planned_over_conv2d"] == pytest.approx(
      by["planned"] / by["conv2d"])
  assert "median of 1 round(s)" in proc.stdout
  # The children start quietly, as train.py and eval.py do: no TensorFlow
  # C++ notices (I0000/W0000/E0000 lines, "WARNING: All log messages...").
  noise = [line for line in proc.stderr.splitlines()
           if line[:5] in ("I0000", "W0000", "E0000") or line.startswith("WARNING: All log")]
  assert not noise, noise[:3]


def test_summary_takes_medians_over_rounds():
  def one(speed, peak, rss, ratio):
    return {"matmul_peak_gflops": {"fp32": peak},
            "results": [{"mode": "train", "precision": "fp32", "variant": "ours",
                         "images_per_sec": speed, "peak_rss_mib": rss, "steps": 12}],
            "ratios": {"train_fp32_ours_over_tiled": ratio}}
  summary = bench.summarize([one(100.0, 300.0, 900.0, 2.0), one(130.0, 320.0, 1000.0, 2.4),
                             one(110.0, 290.0, 950.0, 2.1)])
  (r,) = summary["results"]
  assert (r["images_per_sec"], r["peak_rss_mib"], r["steps"]) == (110.0, 1000.0, 12)
  assert summary["matmul_peak_gflops"] == {"fp32": 300.0}
  assert summary["ratios"] == {"train_fp32_ours_over_tiled": 2.1}


@pytest.mark.integration
def test_cli_profile_books_the_step_by_layer(tmp_path):
  path = tmp_path / "profile.json"
  proc = _bench("--profile", "--precision=fp32", "--batch_size=4", "--warmup=1",
                f"--json={path}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  (report,) = json.loads(path.read_text())["profiles"]
  parts = report["parts"]
  assert set(parts) >= {"conv1", "primary_caps/products", "u_hat", "routing", "adam"}
  assert sum(parts.values()) == pytest.approx(report["traced_ms"])
  rows = {r["part"]: r for r in report["roofline"]}
  assert rows["step"]["ms"] == pytest.approx(report["traced_ms"])
  # No part runs faster than its limit on this host (a claim of the model).
  assert all(r["fraction"] <= 1 for r in rows.values() if r["fraction"] is not None)
  assert report["bandwidth_gbs"] > 0 and report["matmul_peak_gflops"] > 0
  assert "top ops:" in proc.stdout and "of limit" in proc.stdout


def test_dft_multiply_adds_at_the_paper_shape():
  """PrimaryCaps by the DFT at batch 128 (docs/performance.md): the input's
  width and height transforms 0.26 G + 0.75 G (the height's makes Gauss's
  three operands), the products 4.78 G (Gauss's three), the inverse 0.25 G,
  the kernel's transform 0.78 G; in bfloat16 two blocks and four products."""
  (x_tf, kernel, inverse), products = roofline.dft_multiply_adds(128, 20, 20, 256, 9,
                                                                 256, 2)
  assert (x_tf, products, inverse) == (2 * 20 * 10 * 20 * 128 * 256
                                       + 6 * 19 * 20 * 10 * 128 * 256,
                                       190 * 128 * 256 * 256 * 3,
                                       6 * 6 * 19 * 10 * 128 * 256
                                       + 2 * 6 * 6 * 10 * 128 * 256)
  assert [round(v / 1e9, 2) for v in (x_tf, products, inverse, kernel)] == [
      1.01, 4.78, 0.25, 0.78]
  (x_tf, kernel, inverse), products = roofline.dft_multiply_adds(128, 20, 20, 256, 9,
                                                                 256, 2, products=4)
  assert [round(v / 1e9, 2) for v in (x_tf, products, inverse, kernel)] == [
      0.76, 6.38, 0.17, 0.55]


def test_step_costs_of_the_paper_model():
  """The training step's FLOPs by part: a direct PrimaryCaps is 3 x its
  24.5 G multiply-adds (forward and both gradients); with the DFT its
  products are 3 x 4.78 G; routing at r = 3 with the stop reads u_hat
  (94.4 MB in fp32) 5 times forward and once backward."""
  cfg = network.ModelConfig()
  direct = roofline.step_costs(cfg, 128, {"conv1": "conv2d", "primary_caps": "dilated"})
  assert direct["primary_caps/products"].flops == 2 * 3 * 128 * 36 * 81 * 256 * 256
  assert direct["primary_caps/transforms"].flops == 0
  dft = roofline.step_costs(cfg, 128, {"conv1": "patch_gemm", "primary_caps": "dft"})
  assert dft["primary_caps/products"].flops == 2 * 3 * 190 * 128 * 256 * 256 * 3
  u_hat_bytes = 4 * 128 * 1152 * 10 * 16
  assert dft["routing"].bytes == 6 * u_hat_bytes
  nostop = roofline.step_costs(dataclasses.replace(cfg, stop_gradient=False), 128,
                               {"conv1": "patch_gemm", "primary_caps": "dft"})
  assert nostop["routing"].bytes == 10 * u_hat_bytes
  forward = roofline.step_costs(cfg, 128, {"conv1": "dft", "primary_caps": "dft"},
                                train=False)
  assert forward["primary_caps/products"].flops == 2 * 190 * 128 * 256 * 256 * 3
  assert forward["routing"].bytes == 5 * u_hat_bytes and forward["adam"].flops == 0
  conv1_dft = roofline.step_costs(cfg, 128, {"conv1": "dft", "primary_caps": "dft"})
  assert conv1_dft["conv1"].flops - forward["conv1"].flops == 2 * (   # its gradient:
      roofline.dft_multiply_adds(128, 28, 28, 1, 9, 256, 1)[1]        # the products
      + sum(roofline.dft_multiply_adds(128, 28, 28, 1, 9, 256, 1)[0][1:]))  # w, inverse
  assert roofline.Cost(2e9, 1e9).limit(100.0, 10.0) == pytest.approx(0.1)   # memory
  assert roofline.Cost(2e10, 1e8).limit(100.0, 10.0) == pytest.approx(0.2)  # compute


def test_op_names_booked_to_parts():
  assert [roofline.part_of(n) for n in (
      "gradients/capsnet/primary_caps/dft/products/MatMul_grad/MatMul",
      "capsnet/primary_caps/dft/MatMul_3", "capsnet/primary_caps/squash/mul",
      "capsnet/conv1/Relu", "capsnet/digit_caps/transpose_2",
      "capsnet/digit_caps/routing/iter_1/MatMul", "Adam/update_capsnet/conv1/weights",
      "capsnet/decoder/fc1/MatMul", "margin_loss/Sum")] == [
      "primary_caps/products", "primary_caps/transforms", "primary_caps/products",
      "conv1", "u_hat", "routing", "adam", "decoder", "other"]


def test_the_benchmark_imports_no_tensorflow_before_its_children_do():
  """Its children import TensorFlow through `startup` (quietly, oneDNN on);
  the module they import to find their target must not import it first."""
  script = ("import sys; import capsnet.bench, capsnet.roofline; "
            "print('tensorflow' in sys.modules)")
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        cwd=ROOT, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip() == "False"
