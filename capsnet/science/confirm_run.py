"""Running the confirmatory sequence (docs/confirm.md): the registered order
of its 48 runs, the checks that keep every attempt on the registered code and
environment, each attempt's host identity, resume or restart by the page's
rule, a stopped run's part-way state, and each run's scorings (with the
indices of the misclassified images) published as it ends.
`python -m capsnet.confirm`."""
import datetime
import hashlib
import importlib.metadata
import os
import platform
import re
import shutil
import signal
import subprocess

from capsnet.running import files
from capsnet.running import host
from capsnet.running import runs
from capsnet.science import blocks
from capsnet.science import confirm
from capsnet.science import grids
from capsnet.science import report as study_report

# The registration: the commit that adds the lock file (docs/confirm.md).
LOCK = os.path.join("docs", "confirm.lock")
SETTINGS = blocks.settings(confirm.CONFIRM)
IDENTITY = ("cpu", "cpu_id", "flags", "cores", "python", "tensorflow", "numpy", "onednn")

LOST_FOLDER = "lost"               # in --out: the folders of restarted runs, kept
# Tests only: skips the code and environment checks; every attempt records it
# ("checked": false) and the audit refuses such a run.
UNCHECKED = "CAPSNET_CONFIRM_UNCHECKED"
MODEL_FAILURE = "train.py: error: loss is "   # a non-finite loss: an outcome
NOT_LOCKED = ("pip", "setuptools", "wheel", "distribute")   # pip freeze leaves them out


class ConfirmError(Exception):
  """A refusal or a fault, in one line."""


def identity():
  """This host's identity as every attempt records it (IDENTITY's fields)."""
  facts = host.describe()
  out = {k: facts[k] for k in ("cpu", "cpu_id", "flags", "cores", "tensorflow", "onednn")}
  out["python"] = platform.python_version()
  out["numpy"] = host.version("numpy")
  return out


def differs(first, now):
  """The first IDENTITY field where two identities differ, as "field: a -> b",
  or None."""
  for key in IDENTITY:
    if first.get(key) != now.get(key):
      return f"{key}: {first.get(key)} -> {now.get(key)}"
  return None


def _normal(name):
  return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path):
  """(python version, {package: version}) of a lock file."""
  python, pins = None, {}
  try:
    with open(path) as f:
      lines = f.read().splitlines()
  except OSError as e:
    raise ConfirmError(f"{path}: cannot read ({e.strerror})") from None
  for line in lines:
    if line.startswith("# python "):
      python = line.split()[2]
    elif line.strip() and not line.startswith("#"):
      name, sep, version = line.strip().partition("==")
      if not sep:
        raise ConfirmError(f"{path}: {line!r}: expected name==version")
      pins[_normal(name)] = version
  return python, pins


def installed():
  """{package: version} of this interpreter's environment (pip's own left out)."""
  found = {}
  for dist in importlib.metadata.distributions():
    name = dist.metadata["Name"]
    if name and _normal(name) not in NOT_LOCKED:
      found[_normal(name)] = dist.version
  return found


def check_environment(lock_path, python=None, found=None):
  """Raises ConfirmError naming the first difference between this environment
  and the lock file."""
  locked_python, pins = read_lock(lock_path)
  python = python or platform.python_version()
  found = installed() if found is None else found
  build = f"(build it: python3 -m venv ENV && ENV/bin/pip install -r {LOCK})"
  if locked_python != python:
    raise ConfirmError(f"Python {python}, the lock file has {locked_python} {build}")
  for name in sorted(set(pins) | set(found)):
    if pins.get(name) != found.get(name):
      raise ConfirmError(f"{name} {found.get(name) or 'not installed'} here, "
                         f"{pins.get(name) or 'not'} in {LOCK} {build}")


def _git(root, *args):
  return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                        check=True).stdout


def registration_commit(root):
  """The commit that adds the lock file, or None."""
  try:
    found = _git(root, "log", "--diff-filter=A", "--format=%H", "--", LOCK).split()
  except (OSError, subprocess.CalledProcessError):
    return None
  return found[-1] if found else None


def check_code(root):
  """The registration commit; raises ConfirmError unless `root` is a clean
  checkout at it."""
  registered = registration_commit(root)
  if registered is None:
    raise ConfirmError(f"{root}: no git history that adds {LOCK} (expected a checkout "
                       "of the repository at the registration commit)")
  head = _git(root, "rev-parse", "HEAD").strip()
  if head != registered:
    raise ConfirmError(f"{root} is at {head[:12]}, the registration is {registered[:12]}: "
                       "run from a checkout at it (docs/confirm.md, Commands)")
  dirty = _git(root, "status", "--porcelain").splitlines()
  if dirty:
    raise ConfirmError(f"{root} has changes ({dirty[0].strip()}): the registration's "
                       "code is run as committed")
  return registered


def checked():
  return os.environ.get(UNCHECKED) != "1"


def check_turn(publish, out, due):
  """Raises ConfirmError if a run after `due` is published, or part-way in
  `out`: the sequence is taken in order."""
  later = confirm.sequence()[confirm.sequence().index(due) + 1:] if due else []
  for seed, variant in later:
    name = confirm.folder_name((seed, variant))
    if os.path.exists(os.path.join(publish, name)):
      raise ConfirmError(f"{publish}/{name}: published out of turn, "
                         f"{confirm.folder_name(due)} is due")
    if os.path.exists(os.path.join(out, name)):
      raise ConfirmError(f"{out}/{name}: out of turn, {confirm.folder_name(due)} is due (the "
                         "sequence, docs/confirm.md)")


def newest_checkpoint(folder):
  """(step, the files of the newest checkpoint in latest/ or epochs/) or
  (None, [])."""
  best = (None, [])
  for which in ("latest", "epochs"):
    path = os.path.join(folder, which)
    if not os.path.isdir(path):
      continue
    names = os.listdir(path)
    for name in names:
      m = re.fullmatch(re.escape(runs.CHECKPOINT_PREFIX) + r"-(\d+)\.index", name)
      if m and (best[0] is None or int(m.group(1)) > best[0]):
        stem = name[:-len(".index")]
        best = (int(m.group(1)), sorted(os.path.join(path, n) for n in names
                                        if n.startswith(stem + ".")))
  return best


def digest(paths):
  """sha256 over the files' names and bytes."""
  h = hashlib.sha256()
  for path in paths:
    h.update(os.path.basename(path).encode() + b"\0")
    with open(path, "rb") as f:
      for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
  return h.hexdigest()


def _now():
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _started(folder):
  """Whether the folder holds a run that has started (config.json or a checkpoint)."""
  return (os.path.exists(os.path.join(folder, runs.CONFIG_FILE))
          or newest_checkpoint(folder)[0] is not None)


def plan_attempt(out, publish, due, now):
  """What the due run's attempt is: {"kind": start | resume | restart, ...}
  by the page's rule (`now`: this host's identity)."""
  name = confirm.folder_name(due)
  folder = os.path.join(out, name)
  stops = [r for r in confirm.partway_rows(publish) if r.get("run") == name]
  if os.path.isdir(folder) and _started(folder):
    record = runs.RunFolder(folder).read_json(runs.HOST_FILE) or {}
    attempts = record.get("attempts") or []
    if not attempts:
      return {"kind": "restart", "reason": f"{folder}/host.json records no attempt"}
    why = differs(attempts[0]["identity"], now)
    if why is None:
      step, paths = newest_checkpoint(folder)
      return {"kind": "resume", "from_step": step,
              "from_digest": digest(paths) if paths else None}
    return {"kind": "restart", "reason": f"the host identity differs from the first "
            f"attempt's ({why})"}
  if stops:
    return {"kind": "restart", "reason": f"{folder} is gone (its part-way state of "
            f"step {stops[-1].get('step')} is committed)"}
  return {"kind": "start"}


def set_aside(out, name):
  """Moves a restarted run's folder (and log) under out/lost/, never deleting."""
  lost = os.path.join(out, LOST_FOLDER)
  os.makedirs(lost, exist_ok=True)
  k = 1
  while os.path.exists(os.path.join(lost, f"{name}.attempt{k}")):
    k += 1
  target = os.path.join(lost, f"{name}.attempt{k}")
  shutil.move(os.path.join(out, name), target)
  if os.path.exists(os.path.join(out, name + ".log")):
    shutil.move(os.path.join(out, name + ".log"), target + ".log")
  return target


def record_attempt(folder, attempt, lost=()):
  """Adds the attempt to host.json: {"started", "resumed" (as every run's),
  "attempts": [...], "lost": [the attempts of restarted folders]}."""
  run = runs.RunFolder(folder)
  record = run.read_json(runs.HOST_FILE) or {}
  facts = dict(host.describe(), commit=attempt["commit"])
  if "started" not in record:
    record = {"started": facts, "resumed": [], "attempts": [], "lost": list(lost)}
  elif facts not in [record["started"], *record["resumed"]]:
    record["resumed"].append(facts)
  record.setdefault("attempts", []).append(attempt)
  run.write_json(runs.HOST_FILE, record)


def update_record(folder, **fields):
  """Sets `fields` on host.json and on its last attempt's "end" where given."""
  run = runs.RunFolder(folder)
  record = run.read_json(runs.HOST_FILE)
  end = fields.pop("end", None)
  if end is not None:
    record["attempts"][-1]["end"] = end
  record.update(fields)
  run.write_json(runs.HOST_FILE, record)


class Children:
  """The one child process at a time (train.py or eval.py), in its own session,
  so that a stop signal reaches it exactly once: forwarded from here."""

  def __init__(self):
    self.proc, self.signum, self.listening = None, None, False

  def listen(self):
    """From the first child on, a stop signal is forwarded to it, not obeyed here."""
    if not self.listening:
      for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if signal.getsignal(s) is not signal.SIG_IGN:   # nohup's SIGHUP stays ignored
          signal.signal(s, self._stop)
      self.listening = True

  def _stop(self, signum, frame):
    del frame
    if self.signum is None:
      self.signum = signum
      if self.proc is not None and self.proc.poll() is None:
        self.proc.send_signal(signum)

  def run(self, cmd, log_path):
    self.listen()
    if self.signum is not None:
      return 128 + self.signum
    with open(log_path, "a") as log:
      self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                   cwd=grids.ROOT, start_new_session=True)
      try:
        return self.proc.wait()
      finally:
        self.proc = None


def last_error(log_path):
  """The log's last "train.py: error:" or other non-empty line."""
  try:
    with open(log_path, errors="replace") as f:
      lines = [line.strip() for line in f if line.strip()]
  except OSError:
    return ""
  errors = [line for line in lines if line.startswith("train.py: error:")]
  return (errors or lines or [""])[-1]


def score(children, folder, epoch):
  """The along_results.json entry of one kept epoch (test and affine sets)
  with the indices of the misclassified images; None if stopped."""
  ckpt = blocks.kept_checkpoint(folder, epoch)
  if ckpt is None:
    raise ConfirmError(f"{folder}: no checkpoint kept at the end of epoch {epoch}")
  entry = {"epoch": epoch, "step": runs.step_of(ckpt)}
  for split in confirm.CONFIRM.test_sets:
    out_dir = os.path.join(folder, f"along_epoch{epoch}_{split}")
    rc = children.run(grids.eval_command(ckpt, out_dir, f"--split={split}"), folder + ".log")
    if children.signum is not None:
      return None
    if rc:
      raise ConfirmError(f"eval.py --split={split} on {ckpt} failed (exit {rc}); see "
                         f"{folder}.log")
    evaluated = runs.EvalFolder(out_dir)
    res, pred = evaluated.results(), evaluated.predictions()
    entry[split] = {k: res[k] for k in ("count", "error_percent", "margin_loss_mean",
                                        "routing_entropy", "routing_max_c") if k in res}
    entry[split]["wrong"] = [i for i, y, p in zip(pred["index"], pred["label"],
                                                  pred["prediction"], strict=True) if y != p]
  return entry


def write_partway(publish, folder, name, why):
  """Appends the part-way state of a stopped run to the published part-way
  file (committed at the sitting's end) and to its attempt."""
  step, paths = newest_checkpoint(folder)
  row = {"run": name, "time": _now(), "why": why, "step": step,
         "checkpoint": os.path.relpath(paths[0], folder).rsplit(".", 1)[0] if paths else None,
         "digest": digest(paths) if paths else None,
         "scored": sorted(int(e) for e in blocks.scored(folder)),
         "attempt": len((runs.RunFolder(folder).read_json(runs.HOST_FILE) or {})
                        .get("attempts", [])),
         "identity": identity(), "plan": plan_of(folder)}
  os.makedirs(publish, exist_ok=True)
  files.append_jsonl(os.path.join(publish, confirm.PARTWAY_FILE), row)
  update_record(folder, end={"time": row["time"], "why": why, "step": step},
                plan=plan_of(folder))
  return row


def plan_of(folder):
  """The run's convolution plan (config.json), or None before it is written."""
  return ((runs.RunFolder(folder).config() or {}).get("model") or {}).get("conv_plan")


def run_due(children, out, publish, commit, settings, extra, restart=False):
  """Runs (starts, resumes or restarts) the due run to its end and publishes
  it. Returns: the run's name and its outcome, or None with the exit status if
  it stopped part-way."""
  done, due = confirm.progress(publish)
  check_turn(publish, out, due)
  seed, variant = due
  name = confirm.folder_name((seed, variant))
  folder = os.path.join(out, name)
  now = identity()
  attempt = plan_attempt(out, publish, due, now)
  lost = []
  if attempt["kind"] == "restart" and not restart:
    raise ConfirmError(f"{name}: {attempt['reason']}: by the rule it is run again whole, "
                       "from its start, in a fresh folder: pass --restart to do that (the "
                       f"old folder is kept in {out}/{LOST_FOLDER}/)")
  if attempt["kind"] == "restart":
    if os.path.isdir(folder):
      previous = runs.RunFolder(folder).read_json(runs.HOST_FILE) or {}
      lost = previous.get("lost", []) + [dict(a, folder=set_aside(out, name))
                                         for a in previous.get("attempts", [])]
    else:
      lost = [dict(r, lost="folder gone") for r in confirm.partway_rows(publish)
              if r.get("run") == name]
  attempt.update(commit=commit, checked=checked(), identity=now, time=_now(),
                 position=len(done) + 1)
  os.makedirs(folder, exist_ok=True)
  record_attempt(folder, attempt, lost)
  print(f"confirm: run {len(done) + 1} of {len(confirm.sequence())}, {name}: {attempt['kind']}"
        + (f" ({attempt['reason']})" if "reason" in attempt else ""), flush=True)
  outcome = None
  if not study_report.is_complete(folder, settings["epochs"]):
    cmd = grids.train_command(confirm.CONFIRM.variants[variant], seed, folder, settings,
                              [f"--keep_epochs={','.join(map(str, settings['kept']))}",
                               *extra])
    rc = children.run(cmd, folder + ".log")
    if children.signum is not None:
      write_partway(publish, folder, name, f"stopped by {signal.Signals(children.signum).name}")
      return name, None, 128 + children.signum
    if rc:
      line = last_error(folder + ".log")
      if not line.startswith(MODEL_FAILURE):
        write_partway(publish, folder, name, f"train.py exit {rc}")
        raise ConfirmError(f"{name}: train.py failed (exit {rc}: {line}); not an outcome "
                           "of the model: mend the machine and run the command again")
      outcome = f"failed: {line[len('train.py: error: '):]}"
  results = blocks.scored(folder)
  kept = [e for e in settings["kept"] if outcome is None or blocks.kept_checkpoint(folder, e)]
  for epoch in kept:
    if str(epoch) not in results:
      print(f"confirm: {name}: scoring the weights of epoch {epoch}", flush=True)
      entry = score(children, folder, epoch)
      if entry is None:
        write_partway(publish, folder, name,
                      f"stopped by {signal.Signals(children.signum).name} while scoring")
        return name, None, 128 + children.signum
      results[str(epoch)] = entry
      runs.RunFolder(folder).write_json(blocks.RESULTS_FILE, results)
  update_record(folder, outcome=outcome or "completed", plan=plan_of(folder),
                end={"time": _now(), "why": "ended", "step": newest_checkpoint(folder)[0]})
  runs.RunFolder(folder).copy_small_files(os.path.join(publish, name), blocks.SMALL_FILES)
  return name, outcome or "completed", 0


def run_sequence(out, publish, settings, extra, count, restart=False):
  """Runs up to `count` runs of the sequence (None: all that remain) after the
  checks; `restart`: a due run the rule restarts is restarted (else refused).
  Returns the exit status (0, or 128 + a stop signal's number)."""
  if checked():
    commit = check_code(grids.ROOT)
    check_environment(os.path.join(grids.ROOT, LOCK))
  else:
    commit = grids.commit()
  if os.path.abspath(out) == os.path.abspath(publish):
    raise ConfirmError(f"--out={out}: the same folder as --publish (expected the runs' "
                       "own folder, checkpoints included, apart from the published copy)")
  children = Children()
  ran = 0
  while count is None or ran < count:
    if confirm.progress(publish)[1] is None:
      print(f"confirm: the sequence is complete ({len(confirm.sequence())} runs)")
      break
    name, outcome, status = run_due(children, out, publish, commit, settings, extra,
                                    restart)
    restart = False   # only the run due now
    if outcome is None:
      print(f"confirm: {name} stopped part-way; its state is in {publish}/{confirm.PARTWAY_FILE} "
            "(commit it); the same command resumes it", flush=True)
      return status
    print(f"confirm: {name}: {outcome}, published in {publish}/{name}", flush=True)
    ran += 1
  return 0
