"""Training on several machines with TensorFlow's distributed runtime, and a
launcher that tries it on one machine.

  python -m capsnet.cluster --ps=1 --workers=2 -- --iter_routing=3 --logdir=logs/c

Between-graph replication (TF1): every process runs train.py with the same
--ps_hosts and --worker_hosts (or TF_CONFIG) and its own --job_name and
--task_index. ps tasks hold the variables (`replica_device_setter`) and
serve; workers build the graph and train, each on its own shard of every
epoch's data order; worker 0 is the chief (initialises or restores, validates,
saves, writes the metrics and the test results). With --sync (the default) a
SyncReplicasOptimizer aggregates one gradient per worker, so the effective
batch is workers x --batch_size.

The launcher starts the processes on loopback ports, streams the chief's
output (the others' goes to files it names), and ends them all when the chief
ends or on Ctrl-C (the first one is passed to the chief, which saves).
"""
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

ClusterInfo = collections.namedtuple("ClusterInfo", [
    "spec",         # {"ps": [host:port, ...], "worker": [...]}
    "job",          # "ps" or "worker"
    "index",        # task index within the job
])


class ClusterError(ValueError):
  """A cluster description that cannot be used; the message says why."""


def num_workers(info):
  return len(info.spec["worker"]) if info else 1


def is_chief(info):
  return info is None or (info.job == "worker" and info.index == 0)


def _check_hosts(name, hosts):
  for host in hosts:
    head, _, port = host.rpartition(":")
    if not head or not port.isdigit():
      raise ClusterError(f"{name}: {host!r} is not host:port")


def from_flags(ps_hosts, worker_hosts, job_name, task_index):
  """The cluster of train.py's flags, or None for a single process.

  Raises: ClusterError naming the flag.
  """
  if not (ps_hosts or worker_hosts or job_name):
    return None
  if not ps_hosts or not worker_hosts:
    raise ClusterError("--ps_hosts and --worker_hosts go together (and with "
                       "--job_name and --task_index)")
  _check_hosts("--ps_hosts", ps_hosts)
  _check_hosts("--worker_hosts", worker_hosts)
  spec = {"ps": list(ps_hosts), "worker": list(worker_hosts)}
  if job_name not in spec:
    raise ClusterError(f"--job_name={job_name!r}: expected ps or worker")
  if not 0 <= task_index < len(spec[job_name]):
    raise ClusterError(f"--task_index={task_index}: the {job_name} job has "
                       f"{len(spec[job_name])} task(s)")
  return ClusterInfo(spec, job_name, task_index)


def from_tf_config(text):
  """The cluster of a TF_CONFIG value (JSON with "cluster" and "task").

  Raises: ClusterError for what cannot be used.
  """
  try:
    config = json.loads(text)
    cluster, task = config["cluster"], config["task"]
    return from_flags(cluster.get("ps", []), cluster.get("worker", []),
                      task["type"], int(task["index"]))
  except (ValueError, KeyError, TypeError) as e:
    if isinstance(e, ClusterError):
      raise
    raise ClusterError(f"TF_CONFIG: not a usable cluster description ({e!r})") from None


def wait_for(hosts, seconds, what):
  """Waits until every host:port accepts a TCP connection.

  Raises: ClusterError naming the first one still unreachable after `seconds`.
  """
  deadline = time.time() + seconds
  for k, host in enumerate(hosts):
    address, _, port = host.rpartition(":")
    while True:
      try:
        socket.create_connection((address, int(port)), timeout=1.0).close()
        break
      except OSError:
        if time.time() > deadline:
          raise ClusterError(f"{what} task {k} at {host} not reachable within "
                             f"{seconds} s (--cluster_wait_secs)") from None
        time.sleep(0.2)


def any_reachable(hosts):
  for host in hosts:
    address, _, port = host.rpartition(":")
    try:
      socket.create_connection((address, int(port)), timeout=1.0).close()
      return True
    except OSError:
      pass
  return False


# ---------------------------------------------------------------------------
# The launcher

def define_flags():
  """Defined when run as a program only (importing adds no global flags)."""
  flags.DEFINE_integer("ps", 1, "parameter-server tasks", lower_bound=1)
  flags.DEFINE_integer("workers", 2, "worker tasks", lower_bound=1)
  flags.DEFINE_integer("grace_secs", 30, "how long the others may take to end "
                       "after the chief", lower_bound=1)


FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_ports(n):
  """n loopback ports that were free a moment ago."""
  sockets = [socket.socket() for _ in range(n)]
  for s in sockets:
    s.bind(("127.0.0.1", 0))
  ports = [s.getsockname()[1] for s in sockets]
  for s in sockets:
    s.close()
  return ports


def commands(num_ps, workers, train_args, ports):
  """{(job, index): the train.py command} for a loopback cluster."""
  ps_hosts = [f"127.0.0.1:{p}" for p in ports[:num_ps]]
  worker_hosts = [f"127.0.0.1:{p}" for p in ports[num_ps:num_ps + workers]]
  common = [f"--ps_hosts={','.join(ps_hosts)}", f"--worker_hosts={','.join(worker_hosts)}"]
  out = {}
  for job, count in (("ps", num_ps), ("worker", workers)):
    for i in range(count):
      out[(job, i)] = [sys.executable, os.path.join(ROOT, "train.py"), *train_args,
                       *common, f"--job_name={job}", f"--task_index={i}"]
  return out


def launch(num_ps, workers, train_args, grace_secs=30):
  """Runs the cluster; returns the chief's exit status."""
  ports = free_ports(num_ps + workers)
  logs = tempfile.mkdtemp(prefix="capsnet_cluster_")
  procs, files = {}, []
  for (job, i), cmd in commands(num_ps, workers, train_args, ports).items():
    if (job, i) == ("worker", 0):
      procs[(job, i)] = subprocess.Popen(cmd)
    else:
      f = open(os.path.join(logs, f"{job}_{i}.log"), "w")
      files.append(f)
      procs[(job, i)] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
  print(f"cluster: {num_ps} ps, {workers} worker(s) on 127.0.0.1 ports "
        f"{', '.join(map(str, ports))}; logs of the others in {logs}", flush=True)
  chief = procs[("worker", 0)]
  interrupted = []

  def on_stop(signum, frame):   # Ctrl-C, SIGTERM (preemption), SIGHUP
    interrupted.append(True)
    if len(interrupted) == 1:
      chief.send_signal(signum)   # the chief saves, then ends
    else:
      _end(procs.values(), 0)
  stop_signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
  previous = {sig: signal.signal(sig, on_stop) for sig in stop_signals}
  try:
    while chief.poll() is None:
      failed = [(k, p.returncode) for k, p in procs.items()
                if k != ("worker", 0) and p.poll() not in (None, 0)]
      if failed:
        (job, i), code = failed[0]
        print(f"cluster: {job} {i} ended with status {code}; see "
              f"{os.path.join(logs, f'{job}_{i}.log')}", file=sys.stderr)
        _end(procs.values(), 5)
        return 1
      time.sleep(0.2)
    _end(procs.values(), grace_secs)
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
    for f in files:
      f.close()
  return chief.returncode


def _end(procs, grace_secs):
  """Waits up to `grace_secs` for the processes, then terminates the rest."""
  deadline = time.time() + grace_secs
  for p in procs:
    while p.poll() is None and time.time() < deadline:
      time.sleep(0.1)
  for p in procs:
    if p.poll() is None:
      p.terminate()
  for p in procs:
    try:
      p.wait(5)
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def main(argv):
  sys.exit(launch(FLAGS.ps, FLAGS.workers, argv[1:], FLAGS.grace_secs))


if __name__ == "__main__":
  define_flags()
  app.run(main)
