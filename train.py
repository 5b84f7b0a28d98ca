"""Trains CapsNet on MNIST: `python train.py --iter_routing=3`.

Session-based (tf.compat.v1). The model runs on --device (GPU when present),
the input pipeline on the CPU, soft placement lets the same graph run
anywhere. Layout of --logdir:

  config.json        model config + trainer settings; eval.py rebuilds from it
  latest/            checkpoints every --save_every steps and each epoch end
  best/              the checkpoint with the best validation accuracy
  metrics.jsonl      one line per epoch (train and validation figures)
  diagnostics.jsonl  gradient diagnostic (--diag_every)
  events.out.*       TensorBoard summaries
  test_results.json  the best checkpoint scored on the test set, at the end

Re-running with the same --logdir resumes from latest/ (step, optimizer state,
epoch, position in the epoch's data order).
"""
import dataclasses
import json
import os
import signal
import sys
import time

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf
import tqdm

import config
from capsnet import evaluation
from capsnet import files
from capsnet import input as data
from capsnet import model

config.define_train_flags()
flags.DEFINE_integer("train_size", 0, "use only the first N training images "
                     "(0: all); for quick experiments and tests", lower_bound=0)
FLAGS = flags.FLAGS

# Model fields that may differ between a run and its resumption: they change
# how the same computation is carried out, not what is computed.
RESUMABLE_CHANGES = ("precision", "conv_impl")


class TrainingError(Exception):
  """Training cannot go on (non-finite loss)."""


def tower_devices(device, num_towers):
  """['/gpu:0', '/gpu:1', ...] from --device=/gpu:0 and --num_gpus=2."""
  if num_towers == 1:
    return [device]
  kind = device.rsplit(":", 1)[0]
  return [f"{kind}:{i}" for i in range(num_towers)]


def train_settings():
  keys = ("dataset", "val_size", "train_size", "batch_size", "learning_rate",
          "decay_steps", "decay_rate", "seed", "epochs")
  return {k: FLAGS[k].value for k in keys}


def check_logdir(logdir, cfg):
  """Refuses a logdir whose config.json disagrees with `cfg`; writes it.

  Raises: ValueError naming the file and the first differing field.
  """
  path = os.path.join(logdir, "config.json")
  if os.path.exists(path):
    try:
      with open(path) as f:
        old = json.load(f)["model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ValueError(f"{path}: not a valid config.json ({e})") from None
    new = dataclasses.asdict(cfg)
    for field, value in new.items():
      if field in RESUMABLE_CHANGES:
        continue
      before = old.get(field)
      before = tuple(before) if isinstance(before, list) else before
      if before != value:
        raise ValueError(f"{path} has {field}={before!r}, the flags give "
                         f"{value!r}: use another --logdir or the same value")
  os.makedirs(logdir, exist_ok=True)
  files.write_json(path, {"model": dataclasses.asdict(cfg), "train": train_settings()})


class Graph:
  """Everything train.py runs, built in one tf.Graph."""

  def __init__(self, cfg, devices, fixed_batch):
    self.graph = tf.Graph()
    with self.graph.as_default():
      tf.compat.v1.set_random_seed(FLAGS.seed)
      self.global_step = tf.compat.v1.train.get_or_create_global_step()
      # Where the run is, saved with the weights so that a resume continues.
      self.epoch = tf.compat.v1.get_variable("state/epoch", [], tf.int64,
                                             tf.zeros_initializer(), trainable=False)
      self.epoch_examples = tf.compat.v1.get_variable(
          "state/epoch_examples", [], tf.int64, tf.zeros_initializer(), trainable=False)
      self.best_val = tf.compat.v1.get_variable(
          "state/best_val_accuracy", [], tf.float32,
          tf.constant_initializer(-1.0), trainable=False)
      self.state_in = {
          k: tf.compat.v1.placeholder(v.dtype.base_dtype, [])
          for k, v in (("epoch", self.epoch), ("epoch_examples", self.epoch_examples),
                       ("best_val", self.best_val))}
      self.set_state = tf.group(
          self.epoch.assign(self.state_in["epoch"]),
          self.epoch_examples.assign(self.state_in["epoch_examples"]),
          self.best_val.assign(self.state_in["best_val"]))

      shape = [None, cfg.image_size, cfg.image_size, cfg.image_channels]
      with tf.device("/cpu:0"), tf.name_scope("train_input"):
        self.images_in = tf.compat.v1.placeholder(tf.uint8, shape, name="images")
        self.labels_in = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        self.seed_in = tf.compat.v1.placeholder(tf.int64, [], name="seed")
        self.first_batch_in = tf.compat.v1.placeholder(tf.int64, [], name="first_batch")
        ds = data.make_dataset(self.images_in, self.labels_in, FLAGS.batch_size,
                               augment=True, seed=self.seed_in, drop_remainder=True,
                               first_batch=self.first_batch_in)
        self.iterator = tf.compat.v1.data.make_initializable_iterator(ds)
        images, labels = self.iterator.get_next()

      self.lr = tf.compat.v1.train.exponential_decay(
          FLAGS.learning_rate, self.global_step, FLAGS.decay_steps, FLAGS.decay_rate)
      opt = tf.compat.v1.train.AdamOptimizer(self.lr)
      grads, outs = model.tower_gradients(images, labels, cfg, opt, devices)
      self.train_op = opt.apply_gradients(grads, self.global_step)
      n = float(len(outs))
      self.loss = tf.add_n([o.loss for o in outs]) / n
      self.accuracy = tf.add_n([o.accuracy for o in outs]) / n
      self.summary = self._summaries(cfg, outs[0], images)

      self.eval = evaluation.build(cfg, FLAGS.eval_batch_size, devices[0])
      self.diag = {}
      if FLAGS.diag_every:
        with tf.compat.v1.device(devices[0]), tf.name_scope("diagnostic"):
          self.diag = model.gradient_diagnostic(
              tf.constant(fixed_batch[0], tf.float32) / 255.0,
              tf.constant(fixed_batch[1]), cfg)
      self.saver_latest = tf.compat.v1.train.Saver(max_to_keep=2, save_relative_paths=True)
      self.saver_best = tf.compat.v1.train.Saver(max_to_keep=1, save_relative_paths=True)
      self.init = tf.compat.v1.global_variables_initializer()
    self.graph.finalize()

  def _summaries(self, cfg, out, images):
    """Created once, from tower 0, outside the tower scopes."""
    scalar = tf.compat.v1.summary.scalar
    items = [scalar("loss/total", out.loss),
             scalar("loss/margin", tf.reduce_mean(out.margin_loss)),
             scalar("loss/reconstruction", tf.reduce_mean(out.recon_loss)),
             scalar("accuracy", out.accuracy),
             scalar("learning_rate", self.lr)]
    for r, c in enumerate(model.coupling_per_iteration(out, cfg.iter_routing)):
      items.append(scalar(f"routing/entropy_iter_{r}", model.routing_entropy(c)))
      items.append(scalar(f"routing/max_c_iter_{r}",
                          tf.reduce_mean(tf.reduce_max(c, axis=2))))
    if out.reconstructions is not None:
      recon = tf.reshape(out.reconstructions[:4], tf.shape(images[:4]))
      pairs = tf.concat([tf.cast(images[:4], recon.dtype), recon], axis=2)
      items.append(tf.compat.v1.summary.image("input_vs_reconstruction", pairs,
                                              max_outputs=4))
    return tf.compat.v1.summary.merge(items)


def session_config(devices):
  proto = tf.compat.v1.ConfigProto(allow_soft_placement=True,
                                   log_device_placement=FLAGS.log_device_placement)
  cpus = sum(d.lower().startswith("/cpu") for d in devices)
  if cpus > 1:   # towers on logical CPU devices
    proto.device_count["CPU"] = cpus
  return proto


def main(argv):
  del argv
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)  # deprecations
  try:
    cfg = config.model_config_from_flags()
    if FLAGS.batch_size % FLAGS.num_gpus:
      raise ValueError(f"--batch_size={FLAGS.batch_size} must divide by "
                       f"--num_gpus={FLAGS.num_gpus}")
    device = FLAGS.device or config.default_device()
    devices = tower_devices(device, FLAGS.num_gpus)
    splits = data.load(FLAGS.dataset, config.data_dir(), FLAGS.val_size,
                       FLAGS.download)
    if FLAGS.train_size:
      splits["train"] = tuple(a[:FLAGS.train_size] for a in splits["train"])
    train_x, train_y = splits["train"]
    if len(train_x) < FLAGS.batch_size:
      raise ValueError(f"--batch_size={FLAGS.batch_size} is larger than the "
                       f"{len(train_x)} training images")
    check_logdir(FLAGS.logdir, cfg)
  except ValueError as e:   # DataError is a ValueError
    sys.exit(f"train.py: error: {e}")
  try:
    train(cfg, devices, splits)
  except TrainingError as e:
    sys.exit(f"train.py: error: {e}")


def train(cfg, devices, splits):
  logdir = FLAGS.logdir
  train_x, train_y = splits["train"]
  val_x, val_y = splits["validation"]
  steps_per_epoch = len(train_x) // FLAGS.batch_size
  g = Graph(cfg, devices, (train_x[:32], train_y[:32]))
  latest_dir, best_dir = os.path.join(logdir, "latest"), os.path.join(logdir, "best")
  stop = {"requested": False}

  def on_sigint(signum, frame):
    if stop["requested"]:
      raise KeyboardInterrupt
    stop["requested"] = True
    tqdm.tqdm.write("Interrupted: saving a checkpoint at the end of this step "
                    "(Ctrl-C again to quit without saving)")
  previous_handler = signal.signal(signal.SIGINT, on_sigint)

  with tf.compat.v1.Session(graph=g.graph, config=session_config(devices)) as sess:
    ckpt = tf.train.latest_checkpoint(latest_dir)
    if ckpt:
      g.saver_latest.restore(sess, ckpt)
      print(f"Resuming from {ckpt}")
    else:
      sess.run(g.init)
    step, epoch, examples, best_val = (x.item() for x in sess.run(
        [g.global_step, g.epoch, g.epoch_examples, g.best_val]))
    writer = tf.compat.v1.summary.FileWriter(logdir, g.graph if not ckpt else None)

    def save(saver, folder, epoch, examples, best_val):
      sess.run(g.set_state, {g.state_in["epoch"]: epoch,
                             g.state_in["epoch_examples"]: examples,
                             g.state_in["best_val"]: best_val})
      return saver.save(sess, os.path.join(folder, "model.ckpt"), g.global_step)

    def validate(row, epoch, examples, best_val):
      """Scores the validation split, appends `row` to metrics.jsonl and
      saves the best checkpoint; returns the best validation accuracy."""
      if len(val_y):
        val = evaluation.run(sess, g.eval, val_x, val_y)
        row.update(val_loss=val["loss"], val_accuracy=val["accuracy"],
                   val_error_percent=val["error_percent"])
        print(f"epoch {row['epoch']}: validation accuracy {val['accuracy']:.4f} "
              f"(error {val['error_percent']:.2f}%), loss {val['loss']:.4f}"
              + (f", {row['images_per_sec']} images/s" if "images_per_sec" in row else ""))
        add_scalars(writer, step, {"validation/accuracy": val["accuracy"],
                                   "validation/loss": val["loss"]})
      if not len(val_y) or val["accuracy"] > best_val:
        # Without a validation split the newest state counts as the best.
        best_val = val["accuracy"] if len(val_y) else best_val
        save(g.saver_best, best_dir, epoch, examples, best_val)
      files.append_jsonl(os.path.join(logdir, "metrics.jsonl"), row)
      return best_val

    def out_of_steps():
      return FLAGS.max_steps and step >= FLAGS.max_steps

    while epoch < FLAGS.epochs and not out_of_steps() and not stop["requested"]:
      order = data.epoch_order(len(train_x), FLAGS.seed, epoch)[examples:]
      done_batches = int(examples) // FLAGS.batch_size
      sess.run(g.iterator.initializer, {
          g.images_in: train_x[order], g.labels_in: train_y[order],
          g.seed_in: FLAGS.seed * 100003 + epoch, g.first_batch_in: done_batches})
      bar = tqdm.tqdm(total=steps_per_epoch, initial=done_batches,
                      desc=f"epoch {epoch + 1}/{FLAGS.epochs}",
                      disable=not FLAGS.progress, dynamic_ncols=True)
      t_epoch, t_val, n_epoch, losses, accs = time.time(), 0.0, 0, [], []
      while not stop["requested"] and not out_of_steps():
        t0 = time.time()
        fetch = [g.train_op, g.loss, g.accuracy]
        want_summary = (step + 1) % FLAGS.summary_every == 0
        if want_summary:
          fetch.append(g.summary)
        try:
          res = sess.run(fetch)
        except tf.errors.OutOfRangeError:
          break
        loss_val, acc_val = res[1], res[2]
        step += 1   # read back global_step in the same run may predate the update
        if not np.isfinite(loss_val):
          raise TrainingError(
              f"loss is {loss_val} at step {step}; stopped without saving, the "
              f"last good checkpoint is {tf.train.latest_checkpoint(latest_dir)}")
        examples += FLAGS.batch_size
        n_epoch += FLAGS.batch_size
        losses.append(loss_val)
        accs.append(acc_val)
        if want_summary:
          writer.add_summary(res[3], step)
        if g.diag and (step % FLAGS.diag_every == 0 or step == 1):
          record_diagnostic(sess, g, writer, step, epoch, examples, steps_per_epoch)
        if (FLAGS.val_every and step % FLAGS.val_every == 0
            and examples < steps_per_epoch * FLAGS.batch_size):
          t = time.time()
          position = round(epoch + examples / (steps_per_epoch * FLAGS.batch_size), 3)
          best_val = validate({"epoch": position, "step": step}, epoch, examples, best_val)
          t_val += time.time() - t
        if step % FLAGS.save_every == 0:
          save(g.saver_latest, latest_dir, epoch, examples, best_val)
        bar.update(1)
        bar.set_postfix(loss=f"{loss_val:.4f}", acc=f"{acc_val:.3f}",
                        img_s=f"{FLAGS.batch_size / (time.time() - t0):.0f}")
      bar.close()
      if stop["requested"] or examples < steps_per_epoch * FLAGS.batch_size:
        save(g.saver_latest, latest_dir, epoch, examples, best_val)
        break
      wall = time.time() - t_epoch - t_val
      epoch, examples = epoch + 1, 0
      row = {"epoch": epoch, "step": step, "wall_s": round(wall, 1),
             "images_per_sec": round(n_epoch / wall, 1),
             "train_loss": float(np.mean(losses)) if losses else None,
             "train_accuracy": float(np.mean(accs)) if accs else None}
      best_val = validate(row, epoch, examples, best_val)
      save(g.saver_latest, latest_dir, epoch, examples, best_val)
    writer.flush()

    if stop["requested"]:
      print(f"Saved {tf.train.latest_checkpoint(latest_dir)}; run again with "
            f"--logdir={logdir} to resume")
      signal.signal(signal.SIGINT, previous_handler)
      sys.exit(130)
    signal.signal(signal.SIGINT, previous_handler)
    best = tf.train.latest_checkpoint(best_dir)
    if best is None:
      print("No completed epoch yet: no best checkpoint to test")
      return
    g.saver_best.restore(sess, best)
    test = evaluation.run(sess, g.eval, *splits["test"])
    result = dict(evaluation.summary(test), checkpoint=best, split="test")
    files.write_json(os.path.join(logdir, "test_results.json"), result)
    print(f"test ({best}): accuracy {test['accuracy']:.4f}, error "
          f"{test['error_percent']:.2f}% on {test['count']} images")


def add_scalars(writer, step, values):
  summary = tf.compat.v1.Summary(value=[
      tf.compat.v1.Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
  writer.add_summary(summary, step)


def record_diagnostic(sess, g, writer, step, epoch, examples, steps_per_epoch):
  """||g_full - g_stop|| / ||g_full|| on the fixed batch, to diagnostics.jsonl."""
  values = {k: float(v) for k, v in sess.run(g.diag).items()}
  add_scalars(writer, step, {f"grad_through_routing/{k}": v for k, v in values.items()})
  row = {"step": step, "epoch": round(epoch + examples / (steps_per_epoch * FLAGS.batch_size), 3)}
  row.update(values)
  files.append_jsonl(os.path.join(FLAGS.logdir, "diagnostics.jsonl"), row)


if __name__ == "__main__":
  app.run(main)
