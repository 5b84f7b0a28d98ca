"""A registered protocol's runs, read from its declaration (`protocols.Protocol`
with a lock file; docs/studies.md): the sequence of its runs, the checks that
keep every attempt on the registration's code and environment, each attempt's
host identity, the rule that resumes a run on the same host identity and
restarts it whole otherwise, a stopped run's part-way state, each run's
scorings (with the indices of the misclassified images) published as it ends,
one reader of a run's attempt history, the audit of the published runs, and
the progress report while blocks are missing. The confirmatory test
(docs/confirm.md) is one such declaration; `python -m capsnet.confirm`."""
import dataclasses
import datetime
import hashlib
import importlib.metadata
import itertools
import os
import platform
import re
import shutil
import signal
import subprocess

import numpy as np

from capsnet.data import tasks
from capsnet.running import files
from capsnet.running import host
from capsnet.running import runs
from capsnet.running import schedule
from capsnet.science import blocks
from capsnet.science import grids
from capsnet.science import report as study_report

PARTWAY_FILE = "partway.jsonl"   # published: one row each time a run stops part-way
IDENTITY = ("cpu", "cpu_id", "flags", "cores", "python", "tensorflow", "numpy", "onednn")
LOST_FOLDER = "lost"             # in --out: the folders of restarted runs, kept
# In --publish, once the sequence is complete: the report the registration's
# own code made of it (docs/confirm.md's registered answer), with its README.
REGISTERED_FOLDER = "registered"
# Tests only: skips the code and environment checks; every attempt records it
# ("checked": false) and the audit refuses such a run.
UNCHECKED = "CAPSNET_CONFIRM_UNCHECKED"
KILLED = "killed: no end recorded"   # an attempt another followed, with no end
MODEL_FAILURE = "train.py: error: loss is "   # a non-finite loss: an outcome
NOT_LOCKED = ("pip", "setuptools", "wheel", "distribute")   # pip freeze leaves them out
RESULTS_LINE = "\n---\n\n## Results"   # nothing above it on the page changes


class RegisteredError(Exception):
  """A refusal or a fault, in one line."""


# The sequence: each block's runs, the variants in one of their orders, the
# orders spread evenly over the blocks by a shuffle with the registered seed.

def orders(protocol):
  """Every order of the protocol's variants."""
  return list(itertools.permutations(protocol.variants))


def order_table(protocol):
  """{seed: order}: each order used equally often over the blocks, the
  remainder's extra uses drawn, then shuffled over the blocks; numpy's
  default_rng(the rule's order_seed). (Sixteen blocks of three variants: four
  orders used three times, two twice.)"""
  rng = np.random.default_rng(protocol.rule["order_seed"])
  every, n = orders(protocol), len(protocol.seeds)
  extra = set(rng.permutation(len(every))[:n % len(every)].tolist())
  pool = [k for k in range(len(every)) for _ in range(n // len(every) + (k in extra))]
  assigned = rng.permutation(pool).tolist()
  return {seed: every[k] for seed, k in zip(protocol.seeds, assigned, strict=True)}


def sequence(protocol):
  """The runs in their registered order: [(seed, variant)]."""
  return [(seed, v) for seed, order in order_table(protocol).items() for v in order]


def table_lines(protocol):
  """The order table as the protocol's page prints it."""
  places = ("first", "second", "third", "fourth", "fifth", "sixth")[:len(protocol.variants)]
  return study_report.table(["block (seed)", *places], [
      [seed, *(f"`{v}`" for v in order)] for seed, order in order_table(protocol).items()])


def folder_name(run):
  """The folder of a run of the sequence, (seed, variant)."""
  seed, variant = run
  return study_report.run_name(variant, seed)


# What is published: each ended run's small files, the part-way states.

def partway_rows(publish):
  """The committed part-way states, oldest first. Raises RunError on a
  damaged file."""
  return runs.read_jsonl(os.path.join(publish, PARTWAY_FILE))


def step_text(step):
  """A recorded step as the reports write it: "unknown" where a run stopped
  before its first checkpoint."""
  return "unknown" if step is None else str(step)


@dataclasses.dataclass(frozen=True)
class History:
  """A run's attempts as its host.json records them: the one reader of it.
  `attempts` and `lost` (the attempts of restarted folders, or the committed
  stops of a folder that was lost) are the recorded dicts, oldest first."""
  attempts: tuple
  lost: tuple
  outcome: object     # "completed", "failed: ...", or None before the end
  started: dict       # the host the run started on

  @classmethod
  def read(cls, folder):
    """The history in `folder`'s host.json (empty where there is none).
    Raises RunError naming a damaged file."""
    record = runs.RunFolder(folder).read_json(runs.HOST_FILE) or {}
    return cls(tuple(record.get("attempts") or ()), tuple(record.get("lost") or ()),
               record.get("outcome"), record.get("started") or {})

  def killed(self, k):
    """Whether attempt k (0-based), one another followed, was killed: it
    recorded no end (nor, then, a part-way state)."""
    return k < len(self.attempts) - 1 and "end" not in self.attempts[k]

  def kinds(self):
    """[(kind, reason or "")] of every attempt, lost ones first (as "lost",
    with where they ended and where their folder went); a killed one says so."""
    lost = []
    for a in self.lost:
      step, why, where = self.lost_end(a)
      lost.append(("lost", f"at step {step_text(step)}: {why}; {where}"))
    return lost + [(a.get("kind", "?"), a.get("reason") or (KILLED if self.killed(k) else ""))
                   for k, a in enumerate(self.attempts)]

  @staticmethod
  def lost_end(lost):
    """(step, why it ended, where its folder went) of a lost attempt, in
    either shape `lost` holds: a committed part-way state whose folder was
    gone ("lost": "folder gone"), or the attempt of a folder the restart set
    aside (its "end" and "folder")."""
    if "folder" in lost:
      end = lost.get("end") or {}
      return (end.get("step"), end.get("why", KILLED),
              f"folder set aside in {lost['folder']}")
    return lost.get("step"), lost.get("why", "?"), lost.get("lost", "?")

  def resumes(self):
    """[(the attempt before, the resume)] of every resume."""
    return [(before, now) for before, now in itertools.pairwise(self.attempts)]


def ended(folder):
  """The run's recorded outcome ("completed" or "failed: ..."), or None."""
  return History.read(folder).outcome


def progress(protocol, publish):
  """(the runs of the sequence ended and published, in order; the next due,
  or None once all have ended)."""
  done = []
  for run in sequence(protocol):
    if ended(os.path.join(publish, folder_name(run))) is None:
      return done, run
    done.append(run)
  return done, None


def host_kind(facts):
  """A machine as the reports name it and group blocks: its CPU's name and
  family and model (`facts`: a host.json's "started" or an attempt's
  identity; older runs: the widest vector instructions)."""
  facts = facts or {}
  extra = facts.get("cpu_id") or ("AVX-512" if "avx512f" in facts.get("flags", [])
                                    else "AVX2")
  return f"{facts.get('cpu', 'unknown CPU')}, {extra}"


# The checks: the registration's code and environment, this host's identity.

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
    raise RegisteredError(f"{path}: cannot read ({e.strerror})") from None
  for line in lines:
    if line.startswith("# python "):
      python = line.split()[2]
    elif line.strip() and not line.startswith("#"):
      name, sep, version = line.strip().partition("==")
      if not sep:
        raise RegisteredError(f"{path}: {line!r}: expected name==version")
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


def check_environment(lock, root, python=None, found=None):
  """Raises RegisteredError naming the first difference between this
  environment and the lock file `lock` (relative to `root`)."""
  locked_python, pins = read_lock(os.path.join(root, lock))
  python = python or platform.python_version()
  found = installed() if found is None else found
  build = f"(build it: python3 -m venv ENV && ENV/bin/pip install -r {lock})"
  if locked_python != python:
    raise RegisteredError(f"Python {python}, the lock file has {locked_python} {build}")
  for name in sorted(set(pins) | set(found)):
    if pins.get(name) != found.get(name):
      raise RegisteredError(f"{name} {found.get(name) or 'not installed'} here, "
                            f"{pins.get(name) or 'not'} in {lock} {build}")


def _git(root, *args):
  return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                        check=True).stdout


def registration_commit(root, lock):
  """The commit that adds the lock file, or None."""
  try:
    found = _git(root, "log", "--diff-filter=A", "--format=%H", "--", lock).split()
  except (OSError, subprocess.CalledProcessError):
    return None
  return found[-1] if found else None


def check_code(root, lock):
  """The registration commit; raises RegisteredError unless `root` is a clean
  checkout at it."""
  registered = registration_commit(root, lock)
  if registered is None:
    raise RegisteredError(f"{root}: no git history that adds {lock} (expected a checkout "
                          "of the repository at the registration commit)")
  head = _git(root, "rev-parse", "HEAD").strip()
  if head != registered:
    raise RegisteredError(f"{root} is at {head[:12]}, the registration is "
                          f"{registered[:12]}: run from a checkout at it (the protocol's "
                          "page, Commands)")
  dirty = _git(root, "status", "--porcelain").splitlines()
  if dirty:
    raise RegisteredError(f"{root} has changes ({dirty[0].strip()}): the registration's "
                          "code is run as committed")
  return registered


def checked():
  return os.environ.get(UNCHECKED) != "1"


def check_turn(protocol, publish, out, due):
  """Raises RegisteredError if a run after `due` is published, or part-way
  in `out`: the sequence is taken in order."""
  order = sequence(protocol)
  for run in order[order.index(due) + 1:] if due else []:
    name = folder_name(run)
    if os.path.exists(os.path.join(publish, name)):
      raise RegisteredError(f"{publish}/{name}: published out of turn, "
                            f"{folder_name(due)} is due")
    if os.path.exists(os.path.join(out, name)):
      raise RegisteredError(f"{out}/{name}: out of turn, {folder_name(due)} is due (the "
                            "registered sequence)")


# A run's state on disk: its newest checkpoint, the rule's attempt.

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
  by the rule (`now`: this host's identity)."""
  name = folder_name(due)
  folder = os.path.join(out, name)
  stops = [r for r in partway_rows(publish) if r.get("run") == name]
  if os.path.isdir(folder) and _started(folder):
    attempts = History.read(folder).attempts
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

  def call(self, cmd, folder):
    """`run`s `cmd` (eval.py) with <folder>.log: True, or False if stopped.
    Raises RegisteredError if it fails."""
    rc = self.run(cmd, folder + ".log")
    if self.signum is not None:
      return False
    if rc:
      raise RegisteredError(grids.failed(cmd, rc, folder + ".log"))
    return True


def last_error(log_path):
  """The log's last "train.py: error:" or other non-empty line."""
  try:
    with open(log_path, errors="replace") as f:
      lines = [line.strip() for line in f if line.strip()]
  except OSError:
    return ""
  errors = [line for line in lines if line.startswith("train.py: error:")]
  return (errors or lines or [""])[-1]


def plan_of(folder):
  """The run's convolution plan (config.json), or None before it is written."""
  return ((runs.RunFolder(folder).config() or {}).get("model") or {}).get("conv_plan")


def write_partway(publish, folder, name, why):
  """Appends the part-way state of a stopped run to the published part-way
  file (committed at the sitting's end) and to its attempt."""
  step, paths = newest_checkpoint(folder)
  row = {"run": name, "time": _now(), "why": why, "step": step,
         "checkpoint": os.path.relpath(paths[0], folder).rsplit(".", 1)[0] if paths else None,
         "digest": digest(paths) if paths else None,
         "scored": sorted(int(e) for e in blocks.scored(folder)),
         "attempt": len(History.read(folder).attempts),
         "identity": identity(), "plan": plan_of(folder)}
  os.makedirs(publish, exist_ok=True)
  files.append_jsonl(os.path.join(publish, PARTWAY_FILE), row)
  update_record(folder, end={"time": row["time"], "why": why, "step": step},
                plan=plan_of(folder))
  return row


# The runner.

def run_due(protocol, children, out, publish, commit, extra, restart=False):
  """Runs (starts, resumes or restarts) the due run to its end and publishes
  it. Returns: (its name, its outcome or None if it stopped part-way, the exit
  status)."""
  settings = blocks.settings(protocol)
  done, due = progress(protocol, publish)
  check_turn(protocol, publish, out, due)
  seed, variant = due
  name = folder_name(due)
  folder = os.path.join(out, name)
  now = identity()
  attempt = plan_attempt(out, publish, due, now)
  lost = []
  if attempt["kind"] == "restart" and not restart:
    kept = f" (the old folder is kept in {out}/{LOST_FOLDER}/)" if os.path.isdir(folder) else ""
    raise RegisteredError(f"{name}: {attempt['reason']}: by the rule it is run again "
                          "whole, from its start, in a fresh folder: pass --restart to do "
                          f"that{kept}")
  if attempt["kind"] == "restart":
    if os.path.isdir(folder):
      previous = History.read(folder)
      lost = list(previous.lost) + [dict(a, folder=set_aside(out, name))
                                    for a in previous.attempts]
    else:
      lost = [dict(r, lost="folder gone") for r in partway_rows(publish)
              if r.get("run") == name]
  attempt.update(commit=commit, checked=checked(), identity=now, time=_now(),
                 position=len(done) + 1)
  os.makedirs(folder, exist_ok=True)
  record_attempt(folder, attempt, lost)
  print(f"{protocol.name}: run {len(done) + 1} of {len(sequence(protocol))}, {name}: "
        f"{attempt['kind']}" + (f" ({attempt['reason']})" if "reason" in attempt else ""),
        flush=True)
  outcome = None
  if not study_report.is_complete(folder, settings["epochs"]):
    cmd = grids.train_command(protocol.variants[variant], seed, folder, settings,
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
        raise RegisteredError(f"{name}: train.py failed (exit {rc}: {line}); not an outcome "
                              "of the model: mend the machine and run the command again")
      outcome = f"failed: {line[len('train.py: error: '):]}"
  kept = [e for e in settings["kept"] if outcome is None or blocks.kept_checkpoint(folder, e)]
  if not blocks.score_kept(folder, kept, protocol, lambda cmd: children.call(cmd, folder),
                           f"{protocol.name}: {name}"):
    write_partway(publish, folder, name,
                  f"stopped by {signal.Signals(children.signum).name} while scoring")
    return name, None, 128 + children.signum
  update_record(folder, outcome=outcome or "completed", plan=plan_of(folder),
                end={"time": _now(), "why": "ended", "step": newest_checkpoint(folder)[0]})
  runs.RunFolder(folder).copy_small_files(os.path.join(publish, name), blocks.SMALL_FILES)
  return name, outcome or "completed", 0


def run_sequence(protocol, out, publish, extra, count, restart=False):
  """Runs up to `count` runs of the sequence (None: all that remain) after the
  checks; `restart`: a due run the rule restarts is restarted (else refused).
  Returns the exit status (0, or 128 + a stop signal's number)."""
  if checked():
    commit = check_code(grids.ROOT, protocol.lock)
    check_environment(protocol.lock, grids.ROOT)
  else:
    commit = grids.commit()
  if os.path.abspath(out) == os.path.abspath(publish):
    raise RegisteredError(f"--out={out}: the same folder as --publish (expected the runs' "
                          "own folder, checkpoints included, apart from the published copy)")
  children = Children()
  ran = 0
  while count is None or ran < count:
    if progress(protocol, publish)[1] is None:
      print(f"{protocol.name}: the sequence is complete ({len(sequence(protocol))} runs)")
      break
    name, outcome, status = run_due(protocol, children, out, publish, commit, extra, restart)
    restart = False   # only the run due now
    if outcome is None:
      print(f"{protocol.name}: {name} stopped part-way; its state is in "
            f"{publish}/{PARTWAY_FILE} (commit it); the same command resumes it", flush=True)
      return status
    print(f"{protocol.name}: {name}: {outcome}, published in {publish}/{name}", flush=True)
    ran += 1
  return 0


# The audit: the published runs against the registration.

# The model's fields that may differ from the pilot's run of the variant: the
# precision (checked apart), how its convolutions are computed (rounding only).
NOT_LAYERS = ("precision", "conv_impl", "conv_plan")


def registered_settings(protocol, variant, seed, config):
  """({model field: value}, {train field: value}) a run of the protocol must
  record in config.json: the pilot's layers (where it has one: the paper's
  layers as the pilot trained them), the variant's flags and the
  declaration's run flags (each in the section of `config` that records it;
  one recorded in neither is not checked), its precision, seed, epochs and
  schedule, else the trainer's defaults."""
  model = {}
  if protocol.pilot:
    pilot = runs.RunFolder(study_report.run_dir(
        os.path.join(grids.ROOT, "study", protocol.pilot), variant, 0)).config() or {}
    model.update({k: v for k, v in pilot.get("model", {}).items() if k not in NOT_LAYERS})
  model.update(protocol.variants[variant])
  train = {"dataset": protocol.task, "val_size": tasks.VAL_SIZE, "train_size": 0,
           "batch_size": schedule.BATCH_SIZE, "learning_rate": schedule.LEARNING_RATE,
           "decay_steps": protocol.decay_steps, "decay_rate": schedule.DECAY_RATE,
           "epochs": protocol.epochs, "ema_decay": 0.0, "workers": 1}
  for key, value in protocol.run_flags.items():
    if key in config.get("model", {}):
      model[key] = value
    elif key in config.get("train", {}):
      train[key] = value
  return dict(model, precision=protocol.precision), dict(seed=seed, **train)


def audit(protocol, publish, registered, page=None, registered_page=None):
  """The breaches of the published runs in `publish` against the registration
  (`registered`: its commit; `page`: the protocol's page now, for the order
  table; `registered_page`: its text at the registration), one line each; []
  when there is none."""
  breaches = []
  if page is not None and "\n".join(table_lines(protocol)) not in page:
    breaches.append(f"docs/{protocol.name}.md: the order table is not the registered "
                    "shuffle's")
  if page is not None and registered_page is not None and (
      page.split(RESULTS_LINE)[0] != registered_page.split(RESULTS_LINE)[0]):
    breaches.append(f"docs/{protocol.name}.md: changed above its results line since the "
                    "registration")
  try:   # a damaged record is named in one line; nothing past it can be read
    stops = partway_rows(publish)
    done, due = progress(protocol, publish)
  except runs.RunError as e:
    return breaches + [str(e)]
  names = {folder_name(r): r for r in sequence(protocol)}
  present = sorted(n for n in os.listdir(publish) if os.path.isdir(os.path.join(publish, n))
                   ) if os.path.isdir(publish) else []
  in_order = [folder_name(r) for r in done]
  for name in present:
    if name == REGISTERED_FOLDER:
      if due is not None:
        breaches.append(f"{name}: the registration's report before the sequence is "
                        f"complete (next due: {folder_name(due)})")
    elif name not in names:
      breaches.append(f"{name}: not a run of the registered sequence")
    elif name not in in_order:
      breaches.append(f"{name}: published out of turn (the sequence's next due is "
                      f"{folder_name(due) if due else 'none'})")
  for row in stops:
    if row.get("run") not in names:
      breaches.append(f"{PARTWAY_FILE}: a stop of {row.get('run')!r}, not a run of "
                      "the sequence")
  for name in in_order:
    seed, variant = names[name]
    run_stops = [r for r in stops if r.get("run") == name]
    breaches += [f"{name}: {b}" for b in _run_breaches(
        protocol, os.path.join(publish, name), seed, variant, registered, run_stops)]
  return breaches


def _run_breaches(protocol, folder, seed, variant, registered, stops):
  run = runs.RunFolder(folder)
  out = []
  try:
    history = History.read(folder)
    config = run.config() or {}
    results = run.read_json(blocks.RESULTS_FILE) or {}
    epochs = {r["epoch"]: r for r in run.metrics("epoch")}
  except runs.RunError as e:
    return [str(e)]
  attempts = history.attempts
  if not attempts:
    return ["host.json records no attempt"]
  for k, a in enumerate(attempts, 1):
    if a.get("commit") != registered:
      out.append(f"attempt {k} ran from {a.get('commit')}, not the registration "
                 f"{registered}")
    if a.get("checked") is not True:
      out.append(f"attempt {k} ran unchecked (code and environment not checked)")
    missing = [f for f in IDENTITY if f not in (a.get("identity") or {})]
    if missing:
      out.append(f"attempt {k} lacks its host identity's {', '.join(missing)}")
  first = attempts[0]
  if first.get("kind") not in ("start", "restart"):
    out.append(f"attempt 1 is a {first.get('kind')}, expected a start or a restart")
  if first.get("kind") == "restart" and not history.lost:
    out.append("a restart with no lost attempt recorded")
  for k, a in enumerate(attempts[1:], 2):
    if a.get("kind") != "resume":
      out.append(f"attempt {k} is a {a.get('kind')}, expected a resume")
    elif differs(first.get("identity") or {}, a.get("identity") or {}):
      out.append(f"attempt {k} resumed on another host identity "
                 f"({differs(first['identity'], a['identity'])})")
  # Every committed stop is either resumed from, exactly, or lost with a restart;
  # a stop the command recorded (its attempt's end) has its state committed. An
  # attempt with no end was killed (nothing could be recorded): its resume, on the
  # same host identity, is the page's resume of a killed run, listed as such.
  resumes = [(a.get("from_step"), a.get("from_digest")) for a in attempts[1:]]
  lost = [(r.get("step"), r.get("digest")) for r in history.lost]
  for k, (step, digest_) in enumerate(resumes, 2):
    if not history.killed(k - 2) and not any(
        (r.get("step"), r.get("digest")) == (step, digest_) for r in stops):
      out.append(f"attempt {k} resumed from step {step} ({str(digest_)[:12]}), not a "
                 "committed part-way state")
  for r in stops:
    state = (r.get("step"), r.get("digest"))
    if state not in resumes and state not in lost:
      out.append(f"the part-way state of step {r.get('step')} ({str(r.get('digest'))[:12]}) "
                 "is neither resumed nor listed as lost")
  model, train = registered_settings(protocol, variant, seed, config)
  for section, expected in (("model", model), ("train", train)):
    for key, value in expected.items():
      found = config.get(section, {}).get(key)
      if found != (list(value) if isinstance(value, tuple) else value):
        out.append(f"config.json has {key}={found!r}, registered {value!r}")
  outcome = history.outcome
  failed = isinstance(outcome, str) and outcome.startswith("failed")
  if outcome != "completed" and not failed:
    out.append(f"outcome {outcome!r}, expected completed or failed")
  last, kept = protocol.epochs, protocol.kept
  if not failed and sorted(epochs) != list(range(1, last + 1)):
    out.append(f"metrics.jsonl has epochs {sorted(epochs)}, expected 1 to {last}")
  expected = [e for e in kept if e in epochs] if failed else list(kept)
  if sorted(int(e) for e in results) != expected:
    out.append(f"scored epochs {sorted(int(e) for e in results)}, expected {expected}")
  for epoch in expected:
    entry = results.get(str(epoch), {})
    if epoch in epochs and entry.get("step") != epochs[epoch]["step"]:
      out.append(f"epoch {epoch} scored at step {entry.get('step')}, its end is step "
                 f"{epochs[epoch]['step']}")
    for split in protocol.test_sets:
      scored, count = entry.get(split), protocol.test_size
      if not scored:
        out.append(f"epoch {epoch}: no {split} scoring")
      elif scored.get("count") != count or "wrong" not in scored or len(scored["wrong"]) != \
          round(scored["error_percent"] * scored["count"] / 100):
        out.append(f"epoch {epoch}: the {split} scoring is not of {count:,} images with the "
                   "indices of its misclassified ones")
  return out


# The progress report, while blocks are missing: no figure of the question.

def progress_report(protocol, out, complete, folder):
  """The interim report: the runs done, the blocks complete, each run's host
  and attempts (resumes, restarts) and the part-way states; no figure of the
  question. Writes results.md and results.json (and removes a picture) into
  `folder`; returns the markdown."""
  done, due = progress(protocol, out)
  stops = partway_rows(out)
  rows, payload_runs = [], []
  for position, run in enumerate(sequence(protocol), 1):
    name = folder_name(run)
    own = [r for r in stops if r.get("run") == name]
    if run in done:
      history = History.read(os.path.join(out, name))
      state, started, kinds = history.outcome, history.started, history.kinds()
    elif run == due and own:
      # not published yet: its newest stop says where it stands and on what host
      step = own[-1].get("step")
      state = f"part-way (step {step_text(step)})"
      started = own[-1].get("identity")
      kinds = [("stop", r.get("why", "")) for r in own]
    else:
      continue
    rows.append([position, name, state, host_kind(started),
                 ", ".join(k + (f" ({why})" if why else "") for k, why in kinds)])
    payload_runs.append({"run": name, "variant": run[1], "seed": run[0],
                         "position": position, "state": state, "host": host_kind(started),
                         "attempts": [list(k) for k in kinds]})
  n_done, n_runs = len(done), len(sequence(protocol))
  lines = [f"# {protocol.title}: interim, {n_done} of {n_runs} runs, {len(complete)} of "
           f"{len(protocol.seeds)} blocks complete", "",
           "Progress only: no difference and no interval is shown until all "
           f"{study_report.in_words(len(protocol.seeds))} blocks are in "
           f"(docs/{protocol.name}.md).", "",
           f"Next due: {folder_name(due) if due else 'none'}. Part-way stops recorded: "
           f"{len(stops)}.", ""]
  lines += study_report.table(["#", "run", "state", "host", "attempts"], rows)
  text = "\n".join(lines) + "\n"
  study_report.write_results(folder, text, protocol, False, payload_runs, (), {
      "runs_done": n_done, "blocks_complete": complete, "partway_stops": len(stops),
      "next_due": folder_name(due) if due else None})
  picture = os.path.join(folder, f"{protocol.name}.png")
  if os.path.exists(picture):
    os.remove(picture)
  return text
