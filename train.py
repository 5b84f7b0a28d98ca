"""Trains CapsNet on MNIST: `python train.py --iter_routing=3`.

Session-based (tf.compat.v1): the model on --device (GPU when present), the
input pipeline on the CPU, soft placement. --logdir is a run folder
(`capsnet/running/runs.py`): config, checkpoints in latest/, best/ (the best
validation accuracy) and epochs/ (--keep_epochs), metrics, TensorBoard events
and the best checkpoint's test results. Re-running with the same --logdir
resumes exactly.

`main` reads the flags once, decides precision and plan and takes the folder;
`build_graph` builds what the run computes; `train` is the loop. A cluster's
workers run the same loop; what differs is their role's
(`capsnet/running/roles.py`).
"""
import collections
import contextlib
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

from capsnet.data import mnist  # noqa: E402
from capsnet.model import network  # noqa: E402
from capsnet.running import averaging  # noqa: E402
from capsnet.running import cluster_spec  # noqa: E402
from capsnet.running import evaluation  # noqa: E402
from capsnet.running import planner  # noqa: E402
from capsnet.running import recording  # noqa: E402
from capsnet.running import roles  # noqa: E402
from capsnet.running import run_state  # noqa: E402
from capsnet.running import runs  # noqa: E402
from capsnet.running import stopping  # noqa: E402
import config  # noqa: E402

config.define_train_flags()
FLAGS = flags.FLAGS


def main(argv):
  del argv
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)  # deprecations
  try:
    cfg = config.model_config_from_flags(FLAGS)
    s = config.settings_from_flags(FLAGS)
  except ValueError as e:   # ModelConfig and cluster errors
    sys.exit(f"train.py: error: {e}")
  note = config.kept_past_the_end(s.keep_epochs, s.epochs)
  if note:
    print(note, flush=True)
  if s.cluster is not None and s.cluster.job == "ps":   # serves, runs no loop
    sys.exit(roles.serve(s.cluster))
  role = roles.choose(s.cluster, s.sync, s.cluster_wait_secs)
  folder, run_lock = runs.RunFolder(s.logdir), None
  try:
    if role.writes:   # the only process that writes the logdir
      folder.check_writable()
      run_lock = folder.lock()   # before reading anything there
      s.check_resume(folder, cfg)
    if role.plans:   # the convolutions (and --precision=auto) measured here,
      recorded = folder.config()   # or a resumed run's own
      cfg, line = planner.plan_model(cfg, s.batch_size // s.num_gpus, s.device,
                                     recorded["model"] if recorded else None, s.replan,
                                     s.precision_auto)
      if line:
        print(line, flush=True)
    task = s.task()   # the data set's, built once for the run
    splits = s.load_splits(cfg, task)
  except ValueError as e:   # DataError and RunError are ValueErrors
    if run_lock:   # a run that does not start leaves nothing
      run_lock.release(undo=True)
    sys.exit(f"train.py: error: {e}")
  try:
    train(cfg, s, task, role, folder, splits)
  except roles.Ended as e:   # a worker whose chief stopped or ended the run
    sys.exit(e.status)
  except (recording.TrainingError, runs.RunError, cluster_spec.ClusterError) as e:
    sys.exit(f"train.py: error: {e}")
  except OSError as e:
    sys.exit(f"train.py: error: {e.filename or s.logdir}: {e.strerror or e}")
  except stopping.Quit as e:   # the stop signals are ignored from here (StopRequest)
    print(f"{signal.Signals(e.signum).name} again: quit without saving; the last "
          f"checkpoint is {folder.latest_checkpoint('latest')}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # At once: interpreter shutdown with TensorFlow's input threads still
    # running can abort the process ("exception not rethrown").
    os._exit(128 + e.signum)
  finally:
    if run_lock:
      run_lock.release()


TrainGraph = collections.namedtuple("TrainGraph", [
    "graph", "state", "input", "lr", "train_op", "loss", "accuracy", "summary",
    "eval", "eval_averaged", "diag", "init", "coordination"])


def build_graph(cfg, s, task, role, devices, fixed_batch):
  """Everything train.py runs, in one finalized tf.Graph: input pipeline,
  towers' gradients and Adam, validation graph, the gradient diagnostic on
  `fixed_batch` and the run's state, placed by the role."""
  place = role.placement
  graph = tf.Graph()
  with graph.as_default(), place.scope():
    tf.compat.v1.set_random_seed(s.seed)
    state = run_state.RunState()
    pipe = task.train_pipeline([cfg.image_size, cfg.image_size, cfg.image_channels],
                               s.batch_size, place.shard)
    images, labels, targets = pipe.batch
    lr = tf.compat.v1.train.exponential_decay(
        s.learning_rate, state.global_step, s.decay_steps, s.decay_rate)
    opt = place.optimizer(tf.compat.v1.train.AdamOptimizer(lr))
    grads, outs = network.tower_gradients(
        images, labels, cfg, opt, devices, targets=targets,
        variable_device=place.variable_device(), heads=task.heads)
    train_op = opt.apply_gradients(grads, state.global_step)
    loss = network.tower_mean([o.loss for o in outs])
    accuracy = network.tower_mean([o.accuracy for o in outs])
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
    coordination = place.coordination(opt)
  graph.finalize()
  return TrainGraph(graph, state, pipe, lr, train_op, loss, accuracy, summary, ev,
                    eval_averaged, diag, init, coordination)


def train(cfg, s, task, role, folder, splits):
  """Trains until --epochs or --max_steps, then tests the best checkpoint. A
  stop signal ends the step; the run saves and exits with 128 + the signal's
  number. Only the process that `writes` restores, validates, saves and writes."""
  place = role.placement
  devices = place.devices(config.tower_devices(s.device, s.num_gpus))
  g = build_graph(cfg, s, task, role, devices, task.fixed_batch(splits))
  proto = place.session_config(config.session_config(devices, s.log_device_placement))
  workers = place.shard[1]
  steps = len(splits["train"][0]) // (s.batch_size * workers)   # an epoch's
  step_images = s.batch_size * workers
  with role.session(g, proto, folder) as (sess, pos, resumed, stop):
    writer = (recording.start_writing(g, s, cfg, pos, resumed) if role.writes
              else recording.NullWriter())
    run = recording.Run(sess, g, s, folder, splits, writer, stop, role.before_save,
                        steps * step_images)
    with contextlib.closing(writer):
      if role.writes and resumed:
        recording.keep_epoch(run, pos)
      while pos.epoch < s.epochs and not out_of_steps(s, pos) and not stop.requested:
        done = start_epoch(sess, g, s, task, pos, splits["train"], place.shard)
        bar = tqdm.tqdm(total=steps, initial=done, desc=f"epoch {pos.epoch + 1}/{s.epochs}",
                        disable=not s.progress, dynamic_ncols=True)
        start, val_seconds, images = time.time(), 0.0, 0
        while not stop.requested and not out_of_steps(s, pos):
          t0 = time.time()
          fetch = {"train": g.train_op, "loss": g.loss, "accuracy": g.accuracy}
          if (pos.step + 1) % s.summary_every == 0:
            fetch["summary"] = g.summary
          try:
            res = role.run_step(sess, fetch, pos.step + 1, folder, stop)
          except tf.errors.OutOfRangeError:
            break   # the epoch's data ran out
          pos.step += 1   # global_step read in the same run may predate the update
          if not np.isfinite(res["loss"]):
            raise recording.TrainingError(
                f"loss is {res['loss']} at step {pos.step}; stopped without saving, the "
                f"last good checkpoint is {folder.latest_checkpoint('latest')}")
          pos.add_step(step_images, res["loss"], res["accuracy"])
          images += step_images
          if "summary" in fetch:
            writer.add_summary(res["summary"], pos.step)
          bar.update(1)
          bar.set_postfix(loss=f"{res['loss']:.4f}", acc=f"{res['accuracy']:.3f}",
                          img_s=f"{s.batch_size / (time.time() - t0):.0f}")
          if not role.writes:
            continue   # another process validates, saves and records
          if g.diag and (pos.step % s.diag_every == 0 or pos.step == 1):
            recording.record_diagnostic(run, pos)
          inside = pos.examples < run.epoch_images   # (the epoch's end comes below)
          if s.val_every and pos.step % s.val_every == 0 and inside:
            t = time.time()
            recording.validate(run, pos, {"epoch": recording.epoch_of(run, pos),
                                          "step": pos.step}, kind="validation")
            val_seconds += time.time() - t
          if pos.step % s.save_every == 0 and inside:
            recording.save(run, "latest", pos)
        bar.close()
        if stop.requested or pos.examples < run.epoch_images:   # stopped inside it
          if role.writes:
            recording.save(run, "latest", pos)
          break
        recording.end_epoch(run, pos, time.time() - start - val_seconds, images,
                            role.writes)
      writer.flush()
      if role.writes and not stop.requested:
        recording.final_test(run)
  if stop.requested:   # saved, and the run's other processes ended (`role.session`)
    print(f"Saved {folder.latest_checkpoint('latest')}; run again with "
          f"--logdir={s.logdir} to resume")
    sys.exit(stop.exit_status)


def start_epoch(sess, g, s, task, pos, train_split, shard):
  """Feeds the training iterator the epoch's data order from where `pos` is
  in it (this worker's `shard`). Returns the batches of it already done."""
  order = task.epoch_order(len(train_split[1]), s.seed, pos.epoch, s.batch_size,
                           shard)[pos.examples // shard[1]:]
  done = pos.examples // (s.batch_size * shard[1])
  sess.run(g.input.iterator.initializer, {
      g.input.seed: s.seed * 100003 + pos.epoch, g.input.first_batch: done,
      **task.epoch_feed(g.input, train_split, order)})
  return done


def out_of_steps(s, pos):
  return s.max_steps and pos.step >= s.max_steps


if __name__ == "__main__":
  app.run(main)
