"""Evaluates a trained CapsNet on the full test set.

  python eval.py --checkpoint logs/run              # best checkpoint of a logdir
  python eval.py --checkpoint logs/run --which=latest
  python eval.py --checkpoint logs/run/best/model.ckpt-21500 --iter_routing=5

The graph is rebuilt from the run's config.json; --iter_routing overrides the
number of routing iterations. Writes to --out_dir (default
<logdir>/eval_<checkpoint name>): results.json, predictions.csv,
reconstructions.png (inputs beside their reconstructions) and figure4.png
(each of the 16 dimensions of the predicted capsule perturbed over
[-0.25, 0.25] in steps of 0.05, decoded; Figure 4 of the paper).
"""
import dataclasses
import json
import os
import sys

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

import config
from capsnet import evaluation
from capsnet import files
from capsnet import input as data
from capsnet import layers
from capsnet import model

flags.DEFINE_string("checkpoint", None, "checkpoint prefix or training logdir")
flags.DEFINE_enum("which", "best", ["best", "latest"], "checkpoint of a logdir")
flags.DEFINE_integer("iter_routing", None, "override routing iterations", lower_bound=1)
flags.DEFINE_enum("split", "test", ["test", "validation"], "split to score")
flags.DEFINE_integer("batch_size", 500, "evaluation batch size", lower_bound=1)
flags.DEFINE_string("out_dir", None, "output folder")
flags.DEFINE_string("device", None, "model device (default /gpu:0 if present)")
flags.DEFINE_integer("num_images", 16, "images in reconstructions.png", lower_bound=1)
flags.DEFINE_integer("figure4_images", 3, "test images in figure4.png", lower_bound=1)
config.define_data_flags(dataset_default=None)
flags.mark_flag_as_required("checkpoint")
FLAGS = flags.FLAGS

PERTURBATIONS = np.round(np.arange(-0.25, 0.2501, 0.05), 2)   # 11 values


class EvalError(ValueError):
  pass


def resolve(path, which):
  """(checkpoint prefix, run folder holding config.json) for --checkpoint."""
  if os.path.isdir(path):
    folder = os.path.join(path, which)
    ckpt = tf.train.latest_checkpoint(folder) if os.path.isdir(folder) else None
    if ckpt is None:
      raise EvalError(f"{path}: no checkpoint in {folder}"
                      + (" (try --which=latest)" if which == "best" else ""))
    return ckpt, path
  if not os.path.exists(path + ".index"):
    raise EvalError(f"{path}: no such checkpoint (expected {path}.index) or logdir")
  parent = os.path.dirname(os.path.abspath(path))
  for run_dir in (parent, os.path.dirname(parent)):
    if os.path.exists(os.path.join(run_dir, "config.json")):
      return path, run_dir
  raise EvalError(f"{path}: no config.json beside the checkpoint or one folder up")


def load_config(run_dir):
  path = os.path.join(run_dir, "config.json")
  if not os.path.exists(path):
    raise EvalError(f"{path}: missing; cannot rebuild the graph")
  try:
    with open(path) as f:
      saved = json.load(f)
    cfg = model.ModelConfig(**saved["model"])
  except (ValueError, KeyError, TypeError) as e:
    raise EvalError(f"{path}: not a valid config.json ({e})") from None
  return cfg, saved.get("train", {})


def check_matches(ckpt, variables):
  """Every model variable is in the checkpoint with the same shape."""
  try:
    saved = dict(tf.train.list_variables(ckpt))
  except (tf.errors.OpError, ValueError) as e:
    raise EvalError(f"{ckpt}: unreadable checkpoint ({e.__class__.__name__})") from None
  for var in variables:
    name, shape = var.op.name, var.shape.as_list()
    if name not in saved:
      raise EvalError(f"{ckpt}: checkpoint of another architecture: no variable {name}")
    if list(saved[name]) != shape:
      raise EvalError(f"{ckpt}: checkpoint of another architecture: {name} is "
                      f"{list(saved[name])} in the checkpoint, {shape} in config.json")


def tile(images, columns, gap=2):
  """`[n, h, w]` floats in [0, 1] -> one uint8 `[H, W, 1]` grid, row-major."""
  n, h, w = images.shape
  rows = -(-n // columns)
  grid = np.ones([rows * (h + gap) - gap, columns * (w + gap) - gap], np.float32)
  for k, img in enumerate(images):
    r, c = divmod(k, columns)
    grid[r * (h + gap):r * (h + gap) + h, c * (w + gap):c * (w + gap) + w] = img
  return (np.clip(grid, 0, 1) * 255).round().astype(np.uint8)[..., None]


def main(argv):
  del argv
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)  # deprecations
  try:
    ckpt, run_dir = resolve(FLAGS.checkpoint, FLAGS.which)
    cfg, train_settings = load_config(run_dir)
    if FLAGS.iter_routing:
      cfg = dataclasses.replace(cfg, iter_routing=FLAGS.iter_routing)
    dataset = FLAGS.dataset or train_settings.get("dataset", "mnist")
    data_dir = FLAGS.data_dir or f"data/{dataset}"
    splits = data.load(dataset, data_dir, train_settings.get("val_size", 5000),
                       FLAGS.download)
    images, labels = splits[FLAGS.split]
    evaluate(cfg, ckpt, images, labels, dataset, run_dir)
  except ValueError as e:   # EvalError, DataError, ModelConfig errors
    sys.exit(f"eval.py: error: {e}")


def evaluate(cfg, ckpt, images, labels, dataset, run_dir):
  out_dir = FLAGS.out_dir or os.path.join(
      run_dir, f"eval_{os.path.basename(ckpt)}_r{cfg.iter_routing}_{FLAGS.split}")
  device = FLAGS.device or config.default_device()
  with tf.Graph().as_default():
    ev = evaluation.build(cfg, FLAGS.batch_size, device)
    caps_in = tf.compat.v1.placeholder(ev.outputs.v.dtype,
                                       [None, cfg.num_classes * cfg.digit_dim])
    decoded = None
    if cfg.use_decoder:
      with tf.compat.v1.variable_scope("capsnet", reuse=True):
        decoded = layers.decoder(caps_in, cfg.decoder_units, cfg.num_pixels)
    variables = tf.compat.v1.global_variables()
    check_matches(ckpt, variables)
    saver = tf.compat.v1.train.Saver(variables)
    proto = tf.compat.v1.ConfigProto(allow_soft_placement=True)
    with tf.compat.v1.Session(config=proto) as sess:
      saver.restore(sess, ckpt)
      res = evaluation.run(sess, ev, images, labels)
      os.makedirs(out_dir, exist_ok=True)
      result = dict(evaluation.summary(res), checkpoint=ckpt, dataset=dataset,
                    split=FLAGS.split, iter_routing=cfg.iter_routing)
      files.write_json(os.path.join(out_dir, "results.json"), result)
      write_predictions(os.path.join(out_dir, "predictions.csv"), labels, res)
      if cfg.use_decoder and cfg.image_channels == 1:
        write_pictures(sess, ev, caps_in, decoded, images, labels, cfg, out_dir)
  print_report(result, out_dir)


def write_predictions(path, labels, res):
  lines = ["index,label,prediction," + ",".join(
      f"length_{k}" for k in range(res["lengths"].shape[1]))]
  for i, (y, p, lens) in enumerate(zip(labels, res["predictions"], res["lengths"])):
    lines.append(f"{i},{y},{p}," + ",".join(f"{x:.5f}" for x in lens))
  files.atomic_write(path, "\n".join(lines) + "\n")


def write_pictures(sess, ev, caps_in, decoded, images, labels, cfg, out_dir):
  """reconstructions.png and figure4.png from the first test images."""
  n = max(FLAGS.num_images, FLAGS.figure4_images)
  sess.run(ev.iterator.initializer, {ev.images: images[:n], ev.labels: labels[:n]})
  inputs, recon, v, pred = sess.run([ev.batch_images, ev.outputs.reconstructions,
                                     ev.outputs.v, ev.outputs.predictions])
  size = cfg.image_size
  pairs = np.stack([inputs[:FLAGS.num_images, ..., 0],
                    recon[:FLAGS.num_images].reshape(-1, size, size)], axis=1)
  png = tf.io.encode_png(tile(pairs.reshape(-1, size, size), columns=8))
  files.atomic_write(os.path.join(out_dir, "reconstructions.png"), sess.run(png))
  # Figure 4: for each image, 16 rows (dimensions) x 11 columns (perturbations).
  blocks = []
  for k in range(FLAGS.figure4_images):
    caps = np.zeros([cfg.digit_dim, len(PERTURBATIONS), cfg.num_classes, cfg.digit_dim],
                    np.float32)
    caps[:, :, pred[k], :] = v[k, pred[k]]
    for d in range(cfg.digit_dim):
      caps[d, :, pred[k], d] += PERTURBATIONS
    out = sess.run(decoded, {caps_in: caps.reshape(-1, cfg.num_classes * cfg.digit_dim)})
    blocks.append(out.reshape(-1, size, size))
  tiles = [tile(b, columns=len(PERTURBATIONS)) for b in blocks]
  gap = np.full([tiles[0].shape[0], 8, 1], 255, np.uint8)
  grid = np.concatenate(sum(([t, gap] for t in tiles), [])[:-1], axis=1)
  files.atomic_write(os.path.join(out_dir, "figure4.png"), sess.run(tf.io.encode_png(grid)))


def print_report(result, out_dir):
  print(f"checkpoint: {result['checkpoint']}  (iter_routing={result['iter_routing']})")
  print(f"{result['split']}: {result['count']} images, accuracy {result['accuracy']:.4f}, "
        f"error {result['error_percent']:.2f}%")
  print(f"loss {result['loss']:.5f} (margin {result['margin_loss_mean']:.5f}, "
        f"reconstruction {result['recon_loss_mean']:.5f})")
  print("per-class accuracy: " + " ".join(
      f"{k}:{a:.4f}" for k, a in enumerate(result["per_class_accuracy"])))
  print("confusion matrix (rows = label, columns = prediction):")
  for k, row in enumerate(result["confusion"]):
    print(f"  {k}: " + " ".join(f"{x:5d}" for x in row))
  print(f"wrote {out_dir}: " + ", ".join(sorted(os.listdir(out_dir))))


if __name__ == "__main__":
  app.run(main)
