"""The TensorFlow side of between-graph replication for train.py (see
capsnet/running/cluster_spec.py for the cluster description, capsnet/cluster.py
for the launcher).

What a process does, by role:
- ps: starts its server and serves the variables until the chief puts a
  token in this task's "done" queue (or no worker answers any more), then
  ends: ps servers never end on their own.
- worker: starts its server, waits (bounded) until the ps tasks answer, and
  builds the graph with the variables on the ps tasks
  (`replica_device_setter`). The chief (worker 0) opens a session to its
  server, initialises or restores, and with --sync fills the token queue and
  runs the SyncReplicasOptimizer's queue runner; the other workers wait for
  the model to be ready, checking every half second (the default, 30 s, is
  TensorFlow's `recovery_wait_secs`).
"""
import collections
import contextlib
import time

import tensorflow as tf

from capsnet.running import cluster_spec

Coordination = collections.namedtuple("Coordination", [
    "ready_op", "local_init_op", "ready_for_local_init_op",
    "chief_init_op", "chief_queue_runner", "done_signal"])


def variable_device(info):
  """The device function that puts variables on the ps tasks (round robin)
  and everything else on this worker, or None for a single process."""
  if info is None:
    return None
  return tf.compat.v1.train.replica_device_setter(
      cluster=tf.train.ClusterSpec(info.spec),
      worker_device=f"/job:worker/task:{info.index}")


def device_scope(info):
  """The scope that builds a worker's graph (nothing for one process)."""
  setter = variable_device(info)
  return contextlib.nullcontext() if setter is None else tf.compat.v1.device(setter)


def worker_devices(info, devices):
  """Tower devices of this worker: '/cpu:0' -> '/job:worker/task:i/cpu:0'."""
  if info is None:
    return devices
  return [f"/job:worker/task:{info.index}{d}" for d in devices]


def wrap_optimizer(optimizer, info, sync):
  """SyncReplicasOptimizer aggregating one gradient per worker (--sync), or
  the optimizer itself (one process, or asynchronous updates)."""
  if info is None or not sync:
    return optimizer
  workers = cluster_spec.num_workers(info)
  return tf.compat.v1.train.SyncReplicasOptimizer(
      optimizer, replicas_to_aggregate=workers, total_num_replicas=workers)


def _done_queue(task):
  with tf.compat.v1.device(f"/job:ps/task:{task}"):
    return tf.queue.FIFOQueue(1, tf.int32, shared_name=f"capsnet_done_{task}",
                              name=f"done_queue_{task}")


def coordination(info, optimizer):
  """The ops the processes coordinate with (built after the model, so that
  the model's initial weights are those of a single process)."""
  if info is None:
    return None
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
  return Coordination(ready, local_init, ready_for_local, chief_init, runner, done)


def session_config(info, proto):
  """Workers talk to the ps tasks and themselves, not to each other."""
  if info is not None:
    proto.device_filters[:] = ["/job:ps", f"/job:worker/task:{info.index}"]
  return proto


def start_server(info):
  return tf.distribute.Server(tf.train.ClusterSpec(info.spec), job_name=info.job,
                              task_index=info.index, start=True)


def open_session(info, server, graph, proto, coord, wait_secs):
  """A session on this worker's server. The chief's is plain (it then
  initialises or restores); another worker's waits until the chief has
  made the model ready.

  Raises: cluster_spec.ClusterError if that takes over `wait_secs`.
  """
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
  """After the chief's init or restore: its local init and the queue runner
  that aggregates the workers' gradients. Returns what `stop_chief` ends.

  No tokens are put in the queue at the start (TensorFlow's examples put one
  per worker): then a worker's step returns only once the update it took
  part in is applied, with one gradient from each worker, and every worker
  is at the same step, as in one process with the whole batch.
  """
  sess.run(coord.chief_init_op)
  if coord.chief_queue_runner is None:
    return None
  stop = tf.train.Coordinator()
  threads = coord.chief_queue_runner.create_threads(sess, coord=stop, daemon=True,
                                                    start=True)
  return stop, threads


def wait_for_global_step(sess, global_step, step, seconds=60):
  """Synchronous updates: a worker's step returns before the update it
  contributed to is applied; waits until `global_step` reaches `step`."""
  deadline = time.time() + seconds
  while sess.run(global_step) < step:
    if time.time() > deadline:
      raise cluster_spec.ClusterError(f"the update of step {step} was not applied within "
                                 f"{seconds} s (a worker gone?)")
    time.sleep(0.05)


def stop_chief(sess, coord, runner):
  """Tells every ps task the job is done, then stops the queue runner
  (closing the session cancels what its thread waits for)."""
  try:
    sess.run(coord.done_signal, options=tf.compat.v1.RunOptions(timeout_in_ms=10000))
  except tf.errors.OpError:
    pass   # a ps task already gone
  if runner is not None:
    runner[0].request_stop()


def join_chief(runner):
  if runner is not None:
    runner[0].join(runner[1], stop_grace_period_secs=5, ignore_live_threads=True)


def serve_ps(info, idle_check_secs=30):
  """A ps task: serves until the chief says the job is done, or until no
  worker answers at two checks `idle_check_secs` apart."""
  server = start_server(info)
  with tf.Graph().as_default() as graph:
    dequeue = _done_queue(info.index).dequeue()
  proto = tf.compat.v1.ConfigProto(device_filters=[f"/job:ps/task:{info.index}"])
  silent = 0
  with tf.compat.v1.Session(server.target, graph=graph, config=proto) as sess:
    while silent < 2:
      try:
        sess.run(dequeue, options=tf.compat.v1.RunOptions(
            timeout_in_ms=idle_check_secs * 1000))
        return "done"
      except tf.errors.DeadlineExceededError:
        silent = 0 if cluster_spec.any_reachable(info.spec["worker"]) else silent + 1
  return "no worker answers"


class NullWriter:
  """What a worker other than the chief writes events with: nothing."""

  def add_summary(self, *args):
    pass

  def flush(self):
    pass

  def close(self):
    pass
