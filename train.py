"""Trains CapsNet on MNIST: `python train.py --iter_routing=3`.

Session-based (tf.compat.v1). The model runs on --device (GPU when present),
the input pipeline on the CPU, soft placement lets the same graph run
anywhere. --logdir is a run folder (`capsnet/running/runs.py` has its layout): the
config, checkpoints in latest/ (every --save_every steps and each epoch end),
best/ (the best validation accuracy; ties: the lower validation loss) and
epochs/ (the ends of the --keep_epochs epochs), the metrics and diagnostic rows,
TensorBoard events and, at the end, the best checkpoint's test results.

Re-running with the same --logdir resumes from latest/ (step, optimizer state,
epoch, position in the epoch's data order).

The file reads top to bottom: settings (read from the flags once, in `main`),
the run's position, the graph, then the loop: restore or initialise, train an
epoch, end it (validate, save), and score the best checkpoint on the test set.
"""
import collections
import contextlib
import dataclasses
import os
import signal
import sys
import time

from capsnet.running import startup
startup.import_tensorflow()   # before anything imports TensorFlow

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tqdm  # noqa: E402

import config  # noqa: E402
from capsnet.data import mnist  # noqa: E402
from capsnet.model import network  # noqa: E402
from capsnet.running import averaging  # noqa: E402
from capsnet.running import cluster_spec  # noqa: E402
from capsnet.running import evaluation  # noqa: E402
from capsnet.running import planner  # noqa: E402
from capsnet.running import roles  # noqa: E402
from capsnet.running import run_state  # noqa: E402
from capsnet.running import runs  # noqa: E402
from capsnet.running import stopping  # noqa: E402

config.define_train_flags()
FLAGS = flags.FLAGS

class TrainingError(Exception):
  """Training cannot go on (non-finite loss)."""


# --------------------------------------------------------------------------
# The graph

TrainGraph = collections.namedtuple("TrainGraph", [
    "graph", "state", "input", "lr", "train_op", "loss", "accuracy", "summary",
    "eval", "eval_averaged", "diag", "init", "coordination"])


def build_graph(cfg, s, role, devices, fixed_batch):
  """Everything train.py runs, in one finalized tf.Graph.

  Args:
    role: this process's `roles` role (where the variables live, how the
      optimizer aggregates, what the tasks coordinate with).
    fixed_batch: (images, labels, targets or None) uint8/int arrays for the
      gradient diagnostic (`task.fixed_batch`).
  Returns: a `TrainGraph`.
  """
  graph = tf.Graph()
  with graph.as_default(), role.device_scope():
    tf.compat.v1.set_random_seed(s.seed)
    state = run_state.RunState()
    task = s.task()
    pipe = task.train_pipeline([cfg.image_size, cfg.image_size, cfg.image_channels],
                               s.batch_size, (role.index, role.workers))
    images, labels, targets = pipe.batch
    lr = tf.compat.v1.train.exponential_decay(
        s.learning_rate, state.global_step, s.decay_steps, s.decay_rate)
    opt = role.wrap_optimizer(tf.compat.v1.train.AdamOptimizer(lr))
    grads, outs = network.tower_gradients(
        images, labels, cfg, opt, devices, targets=targets,
        variable_device=role.variable_device(), heads=task.heads)
    train_op = opt.apply_gradients(grads, state.global_step)
    n = float(len(outs))
    loss = tf.add_n([o.loss for o in outs]) / n
    accuracy = tf.add_n([o.accuracy for o in outs]) / n
    summary = network.training_summaries(outs[0], images, lr)
    ev = evaluation.build(cfg, s.eval_batch_size, devices[0], task)
    diag = {}
    if s.diag_every:
      with tf.compat.v1.device(devices[0]), tf.name_scope("diagnostic"):
        fixed_images, fixed_labels, fixed_targets = fixed_batch
        diag = network.gradient_diagnostic(
            mnist.pixels(tf.constant(fixed_images)), tf.constant(fixed_labels), cfg,
            devices[0], None if fixed_targets is None else
            mnist.pixels(tf.constant(fixed_targets)), heads=task.heads)
    state.add_epoch_sums()
    eval_averaged = None
    if s.ema_decay:   # created last: the graph of a run without it is unchanged
      train_op, eval_averaged = averaging.weight_averaging(
          cfg, s.ema_decay, s.eval_batch_size, state, train_op, devices[0], task)
    state.add_savers()
    init = tf.compat.v1.global_variables_initializer()
    coordination = role.coordination(opt)
  graph.finalize()
  return TrainGraph(graph, state, pipe, lr, train_op, loss, accuracy, summary, ev,
                    eval_averaged, diag, init, coordination)


# --------------------------------------------------------------------------
# The loop

# What one call of `train` works with.
Run = collections.namedtuple("Run", ["sess", "g", "s", "role", "folder", "splits",
                                     "writer", "stop"])


def main(argv):
  del argv
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)  # deprecations
  try:
    cfg = config.model_config_from_flags(FLAGS)
    s = config.settings_from_flags(FLAGS)
  except ValueError as e:   # ModelConfig and cluster errors
    sys.exit(f"train.py: error: {e}")
  role = roles.choose(s.cluster, s.sync, s.cluster_wait_secs)   # once
  if role.serves:
    sys.exit(role.serve())
  run_lock = None   # this process's hold on the logdir
  try:
    if role.writes:   # the only process that writes the logdir
      folder = runs.RunFolder(s.logdir)
      folder.check_writable()
      run_lock = folder.lock()   # before reading anything there
      s.check_resume(folder, cfg)
      cfg = plan(cfg, s, role, folder)
    splits = s.load_splits(cfg)
  except ValueError as e:   # DataError and RunError are ValueErrors
    if run_lock:   # a run that does not start leaves nothing
      run_lock.release(undo=True)
    sys.exit(f"train.py: error: {e}")
  try:
    run_training(cfg, s, role, config.tower_devices(s.device, s.num_gpus), splits)
  finally:
    if run_lock:
      run_lock.release()


def plan(cfg, s, role, folder):
  """cfg with the convolution plan (and --precision=auto's choice) measured
  on this host, or a resumed run's recorded one (`planner.plan_model`),
  where the role plans (`roles`)."""
  if not role.plans:
    return cfg
  recorded = folder.config()
  cfg, line = planner.plan_model(cfg, s.batch_size // s.num_gpus, s.device,
                                 recorded["model"] if recorded else None, s.replan,
                                 FLAGS.precision == "auto")
  if line:
    print(line, flush=True)
  return cfg


def run_training(cfg, s, role, devices, splits):
  """`train`, with its errors as one line and its exit statuses."""
  try:
    train(cfg, s, role, devices, splits)
  except (TrainingError, runs.RunError, cluster_spec.ClusterError) as e:
    sys.exit(f"train.py: error: {e}")
  except OSError as e:
    sys.exit(f"train.py: error: {e.filename or s.logdir}: {e.strerror or e}")
  except stopping.Quit as e:
    stopping.ignore_stop_signals()
    print(f"{signal.Signals(e.signum).name} again: quit without saving; the last "
          f"checkpoint is {runs.RunFolder(s.logdir).latest_checkpoint('latest')}",
          file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # At once: interpreter shutdown with TensorFlow's input threads still
    # running can abort the process ("exception not rethrown").
    os._exit(128 + e.signum)
  except SystemExit:   # stopped by a signal and saved: a later one changes nothing
    stopping.ignore_stop_signals()
    raise


def train(cfg, s, role, devices, splits):
  """Trains until --epochs or --max_steps, then tests the best checkpoint.

  Writes config.json once the graph is built and the session restored or
  initialised. Exits with status 128 + the signal's number after a stop
  signal (Ctrl-C: 130, SIGTERM: 143, SIGHUP: 129), once the checkpoint is
  saved. What differs between the run's processes is the `role`'s; only
  the one that `writes` restores, validates, saves and writes.
  """
  fixed_batch = s.task().fixed_batch(splits)
  devices = role.devices(devices)
  role.start()
  g = build_graph(cfg, s, role, devices, fixed_batch)
  folder = runs.RunFolder(s.logdir)
  stop = role.stop_request()
  proto = config.session_config(devices, s.log_device_placement)
  try:
    with stop.installed(), role.open_session(g.graph, proto, g.coordination) as sess:
      pos, resumed = role.begin(sess, g, folder)
      writer = role.writer(lambda: start_writing(g, s, cfg, pos, resumed))
      with contextlib.closing(writer), role.watching(sess, g.coordination):
        run = Run(sess, g, s, role, folder, splits, writer, stop)
        if role.writes and resumed:
          keep_epoch(run, pos)
        with role.ending_together(sess, g.coordination, stop, pos):
          train_epochs(run, pos)
        writer.flush()
        if stop.requested:
          stop_early(run, pos)
        if role.writes:
          final_test(run)
      role.end(sess, g.coordination)
  finally:
    role.close()


def stop_early(run, pos):
  """After a stop signal, with the checkpoint saved (the role ends the
  run's other processes first). Exits with 128 + the signal's number."""
  run.role.stop_early(run.sess, run.g.coordination, run.stop, pos.step)
  print(f"Saved {run.folder.latest_checkpoint('latest')}; run again with "
        f"--logdir={run.s.logdir} to resume")
  sys.exit(run.stop.exit_status)


def start_writing(g, s, cfg, pos, resumed):
  """config.json and the events file (of the process that writes)."""
  s.write_config(cfg)
  writer = tf.compat.v1.summary.FileWriter(s.logdir, None if resumed else g.graph)
  if resumed:   # TensorBoard drops what the first attempt logged after pos.step
    writer.add_session_log(tf.compat.v1.SessionLog(
        status=tf.compat.v1.SessionLog.START), pos.step)
  return writer


def train_epochs(run, pos):
  """Epochs until --epochs, --max_steps or a Ctrl-C (then a checkpoint)."""
  s = run.s
  while pos.epoch < s.epochs and not out_of_steps(s, pos) and not run.stop.requested:
    stats = run_epoch(run, pos)
    if run.stop.requested or pos.examples < epoch_images(run):
      if run.role.writes:
        save(run, "latest", pos)
      return
    end_epoch(run, pos, stats)


def steps_per_epoch(run):
  """Steps an epoch: a step takes --batch_size examples from each worker."""
  return len(run.splits["train"][0]) // (run.s.batch_size * run.role.workers)


def epoch_images(run):
  return steps_per_epoch(run) * run.s.batch_size * run.role.workers


def out_of_steps(s, pos):
  return s.max_steps and pos.step >= s.max_steps


def save(run, which, pos):
  """A checkpoint of `pos` into latest/, best/ or epochs/; a second Ctrl-C waits.

  Raises: TrainingError if it cannot be written (e.g. a full disk); the
  checkpoints listed before stay listed and whole.
  """
  folder = run.folder.checkpoint_folder(which)
  run.role.before_save(run.sess, run.g.state.global_step, pos.step, run.folder)
  try:
    with run.stop.deferred():
      run.g.state.save(run.sess, which, folder, pos)
  except (tf.errors.OpError, OSError) as e:
    reason = runs.error_reason(e)
    raise TrainingError(
        f"could not write the checkpoint of step {pos.step} to {folder} ({reason}); "
        f"the last complete one is {tf.train.latest_checkpoint(folder)}") from None


@dataclasses.dataclass
class EpochStats:
  """Timing of one `run_epoch` call (the loss sums are in the Position)."""
  start: float                  # time.time() at the start
  val_seconds: float = 0.0      # spent in validations inside the epoch
  images: int = 0
  last_loss: float = 0.0
  last_accuracy: float = 0.0


def run_epoch(run, pos):
  """Trains from `pos` to the end of its epoch, --max_steps or a Ctrl-C.

  Advances `pos` step by step (validating and saving on the way as the
  settings ask). Returns: the `EpochStats` of the steps it ran.
  """
  sess, g, s = run.sess, run.g, run.s
  task, workers = s.task(), run.role.workers
  order = task.epoch_order(len(run.splits["train"][1]), s.seed, pos.epoch, s.batch_size,
                           (run.role.index, workers))[pos.examples // workers:]
  done_batches = pos.examples // (s.batch_size * workers)
  feed = {g.input.seed: s.seed * 100003 + pos.epoch, g.input.first_batch: done_batches,
          **task.epoch_feed(g.input, run.splits["train"], order)}
  sess.run(g.input.iterator.initializer, feed)
  bar = tqdm.tqdm(total=steps_per_epoch(run), initial=done_batches,
                  desc=f"epoch {pos.epoch + 1}/{s.epochs}", disable=not s.progress,
                  dynamic_ncols=True)
  stats = EpochStats(time.time())
  while not run.stop.requested and not out_of_steps(s, pos):
    t0 = time.time()
    if not train_step(run, pos, stats):
      break
    bar.update(1)
    bar.set_postfix(loss=f"{stats.last_loss:.4f}", acc=f"{stats.last_accuracy:.3f}",
                    img_s=f"{s.batch_size / (time.time() - t0):.0f}")
  bar.close()
  return stats


def train_step(run, pos, stats):
  """One training step and what follows it. Returns False at the epoch's end.

  Raises: TrainingError for a non-finite loss (nothing saved).
  """
  sess, g, s = run.sess, run.g, run.s
  fetch = {"train": g.train_op, "loss": g.loss, "accuracy": g.accuracy}
  want_summary = (pos.step + 1) % s.summary_every == 0
  if want_summary:
    fetch["summary"] = g.summary
  fetch.update(run.role.step_fetches(g.coordination))
  res = run_step(run, pos, fetch)
  if res is None:
    return False
  loss, accuracy = res["loss"], res["accuracy"]
  pos.step += 1   # global_step read in the same run may predate the update
  if not np.isfinite(loss):
    raise TrainingError(
        f"loss is {loss} at step {pos.step}; stopped without saving, the last "
        f"good checkpoint is {runs.RunFolder(s.logdir).latest_checkpoint('latest')}")
  pos.examples += s.batch_size * run.role.workers
  pos.loss_sum += float(loss)
  pos.accuracy_sum += float(accuracy)
  pos.summed_steps += 1
  stats.images += s.batch_size * run.role.workers
  stats.last_loss, stats.last_accuracy = loss, accuracy
  if want_summary:
    run.writer.add_summary(res["summary"], pos.step)
  if not run.role.after_step(sess, g.coordination, res, run.stop):
    return True   # another process validates, saves and records
  if g.diag and (pos.step % s.diag_every == 0 or pos.step == 1):
    record_diagnostic(run, pos)
  images = epoch_images(run)
  if s.val_every and pos.step % s.val_every == 0 and pos.examples < images:
    t = time.time()
    validate(run, pos, {"epoch": round(pos.epoch + pos.examples / images, 3),
                        "step": pos.step}, kind="validation")
    stats.val_seconds += time.time() - t
  if pos.step % s.save_every == 0 and pos.examples < images:
    save(run, "latest", pos)   # (end_epoch saves the last step)
  return True


def run_step(run, pos, fetch):
  """The training step's session run. Returns None at the epoch's end.

  Raises: the role's error (a ClusterError) when another process of the run
  is gone.
  """
  try:
    res = run.sess.run(fetch)
  except tf.errors.OutOfRangeError:
    return None
  except run.role.task_errors as e:
    raise run.role.task_gone(e, pos.step + 1, run.folder) from None
  run.role.check_step(pos.step + 1, run.folder)
  return res


def end_epoch(run, pos, stats):
  """Closes a completed epoch: its metrics row, validation, checkpoints.

  train_loss and train_accuracy are means over all the epoch's steps, across
  resumes (images/s and wall_s: this attempt's steps only).
  """
  wall = time.time() - stats.start - stats.val_seconds
  n = pos.summed_steps
  row = {"epoch": pos.epoch + 1, "step": pos.step, "wall_s": round(wall, 1),
         "images_per_sec": round(stats.images / wall, 1),
         "train_loss": pos.loss_sum / n if n else None,
         "train_accuracy": pos.accuracy_sum / n if n else None}
  pos.epoch, pos.examples = pos.epoch + 1, 0
  pos.loss_sum, pos.accuracy_sum, pos.summed_steps = 0.0, 0.0, 0
  if run.role.writes:
    validate(run, pos, row, kind="epoch")
    keep_epoch(run, pos)
    save(run, "latest", pos)


def keep_epoch(run, pos):
  """At the end of an epoch --keep_epochs names, its weights into epochs/
  (once: a run resumed from a checkpoint of that step that stopped before
  epochs/ was written writes it then)."""
  if (pos.examples == 0 and pos.epoch in run.s.keep_epochs
      and not any(runs.step_of(p) == pos.step for p in run.folder.checkpoints("epochs"))):
    save(run, "epochs", pos)


def validate(run, pos, row, kind):
  """Scores the validation split into `row` (with weight averaging, also the
  averaged weights: the `*_averaged` keys), appends it to metrics.jsonl and
  saves the best checkpoint by the better of the two (without a validation
  split: the newest). Best: the higher validation accuracy; a tie goes to
  the lower validation loss, then to the later step (`run_state.is_better`)."""
  split = run.splits["validation"]
  val_y = split[1]
  if len(val_y):
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
  if not len(val_y):
    save(run, "best", pos)
    return
  # Raw or averaged weights, then this validation against the best so far,
  # by one rule (`run_state.is_better`); raw and averaged tied: the raw.
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
  graph = run.g.eval_averaged if averaged else run.g.eval
  test = evaluation.run(run.sess, graph, *run.splits["test"])
  result = dict(evaluation.summary(test), checkpoint=best, split="test")
  if run.g.eval_averaged:
    result["weights"] = "averaged" if averaged else "raw"
  run.folder.write_test_results(result)
  print(f"test ({best}{', averaged weights' if averaged else ''}): accuracy "
        f"{test['accuracy']:.4f}, error {test['error_percent']:.2f}% on "
        f"{test['count']} images")


def add_scalars(writer, step, values):
  summary = tf.compat.v1.Summary(value=[
      tf.compat.v1.Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
  writer.add_summary(summary, step)


def record_diagnostic(run, pos):
  """||g_full - g_stop|| / ||g_full|| on the fixed batch, to diagnostics.jsonl."""
  values = {k: float(v) for k, v in run.sess.run(run.g.diag).items()}
  add_scalars(run.writer, pos.step,
              {f"grad_through_routing/{k}": v for k, v in values.items()})
  row = {"step": pos.step, "epoch": round(pos.epoch + pos.examples / epoch_images(run), 3)}
  row.update(values)
  run.folder.append_diagnostic(row)


if __name__ == "__main__":
  app.run(main)
