"""What one train.py process is in its run, chosen once in train.py's `main`
(`choose`): the run's only process (`OneProcess`), or a task of a cluster
(docs/cluster.md): the chief (`Chief`, worker 0, the one that writes the run
folder), another worker (`Worker`) or a parameter server (`Ps`, which serves
the variables and runs no loop).

train.py's loop is the same for every role that trains; what differs is
asked of the role: where the graph's variables live, how the optimizer
aggregates, how the session opens and the run starts (restore or wait for
the chief), after-step work, waiting for an update before saving, how a stop
or an error ends the other tasks, the summary writer, and the end of the
run. `writes` is the one flag the loop reads (as nanoGPT's `master_process`):
the process that restores, validates, saves and writes the run folder. The
cluster roles are the only callers of `distributed`.
"""
import contextlib
import signal
import sys

import tensorflow as tf

from capsnet.running import cluster_spec
from capsnet.running import distributed
from capsnet.running import run_state
from capsnet.running import runs
from capsnet.running import stopping


def choose(info, sync=True, wait_secs=60):
  """The role of this process: `info` is the cluster (cluster_spec.ClusterInfo)
  or None for one process; `sync`: synchronous updates; `wait_secs`: how long
  a task waits for another (--cluster_wait_secs)."""
  if info is None:
    return OneProcess()
  if info.job == "ps":
    return Ps(info)
  return (Chief if cluster_spec.is_chief(info) else Worker)(info, sync, wait_secs)


class OneProcess:
  """The run's only process: it trains, restores, validates, saves, writes."""
  writes = True   # restores, validates, saves and writes the run folder
  plans = True    # measures the convolution plan (`planner`) before the graph
  serves = False  # a ps task: serves variables, runs no training loop
  index = 0       # this worker's shard of each epoch's data (of `workers`)
  workers = 1

  def start(self):
    """Before the graph is built."""

  def devices(self, devices):
    return devices

  def device_scope(self):
    """The scope the training graph is built in."""
    return contextlib.nullcontext()

  def variable_device(self):
    return None

  def wrap_optimizer(self, optimizer):
    return optimizer

  def coordination(self, optimizer):
    """The ops the tasks coordinate with; built last in the graph."""
    del optimizer
    return None

  def stop_request(self):
    return stopping.StopRequest()

  def open_session(self, graph, proto, coordination):
    del coordination
    return tf.compat.v1.Session(graph=graph, config=proto)

  def begin(self, sess, g, folder):
    """Restores `folder`'s latest checkpoint or initialises. Returns
    (run_state.Position, resumed)."""
    return run_state.restore_or_init(sess, g.state, g.init, folder)

  def writer(self, open_writer):
    """The summary writer: `open_writer()` where this process writes."""
    return open_writer()

  @contextlib.contextmanager
  def watching(self, sess, coordination):
    """While training: an eye on the other tasks, if any."""
    del sess, coordination
    yield

  @contextlib.contextmanager
  def ending_together(self, sess, coordination, stop, pos):
    """Around the epochs: how an error or the chief's stop ends this task
    and the others."""
    del sess, coordination, stop, pos
    yield

  def step_fetches(self, coordination):
    """What a training step fetches beside the step itself."""
    del coordination
    return {}

  # Session errors of a step that mean another task is gone (none here).
  task_errors = ()

  def check_step(self, step, folder):
    """After the session run of step `step` (`folder`: the run folder)."""

  def after_step(self, sess, coordination, fetched, stop):
    """After a step is counted. Returns whether this process goes on to the
    run's bookkeeping (diagnostic, validation, checkpoints)."""
    del sess, coordination, fetched, stop
    return True

  def before_save(self, sess, global_step, step, folder):
    """Before a checkpoint of `step` is written into `folder` (a RunFolder)."""

  def stop_early(self, sess, coordination, stop, step):
    """A stop signal ended the run at `step` (its checkpoint saved)."""

  def end(self, sess, coordination):
    """The run ended (the best checkpoint tested)."""

  def close(self):
    """After the session is closed, on every way out."""


class _Task(OneProcess):
  """A worker of a cluster (between-graph replication)."""
  plans = False   # the tasks keep --conv_impl's rule: one plan for all
  task_errors = (tf.errors.UnavailableError, tf.errors.AbortedError,
                 tf.errors.CancelledError)

  def __init__(self, info, sync, wait_secs):
    self.info, self.sync, self.wait_secs = info, sync, wait_secs
    self.index = info.index
    self.workers = cluster_spec.num_workers(info)
    self.server = None
    self.watch = None

  def start(self):
    self.server = distributed.start_server(self.info)
    cluster_spec.wait_for(self.info.spec["ps"], self.wait_secs, "ps")

  def devices(self, devices):
    return distributed.worker_devices(self.info, devices)

  def device_scope(self):
    return distributed.device_scope(self.info)

  def variable_device(self):
    return distributed.variable_device(self.info)

  def wrap_optimizer(self, optimizer):
    return distributed.wrap_optimizer(optimizer, self.info, self.sync)

  def coordination(self, optimizer):
    return distributed.coordination(self.info, optimizer)

  def open_session(self, graph, proto, coordination):
    return distributed.open_session(self.info, self.server, graph,
                                    distributed.session_config(self.info, proto),
                                    coordination, self.wait_secs)

  @contextlib.contextmanager
  def watching(self, sess, coordination):
    with distributed.watching(sess, coordination, self.info, self.wait_secs) as watch:
      self.watch = watch
      yield

  def task_gone(self, error, step, folder):
    """The ClusterError of step `step`, whose session run met `error`."""
    return cluster_spec.ClusterError(
        f"step {step}: a task of the cluster is gone ({type(error).__name__}: "
        f"{runs.error_reason(error)}); the last checkpoint is "
        f"{folder.latest_checkpoint('latest')}")

  def check_step(self, step, folder):
    if self.watch and self.watch.lost:
      raise self.lost_error(self.watch.lost, step, folder)

  @staticmethod
  def lost_error(lost, step, folder):
    return cluster_spec.ClusterError(
        f"{lost} stopped answering: step {step} was not applied; "
        f"the last checkpoint is {folder.latest_checkpoint('latest')}")


class Chief(_Task):
  """Worker 0: trains, and restores, validates, saves and writes as one
  process does; starts the synchronous queue runner; passes the stops other
  tasks pass on to the loop; ends the others at the end or on an error."""
  runner = None

  def begin(self, sess, g, folder):
    begun = run_state.restore_or_init(sess, g.state, g.init, folder)
    self.runner = distributed.start_chief(sess, g.coordination)
    return begun

  @contextlib.contextmanager
  def ending_together(self, sess, coordination, stop, pos):
    try:
      yield
    except Exception:
      distributed.end_the_others(sess, coordination, self.info, pos.step)
      raise

  def step_fetches(self, coordination):
    return {"stops_waiting": coordination.stop.requests}

  def after_step(self, sess, coordination, fetched, stop):
    distributed.hear_passed_on_stops(sess, coordination, fetched["stops_waiting"], stop)
    return True

  def before_save(self, sess, global_step, step, folder):
    if self.sync:   # the update of `step` applied, or the worker it waits for named
      lost = distributed.wait_for_global_step(sess, global_step, step, self.watch)
      if lost:
        raise self.lost_error(lost, step, folder)

  def stop_early(self, sess, coordination, stop, step):
    distributed.halt_workers(sess, coordination, self.info, stop.signum, step)
    distributed.stop_chief(sess, coordination, self.runner)

  def end(self, sess, coordination):
    distributed.stop_chief(sess, coordination, self.runner)

  def close(self):
    distributed.join_chief(self.runner)


class Worker(_Task):
  """A worker other than the chief: trains its shard and nothing else;
  passes a stop signal on to the chief and ends when the chief stops or
  ends the run."""
  writes = False

  def stop_request(self):
    return stopping.StopRequest(relay=True)

  def begin(self, sess, g, folder):
    del folder
    return g.state.load(sess), True   # the chief restored or initialised

  def writer(self, open_writer):
    del open_writer
    return distributed.NullWriter()

  @contextlib.contextmanager
  def ending_together(self, sess, coordination, stop, pos):
    del sess, coordination, pos
    try:
      yield
    except distributed.Halted as e:
      how = (f"stopped the run at step {e.step} ({signal.Signals(e.signum).name})"
             if e.signum else f"ended the run at step {e.step} on an error (see its output)")
      print(f"train.py: worker {self.index} ends: the chief {how}")
      sys.exit(128 + (stop.signum or e.signum) if e.signum else 1)

  def after_step(self, sess, coordination, fetched, stop):
    distributed.follow_the_chief(sess, coordination, self.index, stop)
    return False


class Ps:
  """A parameter server: serves the variables until the chief ends the job."""
  serves = True
  writes = False

  def __init__(self, info):
    self.info = info

  def serve(self):
    """Serves; returns the exit status (128 + a stop signal's number, or 0)."""
    why, signum = distributed.serve_ps(self.info)
    print(f"train.py: ps task {self.info.index} ends: {why}")
    return 128 + signum if signum else 0
