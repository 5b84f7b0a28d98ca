"""The committed results are what the project's own code makes of the
committed run files, the along page's table is the answer's table and the
README says where the confirmatory test stands: a run published without its
report, or a report without the README, fails here."""
import json
import os
import shutil

import pytest

from capsnet.running import runs
from capsnet.science import along
from capsnet.science import answer
from capsnet.science import blocks
from capsnet.science import grids
from capsnet.science import protocols
from capsnet.science import registered
from capsnet.science import rule
from conftest import ROOT
from conftest import assert_same_decision

STUDY = os.path.join(ROOT, "study")
ALONG = os.path.join(STUDY, "along")
CONFIRMED = os.path.join(STUDY, "confirm")


# A plot is compared by its pixels: the same figures drawn by another release
# of matplotlib or numpy can move a few anti-aliased pixels (seen: 12 of
# 638,400 in study/along/along.png, one band's edge), while a changed figure
# moves a marker, a line or a band, hundreds of pixels or more.
PIXELS_ALLOWED = 0.0005


def assert_same_file(made, committed, stale):
  """`made` (a path) is the committed file `committed`: byte for byte, or
  for a PNG, the same picture but for PIXELS_ALLOWED of its pixels."""
  with open(made, "rb") as f:
    ours = f.read()
  with open(committed, "rb") as f:
    theirs = f.read()
  if not committed.endswith(".png") or ours == theirs:
    assert ours == theirs, stale
    return
  import io

  from matplotlib import image
  a, b = image.imread(io.BytesIO(ours)), image.imread(io.BytesIO(theirs))
  assert a.shape == b.shape, stale
  moved = (a != b).any(axis=-1).mean()
  assert moved <= PIXELS_ALLOWED, f"{stale} ({moved:.2%} of its pixels differ)"


def table_rows(text, header_start):
  """The data rows of the first markdown table whose header starts so."""
  lines = text.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
  rows = []
  for line in lines[start + 2:]:           # past the header and its |---| line
    if not line.startswith("|"):
      break
    rows.append(line)
  return rows


def test_along_report_is_the_committed_runs_report(tmp_path):
  found = blocks.collect(ALONG, range(5), protocols.ALONG)
  along.report(found, protocols.ALONG, str(tmp_path))
  for name in ("results.md", "results.json", "along.png"):
    assert_same_file(str(tmp_path / name), os.path.join(ALONG, name), (
        f"study/along/{name} is stale: python -m capsnet.along --seeds=5 "
        "--out=study/along --train=false"))


# The grids' reports as their pages publish them: every grid that declares
# its seeds, with the declaration's published variants, seeds, epochs,
# schedules and pairs.
GRID_REPORTS = [name for name, grid in grids.GRIDS.items() if grid.seeds]
REPORT_FILES = ("results.md", "results.json", "val_error.png", "diagnostic.png",
                "affine.png", "affine_sweep.png")


@pytest.mark.parametrize("name", GRID_REPORTS)
def test_grid_report_is_the_committed_runs_report(name, tmp_path):
  """Each grid's published report made again from its published runs (the
  report's files removed first, so each must be written anew)."""
  grid = protocols.PROTOCOLS[name]
  variants = grid.published or tuple(grid.variants)
  out = tmp_path / name
  shutil.copytree(os.path.join(STUDY, name), out)
  committed = [f for f in REPORT_FILES if (out / f).exists()]
  for f in committed:
    (out / f).unlink()
  grids.run_grid(grid, variants, grid.seeds, grid.schedules, {"epochs": grid.epochs}, [],
                 [(a, b) for a, b, _ in grid.pairs], [],
                 grids.Where(str(out), None, False, False, ""))
  made = [f for f in REPORT_FILES if (out / f).exists()]
  assert committed == made, (f"study/{name}: the report writes {made}, the commit holds "
                             f"{committed}: the report command of docs/{name}.md")
  for f in made:
    assert_same_file(str(out / f), os.path.join(STUDY, name, f), (
        f"study/{name}/{f} is stale: the report command of docs/{name}.md"))


def test_confirm_report_is_the_committed_runs_report(tmp_path):
  rule.report(CONFIRMED, protocols.CONFIRM, str(tmp_path))
  final = json.loads((tmp_path / "results.json").read_text())["final"]
  # while interim, progress only: no plot (docs/confirm.md)
  assert os.path.exists(os.path.join(CONFIRMED, "confirm.png")) == final
  for name in ("results.md", "results.json") + (("confirm.png",) if final else ()):
    assert_same_file(str(tmp_path / name), os.path.join(CONFIRMED, name), (
        f"study/confirm/{name} is stale: python -m capsnet.confirm --train=false "
        "--out=study/confirm"))


def test_the_registered_answer_is_the_registrations_own_report():
  """Once the last run is in, study/confirm/registered/ holds the report the
  registration's own code made (issue 72), and main's report gives the same
  registered answer, line for line, and the same decision; before, neither."""
  with open(os.path.join(CONFIRMED, "results.json")) as f:
    ours = json.load(f)
  theirs_folder = os.path.join(CONFIRMED, registered.REGISTERED_FOLDER)
  if not ours["final"]:
    assert not os.path.exists(theirs_folder), "the registration's report before the last run"
    return
  with open(os.path.join(theirs_folder, "results.json")) as f:
    theirs = json.load(f)
  assert theirs["final"] and theirs["blocks"] == ours["details"]["blocks"]
  assert_same_decision(ours["details"]["decision"], theirs["decision"])
  with open(os.path.join(CONFIRMED, "results.md")) as f, \
      open(os.path.join(theirs_folder, "results.md")) as g:
    answer = rule.registered_answer(f.read())
    assert answer and answer == rule.registered_answer(g.read())
  for name in ("confirm.png", "README.md"):
    assert os.path.isfile(os.path.join(theirs_folder, name)), name


def test_every_confirmatory_attempt_ran_checked_fp32_from_the_registration_commit():
  commit = registered.registration_commit(ROOT, protocols.CONFIRM.lock)
  assert commit is not None, "no git history of docs/confirm.lock: test a clone"
  done, _ = registered.progress(protocols.CONFIRM, CONFIRMED)
  names = sorted(n for n in os.listdir(CONFIRMED) if os.path.isdir(os.path.join(CONFIRMED, n))
                 and n != registered.REGISTERED_FOLDER)
  assert names == sorted(registered.folder_name(r) for r in done), "published runs out of turn"
  with open(os.path.join(CONFIRMED, "results.json")) as f:
    counted = json.load(f)
  reported = (counted["details"]["runs_done"] if not counted["final"]
              else len(counted["details"]["blocks"]) * len(protocols.CONFIRM.variants))
  checked = 0
  for name in names:
    folder = runs.RunFolder(os.path.join(CONFIRMED, name))
    record = folder.read_json(runs.HOST_FILE)
    assert record is not None and folder.config() is not None, (
        f"study/confirm/{name}: no host.json or config.json")
    attempts = record.get("attempts")
    assert attempts, f"study/confirm/{name}: no attempt recorded"
    for a in attempts:
      assert (a["commit"], a["checked"]) == (commit, True), f"study/confirm/{name}: {a}"
    assert folder.config()["model"]["precision"] == "fp32", f"study/confirm/{name}"
    checked += 1
  assert checked == reported, f"checked {checked} runs, the report counts {reported}"


def test_answer_is_the_committed_results_answer(tmp_path):
  answer.write(STUDY, str(tmp_path))
  for name in ("answer.md", "answer.json"):
    with open(os.path.join(STUDY, name), "rb") as f:
      assert (tmp_path / name).read_bytes() == f.read(), (
          f"study/{name} is stale: python -m capsnet.answer")


def test_along_page_table_is_the_answers():
  """docs/along.md gives the pilots' primary table across protocols: it must
  be study/answer.md's, row for row."""
  with open(os.path.join(ROOT, "docs", "along.md")) as f:
    page = f.read()
  with open(os.path.join(STUDY, "answer.md")) as f:
    answered = f.read()
  ours = table_rows(page, "| training | checkpoint |")
  assert ours and ours == table_rows(answered, "| training | checkpoint chosen on |"), (
      "docs/along.md's table is not study/answer.md's: python -m capsnet.answer, then copy")


def test_readme_results_say_where_the_confirmatory_test_stands():
  with open(os.path.join(ROOT, "README.md")) as f:
    results = f.read().split("## Results")[1].split("\n## ")[0]
  text = " ".join(results.split())   # the section's words, its line breaks aside
  with open(os.path.join(CONFIRMED, "results.json")) as f:
    counted = json.load(f)
  if not counted["final"]:
    done, total = counted["details"]["runs_done"], len(registered.sequence(protocols.CONFIRM))
    assert f"Where it stands: {done} of {total} runs done." in text
  else:   # the registered answer in a few lines: the primary, the claim, the picture
    decision = counted["details"]["decision"]
    primary = decision["primary"]
    assert f"{primary['mean']:+.3f} points" in text, "README: the primary's difference"
    assert f"[{primary['lo']:+.3f}, {primary['hi']:+.3f}]" in text, "README: its interval"
    assert decision["claim"] in text and "study/confirm/confirm.png" in results
