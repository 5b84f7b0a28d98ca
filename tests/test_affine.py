"""The affine test set (capsnet/data/affine.py) and eval.py --split=affine:
the transform against hand-computed cases, determinism, the frame, the md5
check, and scoring a small run."""
import json
import os

import numpy as np
import pytest

from capsnet.data import affine
from capsnet.data import mnist
from conftest import MNIST
from conftest import THREE_EPOCHS
from conftest import eval_here
from conftest import last_line
from conftest import needs_mnist


def _digits(n=6, seed=0):
  """Small fake digits: a filled rectangle each, somewhere inside 28x28."""
  rng = np.random.RandomState(seed)
  images = np.zeros([n, 28, 28, 1], np.uint8)
  for k in range(n):
    y, x = rng.randint(6, 10, size=2)
    images[k, y:y + rng.randint(8, 14), x:x + rng.randint(4, 10)] = 200
  return images


def test_identity_and_shift_and_quarter_turn_by_hand():
  images = _digits(2)
  identity = np.array([[0, 0, 1, 1, 0, 0]] * 2, np.float64)
  np.testing.assert_array_equal(affine.apply(images, identity), images)
  shift = np.array([[0, 0, 1, 1, 1, 0]] * 2, np.float64)   # one pixel to the right
  out = affine.apply(images, shift)
  np.testing.assert_array_equal(out[:, :, 1:], images[:, :, :-1])
  dot = np.zeros([1, 28, 28, 1], np.uint8)
  dot[0, 3, 5] = 255                                        # (x, y) = (5, 3)
  turned = affine.apply(dot, np.array([[np.pi / 2, 0, 1, 1, 0, 0]]))
  # out = A (p - c) + c with A = [[0, -1], [1, 0]], c = 13.5: (27 - y, x) = (24, 5)
  assert turned[0, 5, 24, 0] == 255 and turned.sum() == 255


def test_forward_matrix_and_the_op_agree_on_where_the_ink_goes():
  images = _digits(6)
  params = affine.draw(images)
  out = affine.apply(images, params)
  for image, moved, p in zip(images, out, params, strict=True):
    ys, xs = np.nonzero(moved[..., 0] > 100)
    centre = affine.forward_matrix(p) @ np.array([*np.argwhere(image[..., 0].T)
                                                  .mean(0), 1.0])
    np.testing.assert_allclose([xs.mean(), ys.mean()], centre, atol=0.6)


def test_draws_are_deterministic_in_range_and_keep_the_ink_in_the_frame():
  images = _digits(40, seed=1)
  a, b = affine.draw(images), affine.draw(images)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, affine.draw(images, seed=affine.SEED + 1))
  r = affine.AFFNIST
  assert (np.abs(a[:, 0]) <= np.deg2rad(r.rotation_deg)).all()
  assert (np.abs(a[:, 1]) <= r.shear).all() and (np.abs(a[:, 4:]) <= r.shift).all()
  assert ((a[:, 2:4] >= r.scale_low) & (a[:, 2:4] <= r.scale_high)).all()
  for image, p in zip(images, a, strict=True):
    assert affine.fits(p, affine.ink_box(image))
  out = affine.apply(images, a)
  assert affine.md5(out) == affine.md5(affine.apply(images, a))
  # The sweep's point at affNIST's own largest rotation is the set (eval.py
  # reuses it there): Ranges with rotation_deg=20 and the rest as they are.
  np.testing.assert_array_equal(affine.make(images, affine.Ranges(rotation_deg=20))[0],
                                affine.test_set(images))
  # Ink the transform would push out is redrawn: a digit filling the frame
  # cannot be scaled up by 1.2 and fit; with no range to draw from it fails.
  full = np.full([1, 28, 28, 1], 9, np.uint8)
  with pytest.raises(affine.AffineError, match="fits no draw"):
    affine.draw(full, affine.Ranges(scale_low=1.2, scale_high=1.2))


def test_ranges_are_checked():
  with pytest.raises(ValueError, match="affine.Ranges: expected"):
    affine.Ranges(scale_low=1.3, scale_high=1.2)


def test_the_recorded_md5_is_checked(monkeypatch):
  images = _digits(4)
  monkeypatch.setitem(affine.MD5, affine.md5(images), "0" * 32)
  with pytest.raises(affine.AffineError, match="the affine test set has md5 [0-9a-f]{32}, "
                     "expected 0{32}"):
    affine.test_set(images)
  other = affine.Ranges(rotation_deg=5)   # another set: not the recorded one, unchecked
  assert affine.test_set(images, other).shape == images.shape


@needs_mnist
def test_mnist_affine_test_set_has_the_recorded_md5():
  images, _ = mnist.load("mnist", MNIST, 5000, download_missing=False)["test"]
  assert affine.md5(images) == affine.MNIST_TEST_MD5
  assert affine.md5(affine.test_set(images)) == affine.MD5[affine.MNIST_TEST_MD5]


@needs_mnist
def test_eval_scores_the_affine_set_with_its_sweep(tmp_path, trained_once):
  logdir = trained_once(*THREE_EPOCHS)
  results = []
  for sweep in (["--affine_sweep=0,20"], []):   # the same count twice, one sweep
    out = str(tmp_path / f"affine{len(results)}")
    proc = eval_here(f"--checkpoint={logdir}", "--split=affine", *sweep,
                     f"--out_dir={out}", "--num_images=2", "--figure4_images=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results.append(json.load(open(os.path.join(out, "results.json"))))
  a, b = results
  assert a["split"] == "affine" and a["count"] == 10000
  assert a["error_percent"] == b["error_percent"] and b["sweep"] == []
  assert a["affine"]["md5"] == affine.MD5[affine.MNIST_TEST_MD5]
  assert [r["max_rotation_deg"] for r in a["sweep"]] == [0, 20]
  # Rotation within 20 degrees with the other ranges affNIST's is the set
  # itself (eval.py scores the same images; made alike: the test above).
  assert a["sweep"][1]["error_percent"] == a["error_percent"]
  proc = eval_here(f"--checkpoint={logdir}", "--affine_sweep=10")
  assert proc.returncode == 1
  assert last_line(proc) == "eval.py: error: --affine_sweep=10: needs --split=affine"
  proc = eval_here(f"--checkpoint={logdir}", "--split=affine", "--affine_sweep=x")
  assert last_line(proc) == ("eval.py: error: --affine_sweep=x: expected rotations in "
                             "degrees between 0 and 180")
