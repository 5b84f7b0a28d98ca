"""Blocks of seeded runs, the machinery the along and confirmatory protocols
share: a block is one seed's run of each variant of a `protocols.Protocol`,
trained on its schedule, the weights kept at its kept epochs each scored once
on the test and affine sets; each run's figures from its files, the paired
differences of its pairs and measures, and the pieces of a block report."""
import dataclasses
import os

from capsnet.running import runs
from capsnet.science import grids
from capsnet.science import report as study_report
from capsnet.science import stats

RESULTS_FILE = "along_results.json"   # a run's scorings (the along protocol named it)

SMALL_FILES = (runs.CONFIG_FILE, runs.METRICS_FILE, runs.DIAGNOSTICS_FILE,
               runs.HOST_FILE, RESULTS_FILE)


def scored(folder):
  """along_results.json of a run ({epoch: {...}}, keys as strings), or {}."""
  return runs.RunFolder(folder).read_json(RESULTS_FILE) or {}


def kept_checkpoint(folder, epoch):
  """The checkpoint prefix train.py kept at the end of `epoch`, or None."""
  ends = {r["epoch"]: r["step"] for r in runs.RunFolder(folder).metrics("epoch")}
  prefix = os.path.join(runs.RunFolder(folder).checkpoint_folder("epochs"),
                        f"{runs.CHECKPOINT_PREFIX}-{ends.get(epoch)}")
  return prefix if epoch in ends and os.path.exists(prefix + ".index") else None


def score(folder, epoch, protocol, run_eval):
  """The scorings entry of the weights kept at the end of `epoch` on the
  protocol's test sets (eval.py, the run's own convolutions and precision),
  with the indices of the misclassified images; None if a stop came.
  `run_eval(command)`: runs eval.py, False if stopped; raises if it fails.
  Raises RunError if the checkpoint is gone."""
  ckpt = kept_checkpoint(folder, epoch)
  if ckpt is None:
    raise runs.RunError(f"{folder}: no checkpoint kept at the end of epoch {epoch} "
                        "(epochs/); the run must be trained again")
  entry = {"epoch": epoch, "step": runs.step_of(ckpt)}
  for split in protocol.test_sets:
    out_dir = os.path.join(folder, f"along_epoch{epoch}_{split}")
    if not run_eval(grids.eval_command(ckpt, out_dir, f"--split={split}")):
      return None
    evaluated = runs.EvalFolder(out_dir)
    res, pred = evaluated.results(), evaluated.predictions()
    entry[split] = {k: res[k] for k in ("count", "error_percent", "margin_loss_mean",
                                        "routing_entropy", "routing_max_c") if k in res}
    entry[split]["wrong"] = [i for i, y, p in zip(pred["index"], pred["label"],
                                                  pred["prediction"], strict=True) if y != p]
  return entry


def score_kept(folder, epochs, protocol, run_eval, name):
  """Scores each of the kept `epochs` not scored yet (`score`), writing the
  run's scorings after each; `name` heads the lines it prints. Returns:
  False if a stop came."""
  results = scored(folder)
  for epoch in (e for e in epochs if str(e) not in results):
    print(f"{name}: scoring the weights of epoch {epoch}", flush=True)
    entry = score(folder, epoch, protocol, run_eval)
    if entry is None:
      return False
    results[str(epoch)] = entry
    runs.RunFolder(folder).write_json(RESULTS_FILE, results)
  return True


def settings(protocol):
  """The train.py settings of a block's run (`grids.train_command`)."""
  return {"epochs": protocol.epochs, "precision": protocol.precision,
          "decay_steps": protocol.decay_steps, **protocol.run_flags, "kept": protocol.kept}


def publish_folder(publish, out):
  """Where a command's runs and report are published: `publish`, or None
  where it is `out` itself (or not given)."""
  same = os.path.abspath(publish or out) == os.path.abspath(out)
  return None if same else publish


def run_blocks(out, seeds, protocol, publish, extra=()):
  """Trains (or resumes) and scores the blocks of `seeds` in `out` as the
  `protocol` has them, each run published to `publish` (None: nowhere) as it
  is scored."""
  run_settings = settings(protocol)
  for seed, (variant, spec) in ((s, v) for s in seeds for v in protocol.variants.items()):
    folder = study_report.run_dir(out, variant, seed)
    if not study_report.is_complete(folder, protocol.epochs):
      grids.run_one(spec, seed, folder, run_settings,
                    [f"--keep_epochs={','.join(str(e) for e in protocol.kept)}", *extra])
    score_kept(folder, protocol.kept, protocol,
               lambda cmd, log=folder + ".log": grids.call(cmd, log),
               os.path.basename(folder))
    if publish:
      runs.RunFolder(folder).copy_small_files(
          os.path.join(publish, os.path.basename(folder)), SMALL_FILES)


@dataclasses.dataclass(frozen=True)
class Scores:
  """The measures of a protocol's runs at their scored kept epochs:
  `runs[(variant, seed)] = {epoch: {measure: value}}`, a run's epochs those
  it has reached and scored."""
  runs: dict = dataclasses.field(default_factory=dict)

  @property
  def seeds(self):
    return sorted({seed for _, seed in self.runs})

  def at(self, variant, epoch):
    """{seed: {measure: value}} of the variant's runs scored at `epoch`."""
    return {s: per[epoch] for (v, s), per in self.runs.items() if v == variant and epoch in per}

  def by_seed(self, variant, epoch, measure):
    """{seed: the `measure` at `epoch`} of the variant's runs that reached it."""
    return {s: m[measure] for s, m in self.at(variant, epoch).items()}

  def of(self, seeds):
    """These scores of the runs of `seeds` alone."""
    return Scores({k: per for k, per in self.runs.items() if k[1] in seeds})

  def complete(self, protocol):
    """(the seeds of the complete blocks, their scores alone): a block is
    complete when its run of every variant is scored at every kept epoch (an
    incomplete one, a sitting that ended first, is left out)."""
    done = [s for s in self.seeds if all(set(protocol.kept) <= set(self.runs.get((v, s), {}))
                                         for v in protocol.variants)]
    return done, self.of(done)

  def __or__(self, other):
    """Both scores; a run in both is `other`'s."""
    return Scores({**self.runs, **other.runs})


def run_scores(folder, kept):
  """{epoch: {measure: value}} of one run's files (an epoch not scored yet,
  or not trained yet, is left out); {} if the folder has no run."""
  results = scored(folder)
  rows = {r["epoch"]: r for r in runs.RunFolder(folder).metrics("epoch")}
  diags = runs.RunFolder(folder).diagnostics()
  out = {}
  for epoch in kept:
    entry = results.get(str(epoch))
    if entry is None or epoch not in rows:
      continue
    test, affine = entry["test"], entry.get("affine", {})
    out[epoch] = {"test_margin_loss": test["margin_loss_mean"],
                  "test_error": test["error_percent"],
                  "affine_error": affine.get("error_percent"),
                  "train_loss": rows[epoch]["train_loss"],
                  "val_loss": rows[epoch].get("val_loss"),
                  "max_c": (test.get("routing_max_c") or [None])[-1],
                  "grad_share": _grad_share(diags, rows[epoch]["step"])}
  return out


def _grad_share(diags, step):
  """The share of W's gradient through the couplings (the gradient
  diagnostic, `digit_caps/weights`) in its last row at or before `step`."""
  before = [d for d in diags if d["step"] <= step and "digit_caps/weights" in d]
  return before[-1]["digit_caps/weights"] if before else None


def published_seeds(folder, variants):
  """The seeds of the run folders (<variant>_seed<k>/) of `variants` in `folder`."""
  seeds = set()
  for name in os.listdir(folder) if os.path.isdir(folder) else ():
    variant, _, seed = name.rpartition("_seed")
    if variant in variants and seed.isdigit():
      seeds.add(int(seed))
  return sorted(seeds)


def with_published(found, publish, protocol):
  """`found` (this command's `Scores`) beside the runs of the other seeds in
  `publish`: a seed's block comes whole from one folder, never mixed."""
  others = [s for s in published_seeds(publish, protocol.variants) if s not in found.seeds]
  return collect(publish, others, protocol) | found


def collect(out, seeds, protocol):
  """The `Scores` of the protocol's runs of `seeds` found in `out`."""
  found = {}
  for variant in protocol.variants:
    for seed in seeds:
      folder = study_report.run_dir(out, variant, seed)
      scores = run_scores(folder, protocol.kept) if os.path.isdir(folder) else {}
      if scores:
        found[(variant, seed)] = scores
  return Scores(found)


def compare(found, protocol):
  """The protocol's pairs and measures at its kept epochs (`found`: `Scores`):
  {(a, b): {measure: {epoch: stats.paired_difference}}}, and the reversals
  [(a, b, measure, earlier epoch, later epoch)]."""
  table, reversals = {}, []
  for a, b, _ in protocol.pairs:
    for key, _, _ in protocol.measures:
      per_epoch = {}
      for epoch in protocol.kept:
        d = stats.paired_difference(found.by_seed(a, epoch, key), found.by_seed(b, epoch, key))
        if d is not None:
          per_epoch[epoch] = d
      table.setdefault((a, b), {})[key] = per_epoch
      calls = [(e, d["mean"] > 0) for e, d in sorted(per_epoch.items()) if d["called"]]
      for i, (early, sign) in enumerate(calls):
        later = next((e for e, s in calls[i + 1:] if s != sign), None)
        if later is not None:
          reversals.append((a, b, key, early, later))
          break
  return table, reversals


def partial_note(partial):
  """The sentence that names the incomplete blocks left out, or ""."""
  return (f" Seed(s) {', '.join(map(str, partial))}: an incomplete block (a run or a "
          "scoring missing), left out until it is complete." if partial else "")


def measure_tables(table, protocol, heading="##", pilot_primary=True):
  """A markdown table per measure: each pair's cell (`stats.cell`) at each
  kept epoch, under `heading`; `pilot_primary` False: without the along
  protocol's "(primary)" mark (another protocol's descriptive tables)."""
  kept, lines = protocol.kept, []
  for key, what, spec in protocol.measures:
    what = what if pilot_primary else what.replace(" (primary)", "")
    lines += [f"{heading} {what}", ""] + study_report.table(
        ["pair (A:B)", *(f"epoch {e}" for e in kept)],
        [[f"{name} ({a}:{b})", *(stats.cell(table[(a, b)][key].get(e), spec) for e in kept)]
         for a, b, name in protocol.pairs]) + [""]
  return lines


def write_report(folder, text, protocol, final, found, table, details):
  """results.md (`text`) and results.json (`study_report.write_results`):
  each run's measures at its kept epochs from `found`, the comparisons of
  `table` (`compare`'s) at each epoch, and `details`."""
  order = list(protocol.variants)
  run_records = [{"run": study_report.run_name(v, s), "variant": v, "seed": s,
                  "epochs": {str(e): m for e, m in per.items()}}
                 for (v, s), per in sorted(found.runs.items(),
                                           key=lambda item: (order.index(item[0][0]), item[0][1]))]
  comparisons = [{"a": a, "b": b, "measure": key, "epoch": e, **d}
                 for (a, b), per_m in table.items() for key, per in per_m.items()
                 for e, d in per.items()]
  study_report.write_results(folder, text, protocol, final, run_records, comparisons,
                             details)


def epoch_band(ax, per, kept, band_label=None, **line):
  """One pair's paired difference against the registered epochs (`per`:
  {epoch: stats.paired_difference}): its means joined, in its 95% interval
  band. Returns: (the epochs drawn, those with a band)."""
  xs = [e for e in kept if e in per]
  drawn, = ax.plot(xs, [per[e]["mean"] for e in xs], marker="o", **line)
  band = [e for e in xs if per[e]["lo"] is not None]
  ax.fill_between(band, [per[e]["lo"] for e in band], [per[e]["hi"] for e in band],
                  color=drawn.get_color(), alpha=0.2, linewidth=0, label=band_label)
  return xs, band


def epoch_axis(ax, kept, fixed=True):
  """The zero line and the registered epochs on a log axis; `fixed`: the
  axis spans them even where nothing is drawn."""
  ax.axhline(0, color="black", linewidth=0.8)
  if fixed:
    ax.set_xlim(min(kept) / 1.2, max(kept) * 1.2)
  ax.set_xscale("log")
  ax.set_xticks(list(kept))
  ax.set_xticklabels([str(e) for e in kept])
  ax.set_xlabel("epoch")


def parse_kept(values, epochs):
  """--kept's values as a sorted tuple of epochs.
  Raises: ValueError naming the value unless each is an epoch of 1..epochs."""
  try:
    kept = tuple(sorted({int(e) for e in values}))
  except ValueError:
    kept = ()
  if not kept or kept[0] < 1 or kept[-1] > epochs:
    raise ValueError(f"--kept={','.join(values)}: expected epochs between 1 and "
                     f"--epochs={epochs}")
  return kept


