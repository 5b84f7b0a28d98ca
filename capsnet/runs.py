"""A training run's folder as eval.py (and other readers) find it: the
checkpoint a path names, the config.json that rebuilds its graph, and whether
the checkpoint fits that graph.
"""
import datetime
import fcntl
import json
import os
import socket

import tensorflow as tf

from capsnet import files
from capsnet import model


class RunError(ValueError):
  """A run folder or checkpoint that cannot be used; the message names it."""


LOCK_FILE = "train.lock"


class RunLock:
  """This process as the one writer of a run folder (see `lock`)."""

  def __init__(self, logdir):
    self.logdir = logdir
    self.created = not os.path.exists(logdir)
    os.makedirs(logdir, exist_ok=True)
    self.path = os.path.join(logdir, LOCK_FILE)
    self._file = open(self.path, "a+")
    try:
      fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      self._file.seek(0)
      holder = self._file.read().strip() or "another process"
      self._file.close()
      raise RunError(f"--logdir={logdir} is in use by {holder}: one trainer a run "
                     "folder; wait for it to end or stop it (it saves on SIGTERM)") from None
    self._file.seek(0)
    self._file.truncate()
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    self._file.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n")
    self._file.flush()

  def release(self, undo=False):
    """Releases the lock (again: nothing). undo: a run that did not start
    leaves nothing: the lock file goes, and the folder if this lock made it
    and it is empty."""
    if self._file.closed:
      return
    if undo:
      os.remove(self.path)
      if self.created and not os.listdir(self.logdir):
        os.rmdir(self.logdir)
    self._file.close()   # closing the file drops the flock


def lock(logdir):
  """Makes this process the one writer of `logdir`: an exclusive `flock` on
  <logdir>/train.lock, held until `release` or the end of the process (the
  OS drops it when the process dies, SIGKILL too, so nothing stale is left).
  The file names the holder (pid, host, start time). Creates `logdir` if
  needed.

  Not a guard across machines: a folder on a network file system may not
  honour the lock between hosts.
  Returns: a `RunLock`.
  Raises: RunError naming the folder and the holder if another process has it.
  """
  return RunLock(logdir)


def resolve(path, which):
  """(checkpoint prefix, run folder holding config.json) for --checkpoint."""
  if os.path.isdir(path):
    folder = os.path.join(path, which)
    ckpt = tf.train.latest_checkpoint(folder) if os.path.isdir(folder) else None
    if ckpt is None:
      raise RunError(f"{path}: no checkpoint in {folder}"
                     + (" (try --which=latest)" if which == "best" else ""))
    return ckpt, path
  if not os.path.exists(path + ".index"):
    raise RunError(f"{path}: no such checkpoint (expected {path}.index) or logdir")
  parent = os.path.dirname(os.path.abspath(path))
  for run_dir in (parent, os.path.dirname(parent)):
    if os.path.exists(os.path.join(run_dir, "config.json")):
      return path, run_dir
  raise RunError(f"{path}: no config.json beside the checkpoint or one folder up")


def load_config(run_dir):
  """(ModelConfig, trainer settings dict) from <run_dir>/config.json."""
  path = os.path.join(run_dir, "config.json")
  if not os.path.exists(path):
    raise RunError(f"{path}: missing; cannot rebuild the graph")
  try:
    with open(path) as f:
      saved = json.load(f)
    cfg = model.ModelConfig(**saved["model"])
  except (ValueError, KeyError, TypeError) as e:
    raise RunError(f"{path}: not a valid config.json ({e})") from None
  return cfg, saved.get("train", {})


# The name of a variable's exponential moving average (train.py --ema_decay).
AVERAGE_SUFFIX = "/ExponentialMovingAverage"
WEIGHTS = ("auto", "raw", "averaged")


def chosen_weights(ckpt):
  """"averaged" if the run chose the averaged weights for this checkpoint
  (its `state/best_averaged`: they won the validation), else "raw"."""
  try:
    reader = tf.train.load_checkpoint(ckpt)
    if reader.has_tensor("state/best_averaged"):
      return "averaged" if reader.get_tensor("state/best_averaged") else "raw"
  except (tf.errors.OpError, ValueError) as e:
    raise RunError(f"{ckpt}: unreadable checkpoint ({e.__class__.__name__})") from None
  return "raw"


def model_saver(ckpt, variables, weights="auto"):
  """A Saver that restores the model `variables` from `ckpt`, checked first.

  Args:
    weights: "raw", "averaged" (each variable from its moving average), or
      "auto": what the run chose (`chosen_weights`).
  Returns: (the Saver, "raw" or "averaged").
  Raises: RunError for a checkpoint that does not fit, or averaged weights
    asked of a run without them.
  """
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
  try:
    return tf.train.list_variables(ckpt)
  except (tf.errors.OpError, ValueError) as e:
    raise RunError(f"{ckpt}: unreadable checkpoint ({e.__class__.__name__})") from None


def check_matches(ckpt, variables):
  """Every model variable is in the checkpoint with the same shape.

  Args:
    variables: a list of variables, or a dict checkpoint name -> variable.
  """
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
  """Checkpoint prefixes in `folder`, oldest first: those its `checkpoint`
  file lists and any other `model.ckpt-<step>` with an index file (the
  `checkpoint` file itself may be the damaged part)."""
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
      if name.startswith("model.ckpt-") and name.endswith(".index"):
        found.add(os.path.join(folder, name[:-len(".index")]))
  good = [p for p in found if p.rsplit("-", 1)[1].isdigit()]
  return sorted(good, key=step_of)


def damage(prefix):
  """Why the checkpoint cannot be restored (a short reason), or None if
  every tensor in it reads back (TensorFlow checks each one's checksum)."""
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
  """The informative line of a TensorFlow error (its message is framed by
  "Graph execution error:", node names and hints), at most 200 characters."""
  message = getattr(error, "message", None) or str(error) or type(error).__name__
  frame = ("Graph execution error", "Detected at node", "File ", "Node:", "[[",
           "Hint:", "Traceback")
  lines = [l.strip() for l in message.splitlines()]
  lines = [l for l in lines if l and not l.startswith(frame)]
  return (lines[-1] if lines else type(error).__name__)[:200]


def relist(folder, prefixes):
  """Rewrites `folder`'s `checkpoint` index to list `prefixes` (oldest
  first; the newest is the one `tf.train.latest_checkpoint` names), or
  removes the index if none is left. The checkpoint files are not touched."""
  index = os.path.join(folder, "checkpoint")
  if not prefixes:
    if os.path.exists(index):
      os.remove(index)
    return
  names = [os.path.basename(p) for p in prefixes]   # relative, as the Savers write
  files.atomic_write(index, f'model_checkpoint_path: "{names[-1]}"\n' + "".join(
      f'all_model_checkpoint_paths: "{n}"\n' for n in names))


def newest_intact(folders):
  """The newest checkpoint that reads back whole, over `folders`.

  Returns: (prefix or None, [(prefix, reason)] of the newer damaged ones).
  """
  candidates = sorted((p for f in folders for p in checkpoints_in(f)),
                      key=step_of, reverse=True)
  damaged = []
  for prefix in candidates:
    reason = damage(prefix)
    if reason is None:
      return prefix, damaged
    damaged.append((prefix, reason))
  return None, damaged
