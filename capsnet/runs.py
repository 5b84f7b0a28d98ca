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
