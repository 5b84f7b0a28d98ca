"""The confirmatory protocol's self-audit (`python -m capsnet.confirm
--audit`) on made-up published runs: a clean record passes, and each breach
of the registration is named."""
import json
import os
import subprocess
import sys

import pytest

from capsnet.science import blocks
from capsnet.science import protocols
from capsnet.science import registered
from conftest import ROOT

CONFIRM = protocols.CONFIRM
COMMIT = "ef07b3b6a48ea4132d4306b400799a6adde28328"
HERE = {"cpu": "Intel(R) Xeon(R) Processor", "cpu_id": "GenuineIntel family 6 model 167",
        "flags": ["avx2", "fma"], "cores": 2, "python": "3.11.7", "tensorflow": "2.21.0",
        "numpy": "2.4.6", "onednn": "1"}
STEPS = 429


def attempt(kind="start", **extra):
  return dict({"kind": kind, "commit": COMMIT, "checked": True, "identity": dict(HERE)},
              **extra)


def publish_run(pub, seed, variant, attempts=None, lost=(), outcome="completed"):
  """One run as the command publishes it (small files only)."""
  folder = os.path.join(pub, registered.folder_name((seed, variant)))
  os.makedirs(folder)
  model, train = registered.registered_settings(CONFIRM, variant, seed, {})
  model = dict(model, conv_plan="conv1:patch_gemm,primary_caps:dft")
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump({"model": model, "train": train}, f)
  with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
    for epoch in range(1, 11):
      f.write(json.dumps({"epoch": epoch, "step": STEPS * epoch, "kind": "epoch",
                          "train_loss": 0.01}) + "\n")
  scoring = {"count": 10000, "error_percent": 0.03, "wrong": [5, 77, 901]}
  with open(os.path.join(folder, blocks.RESULTS_FILE), "w") as f:
    json.dump({str(e): {"epoch": e, "step": STEPS * e, "test": dict(scoring),
                        "affine": dict(scoring)} for e in CONFIRM.kept}, f)
  with open(os.path.join(folder, "host.json"), "w") as f:
    json.dump({"started": {}, "resumed": [], "attempts": attempts or [attempt()],
               "lost": list(lost), "outcome": outcome}, f)
  return folder


def edit(path, change):
  with open(path) as f:
    value = json.load(f)
  change(value)
  with open(path, "w") as f:
    json.dump(value, f)


def first_runs(pub, n):
  for seed, variant in registered.sequence(CONFIRM)[:n]:
    publish_run(pub, seed, variant)
  return [os.path.join(pub, registered.folder_name(r)) for r in registered.sequence(CONFIRM)[:n]]


def stop(pub, name, step, digest):
  with open(os.path.join(pub, registered.PARTWAY_FILE), "a") as f:
    f.write(json.dumps({"run": name, "step": step, "digest": digest}) + "\n")


def test_a_clean_record_passes(tmp_path):
  pub = str(tmp_path)
  first_runs(pub, 3)
  assert registered.audit(CONFIRM, pub, COMMIT) == []


def test_a_resume_from_the_committed_state_and_a_restart_with_its_lost_attempt_pass(
    tmp_path):
  pub = str(tmp_path)
  (s1, v1), (s2, v2) = registered.sequence(CONFIRM)[:2]
  stop(pub, registered.folder_name((s1, v1)), 900, "a" * 64)
  publish_run(pub, s1, v1, [attempt(), attempt("resume", from_step=900,
                                               from_digest="a" * 64)])
  stop(pub, registered.folder_name((s2, v2)), 300, "b" * 64)
  publish_run(pub, s2, v2, [attempt("restart", reason="gone")],
              lost=[{"run": registered.folder_name((s2, v2)), "step": 300, "digest": "b" * 64}])
  assert registered.audit(CONFIRM, pub, COMMIT) == []


def test_a_resume_after_a_kill_passes_and_the_report_says_killed(tmp_path):
  """An attempt with no end was killed (it could record no part-way state):
  its resume on the same host identity passes; the report lists the kill."""
  pub = str(tmp_path)
  (s1, v1), = registered.sequence(CONFIRM)[:1]
  publish_run(pub, s1, v1, [attempt(), attempt("resume", from_step=3432,
                                               from_digest="f" * 64, end={"why": "ended"})])
  assert registered.audit(CONFIRM, pub, COMMIT) == []
  report = registered.progress_report(CONFIRM, pub, [], str(tmp_path / "report"))
  assert "| start (killed: no end recorded), resume |" in report


@pytest.mark.parametrize("breach, said", [
    ("commit", "attempt 1 ran from 0000000, not the registration"),
    ("unchecked", "attempt 1 ran unchecked"),
    ("identity", "attempt 1 lacks its host identity's numpy"),
    ("precision", "config.json has precision='bf16', registered 'fp32'"),
    ("variant", "config.json has stop_gradient="),
    ("layers", "config.json has conv1_channels=16, registered 256"),
    ("seed", "config.json has seed=99, registered"),
    ("epochs", "config.json has epochs=9, registered 10"),
    ("schedule", "config.json has decay_steps=14, registered 2000"),
    ("metrics", "metrics.jsonl has epochs [1, 2, 3, 4, 5, 6, 7, 8, 9], expected 1 to 10"),
    ("scored_twice_missing", "scored epochs [1, 2, 10], expected [1, 2, 5, 10]"),
    ("affine", "epoch 10: no affine scoring"),
    ("wrong", "epoch 1: the test scoring is not of 10,000 images with the indices"),
    ("step", "epoch 2 scored at step 1, its end is step 858"),
    ("outcome", "outcome None, expected completed or failed"),
    ("no_attempt", "host.json records no attempt"),
])
def test_each_breach_of_a_run_is_named(tmp_path, breach, said):
  pub = str(tmp_path)
  folder = first_runs(pub, 2)[1]
  host, config = os.path.join(folder, "host.json"), os.path.join(folder, "config.json")
  results = os.path.join(folder, blocks.RESULTS_FILE)
  change = {
      "commit": (host, lambda h: h["attempts"][0].update(commit="0000000")),
      "unchecked": (host, lambda h: h["attempts"][0].update(checked=False)),
      "identity": (host, lambda h: h["attempts"][0]["identity"].pop("numpy")),
      "precision": (config, lambda c: c["model"].update(precision="bf16")),
      "variant": (config, lambda c: c["model"].update(
          stop_gradient=not c["model"]["stop_gradient"])),
      "layers": (config, lambda c: c["model"].update(conv1_channels=16)),
      "seed": (config, lambda c: c["train"].update(seed=99)),
      "epochs": (config, lambda c: c["train"].update(epochs=9)),
      "schedule": (config, lambda c: c["train"].update(decay_steps=14)),
      "scored_twice_missing": (results, lambda r: r.pop("5")),
      "affine": (results, lambda r: r["10"].pop("affine")),
      "wrong": (results, lambda r: r["1"]["test"].pop("wrong")),
      "step": (results, lambda r: r["2"].update(step=1)),
      "outcome": (host, lambda h: h.pop("outcome")),
      "no_attempt": (host, lambda h: h.update(attempts=[])),
  }
  if breach == "metrics":
    with open(os.path.join(folder, "metrics.jsonl")) as f:
      rows = f.readlines()
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
      f.writelines(rows[:-1])
  elif breach == "outcome":
    # without an outcome the run is not ended: it is then out of turn too
    edit(*change[breach])
    assert any("published out of turn" in b for b in registered.audit(CONFIRM, pub, COMMIT))
    return
  else:
    edit(*change[breach])
  found = registered.audit(CONFIRM, pub, COMMIT)
  assert any(said in b for b in found), found
  assert all(b.startswith(os.path.basename(folder) + ": ") for b in found), found


def test_breaches_of_the_sequence_and_of_the_stops_are_named(tmp_path):
  pub = str(tmp_path)
  first_runs(pub, 1)
  third = registered.sequence(CONFIRM)[2]
  publish_run(pub, *third)
  os.makedirs(os.path.join(pub, "r9_recon_seed5"))
  name = registered.folder_name(registered.sequence(CONFIRM)[0])
  stop(pub, name, 500, "c" * 64)                  # a stop nobody resumed
  stop(pub, "r2_seed5", 1, "d" * 64)              # a stop of no run
  edit(os.path.join(pub, name, "host.json"), lambda h: h.update(attempts=[
      attempt(end={"why": "stopped by SIGTERM", "step": 700}),
      attempt("resume", from_step=700, from_digest="e" * 64)]))
  found = registered.audit(CONFIRM, pub, COMMIT)
  assert f"{registered.folder_name(third)}: published out of turn (the sequence's next due is " \
         f"{registered.folder_name(registered.sequence(CONFIRM)[1])})" in found
  assert "r9_recon_seed5: not a run of the registered sequence" in found
  assert "partway.jsonl: a stop of 'r2_seed5', not a run of the sequence" in found
  assert f"{name}: attempt 2 resumed from step 700 (eeeeeeeeeeee), not a committed " \
         "part-way state" in found
  assert f"{name}: the part-way state of step 500 (cccccccccccc) is neither resumed nor " \
         "listed as lost" in found


def test_the_registrations_report_folder_only_once_the_sequence_is_complete(tmp_path):
  pub = str(tmp_path)
  first_runs(pub, 1)
  os.makedirs(os.path.join(pub, registered.REGISTERED_FOLDER))
  due = registered.folder_name(registered.sequence(CONFIRM)[1])
  assert registered.audit(CONFIRM, pub, COMMIT) == [
      f"registered: the registration's report before the sequence is complete (next due: "
      f"{due})"]
  for seed, variant in registered.sequence(CONFIRM)[1:]:
    publish_run(pub, seed, variant)
  assert registered.audit(CONFIRM, pub, COMMIT) == []


def test_a_resume_on_another_host_and_a_restart_without_lost_attempts_are_named(tmp_path):
  pub = str(tmp_path)
  (s1, v1), (s2, v2) = registered.sequence(CONFIRM)[:2]
  stop(pub, registered.folder_name((s1, v1)), 900, "a" * 64)
  other = attempt("resume", from_step=900, from_digest="a" * 64)
  other["identity"]["cpu_id"] = "AuthenticAMD family 25 model 17"
  publish_run(pub, s1, v1, [attempt(), other])
  publish_run(pub, s2, v2, [attempt("restart", reason="gone")])
  found = registered.audit(CONFIRM, pub, COMMIT)
  assert any("attempt 2 resumed on another host identity (cpu_id:" in b for b in found)
  assert f"{registered.folder_name((s2, v2))}: a restart with no lost attempt recorded" in found


def test_a_failed_run_is_scored_at_the_epochs_it_reached(tmp_path):
  pub = str(tmp_path)
  seed, variant = registered.sequence(CONFIRM)[0]
  folder = publish_run(pub, seed, variant, outcome="failed: loss is nan at step 2500")
  with open(os.path.join(folder, "metrics.jsonl")) as f:
    rows = f.readlines()
  with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
    f.writelines(rows[:5])
  edit(os.path.join(folder, blocks.RESULTS_FILE), lambda r: r.pop("10"))
  assert registered.audit(CONFIRM, pub, COMMIT) == []


def test_the_page_must_print_the_registered_order_table(tmp_path):
  with open(os.path.join(ROOT, "docs", "confirm.md")) as f:
    page = f.read()
  assert registered.audit(CONFIRM, str(tmp_path), COMMIT, page) == []
  swapped = page.replace("| 5 | `r1_recon` | `r3_recon_nostop` | `r3_recon` |",
                         "| 5 | `r3_recon` | `r3_recon_nostop` | `r1_recon` |")
  assert registered.audit(CONFIRM, str(tmp_path), COMMIT, swapped) == [
      "docs/confirm.md: the order table is not the registered shuffle's"]


def test_the_page_above_its_results_line_is_the_registrations(tmp_path):
  with open(os.path.join(ROOT, "docs", "confirm.md")) as f:
    page = f.read()
  above, below = page.split(registered.RESULTS_LINE)
  later = above + registered.RESULTS_LINE + below + "\nA result added below the line.\n"
  assert registered.audit(CONFIRM, str(tmp_path), COMMIT, later, page) == []
  amended = page.replace("n = 16 is fixed regardless", "n = 20 is fixed regardless")
  assert registered.audit(CONFIRM, str(tmp_path), COMMIT, amended, page) == [
      "docs/confirm.md: changed above its results line since the registration"]


@pytest.mark.integration
def test_the_audit_command_on_the_committed_runs():
  """The published runs pass (exit 0, one line); a breach exits 1 naming it."""
  proc = subprocess.run([sys.executable, "-m", "capsnet.confirm", "--audit"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  if registered.registration_commit(ROOT, CONFIRM.lock) is None:
    assert proc.returncode == 1 and "no git history that adds" in proc.stderr
    return
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip().endswith(": no breach")


@pytest.mark.integration
def test_the_audit_command_names_a_breach_and_exits_1(tmp_path):
  if registered.registration_commit(ROOT, CONFIRM.lock) is None:
    pytest.skip("no git history of docs/confirm.lock")
  publish_run(str(tmp_path), *registered.sequence(CONFIRM)[0], [attempt(commit="0" * 40)])
  proc = subprocess.run([sys.executable, "-m", "capsnet.confirm", "--audit",
                         f"--publish={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 1
  lines = proc.stderr.strip().splitlines()
  assert lines and all(line.startswith("confirm: audit: ") for line in lines)
  assert any(f"attempt 1 ran from {'0' * 40}, not the registration" in line
             for line in lines), lines


@pytest.mark.integration
@pytest.mark.parametrize("damaged", ["host.json", registered.PARTWAY_FILE])
def test_a_damaged_record_is_named_in_one_line_and_exits_1(tmp_path, damaged):
  """A user's damaged host.json (of any published run) or partway.jsonl: one
  line naming the file, exit 1, no traceback."""
  if registered.registration_commit(ROOT, CONFIRM.lock) is None:
    pytest.skip("no git history of docs/confirm.lock")
  folders = first_runs(str(tmp_path), 2)
  path = os.path.join(folders[1] if damaged == "host.json" else str(tmp_path), damaged)
  with open(path, "w") as f:
    f.write('{"attempts": [\n')
  proc = subprocess.run([sys.executable, "-m", "capsnet.confirm", "--audit",
                         f"--publish={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 1
  lines = [line for line in proc.stderr.splitlines() if line.startswith("confirm: ")]
  assert lines == [line for line in proc.stderr.splitlines()
                   if "Traceback" in line or line.startswith("confirm: ")], proc.stderr
  assert len(lines) == 1 and lines[0].startswith(f"confirm: audit: {path}: ")
  assert "not a JSON" in lines[0]
