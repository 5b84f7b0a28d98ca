"""What train.py's writing process records at the steps and epoch ends its loop
names: config.json and events, the diagnostic's rows, each epoch's metrics and
validation, the checkpoints (latest/, best/, epochs/) and at the end the best
checkpoint's test results. Each takes the loop's `Run`."""
import collections

import numpy as np
import tensorflow as tf

from capsnet.running import evaluation
from capsnet.running import run_state
from capsnet.running import runs


class TrainingError(Exception):
  """Training cannot go on (non-finite loss, a checkpoint not written)."""


# What the loop records with: its session, graph (train.py's TrainGraph),
# settings, run folder, data splits, summary writer, StopRequest, the role's
# `before_save` and the images of a whole epoch.
Run = collections.namedtuple("Run", ["sess", "g", "s", "folder", "splits", "writer",
                                     "stop", "before_save", "epoch_images"])


def start_writing(g, s, cfg, pos, resumed):
  """config.json and the events file (of the process that writes)."""
  s.write_config(cfg)
  writer = tf.compat.v1.summary.FileWriter(s.logdir, None if resumed else g.graph)
  if resumed:   # TensorBoard drops what the first attempt logged after pos.step
    writer.add_session_log(tf.compat.v1.SessionLog(
        status=tf.compat.v1.SessionLog.START), pos.step)
  return writer


def end_epoch(run, pos, wall, images, writes):
  """Closes a completed epoch: its metrics row (train_loss and train_accuracy
  over all its steps, across resumes), validation and checkpoints, where the
  process `writes`."""
  n = pos.summed_steps
  row = {"epoch": pos.epoch + 1, "step": pos.step, "wall_s": round(wall, 1),
         "images_per_sec": round(images / wall, 1),
         "train_loss": pos.loss_sum / n if n else None,
         "train_accuracy": pos.accuracy_sum / n if n else None}
  pos.epoch, pos.examples = pos.epoch + 1, 0
  pos.loss_sum, pos.accuracy_sum, pos.summed_steps = 0.0, 0.0, 0
  if writes:
    validate(run, pos, row, kind="epoch")
    keep_epoch(run, pos)
    save(run, "latest", pos)


def save(run, which, pos):
  """A checkpoint of `pos` into latest/, best/ or epochs/ (a second Ctrl-C
  waits). Raises TrainingError if it cannot be written; the checkpoints listed
  before stay listed and whole."""
  folder = run.folder.checkpoint_folder(which)
  run.before_save(run.sess, run.g.state.global_step, pos.step, run.folder)
  try:
    with run.stop.deferred():
      run.g.state.save(run.sess, which, folder, pos)
  except (tf.errors.OpError, OSError) as e:
    raise TrainingError(
        f"could not write the checkpoint of step {pos.step} to {folder} "
        f"({runs.error_reason(e)}); the last complete one is "
        f"{tf.train.latest_checkpoint(folder)}") from None


def keep_epoch(run, pos):
  """An epoch --keep_epochs names: its weights into epochs/ (once; also when a
  resumed run finds them missing)."""
  if (pos.examples == 0 and pos.epoch in run.s.keep_epochs
      and not any(runs.step_of(p) == pos.step for p in run.folder.checkpoints("epochs"))):
    save(run, "epochs", pos)


def validate(run, pos, row, kind):
  """Scores the validation split into `row` (with weight averaging the averaged
  weights too, `*_averaged`), appends it to metrics.jsonl and saves the best
  checkpoint by `run_state.is_better` (raw and averaged tied: raw; without a
  validation split: the newest)."""
  split = run.splits["validation"]
  if len(split[1]):
    graphs = {"": run.g.eval}
    if run.g.eval_averaged:
      graphs["_averaged"] = run.g.eval_averaged
    for suffix, graph in graphs.items():
      val = evaluation.run(run.sess, graph, *split)
      row.update({"val_loss" + suffix: val["loss"], "val_accuracy" + suffix: val["accuracy"],
                  "val_error_percent" + suffix: val["error_percent"]})
      if "at_least_one" in val:
        row["val_at_least_one" + suffix] = val["at_least_one"]
      add_scalars(run.writer, pos.step, {f"validation{suffix}/accuracy": val["accuracy"],
                                         f"validation{suffix}/loss": val["loss"]})
    print(f"epoch {row['epoch']}: validation accuracy {row['val_accuracy']:.4f} "
          f"(error {row['val_error_percent']:.2f}%), loss {row['val_loss']:.4f}"
          + (f"; averaged weights {row['val_accuracy_averaged']:.4f} (error "
             f"{row['val_error_percent_averaged']:.2f}%)" if run.g.eval_averaged else "")
          + (f", {row['images_per_sec']} images/s" if "images_per_sec" in row else ""))
  # The row first: a run killed before the best checkpoint is written
  # resumes from an earlier one, drops the row and writes it again.
  run.folder.append_metrics(row, kind)
  if not len(split[1]):
    save(run, "best", pos)
    return
  accuracy, loss, averaged = row["val_accuracy"], row["val_loss"], False
  if run.g.eval_averaged and run_state.is_better(
      row["val_accuracy_averaged"], row["val_loss_averaged"], accuracy, loss,
      tie_wins=False):
    accuracy, loss, averaged = row["val_accuracy_averaged"], row["val_loss_averaged"], True
  if run_state.is_better(accuracy, loss, pos.best_val, pos.best_val_loss):
    pos.best_val, pos.best_val_loss = float(np.float32(accuracy)), float(np.float32(loss))
    pos.best_averaged = averaged
    save(run, "best", pos)


def final_test(run):
  """Scores the best checkpoint on the test set once, with the weights that
  won its validation (raw or averaged): test_results.json."""
  best = run.folder.latest_checkpoint("best")
  if best is None:
    print("No completed epoch yet: no best checkpoint to test")
    return
  run.g.state.restore(run.sess, best)
  averaged = run.g.state.load(run.sess).best_averaged
  test = evaluation.run(run.sess, run.g.eval_averaged if averaged else run.g.eval,
                        *run.splits["test"])
  result = dict(evaluation.summary(test), checkpoint=best, split="test")
  if run.g.eval_averaged:
    result["weights"] = "averaged" if averaged else "raw"
  run.folder.write_json(runs.TEST_RESULTS_FILE, result)
  print(f"test ({best}{', averaged weights' if averaged else ''}): accuracy "
        f"{test['accuracy']:.4f}, error {test['error_percent']:.2f}% on "
        f"{test['count']} images")


def add_scalars(writer, step, values):
  writer.add_summary(tf.compat.v1.Summary(value=[
      tf.compat.v1.Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()]),
      step)


def record_diagnostic(run, pos):
  """||g_full - g_stop|| / ||g_full|| on the fixed batch, to diagnostics.jsonl."""
  values = {k: float(v) for k, v in run.sess.run(run.g.diag).items()}
  add_scalars(run.writer, pos.step,
              {f"grad_through_routing/{k}": v for k, v in values.items()})
  run.folder.append_diagnostic({
      "step": pos.step, "epoch": epoch_of(run, pos), **values})


def epoch_of(run, pos):
  """Where `pos` is in epochs (3 decimals), for a row."""
  return round(pos.epoch + pos.examples / run.epoch_images, 3)


class NullWriter:
  """What a process that does not write the run folder (a cluster's worker
  other than the chief) writes events with: nothing."""

  def add_summary(self, *args):
    pass

  def flush(self):
    pass

  def close(self):
    pass
