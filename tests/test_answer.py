"""The answer along training (capsnet.answer): the protocols' figures side by
side, from fake results.json files of the short protocol, the protocol along
training (written by along's own report) and the 50-epoch rows."""
import json
import os
import subprocess
import sys

import pytest
from test_along import block_runs  # noqa: F401 (a fixture)
import test_confirm

from capsnet.science import along
from capsnet.science import answer
from capsnet.science import blocks
from capsnet.science import protocols
from capsnet.science import rule
from capsnet.science import stats
from conftest import ROOT

# Test margin loss by (variant, seed) of a fake grid; nostop lower in every seed.
MARGIN = {"r1_recon": [0.020, 0.021, 0.022], "r3_recon": [0.0201, 0.0212, 0.0219],
          "r3_recon_nostop": [0.0190, 0.0195, 0.0210]}


def grid_results(name, decay_steps, seeds):
  """A grid report's results.json (the run fields that answer reads)."""
  runs = [{"run": f"{variant}_seed{s}", "variant": variant, "seed": s,
           "decay_steps": decay_steps, "complete": True, "test_margin_loss": margins[s],
           "test_error": 1.0 + margins[s] * 10,
           "routing": ({"own": {"max_c": [0.1, 0.103, 0.104 + 0.001 * s]}}
                       if variant != "r1_recon" else None),
           "diag": {"digit_caps/weights": [0.0, 0.2 + 0.1 * s]}}
          for variant, margins in MARGIN.items() for s in seeds]
  # Another schedule's run is left out.
  runs.append(dict(runs[0], decay_steps=decay_steps + 1, test_margin_loss=1.0))
  return json.dumps({"protocol": name, "title": name, "final": True, "runs": runs,
                     "comparisons": [], "details": {}})


@pytest.fixture
def study(tmp_path, block_runs):  # noqa: F811
  root = tmp_path / "study"
  (root / "short").mkdir(parents=True)
  (root / "table1").mkdir()
  (root / "short" / "results.json").write_text(
      grid_results("short", protocols.SHORT.decay_steps, [0, 1, 2]))
  (root / "table1" / "results.json").write_text(grid_results("table1", 2000, [0]))
  found = blocks.collect(block_runs, range(5), protocols.ALONG)
  along.report(found, protocols.ALONG, str(root / "along"))
  (root / "confirm").mkdir()   # interim: progress only, no row
  (root / "confirm" / "results.json").write_text(json.dumps(
      {"protocol": "confirm", "title": "", "final": False, "runs": [], "comparisons": [],
       "details": {"runs_done": 31}}))
  return str(root)


def test_each_length_a_row_with_each_protocols_own_figures(study):
  table = answer.rows(study)
  assert [r["length"] for r in table] == [
      "5 epochs, compressed schedule", "epoch 1, paper's schedule",
      "epoch 2, paper's schedule", "epoch 5, paper's schedule",
      "epoch 10, paper's schedule", "50 epochs, paper's schedule"]
  short = table[0]["pairs"]["r3_recon:r3_recon_nostop"]["test_margin_loss"]
  by_hand = stats.paired_difference(dict(enumerate(MARGIN["r3_recon"])),
                                    dict(enumerate(MARGIN["r3_recon_nostop"])))
  assert short == by_hand and short["n"] == 3
  # The along rows are along's comparisons, copied.
  payload = json.load(open(os.path.join(study, "along", "results.json")))
  at5 = next(c for c in payload["comparisons"] if c["epoch"] == 5
             and c["measure"] == "test_error" and c["a"] == "r1_recon"
             and c["b"] == "r3_recon_nostop")
  assert table[3]["pairs"]["r1_recon:r3_recon_nostop"]["test_error"]["mean"] == at5["mean"]
  assert table[-1]["pairs"]["r3_recon:r3_recon_nostop"]["test_margin_loss"]["n"] == 1
  # The mechanism: means over the routed runs.
  assert table[0]["mechanism"]["r3_recon"]["max_c"] == pytest.approx(0.105)
  assert table[0]["mechanism"]["r3_recon"]["grad_share"] == pytest.approx(0.3)
  assert table[4]["mechanism"]["r3_recon"]["grad_share"] == pytest.approx(0.42 + 0.02)


def test_the_markdown_and_the_same_bytes_again(study, tmp_path):
  text = answer.write(study, str(tmp_path / "out"))
  # The short protocol's stop pair: nostop below in all three seeds, called.
  d = answer.rows(study)[0]["pairs"]["r3_recon:r3_recon_nostop"]["test_margin_loss"]
  assert d["called"]
  assert f"| **{d['mean']:+.5f} [{d['lo']:+.5f}, {d['hi']:+.5f}], n = 3** |" in text
  assert "| 50 epochs, paper's schedule | best validation | -0.00110 (n = 1) |" in text
  before = {p: (tmp_path / "out" / p).read_bytes() for p in ("answer.md", "answer.json")}
  answer.write(study, str(tmp_path / "out"))
  assert {p: (tmp_path / "out" / p).read_bytes() for p in before} == before


def test_a_missing_protocol_is_named_and_the_answer_left_as_it_was(study, tmp_path):
  answer.write(study)
  before = {p: open(os.path.join(study, p), "rb").read() for p in ("answer.md", "answer.json")}
  missing = os.path.join(study, "table1", "results.json")
  os.remove(missing)
  with pytest.raises(ValueError, match=f"^{missing}: missing \\(the table1 protocol's"):
    answer.rows(study)
  proc = subprocess.run([sys.executable, "-m", "capsnet.answer", f"--study={study}"],
                        capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert proc.returncode == 1
  assert proc.stderr.strip() == (f"answer: error: {missing}: missing (the table1 "
                                 "protocol's results; --protocols names the ones to "
                                 "put side by side)")
  assert {p: open(os.path.join(study, p), "rb").read() for p in before} == before
  # Told to leave it out, the answer has the other protocols' rows.
  table = answer.rows(study, ("short", "along"))
  assert table[-1]["length"] == "epoch 10, paper's schedule"
  with pytest.raises(ValueError, match="^--protocols=short,tabel1: expected one or more "
                                       "of confirm,short,along,table1$"):
    answer.rows(study, ("short", "tabel1"))
  proc = subprocess.run([sys.executable, "-m", "capsnet.answer", f"--study={tmp_path}"],
                        capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert proc.returncode == 1
  assert proc.stderr.strip().startswith(
      f"answer: error: {tmp_path / 'confirm' / 'results.json'}: missing")


def test_a_damaged_results_file_is_named(study):
  damaged = os.path.join(study, "table1", "results.json")
  with open(damaged, "w") as f:
    f.write('{"rows": [')
  with pytest.raises(ValueError, match=f"^{damaged}: not a JSON file"):
    answer.rows(study)


def test_the_confirmatory_row_comes_first_with_its_registered_calls(study, tmp_path):
  """A complete confirmatory study (made up, written by confirm's own report):
  its epoch-10 row first, the test error its registered decision's, called by
  the registered rule alone; its margin loss never called."""
  out = tmp_path / "confirm"
  errs = test_confirm.errors(0.04, 0.0, 0.06, spread=3.0)
  for seed in protocols.CONFIRM.seeds:
    test_confirm.fake_block(str(out), seed, errs)
  rule.report(str(out), protocols.CONFIRM, os.path.join(study, "confirm"))
  payload = json.load(open(os.path.join(study, "confirm", "results.json")))
  table = answer.rows(study)
  first = table[0]
  assert first["length"] == "epoch 10, paper's schedule: confirmatory, 16 blocks"
  assert [r["length"] for r in table[1:]][:2] == ["5 epochs, compressed schedule",
                                                 "epoch 1, paper's schedule"]
  stop = first["pairs"]["r3_recon:r3_recon_nostop"]
  registered = payload["details"]["decision"]["primary"]
  assert {k: stop["test_error"][k] for k in ("mean", "lo", "hi", "called", "n")} == {
      k: registered[k] for k in ("mean", "lo", "hi", "called", "n")}
  assert stop["test_margin_loss"]["called"] is False
  routing = first["pairs"]["r1_recon:r3_recon"]["test_error"]
  assert routing["called"] == payload["details"]["decision"]["secondary"][0]["called"]
  text = answer.markdown(table)
  assert text.splitlines()[8].startswith(
      "| epoch 10, paper's schedule: confirmatory, 16 blocks | none | ")
