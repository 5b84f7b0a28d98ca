"""The protocol along training (docs/along.md): its figures from a fake set
of blocks, the rule with a called reversal, the report's files, and its
refusals; the end-to-end block on a small model is the slow test."""
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from capsnet.science import along
from capsnet.science import blocks
from capsnet.science import protocols
from capsnet.science import report as study_report
from capsnet.science import stats
from conftest import ROOT
from conftest import SMALL
from conftest import needs_mnist

ALONG = protocols.ALONG
# The stop pair's margin-loss difference (nostop - stop) by registered epoch:
# turning the stop off helps at epoch 1, is within noise at 2, hurts at 5 and 10.
STOP_EFFECT = {1: -0.002, 2: 0.0, 5: 0.001, 10: 0.002}
NOISE = [0.0003, -0.0002, 0.0001, -0.0004, 0.0002]   # by seed; its mean is 0


def fake_run(folder, variant, seed):
  """A scored run as `along` leaves it: epoch rows and along_results.json."""
  os.makedirs(folder)
  base = {"r1_recon": 0.0, "r3_recon": 0.0, "r3_recon_nostop": 1.0}[variant]
  with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
    for epoch in range(1, 11):
      f.write(json.dumps({"epoch": epoch, "step": 429 * epoch, "kind": "epoch",
                          "train_loss": 0.1 / epoch + 0.001 * seed,
                          "val_loss": 0.05 / epoch, "images_per_sec": 100.0}) + "\n")
  with open(os.path.join(folder, "diagnostics.jsonl"), "w") as f:
    for step in range(100, 4291, 100):   # every 100 steps, as the protocol's runs
      share = 0.0 if variant == "r1_recon" else step / 10000 + 0.01 * seed
      f.write(json.dumps({"step": step, "digit_caps/weights": share}) + "\n")
  results = {}
  for epoch in ALONG.kept:
    margin = 0.02 / epoch + 0.001 * seed + base * (STOP_EFFECT[epoch] + NOISE[seed])
    if epoch == 2 and variant == "r3_recon_nostop":
      margin += 0.003 * (seed - 2)          # a difference too noisy to call
    results[str(epoch)] = {
        "epoch": epoch, "step": 429 * epoch,
        "test": {"count": 10000, "error_percent": 1.0 / epoch + 0.01 * seed,
                 "margin_loss_mean": margin, "routing_max_c": [0.1, 0.104, 0.105]},
        "affine": {"count": 10000, "error_percent": 4.0 / epoch + 0.01 * seed}}
  with open(os.path.join(folder, blocks.RESULTS_FILE), "w") as f:
    json.dump(results, f)


@pytest.fixture
def block_runs(tmp_path):
  out = tmp_path / "along"
  for seed in range(5):
    for variant in protocols.ALONG.variants:
      fake_run(str(out / study_report.run_name(variant, seed)), variant, seed)
  return str(out)


def test_the_rule_by_hand_and_a_called_reversal(block_runs):
  found = blocks.collect(block_runs, range(5), ALONG)
  assert found.complete(ALONG)[0] == [0, 1, 2, 3, 4]
  table, reversals = blocks.compare(found, ALONG)
  stop = table[("r3_recon", "r3_recon_nostop")]["test_margin_loss"]
  for epoch in (1, 5, 10):
    diffs = [STOP_EFFECT[epoch] + n for n in NOISE]
    half = stats.t_quantile(0.975, 4) * np.std(diffs, ddof=1) / math.sqrt(5)
    np.testing.assert_allclose(stop[epoch]["mean"], STOP_EFFECT[epoch], atol=1e-12)
    np.testing.assert_allclose([stop[epoch]["lo"], stop[epoch]["hi"]],
                               [STOP_EFFECT[epoch] - half, STOP_EFFECT[epoch] + half])
    assert stop[epoch]["called"]
  assert not stop[2]["called"]
  np.testing.assert_allclose(stats.t_quantile(0.975, 4), 2.776, atol=5e-4)
  # Called below zero at epoch 1, above it at 5: the ordering reverses (and
  # against r1_recon, whose figures are r3_recon's here).
  assert reversals == [("r3_recon", "r3_recon_nostop", "test_margin_loss", 1, 5),
                       ("r1_recon", "r3_recon_nostop", "test_margin_loss", 1, 5)]
  # r3_recon against r1_recon: the same figures, nothing to call.
  same = table[("r1_recon", "r3_recon")]["test_error"]
  assert all(d["mean"] == 0 and not d["called"] for d in same.values())
  # The training loss comes from the epoch's row; the gradient share from the
  # epoch's last diagnostic (step 2,100 for epoch 5's end at 2,145).
  assert found.runs[("r1_recon", 3)][5]["train_loss"] == pytest.approx(0.1 / 5 + 0.003)
  assert found.runs[("r3_recon", 3)][5]["grad_share"] == pytest.approx(0.21 + 0.03)
  assert found.runs[("r1_recon", 3)][5]["grad_share"] == 0.0


def test_scores_keep_complete_blocks_and_merge_by_run():
  """A block is complete when each variant's run is scored at every kept
  epoch; `|` keeps a run's scores from its right side."""
  every = {e: {"test_error": 1.0} for e in ALONG.kept}
  scores = blocks.Scores({(v, s): dict(every) for v in ALONG.variants for s in (0, 1)})
  scores.runs[("r3_recon", 1)].pop(ALONG.kept[-1])           # block 1 lacks an epoch
  done, complete = scores.complete(ALONG)
  assert done == [0] and complete.seeds == [0] and scores.seeds == [0, 1]
  assert scores.by_seed("r3_recon", ALONG.kept[-1], "test_error") == {0: 1.0}
  newer = blocks.Scores({("r3_recon", 1): {e: {"test_error": 2.0} for e in ALONG.kept}})
  merged = scores | newer
  assert merged.complete(ALONG)[0] == [0, 1]
  assert merged.by_seed("r3_recon", ALONG.kept[-1], "test_error") == {0: 1.0, 1: 2.0}


def test_no_reversal_when_calls_agree(block_runs):
  found = blocks.collect(block_runs, range(5), ALONG)
  for seed in found.seeds:   # epoch 1 now on the same side as 5, 10
    found.runs[("r3_recon_nostop", seed)][1]["test_margin_loss"] += 0.01
  _, reversals = blocks.compare(found, ALONG)
  assert reversals == []


def _along(*args):
  # As a user starts it: TF_CPP_MIN_LOG_LEVEL unset (the suite sets it), so
  # that TensorFlow, where a checkpoint is looked at, starts quietly (startup).
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  return subprocess.run([sys.executable, "-m", "capsnet.along", *args], env=env,
                        capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.integration
def test_report_from_the_files_and_again_the_same_bytes(block_runs, tmp_path):
  pub = tmp_path / "pub"
  proc = _along("--seeds=5", f"--out={block_runs}", "--train=false", f"--publish={pub}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  text = (pub / "results.md").read_text()
  assert "5 block(s) (seeds 0, 1, 2, 3, 4)." in text and "interim" not in text
  assert ("- r3_recon:r3_recon_nostop, test_margin_loss: epoch 1 against epoch 5"
          in text)
  assert "**-0.00200 [" in text    # the stop pair's call at epoch 1, in bold
  # 48 intervals: three pairs, four measures, four epochs.
  assert " of 48 intervals exclude zero; " in text and "about 2.4 would" in text
  payload = json.loads((pub / "results.json").read_text())
  assert payload["details"]["blocks"] == [0, 1, 2, 3, 4] and len(payload["comparisons"]) == 48
  assert payload["protocol"] == "along" and payload["final"] and len(payload["runs"]) == 15
  assert (pub / "along.png").read_bytes()[:4] == b"\x89PNG"
  before = {p: (pub / p).read_bytes() for p in ("results.md", "results.json", "along.png")}
  assert (open(os.path.join(block_runs, "results.md")).read() == text)
  proc = _along("--seeds=5", f"--out={block_runs}", "--train=false", f"--publish={pub}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert {p: (pub / p).read_bytes() for p in before} == before


@pytest.mark.integration
def test_a_blocks_command_publishes_the_report_of_every_published_block(block_runs, tmp_path):
  # Blocks 0-4 published; this command's folder holds block 4 alone (a
  # sitting's block run in its own folder).
  pub, out = tmp_path / "pub", tmp_path / "block4"
  shutil.copytree(block_runs, pub)
  for variant in protocols.ALONG.variants:
    shutil.copytree(os.path.join(block_runs, study_report.run_name(variant, 4)),
                    out / study_report.run_name(variant, 4))
  os.makedirs(pub / "notes")          # a folder that is not a run is passed over
  proc = _along("--first_seed=4", "--seeds=1", f"--out={out}", "--train=false",
                f"--publish={pub}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "1 block(s) (seeds 4): **interim**" in (out / "results.md").read_text()
  assert json.loads((pub / "results.json").read_text())["details"]["blocks"] == [0, 1, 2, 3, 4]
  whole = {p: (pub / p).read_bytes() for p in ("results.md", "results.json", "along.png")}
  proc = _along("--seeds=5", f"--out={pub}", "--train=false", f"--publish={pub}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert {p: (pub / p).read_bytes() for p in whole} == whole
  # This command's block 4 without its r1_recon: the published r1_recon of
  # seed 4 (another attempt's) does not complete it; a block is never mixed.
  shutil.rmtree(out / study_report.run_name("r1_recon", 4))
  proc = _along("--first_seed=4", "--seeds=1", f"--out={out}", "--train=false",
                f"--publish={pub}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  payload = json.loads((pub / "results.json").read_text())
  assert payload["details"]["blocks"] == [0, 1, 2, 3]
  assert payload["details"]["incomplete_blocks"] == [4]


def test_fewer_blocks_are_interim(block_runs):
  found = blocks.collect(block_runs, range(3), ALONG)
  table, reversals = blocks.compare(found, ALONG)
  text = along.markdown(found, table, reversals, ALONG, len(found.complete(ALONG)[0]))
  assert "3 block(s) (seeds 0, 1, 2): **interim**" in text


@pytest.mark.integration
def test_refuses_a_folder_without_runs_and_names_a_damaged_row(block_runs, tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  proc = _along(f"--out={empty}", "--train=false", f"--publish={tmp_path / 'pub'}")
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
      f"along: error: {empty}: no scored run of the protocol for seeds 0-4 (expected "
      "<variant>_seed<k>/ folders with along_results.json: r1_recon, r3_recon, "
      "r3_recon_nostop)"]
  assert not (tmp_path / "pub").exists() and os.listdir(empty) == []
  metrics = os.path.join(block_runs, "r3_recon_seed2", "metrics.jsonl")
  lines = open(metrics).read().splitlines(keepends=True)
  lines[3] = lines[3][:len(lines[3]) // 2] + "\n"
  with open(metrics, "w") as f:
    f.writelines(lines)
  proc = _along(f"--out={block_runs}", "--train=false", f"--publish={tmp_path / 'pub'}")
  assert proc.returncode == 1
  assert len(proc.stderr.strip().splitlines()) == 1
  assert proc.stderr.startswith(f"along: error: {metrics}: line 4: not a JSON row")


def test_bad_kept_epochs_refused_in_one_line(tmp_path):
  proc = _along(f"--out={tmp_path}", "--kept=0,2", "--epochs=2")
  assert proc.returncode == 1
  assert proc.stderr.strip() == ("along: error: --kept=0,2: expected epochs between 1 "
                                 "and --epochs=2")


@pytest.mark.slow
@needs_mnist
def test_a_block_end_to_end_on_a_small_model(tmp_path):
  """One block of two epochs, kept at 1 and 2, each kept checkpoint scored on
  the test and affine test sets; the small files published, no checkpoint."""
  out, pub = tmp_path / "out", tmp_path / "pub"
  proc = _along("--seeds=1", "--epochs=2", "--kept=1,2", f"--out={out}",
                f"--publish={pub}", "--", *SMALL, "--train_size=320")
  assert proc.returncode == 0, proc.stderr[-3000:]
  for variant in protocols.ALONG.variants:
    run = out / study_report.run_name(variant, 0)
    assert sorted(p for p in os.listdir(run / "epochs") if p.endswith(".index")) == [
        "model.ckpt-10.index", "model.ckpt-20.index"]
    results = json.loads((run / blocks.RESULTS_FILE).read_text())
    assert sorted(results) == ["1", "2"] and results["2"]["step"] == 20
    assert results["1"]["test"]["count"] == results["1"]["affine"]["count"] == 10000
    assert sorted(os.listdir(pub / study_report.run_name(variant, 0))) == sorted(
        n for n in blocks.SMALL_FILES)
  assert "1 block(s) (seeds 0): **interim**" in (pub / "results.md").read_text()


def test_an_incomplete_block_is_left_out(block_runs, tmp_path):
  # Block 4 without its r3_recon_nostop run (a sitting that ended first), and
  # block 3 with one registered epoch not scored.
  shutil.rmtree(os.path.join(block_runs, study_report.run_name("r3_recon_nostop", 4)))
  path = os.path.join(block_runs, study_report.run_name("r1_recon", 3), blocks.RESULTS_FILE)
  results = json.load(open(path))
  del results["10"]
  json.dump(results, open(path, "w"))
  found = blocks.collect(block_runs, range(5), ALONG)
  text = along.report(found, ALONG, str(tmp_path / "out"))
  assert ("3 block(s) (seeds 0, 1, 2): **interim**, the rule judges five blocks. "
          "Seed(s) 3, 4: an incomplete block (a run or a scoring missing), left out "
          "until it is complete.") in text
  payload = json.loads((tmp_path / "out" / "results.json").read_text())
  assert payload["details"]["blocks"] == [0, 1, 2]
  assert payload["details"]["incomplete_blocks"] == [3, 4] and not payload["final"]
  # Every pair is over the same three blocks, r3 - r1 too (both of its runs exist
  # in block 4).
  assert {c["n"] for c in payload["comparisons"]} == {3}
  assert sorted(r["seed"] for r in payload["runs"] if r["variant"] == "r3_recon") == [0, 1, 2]
