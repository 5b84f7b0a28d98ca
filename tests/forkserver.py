"""Starts the tests' `python train.py ...` processes without importing
TensorFlow in each: a fork server.

Every process a test starts spends about 2 s of CPU importing TensorFlow
before the program's first line (2.7 s with ml_dtypes 0.7), and the suite
starts dozens. The server is a Python process that has imported TensorFlow
(as the programs import it, with capsnet.running.startup) and nothing else;
for each request it forks, and the child becomes the program: the request's
standard streams, working directory, environment and argv, then the script
(or `-m` module) run as `__main__` by runpy, so the program's own exit
status, signal handlers, atexit work and output are what a fresh process
would have. Only what a fresh interpreter does before the program's first
line is shared: the import of TensorFlow and its dependencies.

A program forked so that starts Python programs itself (the cluster
launcher its tasks, the study its runs) has them forked too: in the child
subprocess.Popen is this module's Popen. What is not forked is started the
plain way: a command that is not `python script.py` or `python -m module`
(`python -c`, `python -I`, git), another TF_CPP_MIN_LOG_LEVEL than the
server's 3 (TensorFlow's C++ logging reads it once a process), and so a
test about the import itself (which notices it prints, whether it loads
Keras: test_bad_input.py, which starts its processes with subprocess), and
the benchmark's measurements (multiprocessing's spawn, a fresh interpreter
each, as the benchmark means them to be).

  Server:  python tests/forkserver.py SOCKET   (prints "ready" once listening)
  Client:  Popen(argv, ...), a subprocess.Popen whose child comes from the
           server (started on first use, one per test process): the same
           pipes, communicate(), poll(), wait(timeout), send_signal() and
           kill() (a real process: the pid is real), and the exit status
           the server reaped (-N for a signal, as Popen); run(argv, ...).
"""
import atexit
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MAX_REQUEST = 1 << 20


# -- the server ------------------------------------------------------------

def serve(path):
  """Imports TensorFlow, listens on the Unix socket `path` and forks a child
  for each request until its standard input closes (the client's end).
  Started without PYTHONPATH: each child's sys.path is its own request's."""
  base_path = sys.path[1:]   # the interpreter's own: the stdlib, site-packages
  sys.path.insert(0, ROOT)
  from capsnet.running import startup
  startup.import_tensorflow()
  del sys.path[0]

  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(path)
  listener.listen(64)
  print("ready", flush=True)
  waiting = {}   # child pid -> the connection its status goes back on
  while True:
    readable, _, _ = select.select([listener, sys.stdin], [], [], 0.02)
    if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
      break   # the tests' process ended or closed us
    if listener in readable:
      conn, _ = listener.accept()
      request, fds = _receive(conn)
      pid = os.fork()
      if pid == 0:   # the child: becomes the program and never returns here
        listener.close()
        for other in waiting.values():
          other.close()
        _become(request, fds, conn, path, base_path)
      for fd in fds:
        os.close(fd)
      conn.sendall(f"{pid}\n".encode())
      waiting[pid] = conn
    _reap(waiting)
  for pid in list(waiting):   # what is left ends with the tests
    try:
      os.kill(pid, 9)
    except ProcessLookupError:
      pass
  os.unlink(path)


def _receive(conn):
  data, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 3)
  while not data.endswith(b"\n"):
    more = conn.recv(_MAX_REQUEST)
    if not more:
      raise RuntimeError("forkserver: request cut short")
    data += more
  return json.loads(data), fds


def _reap(waiting):
  while waiting:
    try:
      pid, status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if pid == 0:
      return
    conn = waiting.pop(pid, None)
    if conn is not None:
      try:
        conn.sendall(f"{status}\n".encode())
      except OSError:
        pass   # the client has gone; nothing waits for this status
      conn.close()


def _become(request, fds, conn, path, base_path):
  """In the forked child: the request's streams, cwd, environment and argv,
  then the program as `__main__`. Exceptions, SystemExit included, leave
  through the interpreter's own exit, as in a fresh `python script.py`.
  The program's own Python children (the cluster launcher's tasks, the
  study's runs) come from the server too: subprocess.Popen is this module's
  Popen in the child, which starts what it cannot fork the plain way."""
  conn.close()
  _server.update(proc="external", path=path)
  subprocess.Popen = Popen
  for target, fd in enumerate(fds):
    os.dup2(fd, target)
  for fd in fds:
    if fd > 2:
      os.close(fd)
  if request["new_session"]:
    os.setsid()
  os.chdir(request["cwd"])
  os.environ.clear()
  os.environ.update(request["env"])
  import numpy
  numpy.random.seed()   # a fresh process draws its own global numpy state
  import runpy
  argv = request["argv"]
  extra = [os.path.abspath(p) for p in request["env"].get("PYTHONPATH", "").split(
      os.pathsep) if p]
  if argv[0] == "-m":   # as `python -m`: the working directory first
    sys.argv = [argv[1], *argv[2:]]
    sys.path[:] = [request["cwd"], *extra, *base_path]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
  else:                 # as `python script.py`: the script's folder first
    sys.argv = list(argv)
    sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *extra, *base_path]
    runpy.run_path(argv[0], run_name="__main__")
  sys.exit(0)


# -- the client ------------------------------------------------------------

_server = {"proc": None, "path": None}
_lock = threading.Lock()


def _server_path(env):
  """Starts the server once for this process, in the environment of the
  first request (TF_CPP_MIN_LOG_LEVEL=3) less its PYTHONPATH."""
  with _lock:
    if _server["proc"] == "external":   # in a child of the server
      return _server["path"]
    if _server["proc"] is None or _server["proc"].poll() is not None:
      path = os.path.join(tempfile.mkdtemp(prefix="forkserver-"), "socket")
      env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
      proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), path],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=env, cwd=ROOT)
      line = proc.stdout.readline()
      if line.strip() != b"ready":
        raise RuntimeError(f"forkserver did not start: {line!r}, status {proc.poll()}")
      _server.update(proc=proc, path=path)
      atexit.register(stop)
    return _server["path"]


def stop():
  """Ends the server (its children, if any are left, are killed)."""
  with _lock:
    proc = _server["proc"]
    if proc in (None, "external"):
      return
    if proc.poll() is None:
      proc.stdin.close()
      proc.wait(timeout=30)
    shutil.rmtree(os.path.dirname(_server["path"]), ignore_errors=True)
    _server.update(proc=None, path=None)


def _forkable(argv, env):
  """Whether the server can run `argv`: `python script.py ...` or `python -m
  module ...` with the server's TF_CPP_MIN_LOG_LEVEL (3)."""
  if len(argv) < 2 or argv[0] != sys.executable:
    return False
  if env.get("TF_CPP_MIN_LOG_LEVEL") != "3":
    return False
  return (argv[1] == "-m" and len(argv) >= 3) or not argv[1].startswith("-")


class Popen(subprocess.Popen):
  """subprocess.Popen whose child, when it is a Python program started as
  the tests start them (`[sys.executable, script or -m module, ...]`, an
  environment with TF_CPP_MIN_LOG_LEVEL=3, nothing but argv, cwd, env, the
  three streams and start_new_session asked for), is forked by the server;
  anything else is started the plain way. `forked` says which."""

  forked = False

  def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds,
                     cwd, env, startupinfo, creationflags, shell, p2cread,
                     p2cwrite, c2pread, c2pwrite, errread, errwrite,
                     restore_signals, gid, gids, uid, umask, start_new_session,
                     process_group):
    env = dict(os.environ if env is None else env)
    argv = [os.fsdecode(a) for a in args] if isinstance(args, (list, tuple)) else []
    plain_only = (shell or preexec_fn or pass_fds or executable or gids or umask >= 0
                  or gid is not None or uid is not None
                  or process_group not in (None, -1))
    if plain_only or not _forkable(argv, env):
      return super()._execute_child(
          args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
          errwrite, restore_signals, gid, gids, uid, umask, start_new_session,
          process_group)
    streams = [p2cread, c2pwrite, errwrite]
    fds = [fd if fd != -1 else i for i, fd in enumerate(streams)]
    request = json.dumps({"argv": argv[1:], "cwd": os.fsdecode(cwd or os.getcwd()),
                          "env": env, "new_session": bool(start_new_session)})
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(_server_path(env))
    try:
      socket.send_fds(conn, [request.encode() + b"\n"], fds)
    finally:   # the child's ends are the child's now (as Popen's own does)
      self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
    # Unbuffered: a buffer could take the status line with the pid's, and
    # a poll (select on the socket) would then never see it come.
    self._status_file = conn.makefile("rb", buffering=0)
    self._conn = conn
    line = self._status_file.readline()
    if not line:
      raise RuntimeError("forkserver: the server ended before forking")
    self.pid = int(line)
    self.forked = self._child_created = True

  def _try_wait(self, wait_flags):
    if not self.forked:
      return super()._try_wait(wait_flags)
    if wait_flags & os.WNOHANG:
      ready, _, _ = select.select([self._conn], [], [], 0)
      if not ready:
        return (0, 0)
    line = self._status_file.readline()
    if not line:
      raise RuntimeError(f"forkserver: the server ended; the status of pid "
                         f"{self.pid} is lost")
    self._status_file.close()
    self._conn.close()
    return (self.pid, int(line))

  def _internal_poll(self, _deadstate=None, **unused):
    if not self.forked:
      return super()._internal_poll(_deadstate)
    if self.returncode is None and self._waitpid_lock.acquire(False):
      try:
        if self.returncode is None:
          pid, status = self._try_wait(os.WNOHANG)
          if pid == self.pid:
            self._handle_exitstatus(status)
      finally:
        self._waitpid_lock.release()
    return self.returncode


def run(args, input=None, timeout=None, capture_output=False, **kwargs):
  """subprocess.run with forkserver.Popen."""
  if capture_output:
    kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  if input is not None:
    kwargs["stdin"] = subprocess.PIPE
  with Popen(args, **kwargs) as proc:
    try:
      out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
      raise
  return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


if __name__ == "__main__":
  serve(sys.argv[1])
