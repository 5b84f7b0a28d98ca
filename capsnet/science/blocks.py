"""Blocks of seeded runs, the machinery the along and confirmatory protocols
share: a block is one seed's run of each variant of a `protocols.Protocol`,
trained on its schedule, the weights kept at its kept epochs each scored once
on the test and affine sets; each run's figures from its files, the paired
differences of its pairs and measures, and the pieces of a block report."""
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


def score(folder, epoch, log_path, protocol):
  """Scores the weights kept at the end of `epoch` on the protocol's test
  sets (eval.py, the run's own convolutions and precision). Returns: the
  along_results.json entry. Raises RunError if the checkpoint is gone or
  eval.py fails."""
  ckpt = kept_checkpoint(folder, epoch)
  if ckpt is None:
    raise runs.RunError(f"{folder}: no checkpoint kept at the end of epoch {epoch} "
                        "(epochs/); the run must be trained again")
  entry = {"epoch": epoch, "step": runs.step_of(ckpt)}
  for split in protocol.test_sets:
    res = grids.evaluate(ckpt, os.path.join(folder, f"along_epoch{epoch}_{split}"),
                         log_path, f"--split={split}").results()
    entry[split] = {k: res[k] for k in ("count", "error_percent", "margin_loss_mean",
                                        "routing_entropy", "routing_max_c") if k in res}
  return entry


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
    results = scored(folder)
    for epoch in protocol.kept:
      if str(epoch) not in results:
        print(f"{os.path.basename(folder)}: scoring the weights of epoch {epoch}",
              flush=True)
        results[str(epoch)] = score(folder, epoch, folder + ".log", protocol)
        runs.RunFolder(folder).write_json(RESULTS_FILE, results)
    if publish:
      runs.RunFolder(folder).copy_small_files(
          os.path.join(publish, os.path.basename(folder)), SMALL_FILES)


def measures(folder, kept):
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
  """`found` (this command's runs) beside the runs of the other seeds in
  `publish`: a seed's block comes whole from one folder, never mixed."""
  here = {seed for per in found.values() for seed in per}
  merged = collect(publish, [s for s in published_seeds(publish, protocol.variants)
                             if s not in here], protocol)
  for variant, per in found.items():
    merged.setdefault(variant, {}).update(per)
  return merged


def collect(out, seeds, protocol):
  """{variant: {seed: measures(...)}} over the protocol's runs found in `out`."""
  found = {}
  for variant in protocol.variants:
    for seed in seeds:
      folder = study_report.run_dir(out, variant, seed)
      if os.path.isdir(folder):
        m = measures(folder, protocol.kept)
        if m:
          found.setdefault(variant, {})[seed] = m
  return found


def compare(found, protocol):
  """The protocol's pairs and measures at its kept epochs: {(a, b): {measure:
  {epoch: stats.paired_difference}}}, and the reversals [(a, b, measure,
  earlier epoch, later epoch)]."""
  table, reversals = {}, []
  for a, b, _ in protocol.pairs:
    for key, _, _ in protocol.measures:
      per_epoch = {}
      for epoch in protocol.kept:
        d = stats.paired_difference(figures(found, a, epoch, key),
                                    figures(found, b, epoch, key))
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


def figures(found, variant, epoch, key):
  """{seed: the measure `key` at `epoch`} of the variant's runs that reached it."""
  return {s: m[epoch][key] for s, m in found.get(variant, {}).items() if epoch in m}


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
  run_records = [{"run": study_report.run_name(v, s), "variant": v, "seed": s,
                  "epochs": {str(e): m for e, m in per.items()}}
                 for v, seeds in found.items() for s, per in seeds.items()]
  comparisons = [{"a": a, "b": b, "measure": key, "epoch": e, **d}
                 for (a, b), per_m in table.items() for key, per in per_m.items()
                 for e, d in per.items()]
  study_report.write_results(folder, text, protocol, final, run_records, comparisons,
                             details)


def seeds_of(found):
  return {s for per in found.values() for s in per}


def blocks_done(found, protocol):
  """Seeds whose runs of every variant are scored at every kept epoch."""
  return sorted(s for s in seeds_of(found)
                if all(set(protocol.kept) <= set(found.get(v, {}).get(s, {}))
                       for v in protocol.variants))


def only_seeds(found, seeds):
  """`found` ({variant: {seed: ...}}) with the runs of `seeds` alone."""
  return {v: {s: m for s, m in per.items() if s in seeds} for v, per in found.items()}


def complete_blocks(found, protocol):
  """(the seeds of the complete blocks, `found` with their runs alone): a
  block is its runs, each scored at every kept epoch; the runs of an
  incomplete one (a sitting that ended first) are left out."""
  done = blocks_done(found, protocol)
  return done, only_seeds(found, done)


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


