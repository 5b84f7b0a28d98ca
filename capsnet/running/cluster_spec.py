"""A cluster description for TensorFlow's distributed runtime: the ps and worker
hosts and this task, from train.py's flags or TF_CONFIG, and the waits on the
other tasks' ports (docs/cluster.md)."""
import collections
import json
import socket
import time

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
  """The cluster of train.py's flags, or None for one process. Raises
  ClusterError naming the flag."""
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
  """The cluster of a TF_CONFIG value. Raises ClusterError for what cannot be
  used."""
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
  """Waits until every host:port accepts a TCP connection. Raises ClusterError
  naming the first still unreachable after `seconds`."""
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
