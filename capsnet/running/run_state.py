"""Where a training run is, kept in variables so that every checkpoint holds it:
the global step, completed epochs, position in the epoch's order, the best
validation accuracy and loss (`is_better`; with weight averaging, whose weights
won) and the epoch's running sums. train.py resumes from it exactly."""
import dataclasses
import os

import numpy as np
import tensorflow as tf

from capsnet.running import runs


@dataclasses.dataclass
class Position:
  """Where a run is. Saved with the weights, so that a resume continues."""
  step: int = 0             # global step
  epoch: int = 0            # completed epochs
  examples: int = 0         # examples of the current epoch already trained
  best_val: float = -1.0    # best validation accuracy so far (-1: none)
  best_val_loss: float = float("inf")  # its validation loss (the tie rule)
  best_averaged: bool = False  # the best checkpoint won with its averaged weights
  loss_sum: float = 0.0     # sums over the current epoch's steps, for its
  accuracy_sum: float = 0.0  # metrics row (float64, added in step order)
  summed_steps: int = 0     # steps in those sums

  def add_step(self, examples, loss, accuracy):
    """A training step of `examples` (the step counted already)."""
    self.examples += examples
    self.loss_sum += float(loss)
    self.accuracy_sum += float(accuracy)
    self.summed_steps += 1


def is_better(accuracy, loss, best_accuracy, best_loss, tie_wins=True):
  """The best-checkpoint rule: a higher validation accuracy wins, then the lower
  validation loss, then the later (this) one if `tie_wins`; compared in
  float32, as the checkpoint keeps them, so a resumed run decides as an
  uninterrupted one."""
  accuracy, loss = np.float32(accuracy), np.float32(loss)
  best_accuracy, best_loss = np.float32(best_accuracy), np.float32(best_loss)
  if accuracy != best_accuracy:
    return bool(accuracy > best_accuracy)
  return bool(loss < best_loss or (tie_wins and loss == best_loss))


class RunState:
  """A `Position` kept in variables. The epoch sums and best loss came later:
  made after the model's variables (`add_epoch_sums`, so its initial weights did
  not move), and restored at their defaults from a checkpoint without them
  (`optional`)."""

  def __init__(self):
    self.global_step = tf.compat.v1.train.get_or_create_global_step()
    get = tf.compat.v1.get_variable
    self._vars = {   # Position field: variable (names kept for old checkpoints)
        "epoch": get("state/epoch", [], tf.int64, tf.zeros_initializer(),
                     trainable=False),
        "examples": get("state/epoch_examples", [], tf.int64,
                        tf.zeros_initializer(), trainable=False),
        "best_val": get("state/best_val_accuracy", [], tf.float32,
                        tf.constant_initializer(-1.0), trainable=False)}
    self._feeds = {k: tf.compat.v1.placeholder(v.dtype.base_dtype, [])
                   for k, v in self._vars.items()}
    self._assign = tf.group(*[v.assign(self._feeds[k]) for k, v in self._vars.items()])
    self.optional = []

  def add_epoch_sums(self):
    get = tf.compat.v1.get_variable
    sums = {"loss_sum": get("state/epoch_loss_sum", [], tf.float64,
                            tf.zeros_initializer(), trainable=False),
            "accuracy_sum": get("state/epoch_accuracy_sum", [], tf.float64,
                                tf.zeros_initializer(), trainable=False),
            "summed_steps": get("state/epoch_summed_steps", [], tf.int64,
                                tf.zeros_initializer(), trainable=False),
            "best_val_loss": get("state/best_val_loss", [], tf.float32,
                                 tf.constant_initializer(np.inf), trainable=False)}
    feeds = {k: tf.compat.v1.placeholder(v.dtype.base_dtype, []) for k, v in sums.items()}
    self._assign = tf.group(self._assign, *[v.assign(feeds[k]) for k, v in sums.items()])
    self._vars.update(sums)
    self._feeds.update(feeds)
    self.optional = list(sums.values())

  def add_averaging(self):
    """Which weights won the best validation (runs with --ema_decay only)."""
    var = tf.compat.v1.get_variable("state/best_averaged", [], tf.bool,
                                    tf.constant_initializer(False), trainable=False)
    feed = tf.compat.v1.placeholder(tf.bool, [])
    self._assign = tf.group(self._assign, var.assign(feed))
    self._vars["best_averaged"] = var
    self._feeds["best_averaged"] = feed

  def add_savers(self):
    """The savers, once the graph holds every variable: latest/ keeps two, best/
    one, epochs/ all, and one without the `optional` state (for checkpoints
    written before it)."""
    self.savers = {
        "latest": tf.compat.v1.train.Saver(max_to_keep=2, save_relative_paths=True),
        "best": tf.compat.v1.train.Saver(max_to_keep=1, save_relative_paths=True),
        "epochs": tf.compat.v1.train.Saver(max_to_keep=None, save_relative_paths=True)}
    self._saver_without_optional = tf.compat.v1.train.Saver(
        [v for v in tf.compat.v1.global_variables() if v not in self.optional])
    self._init_optional = tf.compat.v1.variables_initializer(self.optional)

  def load(self, sess):
    """The position held by the variables (after a restore or an init)."""
    values = sess.run({"step": self.global_step, **self._vars})
    return Position(**{k: v.item() for k, v in values.items()})

  def save(self, sess, which, folder, pos):
    """Writes `pos` into the variables, then a checkpoint into `folder` with
    the saver of `which` ("latest", "best" or "epochs")."""
    sess.run(self._assign, {self._feeds[k]: getattr(pos, k) for k in self._vars})
    return self.savers[which].save(sess, os.path.join(folder, runs.CHECKPOINT_PREFIX),
                                   self.global_step, write_meta_graph=False)

  def restore(self, sess, ckpt):
    """Restores every variable; state a checkpoint lacks (written before that
    state existed) starts at its default."""
    runs.check_matches(ckpt, sess.graph.get_collection(
        tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES))
    names = set(tf.train.load_checkpoint(ckpt).get_variable_to_shape_map())
    if all(v.op.name in names for v in self.optional):
      self.savers["latest"].restore(sess, ckpt)
    else:
      self._saver_without_optional.restore(sess, ckpt)
      sess.run(self._init_optional)


def restore_or_init(sess, state, init, folder):
  """(The run's `Position`, whether a checkpoint was restored): the newest
  intact checkpoint of latest/ (or best/, epochs/) of `folder` restored by
  `state`'s savers, or `init` run in a logdir without any.

  A damaged checkpoint is passed over, saying so; its files stay and its
  folder's index lists the intact ones only. Metrics and diagnostics rows after
  the restored step are dropped. Raises RunError if there are checkpoints but
  none is intact.
  """
  ckpt, damaged = folder.newest_intact()
  for prefix, reason in damaged:
    print(f"{prefix}: damaged ({reason}); passed over")
  if ckpt is None and damaged:
    raise runs.RunError(f"{folder.path}: no intact checkpoint ({len(damaged)} "
                        "damaged); move the logdir away to start again")
  if ckpt is None:   # (rows of an attempt killed before its first save go)
    sess.run(init)
    folder.drop_rows_after(0)
    return state.load(sess), False
  state.restore(sess, ckpt)
  print(f"Resuming from {ckpt}")
  pos = state.load(sess)
  for which in runs.CHECKPOINT_FOLDERS:
    saver = state.savers[which]
    kept = [p for p in folder.checkpoints(which) if runs.step_of(p) <= pos.step
            and p not in dict(damaged)]
    saver.recover_last_checkpoints(kept)   # so that it deletes them in turn
    if any(os.path.dirname(p) == folder.checkpoint_folder(which) for p, _ in damaged):
      runs.relist(folder.checkpoint_folder(which), kept)   # intact ones only
  folder.drop_rows_after(pos.step)
  return pos, True

