"""tests/forkserver.py, the tests' way of starting train.py and eval.py:
a program forked from it must look, from outside, like the same program in
a fresh interpreter: its output, exit status (signals included), argv,
working directory, environment and standard input."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import forkserver
from conftest import wait_until

PROGRAM = textwrap.dedent("""\
    import os, signal, sys, time
    what = sys.argv[1]
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("FS_TEST"))
    print("main", __name__, os.path.basename(__file__), "path0", os.path.basename(sys.path[0]))
    sys.stdout.flush()
    if what == "exit3":
      sys.exit(3)
    if what == "message":
      sys.exit("program: error: a one-line message")
    if what == "raise":
      raise ValueError("uncaught")
    if what == "stdin":
      print("read", sys.stdin.read().strip())
    if what == "child":
      import subprocess
      done = subprocess.run([sys.executable, __file__, "ppid"], capture_output=True,
                            text=True)
      ppid = int(done.stdout.split()[-1])
      print("grandchild", done.returncode, done.stdout.splitlines()[0], ppid == os.getpid())
    if what == "ppid":
      print(os.getppid())
    if what in ("wait", "sigterm"):
      # Python's own SIGINT handler, also where the tests run with SIGINT
      # ignored (a shell's background job), which a child would inherit.
      signal.signal(signal.SIGINT, signal.default_int_handler)
      if what == "sigterm":
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
      open(sys.argv[2], "w").close()
      time.sleep(60)
    """)


def _both(tmp_path, *args, **kwargs):
  """(fresh, forked) CompletedProcess of PROGRAM with `args`."""
  script = tmp_path / "program.py"
  script.write_text(PROGRAM)
  env = dict(os.environ, FS_TEST="seen", TF_CPP_MIN_LOG_LEVEL="3")
  argv = [sys.executable, str(script), *args]
  common = dict(capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=60)
  return (subprocess.run(argv, **common, **kwargs),
          forkserver.run(argv, **common, **kwargs))


@pytest.mark.parametrize("what", ["exit0", "exit3", "message", "raise"])
def test_output_and_status_as_a_fresh_process(tmp_path, what):
  fresh, forked = _both(tmp_path, what)
  assert forked.returncode == fresh.returncode == {"exit0": 0, "exit3": 3, "message": 1,
                                                   "raise": 1}[what]
  assert forked.stdout == fresh.stdout
  assert fresh.stdout.splitlines()[0] == f"argv ['{what}'] cwd {tmp_path} env seen"
  assert fresh.stdout.splitlines()[1] == f"main __main__ program.py path0 {tmp_path.name}"
  # Tracebacks name the same lines (the forked one has more frames above).
  assert forked.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]


def test_standard_input_is_the_callers(tmp_path):
  fresh, forked = _both(tmp_path, "stdin", input="typed\n")
  assert forked.stdout.splitlines()[-1] == fresh.stdout.splitlines()[-1] == "read typed"


def _stopped_by(popen, sig, tmp_path):
  """Starts PROGRAM with `popen`, sends `sig` once it is waiting; returns
  (status, stderr)."""
  ready = tmp_path / f"ready-{popen.__module__}"
  proc = popen([sys.executable, str(tmp_path / "program.py"),
                "sigterm" if sig == signal.SIGTERM else "wait", str(ready)],
               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
               env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"), cwd=str(tmp_path))
  try:
    assert wait_until(ready.exists, timeout=30, proc=proc)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
      proc.wait(timeout=0.1)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
  return proc.returncode, err


@pytest.mark.parametrize("sig,expected", [(signal.SIGKILL, -9), (signal.SIGTERM, 143),
                                          (signal.SIGINT, -2)])
def test_a_signal_reaches_the_program_and_its_status_comes_back(tmp_path, sig, expected):
  """SIGINT: Python's own handler (KeyboardInterrupt, a traceback, then the
  interpreter ends itself by SIGINT: -2); SIGTERM: the program's handler;
  SIGKILL: -9, as Popen reports it."""
  (tmp_path / "program.py").write_text(PROGRAM)
  fresh = _stopped_by(subprocess.Popen, sig, tmp_path)
  forked = _stopped_by(forkserver.Popen, sig, tmp_path)
  assert forked[0] == fresh[0] == expected, (fresh, forked)
  assert forked[1].splitlines()[-1:] == fresh[1].splitlines()[-1:]


def test_a_programs_own_python_children_are_forked_too(tmp_path):
  """The cluster launcher's tasks and the study's runs: in a forked
  program subprocess.Popen forks from the server as well (the grandchild's
  parent is the server, not the program)."""
  fresh, forked = _both(tmp_path, "child")
  line = f"grandchild 0 argv ['ppid'] cwd {tmp_path} env seen"
  assert fresh.stdout.splitlines()[-1] == line + " True"
  assert forked.stdout.splitlines()[-1] == line + " False"


def test_what_it_cannot_fork_starts_the_plain_way(tmp_path):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  script = [sys.executable, str(tmp_path / "program.py")]
  (tmp_path / "program.py").write_text("print('c')")
  for argv, other in (([sys.executable, "-c", "print('c')"], {}),
                      ([sys.executable, "-I", "-c", "print('c')"], {}),
                      (script, {"TF_CPP_MIN_LOG_LEVEL": "0"})):
    proc = forkserver.Popen(argv, stdout=subprocess.PIPE, text=True,
                            env=dict(env, **other), cwd=str(tmp_path))
    assert proc.communicate(timeout=60)[0] == "c\n" and proc.returncode == 0
    assert not proc.forked
  (tmp_path / "program.py").write_text(PROGRAM)
  proc = forkserver.Popen([sys.executable, str(tmp_path / "program.py"), "exit3"],
                          stdout=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path))
  assert proc.wait(timeout=60) == 3 and proc.forked
  proc.stdout.close()
