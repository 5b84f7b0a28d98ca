"""Speed and memory of the CapsNet step, against the machine's own limit.

  python -m capsnet.bench                       # fp32 and bf16, train and infer
  python -m capsnet.bench --precision=fp32 --json=bench.json
  python -m capsnet.bench --profile               # where the step's time goes

For each (variant, precision, mode) a fresh child process builds the paper
model, runs --warmup steps, then times --steps steps one by one and reports
the median images/s, the achieved GFLOP/s (analytic FLOP count, below), its
fraction of the fp32 matmul peak measured in the same round, and the child's
peak RSS. All of it is repeated in --rounds interleaved rounds, and the
report gives the medians over rounds (of the ratios too, each taken within
its round). `tiled` is the naive baseline: W and u tiled over the batch and
routing as the well-known TF1 reference does it (`tiled_digit_caps`), with
TensorFlow's own convolution gradients.
"""
import dataclasses
import multiprocessing
import resource
import statistics
import time

from absl import app
from absl import flags

from capsnet.running import files
from capsnet.running import startup


def define_flags():
  """The command-line flags; defined when run as a program only, so that
  importing this module (tests, other tools) adds no global flags."""
  flags.DEFINE_integer("batch_size", 128, "images per step", lower_bound=1)
  flags.DEFINE_integer("iter_routing", 3, "routing iterations", lower_bound=1)
  flags.DEFINE_list("precision", ["fp32", "bf16"], "precisions to measure")
  flags.DEFINE_list("variants", ["ours", "tiled"], "ours and/or tiled (baseline)")
  flags.DEFINE_list("modes", ["train", "infer", "input"],
                    "train, infer (model steps) and/or input (the training input "
                    "pipeline alone: shuffle order, shift augmentation, batching)")
  flags.DEFINE_enum("conv_impl", "custom_grad", ["custom_grad", "conv2d"],
                    "convolution gradients of `ours` (the baseline uses conv2d)")
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


def tiled_digit_caps(u, out_caps, out_dim, num_iters, stop_gradient):
  """Baseline DigitCaps: W and u tiled over the batch, routing as in the TF1
  reference (its `routing()` in capsLayer.py): `s_j` by broadcast multiply
  and reduce, the agreement by tiling `v_j` over the input capsules and a
  batched [16, 1]^T [16, 1] matmul. Logits are per example, as in our model
  (the reference sums them over the batch), and the inner iterations read a
  stopped `u_hat` when `stop_gradient`.

  The signature, results and variable of `layers.digit_caps` (W [in_caps,
  out_caps, in_dim, out_dim]), so that `network.forward` takes it in place of
  ours and the rest of the model (losses, decoder) is the same.
  """
  import tensorflow as tf
  from capsnet.model import routing
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
  from capsnet.model import network
  if variant == "ours":
    out = network.forward(images, labels, cfg, training=train)
  else:
    baseline = dataclasses.replace(cfg, conv_impl="conv2d")
    out = network.forward(images, labels, baseline, training=train,
                        digit_caps=tiled_digit_caps)
  if not train:
    return out.predictions
  opt = tf.compat.v1.train.AdamOptimizer(1e-3)
  return opt.minimize(out.loss)


def _step_graph(variant, precision, mode, settings):
  """In the default graph: the config and the step op on a fixed batch."""
  import numpy as np
  import tensorflow as tf
  from capsnet.model import network
  cfg = network.ModelConfig(iter_routing=settings["iter_routing"], precision=precision,
                          conv_impl=settings["conv_impl"])
  batch = settings["batch_size"]
  rng = np.random.RandomState(0)
  # Variables, not constants: grappler would fold whatever depends on the
  # images alone (e.g. Conv1's patches) and time less than training does.
  images = tf.Variable(rng.rand(batch, 28, 28, 1).astype(np.float32),
                       trainable=False)
  labels = tf.Variable(rng.randint(0, 10, batch).astype(np.int32),
                       trainable=False)
  return cfg, _build(variant, cfg, images, labels, mode == "train")


def _measure(variant, precision, mode, settings, queue):
  """Child process: time one configuration, put a result dict on `queue`."""
  tf = _child_tensorflow()
  batch = settings["batch_size"]
  with tf.Graph().as_default():
    cfg, op = _step_graph(variant, precision, mode, settings)
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
    _, op = _step_graph("ours", precision, "train", settings)
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


def _one_round(settings, precisions, variants, modes):
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
  for mode in (m for m in modes if m != "input"):
    for precision in precisions:
      for variant in variants:
        r = _in_child(_measure, variant, precision, mode, settings)
        r["fraction_of_fp32_peak"] = r["gflops"] / peaks["fp32"]
        r["fp32_limit_images_per_sec"] = peaks["fp32"] / r["gflop_per_image"]
        results.append(r)
        print(f"{mode:5s} {precision:4s} {variant:5s} {r['images_per_sec']:7.1f} images/s "
              f"{r['gflops']:6.1f} GFLOP/s = {r['fraction_of_fp32_peak']:.2f} of fp32 "
              f"peak  peak RSS {r['peak_rss_mib']:6.0f} MiB", flush=True)
  ratios = {}
  for mode in (m for m in modes if m != "input"):
    by = {(r["precision"], r["variant"]): r["images_per_sec"]
          for r in results if r["mode"] == mode}
    for p in precisions:
      if (p, "ours") in by and (p, "tiled") in by:
        ratios[f"{mode}_{p}_ours_over_tiled"] = by[(p, "ours")] / by[(p, "tiled")]
    if ("bf16", "ours") in by and ("fp32", "ours") in by:
      ratios[f"{mode}_bf16_over_fp32"] = by[("bf16", "ours")] / by[("fp32", "ours")]
  if "input" in modes and "train" in modes:
    fed = results[0]["images_per_sec"]
    for r in results:
      if r["mode"] == "train" and r["variant"] == "ours":
        ratios[f"input_over_train_{r['precision']}"] = fed / r["images_per_sec"]
  return {"matmul_peak_gflops": peaks, "results": results, "ratios": ratios}


def summarize(rounds):
  """Medians over rounds: of each figure, and of each within-round ratio and
  fraction of the same round's peak (peak RSS: the largest)."""
  def key(r):
    return (r["mode"], r.get("precision"), r.get("variant"))
  results = []
  for first in rounds[0]["results"]:
    same = [r for rnd in rounds for r in rnd["results"] if key(r) == key(first)]
    merged = dict(first)
    for name, value in first.items():
      if isinstance(value, float):
        pick = max if name == "peak_rss_mib" else statistics.median
        merged[name] = pick(r[name] for r in same)
    results.append(merged)
  medians = lambda field: {k: statistics.median(rnd[field][k] for rnd in rounds)
                           for k in rounds[0][field]}
  return {"matmul_peak_gflops": medians("matmul_peak_gflops"), "results": results,
          "ratios": medians("ratios")}


def run(settings, precisions, variants, modes, rounds=1):
  """`rounds` interleaved rounds of every measurement, then their medians:
  the machine drifts by 10-20% over minutes, so a figure measured once, or
  all figures of one kind in a row, would compare different machine states."""
  per_round = []
  for n in range(rounds):
    print(f"-- round {n + 1} of {rounds}", flush=True)
    per_round.append(_one_round(settings, precisions, variants, modes))
  summary = summarize(per_round)
  print(f"-- median of {rounds} round(s)")
  for r in summary["results"]:
    if r["mode"] == "input":
      print(f"input pipeline {r['images_per_sec']:.0f} images/s")
    else:
      print(f"{r['mode']:5s} {r['precision']:4s} {r['variant']:5s} "
            f"{r['images_per_sec']:7.1f} images/s  {r['fraction_of_fp32_peak']:.2f} "
            f"of fp32 peak  peak RSS {r['peak_rss_mib']:6.0f} MiB")
  print("matmul peak: " + ", ".join(
      f"{p} {g:.0f} GFLOP/s" for p, g in summary["matmul_peak_gflops"].items()))
  for k, v in summary["ratios"].items():
    spread = [rnd["ratios"][k] for rnd in per_round]
    print(f"{k}: {v:.2f}x  (rounds: {', '.join(f'{x:.2f}' for x in spread)})")
  return {"settings": dict(settings, rounds=rounds), **summary, "rounds": per_round}


def main(argv):
  del argv
  settings = {"batch_size": FLAGS.batch_size, "iter_routing": FLAGS.iter_routing,
              "conv_impl": FLAGS.conv_impl, "steps": FLAGS.steps,
              "warmup": FLAGS.warmup, "peak_size": FLAGS.peak_size}
  for p in FLAGS.precision:
    if p not in ("fp32", "bf16"):
      raise app.UsageError(f"--precision: {p!r} is not fp32 or bf16")
  for m in FLAGS.modes:
    if m not in ("train", "infer", "input"):
      raise app.UsageError(f"--modes: {m!r} is not train, infer or input")
  for v in FLAGS.variants:
    if v not in ("ours", "tiled"):
      raise app.UsageError(f"--variants: {v!r} is not ours or tiled")
  if FLAGS.profile:
    report = profile(settings, FLAGS.precision)
  else:
    report = run(settings, FLAGS.precision, FLAGS.variants, FLAGS.modes,
                 FLAGS.rounds)
  if FLAGS.json:
    files.write_json(FLAGS.json, report)


if __name__ == "__main__":
  define_flags()
  app.run(main)
