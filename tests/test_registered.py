"""A new registered study is its declaration and its page (docs/studies.md):
a protocol declared here alone (Fashion-MNIST, which has no affine test set;
two variants, two seeds, a tiny model, a few steps) is registered in a fresh
repository (its lock file and page committed) and run through the runner of
every registered protocol end to end: a start, a SIGTERM part-way, the
resume, the next runs, the scorings, the audit (no breach; then a planted
breach, named), the report. No library file names it."""
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys

import pytest

from capsnet.science import protocols
from capsnet.science import registered

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FASHION = os.path.join(ROOT, "data", "fashion_mnist")

# The declaration: everything its registration fixes.
TINY = protocols.Protocol(
    "tiny", "A tiny registered protocol (tests/test_registered.py)",
    {"r1": dict(iter_routing=1, stop_gradient=True),
     "r2": dict(iter_routing=2, stop_gradient=True)},
    measures=(("test_error", "test error, %", "+.3f"),
              ("test_margin_loss", "mean test margin loss", "+.5f")),
    seeds=(3, 4), epochs=2, kept=(1, 2), pairs=(("r1", "r2", "routing: r2 - r1"),),
    primary=("r1", "r2", "routing: r2 - r1"), precision="fp32", unit="block",
    task="fashion_mnist", lock="docs/tiny.lock",
    run_flags={"dataset": "fashion_mnist", "conv1_channels": 16, "primary_types": 4,
               "primary_dim": 4, "digit_dim": 8, "decoder_units": (32,), "batch_size": 32,
               "train_size": 640, "val_size": 500, "eval_batch_size": 500,
               "download": False, "conv_impl": "custom_grad", "save_every": 5,
               "diag_every": 10, "val_every": 0},
    rule={"measure": "test_error", "epoch": 2, "alpha": 0.05, "margin": 1.0,
          "margin_descriptive": 2.0, "power": {"effect": 1.0, "target": 0.8},
          "order_seed": 7,
          "says": {"a_lower": "r = 1 gives the lower test error",
                   "b_lower": "r = 2 gives the lower test error", "subject": "routing"}})

IN_CI = os.environ.get("CI", "").lower() in ("true", "1")
HAVE_FASHION = os.path.isdir(FASHION) and len(os.listdir(FASHION)) >= 4


def _git(root, *args):
  return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                        cwd=root, check=True, capture_output=True, text=True).stdout


def register(repo):
  """A repository holding the code, this file and the protocol's page; then
  the registration: the commit that adds its lock file (this environment's)."""
  for name in ("capsnet", "tests", "train.py", "eval.py", "config.py"):
    copy = shutil.copytree if os.path.isdir(os.path.join(ROOT, name)) else shutil.copy
    copy(os.path.join(ROOT, name), os.path.join(repo, name),
         **({"ignore": shutil.ignore_patterns("__pycache__")}
            if copy is shutil.copytree else {}))
  os.makedirs(os.path.join(repo, "docs"))
  with open(os.path.join(repo, ".gitignore"), "w") as f:
    f.write("__pycache__/\n/data/\n")
  os.makedirs(os.path.join(repo, "data"))
  os.symlink(FASHION, os.path.join(repo, "data", "fashion_mnist"))
  page = ["# tiny", "", *registered.table_lines(TINY), "", "---", "", "## Results", ""]
  with open(os.path.join(repo, "docs", "tiny.md"), "w") as f:
    f.write("\n".join(page))
  _git(repo, "init", "-q")
  _git(repo, "add", ".")
  _git(repo, "commit", "-qm", "the code and the page")
  with open(os.path.join(repo, TINY.lock), "w") as f:
    f.write(f"# python {platform.python_version()}\n" + "".join(
        f"{name}=={version}\n" for name, version in sorted(registered.installed().items())))
  _git(repo, "add", ".")
  _git(repo, "commit", "-qm", "registration")
  return _git(repo, "rev-parse", "HEAD").strip()


def command(repo, *args):
  """The runner's program for the protocol declared here, as a user runs it."""
  script = ("import sys; sys.path.insert(0, 'tests'); import test_registered; "
            "from capsnet import registered; registered.run(test_registered.TINY)")
  env = {k: v for k, v in os.environ.items()
         if k not in (registered.UNCHECKED, "TF_CPP_MIN_LOG_LEVEL", "PYTHONPATH")}
  return [sys.executable, "-c", script, *args], dict(env, PYTHONDONTWRITEBYTECODE="1"), repo


def run(repo, *args, timeout=600):
  cmd, env, cwd = command(repo, *args)
  return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
                        timeout=timeout)


@pytest.mark.integration
def test_a_protocol_declared_here_runs_end_to_end_on_the_runner(tmp_path):
  if not HAVE_FASHION:
    if IN_CI:
      pytest.fail(f"Fashion-MNIST files not in {FASHION} (.ci/run seeds them)")
    pytest.skip(f"Fashion-MNIST files not in {FASHION}")
  repo, out, pub = tmp_path / "repo", tmp_path / "out", tmp_path / "pub"
  repo.mkdir()
  commit = register(str(repo))
  where = (f"--out={out}", f"--publish={pub}")
  order = registered.sequence(TINY)
  names = [registered.folder_name(r) for r in order]
  assert len(names) == 4 and sorted(order) == sorted(
      (s, v) for s in TINY.seeds for v in TINY.variants)
  # A start: the first run, to its end.
  proc = run(repo, *where, "--runs=1")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"tiny: run 1 of 4, {names[0]}: start" in proc.stdout
  # The next run, stopped by one SIGTERM once it has saved a checkpoint.
  from conftest import stop_once_saved  # noqa: PLC0415 (the declaration stays light)
  cmd, env, cwd = command(repo, *where)
  status, said = stop_once_saved(cmd, str(out / names[1]), env=env, cwd=cwd)
  assert status == 143, said[-3000:]
  stops = registered.partway_rows(str(pub))
  assert [r["run"] for r in stops] == [names[1]] and len(stops[0]["digest"]) == 64
  # The resume, then the runs left; each scored on the test set alone.
  proc = run(repo, *where)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"tiny: run 2 of 4, {names[1]}: resume" in proc.stdout
  assert f"tiny: run 4 of 4, {names[3]}: start" in proc.stdout
  for name in names:
    results = json.loads((pub / name / "along_results.json").read_text())
    assert sorted(results) == ["1", "2"] and sorted(results["2"]) == ["epoch", "step", "test"]
    assert len(results["2"]["test"]["wrong"]) == round(results["2"]["test"]["error_percent"]
                                                       * results["2"]["test"]["count"] / 100)
  history = registered.History.read(str(pub / names[1]))
  assert [k for k, _ in history.kinds()] == ["start", "resume"]
  assert history.attempts[1]["from_step"] == stops[0]["step"]
  # The audit: no breach; then a planted one, named.
  proc = run(repo, "--audit", f"--publish={pub}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.strip() == (f"tiny: audit: 4 of 4 runs published, in turn, each "
                                 f"attempt checked at {commit[:12]}: no breach")
  config = pub / names[2] / "config.json"
  saved = config.read_text()
  config.write_text(saved.replace('"conv1_channels": 16', '"conv1_channels": 32'))
  proc = run(repo, "--audit", f"--publish={pub}")
  assert proc.returncode == 1
  assert proc.stderr.strip() == (f"tiny: audit: {names[2]}: config.json has "
                                 "conv1_channels=32, registered 16")
  config.write_text(saved)
  # The report: the registered answer of its two blocks, its picture.
  text = (pub / "results.md").read_text()
  assert text.splitlines()[0] == f"# {TINY.title}: 2 blocks, as registered"
  assert "- **Primary** (routing: r2 - r1, test_error at epoch 2, n = 2): " in text
  assert "## Descriptive, added after the registration: never called" in text
  assert "affine" not in text and (pub / "tiny.png").exists()
  payload = json.loads((pub / "results.json").read_text())
  assert payload["protocol"] == "tiny" and payload["final"]
  assert payload["details"]["decision"]["primary"]["n"] == 2


def test_no_library_file_names_it():
  for folder, _, files in os.walk(os.path.join(ROOT, "capsnet")):
    for name in files:
      if name.endswith(".py"):
        with open(os.path.join(folder, name)) as f:
          assert "tiny" not in f.read().lower(), os.path.join(folder, name)


def test_its_sequence_spreads_the_orders_evenly():
  table = registered.order_table(TINY)
  assert sorted(table) == [3, 4] and sorted(table.values()) == [("r1", "r2"), ("r2", "r1")]
  more = dataclasses.replace(TINY, seeds=tuple(range(7)))
  counts = sorted(list(registered.order_table(more).values()).count(o)
                  for o in registered.orders(more))
  assert counts == [3, 4]
