"""The confirmatory report's descriptive figures (capsnet/science/descriptive.py),
each on made-up runs with a known answer."""
import dataclasses
import itertools
import json
import os

import numpy as np
import pytest

from capsnet.running import runs
from capsnet.science import descriptive
from capsnet.science import registered
from capsnet.science import stats

PAIR = ("r3_recon", "r3_recon_nostop", "the stop: nostop - stop")
XEON = {"cpu": "Intel(R) Xeon(R) Processor", "cpu_id": "GenuineIntel family 6 model 167"}
EPYC = {"cpu": "AMD EPYC", "cpu_id": "AuthenticAMD family 25 model 1"}


def run(wrong, val_wrong=30, identity=None):
  return descriptive.Run(frozenset(wrong), 10000, val_wrong, 5000, identity or dict(EPYC))


def blocks_of(per_block):
  """{seed: {variant: Run}} from [(A's wrong, B's wrong), ...], r1_recon as A."""
  return {5 + k: {"r1_recon": run(a), PAIR[0]: run(a), PAIR[1]: run(b)}
          for k, (a, b) in enumerate(per_block)}


def brute_sign_flip(diffs):
  sums = [sum(s * d for s, d in zip(signs, diffs, strict=True))
          for signs in itertools.product((1, -1), repeat=len(diffs))]
  return sum(abs(x) >= abs(sum(diffs)) for x in sums) / len(sums)


def test_sign_flip_p_known_answers():
  assert descriptive.sign_flip_p([3] * 16) == 2 / 65536
  assert descriptive.sign_flip_p([1, 2, 3]) == 2 / 8       # only +-(1 + 2 + 3) reach 6
  assert descriptive.sign_flip_p([0] * 16) == 1.0
  assert descriptive.sign_flip_p([4, -4]) == 1.0
  diffs = [5, -1, 2, 1, 0, 3, -2, 4, 1, 1]
  assert descriptive.sign_flip_p(diffs) == brute_sign_flip(diffs)


def test_bootstrap_of_identical_runs_has_zero_width():
  rng = np.random.RandomState(0)
  same = [(w, w) for w in (rng.choice(10000, 50, replace=False) for _ in range(16))]
  assert descriptive.bootstrap(blocks_of(same), PAIR, resamples=500) == (0.0, 0.0)


def test_bootstrap_over_images_alone_matches_the_binomial():
  """Every block: B got A's 40 images wrong and 10 more. Resampling blocks
  changes nothing; resampling images makes each block's difference Binomial(
  10000, 0.001) / 100 points, so the mean of 16 has sd sqrt(9.99 / 16) / 100."""
  a = list(range(40))
  per_block = [(a, a + list(range(1000 + 10 * k, 1010 + 10 * k))) for k in range(16)]
  lo, hi = descriptive.bootstrap(blocks_of(per_block), PAIR, resamples=4000, seed=1)
  half = 1.96 * np.sqrt(10000 * 0.001 * 0.999 / 16) / 100
  assert lo == pytest.approx(0.1 - half, abs=0.002)
  assert hi == pytest.approx(0.1 + half, abs=0.002)


def test_bootstrap_over_blocks_alone_matches_resampling_the_means():
  """Blocks whose B got k images more wrong (k = 0..15) and every image
  counted ~once: the interval is near that of resampling the 16 block means
  (images add a little width), centred on their mean, 0.075 points."""
  per_block = [([], list(range(100 * k, 100 * k + k))) for k in range(16)]
  lo, hi = descriptive.bootstrap(blocks_of(per_block), PAIR, resamples=4000, seed=2)
  means = np.random.default_rng(0).choice(np.arange(16) / 100, (4000, 16)).mean(axis=1)
  blo, bhi = np.percentile(means, [2.5, 97.5])
  assert lo < 0.075 < hi
  assert lo == pytest.approx(blo, abs=0.01) and hi == pytest.approx(bhi, abs=0.01)
  assert hi - lo > bhi - blo


def test_the_bootstrap_is_fixed_by_its_registered_seed():
  rng = np.random.RandomState(3)
  per_block = [(rng.choice(10000, 50, replace=False), rng.choice(10000, 55, replace=False))
               for _ in range(16)]
  found = blocks_of(per_block)
  assert descriptive.bootstrap(found, PAIR) == descriptive.bootstrap(found, PAIR)
  assert (descriptive.RESAMPLES, descriptive.BOOTSTRAP_SEED) == (10000, 20261206)


def test_the_validation_difference_is_from_integer_counts(tmp_path):
  folder = tmp_path / "r3_recon_seed5"
  folder.mkdir()
  (folder / "metrics.jsonl").write_text(
      json.dumps({"kind": "epoch", "epoch": 10, "step": 4290,
                  "val_error_percent": 0.6000000000000028}) + "\n")
  (folder / "along_results.json").write_text(json.dumps(
      {"10": {"test": {"count": 10000, "error_percent": 0.51, "wrong": list(range(51))}}}))
  (folder / "config.json").write_text(json.dumps({"model": {}, "train": {"val_size": 5000}}))
  (folder / "host.json").write_text(json.dumps({"attempts": [{"identity": XEON}]}))
  read = descriptive.read_run(str(folder), 10)
  assert (read.val_wrong, read.val_count, len(read.test_wrong)) == (30, 5000, 51)
  assert read.identity == XEON
  found = {5: {PAIR[0]: run([], 30), PAIR[1]: run([], 31)},
           6: {PAIR[0]: run([], 29), PAIR[1]: run([], 32)}}
  d = descriptive.val_difference(found, PAIR)
  assert d["diffs"] == pytest.approx([0.02, 0.06]) and d["mean"] == pytest.approx(0.04)


def test_a_run_without_its_indices_is_named(tmp_path):
  folder = tmp_path / "r3_recon_seed5"
  folder.mkdir()
  (folder / "along_results.json").write_text(json.dumps({"10": {"test": {"count": 10000}}}))
  with pytest.raises(runs.RunError, match="r3_recon_seed5: along_results.json has no "
                                      "misclassified test indices at epoch 10"):
    descriptive.read_run(str(folder), 10)


def test_blocks_split_by_shared_host_identity():
  found = blocks_of([(range(k), range(k + 2)) for k in range(4)])
  found[6][PAIR[1]] = dataclasses.replace(found[6][PAIR[1]], identity=dict(XEON))
  found[8][PAIR[0]] = dataclasses.replace(found[8][PAIR[0]], identity=dict(EPYC, numpy="2"))
  found[7]["r1_recon"] = dataclasses.replace(found[7]["r1_recon"], identity=dict(XEON))
  assert descriptive.shared_host(found, PAIR) == ([5, 7], [6, 8])


def test_every_figure_and_its_lines():
  rng = np.random.RandomState(4)
  per_block = []
  for k in range(16):
    a = rng.choice(10000, 50, replace=False).tolist()
    per_block.append((a, a[:49] + list(range(20000, 20000 + 1 + k % 3))))   # +0, +1, +2
  found = blocks_of(per_block)
  fig = descriptive.compute(found, PAIR, 0.0785, 0.06, 0.05, [])
  diffs = [(k % 3) / 100 for k in range(16)]
  assert fig["sign_flip_p"] == brute_sign_flip([k % 3 for k in range(16)])
  assert fig["sd"] == pytest.approx(np.std(diffs, ddof=1))
  assert fig["power_at_sd"] == pytest.approx(stats.paired_t_power(0.06, fig["sd"], 16))
  assert fig["shared_host"]["n"] == 16 and fig["other_hosts"] == {"blocks": []}
  lines = descriptive.markdown_lines(fig, PAIR[2], 10)
  assert lines[0] == "## Descriptive, added after the registration: never called"
  assert (f"- The sd of its differences: {fig['sd']:.4f} points (the pilot's: 0.0785); the "
          f"power these blocks had to call 0.06 points at it: {fig['power_at_sd']:.3f}"
          in lines)
  assert any(line.endswith("over the rest: – (no block)") for line in lines)
  assert "**" not in "\n".join(lines)          # never called: nothing in bold
  assert lines[-4:] == ["### Every resume and every restart", "", "None.", ""]


def test_every_resume_and_restart_is_listed(tmp_path):
  xeon, epyc = dict(XEON), dict(EPYC)
  records = {
      "r1_recon_seed13": {"attempts": [{"kind": "start", "identity": xeon},
                                       {"kind": "resume", "from_step": 1287,
                                        "identity": xeon}], "lost": []},
      "r3_recon_nostop_seed12": {
          "attempts": [{"kind": "restart", "identity": xeon}],
          "lost": [{"step": 23, "why": "stopped by SIGTERM", "lost": "folder gone",
                    "identity": epyc}]},
      "r1_recon_seed9": {"attempts": [
          {"kind": "start", "identity": xeon, "end": {"why": "stopped by SIGTERM"}},
          {"kind": "resume", "from_step": 1615, "identity": xeon}], "lost": []},
      "r3_recon_seed5": {"attempts": [{"kind": "start", "identity": xeon}], "lost": []},
      "r3_recon_seed16": {   # stopped before its first checkpoint, set aside, restarted
          "attempts": [{"kind": "restart", "identity": epyc}],
          "lost": [{"kind": "start", "identity": epyc, "folder": "/h/lost/r3.attempt1",
                    "end": {"why": "stopped by SIGTERM", "step": None}}]}}
  for name, record in records.items():
    os.makedirs(tmp_path / name)
    (tmp_path / name / "host.json").write_text(json.dumps(record))
  rows = descriptive.resumes_and_restarts(str(tmp_path), [*records, "r1_recon_seed20"])
  x, e = "Intel(R) Xeon(R) Processor, GenuineIntel family 6 model 167", \
      "AMD EPYC, AuthenticAMD family 25 model 1"
  assert rows == [
      {"run": "r1_recon_seed13", "kind": "resume", "hosts": f"{x} -> {x}",
       "steps": "from step 1287", "why": "killed: no end recorded"},
      {"run": "r3_recon_nostop_seed12", "kind": "restart", "hosts": f"{e} -> {x}",
       "steps": "lost at step 23; again from step 0",
       "why": "stopped by SIGTERM; folder gone"},
      {"run": "r1_recon_seed9", "kind": "resume", "hosts": f"{x} -> {x}",
       "steps": "from step 1615", "why": "stopped by SIGTERM"},
      {"run": "r3_recon_seed16", "kind": "restart", "hosts": f"{e} -> {e}",
       "steps": "lost at step unknown; again from step 0",
       "why": "stopped by SIGTERM; folder set aside in /h/lost/r3.attempt1"}]
  # The interim progress table names a lost attempt by the same reader.
  kinds = {name: registered.History.read(str(tmp_path / name)).kinds()
           for name in ("r3_recon_nostop_seed12", "r3_recon_seed16")}
  assert kinds == {
      "r3_recon_nostop_seed12": [("lost", "at step 23: stopped by SIGTERM; folder gone"),
                                 ("restart", "")],
      "r3_recon_seed16": [("lost", "at step unknown: stopped by SIGTERM; folder set aside "
                                   "in /h/lost/r3.attempt1"), ("restart", "")]}
