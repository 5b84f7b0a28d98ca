"""The stop_gradient study: aggregation, table, skip/resume, end to end."""
import json
import os
import subprocess
import sys

import numpy as np

from capsnet import study
from conftest import ROOT
from test_train import SMALL, needs_mnist


def fake_run(folder, test_error, val_errors, diag, epochs=1, speed=100.0):
  os.makedirs(folder)
  with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
    for k, e in enumerate(val_errors):
      row = {"epoch": round(epochs * (k + 1) / len(val_errors), 3), "step": k,
             "val_error_percent": e}
      if k == len(val_errors) - 1:
        row.update(epoch=epochs, images_per_sec=speed)
      f.write(json.dumps(row) + "\n")
  with open(os.path.join(folder, "diagnostics.jsonl"), "w") as f:
    for d in diag:
      f.write(json.dumps({"step": 1, "digit_caps/weights": d, "conv1/weights": d / 2}) + "\n")
  with open(os.path.join(folder, "test_results.json"), "w") as f:
    json.dump({"error_percent": test_error}, f)


def test_summary_and_table(tmp_path):
  out = str(tmp_path)
  fake_run(study.run_dir(out, "r2_stop", 0), 1.0, [3.0, 1.5], [0.01, 0.2], speed=90)
  fake_run(study.run_dir(out, "r2_stop", 1), 1.5, [2.0, 1.7], [0.03, 0.4], speed=110)
  fake_run(study.run_dir(out, "r1", 0), 2.0, [4.0, 2.5], [0.0, 0.0])
  os.remove(os.path.join(study.run_dir(out, "r1", 0), "test_results.json"))
  assert not study.is_complete(study.run_dir(out, "r1", 0), 1)
  assert not study.is_complete(study.run_dir(out, "r2_stop", 0), 2)
  rows = study.summarize(out, ["r1", "r2_stop"], 2, 1)
  assert [r["variant"] for r in rows] == ["r2_stop"]     # r1 is incomplete
  r = rows[0]
  assert r["seeds"] == 2 and r["iter_routing"] == 2 and r["stop_gradient"] is True
  np.testing.assert_allclose(r["test_error_mean"], 1.25)
  np.testing.assert_allclose(r["test_error_std"], np.std([1.0, 1.5], ddof=1))
  np.testing.assert_allclose(r["best_val_error_mean"], 1.6)
  np.testing.assert_allclose(r["images_per_sec"], 100.0)
  np.testing.assert_allclose(r["diag"]["digit_caps/weights"], (0.02, 0.3))
  table = study.markdown(rows)
  assert "| r2_stop | 2 | True | 2 | 1 | 1.250 ± 0.354 | 1.00, 1.50 | 1.600 | 100 | 0.02 → 0.3 | 0.01 → 0.15 |" in table
  path = str(tmp_path / "plot.png")
  study.plot(rows, path)
  assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@needs_mnist
def test_study_cli_runs_then_skips(tmp_path):
  out = str(tmp_path / "study")
  args = [sys.executable, "-m", "capsnet.study", "--epochs=1", "--seeds=1",
          "--variants=r1,r2_nostop", f"--out={out}", "--diag_every=5",
          "--val_every=10", "--", *SMALL, "--train_size=640"]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for name in ("results.md", "results.json", "val_error.png", "r1_seed0.log",
               "r2_nostop_seed0/test_results.json"):
    assert os.path.exists(os.path.join(out, name)), name
  rows = json.load(open(os.path.join(out, "results.json")))
  assert [r["variant"] for r in rows] == ["r1", "r2_nostop"]
  assert all(r["seeds"] == 1 and 0 <= r["test_error_mean"] <= 100 for r in rows)
  # r = 1: no inner iteration, nothing flows through c.
  assert rows[0]["diag"]["digit_caps/weights"] == [0.0, 0.0]
  assert rows[1]["diag"]["digit_caps/weights"][1] > 0
  # Curves: validations at steps 10 and the epoch end (20 steps).
  assert [p[0] for p in rows[1]["curves"][0]] == [0.5, 1]
  proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env,
                        timeout=600)
  assert proc.returncode == 0
  assert "r1 seed 0: complete, skipped" in proc.stdout
  assert "r2_nostop seed 0: complete, skipped" in proc.stdout


def test_unknown_variant(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "capsnet.study", "--variants=r9",
                         f"--out={tmp_path}"], capture_output=True, text=True, cwd=ROOT)
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1] == (
      "study: error: --variants: ['r9'] not in "
      "['r1', 'r2_stop', 'r2_nostop', 'r3_stop', 'r3_nostop']")
