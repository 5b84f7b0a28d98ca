"""Routing studies: trains and tests each variant of a grid, then tabulates.

  python -m capsnet.study --epochs=1 --seeds=2              # stop_gradient grid
  python -m capsnet.study --grid=table1 --variants=r3_recon --epochs=50 \\
      --precision=bf16 --out=$HOME/table1                   # one Table 1 run
  python -m capsnet.study --grid=table1 --out=$HOME/table1 --epochs=50 \\
      --train=false --publish=study/table1                  # tabulate, copy
  python -m capsnet.study --epochs=1 --seeds=1 -- --train_size=2000   # train.py flags after --

Grids:
- `stop_gradient`: r = 1 (the stop changes nothing there; tests/
  test_stop_gradient.py proves it), and r = 2, 3 with stop_gradient on and off.
- `table1`: the rows of Table 1 of the paper, r = 1 and r = 3 each with and
  without the reconstruction decoder, plus r = 3 with reconstruction and
  stop_gradient off.
- `multimnist`: r = 3 with reconstruction on MultiMNIST (Section 6); its
  error counts an image right only if both digits are.

Every variant runs with the same seeds, hence the same initial weights, data
order and augmentation, the same split and the same budget; each run is a
train.py run in <out>/<variant>[_decay<N>]_seed<k>/ with the gradient
diagnostic on (`_decay<N>` when --decay_steps is not train.py's 2,000). A
finished run (test_results.json written after the last epoch) is skipped, an
unfinished one resumes, so the study can be stopped and continued. At the end
the study writes <out>/results.md (the table; runs still in progress appear
with the epochs they have), results.json, val_error.png (validation error
against epoch, log scale, a line per run; for MultiMNIST against training
pairs seen, beside the paper's 5.2%) and, when some variant has r > 1,
diagnostic.png (the share of W's gradient that flows through the routing
coefficients, against epoch). --publish=DIR writes the same there and copies
each run's small files (`runs.SMALL_FILES`: config.json, metrics.jsonl,
diagnostics.jsonl, test_results.json, routing.json, host.json and, for the
short protocol, affine_results.json) to DIR/<run>/, never its checkpoints.
The short protocol (`--grid=short`, docs/short.md) also scores each finished
run on the affine test set with the severity sweep, and the shipped weights
(`--shipped`) once, into <out>/shipped/.
"""
import io
import os
import statistics
import subprocess
import sys

from absl import app
from absl import flags

from capsnet.data import affine
from capsnet.data import tasks
from capsnet.running import files
from capsnet.running import host
from capsnet.running import runs
from capsnet.running import schedule
from capsnet.using import stats

# Weight averaging of the variants that use it: a time constant of 1,000
# steps, about 2.3 epochs of 429 steps.
EMA_DECAY = 0.999

GRIDS = {   # grid: {variant: the train.py flags that make it}
    "stop_gradient": {
        "r1": dict(iter_routing=1, stop_gradient=True),
        "r2_stop": dict(iter_routing=2, stop_gradient=True),
        "r2_nostop": dict(iter_routing=2, stop_gradient=False),
        "r3_stop": dict(iter_routing=3, stop_gradient=True),
        "r3_nostop": dict(iter_routing=3, stop_gradient=False),
    },
    "table1": {
        "r1_norecon": dict(iter_routing=1, stop_gradient=True, use_decoder=False),
        "r1_recon": dict(iter_routing=1, stop_gradient=True, use_decoder=True),
        "r3_norecon": dict(iter_routing=3, stop_gradient=True, use_decoder=False),
        "r3_recon": dict(iter_routing=3, stop_gradient=True, use_decoder=True),
        "r3_recon_nostop": dict(iter_routing=3, stop_gradient=False, use_decoder=True),
        # Issue 24: the official code's loss balance (reconstruction 0.01 against
        # the summed margin loss), then also its layers; both average weights.
        "r3_recon_balance": dict(iter_routing=3, stop_gradient=True, use_decoder=True,
                                 recon_weight=0.01, ema_decay=EMA_DECAY),
        "r3_recon_official": dict(iter_routing=3, stop_gradient=True, use_decoder=True,
                                  recon_weight=0.01, capsule_layers="official",
                                  ema_decay=EMA_DECAY),
    },
    # The short protocol (docs/short.md): the stop_gradient question in runs
    # that fit a sitting, 5 epochs with --decay_steps=14, blocks of seeds.
    "short": {
        "r1_recon": dict(iter_routing=1, stop_gradient=True, use_decoder=True),
        "r3_recon": dict(iter_routing=3, stop_gradient=True, use_decoder=True),
        "r3_recon_nostop": dict(iter_routing=3, stop_gradient=False, use_decoder=True),
    },
    "multimnist": {   # Section 6: an epoch is 55,000 pairs drawn on the fly
        "r3_recon": dict(iter_routing=3, stop_gradient=True, use_decoder=True,
                         dataset="multimnist"),
    },
}
LAST_EPOCHS = 10   # the decision rule's late validation figure: mean of the last 10
AFFINE_SWEEP = tuple(range(0, 50, 5))   # the severity sweep's largest rotations
SHIPPED = "shipped"   # <out>/shipped/: the shipped weights' affine results


def define_flags():
  """The command-line flags; defined when run as a program only, so that
  importing this module (tests, other tools) adds no global flags."""
  flags.DEFINE_enum("grid", "stop_gradient", sorted(GRIDS), "the grid of variants")
  flags.DEFINE_integer("epochs", 1, "epochs per run", lower_bound=1)
  flags.DEFINE_integer("seeds", 2, "seeds per variant (0 .. seeds-1)", lower_bound=1)
  flags.DEFINE_integer("first_seed", 0, "the first seed", lower_bound=0)
  flags.DEFINE_list("variants", None, "variants to run (default: the whole grid)")
  flags.DEFINE_list("decay_steps", [str(schedule.DECAY_STEPS)], "learning-rate "
                    "decay periods (train.py --decay_steps); each variant runs "
                    "with each")
  flags.DEFINE_string("out", "study", "folder of the runs, table and plots")
  flags.DEFINE_string("publish", None, "also write the table and plots here and "
                      "copy each run's small files to <publish>/<run>/")
  flags.DEFINE_string("precision", "fp32", "fp32 or bf16, for every run")
  flags.DEFINE_integer("diag_every", 50, "steps between gradient diagnostics", lower_bound=1)
  flags.DEFINE_integer("val_every", 100, "steps between validations inside an epoch "
                       "(for the curves; 0: epoch ends only)", lower_bound=0)
  flags.DEFINE_bool("train", True, "run missing runs (false: only tabulate)")
  flags.DEFINE_list("compare", [], "paired comparisons A:B (B - A per seed, mean "
                    "and 95 percent t interval), e.g. r3_recon:r3_recon_nostop")
  flags.DEFINE_bool("routing", True, "after a run finishes, measure how far "
                    "routing moves the couplings (eval.py on its best checkpoint, "
                    "with its own and the other routing count): routing.json")
  flags.DEFINE_list("affine_sweep", [str(d) for d in AFFINE_SWEEP], "--grid=short: "
                    "after a run finishes, score its best checkpoint on the affine "
                    "test set and on sets of these largest rotations (degrees): "
                    "affine_results.json; empty: no affine scoring")
  flags.DEFINE_string("shipped", os.path.join("pretrained", "r3_recon"), "--grid=short: "
                      "also score this run folder's best checkpoint on the affine "
                      "sets, into <out>/shipped/ (empty: not)")


FLAGS = flags.FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_name(variant, seed, decay_steps=schedule.DECAY_STEPS):
  tag = "" if decay_steps == schedule.DECAY_STEPS else f"_decay{decay_steps}"
  return f"{variant}{tag}_seed{seed}"


def run_dir(out, variant, seed, decay_steps=schedule.DECAY_STEPS):
  return os.path.join(out, run_name(variant, seed, decay_steps))


def epochs_done(folder):
  """Completed epochs of a run (0 if it has not finished one)."""
  return max([r["epoch"] for r in runs.RunFolder(folder).metrics("epoch")], default=0)


def is_complete(folder, epochs):
  """The run finished `epochs` epochs and scored its best checkpoint."""
  return (runs.RunFolder(folder).test_results() is not None
          and epochs_done(folder) >= epochs)


def train_command(spec, seed, folder, settings, extra):
  """The train.py command of one run; `spec` holds the variant's flags."""
  variant_flags = [f"--{k}={v}" for k, v in spec.items()]
  return [sys.executable, os.path.join(ROOT, "train.py"), *variant_flags,
          f"--seed={seed}", f"--epochs={settings['epochs']}", f"--logdir={folder}",
          f"--precision={settings['precision']}",
          f"--decay_steps={settings['decay_steps']}",
          f"--diag_every={settings['diag_every']}",
          f"--val_every={settings['val_every']}", "--progress=false", *extra]


def describe_run(folder, epochs):
  """One run's figures from its files; None if it has no epoch yet."""
  run = runs.RunFolder(folder)
  metrics = run.metrics()
  epoch_rows = [m for m in metrics if m["kind"] == "epoch"]
  if not epoch_rows:
    return None
  complete = is_complete(folder, epochs)
  test = run.test_results() if complete else {}
  config = run.config() or {}
  model, batch = config.get("model", {}), config.get("train", {}).get("batch_size")
  val = [m for m in metrics if "val_error_percent" in m]
  weights = _better_weights(epoch_rows)
  key = "val_error_percent" + ("_averaged" if weights == "averaged" else "")
  epoch_val = [m[key] for m in epoch_rows if key in m]
  diags = run.diagnostics()
  wall = sum(m["wall_s"] for m in epoch_rows if "wall_s" in m)
  affine = (run.affine_results() if complete else None) or {}
  return {
      "run": os.path.basename(folder), "complete": complete,
      "epochs_done": epoch_rows[-1]["epoch"], "steps": epoch_rows[-1]["step"],
      "images_seen": epoch_rows[-1]["step"] * batch if batch else None,
      "precision": model.get("precision", "fp32"),
      "test_error": test.get("error_percent"),
      "test_errors_count": (round(test["error_percent"] * test["count"] / 100)
                            if "count" in test else None),
      "test_at_least_one": test.get("at_least_one"),   # MultiMNIST only
      "test_margin_loss": test.get("margin_loss_mean"),
      "affine_error": affine.get("error_percent"),
      "affine_sweep": [(x["max_rotation_deg"], x["error_percent"])
                       for x in affine.get("sweep", [])],
      "host": run.host(),
      "best_val_error": min((m[key] for m in val if key in m), default=None),
      "val_weights": weights,            # whose validation figures these are
      "test_weights": test.get("weights", "raw"),
      "last_val_loss": next((m["val_loss"] for m in reversed(val) if "val_loss" in m),
                            None),
      "selected_step": (runs.step_of(test["checkpoint"]) if "checkpoint" in test
                        else None),
      "tied_steps": _tied_steps(val, key),
      "last_val_error": (statistics.mean(epoch_val[-LAST_EPOCHS:])
                         if complete and len(epoch_val) >= LAST_EPOCHS else None),
      "routing": run.routing() if complete else None,
      "images_per_sec": statistics.mean(m["images_per_sec"] for m in epoch_rows),
      "train_wall_s": round(wall, 1),
      "curve": [(m["epoch"], m["val_error_percent"]) for m in val],
      "images_curve": ([(m["step"] * batch, m["val_error_percent"]) for m in val]
                       if batch else []),
      "diag_curve": [(d["epoch"], d["digit_caps/weights"]) for d in diags
                     if "digit_caps/weights" in d],
      "diag": {key: (diags[0][key], diags[-1][key]) if diags else (None, None)
               for key in ("digit_caps/weights", "conv1/weights")},
  }


def _tied_steps(val, key):
  """The steps whose validation error equals the lowest one (ties for the
  best checkpoint; train.py breaks them by the lower validation loss)."""
  errors = [(m["step"], round(m[key], 6)) for m in val if key in m]
  best = min((e for _, e in errors), default=None)
  return [step for step, e in errors if e == best]


def _better_weights(rows):
  """"averaged" if a run with weight averaging reached its lowest validation
  error with the averaged weights (a tie: the lower mean of the last 10
  epochs; then raw), else "raw"."""
  if not any("val_error_percent_averaged" in m for m in rows):
    return "raw"
  def figures(key):
    errors = [m[key] for m in rows if key in m]
    return (min(errors), statistics.mean(errors[-LAST_EPOCHS:]))
  return ("averaged" if figures("val_error_percent_averaged")
          < figures("val_error_percent") else "raw")


def summarize(out, grid, variants, seeds, epochs, schedules=(schedule.DECAY_STEPS,)):
  """Per-variant figures from the run folders.

  Args:
    seeds: the seeds to look for (an iterable of ints).
    schedules: learning-rate decay periods; a row per variant and period.
  Returns: one dict per (variant, period) with an epoch done: its runs
    (`describe_run`) and, over its complete runs, the mean and (with two or
    more) the sample standard deviation of the test error and of the mean
    validation error of the last 10 epochs.
  """
  rows = []
  for name, decay_steps in ((n, d) for n in variants for d in schedules):
    runs = [describe_run(run_dir(out, name, s, decay_steps), epochs) for s in seeds]
    runs = [dict(r, seed=s) for s, r in zip(seeds, runs) if r is not None]
    if not runs:
      continue
    done = [r for r in runs if r["complete"]]
    tests = [r["test_error"] for r in done]
    vals = [r["best_val_error"] for r in runs if r["best_val_error"] is not None]
    lasts = [r["last_val_error"] for r in done if r["last_val_error"] is not None]
    spec = GRIDS[grid][name]
    rows.append({
        "variant": name, "dataset": spec.get("dataset", tasks.DEFAULT),
        "iter_routing": spec["iter_routing"],
        "stop_gradient": spec.get("stop_gradient", True),
        "use_decoder": spec.get("use_decoder", True), "decay_steps": decay_steps,
        "epochs": epochs, "seeds": len(done), "runs": runs,
        "test_errors": tests,
        "test_error_mean": statistics.mean(tests) if tests else None,
        "test_error_std": statistics.stdev(tests) if len(tests) > 1 else None,
        "best_val_error_mean": statistics.mean(vals) if vals else None,
        "last_val_errors": lasts,
        "last_val_error_mean": statistics.mean(lasts) if lasts else None,
        "last_val_error_std": statistics.stdev(lasts) if len(lasts) > 1 else None,
        "images_per_sec": statistics.mean(r["images_per_sec"] for r in runs),
        "measures": {key: _spread([r[key] for r in done]) for key in MEASURES},
        "diag": {key: tuple(_mean_or_none(r["diag"][key][i] for r in runs)
                            for i in (0, 1))
                 for key in ("digit_caps/weights", "conv1/weights")},
        "curves": [r["curve"] for r in runs],
        "images_curves": [r["images_curve"] for r in runs]})
  return rows


# Per-run figures that summarize() also gives per variant (mean, std).
MEASURES = ("test_error", "test_margin_loss", "affine_error")


def _spread(values):
  """{"values", "mean", "std"} of the figures that are not None."""
  values = [v for v in values if v is not None]
  return {"values": values, "mean": statistics.mean(values) if values else None,
          "std": statistics.stdev(values) if len(values) > 1 else None}


def _mean_or_none(values):
  values = [v for v in values if v is not None]
  return statistics.mean(values) if values else None


# The figures a comparison pairs: (run key, what it is); the short
# protocol's are its three measures (docs/short.md).
FIGURES = (("test_error", "test error of the best-validation checkpoint, %"),
           ("last_val_error", f"mean validation error of the last {LAST_EPOCHS} epochs, %"))
SHORT_FIGURES = (("test_error", "test error, %"),
                 ("test_margin_loss", "mean test margin loss per example"),
                 ("affine_error", "affine-test error, %"))
GRID_FIGURES = {"short": SHORT_FIGURES}
# Beside the short protocol's registered measures, not part of its rule: a
# figure no checkpoint choice touches (issue 41).
SELECTION_FREE = (("last_val_loss", "validation loss at the last step "
                   "(selection-free; descriptive)"),)


def figures_of(grid):
  return GRID_FIGURES.get(grid, FIGURES)


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


def compare(rows, pairs, figures=FIGURES):
  """Paired differences B - A by seed, for each figure (the decision rule).

  Args:
    rows: `summarize`'s rows; a pair is compared at each decay period that
      both variants have.
    pairs: [(A, B)] variant names.
    figures: (run key, label) pairs of the figures compared (`figures_of`).
  Returns: one dict per pair and period: a, b, decay_steps, and per figure
    key the `stats.paired_difference` over the complete runs (or None).
  """
  by_key = {(r["variant"], r["decay_steps"]): r for r in rows}
  out = []
  for a, b in pairs:
    for (name, decay_steps), row_a in by_key.items():
      row_b = by_key.get((b, decay_steps))
      if name != a or row_b is None:
        continue
      result = {"a": a, "b": b, "decay_steps": decay_steps}
      for key, _ in figures:
        per_seed = [{x["seed"]: x[key] for x in row["runs"] if x["complete"]}
                    for row in (row_a, row_b)]
        result[key] = stats.paired_difference(*per_seed)
      out.append(result)
  return out


def _fmt(x, spec):
  return "–" if x is None else format(x, spec)


def _duration(seconds):
  h, m = divmod(round(seconds / 60), 60)
  return f"{h} h {m:02d} min" if h else f"{m} min"


def markdown(rows, comparisons=(), figures=FIGURES, descriptive=()):
  """The study's tables: one line per variant, one per run, then the paired
  comparisons (of `figures`; `descriptive`: of SELECTION_FREE, with where
  the best-checkpoint ties fell) and, where measured, how far routing moves
  the couplings."""
  lines = [
      "| variant | r | decoder | stop_gradient | lr decay every | seeds done "
      "| test error % (mean ± std) | per seed | best val error % | images/s "
      "| routing share of W grad, start → end | of conv1 grad |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    w0, w1 = r["diag"]["digit_caps/weights"]
    c0, c1 = r["diag"]["conv1/weights"]
    mean = _fmt(r["test_error_mean"], ".3f")
    if r["test_error_std"] is not None:
      mean += f" ± {r['test_error_std']:.3f}"
    per_seed = ", ".join(
        f"{x['test_error']:.2f}" if x["complete"] else
        f"in progress ({x['epochs_done']}/{r['epochs']} epochs)" for x in r["runs"])
    lines.append(
        f"| {r['variant']} | {r['iter_routing']} | {'yes' if r['use_decoder'] else 'no'} | "
        f"{'n/a' if r['iter_routing'] == 1 else r['stop_gradient']} | "
        f"{r['decay_steps']} steps | {r['seeds']} of {len(r['runs'])} | {mean} | "
        f"{per_seed} | {_fmt(r['best_val_error_mean'], '.3f')} | "
        f"{r['images_per_sec']:.0f} | {_fmt(w0, '.3g')} → {_fmt(w1, '.3g')} | "
        f"{_fmt(c0, '.3g')} → {_fmt(c1, '.3g')} |")
  multi = _multimnist(rows)
  extra = " training pairs seen | test: at least one right % |" if multi else ""
  lines += ["", "| run | precision | epochs | steps | test error % | test errors "
            "| best val error % | images/s | training wall time |" + extra,
            "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if multi else "")]
  for r in rows:
    for x in r["runs"]:
      epochs = f"{x['epochs_done']}" + ("" if x["complete"] else " (in progress)")
      cells = [x["run"], x["precision"], epochs, x["steps"],
               _fmt(x["test_error"], ".2f"), _fmt(x["test_errors_count"], "d"),
               _fmt(x["best_val_error"], ".2f"), f"{x['images_per_sec']:.0f}",
               _duration(x["train_wall_s"])]
      if multi:
        one = x["test_at_least_one"]
        cells += [_fmt(x["images_seen"], ",d"), _fmt(None if one is None else 100 * one, ".2f")]
      lines.append("| " + " | ".join(str(c) for c in cells) + " |")
  seed_table = _short_table(rows) if figures == SHORT_FIGURES else _seed_table(rows)
  lines += (seed_table + _comparison_table(comparisons, figures)
            + _selection_table(rows, descriptive) + _routing_table(rows)
            + _affine_table(rows))
  return "\n".join(lines) + "\n"


def _mean_std(mean, std):
  return _fmt(mean, ".3f") + ("" if std is None else f" ± {std:.3f}")


def _seed_table(rows):
  """Both figures of the decision rule, per variant over its finished seeds."""
  if not any(r["seeds"] for r in rows) or _multimnist(rows):
    return []
  lines = ["", "Both figures of the decision rule over the finished seeds (mean ± "
           "sample std):", "",
           f"| variant | lr decay every | seeds | test error % | per seed "
           f"| mean val error of the last {LAST_EPOCHS} epochs % | per seed |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    done = [x for x in r["runs"] if x["complete"]]
    per = lambda key, spec: ", ".join(
        f"{_fmt(x[key], spec)} (seed {x['seed']})" for x in done) or "–"
    lines.append(
        f"| {r['variant']} | {r['decay_steps']} | {len(done)} | "
        f"{_mean_std(r['test_error_mean'], r['test_error_std'])} | "
        f"{per('test_error', '.2f')} | "
        f"{_mean_std(r['last_val_error_mean'], r['last_val_error_std'])} | "
        f"{per('last_val_error', '.3f')} |")
  return lines


def _short_table(rows):
  """The short protocol's three measures, per variant over its finished blocks."""
  if not any(r["seeds"] for r in rows):
    return []
  lines = ["", "The three measures over the finished blocks (mean ± sample std; per "
           "block = seed):", "",
           "| variant | blocks | test error % | per block | mean test margin loss "
           "| per block | affine-test error % | per block |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    done = [x for x in r["runs"] if x["complete"]]
    cells = [r["variant"], str(len(done))]
    for key, spec in (("test_error", ".2f"), ("test_margin_loss", ".5f"),
                      ("affine_error", ".2f")):
      m = r["measures"][key]
      cells.append(_fmt(m["mean"], spec) + ("" if m["std"] is None
                                             else f" ± {format(m['std'], spec)}"))
      cells.append(", ".join(f"{_fmt(x[key], spec)} ({x['seed']})" for x in done) or "–")
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def _affine_table(rows):
  """Each run's affine error against the largest rotation (the sweep)."""
  swept = [x for r in rows for x in r["runs"] if x.get("affine_sweep")]
  if not swept:
    return []
  degrees = sorted({d for x in swept for d, _ in x["affine_sweep"]})
  lines = ["", "Severity sweep (descriptive, not part of the decision rule): affine-test "
           "error % against the largest rotation, the other ranges affNIST's:", "",
           "| run | " + " | ".join(f"{d:g}°" for d in degrees) + " |",
           "|---|" + "---|" * len(degrees)]
  for x in swept:
    at = dict(x["affine_sweep"])
    lines.append(f"| {x['run']} | " + " | ".join(_fmt(at.get(d), ".2f") for d in degrees)
                 + " |")
  return lines


# The format of a figure's differences (the others: +.3f).
SPECS = {"test_margin_loss": "+.5f", "last_val_loss": "+.5f"}


def _selection_table(rows, descriptive):
  """Where the best-checkpoint ties fell, and the selection-free figure's
  paired comparisons (`descriptive`); [] without them."""
  if not descriptive:
    return []
  lines = ["", "Beside the registered measures (descriptive, not part of the rule): "
           "the checkpoint each run scored, the steps tied at its lowest validation "
           "error (train.py then kept the first of them; since issue 41 the lower "
           "validation loss wins a tie), and the validation loss at the last step, "
           "which no checkpoint choice touches:", "",
           "| run | scored step | steps tied at the lowest val error | val loss, "
           "last step |", "|---|---|---|---|"]
  for r in rows:
    for x in r["runs"]:
      ties = x["tied_steps"]
      lines.append(f"| {x['run']} | {_fmt(x['selected_step'], 'd')} | "
                   f"{', '.join(map(str, ties)) if len(ties) > 1 else 'none'} | "
                   f"{_fmt(x['last_val_loss'], '.5f')} |")
  return lines + _comparison_table(descriptive, SELECTION_FREE)


def _comparison_table(comparisons, figures=FIGURES):
  if not comparisons:
    return []
  short = figures == SHORT_FIGURES
  unit = "block" if short else "seed"
  lines = ["", f"Paired comparisons, B - A by {unit} (positive: A has the lower error"
           + (" or loss" if short else "") + "); 95% interval mean ± t(0.975, n-1) "
           "sd / sqrt(n); called only when it excludes zero" + (
               " (nine intervals at 95% each, not corrected for multiplicity)"
               if short else "") + ":", "",
           f"| A | B | lr decay every | figure | {unit}s | B - A per {unit} | mean | "
           "95% interval | verdict |", "|---|---|---|---|---|---|---|---|---|"]
  for c in comparisons:
    for key, label in figures:
      d, spec = c[key], SPECS.get(key, "+.3f")
      per_seed = "–" if d is None else ", ".join(
          f"{format(x, spec)} ({unit} {s})" for s, x in zip(d["seeds"], d["diffs"]))
      interval = ("–" if d is None or d["lo"] is None
                  else f"[{format(d['lo'], spec)}, {format(d['hi'], spec)}]")
      lines.append(
          f"| {c['a']} | {c['b']} | {c['decay_steps']} | {label} | "
          f"{0 if d is None else d['n']} | {per_seed} | "
          f"{'–' if d is None else format(d['mean'], spec)} | {interval} | "
          f"{stats.verdict(d, spec=spec, within=short)} |")
  return lines


def _routing_table(rows):
  """routing.json of each finished run: how far routing moves c from uniform."""
  measured = [x for r in rows for x in r["runs"] if x.get("routing")]
  if not measured:
    return []
  lines = ["", "How far routing moves the couplings on the 10,000 test images "
           "(eval.py on the best-validation checkpoint; entropy in nats, uniform "
           "= log 10 = 2.3026; mean max c, uniform = 0.1), and what the other "
           "routing count changes:", "",
           "| run | r | mean entropy of c, per iteration | mean max c, per iteration "
           "| test errors | evaluated with r = | test errors | predictions changed "
           "| fixed | broken |", "|---|---|---|---|---|---|---|---|---|---|"]
  for x in measured:
    m = x["routing"]
    own, other = m["own"], m["other"]
    lines.append(
        f"| {x['run']} | {own['iter_routing']} | "
        + " → ".join(f"{e:.4f}" for e in own["entropy"]) + " | "
        + " → ".join(f"{c:.4f}" for c in own["max_c"]) + " | "
        f"{own['errors']} | {other['iter_routing']} | {other['errors']} | "
        f"{m['changed']} | {m['fixed']} | {m['broken']} |")
  return lines


def _figure():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt, matplotlib.ticker


def _save(plt, fig, path):
  fig.tight_layout()
  png = io.BytesIO()
  fig.savefig(png, format="png")
  plt.close(fig)
  files.atomic_write(path, png.getvalue())


def _label(row):
  if row["decay_steps"] == schedule.DECAY_STEPS:
    return row["variant"]
  return f"{row['variant']}, lr decay every {row['decay_steps']}"


def _multimnist(rows):
  """Rows whose task counts training pairs (MultiMNIST): their own columns
  and axis."""
  return any(tasks.get(r["dataset"]).progress == "pairs" for r in rows)


# plot's x axes: the curves it reads, their scale and the axis label.
X_AXES = {"epoch": ("curves", 1, "epoch"),
          "pairs": ("images_curves", 1e-6, "training pairs seen (millions)")}


def band(curves):
  """Mean, min and max over seeds at each x.

  Args:
    curves: one list of (x, y) per seed; a seed without a point at some x
      (a run still in progress) is left out there.
  Returns: (xs, means, mins, maxs), xs ascending.
  """
  at = {}
  for curve in curves:
    for x, y in curve:
      at.setdefault(round(x, 6), []).append(y)
  xs = sorted(at)
  return (xs, [statistics.mean(at[x]) for x in xs], [min(at[x]) for x in xs],
          [max(at[x]) for x in xs])


def plot(rows, path, title="CapsNet on MNIST: routing variants", x="epoch",
         reference=None):
  """Validation error against epoch: a line per variant, the mean over its
  seeds, in a band from the lowest to the highest seed.

  Args:
    x: "epoch", or "pairs": MultiMNIST training pairs seen, in millions.
    reference: (error %, label): a horizontal line, e.g. the paper's result.
  """
  plt, ticker = _figure()
  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
  key, scale, xlabel = X_AXES[x]
  many = max(len(c) for r in rows for c in r[key]) > 30
  for k, r in enumerate(rows):
    curves = [c for c in r[key] if c]
    if not curves:
      continue
    xs, means, lows, highs = band(curves)
    xs = [a * scale for a in xs]
    ax.plot(xs, means, color=f"C{k}", marker=None if many else "o", markersize=3,
            linewidth=1.2, label=f"{_label(r)} ({len(curves)} "
                                 f"seed{'s' if len(curves) > 1 else ''})")
    if len(curves) > 1:
      ax.fill_between(xs, lows, highs, color=f"C{k}", alpha=0.2, linewidth=0)
  if reference:
    ax.axhline(reference[0], color="grey", linestyle=":", label=reference[1])
  ax.set_xlabel(xlabel)
  ax.set_ylabel("validation error (%)")
  ax.set_yscale("log")
  ax.yaxis.set_major_formatter(ticker.ScalarFormatter())
  ax.yaxis.set_minor_formatter(ticker.ScalarFormatter())
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(title="mean over seeds; band: lowest to highest seed", fontsize=8,
            title_fontsize=8)
  ax.set_title(title)
  _save(plt, fig, path)


def plot_diagnostic(rows, path):
  """The share of W's gradient that flows through the coefficients, by epoch."""
  plt, _ = _figure()
  fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
  for k, r in enumerate(rows):
    if r["iter_routing"] == 1:
      continue
    for s, run in enumerate(r["runs"]):
      if run["diag_curve"]:
        xs, ys = zip(*run["diag_curve"])
        ax.plot(xs, ys, color=f"C{k}", linewidth=1, linestyle="-" if s == 0 else "--",
                label=_label(r) if s == 0 else None)
  ax.set_xlabel("epoch")
  ax.set_ylabel("||g_full - g_stop|| / ||g_full||  (W)")
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8)
  ax.set_title("Gradient through the routing coefficients (fixed batch of 32)")
  _save(plt, fig, path)


def plot_affine(rows, path):
  """Affine-test error per variant (x) and block (a line per block)."""
  plt, _ = _figure()
  fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
  names = [r["variant"] for r in rows]
  seeds = sorted({x["seed"] for r in rows for x in r["runs"]})
  for k, seed in enumerate(seeds):
    ys = [next((x["affine_error"] for x in r["runs"] if x["seed"] == seed), None)
          for r in rows]
    xs = [i for i, y in enumerate(ys) if y is not None]
    ax.plot(xs, [ys[i] for i in xs], color=f"C{k}", marker="o", label=f"block {seed}")
  ax.set_xticks(range(len(names)))
  ax.set_xticklabels(names)
  ax.set_ylabel("affine-test error (%)")
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8)
  ax.set_title("Affine test set (28x28, affNIST's ranges; not affNIST)", fontsize=10)
  _save(plt, fig, path)


def plot_sweep(rows, shipped, path):
  """Affine error against the largest rotation: a line per run, and the
  shipped weights' in black."""
  plt, _ = _figure()
  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
  for k, r in enumerate(rows):
    for s, x in enumerate(x for x in r["runs"] if x["affine_sweep"]):
      ds, es = zip(*x["affine_sweep"])
      ax.plot(ds, es, color=f"C{k}", linewidth=1, linestyle="-" if s == 0 else "--",
              label=_label(r) if s == 0 else None)
  if shipped:
    ds, es = zip(*shipped)
    ax.plot(ds, es, color="black", linewidth=1.5, label="shipped r3_recon (50 epochs)")
  ax.set_xlabel("largest rotation (degrees); shear, scale, shift in affNIST's ranges")
  ax.set_ylabel("error (%)")
  ax.set_yscale("log")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  ax.set_title("Severity sweep (descriptive)", fontsize=10)
  _save(plt, fig, path)


# The paper's MultiMNIST result (Section 6): CapsNet, r = 3, with reconstruction.
MULTIMNIST_PAPER = (5.2, "paper: 5.2% test error after 60M pairs")

TITLES = {"stop_gradient": "CapsNet on MNIST: routing variants",
          "table1": "CapsNet on MNIST: the rows of Table 1",
          "short": "CapsNet on MNIST: the short protocol (5 epochs)",
          "multimnist": "CapsNet on MultiMNIST (both digits right)"}


def report(rows, folder, title=TITLES["stop_gradient"], comparisons=(), figures=FIGURES,
           shipped=(), descriptive=()):
  """results.md, results.json (the rows; with comparisons: {"rows",
  "comparisons"}) and the plots in `folder`; with the short protocol's
  figures also affine.png (affine error per variant and block) and, where
  swept, affine_sweep.png (beside the `shipped` weights' sweep)."""
  os.makedirs(folder, exist_ok=True)
  table = markdown(rows, comparisons, figures, descriptive)
  if shipped:
    table += ("\nThe shipped weights (pretrained/r3_recon, 50 epochs), same sweep: "
              + ", ".join(f"{d:g}°: {e:.2f}" for d, e in shipped) + "\n")
  files.atomic_write(os.path.join(folder, "results.md"), table)
  files.write_json(os.path.join(folder, "results.json"),
                   {"rows": rows, "comparisons": comparisons} if comparisons else rows)
  if rows:
    x, reference = ("pairs", MULTIMNIST_PAPER) if _multimnist(rows) else ("epoch", None)
    plot(rows, os.path.join(folder, "val_error.png"), title, x=x, reference=reference)
  if any(r["iter_routing"] > 1 for r in rows):
    plot_diagnostic(rows, os.path.join(folder, "diagnostic.png"))
  if figures == SHORT_FIGURES and any(x["affine_error"] is not None
                                      for r in rows for x in r["runs"]):
    plot_affine(rows, os.path.join(folder, "affine.png"))
  if any(x["affine_sweep"] for r in rows for x in r["runs"]) or shipped:
    plot_sweep(rows, shipped, os.path.join(folder, "affine_sweep.png"))
  return table


def publish(out, rows, folder):
  """Copies each run's small files (never checkpoints) to folder/<run>/."""
  for r in rows:
    for run in r["runs"]:
      runs.RunFolder(os.path.join(out, run["run"])).copy_small_files(
          os.path.join(folder, run["run"]))


def run_one(spec, seed, folder, settings, extra):
  """Trains (or resumes) one run, its output in <folder>.log; exits on failure."""
  print(f"{os.path.basename(folder)}: training in {folder}", flush=True)
  os.makedirs(folder, exist_ok=True)
  runs.RunFolder(folder).record_host(dict(host.describe(), commit=_commit()))
  with open(folder + ".log", "a") as log:
    rc = subprocess.call(train_command(spec, seed, folder, settings, extra),
                         stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
  if rc:
    sys.exit(f"study: error: {os.path.basename(folder)} failed (exit {rc}); "
             f"see {folder}.log")


def _commit():
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
  """routing.json of a finished run: eval.py on its best checkpoint with its
  own routing count and with `other_routing`, on the test set; the per
  iteration couplings figures and how many predictions the other count
  changes (fixed: wrong before, right after; broken: the reverse).

  Returns: the routing.json dict. Exits if eval.py fails.
  """
  results = {}
  for r in (iter_routing, other_routing(iter_routing)):
    out = evaluate(folder, os.path.join(folder, f"routing_r{r}"), folder + ".log",
                   f"--iter_routing={r}")
    predictions = out.predictions()
    results[r] = out.results(), (predictions["label"], predictions["prediction"])
  summary = routing_summary(results[iter_routing], results[other_routing(iter_routing)])
  runs.RunFolder(folder).write_routing(summary)
  return summary


def evaluate(folder, out_dir, log_path, *args):
  """eval.py on the best checkpoint of the run `folder`, with `args`, into
  `out_dir` (its output appended to `log_path`). Returns: the
  runs.EvalFolder. Exits if eval.py fails."""
  cmd = [sys.executable, os.path.join(ROOT, "eval.py"), f"--checkpoint={folder}", *args,
         f"--out_dir={out_dir}", "--num_images=8", "--figure4_images=1"]
  with open(log_path, "a") as log:
    rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
  if rc:
    sys.exit(f"study: error: eval.py {' '.join(args)} on {folder} failed (exit {rc}); "
             f"see {log_path}")
  return runs.EvalFolder(out_dir)


def measure_affine(folder, sweep, out_folder=None):
  """affine_results.json of a finished run: eval.py on its best checkpoint,
  on the affine test set and the sets of the `sweep`'s largest rotations.

  Args:
    out_folder: where affine_results.json goes (default: the run's folder).
  Returns: the affine_results.json dict. Exits if eval.py fails.
  """
  out_folder = out_folder or folder
  res = evaluate(folder, os.path.join(out_folder, "eval_affine"),
                 out_folder.rstrip("/") + ".log", "--split=affine",
                 f"--affine_sweep={','.join(str(d) for d in sweep)}").results()
  result = {k: res[k] for k in ("checkpoint", "count", "error_percent",
                                "margin_loss_mean", "iter_routing", "weights", "affine",
                                "sweep")}
  runs.RunFolder(out_folder).write_affine_results(result)
  return result


def shipped_sweep(out):
  """The shipped weights' affine sweep [(degrees, error %)] from
  <out>/shipped/affine_results.json, or []."""
  res = runs.RunFolder(os.path.join(out, SHIPPED)).affine_results() or {}
  return [(x["max_rotation_deg"], x["error_percent"]) for x in res.get("sweep", [])]


def routing_summary(own, other):
  """routing.json from two (eval.py results.json, (labels, predictions)).

  Returns: {"checkpoint", "uniform_entropy", "own": ..., "other": ...} each
    with iter_routing, errors, error_percent, entropy and max_c per
    iteration; "changed", "fixed", "broken": predictions of `other` that
    differ from `own`'s, of which right only with `other`, right only with
    `own`.
  """
  (res_a, (labels, pred_a)), (res_b, (labels_b, pred_b)) = own, other
  if labels != labels_b:
    raise ValueError("routing_summary: the two evaluations scored different images")
  def part(res, pred):
    return {"iter_routing": res["iter_routing"], "error_percent": res["error_percent"],
            "errors": sum(p != y for p, y in zip(pred, labels)),
            "entropy": res["routing_entropy"], "max_c": res["routing_max_c"]}
  changed = [(a, b, y) for a, b, y in zip(pred_a, pred_b, labels) if a != b]
  return {"checkpoint": res_a["checkpoint"], "images": len(labels),
          "uniform_entropy": res_a["routing_uniform_entropy"],
          "own": part(res_a, pred_a), "other": part(res_b, pred_b),
          "changed": len(changed), "fixed": sum(b == y for _, b, y in changed),
          "broken": sum(a == y for a, _, y in changed)}


def main(argv):
  extra = argv[1:]     # everything after `--` goes to train.py
  grid = GRIDS[FLAGS.grid]
  variants = FLAGS.variants or list(grid)
  unknown = [v for v in variants if v not in grid]
  if unknown:
    sys.exit(f"study: error: --variants: {unknown} not in the {FLAGS.grid} "
             f"grid {list(grid)}")
  try:
    schedules = [int(d) for d in FLAGS.decay_steps]
  except ValueError:
    schedules = []
  if not schedules or min(schedules) < 1:
    sys.exit(f"study: error: --decay_steps={','.join(FLAGS.decay_steps)}: "
             "expected positive integers")
  settings = {k: FLAGS[k].value for k in ("epochs", "precision", "diag_every",
                                          "val_every")}
  try:
    pairs = parse_pairs(FLAGS.compare, grid)
    sweep = [int(d) if d == int(d) else d for d in affine.parse_sweep(FLAGS.affine_sweep)]
  except ValueError as e:
    sys.exit(f"study: error: {e}")
  seeds = range(FLAGS.first_seed, FLAGS.first_seed + FLAGS.seeds)
  if not FLAGS.train and not any(
      os.path.isdir(run_dir(FLAGS.out, n, s, d)) for s in seeds for d in schedules
      for n in variants):   # checked before any scoring
    sys.exit(f"study: error: {FLAGS.out}: no run of the {FLAGS.grid} grid for seeds "
             f"{seeds.start}-{seeds.stop - 1} (expected folders such as "
             f"{run_name(variants[0], seeds.start, schedules[0])}/); a mistyped --out?")
  try:
    run_grid(grid, variants, seeds, schedules, settings, extra, pairs, sweep)
  except runs.RunError as e:   # a damaged file, named with its line
    sys.exit(f"study: error: {e}")


def run_grid(grid, variants, seeds, schedules, settings, extra, pairs, sweep):
  """Trains and scores what is missing, then reports (`main`'s checked flags)."""
  os.makedirs(FLAGS.out, exist_ok=True)
  for seed, decay_steps, name in ((s, d, n) for s in seeds for d in schedules
                                  for n in variants):
    folder = run_dir(FLAGS.out, name, seed, decay_steps)
    if is_complete(folder, FLAGS.epochs):
      print(f"{os.path.basename(folder)}: complete, skipped")
    elif FLAGS.train:
      run_one(grid[name], seed, folder, dict(settings, decay_steps=decay_steps), extra)
    scored = (is_complete(folder, FLAGS.epochs)
              and bool(runs.RunFolder(folder).checkpoints("best")))
    if (FLAGS.routing and scored
        and tasks.get(grid[name].get("dataset", tasks.DEFAULT)).heads == "one_digit"
        and runs.RunFolder(folder).routing() is None):
      print(f"{os.path.basename(folder)}: measuring routing", flush=True)
      measure_routing(folder, grid[name]["iter_routing"])
    if (FLAGS.grid == "short" and sweep and scored
        and runs.RunFolder(folder).affine_results() is None):
      print(f"{os.path.basename(folder)}: scoring the affine test set", flush=True)
      measure_affine(folder, sweep)
  shipped = os.path.join(FLAGS.out, SHIPPED)
  if (FLAGS.grid == "short" and sweep and FLAGS.shipped
      and runs.RunFolder(shipped).affine_results() is None):
    print(f"{FLAGS.shipped}: scoring the affine test set", flush=True)
    os.makedirs(shipped, exist_ok=True)
    measure_affine(FLAGS.shipped, sweep, shipped)
  rows = summarize(FLAGS.out, FLAGS.grid, variants, seeds, FLAGS.epochs, schedules)
  figures = figures_of(FLAGS.grid)
  comparisons = compare(rows, pairs, figures)
  descriptive = (compare(rows, pairs, SELECTION_FREE) if figures == SHORT_FIGURES
                 else ())
  reference = shipped_sweep(FLAGS.out)
  table = report(rows, FLAGS.out, TITLES[FLAGS.grid], comparisons, figures, reference,
                 descriptive)
  if FLAGS.publish:
    report(rows, FLAGS.publish, TITLES[FLAGS.grid], comparisons, figures, reference,
           descriptive)
    publish(FLAGS.out, rows, FLAGS.publish)
    if reference:   # (its affine_results.json)
      runs.RunFolder(shipped).copy_small_files(os.path.join(FLAGS.publish, SHIPPED))
  print(table)


if __name__ == "__main__":
  define_flags()
  app.run(main)
