"""The committed results are what the project's own code makes of the
committed run files, and the README's table is the answer's table: a run
published without its report, or a report without the README, fails here."""
import json
import os

import pytest

from capsnet import along
from capsnet import answer
from conftest import ROOT

STUDY = os.path.join(ROOT, "study")
ALONG = os.path.join(STUDY, "along")


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


@pytest.mark.skipif(not os.path.isfile(os.path.join(ALONG, "results.json")),
                    reason="no published study/along")
def test_along_report_is_the_committed_runs_report(tmp_path):
  found = along.collect(ALONG, range(5), along.KEPT)
  along.report(found, along.KEPT, str(tmp_path))
  for name in ("results.md", "results.json", "along.png"):
    with open(os.path.join(ALONG, name), "rb") as f:
      assert (tmp_path / name).read_bytes() == f.read(), (
          f"study/along/{name} is stale: python -m capsnet.along --seeds=5 "
          "--out=study/along --train=false")


@pytest.mark.skipif(not os.path.isfile(os.path.join(STUDY, "answer.md")),
                    reason="no study/answer.md")
def test_answer_is_the_committed_results_answer(tmp_path):
  answer.write(STUDY, str(tmp_path))
  for name in ("answer.md", "answer.json"):
    with open(os.path.join(STUDY, name), "rb") as f:
      assert (tmp_path / name).read_bytes() == f.read(), (
          f"study/{name} is stale: python -m capsnet.answer")


@pytest.mark.skipif(not os.path.isfile(os.path.join(STUDY, "answer.md")),
                    reason="no study/answer.md")
def test_readme_table_is_the_answers_and_says_interim_while_it_is():
  with open(os.path.join(ROOT, "README.md")) as f:
    readme = f.read()
  with open(os.path.join(STUDY, "answer.md")) as f:
    answered = f.read()
  ours = table_rows(readme, "| training | checkpoint |")
  assert ours and ours == table_rows(answered, "| training | checkpoint chosen on |")
  with open(os.path.join(ALONG, "results.json")) as f:
    blocks = json.load(f)["blocks"]
  if len(blocks) < 5:
    named = ", ".join(str(b) for b in blocks[:-1]) + f" and {blocks[-1]}"
    assert f"interim: blocks {named} of 5" in readme
  else:
    assert "interim" not in readme.split("## Results")[1].split("\n## ")[0]
