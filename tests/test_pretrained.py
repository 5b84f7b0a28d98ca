"""The shipped weights: the end-to-end numerical regression test. Scores all
10,000 MNIST test images with pretrained/r3_recon (in float32, as its
config.json says) and asserts the exact number of errors the README gives:
a change to the layers that changes a prediction fails it.

PrimaryCaps is computed here by the DFT method (`SCORING_PLAN`, the plan
`eval.py --conv_impl=auto` measured on a 2-core Zen 5, where it scored the
10,000 test images in 16.8 s against 24.4 s with the shipped run's own
methods; docs/performance.md), and both made the same prediction for every
one of the 10,000 test and 10,000 affine images (lengths within 1.4e-6).
That the methods compute the same convolution is tests/test_fast_conv.py's."""
import dataclasses
import os

import pytest
import tensorflow as tf

from capsnet.data import mnist
from capsnet.running import evaluation
from capsnet.running import runs
from conftest import MNIST, ROOT, needs_mnist

PRETRAINED = os.path.join(ROOT, "pretrained", "r3_recon")
TEST_ERRORS = 38   # `python eval.py --checkpoint pretrained/r3_recon` (README)
SCORING_PLAN = "conv1:patch_gemm,primary_caps:dft"


@pytest.fixture(scope="module")
def shipped():
  """`shipped(images, labels)`: evaluation.run of the shipped weights, in
  float32 as their config.json says; one graph and session for the module."""
  ckpt, run = runs.resolve(PRETRAINED, "best")
  assert runs.damage(ckpt) is None
  cfg = runs.RunFolder(run).load_config()[0]
  assert cfg.precision == "fp32"
  cfg = dataclasses.replace(cfg, conv_plan=SCORING_PLAN)
  graph = tf.Graph()
  with graph.as_default():
    ev = evaluation.build(cfg, 500)
    runs.check_matches(ckpt, tf.compat.v1.global_variables())
    saver = tf.compat.v1.train.Saver()
  with tf.compat.v1.Session(graph=graph) as sess:
    saver.restore(sess, ckpt)
    yield lambda images, labels: evaluation.run(sess, ev, images, labels)


@needs_mnist
@pytest.mark.skipif(not os.path.exists(os.path.join(PRETRAINED, "config.json")),
                    reason="no shipped weights")
@pytest.mark.integration
def test_shipped_weights_make_the_readme_number_of_test_errors(shipped):
  images, labels = mnist.load("mnist", MNIST, 5000, download_missing=False)["test"]
  result = shipped(images, labels)
  errors = int((result["predictions"] != labels).sum())
  assert result["count"] == 10000
  assert errors == TEST_ERRORS
  readme = open(os.path.join(ROOT, "README.md")).read()
  assert f"{errors} errors on the 10,000 test images" in readme


AFFINE_ERRORS = 174   # `python eval.py --checkpoint pretrained/r3_recon --split=affine`


@needs_mnist
@pytest.mark.skipif(not os.path.exists(os.path.join(PRETRAINED, "config.json")),
                    reason="no shipped weights")
@pytest.mark.integration
def test_shipped_weights_make_the_readme_number_of_affine_test_errors(shipped):
  from capsnet.data import tasks
  splits = {"test": mnist.load("mnist", MNIST, 5000, download_missing=False)["test"]}
  images, labels = tasks.get("mnist").affine_split(splits)
  result = shipped(images, labels)
  errors = int((result["predictions"] != labels).sum())
  assert errors == AFFINE_ERRORS
  readme = open(os.path.join(ROOT, "README.md")).read()
  assert f"--split=affine   # {errors} errors, {errors / 100:.2f}%" in readme
