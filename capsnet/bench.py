"""Speed and memory of the CapsNet step, against the machine's own limit.

  python -m capsnet.bench                       # fp32 and bf16, train and infer
  python -m capsnet.bench --precision=fp32 --json=bench.json
  python -m capsnet.bench --profile               # where the step's time goes

Each measurement runs in a fresh child process, in --rounds interleaved rounds;
the report gives medians and says when the machine was not idle. How to read the
figures, and today's: docs/performance.md.
"""
import dataclasses
import multiprocessing
import os
import re
import resource
import statistics
import time

from absl import app
from absl import flags

from capsnet import roofline
from capsnet.running import files
from capsnet.running import host
from capsnet.running import startup

CONVS = ("planned", "custom_grad", "conv2d", "dft")
MODES = ("train", "infer", "input", "layers", "routing")
PRECISIONS = ("fp32", "bf16")
VARIANTS = ("ours", "tiled")


def define_flags():
  """The flags, defined only when run as a program."""
  flags.DEFINE_integer("batch_size", 128, "images per step", lower_bound=1)
  flags.DEFINE_integer("iter_routing", 3, "routing iterations", lower_bound=1)
  flags.DEFINE_list("precision", ["fp32", "bf16"], "precisions to measure")
  flags.DEFINE_list("variants", ["ours", "tiled"], "ours and/or tiled (baseline)")
  flags.DEFINE_list("modes", ["train", "infer", "input", "layers"],
                    "train, infer (model steps), input (the training input "
                    "pipeline alone: shuffle order, shift augmentation, batching) "
                    "and/or layers (PrimaryCaps' convolution by each method); "
                    "routing (routing alone, in float32 as under both precisions: "
                    "the paper's sums against the model's matmuls) when asked")
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
  flags.DEFINE_integer("bandwidth_mb", 256, "MiB summed to measure the memory "
                       "bandwidth (well above the caches)", lower_bound=1)
  flags.DEFINE_integer("rounds", 3, "interleaved rounds of every measurement; the "
                       "report gives their medians", lower_bound=1)
  flags.DEFINE_string("json", None, "also write the results here")
  flags.DEFINE_bool("profile", False, "instead: where our training step's time "
                    "goes (per layer and top ops, from a step trace), for each "
                    "--precision")


FLAGS = flags.FLAGS


def tiled_digit_caps(u, out_caps, out_dim, num_iters, stop_gradient, official=False):
  """Baseline DigitCaps as the TF1 reference's `routing()` (capsLayer.py): W and
  u tiled over the batch, `s_j` by broadcast multiply and reduce, the agreement
  by tiling `v_j`. Logits per example and the stop as in ours; the signature,
  results and variable of `layers.digit_caps`, paper's layers only."""
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
  """The step op: a train op, or the inference predictions."""
  import tensorflow as tf
  predictions, loss = model(variant, cfg, images, labels, train)
  if not train:
    return predictions
  return tf.compat.v1.train.AdamOptimizer(1e-3).minimize(loss)


def model(variant, cfg, images, labels, train):
  """(predictions, loss) of `variant`'s model; the baseline is ours with
  `tiled_digit_caps` and TensorFlow's convolutions."""
  import tensorflow as tf

  from capsnet.model import layers
  from capsnet.model import network
  from capsnet.model import routing
  if variant == "ours":
    out = network.forward(images, labels, cfg, training=train)
    predictions, loss = out.predictions, out.loss
  else:
    precision = network.precision_policy(cfg)
    images = tf.cast(images, precision.variables)
    with tf.compat.v1.variable_scope("capsnet"):
      x = layers.conv1(images, cfg.conv1_channels, cfg.conv1_kernel, precision, "conv2d")
      u = layers.primary_caps(x, cfg.primary_types, cfg.primary_dim, cfg.primary_kernel,
                              cfg.primary_stride, precision, "conv2d")
      v, _, _ = tiled_digit_caps(u, cfg.num_classes, cfg.digit_dim, cfg.iter_routing,
                                 cfg.stop_gradient)
      predictions, _, margin, recon_loss, _ = network.HEADS["one_digit"].build(
          v, routing.safe_norm(v), tf.cast(labels, tf.int32), images, cfg, train)
      loss = tf.reduce_mean(margin + recon_loss)
  return predictions, loss


def _step_graph(variant, precision, mode, settings, conv="custom_grad"):
  """(cfg, the step op on a fixed batch, the planning's seconds or None) in the
  default graph; `conv` "planned" plans (or reads the cache)."""
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
      step = statistics.median(_seconds(sess, op, settings["warmup"], settings["steps"]))
  gflop = roofline.nominal_flops(cfg, batch, mode == "train") / 1e9
  costs = {}
  if mode == "train" and variant == "ours":
    costs = {part: [c.flops, c.bytes] for part, c in roofline.step_costs(
        cfg, batch, roofline.methods_of(cfg)).items()}
  queue.put({"costs": costs,"variant": variant, "precision": precision, "mode": mode,
             "conv": conv if variant == "ours" else "conv2d", "plan": cfg.conv_plan,
             "planning_s": planning,
             "batch_size": batch, "images_per_sec": batch / step,
             "step_ms": 1000 * step, "gflop_per_image": gflop / batch,
             "gflops": gflop / step,
             "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


def _profile(precision, settings, queue, traces=3, top=12):
  """Child process: per-op times of our training step from step traces, ops one
  at a time so that they add up; per part (`roofline`), the top ops and each
  part's costs."""
  import collections
  tf = _child_tensorflow()
  per_op = collections.Counter()
  with tf.Graph().as_default():
    cfg, op, _ = _step_graph("ours", precision, "train", settings, settings["conv"])
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1)
    with tf.compat.v1.Session(config=config) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      step_ms = 1000 * _seconds(sess, op, settings["warmup"], 1)[0]
      options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
      for _ in range(traces):
        meta = tf.compat.v1.RunMetadata()
        sess.run(op, options=options, run_metadata=meta)
        for device in meta.step_stats.dev_stats:
          for node in device.node_stats:
            per_op[node.node_name] += node.all_end_rel_micros / 1000 / traces
  parts = collections.Counter()
  for name, ms in per_op.items():
    parts[roofline.part_of(name)] += ms
  costs = roofline.step_costs(cfg, settings["batch_size"], roofline.methods_of(cfg))
  queue.put({"precision": precision, "plan": cfg.conv_plan, "untraced_step_ms": step_ms,
             "traced_ms": sum(per_op.values()), "parts": dict(parts),
             "costs": {p: [c.flops, c.bytes] for p, c in costs.items()},
             "top_ops": per_op.most_common(top)})


def profile(settings, precisions):
  """Prints where the training step's time goes, per precision, each part
  against its roofline (peak and bandwidth measured in the same run)."""
  reports, busy = [], []
  _idle("the memory bandwidth", busy)
  bandwidth = _in_child(_bandwidth, settings["bandwidth_mb"])
  for precision in precisions:
    _idle(f"the {precision} profile", busy)
    peak = _in_child(_matmul_peak, "float32" if precision == "fp32" else "bfloat16",
                     settings["peak_size"])
    r = _in_child(_profile, precision, settings)
    costs = {p: roofline.Cost(*fb) for p, fb in r["costs"].items()}
    r.update(matmul_peak_gflops=peak, bandwidth_gbs=bandwidth, busy_cores=busy[-1],
             roofline=roofline.table(costs, r["parts"], peak, bandwidth))
    reports.append(r)
    print(f"-- {precision}: traced ops {r['traced_ms']:.0f} ms (untraced step "
          f"{r['untraced_step_ms']:.0f} ms), plan {r['plan'] or settings['conv']}; "
          f"matmul peak {peak:.0f} GFLOP/s, memory bandwidth {bandwidth:.1f} GB/s")
    print(roofline_lines(r["roofline"]))
    print("top ops:")
    for name, ms in r["top_ops"]:
      print(f"{ms:8.1f} ms  {name}")
  return {"settings": settings, "profiles": reports}


def roofline_lines(rows):
  """The roofline table as text: a line a part, then the step."""
  lines = [f"{'part':48s} {'ms':>8s} {'GFLOP':>7s} {'MB':>7s} {'limit ms':>9s}  of limit"]
  for r in rows:
    title = "the step (parts' limits summed)" if r["part"] == "step" else \
        roofline.TITLES[r["part"]]
    fraction = "n/a" if r["part"] == "other" or not r["limit_ms"] else \
        f"{r['fraction']:.2f}"
    lines.append(f"{title[:48]:48s} {r['ms']:8.1f} {r['gflop']:7.2f} {r['mb']:7.0f} "
                 f"{r['limit_ms']:9.1f}  {fraction}")
  return "\n".join(lines)


def _bandwidth(megabytes, queue, reps=5):
  """Child process: memory bandwidth in GB/s, the best rate of two streaming
  forms (a sum: one read; `assign_add`: two reads and a write, as an
  optimizer's update) over arrays of 32 MiB (the size of Adam's, partly in
  a large L3) and of `megabytes`, each the best of `reps` runs, every core."""
  tf = _child_tensorflow()
  best_rate = 0.0
  for size in sorted({32, megabytes}):
    n = size * 2 ** 20 // 4
    with tf.Graph().as_default():
      x = tf.compat.v1.get_variable("x", [n], tf.float32, tf.ones_initializer())
      y = tf.compat.v1.get_variable("y", [n], tf.float32, tf.ones_initializer())
      forms = {"sum": (tf.reduce_sum(x), 4 * n),
               "update": (tf.compat.v1.assign_add(y, x).op, 12 * n)}
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for op, moved in forms.values():
          best_rate = max(best_rate, moved / min(_seconds(sess, op, 1, reps)) / 1e9)
  queue.put(best_rate)


def _seconds(sess, op, warmup, runs):
  """The seconds of each of `runs` runs of `op`, after `warmup` untimed ones."""
  for _ in range(warmup):
    sess.run(op)
  times = []
  for _ in range(runs):
    t = time.perf_counter()
    sess.run(op)
    times.append(time.perf_counter() - t)
  return times


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
  each method, ms (median of 5)."""
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


def _measure_routing(settings, queue, repeats=7):
  """Child process: routing alone (the stop on, forward and the gradient to
  u_hat) at the paper's shapes in float32, by `routing.procedure_1` and by
  `routing.dynamic_routing`, in turn; median ms."""
  tf = _child_tensorflow()
  import numpy as np

  from capsnet.model import network
  from capsnet.model import routing
  cfg = network.ModelConfig()
  shape = [settings["batch_size"], cfg.in_caps, cfg.num_classes, cfg.digit_dim]
  forms = {"procedure_1": routing.procedure_1, "matmuls": routing.dynamic_routing}
  with tf.Graph().as_default():
    u_hat = tf.Variable(np.random.RandomState(0).normal(0, 0.05, shape).astype(
        cfg.dtype), name="u_hat")   # a variable: nothing is folded away
    ops = {}
    for name, form in forms.items():
      with tf.compat.v1.variable_scope(name):
        v, _ = form(u_hat, settings["iter_routing"])
        grad = tf.gradients(tf.reduce_sum(v * v), u_hat)[0]
        # A scalar of both fetched (a group of them is pruned away after its
        # first run): one pass over the gradient more, the same for each form.
        ops[name] = tf.reduce_sum(v) + tf.reduce_sum(grad)
    times = {name: [] for name in forms}
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      for i in range(2 + repeats):   # two untimed runs of each first
        for name, op in ops.items():
          t = time.perf_counter()
          sess.run(op)
          if i >= 2:
            times[name].append(time.perf_counter() - t)
  queue.put({"mode": "routing", "precision": cfg.dtype, "shape": shape,
             "iter_routing": settings["iter_routing"],
             "ms": {n: 1e3 * statistics.median(t) for n, t in times.items()},
             "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


def _matmul_peak(dtype_name, n, queue, reps=10):
  """Child process: best GFLOP/s of four independent n x n matmuls of variables,
  one element of each fetched."""
  tf = _child_tensorflow()
  dtype = tf.as_dtype(dtype_name)
  with tf.Graph().as_default():
    init = tf.random_normal_initializer()
    mats = [tf.compat.v1.get_variable(f"m{i}", [n, n], dtype, init) for i in range(5)]
    prods = [tf.matmul(a, mats[4])[0, 0] for a in mats[:4]]
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      best = min(_seconds(sess, prods, 1, reps))
  queue.put(4 * 2 * n ** 3 / best / 1e9)


def _child_tensorflow():
  """TensorFlow in a child as train.py imports it, graph mode."""
  startup.import_tensorflow()
  import tensorflow as tf
  tf.compat.v1.disable_eager_execution()
  return tf


def _idle(label, samples):
  """Appends how busy other programs keep the machine to `samples`, saying it in
  one line if not idle."""
  cores = host.others_busy()
  samples.append(cores or 0.0)
  line = host.busy_line(f"bench: before {label}", cores)
  if line:
    print(line + "; its figures are marked not idle", flush=True)


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
  busy = []
  _idle("the matmul peak", busy)
  peaks = {p: _in_child(_matmul_peak, "float32" if p == "fp32" else "bfloat16",
                        settings["peak_size"])
           for p in ["fp32"] + [p for p in precisions if p != "fp32"]}
  bandwidth = _in_child(_bandwidth, settings["bandwidth_mb"])
  print(_machine_line(peaks, bandwidth), flush=True)
  results = []
  if "input" in modes:
    _idle("the input pipeline", busy)
    results.append(_in_child(_measure_input, settings))
    print(_line(results[-1]), flush=True)
  ratios = {}
  if "layers" in modes:
    for precision in precisions:
      _idle(f"layers {precision}", busy)
      r = _in_child(_measure_layers, precision, settings)
      results.append(r)
      ratios[f"layers_{precision}_conv2d_over_dft"] = r["ms"]["conv2d"] / r["ms"]["dft"]
      print(_line(r), flush=True)
  if "routing" in modes:   # in float32 under either precision: measured once
    _idle("routing", busy)
    r = _in_child(_measure_routing, settings)
    results.append(r)
    ratios["routing_procedure_1_over_matmuls"] = r["ms"]["procedure_1"] / r["ms"]["matmuls"]
    print(_line(r), flush=True)
  for mode in (m for m in modes if m in ("train", "infer")):
    for precision in precisions:
      for variant, conv in [(v, c) for v in variants for c in
                            (convs if v == "ours" else ("conv2d",))]:
        _idle(f"{mode} {precision} {variant}/{conv}", busy)
        r = _in_child(_measure, variant, precision, mode, settings, conv)
        r["busy_cores"] = busy[-1]
        r["fraction_of_fp32_peak"] = r["gflops"] / peaks["fp32"]
        r["fraction_of_peak"] = r["gflops"] / peaks[precision]
        r["fp32_limit_images_per_sec"] = peaks["fp32"] / r["gflop_per_image"]
        costs = r.pop("costs")
        if costs:   # ours, training: the method's own FLOPs against the roofline
          costs = [roofline.Cost(*fb) for fb in costs.values()]
          r["method_gflop"] = sum(c.flops for c in costs) / 1e9
          r["limit_ms"] = 1e3 * sum(c.limit(peaks[precision], bandwidth) for c in costs)
          r["fraction_of_limit"] = r["limit_ms"] / r["step_ms"]
        results.append(r)
        print(_line(r), flush=True)
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
  return {"matmul_peak_gflops": peaks, "bandwidth_gbs": bandwidth, "results": results,
          "ratios": ratios, "busy_cores": max(busy)}


def _machine_line(peaks, bandwidth):
  return ("matmul peak: " + ", ".join(f"{p} {g:.0f} GFLOP/s" for p, g in peaks.items())
          + f"; memory bandwidth {bandwidth:.1f} GB/s")


def _line(r):
  """A measurement in one line (as each round measures it, and the medians)."""
  if r["mode"] == "input":
    return (f"input pipeline (shift augmentation, batch {r['batch_size']}): "
            f"{r['images_per_sec']:.0f} images/s")
  if r["mode"] in ("layers", "routing"):
    what = (f"{r['layer']} forward + gradients" if r["mode"] == "layers" else
            f"r = {r['iter_routing']}, u_hat {r['shape']}, forward + gradient")
    return (f"{r['mode']} {r['precision']:4s} {what}: "
            + ", ".join(f"{m} {t:.1f} ms" for m, t in r["ms"].items()))
  plan = (f"  plan {r['plan']} ({r['planning_s']:.1f} s)"
          if r["planning_s"] is not None else "")
  return (f"{r['mode']:5s} {r['precision']:4s} {_label(r):17s} {r['images_per_sec']:7.1f} "
          f"images/s  {_against(r)}  peak RSS {r['peak_rss_mib']:6.0f} MiB{plan}")


def _against(r):
  """Our training step's GFLOP/s and fraction of its roofline; else GFLOP/s by
  the nominal count (`roofline.nominal_flops`)."""
  if "fraction_of_limit" in r:
    return (f"{r['method_gflop'] / r['step_ms'] * 1e3:6.1f} GFLOP/s, "
            f"{r['fraction_of_limit']:.2f} of its limit ({r['limit_ms']:.0f} ms)")
  return f"{r['gflops']:6.1f} GFLOP/s (direct-convolution count)"


def summarize(rounds):
  """Medians over rounds of each figure and within-round ratio (peak RSS: the
  largest)."""
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
  def medians(field):
    return {k: statistics.median(rnd[field][k] for rnd in rounds)
            for k in rounds[0][field]}
  busiest = max(r.get("busy_cores", 0.0) for r in rounds)
  return {"matmul_peak_gflops": medians("matmul_peak_gflops"),
          "bandwidth_gbs": statistics.median(r.get("bandwidth_gbs", 0) for r in rounds),
          "results": results, "ratios": medians("ratios"), "busy_cores": busiest,
          "idle": busiest < host.BUSY_CORES}


def run(settings, precisions, variants, modes, rounds=1, convs=("custom_grad",)):
  """`rounds` interleaved rounds of every measurement, then the medians (the
  machine drifts by 10-20% over minutes)."""
  per_round = []
  for n in range(rounds):
    print(f"-- round {n + 1} of {rounds}", flush=True)
    per_round.append(_one_round(settings, precisions, variants, modes, convs))
  summary = summarize(per_round)
  print(f"-- median of {rounds} round(s)")
  for r in summary["results"]:
    print(_line(r))
  print(_machine_line(summary["matmul_peak_gflops"], summary["bandwidth_gbs"]))
  for k, v in summary["ratios"].items():
    spread = [rnd["ratios"][k] for rnd in per_round]
    print(f"{k}: {v:.2f}x  (rounds: {', '.join(f'{x:.2f}' for x in spread)})")
  if not summary["idle"]:
    print(f"NOT IDLE: other programs kept up to {summary['busy_cores']:.1f} cores busy "
          "during these rounds; the report is marked so (\"idle\": false)")
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
              "steps": FLAGS.steps, "warmup": FLAGS.warmup, "peak_size": FLAGS.peak_size,
              "bandwidth_mb": FLAGS.bandwidth_mb}
  for name, allowed in (("convs", CONVS), ("precision", PRECISIONS), ("modes", MODES),
                        ("variants", VARIANTS)):
    bad = [v for v in FLAGS[name].value if v not in allowed]
    if bad:
      raise app.UsageError(f"--{name}: {bad[0]!r} is not one of {', '.join(allowed)}")
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
