"""The confirmatory protocol (docs/confirm.md): the power computation that
fixed its sixteen blocks, the registered rule (primary, equivalence, Holm's
secondary pair and the claim's verdict) on made-up blocks, the report from
run files, interim while blocks are missing, and its refusals."""
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from capsnet.running import host
from capsnet.science import blocks
from capsnet.science import protocols
from capsnet.science import registered
from capsnet.science import report as study_report
from capsnet.science import rule
from capsnet.science import stats
from conftest import ROOT
from conftest import SMALL
from conftest import assert_same_decision
from conftest import needs_mnist
from conftest import stop_once_saved

CONFIRM = protocols.CONFIRM
KEPT = CONFIRM.kept
SEEDS = CONFIRM.seeds
WOBBLE = [0.03, -0.02, 0.01, -0.04, 0.02, 0.0, -0.01, 0.04,
          -0.03, 0.02, -0.02, 0.01, 0.03, -0.01, 0.0, -0.03]   # by block; mean 0


def errors(r1, r3, nostop, spread=1.0):
  """{variant: {seed: test error at epoch 10}}: each variant's mean plus the
  block's wobble times `spread` (the stop's pair moves with its own wobble)."""
  out = {"r1_recon": {}, "r3_recon": {}, "r3_recon_nostop": {}}
  for k, seed in enumerate(SEEDS):
    w = WOBBLE[k] * spread
    out["r1_recon"][seed] = 0.6 + r1 + w
    out["r3_recon"][seed] = 0.6 + r3
    out["r3_recon_nostop"][seed] = 0.6 + nostop + WOBBLE[(k + 5) % 16] * spread
  return out


def found_of(errs, seeds=SEEDS):
  """The `blocks.Scores` of runs with test errors `errs` at epoch 10."""
  return blocks.Scores({(v, s): {e: {"test_error": x + 0.1 * (10 - e),
                                     "test_margin_loss": 0.01, "affine_error": 2.0,
                                     "train_loss": 0.01} for e in KEPT}
                        for v, per in errs.items() for s, x in per.items() if s in seeds})


def test_power_matches_published_values_and_a_simulation():
  # G*Power, one-sample t, d = 0.5, two-sided 0.05, n = 34: power 0.8078.
  assert stats.paired_t_power(0.5, 1.0, 34) == pytest.approx(0.8078, abs=5e-4)
  assert stats.paired_t_power(0.0, 1.0, 10) == pytest.approx(0.05, abs=1e-4)
  rng = np.random.RandomState(0)
  x = rng.normal(0.06, 0.0785, (100000, 16))
  t = x.mean(axis=1) / (x.std(axis=1, ddof=1) / 4)
  simulated = np.mean(np.abs(t) > stats.t_quantile(0.975, 15))
  assert stats.paired_t_power(0.06, 0.0785, 16) == pytest.approx(simulated, abs=0.005)
  # chi-squared with 4 degrees of freedom: its 0.025 and 0.975 quantiles
  # (printed tables) 0.48442 and 11.1433.
  lo, hi = stats.sd_interval(1.0, 4)
  assert (lo, hi) == (pytest.approx(math.sqrt(4 / 11.1433), abs=1e-4),
                      pytest.approx(math.sqrt(4 / 0.48442), abs=1e-4))


def test_holm_steps_down_and_stops_at_the_first_kept_hypothesis():
  assert stats.holm([0.01, 0.04]) == ([True, True], [0.02, 0.04])
  assert stats.holm([0.03, 0.04]) == ([False, False], [0.06, 0.06])   # each < 0.05 alone
  assert stats.holm([0.2, 0.001, None]) == ([False, True, False], [0.2, 0.002, None])
  d = stats.paired_difference({1: 0, 2: 0, 3: 0}, {1: 1.0, 2: 2.0, 3: 4.0})
  t = d["mean"] / (d["sd"] / math.sqrt(3))   # 7/3 / (sqrt(7/3) / sqrt(3)) = sqrt(7)
  # Two degrees of freedom: P(|T| > t) = 1 - t / sqrt(2 + t^2), here 1 - sqrt(7) / 3.
  assert t == pytest.approx(math.sqrt(7))
  assert stats.t_p_value(d) == pytest.approx(1 - math.sqrt(7) / 3, abs=1e-12)


def test_the_registered_power_from_the_committed_pilot():
  pilot_protocol, pilot_folder = rule.pilot_of(CONFIRM)
  _, pilot = blocks.collect(pilot_folder, pilot_protocol.seeds, CONFIRM).complete(CONFIRM)
  lines = rule.power_lines(pilot, CONFIRM)
  assert lines[0].endswith("mean +0.072, sd 0.0785")
  assert lines[1].startswith("the smallest n with power >= 0.80 to call 0.06 points "
                             "(two-sided 0.05): 16 (power 0.815; n - 1: 0.785)")
  assert len(SEEDS) == 16 and SEEDS[0] == 5 and SEEDS[-1] == 20


@pytest.mark.parametrize("means, claim", [
    ((0.05, 0.0, 0.10), "supported"),        # r3 < r1 < r3 nostop
    ((-0.05, 0.0, 0.10), "contradicted"),    # r3 - r1 called positive
    ((0.05, 0.0, 0.0), "contradicted"),      # r3 nostop - r1 called negative
    ((0.0, 0.0, 0.0), "not settled")])
def test_the_claims_verdict(means, claim):
  """`means`: the test error of r1_recon, r3_recon, r3_recon_nostop above 0.6."""
  decision = rule.decide(found_of(errors(*means)), CONFIRM, final=True)
  assert decision["claim"] == claim


def test_primary_called_and_equivalence_within_the_margin():
  found = found_of(errors(0.0, 0.0, 0.12))
  d = rule.decide(found, CONFIRM, final=True)
  assert d["primary"]["called"] and d["primary"]["mean"] == pytest.approx(0.12)
  assert not d["equivalence"]["within"]
  found = found_of(errors(0.0, 0.0, 0.0, spread=0.5))
  d = rule.decide(found, CONFIRM, final=True)
  assert not d["primary"]["called"] and d["equivalence"]["within"]
  within = d["equivalence"]
  half = stats.t_quantile(0.95, 15) * within["sd"] / 4
  assert within["hi"] - within["mean"] == pytest.approx(half)
  # A wide spread: neither called nor shown within 0.10.
  d = rule.decide(found_of(errors(0.0, 0.0, 0.0, spread=12.0)), CONFIRM, final=True)
  assert not d["primary"]["called"] and not d["equivalence"]["within"]


def test_holm_keeps_a_secondary_pair_that_alone_would_be_called():
  # r3 - r1 at t = -2.2 and r3 nostop - r1 at t = 2.15 (p 0.044 and 0.048):
  # each excludes zero alone, neither survives Holm (the smaller p > 0.025).
  se = np.std(WOBBLE, ddof=1) / 4
  errs = errors(0.0, 0.0, 0.0)
  for k, seed in enumerate(SEEDS):
    errs["r3_recon"][seed] = errs["r1_recon"][seed] - 2.2 * se + WOBBLE[(k + 3) % 16]
    errs["r3_recon_nostop"][seed] = (errs["r1_recon"][seed] + 2.15 * se
                                     + WOBBLE[(k + 7) % 16])
  d = rule.decide(found_of(errs), CONFIRM, final=True)
  first, second = d["secondary"]
  assert 0.025 < first["p"] < 0.05 and 0.025 < second["p"] < 0.05
  assert first["lo"] * first["hi"] > 0 and second["lo"] * second["hi"] > 0
  assert not first["called"] and not second["called"]
  assert first["p_holm"] == pytest.approx(2 * min(first["p"], second["p"]))
  assert d["claim"] == "not settled"


def test_fewer_than_sixteen_blocks_call_nothing():
  found = found_of(errors(0.05, 0.0, 0.20), seeds=SEEDS[:15])
  d = rule.decide(found, CONFIRM, final=False)
  assert d["primary"]["lo"] > 0 and not d["primary"]["called"]
  assert not any(s["called"] for s in d["secondary"]) and not d["equivalence"]["within"]
  assert d["claim"] == "interim: no verdict"


def test_host_kind_from_cpuinfo(tmp_path):
  info = tmp_path / "cpuinfo"
  info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
                  "model\t\t: 17\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n")
  assert host._cpuinfo(str(info)) == ("AMD EPYC", {"fpu", "avx2", "fma"},
                                      "AuthenticAMD family 25 model 17")
  assert registered.host_kind({"cpu": "AMD EPYC", "cpu_id": "AuthenticAMD "
                               "family 25 model 17"}) == (
      "AMD EPYC, AuthenticAMD family 25 model 17")
  assert registered.host_kind({"cpu": "AMD EPYC", "flags": ["avx512f"]}) == (
      "AMD EPYC, AVX-512")


def scoring(rng, percent):
  """A made-up scoring of the 10,000 test images: `percent` of them wrong."""
  wrong = rng.choice(10000, round(percent * 100), replace=False)
  return {"count": 10000, "error_percent": percent, "margin_loss_mean": 0.01,
          "wrong": sorted(wrong.tolist())}


def fake_block(out, seed, errs, cpu_id="AuthenticAMD family 25 model 17", shared=True):
  """One block's three runs as the protocol leaves them (small files only):
  each scoring with its misclassified indices, each run's attempt with its host
  identity (`shared` False: r3_recon_nostop's differs in its numpy)."""
  for k, variant in enumerate(CONFIRM.variants):
    folder = os.path.join(out, study_report.run_name(variant, seed))
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
      for epoch in range(1, 11):
        f.write(json.dumps({"epoch": epoch, "step": 429 * epoch, "kind": "epoch",
                            "train_loss": 0.1 / epoch, "val_loss": 0.05 / epoch,
                            "val_error_percent": errs[variant][seed] + 0.1 / epoch})
                + "\n")
    rng = np.random.RandomState(100 * seed + k)
    results = {str(e): {"epoch": e, "step": 429 * e,
                        "test": scoring(rng, errs[variant][seed] + 0.1 * (10 - e)),
                        "affine": scoring(rng, 2.0)} for e in KEPT}
    with open(os.path.join(folder, blocks.RESULTS_FILE), "w") as f:
      json.dump(results, f)
    identity = {"cpu": "AMD EPYC", "cpu_id": cpu_id, "flags": ["avx2"], "numpy": "2.4.6"}
    if not shared and variant == "r3_recon_nostop":
      identity["numpy"] = "2.4.7"
    with open(os.path.join(folder, "host.json"), "w") as f:
      json.dump({"started": {"cpu": "AMD EPYC", "cpu_id": cpu_id, "flags": ["avx2"],
                             "commit": "abc123def4567890"}, "resumed": [],
                 "attempts": [{"kind": "start", "identity": identity}],
                 "outcome": "completed"}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
      json.dump({"model": {"precision": "fp32", "conv_plan": "conv1:conv2d,primary_caps:dft"},
                 "train": {"seed": seed, "val_size": 5000}}, f)


def test_the_interim_report_shows_a_part_way_run_by_its_newest_stop(tmp_path):
  """The due run, not yet published, stands at its newest committed stop: its
  step (or "unknown", for a lost attempt written by hand) on that stop's host."""
  out = tmp_path / "confirm"
  fake_block(str(out), SEEDS[0], errors(0.05, 0.0, 0.10))
  due = registered.folder_name(registered.sequence(CONFIRM)[3])
  xeon = {"cpu": "Intel(R) Xeon(R) Processor", "cpu_id": "GenuineIntel family 6 model 167"}
  rows = [{"run": due, "step": 1615, "digest": "a" * 64, "why": "stopped by SIGTERM",
           "identity": xeon},
          {"run": due, "step": None, "digest": None, "why": "killed outright",
           "identity": dict(xeon, cpu_id="GenuineIntel family 6 model 143")}]
  with open(out / registered.PARTWAY_FILE, "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in rows[:1]))
  text = registered.progress_report(CONFIRM, str(out), [], str(out))
  assert (f"| 4 | {due} | part-way (step 1615) | Intel(R) Xeon(R) Processor, GenuineIntel "
          "family 6 model 167 | stop (stopped by SIGTERM) |") in text
  with open(out / registered.PARTWAY_FILE, "a") as f:
    f.write(json.dumps(rows[1]) + "\n")
  text = registered.progress_report(CONFIRM, str(out), [], str(out))
  assert (f"| 4 | {due} | part-way (step unknown) | Intel(R) Xeon(R) Processor, GenuineIntel "
          "family 6 model 143 | stop (stopped by SIGTERM), stop (killed outright) |") in text
  assert json.loads((out / "results.json").read_text())["details"]["partway_stops"] == 2


def _confirm(*args):
  """capsnet.confirm as a user starts it (give --publish: its default is the
  repository's study/confirm)."""
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  return subprocess.run([sys.executable, "-m", "capsnet.confirm", *args], env=env,
                        capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.integration
def test_the_report_from_files_interim_then_final_and_the_same_bytes(tmp_path):
  out = tmp_path / "confirm"
  errs = errors(0.05, 0.0, 0.10)
  for seed in SEEDS[:-1]:
    fake_block(str(out), seed, errs, cpu_id=f"AuthenticAMD family {25 + seed % 2} model 1")
  proc = _confirm(f"--out={out}", f"--publish={out}", "--train=false")
  assert proc.returncode == 0, proc.stderr[-2000:]
  text = (out / "results.md").read_text()
  assert text.splitlines()[0].endswith(": interim, 45 of 48 runs, 15 of 16 blocks complete")
  assert "Next due: r1_recon_seed20." in text
  # progress only: no difference, no interval, no plot
  assert "interval [" not in text and "+0." not in text and "-0." not in text
  assert not (out / "confirm.png").exists()
  assert json.loads((out / "results.json").read_text())["details"]["runs_done"] == 45
  fake_block(str(out), SEEDS[-1], errs)
  proc = _confirm(f"--out={out}", f"--publish={out}", "--train=false")
  assert proc.returncode == 0, proc.stderr[-2000:]
  text = (out / "results.md").read_text()
  assert text.splitlines()[0].endswith(": 16 blocks, as registered")
  assert "- **The claim** (with the stop r = 3 beats r = 1, without it r = 1 beats " \
         "r = 3): **supported**" in text
  assert "| 20 | AMD EPYC | AMD EPYC, AuthenticAMD family 25 model 17 | abc123def456 " \
         "| fp32 | conv1:conv2d,primary_caps:dft |" in text
  assert "- Exact sign-flip p over all 65,536 sign patterns of the block differences: " in text
  assert "### Every resume and every restart" in text
  payload = json.loads((out / "results.json").read_text())
  details = payload["details"]
  assert payload["final"] and details["blocks"] == list(SEEDS)
  assert details["descriptive"]["bootstrap"]["resamples"] == 10000
  assert [k["kind"] for k in details["by_host_kind"]] == [
      "AMD EPYC, AuthenticAMD family 25 model 1", "AMD EPYC, AuthenticAMD family 25 model 17",
      "AMD EPYC, AuthenticAMD family 26 model 1"]
  assert details["pooled"][0]["n"] == 21    # the five pilot blocks and these sixteen
  assert (out / "confirm.png").read_bytes()[:4] == b"\x89PNG"
  before = {p: (out / p).read_bytes() for p in ("results.md", "results.json", "confirm.png")}
  proc = _confirm(f"--out={out}", f"--publish={out}", "--train=false")
  assert {p: (out / p).read_bytes() for p in before} == before


@pytest.mark.integration
def test_flags_outside_the_registration_refused_in_one_line(tmp_path):
  for args, line in (
      (["--epochs=2"], "confirm: error: --epochs=2: the registration fixes 10"),
      (["--kept=1,10"], "confirm: error: --kept=1,10: the registration fixes 1,2,5,10"),
      (["--", "--batch_size=3"], "confirm: error: -- (train.py's flags)=--batch_size=3: "
                                 "the registration fixes none")):
    proc = _confirm(f"--out={tmp_path / 'out'}", f"--publish={tmp_path / 'pub'}", *args)
    assert proc.returncode == 1 and proc.stderr.strip() == line
  assert os.listdir(tmp_path) == []
  missing = tmp_path / "confrim"
  proc = _confirm(f"--out={missing}", "--train=false")
  assert proc.returncode == 1 and not missing.exists()
  assert proc.stderr.strip() == (f"confirm: error: --out={missing}: no such folder "
                                 "(expected the protocol's runs, <variant>_seed<k>/)")


@pytest.mark.integration
def test_power_command_prints_the_registered_computation():
  proc = _confirm("--power")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "registered n = 16: power 0.815 for 0.06 points" in proc.stdout


@pytest.mark.slow
@needs_mnist
def test_runs_end_to_end_on_a_small_model_stopped_and_resumed(tmp_path):
  """The sequence's first two runs, two epochs kept at 1 and 2, on a small
  model (a test run: CAPSNET_CONFIRM_UNCHECKED=1); the second stopped by one
  SIGTERM while it trains (its part-way state published), then resumed by
  the same command. Each kept checkpoint is scored on the test and affine
  sets with the misclassified images' indices; the small files are published
  as each run ends; the report shows progress only."""
  out, pub = tmp_path / "out", tmp_path / "pub"
  env = dict(os.environ, CAPSNET_CONFIRM_UNCHECKED="1")
  env.pop("TF_CPP_MIN_LOG_LEVEL", None)
  def command(train_size, runs=1):
    return [sys.executable, "-m", "capsnet.confirm", "--epochs=2", "--kept=1,2",
            f"--out={out}", f"--publish={pub}", f"--runs={runs}", "--", *SMALL,
            f"--train_size={train_size}"]
  first, second = (registered.folder_name(r) for r in registered.sequence(CONFIRM)[:2])
  proc = subprocess.run(command(320), env=env, capture_output=True, text=True, cwd=ROOT,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"confirm: run 1 of 48, {first}: start" in proc.stdout
  status, said = stop_once_saved(command(32000), str(out / second), env=env, cwd=ROOT)
  assert status == 143, said[-3000:]
  rows = registered.partway_rows(str(pub))
  assert [r["run"] for r in rows] == [second] and rows[0]["step"] > 0, rows
  assert len(rows[0]["digest"]) == 64 and rows[0]["why"].startswith("stopped by SIGTERM")
  assert not (pub / second).exists()
  proc = subprocess.run(command(32000), env=env, capture_output=True, text=True, cwd=ROOT,
                        timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"confirm: run 2 of 48, {second}: resume" in proc.stdout
  for name in (first, second):
    assert sorted(os.listdir(pub / name)) == sorted(blocks.SMALL_FILES)
    record = json.loads((pub / name / "host.json").read_text())
    assert record["outcome"] == "completed"
    assert all(a["checked"] is False for a in record["attempts"])
    results = json.loads((pub / name / blocks.RESULTS_FILE).read_text())
    assert sorted(results) == ["1", "2"]
    for split in ("test", "affine"):
      scored = results["2"][split]
      assert scored["count"] == 10000
      assert len(scored["wrong"]) == round(scored["error_percent"] * 100)
  kinds = [a["kind"] for a in json.loads((pub / second / "host.json").read_text())["attempts"]]
  assert kinds == ["start", "resume"]
  resumed = json.loads((pub / second / "host.json").read_text())["attempts"][1]
  assert (resumed["from_step"], resumed["from_digest"]) == (rows[0]["step"], rows[0]["digest"])
  text = (pub / "results.md").read_text()
  assert text.splitlines()[0].endswith(": interim, 2 of 48 runs, 0 of 16 blocks complete")


@pytest.mark.integration
def test_the_registered_answer_is_the_registrations_own(tmp_path):
  """On a made-up complete study, the registration's code (its commit's
  files, run as docs/confirm.md says) and main's write the same registered
  answer, line for line, and the same decision in results.json."""
  commit = registered.registration_commit(ROOT, CONFIRM.lock)
  if commit is None:
    pytest.skip("no git history of docs/confirm.lock")
  code = tmp_path / "registration"
  code.mkdir()
  archive = subprocess.run(["git", "archive", commit, "capsnet", "study/along"],
                           cwd=ROOT, capture_output=True, check=True).stdout
  with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
    tar.extractall(code, filter="data")
  errs = errors(0.02, 0.0, 0.03, spread=2.0)
  for seed in SEEDS:
    fake_block(str(tmp_path / "main"), seed, errs, shared=seed % 3 != 0)
  shutil.copytree(tmp_path / "main", tmp_path / "theirs")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  for folder, cwd in (("main", ROOT), ("theirs", code)):
    proc = subprocess.run([sys.executable, "-m", "capsnet.confirm", "--train=false",
                           f"--out={tmp_path / folder}"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
  ours, theirs = ((tmp_path / f / "results.md").read_text() for f in ("main", "theirs"))
  assert len(rule.registered_answer(theirs)) == 8
  assert rule.registered_answer(ours) == rule.registered_answer(theirs)
  assert "## Descriptive, added after the registration: never called" not in theirs
  assert "## Descriptive, added after the registration: never called" in ours
  decisions = [json.loads((tmp_path / "main" / "results.json").read_text())["details"][
      "decision"], json.loads((tmp_path / "theirs" / "results.json").read_text())["decision"]]
  assert_same_decision(*decisions)

