"""The confirmatory protocol's self-audit (docs/confirm.md): the published
runs checked against the registration. `python -m capsnet.confirm --audit`."""
import os

from capsnet.data import tasks
from capsnet.running import runs
from capsnet.running import schedule
from capsnet.science import blocks
from capsnet.science import confirm
from capsnet.science import confirm_run
from capsnet.science import report as study_report

# The train.py settings every run records (config.json) as the protocol fixes
# them: its own declaration, else the trainer's defaults.
REGISTERED = {"dataset": confirm.CONFIRM.task, "val_size": tasks.VAL_SIZE, "train_size": 0,
              "batch_size": schedule.BATCH_SIZE, "learning_rate": schedule.LEARNING_RATE,
              "decay_steps": confirm.CONFIRM.decay_steps, "decay_rate": schedule.DECAY_RATE,
              "epochs": confirm.CONFIRM.epochs, "ema_decay": 0.0, "workers": 1}


# The model's fields that may differ from the pilot's run of the variant: the
# precision (checked apart), how its convolutions are computed (rounding only).
NOT_LAYERS = ("precision", "conv_impl", "conv_plan")


def _paper_layers(variant):
  """The pilot's (study/along, seed 0) model fields of the variant: the
  paper's layers as the protocol trains them."""
  pilot = runs.RunFolder(study_report.run_dir(confirm.PILOT, variant, 0)).config()
  return {k: v for k, v in (pilot or {}).get("model", {}).items() if k not in NOT_LAYERS}


RESULTS_LINE = "\n---\n\n## Results"   # nothing above it changes after the registration


def audit(publish, registered, page=None, registered_page=None):
  """The breaches of the published runs in `publish` against the registration
  (`registered`: its commit; `page`: docs/confirm.md's text now, for the order
  table; `registered_page`: its text at the registration), one line each; []
  when there is none."""
  breaches = []
  if page is not None and "\n".join(confirm.table_lines()) not in page:
    breaches.append("docs/confirm.md: the order table is not the registered shuffle's")
  if page is not None and registered_page is not None and (
      page.split(RESULTS_LINE)[0] != registered_page.split(RESULTS_LINE)[0]):
    breaches.append("docs/confirm.md: changed above its results line since the registration")
  try:   # a damaged record is named in one line; nothing past it can be read
    stops = confirm.partway_rows(publish)
    done, due = confirm.progress(publish)
  except runs.RunError as e:
    return breaches + [str(e)]
  names = {confirm.folder_name(r): r for r in confirm.sequence()}
  present = sorted(n for n in os.listdir(publish) if os.path.isdir(os.path.join(publish, n))
                   ) if os.path.isdir(publish) else []
  in_order = [confirm.folder_name(r) for r in done]
  for name in present:
    if name not in names:
      breaches.append(f"{name}: not a run of the registered sequence")
    elif name not in in_order:
      breaches.append(f"{name}: published out of turn (the sequence's next due is "
                      f"{confirm.folder_name(due) if due else 'none'})")
  for row in stops:
    if row.get("run") not in names:
      breaches.append(f"{confirm.PARTWAY_FILE}: a stop of {row.get('run')!r}, not a run of "
                      "the sequence")
  for name in in_order:
    seed, variant = names[name]
    run_stops = [r for r in stops if r.get("run") == name]
    breaches += [f"{name}: {b}" for b in _run_breaches(os.path.join(publish, name), seed,
                                                         variant, registered, run_stops)]
  return breaches


def _run_breaches(folder, seed, variant, registered, stops):
  run = runs.RunFolder(folder)
  out = []
  try:
    record = run.read_json(runs.HOST_FILE) or {}
    config = run.config() or {}
    results = run.read_json(blocks.RESULTS_FILE) or {}
    epochs = {r["epoch"]: r for r in run.metrics("epoch")}
  except runs.RunError as e:
    return [str(e)]
  attempts = record.get("attempts") or []
  if not attempts:
    return ["host.json records no attempt"]
  for k, a in enumerate(attempts, 1):
    if a.get("commit") != registered:
      out.append(f"attempt {k} ran from {a.get('commit')}, not the registration "
                 f"{registered}")
    if a.get("checked") is not True:
      out.append(f"attempt {k} ran unchecked (code and environment not checked)")
    missing = [f for f in confirm_run.IDENTITY if f not in (a.get("identity") or {})]
    if missing:
      out.append(f"attempt {k} lacks its host identity's {', '.join(missing)}")
  first = attempts[0]
  if first.get("kind") not in ("start", "restart"):
    out.append(f"attempt 1 is a {first.get('kind')}, expected a start or a restart")
  if first.get("kind") == "restart" and not record.get("lost"):
    out.append("a restart with no lost attempt recorded")
  for k, a in enumerate(attempts[1:], 2):
    if a.get("kind") != "resume":
      out.append(f"attempt {k} is a {a.get('kind')}, expected a resume")
    elif confirm_run.differs(first.get("identity") or {}, a.get("identity") or {}):
      out.append(f"attempt {k} resumed on another host identity "
                 f"({confirm_run.differs(first['identity'], a['identity'])})")
  # Every committed stop is either resumed from, exactly, or lost with a restart;
  # a stop the command recorded (its attempt's end) has its state committed. An
  # attempt with no end was killed (nothing could be recorded): its resume, on the
  # same host identity, is the page's resume of a killed run, listed as such.
  resumes = [(a.get("from_step"), a.get("from_digest")) for a in attempts[1:]]
  lost = [(r.get("step"), r.get("digest")) for r in record.get("lost", [])]
  for k, (step, digest) in enumerate(resumes, 2):
    if not confirm.killed(attempts[k - 2]) and not any(
        (r.get("step"), r.get("digest")) == (step, digest) for r in stops):
      out.append(f"attempt {k} resumed from step {step} ({str(digest)[:12]}), not a "
                 "committed part-way state")
  for r in stops:
    state = (r.get("step"), r.get("digest"))
    if state not in resumes and state not in lost:
      out.append(f"the part-way state of step {r.get('step')} ({str(r.get('digest'))[:12]}) "
                 "is neither resumed nor listed as lost")
  model, train = config.get("model", {}), config.get("train", {})
  spec = dict(_paper_layers(variant), **confirm.CONFIRM.variants[variant])
  for key, value in [*spec.items(), ("precision", confirm.PRECISION)]:
    if model.get(key) != value:
      out.append(f"config.json has {key}={model.get(key)!r}, registered {value!r}")
  for key, value in [("seed", seed), *REGISTERED.items()]:
    if train.get(key) != value:
      out.append(f"config.json has {key}={train.get(key)!r}, registered {value!r}")
  outcome = record.get("outcome")
  failed = isinstance(outcome, str) and outcome.startswith("failed")
  if outcome != "completed" and not failed:
    out.append(f"outcome {outcome!r}, expected completed or failed")
  last, kept = confirm.CONFIRM.epochs, confirm.CONFIRM.kept
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
    for split in confirm.CONFIRM.test_sets:
      scored, count = entry.get(split), confirm.CONFIRM.test_size
      if not scored:
        out.append(f"epoch {epoch}: no {split} scoring")
      elif scored.get("count") != count or "wrong" not in scored or len(scored["wrong"]) != \
          round(scored["error_percent"] * scored["count"] / 100):
        out.append(f"epoch {epoch}: the {split} scoring is not of {count:,} images with the "
                   "indices of its misclassified ones")
  return out
