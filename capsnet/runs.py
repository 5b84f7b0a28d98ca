"""A training run's folder as eval.py (and other readers) find it: the
checkpoint a path names, the config.json that rebuilds its graph, and whether
the checkpoint fits that graph.
"""
import json
import os

import tensorflow as tf

from capsnet import model


class RunError(ValueError):
  """A run folder or checkpoint that cannot be used; the message names it."""


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


def check_matches(ckpt, variables):
  """Every model variable is in the checkpoint with the same shape."""
  try:
    saved = dict(tf.train.list_variables(ckpt))
  except (tf.errors.OpError, ValueError) as e:
    raise RunError(f"{ckpt}: unreadable checkpoint ({e.__class__.__name__})") from None
  for var in variables:
    name, shape = var.op.name, var.shape.as_list()
    if name not in saved:
      raise RunError(f"{ckpt}: checkpoint of another architecture: no variable {name}")
    if list(saved[name]) != shape:
      raise RunError(f"{ckpt}: checkpoint of another architecture: {name} is "
                     f"{list(saved[name])} in the checkpoint, {shape} in config.json")


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
