"""A training run's folder: the one module that knows its layout.

  config.json        the model config and the trainer settings ("model",
                     "train"); eval.py rebuilds the graph from it
  latest/, best/     checkpoints, each folder with its `checkpoint` index
  epochs/            the weights at the end of the epochs --keep_epochs names,
                     every one kept (its index lists the newest only)
  metrics.jsonl      one row a validation: "kind" "epoch" (the epoch's end,
                     with its training figures) or "validation" (inside an
                     epoch, --val_every)
  diagnostics.jsonl  the gradient diagnostic, one row a measurement
  test_results.json  the best checkpoint scored on the test set, at the end
  routing.json       how far routing moves the couplings (capsnet.study)
  host.json          the machine and code a study run trained on (capsnet.study)
  affine_results.json  the best checkpoint scored on the affine test set, with
                     the severity sweep (capsnet.study --grid=short)
  train.lock         held by the one trainer writing the folder
  events.out.tfevents.*  TensorBoard's (train.py)
  eval_<checkpoint>_r<r>_<split>/  eval.py's output for one checkpoint, routing
                     count and split (`EvalFolder`): results.json,
                     predictions.csv, reconstructions.png, figure4.png (or
                     figure5.png, MultiMNIST)
  own_images/        eval.py --images: a picture and a routing picture a file
  routing_r<r>/, eval_affine/  eval.py's output for the study's routing.json and
                     affine_results.json (`EvalFolder`s)

`RunFolder` and `EvalFolder` write and read all of it (train.py, eval.py,
capsnet.study and capsnet.pretrained go through them; TensorBoard's events
are TensorFlow's FileWriter's); the functions below find the checkpoint a
path names, check that a checkpoint fits a graph and tell an intact
checkpoint from a damaged one. TensorFlow is imported where a checkpoint is
read (`_tf`), so that reading a folder's rows (capsnet.study) starts fast.
"""
import dataclasses
import datetime
import fcntl
import json
import os
import socket

from capsnet.running import files
from capsnet.running import startup


class RunError(ValueError):
  """A run folder or checkpoint that cannot be used; the message names it."""


CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
DIAGNOSTICS_FILE = "diagnostics.jsonl"
TEST_RESULTS_FILE = "test_results.json"
ROUTING_FILE = "routing.json"
HOST_FILE = "host.json"
AFFINE_RESULTS_FILE = "affine_results.json"
# What a study publishes of a run (never its checkpoints).
SMALL_FILES = (CONFIG_FILE, METRICS_FILE, DIAGNOSTICS_FILE, TEST_RESULTS_FILE,
               ROUTING_FILE, HOST_FILE, AFFINE_RESULTS_FILE)
CHECKPOINT_FOLDERS = ("latest", "best", "epochs")
CHECKPOINT_PREFIX = "model.ckpt"   # <folder>/model.ckpt-<step>.index, ...


def _tf():
  """TensorFlow, imported on first use as the programs import it (`startup`)."""
  startup.import_tensorflow()
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return tf


def _network():
  from capsnet.model import network  # pylint: disable=import-outside-toplevel
  return network


def _read_json(path, kind="a JSON file", required=False):
  """The JSON value in `path`, or None where there is no such file. Raises
  RunError naming the file: "missing" where `required`, or "not <kind>"."""
  if not os.path.exists(path):
    if required:
      raise RunError(f"{path}: missing")
    return None
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise RunError(f"{path}: not {kind} ({e})") from None


def read_jsonl(path):
  """The rows of a .jsonl file ([] if there is none). Raises RunError naming the
  file and the line of a row that is not JSON."""
  if not os.path.exists(path):
    return []
  rows = []
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if line.strip():
        try:
          rows.append(json.loads(line))
        except ValueError as e:
          raise RunError(f"{path}: line {number}: not a JSON row ({e}); a damaged "
                         "file (restore it from git or the run's copy)") from None
  return rows


class RunFolder:
  """One run's folder (see the module docstring for its layout)."""

  def __init__(self, path):
    self.path = path

  def file(self, name):
    return os.path.join(self.path, name)

  def checkpoint_folder(self, which):
    """latest/, best/ or epochs/."""
    return os.path.join(self.path, which)

  # -- config.json

  def config(self):
    """config.json as a dict, or None if there is none."""
    path = self.file(CONFIG_FILE)
    saved = _read_json(path, "a valid config.json")
    if saved is not None and not (isinstance(saved, dict)
                                  and isinstance(saved.get("model"), dict)):
      raise RunError(f"{path}: not a valid config.json (no \"model\" object)")
    return saved

  def write_config(self, model_fields, settings, **extra):
    """config.json: {"model": ..., "train": ..., **extra}."""
    os.makedirs(self.path, exist_ok=True)
    files.write_json(self.file(CONFIG_FILE),
                     {"model": model_fields, "train": settings, **extra})

  def load_config(self):
    """(ModelConfig, trainer settings dict) from config.json."""
    saved = self.config()
    if saved is None:
      raise RunError(f"{self.file(CONFIG_FILE)}: missing; cannot rebuild the graph")
    try:
      cfg = _network().ModelConfig(**saved["model"])
    except (ValueError, TypeError) as e:
      raise RunError(f"{self.file(CONFIG_FILE)}: not a valid config.json ({e})") from None
    return cfg, saved.get("train", {})

  def check_resume(self, model_fields, settings, may_change=(), setting_defaults=None,
                   adopt=False):
    """Raises ValueError naming config.json and the first field (not in
    `may_change`) whose recorded value differs from `model_fields` or
    `settings`; a setting the file lacks is compared with `setting_defaults`.
    Checkpoints without config.json are refused unless `adopt`."""
    saved = self.config()
    path = self.file(CONFIG_FILE)
    if saved is None:
      found = [p for which in CHECKPOINT_FOLDERS for p in self.checkpoints(which)]
      if found and not adopt:
        raise ValueError(
            f"{self.path} has checkpoints ({os.path.relpath(found[-1], self.path)}) "
            "but no config.json, so the settings they were trained with cannot be "
            "checked: restore config.json, or pass --adopt_checkpoints to resume "
            "them with these flags (the variables' shapes are checked against the "
            "model)")
      return
    old_model, old_train = saved["model"], saved.get("train", {})
    defaults = dataclasses.asdict(_network().ModelConfig())   # fields added since
    for field, value in model_fields.items():
      if field not in may_change:
        _same(path, field, old_model.get(field, defaults.get(field)), value)
    for field, value in settings.items():
      if field in may_change:
        continue
      if field in old_train:
        _same(path, field, old_train[field], value)
      elif field in (setting_defaults or {}):
        _same(path, field, setting_defaults[field], value)

  def check_writable(self):
    """Raises ValueError naming the path unless the folder, or the one that
    would hold it, takes a file."""
    if os.path.exists(self.path) and not os.path.isdir(self.path):
      raise ValueError(f"--logdir={self.path}: is a file, expected a folder")
    folder = self.path
    while not os.path.exists(folder):
      folder = os.path.dirname(os.path.abspath(folder))
    if not os.path.isdir(folder):
      raise ValueError(f"--logdir={self.path}: {folder} is a file, expected a folder")
    try:
      files.probe_writable(folder)
    except OSError as e:
      raise ValueError(f"--logdir={self.path}: cannot write in {folder} "
                       f"({e.strerror})") from None

  def lock(self):
    """A `RunLock`: this process as the folder's one writer."""
    return RunLock(self.path)

  # -- checkpoints

  def checkpoints(self, which):
    """The checkpoint prefixes of latest/, best/ or epochs/, oldest first."""
    return checkpoints_in(self.checkpoint_folder(which))

  def latest_checkpoint(self, which):
    """What latest/ or best/'s `checkpoint` index names, or None."""
    tf = _tf()
    return tf.train.latest_checkpoint(self.checkpoint_folder(which))

  def newest_intact(self):
    """`newest_intact` over latest/, best/ and epochs/."""
    return newest_intact([self.checkpoint_folder(w) for w in CHECKPOINT_FOLDERS])

  # -- rows

  def append_metrics(self, row, kind):
    """A metrics.jsonl row of `kind` "epoch" or "validation"."""
    files.append_jsonl(self.file(METRICS_FILE), dict(row, kind=kind))

  def append_diagnostic(self, row):
    files.append_jsonl(self.file(DIAGNOSTICS_FILE), row)

  def metrics(self, kind=None):
    """metrics.jsonl's rows of `kind` (None: all), each with its "kind" (older
    rows: "epoch" if they have images_per_sec)."""
    rows = [dict(r, kind=r.get("kind") or ("epoch" if "images_per_sec" in r
                                           else "validation"))
            for r in read_jsonl(self.file(METRICS_FILE))]
    return [r for r in rows if kind is None or r["kind"] == kind]

  def diagnostics(self):
    return read_jsonl(self.file(DIAGNOSTICS_FILE))

  def drop_rows_after(self, step):
    """Drops the metrics and diagnostics rows of steps after `step` (a resumed
    run writes them again)."""
    for name in (METRICS_FILE, DIAGNOSTICS_FILE):
      path = self.file(name)
      if not os.path.exists(path):
        continue
      with open(path) as f:
        lines = [line for line in f if line.strip()]
      kept = [line for line in lines if json.loads(line)["step"] <= step]
      if len(kept) < len(lines):
        files.atomic_write(path, "".join(kept))

  # -- results

  def read_json(self, name):
    """The folder's JSON file `name`, or None."""
    return _read_json(self.file(name))

  def write_json(self, name, value):
    """The folder's JSON file `name`, written whole or not at all."""
    files.write_json(self.file(name), value)

  def record_host(self, facts):
    """host.json: {"started": facts, "resumed": [...]}, where a later start on
    another machine or code is added to "resumed"."""
    old = _read_json(self.file(HOST_FILE))
    if old is None:
      files.write_json(self.file(HOST_FILE), {"started": facts, "resumed": []})
    elif facts not in [old["started"], *old["resumed"]]:
      old["resumed"].append(facts)
      files.write_json(self.file(HOST_FILE), old)

  def copy_small_files(self, target, names=SMALL_FILES):
    """Copies those of `names` there are (never checkpoints) into `target`, each
    written whole or not at all."""
    os.makedirs(target, exist_ok=True)
    for name in names:
      if os.path.exists(self.file(name)):
        with open(self.file(name), "rb") as f:
          files.atomic_write(os.path.join(target, name), f.read())

  # -- what eval.py writes inside it

  def eval_folder(self, checkpoint, iter_routing, split):
    """eval.py's default output folder: eval_<checkpoint name>_r<r>_<split>/."""
    return EvalFolder(self.file(
        f"eval_{os.path.basename(checkpoint)}_r{iter_routing}_{split}"))

  def own_images_folder(self):
    """eval.py --images's default output folder: own_images/."""
    return EvalFolder(self.file(OWN_IMAGES_FOLDER))


OWN_IMAGES_FOLDER = "own_images"
EVAL_RESULTS_FILE = "results.json"
PREDICTIONS_FILE = "predictions.csv"


class EvalFolder:
  """What eval.py writes for one checkpoint and split: results.json,
  predictions.csv (index, label(s), prediction(s), capsule lengths), pictures."""

  def __init__(self, path):
    self.path = path

  def file(self, name):
    return os.path.join(self.path, name)

  def write_results(self, result):
    files.write_json(self.file(EVAL_RESULTS_FILE), result)

  def results(self):
    """results.json. Raises RunError if missing or not JSON."""
    return _read_json(self.file(EVAL_RESULTS_FILE), "a valid results.json", required=True)

  def write_predictions(self, labels, predictions, lengths):
    """predictions.csv; `labels` and `predictions` [n], or [n, 2] for two digits
    an image."""
    two = labels.ndim == 2
    names = (["label_a", "label_b", "prediction_a", "prediction_b"] if two
             else ["label", "prediction"])
    lines = [",".join(["index", *names, *(f"length_{k}" for k in range(lengths.shape[1]))])]
    for i, (y, p, lens) in enumerate(zip(labels, predictions, lengths, strict=True)):
      ids = [*y, *p] if two else [y, p]
      lines.append(",".join([str(i), *map(str, ids), *(f"{x:.5f}" for x in lens)]))
    files.atomic_write(self.file(PREDICTIONS_FILE), "\n".join(lines) + "\n")

  def predictions(self):
    """predictions.csv as {column: [values]}. Raises RunError if it is missing
    or its rows do not fit its header."""
    path = self.file(PREDICTIONS_FILE)
    try:
      with open(path) as f:
        head, *rows = [line.split(",") for line in f.read().splitlines() if line]
      columns = {name: [(float if name.startswith("length_") else int)(r[k])
                        for r in rows] for k, name in enumerate(head)}
    except OSError as e:
      raise RunError(f"{path}: cannot read ({e.strerror})") from None
    except (ValueError, IndexError) as e:
      raise RunError(f"{path}: not a valid predictions.csv ({e})") from None
    return columns


def _same(path, field, before, value):
  before = tuple(before) if isinstance(before, list) else before
  if before != value:
    raise ValueError(f"{path} has {field}={before!r}, the flags give "
                     f"{value!r}: use another --logdir or the same value")


LOCK_FILE = "train.lock"


class RunLock:
  """This process as the one writer of a run folder: an exclusive `flock` on
  train.lock (naming the holder), dropped by `release` or when the process dies.
  Raises RunError naming the holder if another process has it.

  The file is never unlinked while another process may hold it open: after its
  flock a process checks that the path still names the file it locked. Not a
  guard across machines on a network file system.
  """

  def __init__(self, logdir):
    self.logdir = logdir
    self.created = not os.path.exists(logdir)
    os.makedirs(logdir, exist_ok=True)
    self.path = os.path.join(logdir, LOCK_FILE)
    while True:
      self._existed = os.path.exists(self.path)
      self._file = open(self.path, "a+b")
      try:
        fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        self._file.seek(0)
        holder = self._file.read().decode(errors="replace").strip() or "another process"
        self._file.close()
        raise RunError(f"--logdir={logdir} is in use by {holder}: one trainer a run "
                       "folder; wait for it to end or stop it (it saves on SIGTERM)") from None
      if self._still_the_lock_file():
        break
      self._file.close()   # unlinked (or replaced) since it was opened: again
    # What was there before, for a start that is refused (`release(undo=True)`).
    self._file.seek(0)
    self._before = self._file.read()
    stat = os.fstat(self._file.fileno())
    self._before_times = (stat.st_atime_ns, stat.st_mtime_ns)
    self._file.seek(0)
    self._file.truncate()
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    self._file.write(f"pid {os.getpid()} on {socket.gethostname()}, "
                     f"started {started}\n".encode())
    self._file.flush()

  def _still_the_lock_file(self):
    try:
      return os.path.samestat(os.fstat(self._file.fileno()), os.stat(self.path))
    except FileNotFoundError:
      return False

  def release(self, undo=False):
    """Releases the lock (again: nothing). `undo`, for a start that was refused:
    a lock file that was there gets its bytes and times back; one this start
    made goes, and the folder too if this lock made it empty."""
    if self._file.closed:
      return
    if undo:
      if self._existed:
        self._file.seek(0)
        self._file.truncate()
        self._file.write(self._before)
        self._file.flush()
        os.utime(self._file.fileno(), ns=self._before_times)
      else:
        os.remove(self.path)
        if self.created and not os.listdir(self.logdir):
          os.rmdir(self.logdir)
    self._file.close()   # closing the file drops the flock


def resolve(path, which):
  """(checkpoint prefix, run folder holding config.json) for --checkpoint."""
  if os.path.isdir(path):
    ckpt = RunFolder(path).latest_checkpoint(which) if os.path.isdir(
        os.path.join(path, which)) else None
    if ckpt is None:
      raise RunError(f"{path}: no checkpoint in {os.path.join(path, which)}"
                     + (" (try --which=latest)" if which == "best" else ""))
    return ckpt, path
  if not os.path.exists(path + ".index"):
    raise RunError(f"{path}: no such checkpoint (expected {path}.index) or logdir")
  parent = os.path.dirname(os.path.abspath(path))
  for run_dir in (parent, os.path.dirname(parent)):
    if os.path.exists(RunFolder(run_dir).file(CONFIG_FILE)):
      return path, run_dir
  raise RunError(f"{path}: no config.json beside the checkpoint or one folder up")


# The name of a variable's exponential moving average (train.py --ema_decay).
AVERAGE_SUFFIX = "/ExponentialMovingAverage"
WEIGHTS = ("auto", "raw", "averaged")


def chosen_weights(ckpt):
  """"averaged" if the run chose the averaged weights for this checkpoint
  (its `state/best_averaged`: they won the validation), else "raw"."""
  tf = _tf()
  try:
    reader = tf.train.load_checkpoint(ckpt)
    if reader.has_tensor("state/best_averaged"):
      return "averaged" if reader.get_tensor("state/best_averaged") else "raw"
  except (tf.errors.OpError, ValueError) as e:
    raise RunError(f"{ckpt}: unreadable checkpoint ({e.__class__.__name__})") from None
  return "raw"


def model_saver(ckpt, variables, weights="auto"):
  """(A Saver restoring the model `variables` from `ckpt`, checked first; "raw"
  or "averaged"). `weights`: "raw", "averaged" (the moving averages) or "auto"
  (what the run chose). Raises RunError for a checkpoint that does not fit, or
  averaged weights a run did not keep."""
  tf = _tf()
  if weights not in WEIGHTS:
    raise RunError(f"--weights={weights}: expected one of {WEIGHTS}")
  if weights == "auto":
    weights = chosen_weights(ckpt)
  suffix = AVERAGE_SUFFIX if weights == "averaged" else ""
  names = {v.op.name + suffix: v for v in variables}
  if suffix and not any(n.endswith(suffix) for n, _ in _list(ckpt)):
    raise RunError(f"{ckpt}: --weights=averaged, but the run kept no averaged "
                   "weights (it trained without --ema_decay)")
  check_matches(ckpt, names)
  return tf.compat.v1.train.Saver(names), weights


def _list(ckpt):
  tf = _tf()
  try:
    return tf.train.list_variables(ckpt)
  except (tf.errors.OpError, ValueError) as e:
    raise RunError(f"{ckpt}: unreadable checkpoint ({e.__class__.__name__})") from None


def check_matches(ckpt, variables):
  """Raises RunError unless every model variable (a list, or a dict checkpoint
  name -> variable) is in `ckpt` with its shape and dtype."""
  tf = _tf()
  if not isinstance(variables, dict):
    variables = {v.op.name: v for v in variables}
  saved = dict(_list(ckpt))
  dtypes = tf.train.load_checkpoint(ckpt).get_variable_to_dtype_map()
  for name, var in variables.items():
    shape = var.shape.as_list()
    if name not in saved:
      raise RunError(f"{ckpt}: checkpoint of another architecture: no variable {name}")
    if list(saved[name]) != shape:
      raise RunError(f"{ckpt}: checkpoint of another architecture: {name} is "
                     f"{list(saved[name])} in the checkpoint, {shape} in config.json")
    dtype = var.dtype.base_dtype
    if dtypes[name] != dtype:
      raise RunError(f"{ckpt}: {name} is {dtypes[name].name} in the checkpoint, "
                     f"{dtype.name} in the model (a --dtype or --precision that "
                     "does not fit the run?)")


def step_of(prefix):
  """The global step in a checkpoint prefix `.../model.ckpt-<step>`."""
  return int(prefix.rsplit("-", 1)[1])


def checkpoints_in(folder):
  """Checkpoint prefixes in `folder`, oldest first: those its `checkpoint` file
  lists and any other with an index file."""
  tf = _tf()
  found = set()
  try:
    state = tf.compat.v1.train.get_checkpoint_state(folder)
  except (tf.errors.OpError, ValueError):   # an unreadable `checkpoint` file
    state = None
  if state is not None:
    for path in state.all_model_checkpoint_paths:
      found.add(path if os.path.isabs(path) else os.path.join(folder, path))
  if os.path.isdir(folder):
    for name in os.listdir(folder):
      if name.startswith(CHECKPOINT_PREFIX + "-") and name.endswith(".index"):
        found.add(os.path.join(folder, name[:-len(".index")]))
  good = [p for p in found if p.rsplit("-", 1)[1].isdigit()]
  return sorted(good, key=step_of)


def damage(prefix):
  """Why the checkpoint cannot be restored (a short reason), or None if every
  tensor reads back (TensorFlow checks each one's checksum)."""
  tf = _tf()
  if not os.path.exists(prefix + ".index"):
    return "no .index file"
  try:
    reader = tf.train.load_checkpoint(prefix)
    for name in reader.get_variable_to_shape_map():
      reader.get_tensor(name)
  except Exception as e:  # pylint: disable=broad-except
    # A damaged file fails in many ways (OpError, IndexError, ValueError...).
    return error_reason(e)
  return None


def error_reason(error):
  """The informative line of a TensorFlow error (without its "Graph execution
  error:" framing), at most 200 characters."""
  message = getattr(error, "message", None) or str(error) or type(error).__name__
  frame = ("Graph execution error", "Detected at node", "File ", "Node:", "[[",
           "Hint:", "Traceback")
  lines = [line.strip() for line in message.splitlines()]
  lines = [line for line in lines if any(c.isalnum() for c in line) and not line.startswith(frame)]
  return (lines[-1] if lines else type(error).__name__)[:200]


def relist(folder, prefixes):
  """Rewrites `folder`'s `checkpoint` index to list `prefixes` (oldest first),
  or removes it if none; the checkpoints are not touched."""
  index = os.path.join(folder, "checkpoint")
  if not prefixes:
    if os.path.exists(index):
      os.remove(index)
    return
  names = [os.path.basename(p) for p in prefixes]   # relative, as the Savers write
  files.atomic_write(index, f'model_checkpoint_path: "{names[-1]}"\n' + "".join(
      f'all_model_checkpoint_paths: "{n}"\n' for n in names))


def newest_intact(folders):
  """(The newest checkpoint in `folders` that reads back whole, or None;
  [(prefix, reason)] of the newer damaged ones)."""
  candidates = sorted((p for f in folders for p in checkpoints_in(f)),
                      key=step_of, reverse=True)
  damaged = []
  for prefix in candidates:
    reason = damage(prefix)
    if reason is None:
      return prefix, damaged
    damaged.append((prefix, reason))
  return None, damaged
