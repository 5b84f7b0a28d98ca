"""Speed and memory of the CapsNet step, against the machine's own limit.

  python -m capsnet.bench                       # fp32 and bf16, train and infer
  python -m capsnet.bench --precision=fp32 --json=bench.json
  python -m capsnet.bench --profile               # where the step's time goes

For each (variant, convolutions, precision, mode) a fresh child process
builds the paper model, runs --warmup steps, then times --steps steps one by
one and reports the median images/s, the achieved GFLOP/s (analytic FLOP
count, below), its fraction of the matmul peak of its precision measured in
the same round, and the child's peak RSS. `ours` is measured with each of
--convs: `planned` (the host's plan, `capsnet.running.planner`, printed with
the time it took) and the fixed choices (custom_grad, conv2d, dft); the
report gives the planned step over each fixed one. Mode `layers` times
PrimaryCaps' convolution alone (forward and both gradients) by each method,
with the DFT's ratio against conv2d. All of it is repeated in --rounds
interleaved rounds, and the report gives the medians over rounds (of the
ratios too, each taken within its round). `tiled` is the naive baseline: W
and u tiled over the batch and routing as the well-known TF1 reference does
it (`tiled_digit_caps`), with TensorFlow's own convolution gradients.
--host_file also writes the report to bench_results/<CPU model>.<kernel
flag>.json, one file per kind of host measured.
"""
import dataclasses
import multiprocessing
import os
import re
import resource
import statistics
import time
from unittest import mock

from absl import app
from absl import flags

from capsnet.running import files
from capsnet.running import host
from capsnet.running import startup

CONVS = ("planned", "custom_grad", "conv2d", "dft")
MODES = ("train", "infer", "input", "layers")


def define_flags():
  """The command-line flags; defined when run as a program only, so that
  importing this module (tests, other tools) adds no global flags."""
  flags.DEFINE_integer("batch_size", 128, "images per step", lower_bound=1)
  flags.DEFINE_integer("iter_routing", 3, "routing iterations", lower_bound=1)
  flags.DEFINE_list("precision", ["fp32", "bf16"], "precisions to measure")
  flags.DEFINE_list("variants", ["ours", "tiled"], "ours and/or tiled (baseline)")
  flags.DEFINE_list("modes", ["train", "infer", "input", "layers"],
                    "train, infer (model steps), input (the training input "
                    "pipeline alone: shuffle order, shift augmentation, batching) "
                    "and/or layers (PrimaryCaps' convolution by each method)")
  flags.DEFINE_list("convs", list(CONVS), "the convolutions of `ours`: planned (the "
                    "host's measured plan) and/or fixed conv_impl choices "
                    "custom_grad, conv2d, dft (the baseline uses conv2d)")
  flags.DEFINE_bool("host_file", False, "also write the report to "
                    "bench_results/<CPU model>.<kernel flag>.json")
  flags.DEFINE_integer("steps", 12, "timed steps (median is reported)", lower_bound=1)
  flags.DEFINE_integer("warmup", 3, "untimed steps first", lower_bound=0)
  flags.DEFINE_integer("peak_size", 2048, "n of the n x n matmuls that measure "
                       "the machine's peak (smaller: quicker, less exact)",
                       lower_bound=64)
  flags.DEFINE_integer("rounds", 3, "interleaved rounds of every measurement; the "
                       "report gives their medians", lower_bound=1)
  flags.DEFINE_string("json", None, "also write the results here")
  flags.DEFINE_bool("profile", False, "instead: where our training step's time "
                    "goes (per layer and top ops, from a step trace), for each "
                    "--precision")


FLAGS = flags.FLAGS


def flops_per_image(cfg, train):
  """Analytic multiply-add FLOPs (x2) per image of the CapsNet step.

  Forward: Conv1, PrimaryCaps conv, u_hat = W u, routing (r weighted sums,
  r - 1 agreements), decoder. Training adds the backward pass: twice the
  forward for every layer but Conv1, whose input needs no gradient (once).
  Element-wise ops (squash, softmax, losses) are not counted.
  """
  conv1 = 2 * cfg.conv1_size ** 2 * cfg.conv1_kernel ** 2 * cfg.image_channels \
      * cfg.conv1_channels
  primary = 2 * cfg.primary_size ** 2 * cfg.primary_kernel ** 2 * cfg.conv1_channels \
      * cfg.primary_types * cfg.primary_dim
  u_hat = 2 * cfg.in_caps * cfg.num_classes * cfg.primary_dim * cfg.digit_dim
  routing = 2 * cfg.in_caps * cfg.num_classes * cfg.digit_dim * (2 * cfg.iter_routing - 1)
  sizes = [cfg.num_classes * cfg.digit_dim, *cfg.decoder_units, cfg.num_pixels]
  decoder = sum(2 * a * b for a, b in zip(sizes, sizes[1:])) if cfg.use_decoder else 0
  rest = primary + u_hat + routing + decoder
  return 2 * conv1 + 3 * rest if train else conv1 + rest


def tiled_digit_caps(u, out_caps, out_dim, num_iters, stop_gradient, official=False):
  """Baseline DigitCaps: W and u tiled over the batch, routing as in the TF1
  reference (its `routing()` in capsLayer.py): `s_j` by broadcast multiply
  and reduce, the agreement by tiling `v_j` over the input capsules and a
  batched [16, 1]^T [16, 1] matmul. Logits are per example, as in our model
  (the reference sums them over the batch), and the inner iterations read a
  stopped `u_hat` when `stop_gradient`.

  The signature, results and variable of `layers.digit_caps` (W [in_caps,
  out_caps, in_dim, out_dim]), so that `_build` can put it in the place of
  ours while `network.forward` builds the graph, and the rest of the model
  (losses, decoder) is the same. The paper's layers only (`official` False).
  """
  import tensorflow as tf
  from capsnet.model import routing
  if official:
    raise ValueError("the baseline DigitCaps has the paper's layers only")
  with tf.compat.v1.variable_scope("digit_caps"):
    in_caps, in_dim = u.shape[1], u.shape[2]
    w = tf.compat.v1.get_variable(
        "weights", [in_caps, out_caps, in_dim, out_dim], u.dtype,
        tf.compat.v1.random_normal_initializer(stddev=0.01))
    batch = tf.shape(u)[0]
    w_tiled = tf.tile(w[None], [batch, 1, 1, 1, 1])            # [b, i, o, k, d]
    u_tiled = tf.tile(u[:, :, None, :, None], [1, 1, out_caps, 1, 1])
    u_hat = tf.matmul(w_tiled, u_tiled, transpose_a=True)      # [b, i, o, d, 1]
    u_hat_stopped = tf.stop_gradient(u_hat) if stop_gradient else u_hat
    b = tf.zeros_like(u_hat[:, :, :, :1, :])                    # [b, i, o, 1, 1]
    couplings = []
    for r in range(num_iters):
      c = tf.nn.softmax(b, axis=2)
      couplings.append(c[:, :, :, 0, 0])
      last = r == num_iters - 1
      uh = u_hat if last else u_hat_stopped
      s = tf.reduce_sum(c * uh, axis=1, keepdims=True)          # [b, 1, o, d, 1]
      v = routing.squash(s, axis=3)
      if not last:
        v_tiled = tf.tile(v, [1, in_caps, 1, 1, 1])             # [b, i, o, d, 1]
        b += tf.matmul(uh, v_tiled, transpose_a=True)           # [b, i, o, 1, 1]
    return tf.squeeze(v, [1, 4]), couplings, u_hat[..., 0]


def _build(variant, cfg, images, labels, train):
  """The step op: a train op, or the inference predictions. The baseline is
  the same model (losses, decoder, config) with `tiled_digit_caps` and
  TensorFlow's own convolution gradients."""
  import tensorflow as tf
  from capsnet.model import layers
  from capsnet.model import network
  if variant == "ours":
    out = network.forward(images, labels, cfg, training=train)
  else:   # the model's own forward, with the baseline layer in ours' place
    baseline = dataclasses.replace(cfg, conv_impl="conv2d")
    with mock.patch.object(layers, "digit_caps", tiled_digit_caps):
      out = network.forward(images, labels, baseline, training=train)
  if not train:
    return out.predictions
  opt = tf.compat.v1.train.AdamOptimizer(1e-3)
  return opt.minimize(out.loss)


def _step_graph(variant, precision, mode, settings, conv="custom_grad"):
  """In the default graph: the config and the step op on a fixed batch.

  Args:
    conv: a `CONVS` choice for `ours`: "planned" plans (or reads the cache)
      first, for this mode's batch.
  Returns: (cfg, op, the planning's seconds or None).
  """
  import numpy as np
  import tensorflow as tf
  from capsnet.model import network
  from capsnet.running import planner
  cfg = network.ModelConfig(iter_routing=settings["iter_routing"], precision=precision,
                            conv_impl="auto" if conv == "planned" else conv)
  batch = settings["batch_size"]
  planning = None
  if conv == "planned" and variant == "ours":
    start = time.perf_counter()
    plan, _ = planner.plan_convolutions(cfg, batch, mode == "train")
    planning = time.perf_counter() - start
    cfg = dataclasses.replace(cfg, conv_plan=plan)
  rng = np.random.RandomState(0)
  # Variables, not constants: grappler would fold whatever depends on the
  # images alone (e.g. Conv1's patches) and time less than training does.
  images = tf.Variable(rng.rand(batch, 28, 28, 1).astype(np.float32),
                       trainable=False)
  labels = tf.Variable(rng.randint(0, 10, batch).astype(np.int32),
                       trainable=False)
  return cfg, _build(variant, cfg, images, labels, mode == "train"), planning


def _measure(variant, precision, mode, settings, conv, queue):
  """Child process: time one configuration, put a result dict on `queue`."""
  tf = _child_tensorflow()
  batch = settings["batch_size"]
  with tf.Graph().as_default():
    cfg, op, planning = _step_graph(variant, precision, mode, settings, conv)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      for _ in range(settings["warmup"]):
        sess.run(op)
      times = []
      for _ in range(settings["steps"]):
        t = time.perf_counter()
        sess.run(op)
        times.append(time.perf_counter() - t)
  step = statistics.median(times)
  gflop = flops_per_image(cfg, mode == "train") * batch / 1e9
  queue.put({"variant": variant, "precision": precision, "mode": mode,
             "conv": conv if variant == "ours" else "conv2d", "plan": cfg.conv_plan,
             "planning_s": planning,
             "batch_size": batch, "images_per_sec": batch / step,
             "step_ms": 1000 * step, "gflop_per_image": gflop / batch,
             "gflops": gflop / step,
             "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


# Where a traced op's time is booked, by the first match in its name.
PROFILE_GROUPS = (("Adam", "Adam updates"),
                  ("primary_caps", "PrimaryCaps conv (forward, gradients)"),
                  ("conv1", "Conv1 (forward, gradients)"),
                  ("digit_caps", "u_hat and routing (forward, gradients)"),
                  ("decoder", "decoder"))


def _profile(precision, settings, queue, traces=3, top=12):
  """Child process: per-op times of our training step from TensorFlow's
  step trace, ops run one at a time (inter-op threads 1) so that their times
  add up to the step; put the per-group totals and the top ops on `queue`."""
  import collections
  tf = _child_tensorflow()
  per_op = collections.Counter()
  with tf.Graph().as_default():
    _, op, _ = _step_graph("ours", precision, "train", settings, settings["conv"])
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1)
    with tf.compat.v1.Session(config=config) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      for _ in range(settings["warmup"]):
        sess.run(op)
      t = time.perf_counter()
      sess.run(op)
      step_ms = 1000 * (time.perf_counter() - t)
      options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
      for _ in range(traces):
        meta = tf.compat.v1.RunMetadata()
        sess.run(op, options=options, run_metadata=meta)
        for device in meta.step_stats.dev_stats:
          for node in device.node_stats:
            per_op[node.node_name] += node.all_end_rel_micros / 1000 / traces
  groups = collections.Counter()
  for name, ms in per_op.items():
    label = next((g for key, g in PROFILE_GROUPS if key in name), "other")
    groups[label] += ms
  queue.put({"precision": precision, "untraced_step_ms": step_ms,
             "traced_ms": sum(per_op.values()), "groups": dict(groups),
             "top_ops": per_op.most_common(top)})


def profile(settings, precisions):
  """Prints where the training step's time goes, per precision."""
  reports = []
  for precision in precisions:
    r = _in_child(_profile, precision, settings)
    reports.append(r)
    print(f"-- {precision}: traced ops {r['traced_ms']:.0f} ms "
          f"(untraced step {r['untraced_step_ms']:.0f} ms)")
    for label, ms in sorted(r["groups"].items(), key=lambda kv: -kv[1]):
      print(f"{ms:8.1f} ms  {100 * ms / r['traced_ms']:4.1f}%  {label}")
    print("top ops:")
    for name, ms in r["top_ops"]:
      print(f"{ms:8.1f} ms  {name}")
  return {"settings": settings, "profiles": reports}


def _measure_input(settings, queue, n=55000, batches=200):
  """Child process: images/s of the training tf.data pipeline, augmentation on."""
  import numpy as np
  tf = _child_tensorflow()
  from capsnet.data import mnist
  rng = np.random.RandomState(0)
  images = rng.randint(0, 256, (n, 28, 28, 1)).astype(np.uint8)
  labels = rng.randint(0, 10, n).astype(np.int32)
  batch = settings["batch_size"]
  with tf.Graph().as_default():
    pipe = mnist.fed_pipeline([28, 28, 1], batch, augment=True, drop_remainder=True)
    nxt = pipe.batch[:2]   # (images, labels)
    with tf.compat.v1.Session() as sess:
      order = mnist.epoch_order(n, 0, 0)
      sess.run(pipe.iterator.initializer, {
          pipe.images: images[order], pipe.labels: labels[order], pipe.seed: 1,
          pipe.first_batch: 0})
      for _ in range(10):
        sess.run(nxt)
      t = time.perf_counter()
      for _ in range(batches):
        sess.run(nxt)
      wall = time.perf_counter() - t
  queue.put({"mode": "input", "batch_size": batch,
             "images_per_sec": batches * batch / wall})


def _measure_layers(precision, settings, queue):
  """Child process: PrimaryCaps' convolution (forward and both gradients) by
  each method, ms (median of 5), at the benchmark's batch."""
  _child_tensorflow()
  from capsnet.model import fast_conv
  from capsnet.model import network
  from capsnet.running import planner
  cfg = network.ModelConfig(precision=precision)
  conv = planner.convolutions(cfg, settings["batch_size"])[1]
  dtype = planner.compute_dtype(cfg)
  queue.put({"mode": "layers", "precision": precision, "layer": conv.layer,
             "ms": {m: 1e3 * t for m, t in planner.time_methods(
                 conv, fast_conv.candidates(conv.stride), dtype, True, repeats=5,
                 warmup=2).items()},
             "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


def _matmul_peak(dtype_name, n, queue, reps=10):
  """Child process: best GFLOP/s of four independent n x n matmuls.

  The operands are variables already in the dtype and only one element of
  each product is fetched, so the timed work is the matmuls alone.
  """
  tf = _child_tensorflow()
  dtype = tf.as_dtype(dtype_name)
  with tf.Graph().as_default():
    init = tf.random_normal_initializer()
    mats = [tf.compat.v1.get_variable(f"m{i}", [n, n], dtype, init) for i in range(5)]
    prods = [tf.matmul(a, mats[4])[0, 0] for a in mats[:4]]
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      sess.run(prods)
      best = float("inf")
      for _ in range(reps):
        t = time.perf_counter()
        sess.run(prods)
        best = min(best, time.perf_counter() - t)
  queue.put(4 * 2 * n ** 3 / best / 1e9)


def _child_tensorflow():
  """TensorFlow in a child as train.py imports it (`startup`: no Keras and,
  unless the user set TF_CPP_MIN_LOG_LEVEL, no start-up notices), in graph
  mode."""
  startup.import_tensorflow()
  import tensorflow as tf
  tf.compat.v1.disable_eager_execution()
  return tf


def _in_child(target, *args):
  ctx = multiprocessing.get_context("spawn")
  queue = ctx.Queue()
  proc = ctx.Process(target=target, args=(*args, queue))
  proc.start()
  result = queue.get()
  proc.join()
  return result


def _label(r):
  return r["variant"] if r["variant"] == "tiled" else f"{r['variant']}/{r['conv']}"


def _one_round(settings, precisions, variants, modes, convs=("custom_grad",)):
  """Every measurement once, each in a fresh child; ratios within the round."""
  peaks = {p: _in_child(_matmul_peak, "float32" if p == "fp32" else "bfloat16",
                        settings["peak_size"])
           for p in ["fp32"] + [p for p in precisions if p != "fp32"]}
  print("matmul peak: " + ", ".join(f"{p} {g:.0f} GFLOP/s" for p, g in peaks.items()),
        flush=True)
  results = []
  if "input" in modes:
    r = _in_child(_measure_input, settings)
    results.append(r)
    print(f"input pipeline (shift augmentation, batch {r['batch_size']}): "
          f"{r['images_per_sec']:.0f} images/s", flush=True)
  ratios = {}
  if "layers" in modes:
    for precision in precisions:
      r = _in_child(_measure_layers, precision, settings)
      results.append(r)
      ms = r["ms"]
      ratios[f"layers_{precision}_conv2d_over_dft"] = ms["conv2d"] / ms["dft"]
      print(f"layers {precision:4s} {r['layer']} forward + gradients: " + ", ".join(
          f"{m} {t:.1f} ms" for m, t in ms.items())
          + f"; conv2d/dft {ms['conv2d'] / ms['dft']:.2f}x", flush=True)
  for mode in (m for m in modes if m in ("train", "infer")):
    for precision in precisions:
      for variant, conv in [(v, c) for v in variants for c in
                            (convs if v == "ours" else ("conv2d",))]:
        r = _in_child(_measure, variant, precision, mode, settings, conv)
        r["fraction_of_fp32_peak"] = r["gflops"] / peaks["fp32"]
        r["fraction_of_peak"] = r["gflops"] / peaks[precision]
        r["fp32_limit_images_per_sec"] = peaks["fp32"] / r["gflop_per_image"]
        results.append(r)
        plan = (f"  plan {r['plan']} ({r['planning_s']:.1f} s)"
                if r["planning_s"] is not None else "")
        print(f"{mode:5s} {precision:4s} {_label(r):17s} {r['images_per_sec']:7.1f} "
              f"images/s {r['gflops']:6.1f} GFLOP/s = {r['fraction_of_peak']:.2f} of "
              f"{precision} peak  peak RSS {r['peak_rss_mib']:6.0f} MiB{plan}", flush=True)
  for mode in (m for m in modes if m in ("train", "infer")):
    by = {(r["precision"], _label(r)): r["images_per_sec"]
          for r in results if r["mode"] == mode}
    main = f"ours/{convs[0]}"
    for p in precisions:
      if (p, main) in by and (p, "tiled") in by:
        ratios[f"{mode}_{p}_ours_over_tiled"] = by[(p, main)] / by[(p, "tiled")]
      if convs[0] == "planned":
        for conv in convs[1:]:
          if (p, f"ours/{conv}") in by and (p, main) in by:
            ratios[f"{mode}_{p}_planned_over_{conv}"] = by[(p, main)] / by[(p, f"ours/{conv}")]
    if ("bf16", main) in by and ("fp32", main) in by:
      ratios[f"{mode}_bf16_over_fp32"] = by[("bf16", main)] / by[("fp32", main)]
  if "input" in modes and "train" in modes:
    fed = results[0]["images_per_sec"]
    for r in results:
      if r["mode"] == "train" and r["variant"] == "ours" and r["conv"] == convs[0]:
        ratios[f"input_over_train_{r['precision']}"] = fed / r["images_per_sec"]
  return {"matmul_peak_gflops": peaks, "results": results, "ratios": ratios}


def summarize(rounds):
  """Medians over rounds: of each figure, and of each within-round ratio and
  fraction of the same round's peak (peak RSS: the largest)."""
  def key(r):
    return (r["mode"], r.get("precision"), r.get("variant"), r.get("conv"))
  results = []
  for first in rounds[0]["results"]:
    same = [r for rnd in rounds for r in rnd["results"] if key(r) == key(first)]
    merged = dict(first)
    for name, value in first.items():
      if isinstance(value, float):
        pick = max if name == "peak_rss_mib" else statistics.median
        merged[name] = pick(r[name] for r in same)
    if "ms" in first:   # layers: the median of each method's time
      merged["ms"] = {m: statistics.median(r["ms"][m] for r in same) for m in first["ms"]}
    results.append(merged)
  medians = lambda field: {k: statistics.median(rnd[field][k] for rnd in rounds)
                           for k in rounds[0][field]}
  return {"matmul_peak_gflops": medians("matmul_peak_gflops"), "results": results,
          "ratios": medians("ratios")}


def run(settings, precisions, variants, modes, rounds=1, convs=("custom_grad",)):
  """`rounds` interleaved rounds of every measurement, then their medians:
  the machine drifts by 10-20% over minutes, so a figure measured once, or
  all figures of one kind in a row, would compare different machine states."""
  per_round = []
  for n in range(rounds):
    print(f"-- round {n + 1} of {rounds}", flush=True)
    per_round.append(_one_round(settings, precisions, variants, modes, convs))
  summary = summarize(per_round)
  print(f"-- median of {rounds} round(s)")
  for r in summary["results"]:
    if r["mode"] == "input":
      print(f"input pipeline {r['images_per_sec']:.0f} images/s")
    elif r["mode"] == "layers":
      print(f"layers {r['precision']:4s} {r['layer']}: " + ", ".join(
          f"{m} {t:.1f} ms" for m, t in r["ms"].items()))
    else:
      plan = f"  plan {r['plan']}" if r["conv"] == "planned" else ""
      print(f"{r['mode']:5s} {r['precision']:4s} {_label(r):17s} "
            f"{r['images_per_sec']:7.1f} images/s  {r['fraction_of_peak']:.2f} "
            f"of {r['precision']} peak  peak RSS {r['peak_rss_mib']:6.0f} MiB{plan}")
  print("matmul peak: " + ", ".join(
      f"{p} {g:.0f} GFLOP/s" for p, g in summary["matmul_peak_gflops"].items()))
  for k, v in summary["ratios"].items():
    spread = [rnd["ratios"][k] for rnd in per_round]
    print(f"{k}: {v:.2f}x  (rounds: {', '.join(f'{x:.2f}' for x in spread)})")
  return {"settings": dict(settings, rounds=rounds, convs=list(convs)),
          "host": host.describe(), **summary, "rounds": per_round}


def host_file(root=None):
  """bench_results/<CPU model>.<its best kernel flag>.json."""
  facts = host.describe()
  model = re.sub(r"\((R|TM)\)", "", facts["cpu"], flags=re.I)
  model = re.sub(r"[^A-Za-z0-9]+", "-", model).strip("-") or "unknown-cpu"
  best = next((f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2")
               if f in facts["flags"]), "baseline")
  root = root or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "bench_results")
  return os.path.join(root, f"{model}.{best}.json")


def main(argv):
  del argv
  settings = {"batch_size": FLAGS.batch_size, "iter_routing": FLAGS.iter_routing,
              "conv": FLAGS.convs[0] if FLAGS.convs else "custom_grad",
              "steps": FLAGS.steps, "warmup": FLAGS.warmup, "peak_size": FLAGS.peak_size}
  for c in FLAGS.convs:
    if c not in CONVS:
      raise app.UsageError(f"--convs: {c!r} is not one of {', '.join(CONVS)}")
  for p in FLAGS.precision:
    if p not in ("fp32", "bf16"):
      raise app.UsageError(f"--precision: {p!r} is not fp32 or bf16")
  for m in FLAGS.modes:
    if m not in MODES:
      raise app.UsageError(f"--modes: {m!r} is not train, infer, input or layers")
  for v in FLAGS.variants:
    if v not in ("ours", "tiled"):
      raise app.UsageError(f"--variants: {v!r} is not ours or tiled")
  if FLAGS.profile:
    report = profile(settings, FLAGS.precision)
  else:
    report = run(settings, FLAGS.precision, FLAGS.variants, FLAGS.modes,
                 FLAGS.rounds, tuple(FLAGS.convs) or ("custom_grad",))
  if FLAGS.json:
    files.write_json(FLAGS.json, report)
  if FLAGS.host_file and not FLAGS.profile:
    files.write_json(host_file(), report)
    print(f"wrote {host_file()}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
