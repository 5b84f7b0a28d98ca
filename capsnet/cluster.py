"""The launcher that tries training on several machines on this one
(between-graph replication, docs/cluster.md).

  python -m capsnet.cluster --ps=1 --workers=2 -- --iter_routing=3 --logdir=logs/c

It starts the ps and worker processes of train.py on loopback ports, streams
the chief's output (the others' goes to files it names), and ends them all
when the chief ends or on Ctrl-C (the first one is passed to the chief,
which saves).
"""
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags


def define_flags():
  """Defined when run as a program only (importing adds no global flags)."""
  flags.DEFINE_integer("ps", 1, "parameter-server tasks", lower_bound=1)
  flags.DEFINE_integer("workers", 2, "worker tasks", lower_bound=1)
  flags.DEFINE_integer("grace_secs", 30, "how long the others may take to end "
                       "after the chief", lower_bound=1)


FLAGS = flags.FLAGS
# A task's exit status after a stop signal to any task (the chief saves, then
# every task ends with 128 + the signal's number): not a failure.
STOPPED = tuple(128 + sig for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))
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
                if k != ("worker", 0) and p.poll() not in (None, 0, *STOPPED)]
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
