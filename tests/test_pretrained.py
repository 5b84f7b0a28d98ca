"""The shipped weights: the end-to-end numerical regression test. Runs the
README's commands, `python eval.py --checkpoint pretrained/r3_recon` on all
10,000 MNIST test images and the same with `--split=affine`, as eval.py runs
them (in this process, `eval_here`: the run's own precision and
convolution methods, its config.json), and asserts the exact numbers of
errors: a change to the layers that changes a prediction fails it."""
import os

import pytest

from capsnet.running import runs
from conftest import MNIST
from conftest import ROOT
from conftest import eval_here
from conftest import needs_mnist

PRETRAINED = os.path.join(ROOT, "pretrained", "r3_recon")
TEST_ERRORS = 38      # `python eval.py --checkpoint pretrained/r3_recon` (README)
AFFINE_ERRORS = 174   # the same with `--split=affine` (README)

shipped = pytest.mark.skipif(not os.path.exists(os.path.join(PRETRAINED, "config.json")),
                             reason="no shipped weights")


def errors_of(tmp_path, *flags):
  """eval.py on the shipped weights with `flags`: its results.json's count
  and the errors its predictions file holds."""
  out = str(tmp_path / "eval")
  proc = eval_here(f"--checkpoint={PRETRAINED}", f"--data_dir={MNIST}", "--download=false",
                   f"--out_dir={out}", "--num_images=8", "--figure4_images=1", *flags)
  assert proc.returncode == 0, proc.stderr[-3000:]
  folder = runs.EvalFolder(out)
  predictions = folder.predictions()
  return folder.results()["count"], sum(
      p != y for p, y in zip(predictions["prediction"], predictions["label"], strict=True))


@needs_mnist
@shipped
@pytest.mark.integration
def test_shipped_weights_make_the_readme_number_of_test_errors(tmp_path):
  assert errors_of(tmp_path) == (10000, TEST_ERRORS)


@needs_mnist
@shipped
@pytest.mark.integration
def test_shipped_weights_make_the_readme_number_of_affine_test_errors(tmp_path):
  assert errors_of(tmp_path, "--split=affine") == (10000, AFFINE_ERRORS)
