"""A study's report, from its runs' files alone: each run's figures
(`describe_run`), a row per variant (`summarize`), paired comparisons
(`compare`), the tables (`markdown`) and the plots, written by `report` into a
folder with results.md and results.json. A `protocols.Protocol` says how it is shown."""
import contextlib
import dataclasses
import io
import json
import os
import statistics

from capsnet.data import tasks
from capsnet.running import files
from capsnet.running import runs
from capsnet.running import schedule
from capsnet.science import protocols
from capsnet.science import stats

SHIPPED = "shipped"   # <out>/shipped/: the shipped weights' affine results


_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
          "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
          "seventeen", "eighteen", "nineteen", "twenty")


def in_words(n):
  """A count as the reports write it: a word up to twenty, else digits."""
  return _WORDS[n] if 0 <= n < len(_WORDS) else f"{n:,}"


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
  return (runs.RunFolder(folder).read_json(runs.TEST_RESULTS_FILE) is not None
          and epochs_done(folder) >= epochs)


def describe_run(folder, epochs):
  """One run's figures from its files; None if it has no epoch yet."""
  run = runs.RunFolder(folder)
  metrics = run.metrics()
  epoch_rows = [m for m in metrics if m["kind"] == "epoch"]
  if not epoch_rows:
    return None
  complete = is_complete(folder, epochs)
  test = run.read_json(runs.TEST_RESULTS_FILE) if complete else {}
  config = run.config() or {}
  model, batch = config.get("model", {}), config.get("train", {}).get("batch_size")
  val = [m for m in metrics if "val_error_percent" in m]
  weights = _better_weights(epoch_rows)
  key = "val_error_percent" + ("_averaged" if weights == "averaged" else "")
  epoch_val = [m[key] for m in epoch_rows if key in m]
  diags = run.diagnostics()
  wall = sum(m["wall_s"] for m in epoch_rows if "wall_s" in m)
  affine = (run.read_json(runs.AFFINE_RESULTS_FILE) if complete else None) or {}
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
      "host": run.read_json(runs.HOST_FILE),
      "best_val_error": min((m[key] for m in val if key in m), default=None),
      "val_weights": weights,            # whose validation figures these are
      "test_weights": test.get("weights", "raw"),
      "last_val_loss": next((m["val_loss"] for m in reversed(val) if "val_loss" in m),
                            None),
      "selected_step": (runs.step_of(test["checkpoint"]) if "checkpoint" in test
                        else None),
      "tied_steps": _tied_steps(val, key),
      "last_val_error": (statistics.mean(epoch_val[-protocols.LAST_EPOCHS:])
                         if complete and len(epoch_val) >= protocols.LAST_EPOCHS else None),
      "routing": run.read_json(runs.ROUTING_FILE) if complete else None,
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
    return (min(errors), statistics.mean(errors[-protocols.LAST_EPOCHS:]))
  return ("averaged" if figures("val_error_percent_averaged")
          < figures("val_error_percent") else "raw")


def summarize(out, protocol, variants, seeds, epochs, schedules=(schedule.DECAY_STEPS,)):
  """A dict per (variant of `protocol`, decay period of `schedules`) with an epoch
  done: its runs of `seeds` (`describe_run`) and, over the complete ones, the
  mean and (two or more) sample standard deviation of the test error and of the
  last 10 epochs' mean validation error."""
  rows = []
  for name, decay_steps in ((n, d) for n in variants for d in schedules):
    described = [describe_run(run_dir(out, name, s, decay_steps), epochs) for s in seeds]
    described = [dict(r, seed=s) for s, r in zip(seeds, described, strict=True)
                 if r is not None]
    if not described:
      continue
    done = [r for r in described if r["complete"]]
    tests = [r["test_error"] for r in done]
    vals = [r["best_val_error"] for r in described if r["best_val_error"] is not None]
    lasts = [r["last_val_error"] for r in done if r["last_val_error"] is not None]
    spec = protocol.variants[name]
    rows.append({
        "variant": name, "dataset": spec.get("dataset", tasks.DEFAULT),
        "iter_routing": spec["iter_routing"],
        "stop_gradient": spec.get("stop_gradient", True),
        "use_decoder": spec.get("use_decoder", True), "decay_steps": decay_steps,
        "epochs": epochs, "seeds": len(done), "runs": described,
        "test_errors": tests,
        "test_error_mean": statistics.mean(tests) if tests else None,
        "test_error_std": statistics.stdev(tests) if len(tests) > 1 else None,
        "best_val_error_mean": statistics.mean(vals) if vals else None,
        "last_val_errors": lasts,
        "last_val_error_mean": statistics.mean(lasts) if lasts else None,
        "last_val_error_std": statistics.stdev(lasts) if len(lasts) > 1 else None,
        "images_per_sec": statistics.mean(r["images_per_sec"] for r in described),
        "spreads": {key: _spread([r[key] for r in done]) for key in SUMMARIZED},
        "diag": {key: tuple(mean_or_none(r["diag"][key][i] for r in described)
                            for i in (0, 1))
                 for key in ("digit_caps/weights", "conv1/weights")},
        "curves": [r["curve"] for r in described],
        "images_curves": [r["images_curve"] for r in described]})
  return rows


# Per-run figures that summarize() also gives per variant (mean, std).
SUMMARIZED = ("test_error", "test_margin_loss", "affine_error")


def _spread(values):
  """{"values", "mean", "std"} of the figures that are not None."""
  values = [v for v in values if v is not None]
  return {"values": values, "mean": statistics.mean(values) if values else None,
          "std": statistics.stdev(values) if len(values) > 1 else None}


def mean_or_none(values):
  values = [v for v in values if v is not None]
  return statistics.mean(values) if values else None


def compare(rows, pairs, figures=protocols.BEST_VALIDATION):
  """Paired differences B - A by seed of `figures` ((key, label, format)) for
  each (A, B) of `pairs`, at each decay period both have in `rows`: a dict per
  pair and period, each figure's `stats.paired_difference` or None."""
  by_key = {(r["variant"], r["decay_steps"]): r for r in rows}
  out = []
  for a, b in pairs:
    for (name, decay_steps), row_a in by_key.items():
      row_b = by_key.get((b, decay_steps))
      if name != a or row_b is None:
        continue
      result = {"a": a, "b": b, "decay_steps": decay_steps}
      for key, _, _ in figures:
        per_seed = [{x["seed"]: x[key] for x in row["runs"] if x["complete"]}
                    for row in (row_a, row_b)]
        result[key] = stats.paired_difference(*per_seed)
      out.append(result)
  return out


def _fmt(x, spec):
  return "–" if x is None else format(x, spec)


def table(header, rows):
  """A markdown table's lines: the `header`'s cells, then a line per row of cells."""
  return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
          *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def _duration(seconds):
  h, m = divmod(round(seconds / 60), 60)
  return f"{h} h {m:02d} min" if h else f"{m} min"


def markdown(rows, protocol, comparisons=(), descriptive=()):
  """The study's tables: one line per variant, one per run, then the paired
  comparisons (of the `protocol`'s measures; `descriptive`: of its descriptive
  figures, with where the best-checkpoint ties fell) and, where measured,
  how far routing moves the couplings."""
  def variant(r):
    (w0, w1), (c0, c1) = r["diag"]["digit_caps/weights"], r["diag"]["conv1/weights"]
    per_seed = ", ".join(
        f"{x['test_error']:.2f}" if x["complete"] else
        f"in progress ({x['epochs_done']}/{r['epochs']} epochs)" for x in r["runs"])
    return [r["variant"], r["iter_routing"], "yes" if r["use_decoder"] else "no",
            "n/a" if r["iter_routing"] == 1 else r["stop_gradient"],
            f"{r['decay_steps']} steps", f"{r['seeds']} of {len(r['runs'])}",
            _mean_std(r["test_error_mean"], r["test_error_std"]), per_seed,
            _fmt(r["best_val_error_mean"], ".3f"), f"{r['images_per_sec']:.0f}",
            f"{_fmt(w0, '.3g')} → {_fmt(w1, '.3g')}", f"{_fmt(c0, '.3g')} → {_fmt(c1, '.3g')}"]
  multi = _multimnist(rows)
  def run(x):
    one = x["test_at_least_one"]
    return [x["run"], x["precision"],
            f"{x['epochs_done']}" + ("" if x["complete"] else " (in progress)"), x["steps"],
            _fmt(x["test_error"], ".2f"), _fmt(x["test_errors_count"], "d"),
            _fmt(x["best_val_error"], ".2f"), f"{x['images_per_sec']:.0f}",
            _duration(x["train_wall_s"])] + ([
                _fmt(x["images_seen"], ",d"), _fmt(None if one is None else 100 * one, ".2f")]
                                             if multi else [])
  lines = table(["variant", "r", "decoder", "stop_gradient", "lr decay every", "seeds done",
                 "test error % (mean ± std)", "per seed", "best val error %", "images/s",
                 "routing share of W grad, start → end", "of conv1 grad"],
                [variant(r) for r in rows])
  lines += [""] + table(
      ["run", "precision", "epochs", "steps", "test error %", "test errors",
       "best val error %", "images/s", "training wall time"]
      + (["training pairs seen", "test: at least one right %"] if multi else []),
      [run(x) for r in rows for x in r["runs"]])
  seed_table = _short_table(rows) if protocol.scores_affine else _seed_table(rows)
  lines += (seed_table + _comparison_table(comparisons, protocol)
            + _selection_table(rows, protocol, descriptive) + _routing_table(rows)
            + _affine_table(rows))
  return "\n".join(lines) + "\n"


def _mean_std(mean, std):
  return _fmt(mean, ".3f") + ("" if std is None else f" ± {std:.3f}")


def _seed_table(rows):
  """Both figures of the decision rule, per variant over its finished seeds."""
  if not any(r["seeds"] for r in rows) or _multimnist(rows):
    return []
  def row(r):
    done = [x for x in r["runs"] if x["complete"]]
    def per(key, spec):
      return ", ".join(
          f"{_fmt(x[key], spec)} (seed {x['seed']})" for x in done) or "–"
    return [r["variant"], r["decay_steps"], len(done),
            _mean_std(r["test_error_mean"], r["test_error_std"]), per("test_error", ".2f"),
            _mean_std(r["last_val_error_mean"], r["last_val_error_std"]),
            per("last_val_error", ".3f")]
  return ["", "Both figures of the decision rule over the finished seeds (mean ± "
          "sample std):", ""] + table(
              ["variant", "lr decay every", "seeds", "test error %", "per seed",
               f"mean val error of the last {protocols.LAST_EPOCHS} epochs %", "per seed"],
              [row(r) for r in rows])


def _short_table(rows):
  """The short protocol's three measures, per variant over its finished blocks."""
  if not any(r["seeds"] for r in rows):
    return []
  def row(r):
    done = [x for x in r["runs"] if x["complete"]]
    cells = [r["variant"], len(done)]
    for key, spec in (("test_error", ".2f"), ("test_margin_loss", ".5f"),
                      ("affine_error", ".2f")):
      m = r["spreads"][key]
      cells.append(_fmt(m["mean"], spec) + ("" if m["std"] is None
                                             else f" ± {format(m['std'], spec)}"))
      cells.append(", ".join(f"{_fmt(x[key], spec)} ({x['seed']})" for x in done) or "–")
    return cells
  return ["", "The three measures over the finished blocks (mean ± sample std; per "
          "block = seed):", ""] + table(
              ["variant", "blocks", "test error %", "per block", "mean test margin loss",
               "per block", "affine-test error %", "per block"], [row(r) for r in rows])


def _affine_table(rows):
  """Each run's affine error against the largest rotation (the sweep)."""
  swept = [x for r in rows for x in r["runs"] if x.get("affine_sweep")]
  if not swept:
    return []
  degrees = sorted({d for x in swept for d, _ in x["affine_sweep"]})
  return ["", "Severity sweep (descriptive, not part of the decision rule): affine-test "
          "error % against the largest rotation, the other ranges affNIST's:", ""] + table(
              ["run", *(f"{d:g}°" for d in degrees)],
              [[x["run"], *(_fmt(dict(x["affine_sweep"]).get(d), ".2f") for d in degrees)]
               for x in swept])


# The format of a figure's differences (the others: +.3f).
def _selection_table(rows, protocol, descriptive):
  """Where the best-checkpoint ties fell, and the `protocol`'s descriptive
  figures' paired comparisons (`descriptive`); [] without them."""
  if not descriptive:
    return []
  lines = ["", "Beside the registered measures (descriptive, not part of the rule): "
           "the checkpoint each run scored, the steps tied at its lowest validation "
           "error (train.py kept the first of them when these runs trained; it now "
           "keeps the one with the lower validation loss), and the validation loss at the "
           "last step, which no checkpoint choice touches:", ""] + table(
               ["run", "scored step", "steps tied at the lowest val error",
                "val loss, last step"],
               [[x["run"], _fmt(x["selected_step"], "d"),
                 ", ".join(map(str, x["tied_steps"])) if len(x["tied_steps"]) > 1 else "none",
                 _fmt(x["last_val_loss"], ".5f")] for r in rows for x in r["runs"]])
  return lines + _comparison_table(descriptive, dataclasses.replace(
      protocol, measures=protocol.descriptive, note=""))


def _comparison_table(comparisons, protocol):
  """The paired comparisons of the `protocol`'s measures, as its unit, note and
  wording have them."""
  if not comparisons:
    return []
  unit = protocol.unit
  losses = any("loss" in key for key, _, _ in protocol.measures)
  lines = ["", f"Paired comparisons, B - A by {unit} (positive: A has the lower error"
           + (" or loss" if losses else "") + "); 95% interval mean ± t(0.975, n-1) "
           "sd / sqrt(n); called only when it excludes zero" + protocol.note + ":", ""]
  def row(c, key, label, spec):
    d = c[key]
    if d is None:
      return [c["a"], c["b"], c["decay_steps"], label, 0, "–", "–", "–",
              stats.verdict(d, spec=spec, within=protocol.within)]
    return [c["a"], c["b"], c["decay_steps"], label, d["n"], ", ".join(
        f"{format(x, spec)} ({unit} {s})" for s, x in zip(d["seeds"], d["diffs"], strict=True)),
            format(d["mean"], spec),
            "–" if d["lo"] is None else f"[{format(d['lo'], spec)}, {format(d['hi'], spec)}]",
            stats.verdict(d, spec=spec, within=protocol.within)]
  return lines + table(["A", "B", "lr decay every", "figure", f"{unit}s",
                        f"B - A per {unit}", "mean", "95% interval", "verdict"],
                       [row(c, *measure) for c in comparisons
                        for measure in protocol.measures])


def _routing_table(rows):
  """routing.json of each finished run: how far routing moves c from uniform."""
  measured = [x for r in rows for x in r["runs"] if x.get("routing")]
  if not measured:
    return []
  lines = ["", "How far routing moves the couplings on the 10,000 test images "
           "(eval.py on the best-validation checkpoint; entropy in nats, uniform "
           "= log 10 = 2.3026; mean max c, uniform = 0.1), and what the other "
           "routing count changes:", ""]
  def row(x):
    m = x["routing"]
    own, other = m["own"], m["other"]
    return [x["run"], own["iter_routing"], " → ".join(f"{e:.4f}" for e in own["entropy"]),
            " → ".join(f"{c:.4f}" for c in own["max_c"]), own["errors"],
            other["iter_routing"], other["errors"], m["changed"], m["fixed"], m["broken"]]
  return lines + table(["run", "r", "mean entropy of c, per iteration",
                        "mean max c, per iteration", "test errors", "evaluated with r =",
                        "test errors", "predictions changed", "fixed", "broken"],
                       [row(x) for x in measured])


@contextlib.contextmanager
def drawing(path, figsize, **subplots):
  """A figure's axes (`plt.subplots`' keywords), written to `path` as a PNG
  when the block ends."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(figsize=figsize, **subplots)
  png = io.BytesIO()
  try:
    yield axes
    fig.tight_layout()
    fig.savefig(png, format="png")
  finally:   # a plot that fails closes its figure too, and writes nothing
    plt.close(fig)
  files.atomic_write(path, png.getvalue())


def _finish(ax, title, grid="major", legend=(), **title_font):
  """The common end of a plot: a grid, a legend (its keywords beside
  fontsize 8), a title."""
  ax.grid(True, which=grid, alpha=0.3)
  ax.legend(fontsize=8, **dict(legend))
  ax.set_title(title, **title_font)


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
  """(xs ascending, means, mins, maxs) over `curves`, one list of (x, y) a seed;
  a seed without a point at some x is left out there."""
  at = {}
  for curve in curves:
    for x, y in curve:
      at.setdefault(round(x, 6), []).append(y)
  xs = sorted(at)
  return (xs, [statistics.mean(at[x]) for x in xs], [min(at[x]) for x in xs],
          [max(at[x]) for x in xs])


def plot(rows, path, title="CapsNet on MNIST: routing variants", x="epoch",
         reference=None):
  """Validation error against epoch (`x` "pairs": MultiMNIST pairs seen, in
  millions): a line per variant, the mean over its seeds in a band from the
  lowest to the highest; `reference` (error %, label) a horizontal line."""
  from matplotlib import ticker
  key, scale, xlabel = X_AXES[x]
  many = max(len(c) for r in rows for c in r[key]) > 30
  with drawing(path, (7, 4.5), dpi=110) as ax:
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
    _finish(ax, title, grid="both", legend={
        "title": "mean over seeds; band: lowest to highest seed", "title_fontsize": 8})


def _runs_lines(ax, rows, curve, skip=lambda r: False):
  """A line per run of each row (`curve(run)`: its (xs, ys), or None), the
  row's colour, its first seed solid and labelled, the others dashed."""
  for k, r in enumerate(rows):
    drawn = [c for c in map(curve, r["runs"]) if c] if not skip(r) else []
    for s, (xs, ys) in enumerate(drawn):
      ax.plot(xs, ys, color=f"C{k}", linewidth=1, linestyle="-" if s == 0 else "--",
              label=_label(r) if s == 0 else None)


def plot_diagnostic(rows, path):
  """The share of W's gradient that flows through the coefficients, by epoch."""
  with drawing(path, (7, 4), dpi=110) as ax:
    _runs_lines(ax, rows, lambda x: x["diag_curve"] and tuple(zip(*x["diag_curve"], strict=True)),
                skip=lambda r: r["iter_routing"] == 1)
    ax.set_xlabel("epoch")
    ax.set_ylabel("||g_full - g_stop|| / ||g_full||  (W)")
    _finish(ax, "Gradient through the routing coefficients (fixed batch of 32)")


def plot_affine(rows, path):
  """Affine-test error per variant (x) and block (a line per block)."""
  names = [r["variant"] for r in rows]
  seeds = sorted({x["seed"] for r in rows for x in r["runs"]})
  with drawing(path, (6, 4), dpi=110) as ax:
    for k, seed in enumerate(seeds):
      ys = [next((x["affine_error"] for x in r["runs"] if x["seed"] == seed), None)
            for r in rows]
      xs = [i for i, y in enumerate(ys) if y is not None]
      ax.plot(xs, [ys[i] for i in xs], color=f"C{k}", marker="o", label=f"block {seed}")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names)
    ax.set_ylabel("affine-test error (%)")
    _finish(ax, "Affine test set (28x28, affNIST's ranges; not affNIST)", fontsize=10)


def plot_sweep(rows, shipped, path):
  """Affine error against the largest rotation: a line per run, and the
  shipped weights' in black."""
  with drawing(path, (7, 4.5), dpi=110) as ax:
    _runs_lines(ax, rows, lambda x: x["affine_sweep"]
                and tuple(zip(*x["affine_sweep"], strict=True)))
    if shipped:
      ds, es = zip(*shipped, strict=True)
      ax.plot(ds, es, color="black", linewidth=1.5, label="shipped r3_recon (50 epochs)")
    ax.set_xlabel("largest rotation (degrees); shear, scale, shift in affNIST's ranges")
    ax.set_ylabel("error (%)")
    ax.set_yscale("log")
    _finish(ax, "Severity sweep (descriptive)", grid="both", fontsize=10)


# The paper's MultiMNIST result (Section 6): CapsNet, r = 3, with reconstruction.
MULTIMNIST_PAPER = (5.2, "paper: 5.2% test error after 60M pairs")


def write_results(folder, text, protocol, final, run_records, comparisons=(), details=None):
  """results.md (`text`) and results.json in `folder`. results.json has one
  shape for every study: {"protocol", "title", "final" (every registered run
  in), "runs" (a record a run: "run", "variant", "seed" and its figures),
  "comparisons" (a record a pair, measure and point: "a", "b", "measure", the
  epoch or decay period, and the paired difference), "details" (what the
  protocol's report adds)}."""
  os.makedirs(folder, exist_ok=True)
  files.atomic_write(os.path.join(folder, "results.md"), text)
  payload = {"protocol": protocol.name, "title": protocol.title, "final": bool(final),
             "runs": list(run_records), "comparisons": list(comparisons),
             "details": details or {}}
  files.atomic_write(os.path.join(folder, "results.json"),
                     json.dumps(payload, indent=1, sort_keys=True) + "\n")


def report(rows, folder, protocol, comparisons=(), shipped=(), descriptive=()):
  """results.md, results.json (`write_results`: each run's figures, each
  comparison by measure, the rows per variant in "details") and the plots in
  `folder`; for a `protocol` whose runs are scored on the affine sets also
  affine.png (affine error per variant and block) and, where swept,
  affine_sweep.png (beside the `shipped` weights' sweep)."""
  table = markdown(rows, protocol, comparisons, descriptive)
  if shipped:
    table += ("\nThe shipped weights (pretrained/r3_recon, 50 epochs), same sweep: "
              + ", ".join(f"{d:g}°: {e:.2f}" for d, e in shipped) + "\n")
  run_records = [dict(x, variant=r["variant"], decay_steps=r["decay_steps"])
                 for r in rows for x in r["runs"]]
  by_measure = [{"a": c["a"], "b": c["b"], "decay_steps": c["decay_steps"], "measure": key,
                 **(d or {})} for c in comparisons for key, d in c.items()
                if key not in ("a", "b", "decay_steps")]
  write_results(folder, table, protocol, run_records and all(x["complete"] for x in run_records),
                run_records, by_measure,
                {"rows": [{k: v for k, v in r.items() if k != "runs"} for r in rows]})
  if rows:
    x, reference = ("pairs", MULTIMNIST_PAPER) if _multimnist(rows) else ("epoch", None)
    plot(rows, os.path.join(folder, "val_error.png"), protocol.title, x=x, reference=reference)
  if any(r["iter_routing"] > 1 for r in rows):
    plot_diagnostic(rows, os.path.join(folder, "diagnostic.png"))
  if protocol.scores_affine and any(x["affine_error"] is not None for r in rows for x in r["runs"]):
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


def shipped_sweep(out):
  """The shipped weights' affine sweep [(degrees, error %)] from
  <out>/shipped/affine_results.json, or []."""
  res = runs.RunFolder(os.path.join(out, SHIPPED)).read_json(runs.AFFINE_RESULTS_FILE) or {}
  return [(x["max_rotation_deg"], x["error_percent"]) for x in res.get("sweep", [])]
