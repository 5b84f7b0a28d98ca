"""A plan per host: each convolution's fastest `fast_conv` method, timed on the
layer's real shapes, dtype and batch (forward and gradients, or the forward
alone for inference), as FFTW's planner and cuDNN's benchmark mode do, and
cached (`cache_path`) under a key of the CPU, TensorFlow, oneDNN, shapes, dtype,
batch and mode (docs/performance.md). On a GPU nothing is planned. The
program: `python -m capsnet.plan`.
"""
import dataclasses
import hashlib
import inspect
import json
import os
import statistics
import sys
import time

from capsnet.running import startup

startup.import_tensorflow()   # before fast_conv imports it: oneDNN on, as in train.py
from capsnet.model import fast_conv  # noqa: E402
from capsnet.running import files  # noqa: E402
from capsnet.running import host  # noqa: E402

CACHE_VERSION = 1
REPEATS = 3        # timed runs of each candidate (the median counts)
WARMUP = 1         # untimed runs first (oneDNN builds its kernels)
GIVE_UP = 3.0      # a candidate whose warmup run is 3x the best so far is not timed


def cache_path():
  """$CAPSNET_CACHE_DIR, else $XDG_CACHE_HOME/capsnet, else ~/.cache/capsnet;
  the file conv_plans.json there."""
  folder = os.environ.get("CAPSNET_CACHE_DIR") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
      "capsnet")
  return os.path.join(folder, "conv_plans.json")


@dataclasses.dataclass(frozen=True)
class Conv:
  """One convolution of the model as it is computed: `[batch, h, w, c]` in,
  `kernel` x `kernel` x c x `channels` weights, `stride`, VALID."""
  layer: str
  batch: int
  height: int
  width: int
  in_channels: int
  kernel: int
  channels: int
  stride: int
  relu: bool
  input_grad: bool    # training needs the input's gradient (not Conv1's: the images)


def convolutions(cfg, batch):
  """The model's convolutions at this batch (per tower), Conv1 first."""
  return [Conv("conv1", batch, cfg.image_size, cfg.image_size, cfg.image_channels,
               cfg.conv1_kernel, cfg.conv1_channels, 1, True, False),
          Conv("primary_caps", batch, cfg.conv1_size, cfg.conv1_size, cfg.conv1_channels,
               cfg.primary_kernel, cfg.primary_types * cfg.primary_dim, cfg.primary_stride,
               False, True)]


def compute_dtype(cfg):
  """The convolutions' compute dtype's name: bfloat16 under bf16, else the
  variables' dtype."""
  return "bfloat16" if cfg.precision == "bf16" else cfg.dtype


def methods_digest():
  """The first 12 hex digits of the sha256 of `fast_conv`'s source: a plan
  timed with other code for the methods is measured again."""
  return hashlib.sha256(inspect.getsource(fast_conv).encode()).hexdigest()[:12]


def cache_key(conv, dtype, training):
  facts = host.describe()
  return json.dumps({"cpu": facts["cpu"], "flags": facts["flags"],
                     "tensorflow": facts["tensorflow"], "onednn": facts["onednn"],
                     "methods": methods_digest(), "dtype": dtype,
                     "training": training, **dataclasses.asdict(conv)}, sort_keys=True)


def time_methods(conv, methods, dtype, training, repeats=REPEATS, warmup=WARMUP,
                 give_up=None):
  """{method: median seconds of one run on `conv`}: the forward and, for
  training, the gradients, all in one graph over the same input and weights
  (variables, so that grappler folds nothing away).

  Every method is warmed up, then the timed runs alternate between the methods
  so that a slow moment falls on all alike. A method whose first timed run is
  over 1.5 times the best is not run again; with `give_up`, one whose first
  warmup is over `give_up` times the best so far is not timed at all.
  """
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  dt = tf.as_dtype(dtype)
  with tf.Graph().as_default():
    tf.compat.v1.set_random_seed(0)
    x = tf.Variable(tf.random.uniform([conv.batch, conv.height, conv.width,
                                       conv.in_channels]), trainable=False)
    w = tf.Variable(0.05 * tf.random.normal([conv.kernel, conv.kernel, conv.in_channels,
                                             conv.channels]))
    b = tf.Variable(tf.zeros([conv.channels]))
    xc, wc, bc = (tf.cast(t, dt) for t in (x, w, b))
    ops = {}
    for method in methods:
      y = fast_conv.conv2d(xc, wc, bc, conv.stride, method, conv.relu)
      outs = [y]
      if training:
        wrt = [xc, wc, bc] if conv.input_grad else [wc, bc]
        outs = tf.gradients(y, wrt, grad_ys=tf.ones_like(y))
      # Fetched, not grouped: a tf.group of ops without side effects is
      # pruned (measured: 0.3 ms for a convolution of 0.7 s). The sums cost
      # the same for every method.
      ops[method] = [tf.reduce_sum(tf.cast(t, tf.float32)) for t in outs]

    def timed(op):
      start = time.perf_counter()
      sess.run(op)
      return time.perf_counter() - start

    given_up, warm, runs = {}, {}, {m: [] for m in ops}
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      for method, op in ops.items():
        for k in range(warmup):
          seconds = timed(op)
          if k == 0:
            if give_up and warm and seconds > give_up * min(warm.values()):
              given_up[method] = seconds
              break
            warm[method] = seconds
      live = [m for m in ops if m not in given_up]
      for turn in range(repeats):
        for method in live:
          runs[method].append(timed(ops[method]))
        if turn == 0:   # those that cannot win run no more
          best = min(runs[m][0] for m in live)
          live = [m for m in live if runs[m][0] <= 1.5 * best]
  return {m: given_up[m] if m in given_up else statistics.median(runs[m]) for m in ops}


class Cache:
  """The plan cache file: read once, written whole (atomically) or not at all."""

  def __init__(self, path, log):
    self.path, self.log, self.entries = path, log, {}
    if not os.path.exists(path):
      return
    try:
      with open(path) as f:
        data = json.load(f)
      if data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"), dict):
        raise ValueError(f"version {data.get('version')!r}, expected {CACHE_VERSION}")
      self.entries = data["entries"]
    except (OSError, ValueError, AttributeError) as e:
      log(f"planner: the plan cache {path} cannot be used ({e}); planning afresh")

  def get(self, key):
    entry = self.entries.get(key)
    return entry if isinstance(entry, dict) and entry.get("method") in fast_conv.METHODS else None

  def put(self, key, entry):
    self.entries[key] = entry

  def save(self):
    try:
      os.makedirs(os.path.dirname(self.path), exist_ok=True)
      files.write_json(self.path, {"version": CACHE_VERSION, "entries": self.entries})
    except OSError as e:
      self.log(f"planner: cannot write the plan cache {self.path} "
               f"({e.strerror or e}); the plan is used without caching")


def _say(line):
  print(line, file=sys.stderr, flush=True)


def plan_convolutions(cfg, batch, training, device=None, path=None, log=_say,
                      timer=time_methods):
  """(The plan string for `ModelConfig.conv_plan`, {layer: {"method", "ms":
  {method: ms}, "cached"}}): each convolution's fastest method at `batch` (one
  tower's), with gradients if `training`, from the cache at `path` or timed by
  `timer` (`time_methods`'); on a GPU every one conv2d."""
  if fast_conv.on_gpu(device):
    methods = dict.fromkeys(fast_conv.LAYERS, "conv2d")
    return fast_conv.format_plan(methods), {
        layer: {"method": "conv2d", "ms": {}, "cached": False} for layer in methods}
  dtype = compute_dtype(cfg)
  cache = Cache(path or cache_path(), log)
  report, changed, said = {}, False, False
  busy = None   # cores other programs keep busy: sampled once, when first needed
  for conv in convolutions(cfg, batch):
    key = cache_key(conv, dtype, training)
    entry = cache.get(key)
    if entry is None or "busy_cores" in entry:
      busy = (host.others_busy() or 0.0) if busy is None else busy
      if entry is not None and busy < host.BUSY_CORES:
        entry = None   # measured on a busy machine, and this one is idle: again
    if entry is None:
      line = host.busy_line("planner", busy)
      if line and not said:
        log(line + "; the plan is cached marked so, and measured again when idle")
        said = True
      # The fewest FLOPs first (the DFT, then the direct forms, conv2d last),
      # so that a slow candidate is given up after its warmup run.
      seconds = timer(conv, fast_conv.candidates(conv.stride)[::-1], dtype, training,
                      give_up=GIVE_UP)
      ms = {m: round(1e3 * t, 3) for m, t in seconds.items()}
      entry = {"method": min(ms, key=ms.get), "ms": ms}
      if line:
        entry["busy_cores"] = round(busy, 2)
      cache.put(key, entry)
      changed = True
      report[conv.layer] = dict(entry, cached=False)
    else:
      report[conv.layer] = dict(entry, cached=True)
  if changed:
    cache.save()
  methods = {layer: r["method"] for layer, r in report.items()}
  return fast_conv.format_plan(methods), report


def planned_seconds(report):
  """The planned convolutions' time for one batch, in seconds."""
  return sum(r["ms"][r["method"]] for r in report.values() if r["ms"]) / 1e3


def plan_model(cfg, batch, device=None, recorded=None, replan=False,
               precision_auto=False, log=_say, path=None, timer=time_methods):
  """(The `ModelConfig` a program trains, a line describing the plan or None):
  `cfg` with its measured `conv_plan` and, with `precision_auto`, the precision
  whose convolutions plan faster (else under bf16 a line says if fp32 plans
  faster).

  Nothing is planned for a forced method or a given `conv_plan`, in float64, or
  for a resumed run whose config.json (`recorded`) has its plan or none (it
  continues bit for bit), unless `replan`.
  """
  if cfg.conv_plan or cfg.conv_impl != "auto" or cfg.dtype == "float64":
    return cfg, None
  if recorded is not None and not replan:
    keep = {"conv_plan": recorded.get("conv_plan", "")}
    if precision_auto:
      keep["precision"] = recorded.get("precision", "fp32")
    return dataclasses.replace(cfg, **keep), None
  plans = {}
  for precision in (("fp32", "bf16") if precision_auto or cfg.precision == "bf16"
                    else (cfg.precision,)):
    plans[precision] = plan_convolutions(dataclasses.replace(cfg, precision=precision),
                                         batch, True, device, path, log, timer)
  if precision_auto:   # on a GPU nothing is timed: fp32
    faster = planned_seconds(plans["bf16"][1]) < planned_seconds(plans["fp32"][1])
    cfg = dataclasses.replace(cfg, precision="bf16" if faster else "fp32")
  elif cfg.precision == "bf16" and not fast_conv.on_gpu(device):
    bf16, fp32 = (planned_seconds(plans[p][1]) for p in ("bf16", "fp32"))
    if bf16 > fp32:
      log(f"planner: bf16 is slower than fp32 on this CPU ({1e3 * bf16:.0f} against "
          f"{1e3 * fp32:.0f} ms a batch of {batch} in the planned convolutions; no "
          "AMX?): --precision=fp32 or auto would train faster")
  plan, report = plans[cfg.precision]
  return (dataclasses.replace(cfg, conv_plan=plan),
          f"planner: {cfg.precision}, {describe(report)}")


def plan_inference(cfg, batch, device=None, log=_say, path=None, timer=time_methods):
  """(The `ModelConfig` to score with, a line or None): the convolutions planned
  for the forward alone at this batch (a run's recorded plan was timed with the
  gradients; any method gives the same function up to rounding). Nothing is
  planned where `plan_model` plans nothing."""
  if cfg.conv_impl != "auto" or cfg.dtype == "float64":
    return cfg, None
  plan, report = plan_convolutions(dataclasses.replace(cfg, conv_plan=""), batch, False,
                                   device, path, log, timer)
  return (dataclasses.replace(cfg, conv_plan=plan),
          f"planner: {cfg.precision} inference, {describe(report)}")


def describe(report):
  """One line: each layer's method and its time against the others'."""
  parts = []
  for layer, r in report.items():
    others = ", ".join(f"{m} {t:.1f}" for m, t in sorted(r["ms"].items(), key=lambda x: x[1]))
    parts.append(f"{layer}: {r['method']}" + (f" ({others} ms)" if others else "")
                 + (" [cached]" if r["cached"] else ""))
  return "; ".join(parts)
