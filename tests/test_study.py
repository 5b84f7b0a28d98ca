"""The routing studies (capsnet.study, capsnet.science.grids) and their
reports (capsnet.science.report): aggregation, table, skip/resume,
publishing, end to end."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from capsnet.running import runs
from capsnet.science import grids
from capsnet.science import protocols
from capsnet.science import report
from capsnet.science import stats
from conftest import ROOT
from conftest import SMALL
from conftest import needs_mnist


def fake_run(folder, test_error, val_errors, diag, epochs=1, speed=100.0,
             complete=True, precision="bf16", at_least_one=None, every_epoch=False):
  """A run folder as train.py leaves it; the last val error closes `epochs`
  (every_epoch: each val error closes an epoch, as with --val_every=0)."""
  os.makedirs(folder)
  with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
    for k, e in enumerate(val_errors):
      row = {"epoch": round(epochs * (k + 1) / len(val_errors), 3), "step": 10 * (k + 1),
             "val_error_percent": e}
      if k == len(val_errors) - 1 or every_epoch:
        row.update(images_per_sec=speed, wall_s=90.0)
      if k == len(val_errors) - 1:
        row.update(epoch=epochs)
      f.write(json.dumps(row) + "\n")
  with open(os.path.join(folder, "diagnostics.jsonl"), "w") as f:
    for k, d in enumerate(diag):
      f.write(json.dumps({"step": 1 + k, "epoch": k / 2, "digit_caps/weights": d,
                          "conv1/weights": d / 2}) + "\n")
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump({"model": {"precision": precision}, "train": {"batch_size": 128}}, f)
  if complete:
    with open(os.path.join(folder, "test_results.json"), "w") as f:
      result = {"error_percent": test_error, "count": 10000}
      if at_least_one is not None:
        result["at_least_one"] = at_least_one
      json.dump(result, f)


def test_summary_and_table(tmp_path):
  out = str(tmp_path)
  fake_run(report.run_dir(out, "r2_stop", 0), 1.0, [3.0, 1.5], [0.01, 0.2], speed=90)
  fake_run(report.run_dir(out, "r2_stop", 1), 1.5, [2.0, 1.7], [0.03, 0.4], speed=110)
  fake_run(report.run_dir(out, "r1", 0), 2.0, [4.0, 2.5], [0.0, 0.0], complete=False)
  assert not report.is_complete(report.run_dir(out, "r1", 0), 1)
  assert not report.is_complete(report.run_dir(out, "r2_stop", 0), 2)
  assert report.is_complete(report.run_dir(out, "r2_stop", 0), 1)
  rows = report.summarize(out, grids.GRIDS["stop_gradient"], ["r1", "r2_stop"], range(2), 1)
  assert [r["variant"] for r in rows] == ["r1", "r2_stop"]
  r1, r = rows
  assert r1["seeds"] == 0 and r1["test_error_mean"] is None and len(r1["runs"]) == 1
  assert r["seeds"] == 2 and r["iter_routing"] == 2 and r["stop_gradient"] is True
  np.testing.assert_allclose(r["test_error_mean"], 1.25)
  np.testing.assert_allclose(r["test_error_std"], np.std([1.0, 1.5], ddof=1))
  np.testing.assert_allclose(r["best_val_error_mean"], 1.6)
  np.testing.assert_allclose(r["images_per_sec"], 100.0)
  np.testing.assert_allclose(r["diag"]["digit_caps/weights"], (0.02, 0.3))
  assert r["runs"][1]["test_errors_count"] == 150
  assert r["runs"][0]["diag_curve"] == [(0.0, 0.01), (0.5, 0.2)]
  table = report.markdown(rows, grids.GRIDS["stop_gradient"])
  assert ("| r2_stop | 2 | yes | True | 2000 steps | 2 of 2 | 1.250 ± 0.354 | 1.00, 1.50 "
          "| 1.600 | 100 | 0.02 → 0.3 | 0.01 → 0.15 |") in table
  assert ("| r1 | 1 | yes | n/a | 2000 steps | 0 of 1 | – | in progress (1/1 epochs) "
          "| 2.500 | 100 | 0 → 0 | 0 → 0 |") in table
  assert "| r2_stop_seed1 | bf16 | 1 | 20 | 1.50 | 150 | 1.70 | 110 | 2 min |" in table
  assert "| r1_seed0 | bf16 | 1 (in progress) | 20 | – | – | 2.50 | 100 | 2 min |" in table
  for name, draw in (("plot.png", report.plot), ("diag.png", report.plot_diagnostic)):
    draw(rows, str(tmp_path / name))
    assert open(tmp_path / name, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_multimnist_table_and_curve_by_pairs_seen(tmp_path):
  out = str(tmp_path)
  fake_run(report.run_dir(out, "r3_recon", 0), 6.5, [30.0, 12.0, 8.0], [0.01, 0.2],
           epochs=2, at_least_one=0.991)
  (r,) = report.summarize(out, grids.GRIDS["multimnist"], ["r3_recon"], range(1), 2)
  assert r["dataset"] == "multimnist"
  (run,) = r["runs"]
  assert run["images_seen"] == 30 * 128 and run["test_at_least_one"] == 0.991
  assert run["images_curve"] == [(1280, 30.0), (2560, 12.0), (3840, 8.0)]
  table = report.markdown([r], grids.GRIDS["multimnist"])
  assert "| training pairs seen | test: at least one right % |" in table
  assert ("| r3_recon_seed0 | bf16 | 2 | 30 | 6.50 | 650 | 8.00 | 100 | 2 min | 3,840 "
          "| 99.10 |") in table
  report.report([r], str(tmp_path / "report"), grids.GRIDS["multimnist"])
  assert open(tmp_path / "report" / "val_error.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  # an MNIST table keeps its nine columns
  assert "pairs seen" not in report.markdown(report.summarize(
      out, grids.GRIDS["table1"], ["r3_recon"], range(1), 2), grids.GRIDS["table1"])


def test_table1_grid_commands_and_schedules(tmp_path):
  grid = grids.GRIDS["table1"].variants
  assert sorted(grid) == ["r1_norecon", "r1_recon", "r3_norecon", "r3_recon",
                          "r3_recon_balance", "r3_recon_nostop", "r3_recon_official"]
  # Issue 24's runs (f) and (g): the official loss balance, then its layers.
  cmd = grids.train_command(grid["r3_recon_official"], 0, "/f", dict(
      epochs=50, precision="bf16", decay_steps=2000, diag_every=100, val_every=0), [])
  assert cmd[2:8] == ["--iter_routing=3", "--stop_gradient=True", "--use_decoder=True",
                      "--recon_weight=0.01", "--capsule_layers=official",
                      "--ema_decay=0.999"]
  settings = dict(epochs=50, precision="bf16", decay_steps=143, diag_every=100,
                  val_every=0)
  folder = report.run_dir("/runs", "r3_recon_nostop", 1, 143)
  assert folder == "/runs/r3_recon_nostop_decay143_seed1"
  assert report.run_dir("/runs", "r1_norecon", 0) == "/runs/r1_norecon_seed0"
  cmd = grids.train_command(grid["r3_recon_nostop"], 1, folder, settings, ["--x=1"])
  assert cmd[1].endswith("train.py")
  assert cmd[2:] == ["--iter_routing=3", "--stop_gradient=False", "--use_decoder=True",
                     "--seed=1", "--epochs=50", f"--logdir={folder}", "--precision=bf16",
                     "--decay_steps=143", "--diag_every=100", "--val_every=0",
                     "--progress=false", "--x=1"]
  assert "--use_decoder=False" in grids.train_command(grid["r1_norecon"], 0, folder,
                                                      settings, [])
  (multimnist,) = grids.GRIDS["multimnist"].variants.values()
  assert grids.train_command(multimnist, 0, folder, settings, [])[2:6] == [
      "--iter_routing=3", "--stop_gradient=True", "--use_decoder=True",
      "--dataset=multimnist"]
  # Two schedules of one variant: a row each, and only the small files published.
  out = str(tmp_path / "runs")
  fake_run(report.run_dir(out, "r3_recon", 0), 0.4, [1.0, 0.5], [0.1, 0.2], epochs=2)
  fake_run(report.run_dir(out, "r3_recon", 0, 143), 0.3, [0.9, 0.4], [0.1, 0.3], epochs=2)
  open(os.path.join(report.run_dir(out, "r3_recon", 0), "model.ckpt-1.index"), "w").close()
  rows = report.summarize(out, grids.GRIDS["table1"], ["r3_recon"], [0], 2, (2000, 143))
  assert [(r["variant"], r["decay_steps"], r["test_error_mean"]) for r in rows] == [
      ("r3_recon", 2000, 0.4), ("r3_recon", 143, 0.3)]
  assert rows[0]["use_decoder"] is True and rows[0]["stop_gradient"] is True
  published = str(tmp_path / "published")
  report.report(rows, published, grids.GRIDS["table1"])
  report.publish(out, rows, published)
  assert sorted(os.listdir(published)) == [
      "diagnostic.png", "r3_recon_decay143_seed0", "r3_recon_seed0", "results.json",
      "results.md", "val_error.png"]
  assert sorted(os.listdir(os.path.join(published, "r3_recon_seed0"))) == sorted(
      set(runs.SMALL_FILES) - {"routing.json", "host.json", "affine_results.json"})


@pytest.mark.integration
@needs_mnist
def test_study_cli_runs_then_skips(tmp_path):
  out = str(tmp_path / "study")
  args = [sys.executable, "-m", "capsnet.study", "--epochs=1", "--seeds=1",
          "--variants=r2_nostop", f"--out={out}", "--diag_every=5",
          "--val_every=10", "--", *SMALL, "--train_size=640"]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for name in ("results.md", "results.json", "val_error.png", "diagnostic.png",
               "r2_nostop_seed0.log", "r2_nostop_seed0/test_results.json"):
    assert os.path.exists(os.path.join(out, name)), name
  payload = json.load(open(os.path.join(out, "results.json")))
  (row,) = payload["details"]["rows"]
  (run,) = payload["runs"]
  assert (payload["protocol"], run["variant"], run["seed"]) == ("stop_gradient", "r2_nostop", 0)
  row["runs"] = payload["runs"]
  test = json.load(open(os.path.join(out, "r2_nostop_seed0", "test_results.json")))
  assert row["variant"] == "r2_nostop" and row["seeds"] == 1
  assert row["test_errors"] == [test["error_percent"]]
  assert row["runs"][0]["steps"] == 20 and row["runs"][0]["precision"] == "fp32"
  diag = [json.loads(line) for line in open(os.path.join(out, "r2_nostop_seed0",
                                                   "diagnostics.jsonl"))]
  assert row["diag"]["digit_caps/weights"] == [diag[0]["digit_caps/weights"],
                                               diag[-1]["digit_caps/weights"]]
  assert diag[-1]["digit_caps/weights"] > 1e-4   # r = 2: some gradient through c
  # Curves: validations at steps 10 and the epoch end (20 steps).
  assert [p[0] for p in row["curves"][0]] == [0.5, 1]
  # Routing measured on the best checkpoint, with r = 2 and with r = 1.
  routing = json.load(open(os.path.join(out, "r2_nostop_seed0", "routing.json")))
  assert routing["own"]["iter_routing"] == 2 and routing["other"]["iter_routing"] == 1
  assert routing["own"]["errors"] == round(test["error_percent"] * 100)
  assert len(routing["own"]["entropy"]) == 2 and len(routing["other"]["max_c"]) == 1
  np.testing.assert_allclose(routing["other"]["entropy"], [np.log(10)], rtol=1e-6)
  assert routing["own"]["entropy"][1] < np.log(10)   # the second iteration moved c
  assert row["runs"][0]["routing"] == routing
  assert 0 <= routing["fixed"] + routing["broken"] <= routing["changed"] <= 10000
  proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env,
                        timeout=600)
  assert proc.returncode == 0
  assert "r2_nostop_seed0: complete, skipped" in proc.stdout


@pytest.mark.integration
def test_a_failed_program_is_named_with_its_first_flags_and_log(tmp_path):
  """grids.call and the registered runner's children: one line naming the
  program, its first two flags, its exit status and its log."""
  from capsnet.science import registered
  prog = tmp_path / "prog.py"
  prog.write_text("import sys\nprint('dying')\nsys.exit(3)\n")
  cmd = [sys.executable, str(prog), "--a=1", "--b=2", "--c=3"]
  log = str(tmp_path / "run.log")
  with pytest.raises(runs.RunError) as e:
    grids.call(cmd, log)
  assert str(e.value) == f"prog.py --a=1 --b=2 failed (exit 3); see {log}"
  with pytest.raises(registered.RegisteredError) as e:
    registered.Children().call(cmd, str(tmp_path / "run"))
  assert str(e.value) == f"prog.py --a=1 --b=2 failed (exit 3); see {log}"
  with open(log) as f:
    assert f.read() == "dying\ndying\n"


def test_study_flag_errors(tmp_path):
  def refused(*flags):
    """The stderr lines of a study command that must fail."""
    proc = subprocess.run([sys.executable, "-m", "capsnet.study", *flags,
                           f"--out={tmp_path}"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode != 0
    return proc.stderr.strip().splitlines()
  def last_error(*flags):
    return refused(*flags)[-1]
  assert last_error("--variants=r9") == (
      "study: error: --variants: ['r9'] not in the stop_gradient grid "
      "['r1', 'r2_stop', 'r2_nostop', 'r3_stop', 'r3_nostop']")
  assert last_error("--grid=table1", "--variants=r3_stop") == (
      "study: error: --variants: ['r3_stop'] not in the table1 grid "
      "['r1_norecon', 'r1_recon', 'r3_norecon', 'r3_recon', 'r3_recon_nostop', "
      "'r3_recon_balance', 'r3_recon_official']")
  assert last_error("--decay_steps=2000,x") == (
      "study: error: --decay_steps=2000,x: expected positive integers")
  assert "flag --precision=fp16: value should be one of <fp32|bf16>" in "\n".join(
      refused("--precision=fp16"))
  assert not os.listdir(tmp_path)   # refused before anything is written


def test_t_quantiles_and_paired_interval_by_hand():
  # Student's t, 0.975 quantile, from the printed tables.
  for df, t in ((1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (9, 2.2622),
                (30, 2.0423)):
    np.testing.assert_allclose(stats.t_quantile(0.975, df), t, atol=5e-5)
  np.testing.assert_allclose(stats.t_quantile(0.95, 2), 2.9200, atol=5e-5)
  # Differences 0.11, 0.02, 0.01: mean 0.04667, sd 0.055076, half-width
  # 4.3027 * 0.055076 / sqrt(3) = 0.13682 -> [-0.09015, 0.18349].
  d = stats.paired_difference({0: 0.38, 1: 0.43, 2: 0.40, 3: 0.5},
                              {0: 0.49, 1: 0.45, 2: 0.41, 4: 0.1})
  assert d["seeds"] == [0, 1, 2] and d["n"] == 3   # seeds 3 and 4 have no pair
  np.testing.assert_allclose(d["diffs"], [0.11, 0.02, 0.01], atol=1e-12)
  np.testing.assert_allclose([d["mean"], d["sd"], d["lo"], d["hi"]],
                             [0.046667, 0.055076, -0.090149, 0.183482], atol=2e-6)
  assert not d["called"]
  assert stats.verdict(d) == ("not measurable at this budget: the interval is "
                              "[-0.090, +0.183]")
  assert stats.cell(d, "+.3f") == "+0.047 [-0.090, +0.183]"   # not called: not bold
  # Consistent differences: the interval excludes zero.
  d = stats.paired_difference({0: 1.0, 1: 2.0, 2: 3.0}, {0: 1.5, 1: 2.6, 2: 3.4})
  np.testing.assert_allclose([d["lo"], d["hi"]], [0.5 - 4.3027 * 0.1 / np.sqrt(3),
                                                  0.5 + 4.3027 * 0.1 / np.sqrt(3)],
                             atol=1e-4)
  assert d["called"] and stats.verdict(d).startswith("called: +0.500 points")
  assert stats.cell(d, "+.2f") == "**+0.50 [+0.25, +0.75]**"
  assert stats.cell(d, "+.2f", show_n=True) == "**+0.50 [+0.25, +0.75], n = 3**"
  d = stats.paired_difference({0: 1.0}, {0: 1.5})
  assert d["lo"] is None and not d["called"]
  assert stats.cell(d, ".1f") == "0.5 (n = 1)" and stats.cell(None, ".1f", "–") == "–"
  assert stats.paired_difference({0: 1.0}, {1: 1.5}) is None
  with pytest.raises(ValueError, match="p must be in"):
    stats.t_quantile(0.4, 3)


def test_seed_aggregation_comparison_and_band_plot(tmp_path):
  out = str(tmp_path)
  def vals(last):
    return [2.0] * 5 + [last] * 10   # the last 10 epochs' mean: last
  for seed, (a_test, b_test, a_last, b_last) in enumerate(
      [(0.38, 0.49, 0.40, 0.42), (0.43, 0.45, 0.44, 0.46), (0.40, 0.41, 0.41, 0.40)]):
    fake_run(report.run_dir(out, "r3_recon", seed), a_test, vals(a_last), [0.1], epochs=15,
             every_epoch=True)
    fake_run(report.run_dir(out, "r3_recon_nostop", seed), b_test, vals(b_last), [0.1],
             epochs=15, every_epoch=True)
  fake_run(report.run_dir(out, "r1_recon", 0), 0.37, vals(0.36), [0.0], epochs=15,
           complete=False, every_epoch=True)
  rows = report.summarize(out, grids.GRIDS["table1"], ["r3_recon", "r3_recon_nostop", "r1_recon"],
                         range(3), 15)
  stop, nostop, r1 = rows
  np.testing.assert_allclose(stop["last_val_errors"], [0.40, 0.44, 0.41])
  np.testing.assert_allclose([stop["last_val_error_mean"], stop["last_val_error_std"]],
                             [0.416667, np.std([0.40, 0.44, 0.41], ddof=1)], atol=1e-6)
  assert r1["last_val_errors"] == [] and r1["runs"][0]["last_val_error"] is None
  pairs = grids.parse_pairs(["r3_recon:r3_recon_nostop", "r3_recon:r1_recon"],
                            grids.GRIDS["table1"].variants)
  comparisons = report.compare(rows, pairs)
  assert [(c["a"], c["b"]) for c in comparisons] == [
      ("r3_recon", "r3_recon_nostop"), ("r3_recon", "r1_recon")]
  test = comparisons[0]["test_error"]
  np.testing.assert_allclose([test["mean"], test["lo"], test["hi"]],
                             [0.046667, -0.090149, 0.183482], atol=2e-6)
  late = comparisons[0]["last_val_error"]
  np.testing.assert_allclose(late["diffs"], [0.02, 0.02, -0.01], atol=1e-9)
  assert comparisons[1]["test_error"] is None   # r1_recon has no finished seed
  table = report.markdown(rows, grids.GRIDS["table1"], comparisons)
  assert ("| r3_recon | 2000 | 3 | 0.403 ± 0.025 | 0.38 (seed 0), 0.43 (seed 1), "
          "0.40 (seed 2) | 0.417 ± 0.021 | 0.400 (seed 0), 0.440 (seed 1), "
          "0.410 (seed 2) |") in table
  assert ("| r3_recon | r3_recon_nostop | 2000 | test error of the best-validation "
          "checkpoint, % | 3 | +0.110 (seed 0), +0.020 (seed 1), +0.010 (seed 2) | "
          "+0.047 | [-0.090, +0.183] | not measurable at this budget: the interval "
          "is [-0.090, +0.183] |") in table
  assert "| r3_recon | r1_recon | 2000 | test error" in table and "no paired seeds" in table
  with pytest.raises(ValueError, match="--compare=r3_recon:r9: expected A:B"):
    grids.parse_pairs(["r3_recon:r9"], grids.GRIDS["table1"].variants)
  # The band: mean, lowest and highest seed at each epoch; a seed in progress
  # counts where it has points.
  xs, means, lows, highs = report.band([[(1, 1.0), (2, 0.5)], [(1, 3.0), (2, 0.7)],
                                       [(1, 2.0)]])
  assert xs == [1, 2] and means == [2.0, 0.6] and lows == [1.0, 0.5] and highs == [3.0, 0.7]
  report.report(rows, str(tmp_path / "report"), grids.GRIDS["table1"], comparisons)
  assert open(tmp_path / "report" / "val_error.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  saved = json.load(open(tmp_path / "report" / "results.json"))
  assert sorted(saved) == ["comparisons", "details", "final", "protocol", "runs", "title"]
  assert len(saved["details"]["rows"]) == 3 and saved["protocol"] == "table1"
  assert len(saved["runs"]) == sum(len(r["runs"]) for r in rows)
  # a comparison a measure: the two figures of each pair that has seeds
  assert {c["measure"] for c in saved["comparisons"]} == {"test_error", "last_val_error"}


def test_routing_summary_counts_changed_predictions(tmp_path):
  def result(r, entropy, max_c):
    return {"iter_routing": r, "error_percent": 40.0, "routing_entropy": entropy,
            "routing_max_c": max_c, "checkpoint": "x/best/model.ckpt-9",
            "routing_uniform_entropy": float(np.log(10))}
  labels = [0, 1, 2, 3, 4]
  own = (result(3, [2.3026, 2.30, 2.29], [0.1, 0.11, 0.12]), (labels, [0, 1, 9, 9, 4]))
  other = (result(1, [2.3026], [0.1]), (labels, [0, 7, 2, 8, 4]))
  m = grids.routing_summary(own, other)
  # changed: image 1 (right -> wrong: broken), 2 (wrong -> right: fixed),
  # 3 (wrong -> wrong).
  assert (m["changed"], m["fixed"], m["broken"]) == (3, 1, 1)
  assert m["own"]["errors"] == 2 and m["other"]["errors"] == 2 and m["images"] == 5
  assert m["own"]["entropy"] == [2.3026, 2.30, 2.29] and m["other"]["iter_routing"] == 1
  assert grids.other_routing(3) == 1 and grids.other_routing(1) == 3
  with pytest.raises(ValueError, match="different images"):
    grids.routing_summary(own, (other[0], ([1, 1, 2, 3, 4], [0, 7, 2, 8, 4])))


def test_averaged_weights_figures(tmp_path):
  """A run with weight averaging: the figures are the better weights'."""
  folder = report.run_dir(str(tmp_path), "r3_recon_balance", 0)
  fake_run(folder, 0.3, [1.0] * 12, [0.1], epochs=12, every_epoch=True)
  path = os.path.join(folder, "metrics.jsonl")
  rows = [json.loads(line) for line in open(path)]
  for k, r in enumerate(rows):
    r["val_error_percent_averaged"] = 0.9 if k == 5 else 1.1
  open(path, "w").write("".join(json.dumps(r) + "\n" for r in rows))
  run = report.describe_run(folder, 12)
  assert run["val_weights"] == "averaged" and run["best_val_error"] == 0.9
  np.testing.assert_allclose(run["last_val_error"], (9 * 1.1 + 0.9) / 10)  # averaged too
  assert report._better_weights(rows[:5]) == "raw"   # 1.0 against 1.1
  for r in rows:
    r["val_error_percent_averaged"] = 1.0 if r is rows[0] else 2.0
  assert report._better_weights(rows) == "raw"       # a tie: the later epochs


def test_short_protocol_tables_compare_its_three_measures(tmp_path):
  """--grid=short: per variant the three measures over blocks, the paired
  table of each (margin loss to 5 decimals, "within [lo, hi]" wording), the
  severity sweep, and the affine plots."""
  out = str(tmp_path)
  figures = {"r3_recon": [(1.00, 0.0200, 3.0), (1.10, 0.0210, 3.2), (1.05, 0.0205, 3.1)],
             "r3_recon_nostop": [(1.20, 0.0230, 3.1), (1.25, 0.0240, 3.3),
                                 (1.30, 0.0236, 3.0)]}
  for variant, per_seed in figures.items():
    for seed, (test, margin, aff) in enumerate(per_seed):
      folder = report.run_dir(out, variant, seed, 14)
      fake_run(folder, test, [2.0, 1.5], [0.1], epochs=5)
      with open(os.path.join(folder, "test_results.json"), "w") as f:
        json.dump({"error_percent": test, "count": 10000, "margin_loss_mean": margin}, f)
      with open(os.path.join(folder, "affine_results.json"), "w") as f:
        json.dump({"error_percent": aff, "count": 10000,
                   "sweep": [{"max_rotation_deg": d, "error_percent": aff * (1 + d / 20)}
                             for d in (0, 20, 45)]}, f)
  rows = report.summarize(out, grids.GRIDS["short"], ["r3_recon", "r3_recon_nostop"],
                          range(3), 5, (14,))
  stop, nostop = rows
  np.testing.assert_allclose(stop["spreads"]["affine_error"]["values"], [3.0, 3.2, 3.1])
  assert stop["spreads"]["test_margin_loss"]["mean"] == pytest.approx(0.0205)
  pairs = grids.parse_pairs(["r3_recon:r3_recon_nostop"], grids.GRIDS["short"].variants)
  comparisons = report.compare(rows, pairs, protocols.SHORT_MEASURES)
  (c,) = comparisons
  assert c["test_error"]["called"] and c["test_margin_loss"]["called"]
  assert not c["affine_error"]["called"]
  np.testing.assert_allclose(c["affine_error"]["diffs"], [0.1, 0.1, -0.1], atol=1e-9)
  table = report.markdown(rows, grids.GRIDS["short"], comparisons)
  assert ("| r3_recon | 3 | 1.05 ± 0.05 | 1.00 (0), 1.10 (1), 1.05 (2) | 0.02050 ± "
          "0.00050 | 0.02000 (0), 0.02100 (1), 0.02050 (2) | 3.10 ± 0.10 | 3.00 (0), "
          "3.20 (1), 3.10 (2) |") in table
  assert ("| r3_recon | r3_recon_nostop | 14 | mean test margin loss per example | 3 | "
          "+0.00300 (block 0), +0.00300 (block 1), +0.00310 (block 2) | +0.00303 |") in table
  assert "| affine-test error, % | 3 |" in table
  lo, hi = c["affine_error"]["lo"], c["affine_error"]["hi"]
  assert f"| within [{lo:+.3f}, {hi:+.3f}] |" in table
  assert "| r3_recon_decay14_seed0 | 3.00 | 6.00 | 9.75 |" in table   # the sweep
  shipped = [(0, 0.7), (20, 1.7), (45, 8.4)]
  table = report.report(rows, str(tmp_path / "report"), grids.GRIDS["short"], comparisons,
                        shipped)
  assert "The shipped weights (pretrained/r3_recon, 50 epochs), same sweep: 0°: 0.70" in table
  assert {"affine.png", "affine_sweep.png", "val_error.png"} <= set(
      os.listdir(tmp_path / "report"))


def test_short_report_shows_ties_and_the_selection_free_loss(tmp_path):
  """Beside the short protocol's measures: the steps tied at the lowest
  validation error, the step scored, and the validation loss at the last
  step, with its paired comparison (descriptive)."""
  out = str(tmp_path)
  for variant, losses in (("r3_recon", [0.05, 0.04, 0.039]),
                          ("r3_recon_nostop", [0.05, 0.04, 0.038])):
    for seed, shift in ((0, 0.0), (1, 0.001)):
      folder = report.run_dir(out, variant, seed, 14)
      fake_run(folder, 1.0, [1.2, 1.1, 1.1], [0.1], epochs=1)
      rows = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
      with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for row, loss in zip(rows, losses, strict=True):
          f.write(json.dumps(dict(row, val_loss=loss + shift)) + "\n")
      with open(os.path.join(folder, "test_results.json"), "w") as f:
        json.dump({"error_percent": 1.0, "count": 10000,
                   "checkpoint": os.path.join(folder, "best", "model.ckpt-20")}, f)
  rows = report.summarize(out, grids.GRIDS["short"], ["r3_recon", "r3_recon_nostop"],
                          range(2), 1, (14,))
  run = rows[0]["runs"][1]
  assert run["tied_steps"] == [20, 30] and run["selected_step"] == 20
  assert run["last_val_loss"] == pytest.approx(0.040)
  pairs = [("r3_recon", "r3_recon_nostop")]
  descriptive = report.compare(rows, pairs, protocols.SELECTION_FREE)
  assert descriptive[0]["last_val_loss"]["diffs"] == pytest.approx([-0.001, -0.001])
  text = report.markdown(rows, grids.GRIDS["short"],
                         report.compare(rows, pairs, protocols.SHORT_MEASURES), descriptive)
  assert "| r3_recon_decay14_seed1 | 20 | 20, 30 | 0.04000 |" in text
  assert "validation loss at the last step (selection-free; descriptive)" in text


def _study(*args):
  # As a user starts it: TF_CPP_MIN_LOG_LEVEL unset (the suite sets it), so
  # that TensorFlow, where a checkpoint is looked at, starts quietly (startup).
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  return subprocess.run([sys.executable, "-m", "capsnet.study", *args], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.integration
def test_publish_of_a_folder_without_runs_refused_before_any_scoring(tmp_path):
  """A mistyped --out: one line naming it, before the shipped weights'
  affine sweep (13 minutes on a slow host) or anything else is written."""
  empty = tmp_path / "empty"
  empty.mkdir()
  proc = _study("--grid=short", "--seeds=5", "--epochs=5", "--decay_steps=14",
                f"--out={empty}", "--train=false", f"--publish={tmp_path / 'pub'}")
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
      f"study: error: {empty}: no run of the short grid for seeds 0-4 (expected folders "
      "such as r1_recon_decay14_seed0/); a mistyped --out?"]
  assert os.listdir(empty) == [] and not (tmp_path / "pub").exists()


@pytest.mark.integration
def test_a_damaged_row_is_named_by_file_and_line(tmp_path):
  out = tmp_path / "short"
  for seed in range(2):
    fake_run(report.run_dir(str(out), "r3_recon", seed, 14), 1.0, [1.2, 1.1], [0.1])
  metrics = report.run_dir(str(out), "r3_recon", 1, 14) + "/metrics.jsonl"
  lines = open(metrics).read().splitlines(keepends=True)
  with open(metrics, "w") as f:
    f.write(lines[0] + lines[1][:10] + "\n")
  proc = _study("--grid=short", "--seeds=2", "--decay_steps=14", f"--out={out}",
                "--train=false", "--shipped=")
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
      f"study: error: {metrics}: line 2: not a JSON row (Expecting value: line 2 column "
      "1 (char 11)); a damaged file (restore it from git or the run's copy)"]
