"""The TensorFlow side of between-graph replication for train.py: the ps tasks'
serving, a worker's placement, sessions and the stop signals passed between
tasks. What each role does and how a run stops: docs/cluster.md."""
import collections
import contextlib
import threading
import time

import tensorflow as tf

from capsnet.running import cluster_spec
from capsnet.running import stopping

Coordination = collections.namedtuple("Coordination", [
    "ready_op", "local_init_op", "ready_for_local_init_op",
    "chief_init_op", "chief_queue_runner", "done_signal", "stop"])

# How a stop signal to one worker reaches the others (queues on ps task 0).
StopOps = collections.namedtuple("StopOps", [
    "request",         # placeholder [worker index, signal number]
    "pass_on",         # enqueues `request`
    "requests",        # how many wait
    "next_request",    # dequeues one
    "halt",            # placeholder [signal number, step] the run stops with
    "halt_others",     # one halt word per worker other than the chief
    "halts",           # how many wait
    "take_halt",       # dequeues one
    "release",         # a token for each worker waiting on a synchronous update
])


def _bounded():
  """Options for a run that must not wait for ever on a task that may be gone."""
  return tf.compat.v1.RunOptions(timeout_in_ms=10000)


class Halted(Exception):
  """A worker other than the chief: the chief stopped the run with its
  checkpoint of `step` on stop signal `signum` (0: on an error)."""

  def __init__(self, signum, step):
    super().__init__(signum, step)
    self.signum, self.step = signum, step


class Placement:
  """Where a cluster's task builds and runs its graph: variables on the ps
  tasks, the rest on this worker, its shard of each epoch, and with --sync one
  aggregated update a step (one process: `roles.LocalPlacement`)."""

  def __init__(self, info, sync):
    self.info, self.sync = info, sync
    self.shard = (info.index, cluster_spec.num_workers(info))   # (index, workers)

  def variable_device(self):
    """Variables on the ps tasks (round robin), the rest on this worker."""
    return tf.compat.v1.train.replica_device_setter(
        cluster=tf.train.ClusterSpec(self.info.spec),
        worker_device=f"/job:worker/task:{self.info.index}")

  def scope(self):
    """The scope that builds the worker's graph."""
    return tf.compat.v1.device(self.variable_device())

  def devices(self, devices):
    """Tower devices of this worker: '/cpu:0' -> '/job:worker/task:i/cpu:0'."""
    return [f"/job:worker/task:{self.info.index}{d}" for d in devices]

  def optimizer(self, optimizer):
    """SyncReplicasOptimizer aggregating one gradient a worker (--sync), or the
    optimizer itself."""
    if not self.sync:
      return optimizer
    workers = self.shard[1]
    return tf.compat.v1.train.SyncReplicasOptimizer(
        optimizer, replicas_to_aggregate=workers, total_num_replicas=workers)

  def coordination(self, optimizer):
    return coordination(self.info, optimizer)

  def session_config(self, proto):
    """Workers talk to the ps tasks and themselves, not to each other."""
    proto.device_filters[:] = ["/job:ps", f"/job:worker/task:{self.info.index}"]
    return proto


def _done_queue(task):
  with tf.compat.v1.device(f"/job:ps/task:{task}"):
    return tf.queue.FIFOQueue(1, tf.int32, shared_name=f"capsnet_done_{task}",
                              name=f"done_queue_{task}")


def coordination(info, optimizer):
  """The ops the processes coordinate with (built after the model, so that its
  initial weights are a single process's)."""
  ready = tf.compat.v1.report_uninitialized_variables(tf.compat.v1.global_variables())
  local_init = tf.compat.v1.local_variables_initializer()
  ready_for_local, chief_init, runner = None, local_init, None
  if isinstance(optimizer, tf.compat.v1.train.SyncReplicasOptimizer):
    local_init = optimizer.local_step_init_op
    chief_init = optimizer.chief_init_op
    ready_for_local = optimizer.ready_for_local_init_op
    runner = optimizer.get_chief_queue_runner()
  done = tf.group(*[_done_queue(t).enqueue(1) for t in range(len(info.spec["ps"]))])
  for op in (ready, ready_for_local):   # not every role runs them: no warning
    getattr(op, "mark_used", lambda: None)()
  return Coordination(ready, local_init, ready_for_local, chief_init, runner, done,
                      _stop_ops(info, optimizer))


def _stop_requests(info):
  """The queue of stop signals passed on to the chief: [task, signal number],
  task a worker's index or -1 - a ps task's."""
  tasks = len(info.spec["worker"]) + len(info.spec["ps"])
  with tf.compat.v1.device("/job:ps/task:0"):
    return tf.queue.FIFOQueue(2 * tasks, tf.int32, shapes=[[2]],
                              shared_name="capsnet_stop_requests", name="stop_requests")


def _stop_ops(info, optimizer):
  others = cluster_spec.num_workers(info) - 1
  requests = _stop_requests(info)
  with tf.compat.v1.device("/job:ps/task:0"), tf.name_scope("stop"):
    halts = tf.queue.FIFOQueue(max(others, 1), tf.int64, shapes=[[2]],
                               shared_name="capsnet_halts", name="halts")
    request = tf.compat.v1.placeholder(tf.int32, [2], name="request")
    halt = tf.compat.v1.placeholder(tf.int64, [2], name="halt")
    halt_others = halts.enqueue_many(tf.tile(halt[None], [others, 1]))
  release = None
  if isinstance(optimizer, tf.compat.v1.train.SyncReplicasOptimizer) and others:
    release = optimizer.get_init_tokens_op(num_tokens=others)
  return StopOps(request, requests.enqueue(request), requests.size(), requests.dequeue(),
                 halt, halt_others, halts.size(), halts.dequeue(), release)


def _pass_on_once(sess, pass_on, request, task, stop):
  """Passes this task's stop signal on to the chief, once."""
  if stop.signum and not stop.relayed:
    sess.run(pass_on, {request: [task, stop.signum]})
    stop.relayed = True


def follow_the_chief(sess, coord, index, stop):
  """A worker other than the chief, after each step: passes a stop signal on,
  once; raises Halted once the chief has stopped the run. The halt queue is read
  in a run of its own: fetched with the step, it could be read before the
  chief's word arrives, and the next step would wait for a token that never
  comes."""
  _pass_on_once(sess, coord.stop.pass_on, coord.stop.request, index, stop)
  if sess.run(coord.stop.halts):
    signum, step = sess.run(coord.stop.take_halt)
    raise Halted(int(signum), int(step))


def hear_passed_on_stops(sess, coord, waiting, stop):
  """The chief, after each step (`waiting`: the stops passed on, fetched with
  the step): such a stop stops the run as if it had come here."""
  if waiting:
    task, signum = sess.run(coord.stop.next_request)
    stop.passed_on(int(signum), f"worker {task}" if task >= 0 else f"ps {-1 - task}")


def halt_workers(sess, coord, info, signum, step, wait_secs=30):
  """The chief, stopping early: tells every other worker to end, releases those
  waiting on a synchronous update (never applied: the checkpoint is saved), and
  waits up to `wait_secs` until each has taken its word, so none meets the ps
  tasks gone."""
  others = info.spec["worker"][1:]
  sess.run(coord.stop.halt_others, {coord.stop.halt: [signum, step]}, options=_bounded())
  if coord.stop.release is not None:
    sess.run(coord.stop.release, options=_bounded())
  deadline = time.time() + wait_secs
  while (sess.run(coord.stop.halts, options=_bounded()) and time.time() < deadline
         and cluster_spec.any_reachable(others)):
    time.sleep(0.1)


def end_the_others(sess, coord, info, step):
  """The chief, ending on an error: the other workers and the ps tasks end too,
  as far as they can be reached."""
  try:
    halt_workers(sess, coord, info, 0, step, wait_secs=10)
  except tf.errors.OpError:
    pass
  stop_chief(sess, coord, None)


class Watch:
  """A synchronous worker's eye on the others: one whose port has not answered
  for `grace_secs` is taken as lost (`lost` names it) and the steps waiting for
  it are released, unapplied, instead of waiting for ever."""

  def __init__(self, sess, coord, info, interval_secs=1.0, grace_secs=10.0):
    self.lost = None
    others = [(i, h) for i, h in enumerate(info.spec["worker"]) if i != info.index]
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._watch, daemon=True, args=(
        sess, coord, others, interval_secs, grace_secs))
    self._thread.start()

  def _watch(self, sess, coord, others, interval_secs, grace_secs):
    silent_since = {}
    while not self._done.wait(interval_secs):
      now = time.time()
      for index, host in others:
        if cluster_spec.any_reachable([host]):
          silent_since.pop(index, None)
        elif now - silent_since.setdefault(index, now) >= grace_secs:
          self.lost = f"worker {index} at {host}"
          try:
            sess.run(coord.stop.release, options=_bounded())
          except tf.errors.OpError:
            pass
          return

  def close(self):
    self._done.set()
    self._thread.join()


@contextlib.contextmanager
def watching(sess, coord, info, grace_secs):
  """A `Watch` while inside (None where no update waits for another worker)."""
  if coord is None or coord.stop.release is None:
    yield None
    return
  watch = Watch(sess, coord, info, grace_secs=grace_secs)
  try:
    yield watch
  finally:
    watch.close()


def start_server(info):
  return tf.distribute.Server(tf.train.ClusterSpec(info.spec), job_name=info.job,
                              task_index=info.index, start=True)


def open_session(info, server, graph, proto, coord, wait_secs):
  """A session on this worker's server: the chief's plain, the others' once the
  chief has made the model ready. Raises ClusterError after `wait_secs`."""
  if cluster_spec.is_chief(info):
    return tf.compat.v1.Session(server.target, graph=graph, config=proto)
  manager = tf.compat.v1.train.SessionManager(
      local_init_op=coord.local_init_op, ready_op=coord.ready_op,
      ready_for_local_init_op=coord.ready_for_local_init_op, graph=graph,
      recovery_wait_secs=0.5)
  sess = manager.wait_for_session(server.target, config=proto, max_wait_secs=wait_secs)
  if sess is None:
    raise cluster_spec.ClusterError(f"the chief did not make the model ready within "
                               f"{wait_secs} s (--cluster_wait_secs)")
  return sess


def start_chief(sess, coord):
  """The chief's local init and the queue runner that aggregates the workers'
  gradients; returns what `stop_chief` ends.

  No tokens are put in the queue at the start (TensorFlow's examples put one a
  worker): a worker's step then returns only once its update is applied, and
  every worker is at the same step, as one process with the whole batch.
  """
  sess.run(coord.chief_init_op)
  if coord.chief_queue_runner is None:
    return None
  stop = tf.train.Coordinator()
  threads = coord.chief_queue_runner.create_threads(sess, coord=stop, daemon=True,
                                                    start=True)
  return stop, threads


def wait_for_global_step(sess, global_step, step, watch=None, seconds=60):
  """Waits until `global_step` reaches `step` (a synchronous worker's step
  returns before its update is applied). Returns None, or the worker `watch`
  names as lost. Raises ClusterError after `seconds`."""
  deadline = time.time() + seconds
  while sess.run(global_step) < step:
    if watch is not None and watch.lost:
      return watch.lost
    if time.time() > deadline:
      raise cluster_spec.ClusterError(f"the update of step {step} was not applied within "
                                 f"{seconds} s (a worker gone?)")
    time.sleep(0.05)
  return None


def stop_chief(sess, coord, runner):
  """Tells every ps task the job is done, then stops the queue runner."""
  try:
    sess.run(coord.done_signal, options=_bounded())
  except tf.errors.OpError:
    pass   # a ps task already gone
  if runner is not None:
    runner[0].request_stop()


def join_chief(runner):
  """Waits for the queue runner's thread (an error of its is the chief's own
  step's too and is not raised again)."""
  if runner is not None:
    try:
      runner[0].join(runner[1], stop_grace_period_secs=5, ignore_live_threads=True)
    except tf.errors.OpError:
      pass


def serve_ps(info, idle_check_secs=30):
  """A ps task: serves until the chief says the job is done, or no worker
  answers at two checks `idle_check_secs` apart; a stop signal is passed on to
  the chief. It looks at its "done" queue once a second rather than blocking in
  a dequeue (one cut off by a timeout can lose what it took). Returns (why it
  ended, its stop signal's number or None)."""
  server = start_server(info)
  with tf.Graph().as_default() as graph:
    done = _done_queue(info.index)
    waiting, dequeue = done.size(), done.dequeue()
    request = tf.compat.v1.placeholder(tf.int32, [2])
    pass_on = _stop_requests(info).enqueue(request)
  proto = tf.compat.v1.ConfigProto(
      device_filters=sorted({f"/job:ps/task:{info.index}", "/job:ps/task:0"}))
  stop, silent, looks = stopping.StopRequest(relay=True), 0, 0
  with stop.installed(), tf.compat.v1.Session(server.target, graph=graph,
                                              config=proto) as sess:
    while silent < 2:
      _pass_on_once(sess, pass_on, request, -1 - info.index, stop)
      if sess.run(waiting):
        sess.run(dequeue)
        return "done", stop.signum
      time.sleep(1.0)
      looks += 1
      if looks % idle_check_secs == 0:
        silent = 0 if cluster_spec.any_reachable(info.spec["worker"]) else silent + 1
  return "no worker answers", stop.signum
