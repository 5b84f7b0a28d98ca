"""MultiMNIST: the pair generator, the two-label losses and heads, the
metric, and a small run through train.py and eval.py."""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from capsnet.data import multimnist
from capsnet.model import losses
from capsnet.model import network
from conftest import SMALL
from conftest import eval_here
from conftest import needs_mnist
from conftest import train_here


def _digits(n=60, seed=0):
  """Small fake digits: distinct values, every class present."""
  rng = np.random.RandomState(seed)
  images = rng.randint(1, 200, (n, 28, 28, 1)).astype(np.uint8)
  return images, np.arange(n) % 10


def test_fixed_pairs_cover_every_digit_with_another_class():
  _, labels = _digits()
  first, second, shifts = multimnist.fixed_pairs(labels, seed=3)
  np.testing.assert_array_equal(first, np.arange(len(labels)))
  assert (labels[first] != labels[second]).all()
  assert shifts.shape == (len(labels), 2, 2)
  assert shifts.min() >= -4 and shifts.max() <= 4 and len(np.unique(shifts)) == 9
  again = multimnist.fixed_pairs(labels, seed=3)
  for a, b in zip((first, second, shifts), again, strict=True):
    np.testing.assert_array_equal(a, b)
  other = multimnist.fixed_pairs(labels, seed=4)
  assert not np.array_equal(other[1], second)


def test_place_and_merge_are_exact():
  digit = np.zeros([1, 28, 28], np.uint8)
  digit[0, 0, 0], digit[0, 27, 27] = 7, 9
  placed = multimnist.place(digit, np.array([[-4, 3]]))
  assert placed.shape == (1, 36, 36)
  assert placed[0, 4 - 4, 4 + 3] == 7 and placed[0, 31 - 4, 31 + 3] == 9
  assert placed.sum() == 16
  # Shifts past 4 (the official README's 6) cut off what leaves the field.
  cut = multimnist.place(np.full([1, 28, 28], 1, np.uint8), np.array([[6, -6]]))
  assert cut.sum() == 26 * 26 and cut[0, 35, 0] == 1 and cut[0, 9, 0] == 0
  a = np.array([[100, 200, 0]], np.uint8)
  b = np.array([[100, 100, 5]], np.uint8)
  np.testing.assert_array_equal(multimnist.merge(a, b), [[200, 255, 5]])


def test_compose_keeps_both_shifted_digits_as_targets():
  images, labels = _digits()
  first, second, shifts = multimnist.fixed_pairs(labels, seed=1)
  merged, pair_labels, targets = multimnist.compose(images, labels, first[:5],
                                                    second[:5], shifts[:5])
  assert merged.shape == (5, 36, 36, 1) and targets.shape == (5, 2, 36, 36, 1)
  np.testing.assert_array_equal(pair_labels, np.stack([labels[first[:5]],
                                                       labels[second[:5]]], 1))
  for k in range(5):
    for d, index in enumerate((first[k], second[k])):
      np.testing.assert_array_equal(
          targets[k, d, ..., 0], multimnist.place(images[index:index + 1, ..., 0],
                                                  shifts[k, d][None])[0])
    np.testing.assert_array_equal(merged[k], multimnist.merge(targets[k, 0], targets[k, 1]))


def test_training_pairs_in_tensorflow():
  """Shifts in bounds, different classes, the merge rule, both targets
  exact (equal to the NumPy composition of the same pairs), and the same
  seed gives the same pairs."""
  images, labels = _digits()
  first = np.array([0, 5, 13, 27, 42, 59])
  with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
    seed = tf.compat.v1.placeholder(tf.int64, [2])
    out = multimnist.training_pairs(tf.constant(images), tf.constant(labels, tf.int32),
                                    tf.constant(first), seed)
    merged, pair_labels, targets = sess.run(out, {seed: [7, 0]})
    again = sess.run(out, {seed: [7, 0]})
    other = sess.run(out, {seed: [7, 1]})
  for a, b in zip((merged, pair_labels, targets), again, strict=True):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(other[2], targets)
  np.testing.assert_array_equal(pair_labels[:, 0], labels[first])
  assert (pair_labels[:, 0] != pair_labels[:, 1]).all()
  for k in range(len(first)):
    a, b = targets[k, 0, ..., 0], targets[k, 1, ..., 0]
    np.testing.assert_array_equal(merged[k, ..., 0], multimnist.merge(a, b))
    # Each target is its digit, shifted by at most 4 (found by search).
    for d, candidates in ((0, [first[k]]), (1, np.flatnonzero(labels == pair_labels[k, 1]))):
      found = [(i, dy, dx) for i in candidates for dy in range(-4, 5)
               for dx in range(-4, 5) if np.array_equal(
                   multimnist.place(images[i:i + 1, ..., 0], np.array([[dy, dx]]))[0],
                   targets[k, d, ..., 0])]
      assert len(found) == 1, (k, d)


def test_two_label_margin_loss_hand_computed():
  lengths = np.array([[0.95, 0.3, 0.05, 0.7]])
  labels = np.array([[0, 3]])
  # present 0: 0.95 >= 0.9 -> 0; present 3: (0.9 - 0.7)^2 = 0.04;
  # absent 1: 0.5 (0.3 - 0.1)^2 = 0.02; absent 2: 0.05 < 0.1 -> 0.
  with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
    got = sess.run(losses.margin_loss(tf.constant(lengths), tf.constant(labels)))
  np.testing.assert_allclose(got, [0.06], rtol=1e-12)


def test_two_reconstruction_losses_hand_computed():
  """Each digit's reconstruction against its own shifted digit; the sum."""
  targets = np.zeros([1, 2, 2, 2, 1])
  targets[0, 0, 0, 0, 0] = 1.0
  targets[0, 1, 1, 1, 0] = 0.5
  recon = np.full([1, 2, 4], 0.5)
  # digit 0: 0.25 + 3 * 0.25 = 1.0; digit 1: 3 * 0.25 + 0 = 0.75.
  with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
    terms = [losses.reconstruction_loss(tf.constant(recon[:, d]),
                                        tf.constant(targets[:, d])) for d in range(2)]
    got = sess.run(tf.add_n(terms))
  np.testing.assert_allclose(got, [0.0005 * 1.75], rtol=1e-12)


def test_top2_metric_on_hand_made_lengths():
  lengths = np.array([[0.9, 0.8, 0.1, 0.0],     # top {0, 1}, labels {1, 0}: exact
                      [0.9, 0.1, 0.8, 0.0],     # top {0, 2}, labels {0, 1}: one
                      [0.1, 0.2, 0.9, 0.8],     # top {2, 3}, labels {0, 1}: none
                      [0.5, 0.1, 0.2, 0.6]])    # top {3, 0}, labels {0, 3}: exact
  labels = np.array([[1, 0], [0, 1], [0, 1], [0, 3]])
  exact, one = multimnist.top2_scores(lengths, labels)
  assert (exact, one) == (0.5, 0.75)


def test_tensorflow_placement_equals_numpy_for_shifts_up_to_6():
  images, _ = _digits(20)
  shifts = np.random.RandomState(0).randint(-6, 7, (20, 2))
  with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
    got = sess.run(multimnist._place_tf(tf.constant(images), tf.constant(shifts, tf.int32)))
  np.testing.assert_array_equal(got[..., 0], multimnist.place(images[..., 0], shifts))


def test_paper_model_on_36x36_has_10x10x32_primary_capsules():
  cfg = network.ModelConfig(image_size=36)
  assert (cfg.primary_size, cfg.in_caps) == (10, 3200)
  with tf.Graph().as_default():
    images = tf.compat.v1.placeholder(tf.float32, [None, 36, 36, 1])
    out = network.forward(images, tf.zeros([1, 2], tf.int32), cfg, training=True,
                        targets=tf.zeros([1, 2, 36, 36, 1]), heads="two_digits")
    # the task says how many labels an image has; a rank that does not fit
    # is refused, not guessed
    with pytest.raises(ValueError, match=r"labels must be \[batch, 2\] with "
                       r"heads='two_digits', got shape \(1,\)"):
      network.forward(images, tf.zeros([1], tf.int32), cfg, training=True,
                    targets=tf.zeros([1, 2, 36, 36, 1]), heads="two_digits")
    with pytest.raises(ValueError, match=r"labels must be \[batch\] with "
                       r"heads='one_digit', got shape \(1, 2\)"):
      network.forward(images, tf.zeros([1, 2], tf.int32), cfg, training=True)
    with pytest.raises(ValueError, match=r"forward: heads='three': expected one of "
                       r"\['one_digit', 'two_digits'\]"):
      network.forward(images, tf.zeros([1], tf.int32), cfg, training=True, heads="three")
    count = sum(int(np.prod(v.shape)) for v in tf.compat.v1.trainable_variables())
  # W alone: 3200 x 10 x 8 x 16; the decoder's output layer has 36 * 36 units.
  assert count == 11_361_808
  assert out.reconstructions.shape.as_list() == [None, 2, 1296]
  assert out.predictions.shape.as_list() == [None, 2]


def test_two_digit_heads_on_fixed_capsules():
  """Top-2 predictions, exact-pair accuracy and the two-label margin loss
  from capsules set by hand (through forward's heads, decoder off)."""
  cfg = network.ModelConfig(num_classes=4, digit_dim=2, use_decoder=False)
  v = np.zeros([2, 4, 2])
  v[0, 1, 0], v[0, 3, 1], v[0, 0, 0] = 0.95, 0.7, 0.3      # top {1, 3}
  v[1, 2, 0], v[1, 0, 0] = 0.8, 0.6                         # top {2, 0}
  labels = np.array([[3, 1], [2, 1]])
  lengths = np.sqrt((v ** 2).sum(-1) + 1e-12)
  with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
    top2, recon, margin, recon_loss, correct = network._two_digit_heads(
        tf.constant(v), tf.constant(lengths), tf.constant(labels, tf.int32), None,
        cfg, False)
    assert recon is None
    top2, margin, recon_loss, correct = sess.run([top2, margin, recon_loss, correct])
  np.testing.assert_array_equal(top2, [[1, 3], [2, 0]])
  assert (recon_loss == 0).all()
  np.testing.assert_array_equal(correct, [1.0, 0.0])
  # ex 0: present 1 (0.95) and 3 (0.7): 0.04; absent 0: 0.5 * 0.2^2 = 0.02.
  # ex 1: present 2 (0.8): 0.01, present 1 (0): 0.81; absent 0: 0.5 * 0.5^2.
  np.testing.assert_allclose(margin, [0.06, 0.945], atol=1e-5)   # (lengths + 1e-12)


@needs_mnist
def test_multimnist_training_and_evaluation_smoke(tmp_path):
  logdir = str(tmp_path / "run")
  proc = train_here(*SMALL, "--dataset=multimnist", "--train_size=320", "--epochs=1",
                    f"--logdir={logdir}", "--diag_every=5")
  assert proc.returncode == 0, proc.stderr[-3000:]
  saved = json.load(open(os.path.join(logdir, "config.json")))
  assert saved["model"]["image_size"] == 36 and saved["train"]["multimnist_shift"] == 4
  row = json.loads(open(os.path.join(logdir, "metrics.jsonl")).readline())
  assert (row["epoch"], row["step"]) == (1, 10) and 0 <= row["val_accuracy"] <= 1
  assert row["val_at_least_one"] >= row["val_accuracy"]
  test = json.load(open(os.path.join(logdir, "test_results.json")))
  assert test["count"] == 10000 and test["at_least_one"] >= test["accuracy"]
  out = tmp_path / "eval"
  proc = eval_here(f"--checkpoint={logdir}", f"--out_dir={out}", "--split=validation")
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.load(open(out / "results.json"))
  assert (result["accuracy"], result["count"]) == (row["val_accuracy"], 500)
  header = open(out / "predictions.csv").readline()
  assert header.startswith("index,label_a,label_b,prediction_a,prediction_b,length_0")
  with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
    picture = sess.run(tf.io.decode_png(open(out / "figure5.png", "rb").read()))
  tile = (36 * 2 + 2) * 3 + 14
  assert picture.shape == (2 * tile + 6, 6 * 36 * 3 + 5 * 6, 3)
  assert "both digits right:" in proc.stdout


def test_tasks_say_what_each_data_set_is():
  from capsnet.data import tasks
  mnist, fashion, pairs = (tasks.get(n, 6) for n in ("mnist", "fashion_mnist", "multimnist"))
  assert (mnist.heads, fashion.heads, pairs.heads) == ("one_digit", "one_digit",
                                                       "two_digits")
  assert (mnist.image_size, fashion.image_size, pairs.image_size) == (28, 28, 36)
  assert (mnist.pictures, pairs.pictures) == ("figure4", "figure5")
  assert (mnist.has_affine, fashion.has_affine, pairs.has_affine) == (True, False, False)
  lengths = np.array([[0.9, 0.8, 0.1], [0.1, 0.9, 0.8]])
  scored = pairs.score(lengths, None, np.array([[0, 1], [0, 1]]))
  assert scored == {"accuracy": 0.5, "error_percent": 50.0, "at_least_one": 1.0}
  scored = mnist.score(lengths, np.array([0, 1]), np.array([0, 2]))
  assert (scored["accuracy"], scored["per_class_accuracy"]) == (0.5, [1.0, 0.0, 0.0])
  assert scored["confusion"] == [[1, 0, 0], [0, 0, 0], [0, 1, 0]]
  assert (mnist.files, fashion.files, pairs.files) == ("mnist", "fashion_mnist", "mnist")
  assert pairs.pair_shift == 6
  splits = {"train": (np.arange(40).reshape(40, 1), np.arange(40)),
            "validation": (np.arange(50).reshape(50, 1), np.arange(50))}
  assert mnist.fixed_batch(splits)[1].tolist() == list(range(32))     # training
  assert len(pairs.fixed_batch(splits)[0]) == 32
  assert pairs.fixed_batch(splits)[0][0, 0] == 0 and pairs.fixed_batch(splits)[1][-1] == 31
  with pytest.raises(ValueError, match=r"--dataset=cifar: expected one of "
                     r"\['fashion_mnist', 'mnist', 'multimnist'\]"):
    tasks.get("cifar")
  with tf.Graph().as_default():
    digits = mnist.train_pipeline([28, 28, 1], 8, (0, 1))
    both = pairs.train_pipeline([36, 36, 1], 8, (0, 1))
    order = np.arange(4)
    feed = mnist.epoch_feed(digits, splits["train"], order)
    assert set(feed) == {digits.images, digits.labels}
    assert feed[digits.labels].tolist() == [0, 1, 2, 3]
    feed = pairs.epoch_feed(both, splits["train"], order)
    assert set(feed) == {both.images, both.labels, both.order}
    assert len(feed[both.images]) == 40          # the digits once, paired on the fly
    assert digits.batch[2] is None and both.batch[2] is not None
