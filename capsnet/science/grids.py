"""The routing studies' machinery: grids and their variants, training and
scoring a run (train.py and eval.py as processes), a grid's run and report.
Command line: `python -m capsnet.study`; protocols: docs/table1.md,
docs/short.md."""
import collections
import os
import subprocess
import sys

from capsnet.data import tasks
from capsnet.running import host
from capsnet.running import runs
from capsnet.science import protocols
from capsnet.science import report

# The protocols whose runs are a grid of variants by seed (`capsnet.study`).
GRIDS = {name: protocols.PROTOCOLS[name]
         for name in ("stop_gradient", "table1", "short", "multimnist")}

AFFINE_SWEEP = tuple(range(0, 50, 5))   # the severity sweep's largest rotations

# The repository.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train_command(spec, seed, folder, settings, extra):
  """The train.py command of one run; `spec` holds the variant's flags,
  `settings` the run's epochs and other train.py flags (its kept epochs
  aside)."""
  def flag(key, value):
    return f"--{key}={','.join(map(str, value)) if isinstance(value, tuple) else value}"
  return [sys.executable, os.path.join(ROOT, "train.py"), *(flag(*f) for f in spec.items()),
          f"--seed={seed}", f"--epochs={settings['epochs']}", f"--logdir={folder}",
          *(flag(k, v) for k, v in settings.items() if k not in ("epochs", "kept")),
          "--progress=false", *extra]


def parse_pairs(specs, variants):
  """[(A, B)] from ["A:B", ...]; raises ValueError naming a bad entry."""
  pairs = []
  for spec in specs:
    names = spec.split(":")
    if len(names) != 2 or not all(n in variants for n in names) or names[0] == names[1]:
      raise ValueError(f"--compare={spec}: expected A:B, two different variants "
                       f"of {list(variants)}")
    pairs.append(tuple(names))
  return pairs


def run_one(spec, seed, folder, settings, extra):
  """Trains (or resumes) one run, its output in <folder>.log. Raises RunError
  if train.py fails."""
  print(f"{os.path.basename(folder)}: training in {folder}", flush=True)
  os.makedirs(folder, exist_ok=True)
  runs.RunFolder(folder).record_host(dict(host.describe(), commit=commit()))
  call(train_command(spec, seed, folder, settings, extra), folder + ".log")


def call(cmd, log_path):
  """Runs `cmd` (train.py or eval.py and its flags) in the repository, its
  output appended to `log_path`. Returns True; raises RunError naming the
  program and the log if it fails."""
  with open(log_path, "a") as log:
    rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
  if rc:
    raise runs.RunError(failed(cmd, rc, log_path))
  return True


def failed(cmd, rc, log_path):
  """The one line that names a failed program, its first flags and its log."""
  return f"{os.path.basename(cmd[1])} {' '.join(cmd[2:4])} failed (exit {rc}); see {log_path}"


def commit():
  """The work tree's commit (with "+changes" if it differs), or None."""
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None
  return head + ("+changes" if dirty else "")


def other_routing(iter_routing):
  """The routing count a run is also evaluated with: 1 (uniform couplings)
  for a model trained with r > 1, 3 for one trained with r = 1."""
  return 1 if iter_routing > 1 else 3


def measure_routing(folder, iter_routing):
  """routing.json of a finished run: eval.py on its best checkpoint on the test
  set, with its own routing count and `other_routing` (`routing_summary`). Raises
  if eval.py fails."""
  results = {}
  for r in (iter_routing, other_routing(iter_routing)):
    out = evaluate(folder, os.path.join(folder, f"routing_r{r}"), folder + ".log",
                   f"--iter_routing={r}")
    predictions = out.predictions()
    results[r] = out.results(), (predictions["label"], predictions["prediction"])
  summary = routing_summary(results[iter_routing], results[other_routing(iter_routing)])
  runs.RunFolder(folder).write_json(runs.ROUTING_FILE, summary)
  return summary


def eval_command(checkpoint, out_dir, *args):
  """The eval.py command that scores `checkpoint` with `args` into `out_dir`."""
  return [sys.executable, os.path.join(ROOT, "eval.py"), f"--checkpoint={checkpoint}",
          *args, f"--out_dir={out_dir}", "--num_images=8", "--figure4_images=1"]


def evaluate(checkpoint, out_dir, log_path, *args):
  """eval.py on `checkpoint` (a run folder: its best checkpoint), with
  `args`, into `out_dir` (its output appended to `log_path`). Returns: the
  runs.EvalFolder. Raises RunError if eval.py fails."""
  call(eval_command(checkpoint, out_dir, *args), log_path)
  return runs.EvalFolder(out_dir)


def measure_affine(folder, sweep, out_folder=None):
  """affine_results.json of a finished run (into `out_folder`, default the
  run's): eval.py on its best checkpoint on the affine test set and the
  `sweep`'s sets. Raises RunError if eval.py fails."""
  out_folder = out_folder or folder
  res = evaluate(folder, os.path.join(out_folder, "eval_affine"),
                 out_folder.rstrip("/") + ".log", "--split=affine",
                 f"--affine_sweep={','.join(str(d) for d in sweep)}").results()
  result = {k: res[k] for k in ("checkpoint", "count", "error_percent",
                                "margin_loss_mean", "iter_routing", "weights", "affine",
                                "sweep")}
  runs.RunFolder(out_folder).write_json(runs.AFFINE_RESULTS_FILE, result)
  return result


def routing_summary(own, other):
  """routing.json from two (results.json, (labels, predictions)): "own" and
  "other" (iter_routing, errors, error_percent, entropy and max_c per
  iteration), and "changed", "fixed", "broken": the predictions `other` changes,
  of which right only with `other`, only with `own`."""
  (res_a, (labels, pred_a)), (res_b, (labels_b, pred_b)) = own, other
  if labels != labels_b:
    raise ValueError("routing_summary: the two evaluations scored different images")
  def part(res, pred):
    return {"iter_routing": res["iter_routing"], "error_percent": res["error_percent"],
            "errors": sum(p != y for p, y in zip(pred, labels, strict=True)),
            "entropy": res["routing_entropy"], "max_c": res["routing_max_c"]}
  changed = [(a, b, y) for a, b, y in zip(pred_a, pred_b, labels, strict=True) if a != b]
  return {"checkpoint": res_a["checkpoint"], "images": len(labels),
          "uniform_entropy": res_a["routing_uniform_entropy"],
          "own": part(res_a, pred_a), "other": part(res_b, pred_b),
          "changed": len(changed), "fixed": sum(b == y for _, b, y in changed),
          "broken": sum(a == y for a, _, y in changed)}


# Where a grid's runs and report go and what is done there (`main`'s flags).
Where = collections.namedtuple("Where", [
    "out",       # the runs (checkpoints included) and the report
    "publish",   # also the report and each run's small files here, or ""
    "train",     # train missing runs (else: score and report only)
    "routing",   # measure how far routing moves the couplings
    "shipped"])  # the shipped weights, scored once on the affine sweep, or ""


def run_grid(protocol, variants, seeds, schedules, settings, extra, pairs, sweep, where):
  """Trains and scores what is missing, then reports (`main`'s checked flags)."""
  out, epochs = where.out, settings["epochs"]
  os.makedirs(out, exist_ok=True)
  for seed, decay_steps, name in ((s, d, n) for s in seeds for d in schedules
                                  for n in variants):
    folder, spec = report.run_dir(out, name, seed, decay_steps), protocol.variants[name]
    if report.is_complete(folder, epochs):
      print(f"{os.path.basename(folder)}: complete, skipped")
    elif where.train:
      run_one(spec, seed, folder, dict(settings, decay_steps=decay_steps), extra)
    scored = (report.is_complete(folder, epochs)
              and bool(runs.RunFolder(folder).checkpoints("best")))
    if (where.routing and scored
        and tasks.get(spec.get("dataset", tasks.DEFAULT)).heads == "one_digit"
        and runs.RunFolder(folder).read_json(runs.ROUTING_FILE) is None):
      print(f"{os.path.basename(folder)}: measuring routing", flush=True)
      measure_routing(folder, spec["iter_routing"])
    if (protocol.scores_affine and sweep and scored
        and runs.RunFolder(folder).read_json(runs.AFFINE_RESULTS_FILE) is None):
      print(f"{os.path.basename(folder)}: scoring the affine test set", flush=True)
      measure_affine(folder, sweep)
  shipped = os.path.join(out, report.SHIPPED)
  if (protocol.scores_affine and sweep and where.shipped
      and runs.RunFolder(shipped).read_json(runs.AFFINE_RESULTS_FILE) is None):
    print(f"{where.shipped}: scoring the affine test set", flush=True)
    os.makedirs(shipped, exist_ok=True)
    measure_affine(where.shipped, sweep, shipped)
  rows = report.summarize(out, protocol, variants, seeds, epochs, schedules)
  comparisons = report.compare(rows, pairs, protocol.measures)
  descriptive = report.compare(rows, pairs, protocol.descriptive) if protocol.descriptive else ()
  reference = report.shipped_sweep(out)
  table = report.report(rows, out, protocol, comparisons, reference, descriptive)
  if where.publish:
    report.report(rows, where.publish, protocol, comparisons, reference, descriptive)
    report.publish(out, rows, where.publish)
    if reference:   # (its affine_results.json)
      runs.RunFolder(shipped).copy_small_files(os.path.join(where.publish, report.SHIPPED))
  print(table)
