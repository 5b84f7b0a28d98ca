"""What one train.py process is in its run, chosen once by `choose`: the only
process (`OneProcess`), a cluster's chief (`Chief`) or other worker (`Worker`);
a ps task serves the variables (`serve`). Every role runs the one loop; what
differs is its `placement` and three hooks, `session`, `run_step` and
`before_save` (docs/cluster.md)."""
import contextlib
import signal

import tensorflow as tf

from capsnet.running import cluster_spec
from capsnet.running import distributed
from capsnet.running import run_state
from capsnet.running import runs
from capsnet.running import stopping


class Ended(Exception):
  """A worker's run ended by the chief: `status`, the process's exit status
  (128 + the stop signal's number, or 1 after an error)."""

  def __init__(self, status):
    super().__init__(f"exit status {status}")
    self.status = status


def choose(info, sync=True, wait_secs=60):
  """The role of this process: `info` the cluster (cluster_spec.ClusterInfo) or
  None; `sync` synchronous updates; `wait_secs` --cluster_wait_secs."""
  if info is None:
    return OneProcess()
  return (Chief if cluster_spec.is_chief(info) else Worker)(info, sync, wait_secs)


def serve(info):
  """A ps task: serves the variables until the chief ends the job. Returns
  the exit status (128 + a stop signal's number, or 0)."""
  why, signum = distributed.serve_ps(info)
  print(f"train.py: ps task {info.index} ends: {why}")
  return 128 + signum if signum else 0


class LocalPlacement:
  """Where the only process builds and runs its graph: as built, with all of
  each epoch's data (a cluster: `distributed.Placement`)."""
  shard = (0, 1)   # (this worker's index, workers): the whole epoch

  def scope(self):
    return contextlib.nullcontext()

  def devices(self, devices):
    return devices

  def variable_device(self):
    return None

  def optimizer(self, optimizer):
    return optimizer

  def coordination(self, optimizer):
    del optimizer

  def session_config(self, proto):
    return proto


class OneProcess:
  """The run's only process: it trains, restores, validates, saves, writes."""
  writes = True         # restores, validates, saves and writes the run folder
  plans = True          # measures the convolution plan (`planner`) first
  relays_stops = False  # passes a stop signal on to the chief (StopRequest)
  placement = LocalPlacement()

  @contextlib.contextmanager
  def session(self, g, proto, folder):
    """Yields (sess, Position, resumed, StopRequest): the session with stop
    signals caught, the run restored from `folder` or initialised; the way out
    ends the run's other processes."""
    stop = stopping.StopRequest(relay=self.relays_stops)
    with stop.installed(), self._session(g, proto, folder, stop) as (sess, pos, resumed):
      yield sess, pos, resumed, stop

  @contextlib.contextmanager
  def _session(self, g, proto, folder, stop):
    del stop
    with tf.compat.v1.Session(graph=g.graph, config=proto) as sess:
      yield (sess, *run_state.restore_or_init(sess, g.state, g.init, folder))

  def run_step(self, sess, fetch, step, folder, stop):
    """Runs training step `step` with `fetch` and the role's own fetches. Raises
    OutOfRangeError at the epoch's end, ClusterError when another process of the
    run is gone."""
    del step, folder, stop
    return sess.run(fetch)

  def before_save(self, sess, global_step, step, folder):
    """Before a checkpoint of `step` is written into `folder` (a RunFolder)."""


class _Task(OneProcess):
  """A worker of a cluster (between-graph replication)."""
  plans = False   # the tasks keep --conv_impl's rule: one plan for all
  gone = (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError)

  def __init__(self, info, sync, wait_secs):
    self.info, self.sync, self.wait_secs = info, sync, wait_secs
    self.index = info.index
    self.placement = distributed.Placement(info, sync)
    self.coord = self.watch = None

  def _open(self, g, proto):
    """This task's server (once the ps tasks answer) and a session on it."""
    server = distributed.start_server(self.info)
    cluster_spec.wait_for(self.info.spec["ps"], self.wait_secs, "ps")
    self.coord = g.coordination
    return distributed.open_session(self.info, server, g.graph, proto, g.coordination,
                                    self.wait_secs)

  @contextlib.contextmanager
  def _watching(self, sess):
    with distributed.watching(sess, self.coord, self.info, self.wait_secs) as watch:
      self.watch = watch
      yield

  def run_step(self, sess, fetch, step, folder, stop):
    try:
      fetched = sess.run(fetch)
    except self.gone as e:
      raise cluster_spec.ClusterError(
          f"step {step}: a task of the cluster is gone ({type(e).__name__}: "
          f"{runs.error_reason(e)}); the last checkpoint is "
          f"{folder.latest_checkpoint('latest')}") from None
    if self.watch and self.watch.lost:
      raise self.lost_error(self.watch.lost, step, folder)
    return fetched

  @staticmethod
  def lost_error(lost, step, folder):
    return cluster_spec.ClusterError(
        f"{lost} stopped answering: step {step} was not applied; "
        f"the last checkpoint is {folder.latest_checkpoint('latest')}")


class Chief(_Task):
  """Worker 0: trains, restores, validates, saves and writes as one process
  does, runs the synchronous queue, hears passed-on stops, and ends the others
  at the end, on a stop or on an error."""

  @contextlib.contextmanager
  def _session(self, g, proto, folder, stop):
    runner = None
    try:
      with self._open(g, proto) as sess:
        pos, resumed = run_state.restore_or_init(sess, g.state, g.init, folder)
        runner = distributed.start_chief(sess, self.coord)
        with self._watching(sess):
          try:
            yield sess, pos, resumed
          except Exception:
            distributed.end_the_others(sess, self.coord, self.info, pos.step)
            raise
          if stop.requested:   # the checkpoint saved: the other workers end
            distributed.halt_workers(sess, self.coord, self.info, stop.signum, pos.step)
        distributed.stop_chief(sess, self.coord, runner)
    finally:
      distributed.join_chief(runner)

  def run_step(self, sess, fetch, step, folder, stop):
    fetched = super().run_step(sess, dict(fetch, stops_waiting=self.coord.stop.requests),
                               step, folder, stop)
    distributed.hear_passed_on_stops(sess, self.coord, fetched["stops_waiting"], stop)
    return fetched

  def before_save(self, sess, global_step, step, folder):
    if self.sync:   # the update of `step` applied, or the worker it waits for named
      lost = distributed.wait_for_global_step(sess, global_step, step, self.watch)
      if lost:
        raise self.lost_error(lost, step, folder)


class Worker(_Task):
  """A worker other than the chief: trains its shard, passes a stop signal on,
  ends when the chief stops or ends the run."""
  writes = False
  relays_stops = True

  @contextlib.contextmanager
  def _session(self, g, proto, folder, stop):
    with self._open(g, proto) as sess, self._watching(sess):
      try:
        yield sess, g.state.load(sess), True   # the chief restored or initialised
      except distributed.Halted as e:
        how = (f"stopped the run at step {e.step} ({signal.Signals(e.signum).name})"
               if e.signum else f"ended the run at step {e.step} on an error (see its output)")
        print(f"train.py: worker {self.index} ends: the chief {how}")
        raise Ended(128 + (stop.signum or e.signum) if e.signum else 1) from None

  def run_step(self, sess, fetch, step, folder, stop):
    fetched = super().run_step(sess, fetch, step, folder, stop)
    distributed.follow_the_chief(sess, self.coord, self.index, stop)
    return fetched
