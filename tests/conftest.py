"""Shared fixtures and helpers: graph mode once, a tiny float64 config, the
small model's command-line flags and a runner for train.py / eval.py."""
import contextlib
import fcntl
import functools
import glob
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# TensorFlow's thread pools, as on the 2-core machines where every recorded
# bit-for-bit figure (the float64 weights' sha256 in test_regression and
# test_averaging) was made: by default TensorFlow uses one intra-op thread per
# core, and how its float64 reductions split the work follows the thread count,
# so on a machine with 1 or 4 cores those tests would fail though nothing
# changed. Set before any session exists; the processes the tests start
# inherit it. On these machines it is TensorFlow's default, so no timing moves.
os.environ["TF_NUM_INTRAOP_THREADS"] = "2"
os.environ["TF_NUM_INTEROP_THREADS"] = "2"
# The suite's workers share the machine on purpose: the planner's and the
# benchmark's idle check (host.others_busy) would mark every timing; the
# tests of that check turn it back on.
os.environ["CAPSNET_ASSUME_IDLE"] = "1"

from capsnet.running import startup  # noqa: E402

startup.import_tensorflow()

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from capsnet.model import network  # noqa: E402

tf.compat.v1.disable_eager_execution()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 12x12 images -> conv1 3x3 -> 10x10x4 -> primary 3x3/2 -> 4x4x2 = 32 capsules.
TINY = dict(image_size=12, conv1_channels=4, conv1_kernel=3, primary_types=2,
            primary_dim=4, primary_kernel=3, primary_stride=2, num_classes=3,
            digit_dim=4, decoder_units=(8,), dtype="float64")


@pytest.fixture
def tiny_cfg():
  return network.ModelConfig(**TINY)


MNIST = os.path.join(ROOT, "data", "mnist")
HAVE_MNIST = os.path.isdir(MNIST) and len(glob.glob(os.path.join(MNIST, "*.gz"))) >= 4
IN_CI = os.environ.get("CI", "").lower() in ("true", "1")


def needs_mnist(test):
  """For tests on the real MNIST files: without them a test skips, saying
  why, except in CI (CI=true), where it fails: CI must run them all."""
  if HAVE_MNIST:
    return test
  why = f"real MNIST files not in {MNIST} (.ci/run seeds them from ../shared/data)"
  if not IN_CI:
    return pytest.mark.skip(reason=why)(test)

  @functools.wraps(test)
  def fail(*args, **kwargs):
    pytest.fail(f"CI=true: {why}")
  return fail

# A small CapsNet for command-line tests: 16 Conv1 channels, 4 primary types.
# The convolutions by conv_impl's rule, not a plan measured on the host, so
# that every test computes the same thing on every machine (the planner's
# own tests, tests/test_planner.py, plan).
SMALL = ["--conv1_channels=16", "--primary_types=4", "--primary_dim=4",
         "--digit_dim=8", "--decoder_units=32", "--batch_size=32",
         "--val_size=500", "--eval_batch_size=300", "--progress=false",
         f"--data_dir={MNIST}", "--download=false", "--conv_impl=custom_grad"]

# Where a test that plans keeps the plan cache: never the user's ~/.cache.
os.environ.setdefault("CAPSNET_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"capsnet-test-cache-{os.getpid()}"))


def cli(script, *args, timeout=300, tf_log_level="3", **kwargs):
  """Runs `python <script> <args>` from the repository root in a new process
  (plain `subprocess`); returns the CompletedProcess (text stdout and
  stderr). tf_log_level=None runs it with TF_CPP_MIN_LOG_LEVEL unset (the
  program's own default)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=tf_log_level or "", PYTHONPATH=ROOT)
  if tf_log_level is None:
    del env["TF_CPP_MIN_LOG_LEVEL"]
  return subprocess.run([sys.executable, os.path.join(ROOT, script), *args],
                        capture_output=True, text=True, timeout=timeout, env=env,
                        cwd=ROOT, **kwargs)


def train_here(*args):
  """Runs train.py's `main` in this process with these flags: what `cli`
  does for train.py, without a new process's TensorFlow start-up (seconds
  each). Returns a CompletedProcess (exit status, stdout, stderr)."""
  from absl import flags

  import train  # defines train.py's flags in absl's global FLAGS
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["train.py", *args])
  return _run_main("train.py", args, lambda: train.main(["train.py"]))


def eval_here(*args):
  """As `train_here`, for eval.py: its flags go in a FlagValues of their own,
  since train.py's (some of the same names) are in absl's global FLAGS."""
  from absl import flags

  import eval as eval_py
  fv = flags.FlagValues()
  eval_py.define_flags(fv)
  argv = fv(["eval.py", *args])
  return _run_main("eval.py", args, lambda: eval_py.main(argv, fv))


def _run_main(script, args, main):
  out, err, code = io.StringIO(), io.StringIO(), 0
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      main()
    except SystemExit as e:   # sys.exit(message) prints it and exits with 1
      code = e.code if isinstance(e.code, int) or e.code is None else 1
      if isinstance(e.code, str):
        print(e.code, file=err)
  return subprocess.CompletedProcess([script, *args], code or 0, out.getvalue(),
                                     err.getvalue())


def start(script, *args, **popen_kwargs):
  """Starts `python <script> <args>` as `cli` runs it, without waiting."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
  return subprocess.Popen([sys.executable, os.path.join(ROOT, script), *args],
                          env=env, cwd=ROOT, **popen_kwargs)


def wait_until(condition, timeout=120, poll=0.05, proc=None):
  """Polls `condition()` until it holds, `timeout` passes or `proc` ends.
  Returns: whether it holds (assert it: a timeout must not pass unnoticed)."""
  deadline = time.time() + timeout
  while not condition() and time.time() < deadline and (proc is None or
                                                           proc.poll() is None):
    time.sleep(poll)
  return bool(condition())


def last_line(proc):
  lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
  return lines[-1] if lines else ""


# 320 training images of 32: 10 steps an epoch.
QUICK = [*SMALL, "--train_size=320"]
# Three such epochs, a checkpoint every step: the uninterrupted reference of
# the kill and preemption tests (`trained_once`), and a trained run to score.
THREE_EPOCHS = [*QUICK, "--epochs=3", "--save_every=1", "--summary_every=1000"]
# One epoch of 50 steps on 1,600 images (about 80% validation accuracy) with
# two towers on the CPU, summaries and diagnostics: the run the training
# tests read, and the model the usage tests classify with (`trained_once`).
TWO_TOWERS = [*SMALL, "--epochs=1", "--train_size=1600", "--learning_rate=0.01",
              "--summary_every=5", "--num_gpus=2", "--device=/cpu:0", "--diag_every=25"]


@pytest.fixture(scope="session")
def trained_once(tmp_path_factory):
  """`trained_once(*flags)`: the run folder of `train_here(*flags)`, trained
  once for the whole session: under pytest-xdist the first worker to ask
  trains it (a file lock in the workers' common temporary folder) and the
  others wait for it and read the same folder. Read only: a test that
  changes a run copies it first (shutil.copytree); one that asks train.py
  to resume it with other flags relies on the refusal leaving it byte for
  byte as it was (tests/test_run_lock.py)."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent   # pytest-of-<user>/pytest-<n>, shared by the workers
  shared = root / "trained_once"
  shared.mkdir(exist_ok=True)

  def get(*flags):
    key = hashlib.sha256("\0".join(flags).encode()).hexdigest()[:16]
    logdir, done = shared / key, shared / f"{key}.done"
    with open(shared / f"{key}.lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      if not done.exists():
        if logdir.exists():   # a worker that failed while training it
          shutil.rmtree(logdir)
        proc = train_here(*flags, f"--logdir={logdir}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        (shared / f"{key}.stdout").write_text(proc.stdout)
        done.write_text(" ".join(flags))
    return str(logdir)
  return get


def trained_stdout(logdir):
  """What train.py printed while `trained_once` trained `logdir`."""
  return open(logdir + ".stdout").read()


def rows(logdir, name="metrics.jsonl"):
  with open(os.path.join(logdir, name)) as f:
    return [json.loads(line) for line in f if line.strip()]


def listed(folder):
  """The checkpoints a `checkpoint` file lists, each of which must load."""
  state = tf.compat.v1.train.get_checkpoint_state(folder)
  return [os.path.join(folder, os.path.basename(p))
          for p in (state.all_model_checkpoint_paths if state else [])]


@pytest.fixture
def small_disk(tmp_path):
  """A tmpfs folder (needs mount rights, as root in CI); yields a function
  that remounts it with other options."""
  folder = tmp_path / "mnt"
  folder.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)],
                    capture_output=True).returncode:
    pytest.skip("cannot mount a tmpfs here")
  def remount(opts):
    return subprocess.run(
        ["mount", "-o", f"remount,{opts}", str(folder)], check=True)
  yield folder, remount
  subprocess.run(["umount", str(folder)], check=True)   # fails if a file is left open


# metrics.jsonl fields that may differ between a run and its resumed twin
TIMING = ("wall_s", "images_per_sec")


# weights_sha256 of the regression run (tests/test_regression.py: SMALL,
# --train_size=320, --max_steps=12, --dtype=float64), recorded at commit
# 8739eda; weight averaging must leave it as it is (tests/test_averaging.py).
FLOAT64_WEIGHTS_SHA256 = "b639933f89df2108b8c4b1320b264c5efba71713fbf4e476e33e18a0523a1f86"


def run_and_list_nodes(sess, fetches, feed_dict=None):
  """`sess.run(fetches)` and the nodes of the graph that ran (after
  Grappler, every partition): (value, [NodeDef])."""
  meta = tf.compat.v1.RunMetadata()
  value = sess.run(fetches, feed_dict, run_metadata=meta,
                   options=tf.compat.v1.RunOptions(output_partition_graphs=True))
  return value, [n for g in meta.partition_graphs for n in g.node]


def weights_sha256(ckpt):
  """sha256 over a checkpoint's model variables (capsnet/, no Adam slots, no
  moving averages), in name order: the end-to-end regression value."""
  import hashlib

  import numpy as np
  reader = tf.train.load_checkpoint(ckpt)
  digest = hashlib.sha256()
  for name, _ in sorted(tf.train.list_variables(ckpt)):
    if (name.startswith("capsnet/") and "Adam" not in name
        and not name.endswith("/ExponentialMovingAverage")):
      digest.update(name.encode())
      digest.update(np.ascontiguousarray(reader.get_tensor(name)).tobytes())
  return digest.hexdigest()


def latest_step(logdir):
  """The step of the newest checkpoint latest/checkpoint lists (0: none)."""
  try:
    with open(os.path.join(logdir, "latest", "checkpoint")) as f:
      return int(f.readline().split('"')[1].rsplit("-", 1)[1])
  except (OSError, IndexError, ValueError):
    return 0


def assert_same_decision(ours, theirs):
  """Two results.json decisions agree: every call, count and word exactly,
  every figure to 1e-9 (main's t quantiles are scipy's, the registration's
  its own series: they differ in the last bits, never in a printed digit)."""
  if isinstance(theirs, float):
    assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-12)
  elif isinstance(theirs, dict):
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
      assert_same_decision(ours[key], theirs[key])
  elif isinstance(theirs, list):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
      assert_same_decision(a, b)
  else:
    assert type(ours) is type(theirs) and ours == theirs


def stop_once_saved(cmd, run_folder, **popen):
  """Starts `cmd`, sends it one SIGTERM once `run_folder` holds a latest/
  checkpoint (or the command has ended); returns (its exit status, its output)."""
  import signal  # noqa: PLC0415
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          **popen)
  for _ in range(1200):
    if os.path.isdir(os.path.join(run_folder, "latest")) or proc.poll() is not None:
      break
    time.sleep(0.25)
  proc.send_signal(signal.SIGTERM)
  said = proc.communicate(timeout=300)[0]   # read while it ends: a full pipe never blocks it
  return proc.returncode, said
