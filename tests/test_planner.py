"""The planner (capsnet/running/planner.py) and its program, capsnet.plan: the
measured plan, its cache, and what a run keeps."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from capsnet.model import fast_conv
from capsnet.model import network
from capsnet.running import planner
from capsnet.running import runs
from conftest import QUICK
from conftest import ROOT
from conftest import THREE_EPOCHS
from conftest import eval_here
from conftest import needs_mnist
from conftest import train_here
from conftest import weights_sha256

SMALL_CFG = network.ModelConfig(conv1_channels=8, primary_types=2, primary_dim=4)
# The model of conftest.SMALL's flags (the runs train_here and eval_here make).
CLI_CFG = network.ModelConfig(conv1_channels=16, primary_types=4, primary_dim=4,
                              digit_dim=8, decoder_units=(32,))


def fake_timer(fastest, calls=None):
  """A timer whose fastest method per layer is `fastest[layer]`; counts calls."""
  def timer(conv, methods, dtype, training, give_up=None):
    out = {}
    for method in methods:
      if calls is not None:
        calls.append((conv.layer, method, dtype, training))
      out[method] = 0.001 if method == fastest[conv.layer] else 0.002
    return out
  return timer


def test_plan_is_the_fastest_method_and_a_second_start_reads_the_cache(tmp_path):
  path, calls, lines = str(tmp_path / "plans.json"), [], []
  timer = fake_timer({"conv1": "patch_gemm", "primary_caps": "dft"}, calls)
  plan, report = planner.plan_convolutions(SMALL_CFG, 32, True, path=path,
                                           log=lines.append, timer=timer)
  assert plan == "conv1:patch_gemm,primary_caps:dft"
  # Every candidate, the fewest FLOPs (the DFT) first.
  assert [c[:2] for c in calls] == [("conv1", m) for m in fast_conv.candidates(1)[::-1]] + [
      ("primary_caps", m) for m in fast_conv.candidates(2)[::-1]]
  assert report["primary_caps"]["ms"] == {"conv2d": 2.0, "dilated": 2.0, "folded": 2.0,
                                          "dft": 1.0}
  assert not report["conv1"]["cached"] and lines == []
  calls.clear()
  again, report = planner.plan_convolutions(SMALL_CFG, 32, True, path=path,
                                            log=lines.append, timer=timer)
  assert again == plan and calls == [] and report["conv1"]["cached"]
  # Another batch, dtype or mode is another entry.
  planner.plan_convolutions(SMALL_CFG, 16, False, path=path, log=lines.append, timer=timer)
  assert {c[3] for c in calls} == {False} and len(json.load(open(path))["entries"]) == 4


def test_a_plan_timed_with_other_code_for_the_methods_is_measured_again(tmp_path,
                                                                       monkeypatch):
  """The cache key holds a digest of fast_conv's source: after a change to
  the methods (a faster DFT, say) a cached plan is not trusted."""
  path, calls = str(tmp_path / "plans.json"), []
  timer = fake_timer({"conv1": "patch_gemm", "primary_caps": "folded"}, calls)
  planner.plan_convolutions(SMALL_CFG, 32, True, path=path, log=print, timer=timer)
  assert len(planner.methods_digest()) == 12
  monkeypatch.setattr(planner, "methods_digest", lambda: "0123456789ab")
  calls.clear()
  timer = fake_timer({"conv1": "patch_gemm", "primary_caps": "dft"}, calls)
  plan, report = planner.plan_convolutions(SMALL_CFG, 32, True, path=path, log=print,
                                           timer=timer)
  assert plan == "conv1:patch_gemm,primary_caps:dft" and not report["conv1"]["cached"]
  assert len(calls) == 7 and len(json.load(open(path))["entries"]) == 4


def test_real_timer_plans_a_small_model(tmp_path):
  plan, report = planner.plan_convolutions(SMALL_CFG, 4, True, path=str(tmp_path / "p.json"))
  methods = fast_conv.parse_plan(plan)
  assert methods["conv1"] in fast_conv.candidates(1)
  assert methods["primary_caps"] in fast_conv.candidates(2)
  assert all(t > 0 for r in report.values() for t in r["ms"].values())


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 0, "entries": {}}),
                                     json.dumps([1, 2])])
def test_corrupt_cache_gives_one_line_and_a_fresh_plan(tmp_path, content):
  path, lines, calls = tmp_path / "plans.json", [], []
  path.write_text(content)
  timer = fake_timer({"conv1": "conv2d", "primary_caps": "folded"}, calls)
  plan, _ = planner.plan_convolutions(SMALL_CFG, 32, True, path=str(path),
                                      log=lines.append, timer=timer)
  assert plan == "conv1:conv2d,primary_caps:folded" and len(calls) == 7
  assert len(lines) == 1 and lines[0].startswith(f"planner: the plan cache {path} "
                                                 "cannot be used (")
  assert lines[0].endswith("); planning afresh")
  assert json.load(open(path))["version"] == planner.CACHE_VERSION   # rewritten whole


def test_cache_that_cannot_be_written_plans_without_caching(tmp_path):
  folder = tmp_path / "ro"
  folder.mkdir()
  os.chmod(folder, 0o500)
  if os.access(folder, os.W_OK):   # root ignores the mode
    folder = tmp_path / "file"
    folder.write_text("a file, not a folder")
  path, lines = str(folder / "sub" / "plans.json"), []
  plan, _ = planner.plan_convolutions(SMALL_CFG, 32, True, path=path, log=lines.append,
                                      timer=fake_timer({"conv1": "dft", "primary_caps": "dft"}))
  assert plan == "conv1:dft,primary_caps:dft"
  assert len(lines) == 1 and lines[0].startswith("planner: cannot write the plan cache")
  assert lines[0].endswith("the plan is used without caching")


def test_gpu_plans_conv2d_without_timing(tmp_path):
  plan, _ = planner.plan_convolutions(SMALL_CFG, 32, True, "/gpu:0",
                                      path=str(tmp_path / "p.json"), timer=None)
  assert plan == "conv1:conv2d,primary_caps:conv2d"
  assert not os.path.exists(tmp_path / "p.json")


def test_what_is_planned_and_what_is_kept(tmp_path):
  path = str(tmp_path / "p.json")
  timer = fake_timer({"conv1": "patch_gemm", "primary_caps": "dft"})
  def plan(cfg, **kw):
    return planner.plan_model(cfg, 32, path=path, timer=timer,
                              log=lambda _: None, **kw)[0]
  assert plan(SMALL_CFG).conv_plan == "conv1:patch_gemm,primary_caps:dft"
  for forced in (dataclasses.replace(SMALL_CFG, conv_impl="conv2d"),
                 dataclasses.replace(SMALL_CFG, dtype="float64"),
                 dataclasses.replace(SMALL_CFG, conv_plan="conv1:conv2d,primary_caps:conv2d")):
    assert plan(forced) == forced
  recorded = {"conv_plan": "conv1:conv2d,primary_caps:folded", "precision": "bf16"}
  kept = plan(SMALL_CFG, recorded=recorded, precision_auto=True)
  assert (kept.conv_plan, kept.precision) == ("conv1:conv2d,primary_caps:folded", "bf16")
  assert plan(SMALL_CFG, recorded={"conv_impl": "auto"}).conv_plan == ""   # older run
  assert plan(SMALL_CFG, recorded=recorded, replan=True).conv_plan == (
      "conv1:patch_gemm,primary_caps:dft")


def test_precision_auto_takes_the_faster_and_bf16_slower_is_said(tmp_path):
  def timer(conv, methods, dtype, training, give_up=None):   # bf16 three times slower
    return {m: 0.003 if dtype == "bfloat16" else 0.001 for m in methods}
  lines = []
  cfg, line = planner.plan_model(SMALL_CFG, 32, path=str(tmp_path / "p.json"),
                                 precision_auto=True, timer=timer, log=lines.append)
  assert cfg.precision == "fp32" and line.startswith("planner: fp32, conv1: ")
  assert lines == []
  cfg, _ = planner.plan_model(dataclasses.replace(SMALL_CFG, precision="bf16"), 32,
                              path=str(tmp_path / "p.json"), timer=timer, log=lines.append)
  assert cfg.precision == "bf16"   # asked for: it still runs
  assert lines == ["planner: bf16 is slower than fp32 on this CPU (6 against 2 ms a "
                   "batch of 32 in the planned convolutions; no AMX?): "
                   "--precision=fp32 or auto would train faster"]
  def fast_bf16(conv, methods, dtype, training, give_up=None):
    return {
        m: 0.001 if dtype == "bfloat16" else 0.003 for m in methods}
  cfg, _ = planner.plan_model(SMALL_CFG, 32, path=str(tmp_path / "q.json"),
                              precision_auto=True, timer=fast_bf16, log=lines.append)
  assert cfg.precision == "bf16"


def test_inference_is_planned_for_the_forward_alone(tmp_path):
  """A run's recorded training plan is replaced by the forward pass's own;
  a forced method and float64 are kept."""
  calls = []
  timer = fake_timer({"conv1": "conv2d", "primary_caps": "dft"}, calls)
  def plan(cfg):
    return planner.plan_inference(cfg, 500, path=str(tmp_path / "p.json"),
                                  timer=timer, log=lambda _: None)
  trained = dataclasses.replace(SMALL_CFG, conv_plan="conv1:patch_gemm,primary_caps:folded")
  cfg, line = plan(trained)
  assert cfg == dataclasses.replace(trained, conv_plan="conv1:conv2d,primary_caps:dft")
  assert line.startswith("planner: fp32 inference, conv1: conv2d (")
  assert {(c[0], c[3]) for c in calls} == {("conv1", False), ("primary_caps", False)}
  calls.clear()
  for kept in (dataclasses.replace(SMALL_CFG, conv_impl="custom_grad"),
               dataclasses.replace(trained, dtype="float64")):
    assert plan(kept) == (kept, None)
  assert calls == []


@needs_mnist
def test_eval_scores_with_the_inference_plan_and_predicts_the_same(tmp_path, monkeypatch,
                                                                    trained_once):
  """eval.py --conv_impl=auto on a run trained with the rule's methods: the
  cache's forward plan (conv2d, dft) is used and said, and every prediction
  is the one the run's own methods (patch_gemm, dilated; eval.py's default)
  make."""
  monkeypatch.setenv("CAPSNET_CACHE_DIR", str(tmp_path / "cache"))
  os.makedirs(tmp_path / "cache")
  logdir = trained_once(*THREE_EPOCHS)
  cfg = CLI_CFG
  _write_cache(planner.cache_path(), cfg, 250, {"conv1": "conv2d", "primary_caps": "dft"},
               training=False)
  scored = {}
  for impl in ("auto", None):
    out = str(tmp_path / str(impl))
    proc = eval_here(f"--checkpoint={logdir}", "--split=validation",
                     *([f"--conv_impl={impl}"] if impl else []),
                     "--batch_size=250", f"--out_dir={out}", "--num_images=2",
                     "--figure4_images=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("planner: fp32 inference, conv1: conv2d (conv2d 1.0 ms) [cached]; "
            "primary_caps: dft (dft 1.0 ms) [cached]" in proc.stderr) == (impl == "auto")
    scored[impl] = runs.EvalFolder(out).predictions()
  auto, rule = scored["auto"], scored[None]
  assert len(auto["prediction"]) == 500 and auto["prediction"] == rule["prediction"]
  for k in range(10):
    assert auto[f"length_{k}"] == pytest.approx(rule[f"length_{k}"], abs=2e-5)


def _write_cache(path, cfg, batch, methods, training=True):
  """A plan cache whose entries for `cfg` name `methods`."""
  entries = {}
  for conv in planner.convolutions(cfg, batch):
    key = planner.cache_key(conv, planner.compute_dtype(cfg), training)
    entries[key] = {"method": methods[conv.layer], "ms": {methods[conv.layer]: 1.0}}
  with open(path, "w") as f:
    json.dump({"version": planner.CACHE_VERSION, "entries": entries}, f)


@needs_mnist
def test_resume_after_a_replanned_cache_continues_bit_for_bit(tmp_path, monkeypatch):
  """A run plans (from the cache), stops at step 6; the cache then names other
  methods; the resumed run keeps its recorded plan and ends with the weights
  of the same run uninterrupted."""
  monkeypatch.setenv("CAPSNET_CACHE_DIR", str(tmp_path / "cache"))
  os.makedirs(tmp_path / "cache")
  flags = [f for f in QUICK if not f.startswith("--conv_impl")] + ["--conv_impl=auto"]
  cfg = CLI_CFG
  first = {"conv1": "patch_gemm", "primary_caps": "dft"}
  _write_cache(planner.cache_path(), cfg, 32, first)
  stopped, whole = str(tmp_path / "stopped"), str(tmp_path / "whole")
  proc = train_here(*flags, "--max_steps=6", f"--logdir={stopped}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "planner: fp32, conv1: patch_gemm" in proc.stdout
  recorded = json.load(open(os.path.join(stopped, "config.json")))["model"]
  assert recorded["conv_plan"] == "conv1:patch_gemm,primary_caps:dft"
  _write_cache(planner.cache_path(), cfg, 32, {"conv1": "conv2d", "primary_caps": "dilated"})
  proc = train_here(*flags, "--max_steps=12", f"--logdir={stopped}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "planner:" not in proc.stdout   # kept, not planned
  assert json.load(open(os.path.join(stopped, "config.json")))["model"]["conv_plan"] == (
      recorded["conv_plan"])
  proc = train_here(*flags, "--max_steps=12", f"--logdir={whole}",
                    f"--conv_plan={recorded['conv_plan']}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  def latest(d):
    return tf.train.latest_checkpoint(os.path.join(d, "latest"))
  assert latest(stopped).endswith("-12") and latest(whole).endswith("-12")
  assert weights_sha256(latest(stopped)) == weights_sha256(latest(whole))
  # --replan measures again (here: reads the changed cache) and records it.
  proc = train_here(*flags, "--max_steps=13", f"--logdir={stopped}", "--replan")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.load(open(os.path.join(stopped, "config.json")))["model"]["conv_plan"] == (
      "conv1:conv2d,primary_caps:dilated")


def test_candidates_alternate_and_a_slow_warmup_is_given_up(monkeypatch):
  """time_methods(give_up=3): every method warmed up, the hopeless one (its
  warmup over 3 times the best so far) not timed; then the timed runs
  alternate between the others, and one over 1.5 times the best first run
  is not run again."""
  clock = iter([0, 1,    2, 3.2,   4, 14,            # warmups: dft, dilated, conv2d
                20, 21,  22, 23.1,                   # turn 1: dft 1.0, dilated 1.1
                30, 31.5,  40, 41,                   # turn 2: dft 1.5, dilated 1.0
                50, 50.5,  60, 61.2])                # turn 3: dft 0.5, dilated 1.2
  monkeypatch.setattr(planner.time, "perf_counter", lambda: float(next(clock)))
  conv = planner.convolutions(SMALL_CFG, 4)[1]
  times = planner.time_methods(conv, ["dft", "dilated", "conv2d"], "float32", False,
                               give_up=3.0)
  assert times == pytest.approx({"dft": 1.0, "dilated": 1.1, "conv2d": 10.0})
  assert next(clock, None) is None


def test_a_plan_measured_on_a_busy_machine_is_said_marked_and_measured_again(
    tmp_path, monkeypatch):
  path, calls, lines = str(tmp_path / "plans.json"), [], []
  timer = fake_timer({"conv1": "patch_gemm", "primary_caps": "dft"}, calls)
  monkeypatch.setattr(planner.host, "others_busy", lambda: 1.2)
  plan, _ = planner.plan_convolutions(SMALL_CFG, 32, True, path=path, log=lines.append,
                                      timer=timer)
  assert plan == "conv1:patch_gemm,primary_caps:dft" and len(lines) == 1
  assert lines[0].startswith("planner: the machine was not idle: other programs kept "
                             "1.2 of ")
  cached = json.load(open(path))["entries"]
  assert [e["busy_cores"] for e in cached.values()] == [1.2, 1.2]
  calls.clear()   # still busy: the marked plan is used, not measured again
  planner.plan_convolutions(SMALL_CFG, 32, True, path=path, log=lines.append, timer=timer)
  assert calls == []
  monkeypatch.setattr(planner.host, "others_busy", lambda: 0.0)   # idle: again
  planner.plan_convolutions(SMALL_CFG, 32, True, path=path, log=lines.append, timer=timer)
  assert len(calls) == 7 and len(lines) == 1
  assert all("busy_cores" not in e for e in json.load(open(path))["entries"].values())


def test_the_planner_program_imports_tensorflow_as_the_trainer_does():
  """`python -m capsnet.plan` caches plans under the key of oneDNN
  on (`host.describe`), so it must time with oneDNN on: TensorFlow imported
  through `startup` (quietly, oneDNN on), not first by fast_conv."""
  script = ("import os, runpy, sys; sys.argv = ['planner', '--help']\n"
            "try:\n  runpy.run_module('capsnet.plan', run_name='__main__')\n"
            "except SystemExit:\n  pass\n"
            "from tensorflow.python.util import _pywrap_util_port\n"
            "print(os.environ.get('TF_ENABLE_ONEDNN_OPTS'), _pywrap_util_port.IsMklEnabled())")
  env = {k: v for k, v in os.environ.items()
         if k not in ("TF_ENABLE_ONEDNN_OPTS", "TF_CPP_MIN_LOG_LEVEL")}
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        cwd=ROOT, env=env, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.splitlines()[-1] == "1 True"
  assert "I0000" not in proc.stderr and "All log messages" not in proc.stderr


@pytest.mark.integration
def test_the_planner_program_plans_and_refuses_a_bad_value_in_one_line(tmp_path):
  env = dict(os.environ, CAPSNET_CACHE_DIR=str(tmp_path))
  def run(*flags):
    return subprocess.run(
        [sys.executable, "-m", "capsnet.plan", *flags], capture_output=True,
        text=True, cwd=ROOT, env=env, timeout=600)
  proc = run("--batch_size=0")
  assert proc.returncode == 1 and not (tmp_path / "conv_plans.json").exists()
  assert "flag --batch_size=0: 0 is not a positive integer" in proc.stderr
  proc = run("--batch_size=4", "--inference")
  assert proc.returncode == 0, proc.stderr[-2000:]
  plan = proc.stdout.split()[0]
  assert fast_conv.parse_plan(plan) and (tmp_path / "conv_plans.json").exists()
