"""Evaluation graph and loop shared by train.py and eval.py: an initializable
iterator over placeholders scores any split, each example once (the last partial
batch kept)."""
import collections

import numpy as np
import tensorflow as tf

from capsnet.data import tasks
from capsnet.model import network

EvalGraph = collections.namedtuple(
    "EvalGraph", ["images", "labels", "iterator", "outputs", "batch_images", "targets",
                  "routing", "task"])


def build(cfg, batch_size, device=None, task=None, routing_stats=False):
  """An `EvalGraph`: the eval pipeline of `task` (default MNIST's) on the CPU,
  placeholders fed at `iterator.initializer`, and
  `network.forward(training=False)` on `device`; `routing_stats` (eval.py) adds
  the per-example `couplings_moved`."""
  task = task or tasks.get(tasks.DEFAULT)
  pipe = task.eval_pipeline([cfg.image_size, cfg.image_size, cfg.image_channels],
                            batch_size)
  batch_images, batch_labels, batch_targets = pipe.batch
  with tf.compat.v1.device(device), tf.name_scope("eval"):
    outputs = network.forward(batch_images, batch_labels, cfg, training=False,
                            device=device, targets=batch_targets,
                            heads=task.heads)
    routing = couplings_moved(outputs.couplings) if routing_stats else None
  return EvalGraph(pipe.images, pipe.labels, pipe.iterator, outputs, batch_images,
                   pipe.targets, routing, task)


def couplings_moved(couplings):
  """{"entropy", "max_c": `[batch, iterations]`}: `network.routing_movement` of
  each iteration's couplings, in float64."""
  moved = [network.routing_movement(tf.cast(c, tf.float64)) for c in couplings]
  return {"entropy": tf.stack([e for e, _ in moved], axis=1),
          "max_c": tf.stack([m for _, m in moved], axis=1)}


def run(sess, graph, images, labels, targets=None):
  """Scores every example of the split once: count, accuracy, error_percent,
  loss, margin_loss_mean, recon_loss_mean, the task's per-class figures and
  confusion, the per-example predictions, lengths and losses, and with
  routing_stats routing_entropy and routing_max_c per iteration."""
  out = graph.outputs
  fetch = {"predictions": out.predictions, "lengths": out.lengths,
           "margin_loss": out.margin_loss, "recon_loss": out.recon_loss}
  if graph.routing is not None:
    fetch.update({"routing_" + k: t for k, t in graph.routing.items()})
  feed = {graph.images: images, graph.labels: labels}
  if graph.targets is not None:
    feed[graph.targets] = targets
  sess.run(graph.iterator.initializer, feed)
  parts = collections.defaultdict(list)
  while True:
    try:
      for k, v in sess.run(fetch).items():
        parts[k].append(v)
    except tf.errors.OutOfRangeError:
      break
  res = {k: np.concatenate(v) for k, v in parts.items()}
  n = len(res["predictions"])
  if n != len(labels):
    raise RuntimeError(f"evaluation scored {n} examples, expected {len(labels)}")
  res.update(count=n, loss=float(np.mean(res["margin_loss"] + res["recon_loss"])),
             margin_loss_mean=float(res["margin_loss"].mean()),
             recon_loss_mean=float(res["recon_loss"].mean()))
  for key in ("routing_entropy", "routing_max_c"):
    if key in res:   # per example and iteration -> per iteration
      res[key] = res[key].mean(axis=0).tolist()
  res.update(graph.task.score(res["lengths"], res["predictions"], labels))
  return res


def summary(res):
  """The scalar part of `run`'s result, for JSON and logs."""
  keys = ("count", "accuracy", "error_percent", "at_least_one", "loss",
          "margin_loss_mean", "recon_loss_mean", "routing_entropy", "routing_max_c",
          "per_class_accuracy", "confusion")
  return {k: res[k] for k in keys if k in res}
