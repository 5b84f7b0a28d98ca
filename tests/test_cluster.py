"""Training on a cluster (TensorFlow's distributed runtime) on loopback
addresses: synchronous averaging, the chief's checkpoint, asynchronous
updates, and cluster descriptions that cannot work."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from capsnet import cluster
from capsnet.running import cluster_spec
from conftest import ROOT
from conftest import SMALL
from conftest import cli
from conftest import eval_here
from conftest import last_line
from conftest import latest_step
from conftest import needs_mnist
from conftest import train_here
from conftest import wait_until

# 320 training images: with 2 workers x 16 a step, 10 steps an epoch.
ARGS = [*SMALL[:5], "--val_size=500", "--eval_batch_size=300", "--progress=false",
        *SMALL[-2:], "--train_size=320"]


def launch(logdir, *args, workers=2, timeout=240):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, "-m", "capsnet.cluster", "--ps=1",
                         f"--workers={workers}", "--", *ARGS, f"--logdir={logdir}",
                         *args], capture_output=True, text=True, env=env, cwd=ROOT,
                        timeout=timeout)


def model_weights(ckpt):
  reader = tf.train.load_checkpoint(ckpt)
  return {n: reader.get_tensor(n) for n in reader.get_variable_to_shape_map()
          if n.startswith("capsnet/") and "Adam" not in n}


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
  """1 ps + 2 workers, synchronous, batches of 16 each, one epoch (10 steps)."""
  logdir = str(tmp_path_factory.mktemp("cluster") / "sync")
  proc = launch(logdir, "--batch_size=16", "--epochs=1")
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  return logdir, proc


@pytest.mark.integration
@needs_mnist
def test_two_synchronous_workers_average_as_one_process_with_twice_the_batch(
    sync_run, tmp_path):
  logdir, proc = sync_run
  single = str(tmp_path / "single")
  done = train_here(*ARGS, "--batch_size=32", "--epochs=1", f"--logdir={single}")
  assert done.returncode == 0, done.stderr[-3000:]
  def ckpt(d):
    return tf.train.latest_checkpoint(os.path.join(d, "latest"))
  assert ckpt(logdir).endswith("-10") and ckpt(single).endswith("-10")
  ours, theirs = model_weights(ckpt(logdir)), model_weights(ckpt(single))
  assert sorted(ours) == sorted(theirs) and len(ours) == 9
  for name in ours:   # float32 rounding only: the order of the sums differs
    scale = np.abs(theirs[name]).max()
    assert np.abs(ours[name] - theirs[name]).max() <= 1e-5 * scale, name
  assert any(not np.array_equal(ours[n], theirs[n]) for n in ours)   # two processes
  saved = json.load(open(os.path.join(logdir, "config.json")))["train"]
  assert (saved["workers"], saved["sync"], saved["batch_size"]) == (2, True, 16)
  rows = [json.loads(line) for line in open(os.path.join(logdir, "metrics.jsonl"))]
  assert [(r["epoch"], r["step"]) for r in rows] == [(1, 10)]
  assert re.match(r"cluster: 1 ps, 2 worker\(s\) on 127\.0\.0\.1 ports", proc.stdout)


@pytest.mark.integration
@needs_mnist
def test_chief_checkpoint_is_evaluated_by_eval(sync_run, tmp_path):
  logdir, _ = sync_run
  proc = eval_here(f"--checkpoint={logdir}", "--split=validation",
                   f"--out_dir={tmp_path}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.load(open(tmp_path / "results.json"))
  row = json.loads(open(os.path.join(logdir, "metrics.jsonl")).readline())
  assert (result["count"], result["accuracy"]) == (500, row["val_accuracy"])
  test = json.load(open(os.path.join(logdir, "test_results.json")))
  assert test["count"] == 10000


@pytest.mark.integration
@needs_mnist
def test_asynchronous_workers_train_and_every_process_ends(tmp_path):
  logdir = str(tmp_path / "async")
  started = time.time()
  proc = launch(logdir, "--batch_size=16", "--max_steps=6", "--sync=false")
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert time.time() - started < 120
  logs = proc.stdout.split("logs of the others in ")[1].split()[0]
  ps_log = open(os.path.join(logs, "ps_0.log")).read()
  assert "train.py: ps task 0 ends: done" in ps_log
  ckpt = tf.train.latest_checkpoint(os.path.join(logdir, "latest"))
  assert ckpt is not None and json.load(open(os.path.join(
      logdir, "config.json")))["train"]["sync"] is False


@pytest.mark.parametrize("args,message", [
    (["--ps_hosts=localhost:1"], "--ps_hosts and --worker_hosts go together (and "
     "with --job_name and --task_index)"),
    (["--ps_hosts=localhost", "--worker_hosts=localhost:2", "--job_name=worker"],
     "--ps_hosts: 'localhost' is not host:port"),
    (["--ps_hosts=localhost:1", "--worker_hosts=localhost:2", "--job_name=worker",
      "--task_index=1"], "--task_index=1: the worker job has 1 task(s)"),
])
def test_bad_cluster_description_is_one_line(args, message):
  proc = train_here(*args)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [f"train.py: error: {message}"]


CLUSTER = ["--ps_hosts=localhost:1", "--worker_hosts=localhost:2", "--job_name=worker"]


def test_the_role_is_chosen_once_from_the_cluster():
  """roles.choose: one process writes and plans; the chief writes, not
  plans; another worker neither, and relays stop signals (a ps task has no
  role: train.py's main serves, `roles.serve`)."""
  from capsnet.running import roles
  spec = {"ps": ["localhost:1"], "worker": ["localhost:2", "localhost:3"]}
  one = roles.choose(None)
  chief = roles.choose(cluster_spec.ClusterInfo(spec, "worker", 0))
  worker = roles.choose(cluster_spec.ClusterInfo(spec, "worker", 1))
  assert [type(r).__name__ for r in (one, chief, worker)] == ["OneProcess", "Chief", "Worker"]
  assert [r.writes for r in (one, chief, worker)] == [True, True, False]
  assert (one.plans, chief.plans, worker.plans) == (True, False, False)
  # Each one's shard of every epoch (index, workers), from its placement: one
  # process places nothing (no call into `distributed`), a task by the cluster.
  assert [r.placement.shard for r in (one, chief, worker)] == [(0, 1), (0, 2), (1, 2)]
  assert [r.relays_stops for r in (one, chief, worker)] == [False, False, True]
  assert isinstance(one.placement, roles.LocalPlacement) and worker.info.index == 1
  assert one.placement.devices(["/cpu:0"]) == ["/cpu:0"]
  assert worker.placement.devices(["/cpu:0"]) == ["/job:worker/task:1/cpu:0"]
  assert tf.errors.UnavailableError in worker.gone
  # The interface the loop calls: three hooks, the same names on every role.
  hooks = {n for n in vars(roles.OneProcess) if not n.startswith("_")
           and callable(getattr(roles.OneProcess, n))}
  assert hooks == {"session", "run_step", "before_save"}


@pytest.mark.parametrize("arg,message", [
    ("--dataset=multimnist", "--dataset=multimnist does not run on a cluster yet"),
    ("--ema_decay=0.999", "--ema_decay=0.999: weight averaging does not run on a "
     "cluster yet; use --ema_decay=0 there"),
    ("--precision=bf16", "--precision=bf16 on a cluster: TensorFlow's distributed "
     "runtime fuses the bfloat16 Conv1 into an op without a bfloat16 CPU kernel; "
     "use --precision=fp32"),
])
def test_what_does_not_run_on_a_cluster_is_one_line(arg, message):
  """config.check_cluster, the one place that says so; nothing is started."""
  proc = train_here(*CLUSTER, arg)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [f"train.py: error: {message}"]


@pytest.mark.integration
@needs_mnist
def test_unreachable_ps_is_one_line_within_the_wait():
  ps, worker = cluster.free_ports(2)
  started = time.time()
  proc = cli("train.py", *ARGS, "--batch_size=16", f"--ps_hosts=127.0.0.1:{ps}",
             f"--worker_hosts=127.0.0.1:{worker}", "--job_name=worker",
             "--cluster_wait_secs=2", "--logdir=/nonexistent/never/written")
  assert proc.returncode == 1
  assert last_line(proc) == (f"train.py: error: ps task 0 at 127.0.0.1:{ps} not "
                             "reachable within 2 s (--cluster_wait_secs)")
  assert time.time() - started < 60


def test_tf_config_and_launcher_commands():
  config = {"cluster": {"ps": ["a:1"], "worker": ["b:2", "c:3"]},
            "task": {"type": "worker", "index": 1}}
  info = cluster_spec.from_tf_config(json.dumps(config))
  assert info == cluster_spec.ClusterInfo({"ps": ["a:1"], "worker": ["b:2", "c:3"]},
                                     "worker", 1)
  assert cluster_spec.num_workers(info) == 2 and not cluster_spec.is_chief(info)
  with pytest.raises(cluster_spec.ClusterError, match="TF_CONFIG: not a usable cluster"):
    cluster_spec.from_tf_config("{")
  cmds = cluster.commands(1, 2, ["--epochs=1"], [10, 11, 12])
  assert sorted(cmds) == [("ps", 0), ("worker", 0), ("worker", 1)]
  assert cmds[("worker", 1)][2:] == [
      "--epochs=1", "--ps_hosts=127.0.0.1:10", "--worker_hosts=127.0.0.1:11,127.0.0.1:12",
      "--job_name=worker", "--task_index=1"]


def _cluster_stopped_by(sig, target, logdir, *extra):
  """1 ps + 2 synchronous workers started as separate processes (no
  launcher); `sig` goes to `target` ((job, index)) once the chief has saved
  step 3 (None: no signal). Returns {(job, index): (status, output)} once
  all have ended."""
  cmds = cluster.commands(1, 2, [*ARGS, "--batch_size=16", "--epochs=100",
                                 "--save_every=3", "--summary_every=1000",
                                 f"--logdir={logdir}", *extra], cluster.free_ports(3))
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
  procs = {k: subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=ROOT) for k, c in cmds.items()}
  try:
    chief = procs[("worker", 0)]
    if sig is not None:
      assert wait_until(lambda: latest_step(logdir) >= 3, proc=chief, timeout=180)
      procs[target].send_signal(sig)
    return {k: (p.wait(timeout=90), p.stdout.read()) for k, p in procs.items()}
  finally:
    for p in procs.values():
      if p.poll() is None:
        p.kill()


@pytest.mark.integration
@needs_mnist
@pytest.mark.parametrize("target", [("worker", 1), ("ps", 0)])
def test_sigterm_to_any_task_saves_and_every_task_ends(target, tmp_path):
  """SIGTERM to the chief itself: the launcher's test below (it forwards the
  signal to the chief alone)."""
  logdir = str(tmp_path / "run")
  ended = _cluster_stopped_by(signal.SIGTERM, target, logdir)
  assert [ended[k][0] for k in sorted(ended)] == [0 if target[0] == "worker" else 143,
                                                  143, 143], ended
  chief_out = ended[("worker", 0)][1]
  assert "Traceback" not in "".join(out for _, out in ended.values())
  assert (f"SIGTERM to {target[0]} {target[1]}: saving a checkpoint at the end of "
          "this step") in chief_out
  step = latest_step(logdir)
  assert f"Saved {logdir}/latest/model.ckpt-{step}" in chief_out
  other = ("worker", 1)
  assert (f"train.py: worker 1 ends: the chief stopped the run at step {step} "
          "(SIGTERM)") in ended[other][1]
  assert "train.py: ps task 0 ends: done" in ended[("ps", 0)][1]


@pytest.mark.integration
@needs_mnist
def test_sigterm_to_the_launcher_saves_and_every_task_ends(tmp_path):
  logdir = str(tmp_path / "run")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
  proc = subprocess.Popen([sys.executable, "-m", "capsnet.cluster", "--ps=1", "--workers=2",
                           "--", *ARGS, "--batch_size=16", "--epochs=100", "--save_every=3",
                           f"--logdir={logdir}"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
  try:
    assert wait_until(lambda: latest_step(logdir) >= 3, proc=proc, timeout=180)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=90)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 143, err[-3000:]
  assert "Traceback" not in out + err and "ended with status" not in err
  # The chief's own output: the signal came to it, from the launcher.
  assert "SIGTERM: saving a checkpoint at the end of this step" in out
  step = latest_step(logdir)
  assert f"Saved {logdir}/latest/model.ckpt-{step}" in out
  logs = out.split("logs of the others in ")[1].split()[0]
  assert (f"train.py: worker 1 ends: the chief stopped the run at step {step} "
          "(SIGTERM)") in open(os.path.join(logs, "worker_1.log")).read()
  assert "train.py: ps task 0 ends: done" in open(os.path.join(logs, "ps_0.log")).read()


@needs_mnist
@pytest.mark.integration
def test_a_worker_killed_without_a_word_ends_the_run_in_one_line(tmp_path):
  """With both cores kept busy by other programs: the chief names the lost
  worker whether it is inside a step or waiting for the update to be applied
  before a checkpoint (where a loaded machine tends to find it)."""
  logdir = str(tmp_path / "run")
  load = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
          for _ in range(os.cpu_count() or 2)]
  try:
    ended = _cluster_stopped_by(signal.SIGKILL, ("worker", 1), logdir,
                                "--cluster_wait_secs=3")
  finally:
    for p in load:
      p.kill()
      p.wait()
  assert [ended[k][0] for k in sorted(ended)] == [0, 1, -9], ended
  chief_lines = ended[("worker", 0)][1].strip().splitlines()
  assert re.fullmatch(r"train\.py: error: worker 1 at 127\.0\.0\.1:\d+ stopped answering: "
                      rf"step \d+ was not applied; the last checkpoint is {logdir}/latest/"
                      r"model\.ckpt-\d+", chief_lines[-1]), chief_lines[-3:]
  assert "Traceback" not in ended[("worker", 0)][1]
  assert "train.py: ps task 0 ends: done" in ended[("ps", 0)][1]


@needs_mnist
@pytest.mark.integration
def test_the_chief_ending_on_an_error_ends_every_task(tmp_path):
  ended = _cluster_stopped_by(None, None, str(tmp_path / "run"), "--learning_rate=1e12")
  assert [ended[k][0] for k in sorted(ended)] == [0, 1, 1], ended
  chief_last = ended[("worker", 0)][1].strip().splitlines()[-1]
  step = re.fullmatch(r"train\.py: error: loss is (?:nan|inf) at step (\d+); stopped "
                      r"without saving, the last good checkpoint is None", chief_last)
  assert step, chief_last
  # Worker 1 meets the same loss in the same step, and says so itself.
  assert ended[("worker", 1)][1].strip().splitlines()[-1] == chief_last
  # The chief ends the ps task (else it would wait for its idle checks).
  assert "train.py: ps task 0 ends: done" in ended[("ps", 0)][1]


def test_waiting_for_an_update_ends_when_the_watch_names_a_lost_worker():
  """distributed.wait_for_global_step: the update of a step that waits for a
  lost worker is never applied; the wait returns the watch's name for it
  (the chief then names it, `roles`), and times out without one."""
  import types

  from capsnet.running import cluster_spec as spec
  from capsnet.running import distributed
  sess = types.SimpleNamespace(run=lambda _: 5)      # the global step stays at 5
  watch = types.SimpleNamespace(lost=None)
  assert distributed.wait_for_global_step(sess, None, 5, watch) is None   # applied
  watch.lost = "worker 1 at 127.0.0.1:2222"
  assert distributed.wait_for_global_step(sess, None, 6, watch) == watch.lost
  with pytest.raises(spec.ClusterError, match=r"^the update of step 6 was not applied "
                     r"within 0.2 s \(a worker gone\?\)$"):
    distributed.wait_for_global_step(sess, None, 6, None, seconds=0.2)
