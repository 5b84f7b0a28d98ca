"""The along-training protocol (docs/along.md): a block's runs and their
scorings, each run's figures from its files, the rule (paired differences,
calls, reversals) and the report. `python -m capsnet.along` is its command
line.
"""
import json
import os
import sys

from absl import flags

from capsnet.running import files
from capsnet.running import runs
from capsnet.running import schedule
from capsnet.science import grids
from capsnet.science import report as study_report
from capsnet.science import stats

VARIANTS = grids.GRIDS["short"].variants   # r1_recon, r3_recon, r3_recon_nostop: the same flags

EPOCHS = 10

KEPT = (1, 2, 5, 10)              # the registered epochs

PAIRS = (("r3_recon", "r3_recon_nostop", "the stop: nostop - stop"),
         ("r1_recon", "r3_recon", "routing with the stop: r3 - r1"),
         ("r1_recon", "r3_recon_nostop", "routing without it: r3 nostop - r1"))

MEASURES = (   # key, what it is, its format
    ("test_margin_loss", "mean test margin loss (primary)", "+.5f"),
    ("test_error", "test error, %", "+.3f"),
    ("affine_error", "affine-test error, %", "+.3f"),
    ("train_loss", "the epoch's training loss", "+.5f"))

RESULTS_FILE = "along_results.json"

SMALL_FILES = (runs.CONFIG_FILE, runs.METRICS_FILE, runs.DIAGNOSTICS_FILE,
               runs.HOST_FILE, RESULTS_FILE)

TITLE = "The stop_gradient question along training (docs/along.md)"


def scored(folder):
  """along_results.json of a run ({epoch: {...}}, keys as strings), or {}."""
  return runs.RunFolder(folder).read_json(RESULTS_FILE) or {}


def kept_checkpoint(folder, epoch):
  """The checkpoint prefix train.py kept at the end of `epoch`, or None."""
  ends = {r["epoch"]: r["step"] for r in runs.RunFolder(folder).metrics("epoch")}
  prefix = os.path.join(runs.RunFolder(folder).checkpoint_folder("epochs"),
                        f"{runs.CHECKPOINT_PREFIX}-{ends.get(epoch)}")
  return prefix if epoch in ends and os.path.exists(prefix + ".index") else None


def score(folder, epoch, log_path):
  """Scores the weights kept at the end of `epoch` on the test set and the
  affine test set (eval.py, the run's own convolutions and precision).
  Returns: the along_results.json entry. Exits if the checkpoint is gone
  or eval.py fails."""
  ckpt = kept_checkpoint(folder, epoch)
  if ckpt is None:
    sys.exit(f"along: error: {folder}: no checkpoint kept at the end of epoch "
             f"{epoch} (epochs/); the run must be trained again in this sitting")
  entry = {"epoch": epoch, "step": runs.step_of(ckpt)}
  for split in ("test", "affine"):
    res = grids.evaluate(ckpt, os.path.join(folder, f"along_epoch{epoch}_{split}"),
                         log_path, f"--split={split}", program="along").results()
    entry[split] = {k: res[k] for k in ("count", "error_percent", "margin_loss_mean",
                                        "routing_entropy", "routing_max_c") if k in res}
  return entry


def run_blocks(out, seeds, precision, epochs, kept, publish, extra=()):
  """Trains (or resumes) and scores the blocks of `seeds` in `out`, each
  `epochs` long on the paper's schedule, keeping and scoring the `kept`
  epochs' weights, each run published to `publish` (None: nowhere) as it
  is scored."""
  settings = {"epochs": epochs, "precision": precision,
              "decay_steps": schedule.DECAY_STEPS, "diag_every": 100,
              "val_every": 0, "kept": kept}
  os.makedirs(out, exist_ok=True)
  for seed in seeds:
    run_block(out, seed, settings, publish, extra)


def publish_folder(publish, out):
  """Where a command's runs and report are published: `publish`, or None
  where it is `out` itself (or not given)."""
  same = os.path.abspath(publish or out) == os.path.abspath(out)
  return None if same else publish


def run_block(out, seed, settings, publish, extra=()):
  """Trains (or resumes) in `out` and scores one seed's three runs,
  publishing each."""
  for variant, spec in VARIANTS.items():
    folder = study_report.run_dir(out, variant, seed)
    if not study_report.is_complete(folder, settings["epochs"]):
      grids.run_one(spec, seed, folder, settings,
                    [f"--keep_epochs={','.join(str(e) for e in settings['kept'])}",
                     *extra])
    results = scored(folder)
    for epoch in settings["kept"]:
      if str(epoch) not in results:
        print(f"{os.path.basename(folder)}: scoring the weights of epoch {epoch}",
              flush=True)
        results[str(epoch)] = score(folder, epoch, folder + ".log")
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
    test, affine = entry["test"], entry["affine"]
    out[epoch] = {"test_margin_loss": test["margin_loss_mean"],
                  "test_error": test["error_percent"],
                  "affine_error": affine["error_percent"],
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


def published_seeds(folder):
  """The seeds of the protocol's run folders (<variant>_seed<k>/) in `folder`."""
  seeds = set()
  for name in os.listdir(folder) if os.path.isdir(folder) else ():
    variant, _, seed = name.rpartition("_seed")
    if variant in VARIANTS and seed.isdigit():
      seeds.add(int(seed))
  return sorted(seeds)


def with_published(found, publish, kept):
  """`found` (this command's runs) beside the runs of the other seeds in
  `publish`: a seed's block comes whole from one folder, never mixed."""
  here = {seed for per in found.values() for seed in per}
  merged = collect(publish, [s for s in published_seeds(publish) if s not in here], kept)
  for variant, per in found.items():
    merged.setdefault(variant, {}).update(per)
  return merged


def collect(out, seeds, kept):
  """{variant: {seed: measures(...)}} over the runs found in `out`."""
  found = {}
  for variant in VARIANTS:
    for seed in seeds:
      folder = study_report.run_dir(out, variant, seed)
      if os.path.isdir(folder):
        m = measures(folder, kept)
        if m:
          found.setdefault(variant, {})[seed] = m
  return found


def compare(found, kept):
  """The rule: {(a, b): {measure: {epoch: stats.paired_difference}}} and the
  reversals [(a, b, measure, earlier epoch, later epoch)]."""
  table, reversals = {}, []
  for a, b, _ in PAIRS:
    for key, _, _ in MEASURES:
      per_epoch = {}
      for epoch in kept:
        d = stats.paired_difference(_figures(found, a, epoch, key),
                                    _figures(found, b, epoch, key))
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


def _figures(found, variant, epoch, key):
  """{seed: the measure `key` at `epoch`} of the variant's runs that reached it."""
  return {s: m[epoch][key] for s, m in found.get(variant, {}).items() if epoch in m}


def markdown(found, table, reversals, kept, blocks, partial=()):
  """results.md; `partial`: the seeds of incomplete blocks, left out."""
  n_int = sum(1 for pairs in table.values() for per in pairs.values()
              for d in per.values() if d["lo"] is not None)
  n_called = sum(1 for pairs in table.values() for per in pairs.values()
                 for d in per.values() if d["called"])
  final = blocks >= 5
  lines = [f"# {TITLE}", "",
           f"{blocks} block(s) (seeds {', '.join(map(str, sorted(_seeds(found))))})"
           + ("" if final else ": **interim**, the rule judges five blocks") + "."
           + partial_note(partial),
           "Cells: the paired difference B - A over the blocks, its mean and 95% t "
           "interval; **bold** = called (the interval excludes zero). B - A > 0: A "
           "has the lower loss or error.", ""]
  lines += measure_tables(table, kept)
  lines += ["## Calls", "",
            f"{n_called} of {n_int} intervals exclude zero; with no difference "
            f"anywhere about {0.05 * n_int:.1f} would by chance (95% each, not "
            "corrected for multiplicity)."]
  if reversals:
    lines += ["", "The ordering reverses with training (called at an earlier "
              "registered epoch on one side, at a later one on the other):"]
    lines += [f"- {a}:{b}, {key}: epoch {e1} against epoch {e2}"
              for a, b, key, e1, e2 in reversals]
  else:
    lines += ["", "No reversal is called."]
  lines += ["", "## Per variant (mean over blocks; descriptive)", "",
            "The couplings from the test scoring; the gradient share from the "
            "epoch's last gradient diagnostic (||g_full - g_stop|| / ||g_full|| of "
            "W, on a fixed batch of 32).", ""]
  columns = (("test_margin_loss", ".5f"), ("test_error", ".3f"), ("affine_error", ".3f"),
             ("train_loss", ".5f"), ("val_loss", ".5f"), ("max_c", ".4f"),
             ("grad_share", ".3f"))
  def row(variant, epoch):
    ms = [m[epoch] for m in found.get(variant, {}).values() if epoch in m]
    means = [[m[k] for m in ms if m.get(k) is not None] for k, _ in columns]
    return [variant, epoch, *(format(sum(v) / len(v), spec) if v else ""
                              for v, (_, spec) in zip(means, columns, strict=True))]
  lines += study_report.table(
      ["variant", "epoch", "test margin loss", "test error %", "affine error %",
       "train loss", "val loss", "mean largest coupling, last iteration",
       "share of W's gradient through the couplings"],
      [row(v, e) for v in VARIANTS for e in kept
       if any(e in m for m in found.get(v, {}).values())])
  return "\n".join(lines) + "\n"


def partial_note(partial):
  """The sentence that names the incomplete blocks left out, or ""."""
  return (f" Seed(s) {', '.join(map(str, partial))}: an incomplete block (a run or a "
          "scoring missing), left out until it is complete." if partial else "")


def measure_tables(table, kept, heading="##", pilot_primary=True):
  """A markdown table per measure: each pair's cell (`stats.cell`) at each
  registered epoch, under `heading`; `pilot_primary` False: without the
  pilot's "(primary)" mark (another protocol's descriptive tables)."""
  lines = []
  for key, what, spec in MEASURES:
    what = what if pilot_primary else what.replace(" (primary)", "")
    lines += [f"{heading} {what}", ""] + study_report.table(
        ["pair (A:B)", *(f"epoch {e}" for e in kept)],
        [[f"{name} ({a}:{b})", *(stats.cell(table[(a, b)][key].get(e), spec) for e in kept)]
         for a, b, name in PAIRS]) + [""]
  return lines


def write_report(folder, text, payload, found):
  """results.md (`text`) and results.json (`payload` with each run's
  measures from `found`) in `folder`."""
  os.makedirs(folder, exist_ok=True)
  files.atomic_write(os.path.join(folder, "results.md"), text)
  payload = dict(payload, runs={v: {str(s): {str(e): m for e, m in per.items()}
                                    for s, per in seeds.items()}
                                for v, seeds in found.items()})
  files.atomic_write(os.path.join(folder, "results.json"),
                     json.dumps(payload, indent=1, sort_keys=True) + "\n")


def _seeds(found):
  return {s for per in found.values() for s in per}


def blocks_done(found, kept):
  """Seeds whose three runs are scored at every registered epoch."""
  return sorted(s for s in _seeds(found)
                if all(set(kept) <= set(found.get(v, {}).get(s, {})) for v in VARIANTS))


def only_seeds(found, seeds):
  """`found` ({variant: {seed: ...}}) with the runs of `seeds` alone."""
  return {v: {s: m for s, m in per.items() if s in seeds} for v, per in found.items()}


def complete_blocks(found, kept):
  """(the seeds of the complete blocks, `found` with their runs alone): a
  block is its three runs, each scored at every registered epoch; the runs
  of an incomplete one (a sitting that ended first) are left out."""
  done = blocks_done(found, kept)
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


def plot(table, kept, path):
  """along.png: each pair's paired difference against epoch with its 95%
  interval band, one panel per measure."""
  with study_report.drawing(path, (4.2 * len(MEASURES), 3.8), ncols=len(MEASURES)) as axes:
    for ax, (key, what, _) in zip(axes, MEASURES, strict=True):
      drawn = [epoch_band(ax, table[(a, b)][key], kept, label=name)[0] for a, b, name in PAIRS]
      epoch_axis(ax, kept, fixed=not any(drawn))   # no complete block: the epochs alone
      ax.set_title(f"B - A: {what}", fontsize=9)
    axes[0].legend(fontsize=7)


def report(found, kept, folder):
  """results.md, results.json and along.png into `folder`. Returns the markdown."""
  done, complete = complete_blocks(found, kept)
  partial = sorted(_seeds(found) - set(done))
  found = complete
  table, reversals = compare(found, kept)
  text = markdown(found, table, reversals, kept, len(done), partial)
  payload = {"blocks": done, "incomplete_blocks": partial, "kept_epochs": list(kept),
             "comparisons": [{"a": a, "b": b, "measure": key, "epoch": e, **d}
                             for (a, b), per_m in table.items()
                             for key, per in per_m.items() for e, d in per.items()],
             "reversals": [dict(zip(("a", "b", "measure", "earlier", "later"), r, strict=True))
                           for r in reversals]}
  write_report(folder, text, payload, found)
  plot(table, kept, os.path.join(folder, "along.png"))
  return text


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


def define_block_flags(name, first_seed, seeds, seed_help=""):
  """The flags of a command that runs and reports blocks of this protocol
  (capsnet.along, capsnet.confirm), its runs in ~/<name> and published in
  study/<name>; defined when the program calls it."""
  flags.DEFINE_integer("first_seed", first_seed, "the first block's seed" + seed_help,
                       lower_bound=0)
  flags.DEFINE_integer("seeds", seeds, "blocks to run, from --first_seed", lower_bound=1)
  flags.DEFINE_string("out", os.path.join(os.path.expanduser("~"), name),
                      "folder of the runs (checkpoints included) and the report")
  flags.DEFINE_string("publish", os.path.join(grids.ROOT, "study", name),
                      "copy each scored run's small files, and the report, here")
  flags.DEFINE_bool("train", True, "train and score missing runs (false: report only)")
  flags.DEFINE_integer("epochs", EPOCHS, "epochs a run (the protocol: 10; tests: fewer)",
                       lower_bound=1)
  flags.DEFINE_list("kept", [str(e) for e in KEPT], "the registered epochs "
                    "(the protocol: 1,2,5,10)")


def block_flags(values, program):
  """(the registered epochs, the seeds, where to publish or None) from the
  block flags' parsed `values` (a program's FLAGS, passed by its main);
  exits naming a bad --kept."""
  try:
    kept = parse_kept(values.kept, values.epochs)
  except ValueError as e:
    sys.exit(f"{program}: error: {e}")
  return (kept, range(values.first_seed, values.first_seed + values.seeds),
          publish_folder(values.publish, values.out))
