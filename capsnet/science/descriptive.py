"""The confirmatory report's descriptive figures (docs/confirm.md, results):
added after the registration, computed beside its answer and never called.

- the exact sign-flip p of the primary, over all 2^n sign patterns of its
  block differences;
- a bootstrap of the primary over blocks and over test images, its
  percentile interval;
- the primary's difference on the validation images at the rule's epoch,
  from integer counts;
- the primary over the blocks whose two runs shared a host identity, and
  over the rest;
- the spread of the primary's differences beside the pilot's, and the power
  the registered blocks had at it;
- every resume and every restart.
"""
import dataclasses
import os

import numpy as np

from capsnet.running import runs
from capsnet.science import blocks
from capsnet.science import registered
from capsnet.science import report as study_report
from capsnet.science import stats

# The bootstrap, fixed before the 48th run was in (issue 72): resamples, seed.
RESAMPLES = 10000
BOOTSTRAP_SEED = 20261206


@dataclasses.dataclass(frozen=True)
class Run:
  """What the descriptive figures read of one run's files."""
  test_wrong: frozenset     # indices of the misclassified test images at the epoch
  test_count: int           # test images scored
  val_wrong: int            # misclassified validation images at the epoch's end
  val_count: int            # validation images
  identity: dict            # the host identity of its (first kept) attempt


def read_run(folder, epoch):
  """The `Run` of the run in `folder` at the end of `epoch`. Raises RunError
  naming the file where a figure is missing."""
  run = runs.RunFolder(folder)
  test = blocks.scored(folder).get(str(epoch), {}).get("test", {})
  if "wrong" not in test:
    raise runs.RunError(f"{folder}: {blocks.RESULTS_FILE} has no misclassified test "
                        f"indices at epoch {epoch}")
  rows = {r["epoch"]: r for r in run.metrics("epoch")}
  val_count = (run.config() or {}).get("train", {}).get("val_size")
  val = rows.get(epoch, {}).get("val_error_percent")
  if val is None or not val_count:
    raise runs.RunError(f"{folder}: no validation error at epoch {epoch} (metrics.jsonl) "
                        "or no val_size (config.json)")
  history = registered.History.read(folder)
  first = history.attempts[0] if history.attempts else {}
  return Run(frozenset(test["wrong"]), test["count"], round(val * val_count / 100),
             val_count, first.get("identity") or history.started)


def read_blocks(out, seeds, variants, epoch):
  """{seed: {variant: Run}} of the blocks of `seeds` in `out`."""
  return {seed: {v: read_run(study_report.run_dir(out, v, seed), epoch) for v in variants}
          for seed in seeds}


def sign_flip_p(diffs):
  """The exact two-sided sign-flip p of paired differences `diffs` (ints, so
  that ties are exact): the share of the 2^n sign patterns whose sum is at
  least as far from zero as the observed one. Sixteen positive differences:
  2 / 65536."""
  d = np.asarray(diffs, dtype=np.int64)
  patterns = np.arange(2 ** len(d))[:, None] >> np.arange(len(d)) & 1   # [2^n, n]
  sums = (1 - 2 * patterns) @ d
  return float(np.mean(np.abs(sums) >= abs(d.sum())))


def bootstrap(block_runs, pair, resamples=RESAMPLES, seed=BOOTSTRAP_SEED, level=0.95):
  """The percentile interval of the mean difference B - A (points) over
  resampled blocks and test images: each resample draws the blocks with
  replacement, then for each drawn block its test images with replacement,
  the same images for all the block's runs.

  Only the counts of the images some run of the block got wrong matter: the
  counts of those K images in a draw of N from N are the first K cells of a
  multinomial over them and the rest, drawn so. `block_runs`: {seed: {variant:
  Run}}. Returns: (lo, hi)."""
  rng = np.random.default_rng(seed)
  seeds = sorted(block_runs)
  union = [sorted(frozenset().union(*(r.test_wrong for r in block_runs[s].values())))
           for s in seeds]
  width = max(len(u) for u in union) or 1
  count = {block_runs[s][pair[0]].test_count for s in seeds}
  if len(count) != 1 or {block_runs[s][pair[1]].test_count for s in seeds} != count:
    raise ValueError(f"bootstrap: the runs scored different numbers of test images {count}")
  count = count.pop()
  # sign[k, j]: +1 where only B got the k-th block's j-th image wrong, -1 where only A
  sign = np.zeros((len(seeds), width), np.int64)
  for k, (s, images) in enumerate(zip(seeds, union, strict=True)):
    a, b = block_runs[s][pair[0]].test_wrong, block_runs[s][pair[1]].test_wrong
    sign[k, :len(images)] = [(i in b) - (i in a) for i in images]
  cells = np.full(width + 1, 1 / count)
  cells[-1] = 1 - width / count
  means = []
  for start in range(0, resamples, 1000):   # 1,000 resamples at a time: bounded memory
    size = (min(1000, resamples - start), len(seeds))
    drawn = rng.integers(0, len(seeds), size)                       # [R, blocks]
    counts = rng.multinomial(count, cells, size)[..., :-1]          # [R, blocks, K]
    means.append((counts * sign[drawn]).sum(axis=2).mean(axis=1) * 100 / count)  # points
  lo, hi = np.percentile(np.concatenate(means), [50 - 50 * level, 50 + 50 * level])
  return float(lo), float(hi)


def counted_difference(block_runs, pair, wrong, count):
  """`stats.paired_difference` of B - A in points from integer counts:
  `wrong(run)` misclassified of `count(run)` images."""
  figure = {v: {s: wrong(by_variant[v]) * 100 / count(by_variant[v])
                for s, by_variant in block_runs.items()} for v in pair[:2]}
  return stats.paired_difference(*figure.values())


def error_difference(block_runs, pair):
  """The test-error difference B - A, points."""
  return counted_difference(block_runs, pair, lambda r: len(r.test_wrong),
                            lambda r: r.test_count)


def val_difference(block_runs, pair):
  """The validation-error difference B - A, points."""
  return counted_difference(block_runs, pair, lambda r: r.val_wrong, lambda r: r.val_count)


def shared_host(block_runs, pair):
  """(the seeds whose runs of the pair ran on one host identity, every field
  the runner records alike; the rest)."""
  same = [s for s in sorted(block_runs)
          if block_runs[s][pair[0]].identity == block_runs[s][pair[1]].identity]
  return same, [s for s in sorted(block_runs) if s not in same]


def resumes_and_restarts(out, names):
  """[{run, kind, hosts, steps, why}]: every resume and restart recorded in
  the host.json of the runs `names` in `out`, in their order."""
  def host(attempt):
    return registered.host_kind(attempt.get("identity"))
  rows = []
  for name in names:
    history = registered.History.read(os.path.join(out, name))
    for before, now in history.resumes():
      rows.append({"run": name, "kind": "resume",
                   "hosts": f"{host(before)} -> {host(now)}",
                   "steps": f"from step {now.get('from_step')}",
                   "why": before.get("end", {}).get("why", registered.KILLED)})
    for lost in history.lost:
      step, why, where = history.lost_end(lost)
      rows.append({"run": name, "kind": "restart",
                   "hosts": f"{host(lost)} -> {host(history.attempts[0])}",
                   "steps": f"lost at step {registered.step_text(step)}; "
                            f"again from step 0",
                   "why": f"{why}; {where}"})
  return rows


def compute(block_runs, pair, pilot_sd, effect, alpha, restarts):
  """Every descriptive figure as one dict (results.json's "descriptive")."""
  primary = error_difference(block_runs, pair)
  counts = [len(block_runs[s][pair[1]].test_wrong) - len(block_runs[s][pair[0]].test_wrong)
            for s in sorted(block_runs)]
  lo, hi = bootstrap(block_runs, pair)

  def over(seeds):
    return {"blocks": seeds, **(error_difference({s: block_runs[s] for s in seeds}, pair)
                                or {})}
  same, rest = shared_host(block_runs, pair)
  sd = primary["sd"]
  return {
      "sign_flip_p": sign_flip_p(counts), "sign_patterns": 2 ** len(counts),
      "bootstrap": {"lo": lo, "hi": hi, "resamples": RESAMPLES, "seed": BOOTSTRAP_SEED},
      "validation": val_difference(block_runs, pair),
      "shared_host": over(same), "other_hosts": over(rest),
      "sd": sd, "pilot_sd": pilot_sd, "power_effect": effect,
      "power_at_sd": stats.paired_t_power(effect, sd, len(counts), alpha) if sd else None,
      "resumes_and_restarts": restarts}


def _plain(d):
  """A `stats.cell` that never bolds: these figures are not called."""
  return stats.cell(d and dict(d, called=False), "+.3f", "–", True)


def markdown_lines(fig, name, epoch):
  """The report's section of these figures (`fig`: `compute`; `name`: the
  primary's, measured at `epoch`)."""
  def group(g):
    return _plain(g if "n" in g else None) + (
        f" (blocks {', '.join(map(str, g['blocks']))})" if g["blocks"] else " (no block)")
  lines = [
      "## Descriptive, added after the registration: never called", "",
      f"Figures of the primary ({name}, test error at epoch {epoch}) that the "
      "registration did not compute, added by issue 72 and computed by main's code: none "
      "is a test, and none calls anything.", "",
      f"- Exact sign-flip p over all {fig['sign_patterns']:,} sign patterns of the block "
      f"differences: {round(fig['sign_flip_p'] * fig['sign_patterns']):,} of "
      f"{fig['sign_patterns']:,} patterns as far from zero, p = {fig['sign_flip_p']:.5f}",
      f"- Bootstrap over blocks and test images ({fig['bootstrap']['resamples']:,} "
      f"resamples, seed {fig['bootstrap']['seed']}; a block's runs share its resampled "
      f"images): 95% percentile interval [{fig['bootstrap']['lo']:+.3f}, "
      f"{fig['bootstrap']['hi']:+.3f}] points",
      f"- The same difference on the validation images (error from integer counts): "
      f"{_plain(fig['validation'])}",
      f"- Over the blocks whose two runs shared a host identity: "
      f"{group(fig['shared_host'])}; over the rest: {group(fig['other_hosts'])}",
      f"- The sd of its differences: {fig['sd']:.4f} points"
      + (f" (the pilot's: {fig['pilot_sd']:.4f})" if fig["pilot_sd"] is not None else "")
      + f"; the power these blocks had to call {fig['power_effect']:.2f} points at it: "
      f"{fig['power_at_sd']:.3f}"
      if fig["sd"] else "- The sd of its differences: none (fewer than two blocks)", ""]
  rows = fig["resumes_and_restarts"]
  lines += ["### Every resume and every restart", ""]
  lines += study_report.table(["run", "kind", "hosts", "steps", "why"],
                              [[r["run"], r["kind"], r["hosts"], r["steps"], r["why"]]
                               for r in rows]) if rows else ["None."]
  return lines + [""]
