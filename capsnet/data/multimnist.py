"""MultiMNIST (Sabour et al. 2017, Section 6): two overlapping digits of
different classes in one 36x36 image, made from the MNIST splits.

Each digit is placed at the centre of the canvas, shifted by its own uniform
(dy, dx) in [-max_shift, max_shift] (the paper: 4), and the two merged with
`min(a + b, 255)`; the shifted digits are the reconstruction targets. Training
pairs are drawn on the fly, stateless (batch k's from (seed, k)), so nothing of
the paper's 60M images is written; validation and test pairs are fixed by a
seed, one a digit, that digit first.
"""

import numpy as np
import tensorflow as tf

from capsnet.data import mnist

CANVAS = 36
PAIR_SHIFT = 4   # each digit of a pair shifted by up to 4 pixels (Section 6)


def fixed_pairs(labels, seed, max_shift=PAIR_SHIFT, num_classes=10):
  """One pair a digit of a split with `labels` `[n]`: (first = arange(n),
  second: a digit of another class, shifts `[n, 2, 2]`)."""
  rng = np.random.RandomState(seed)
  labels = np.asarray(labels)
  first = np.arange(len(labels))
  offset = rng.randint(1, num_classes, len(labels))          # another class
  partner_class = (labels + offset) % num_classes
  by_class = [np.flatnonzero(labels == c) for c in range(num_classes)]
  pick = rng.random_sample(len(labels))
  second = np.array([by_class[c][int(p * len(by_class[c]))]
                     for c, p in zip(partner_class, pick, strict=True)])
  shifts = rng.randint(-max_shift, max_shift + 1, (len(labels), 2, 2))
  return first, second, shifts


def place(digits, shifts, canvas=CANVAS):
  """Digits `[n, h, w]` centred on a `canvas`-sized field, each shifted by
  its (dy, dx) `[n, 2]` with zero fill; what leaves the field is cut off
  (shifts over (canvas - 28) / 2 = 4). NumPy. Returns uint8 `[n, c, c]`."""
  n, h, w = digits.shape
  margin = canvas + int(np.abs(shifts).max(initial=0))
  big = np.zeros([n, canvas + 2 * margin, canvas + 2 * margin], np.uint8)
  for k in range(n):
    top = margin + (canvas - h) // 2 + shifts[k, 0]
    left = margin + (canvas - w) // 2 + shifts[k, 1]
    big[k, top:top + h, left:left + w] = digits[k]
  return big[:, margin:margin + canvas, margin:margin + canvas]


def merge(a, b):
  """The paper's merge: `min(a + b, 255)` of two uint8 images."""
  return np.minimum(a.astype(np.int32) + b.astype(np.int32), 255).astype(np.uint8)


def compose(images, labels, first, second, shifts):
  """The MultiMNIST images of given pairs (NumPy): (merged `[m, 36, 36, 1]`
  uint8, labels `[m, 2]` int32, targets `[m, 2, 36, 36, 1]`: the shifted
  digits)."""
  a = place(images[first, ..., 0], shifts[:, 0])
  b = place(images[second, ..., 0], shifts[:, 1])
  targets = np.stack([a, b], axis=1)[..., None]
  pair_labels = np.stack([labels[first], labels[second]], axis=1).astype(np.int32)
  return merge(a, b)[..., None], pair_labels, targets


def training_pairs(images, labels, first, seed, max_shift=PAIR_SHIFT, num_classes=10):
  """The pairs of one training batch, drawn in TensorFlow from `seed`
  (stateless) for the batch's `first` digits: (merged `[b, 36, 36, 1]` uint8,
  labels `[b, 2]` int32, targets `[b, 2, 36, 36, 1]`); every class must be
  present in `labels`."""
  b = tf.shape(first)[0]
  first_labels = tf.gather(labels, first)
  seeds = tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), 3)
  offset = tf.random.stateless_uniform([b], seeds[0], 1, num_classes, dtype=tf.int32)
  partner_class = (first_labels + offset) % num_classes
  order = tf.argsort(labels, stable=True)                   # indices by class
  counts = tf.math.bincount(labels, minlength=num_classes, maxlength=num_classes)
  starts = tf.cumsum(counts, exclusive=True)
  u = tf.random.stateless_uniform([b], seeds[1], dtype=tf.float32)
  within = tf.minimum(tf.cast(u * tf.cast(tf.gather(counts, partner_class), tf.float32),
                              tf.int32), tf.gather(counts, partner_class) - 1)
  second = tf.gather(order, tf.gather(starts, partner_class) + within)
  shifts = tf.random.stateless_uniform([b, 2, 2], seeds[2], -max_shift, max_shift + 1,
                                       dtype=tf.int32)
  a = _place_tf(tf.gather(images, first), shifts[:, 0])
  c = _place_tf(tf.gather(images, second), shifts[:, 1])
  merged = tf.cast(tf.minimum(tf.cast(a, tf.int32) + tf.cast(c, tf.int32), 255), tf.uint8)
  pair_labels = tf.stack([first_labels, tf.gather(labels, second)], axis=1)
  return merged, pair_labels, tf.stack([a, c], axis=1)


def _place_tf(digits, shifts, canvas=CANVAS):
  """`place` in TensorFlow: digits `[b, h, w, 1]`, shifts `[b, 2]` (each
  within +-canvas)."""
  h, w = digits.shape[1], digits.shape[2]
  padded = tf.pad(digits, [[0, 0], [canvas, canvas], [canvas, canvas], [0, 0]])
  # Output row y shows digit row y - (canvas - h) // 2 - dy, which the
  # padding put `canvas` further down: one gather per axis, an exact shift.
  rows = tf.range(canvas)[None, :] + (canvas - (canvas - h) // 2) - shifts[:, :1]
  cols = tf.range(canvas)[None, :] + (canvas - (canvas - w) // 2) - shifts[:, 1:]
  out = tf.gather(padded, rows, axis=1, batch_dims=1)
  return tf.gather(out, cols, axis=2, batch_dims=1)


def top2_scores(lengths, labels):
  """The paper's MultiMNIST metric on capsule `lengths`: (share of images whose
  two longest capsules are their two `labels`, share where at least one of them
  is)."""
  top = np.argsort(-np.asarray(lengths), axis=1, kind="stable")[:, :2]
  hits = (top[:, :, None] == np.asarray(labels)[:, None, :]).any(axis=2).sum(axis=1)
  return float((hits == 2).mean()), float((hits >= 1).mean())


def eval_pipeline(batch_size, name="eval_input", size=CANVAS):
  """Fixed pairs fed as arrays (`compose`), batched in order, the last
  partial batch kept."""
  with tf.device("/cpu:0"), tf.name_scope(name):
    images = tf.compat.v1.placeholder(tf.uint8, [None, size, size, 1], name="images")
    labels = tf.compat.v1.placeholder(tf.int32, [None, 2], name="labels")
    targets = tf.compat.v1.placeholder(tf.uint8, [None, 2, size, size, 1],
                                       name="targets")
    ds = tf.data.Dataset.from_tensor_slices((images, labels, targets)).batch(batch_size)
    ds = ds.map(lambda x, y, t: (mnist.pixels(x), y, mnist.pixels(t)), num_parallel_calls=2)
    iterator = tf.compat.v1.data.make_initializable_iterator(
        ds.prefetch(2).with_options(mnist.dataset_options()))
    batch = iterator.get_next()
  return mnist.Pipeline(images, labels, targets, None, None, None, iterator, batch)


def train_pipeline(batch_size, max_shift=PAIR_SHIFT, name="train_input"):
  """Training pairs drawn on the fly: feed the training digits, their
  labels, the epoch's order of first digits, the epoch's seed and the index
  of the first batch (to resume inside an epoch); batch k's pairs follow
  from (seed, first_batch + k)."""
  with tf.device("/cpu:0"), tf.name_scope(name):
    digits = tf.compat.v1.placeholder(tf.uint8, [None, 28, 28, 1], name="digits")
    labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
    order = tf.compat.v1.placeholder(tf.int64, [None], name="order")
    seed = tf.compat.v1.placeholder(tf.int64, [], name="seed")
    first_batch = tf.compat.v1.placeholder(tf.int64, [], name="first_batch")
    ds = tf.data.Dataset.from_tensor_slices(order).batch(batch_size, drop_remainder=True)

    def pairs(k, first):
      x, y, t = training_pairs(digits, labels, first, tf.stack([seed, first_batch + k]),
                               max_shift)
      return mnist.pixels(x), y, mnist.pixels(t)
    ds = ds.enumerate().map(pairs, num_parallel_calls=2)
    iterator = tf.compat.v1.data.make_initializable_iterator(
        ds.prefetch(2).with_options(mnist.dataset_options()))
    batch = iterator.get_next()
  return mnist.Pipeline(digits, labels, None, order, seed, first_batch, iterator, batch)


def load(mnist_splits, max_shift=PAIR_SHIFT, seeds=(1, 2)):
  """MultiMNIST splits: "train" the MNIST digits (paired on the fly),
  "validation" and "test" fixed pairs by the given seeds (images, labels `[n,
  2]`, targets)."""
  out = {"train": mnist_splits["train"]}
  for split, seed in zip(("validation", "test"), seeds, strict=True):
    images, labels = mnist_splits[split]
    if not len(labels):
      out[split] = (np.zeros([0, CANVAS, CANVAS, 1], np.uint8), np.zeros([0, 2], np.int32),
                    np.zeros([0, 2, CANVAS, CANVAS, 1], np.uint8))
      continue
    first, second, shifts = fixed_pairs(labels, seed, max_shift)
    out[split] = compose(images, labels, first, second, shifts)
  return out
