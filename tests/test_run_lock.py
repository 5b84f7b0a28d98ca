"""The run folder's lock: a refused start leaves the folder byte for byte, and
a lock file unlinked by a refused start cannot give two processes the lock."""
import os
import subprocess
import sys

import pytest

from capsnet.running import runs
from conftest import QUICK
from conftest import ROOT
from conftest import needs_mnist
from conftest import train_here


def snapshot(folder):
  """Every file under `folder`: its bytes and modification time."""
  out = {}
  for root, _, names in os.walk(folder):
    for name in names:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, folder)] = (f.read(), os.stat(path).st_mtime_ns)
  return out


@needs_mnist
def test_refused_resume_leaves_a_finished_run_byte_for_byte(tmp_path):
  logdir = str(tmp_path / "run")
  proc = train_here(*QUICK, "--max_steps=2", f"--logdir={logdir}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert os.path.exists(os.path.join(logdir, runs.LOCK_FILE))   # the run's holder line
  before = snapshot(logdir)
  proc = train_here(*QUICK, "--max_steps=4", "--learning_rate=0.5", f"--logdir={logdir}")
  assert proc.returncode == 1 and "learning_rate" in proc.stderr
  assert snapshot(logdir) == before


def test_refused_start_in_a_new_folder_leaves_nothing(tmp_path):
  folder = str(tmp_path / "new")
  runs.RunLock(folder).release(undo=True)
  assert not os.path.exists(folder)


# A second process that opens the lock file, then waits (for a line on its
# stdin) before its flock: the moment a refused start may unlink the file.
_LATE_LOCKER = r"""
import fcntl, sys
real = fcntl.flock
def late(f, op):
  fcntl.flock = real
  print("opened", flush=True)
  sys.stdin.readline()
  return real(f, op)
fcntl.flock = late
from capsnet.running import runs
try:
  runs.RunLock(sys.argv[1])
  print("locked", flush=True)
except runs.RunError as e:
  print("refused:", e, flush=True)
"""


@pytest.mark.integration
def test_a_lock_file_unlinked_under_a_waiting_process_is_not_held(tmp_path):
  folder = tmp_path / "run"
  folder.mkdir()
  (folder / "config.json").write_text("{}")   # the folder stays when the lock goes
  first = runs.RunLock(str(folder))             # a start that will be refused
  late = subprocess.Popen([sys.executable, "-c", _LATE_LOCKER, str(folder)], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
  try:
    assert late.stdout.readline().strip() == "opened"   # holds the old file open
    first.release(undo=True)                            # unlinks it
    third = runs.RunLock(str(folder))                   # a new file, locked
    late.stdin.write("go\n")
    late.stdin.flush()
    answer = late.stdout.readline().strip()
    assert answer.startswith(f"refused: --logdir={folder} is in use by pid {os.getpid()}"), answer
    third.release()
  finally:
    late.kill()
    late.wait()
