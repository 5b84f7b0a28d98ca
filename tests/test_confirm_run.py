"""The confirmatory sequence's runner (capsnet/science/registered.py): the
registered order, the code and environment checks, the rule that resumes or
restarts a run, and turns; in-process, on made-up folders."""
from collections import Counter
import json
import os
import subprocess

import pytest

from capsnet.science import protocols
from capsnet.science import registered

CONFIRM = protocols.CONFIRM


def test_the_order_table_uses_each_order_two_or_three_times():
  table = registered.order_table(CONFIRM)
  assert list(table) == list(CONFIRM.seeds)
  assert all(sorted(order) == sorted(CONFIRM.variants) for order in table.values())
  assert sorted(Counter(table.values()).values()) == [2, 2, 3, 3, 3, 3]
  seq = registered.sequence(CONFIRM)
  assert len(seq) == 48 and len(set(seq)) == 48
  assert seq[:3] == [(5, v) for v in table[5]] and seq[-1][0] == 20


def test_the_page_prints_the_order_table():
  with open(os.path.join(registered.grids.ROOT, "docs", "confirm.md")) as f:
    page = f.read()
  assert "\n".join(registered.table_lines(CONFIRM)) in page
  assert f"registered seed\n  {CONFIRM.rule['order_seed']}" in page


def test_environment_differences_are_named(tmp_path):
  (tmp_path / "docs").mkdir()
  lock = tmp_path / "docs" / "confirm.lock"
  lock.write_text("# a comment\n# python 3.11.7\nnumpy==2.4.6\nabsl-py==2.5.1\n")
  ok = {"numpy": "2.4.6", "absl-py": "2.5.1"}
  registered.check_environment(CONFIRM.lock, str(tmp_path), python="3.11.7", found=ok)
  for python, found, said in (
      ("3.11.8", ok, "Python 3.11.8, the lock file has 3.11.7"),
      ("3.11.7", dict(ok, numpy="2.4.5"), "numpy 2.4.5 here, 2.4.6 in docs/confirm.lock"),
      ("3.11.7", dict(ok, ruff="0.17.6"), "ruff 0.17.6 here, not in docs/confirm.lock"),
      ("3.11.7", {"numpy": "2.4.6"}, "absl-py not installed here, 2.5.1 in")):
    with pytest.raises(registered.RegisteredError, match=said):
      registered.check_environment(CONFIRM.lock, str(tmp_path), python=python, found=found)
  lock.write_text("# python 3.11.7\nnumpy>=2\n")
  with pytest.raises(registered.RegisteredError, match="expected name==version"):
    registered.check_environment(CONFIRM.lock, str(tmp_path), python="3.11.7", found=ok)


def test_the_lock_file_pins_every_requirement_of_the_registered_code():
  """The lock pins what the registration's requirements.txt asks (main's may
  ask more since: its runs are made by the registration's code alone)."""
  root = registered.grids.ROOT
  _, pins = registered.read_lock(os.path.join(root, CONFIRM.lock))
  commit = registered.registration_commit(root, CONFIRM.lock)
  assert commit is not None, "no git history of docs/confirm.lock: test a clone"
  requirements = subprocess.run(["git", "show", f"{commit}:requirements.txt"], cwd=root,
                                capture_output=True, text=True, check=True).stdout
  wanted = [line.split(">")[0].split("<")[0].split("=")[0].strip()
            for line in requirements.splitlines() if line.strip() and not line.startswith("#")]
  missing = [w for w in wanted if registered._normal(w) not in pins]
  # ruff is the linter's, not the protocol's (installed by CI beside the tests)
  assert [m for m in missing if m != "ruff"] == []


def _git(root, *args):
  subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root,
                 check=True, capture_output=True)


def test_only_a_clean_checkout_at_the_registration_runs(tmp_path):
  root = str(tmp_path)
  _git(root, "init", "-q")
  with pytest.raises(registered.RegisteredError, match="no git history that adds"):
    registered.check_code(root, CONFIRM.lock)
  os.makedirs(tmp_path / "docs")
  (tmp_path / "docs" / "confirm.lock").write_text("# python 3.11.7\n")
  _git(root, "add", ".")
  _git(root, "commit", "-qm", "registration")
  commit = registered.check_code(root, CONFIRM.lock)
  assert commit == registered.registration_commit(root, CONFIRM.lock)
  (tmp_path / "train.py").write_text("changed\n")
  with pytest.raises(registered.RegisteredError, match=r"has changes \(\?\? train.py\)"):
    registered.check_code(root, CONFIRM.lock)
  _git(root, "add", ".")
  _git(root, "commit", "-qm", "later")
  with pytest.raises(registered.RegisteredError,
                     match=f"the registration is {commit[:12]}: run from a checkout"):
    registered.check_code(root, CONFIRM.lock)


HERE = {"cpu": "Intel(R) Xeon(R) Processor", "cpu_id": "GenuineIntel family 6 model 167",
        "flags": ["avx2", "fma", "avx512f"], "cores": 2, "python": "3.11.7",
        "tensorflow": "2.21.0", "numpy": "2.4.6", "onednn": "1"}


def started_run(out, name, identity, step=429):
  folder = os.path.join(out, name)
  os.makedirs(os.path.join(folder, "latest"))
  for suffix in (".index", ".data-00000-of-00001"):
    with open(os.path.join(folder, "latest", f"model.ckpt-{step}{suffix}"), "w") as f:
      f.write(f"weights {step}{suffix}")
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump({"model": {"precision": "fp32", "conv_plan": "conv1:conv2d"}}, f)
  with open(os.path.join(folder, "host.json"), "w") as f:
    json.dump({"started": {}, "resumed": [], "attempts": [{"kind": "start",
                                                           "identity": identity}]}, f)
  return folder


def test_the_rule_resumes_on_the_same_host_else_restarts(tmp_path):
  out, pub = str(tmp_path / "out"), str(tmp_path / "pub")
  due = registered.sequence(CONFIRM)[0]
  name = registered.folder_name(due)
  assert registered.plan_attempt(out, pub, due, HERE) == {"kind": "start"}
  folder = started_run(out, name, HERE)
  step, paths = registered.newest_checkpoint(folder)
  assert registered.plan_attempt(out, pub, due, HERE) == {
      "kind": "resume", "from_step": 429, "from_digest": registered.digest(paths)}
  other = dict(HERE, cpu_id="AuthenticAMD family 25 model 17")
  attempt = registered.plan_attempt(out, pub, due, other)
  assert attempt["kind"] == "restart"
  assert "cpu_id: GenuineIntel family 6 model 167 -> AuthenticAMD family 25 model 17" \
      in attempt["reason"]
  for key in registered.IDENTITY:   # every field of the identity counts
    changed = dict(HERE, **{key: "other"})
    assert registered.plan_attempt(out, pub, due, changed)["kind"] == "restart", key
  os.makedirs(pub)
  with open(os.path.join(pub, registered.PARTWAY_FILE), "w") as f:
    f.write(json.dumps({"run": name, "step": 429}) + "\n")
  os.rename(folder, folder + ".moved")   # the folder gone (a fresh machine)
  attempt = registered.plan_attempt(out, pub, due, HERE)
  assert attempt["kind"] == "restart" and "is gone" in attempt["reason"]


def test_a_restart_is_refused_without_the_flag_and_keeps_the_old_folder(tmp_path,
                                                                        monkeypatch):
  monkeypatch.setenv(registered.UNCHECKED, "1")
  out, pub = str(tmp_path / "out"), str(tmp_path / "pub")
  name = registered.folder_name(registered.sequence(CONFIRM)[0])
  started_run(out, name, dict(HERE, cpu="another CPU"))
  with pytest.raises(registered.RegisteredError,
                     match=r"pass --restart to do that \(the old folder is kept in "):
    registered.run_sequence(CONFIRM, out, pub, [], 1)
  assert os.path.isdir(os.path.join(out, name))
  assert registered.set_aside(out, name) == os.path.join(out, "lost", name + ".attempt1")
  assert not os.path.exists(os.path.join(out, name))
  # Gone with the machine, its part-way state committed: no old folder to keep.
  os.makedirs(pub)
  with open(os.path.join(pub, registered.PARTWAY_FILE), "w") as f:
    f.write(json.dumps({"run": name, "step": 429}) + "\n")
  with pytest.raises(registered.RegisteredError, match=r"is gone.*pass --restart to do that$"):
    registered.run_sequence(CONFIRM, out, pub, [], 1)


def test_runs_out_of_turn_are_refused(tmp_path, monkeypatch):
  monkeypatch.setenv(registered.UNCHECKED, "1")
  out, pub = str(tmp_path / "out"), str(tmp_path / "pub")
  third = registered.folder_name(registered.sequence(CONFIRM)[2])
  started_run(out, third, HERE)
  due = registered.folder_name(registered.sequence(CONFIRM)[0])
  with pytest.raises(registered.RegisteredError,
                     match=f"{third}: out of turn, {due} is due"):
    registered.run_sequence(CONFIRM, out, pub, [], 1)
  os.makedirs(os.path.join(pub, third))
  with pytest.raises(registered.RegisteredError, match=f"{third}: published out of turn"):
    registered.run_sequence(CONFIRM, out, pub, [], 1)
  with pytest.raises(registered.RegisteredError, match="the same folder as --publish"):
    registered.run_sequence(CONFIRM, pub, pub, [], 1)


def test_a_model_failure_is_told_from_a_machine_fault(tmp_path):
  log = tmp_path / "run.log"
  log.write_text("step 10\ntrain.py: error: loss is nan at step 11; stopped without "
                 "saving\n")
  assert registered.last_error(str(log)).startswith(registered.MODEL_FAILURE)
  log.write_text("step 10\ntrain.py: error: /x: No space left on device\n")
  assert not registered.last_error(str(log)).startswith(registered.MODEL_FAILURE)
