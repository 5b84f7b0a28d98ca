"""A task per data set, chosen once from --dataset: its image size, splits and
pipelines, epoch order and feed, diagnostic batch, heads (`network.HEADS`),
metric (`score`), eval.py's pictures and the study's x axis. No other module
compares data set names. `Digits`: MNIST and Fashion-MNIST; `DigitPairs`:
MultiMNIST (docs/multimnist.md). The data modules load on first use."""
import importlib

import numpy as np


def _module(name):
  return importlib.import_module(f"capsnet.data.{name}")


class _Task:
  """What every task shares: the order of an epoch."""

  def epoch_order(self, n, seed, epoch, batch_size, shard):
    """The order of the `n` training examples in `epoch`, fixed by (seed,
    epoch), and worker `shard` (index, count)'s part of it."""
    mnist = _module("mnist")
    return mnist.shard_order(mnist.epoch_order(n, seed, epoch), batch_size, *shard)


class Digits(_Task):
  """A data set of one digit (or garment) an image: MNIST, Fashion-MNIST."""
  heads = "one_digit"
  image_size = 28
  pictures = "figure4"       # eval.py: reconstructions and Figure 4
  progress = "epoch"         # the study's x axis: epochs

  def __init__(self, name):
    self.name = name
    self.files = name          # data/<files>/ holds its four .gz files
    self.has_affine = name == "mnist"   # the affine test set is made from it
    self.test_size = 10000   # the test file's images (MNIST's and Fashion-MNIST's)

  def score(self, lengths, predictions, labels):
    """The metric of (capsule lengths, predictions) against `labels` [n]:
    accuracy, error_percent, per_class_accuracy, confusion (rows label, columns
    prediction)."""
    num_classes = lengths.shape[-1]
    correct = predictions == labels
    confusion = np.zeros([num_classes, num_classes], np.int64)
    np.add.at(confusion, (labels, predictions), 1)
    per_class = confusion.diagonal() / np.maximum(confusion.sum(1), 1)
    return {"accuracy": float(correct.mean()),
            "error_percent": float(100.0 * (1.0 - correct.mean())),
            "per_class_accuracy": per_class.tolist(), "confusion": confusion.tolist()}

  def load(self, data_dir, val_size, download):
    """dict split -> (images uint8 [n, h, w, c], labels [n])."""
    return _module("mnist").load(self.name, data_dir, val_size, download)

  def train_pipeline(self, image_shape, batch_size, shard):
    """Batches of the epoch's images in the order fed, shifted (augmented)."""
    return _module("mnist").fed_pipeline(image_shape, batch_size, augment=True,
                                        drop_remainder=True, name="train_input",
                                        shard=shard)

  def eval_pipeline(self, image_shape, batch_size):
    """Batches in order, the last partial one kept."""
    return _module("mnist").fed_pipeline(image_shape, batch_size, name="eval_input")

  def epoch_feed(self, pipe, train, order):
    """The feed of the training iterator's initializer for an epoch's
    `order` of the training split (seed and first batch aside)."""
    images, labels = train
    return {pipe.images: images[order], pipe.labels: labels[order]}

  def fixed_batch(self, splits):
    """The gradient diagnostic's batch: the first 32 training images
    (images, labels, targets None)."""
    images, labels = splits["train"]
    return images[:32], labels[:32], None

  def affine_split(self, splits, max_rotation_deg=None):
    """(images, labels) of the affine test set; `max_rotation_deg`: another
    largest rotation (the sweep; not md5-checked). Raises ValueError for a data
    set other than MNIST."""
    if not self.has_affine:
      raise ValueError(f"--split=affine: the affine test set is made from MNIST's test "
                       f"images, not from --dataset={self.name}'s")
    affine = _module("affine")
    images, labels = splits["test"]
    if max_rotation_deg is None:
      return affine.test_set(images), labels
    ranges = affine.Ranges(**dict(vars(affine.AFFNIST), rotation_deg=max_rotation_deg))
    return affine.make(images, ranges)[0], labels


class DigitPairs(_Task):
  """MultiMNIST: two overlapping MNIST digits an image (Section 6), each
  shifted by up to `pair_shift` pixels."""
  heads = "two_digits"
  name = "multimnist"
  files = "mnist"
  pictures = "figure5"       # eval.py: the paper's Figure 5
  progress = "pairs"         # the study's x axis: training pairs seen
  has_affine = False

  @property
  def image_size(self):
    return _module("multimnist").CANVAS

  def score(self, lengths, predictions, labels):
    """The paper's metric (`multimnist.top2_scores`): accuracy and
    error_percent of exact pairs, at_least_one; no per-class figures."""
    del predictions
    exact, one = _module("multimnist").top2_scores(lengths, labels)
    return {"accuracy": exact, "error_percent": 100.0 * (1.0 - exact),
            "at_least_one": one}

  def __init__(self, pair_shift=None):
    self.pair_shift = pair_shift   # None: multimnist.PAIR_SHIFT

  def _shift(self):
    return _module("multimnist").PAIR_SHIFT if self.pair_shift is None else self.pair_shift

  def load(self, data_dir, val_size, download):
    """dict split -> "train": (digits, labels), the others: (images, labels
    [n, 2], targets [n, 2, h, w, 1])."""
    mnist = _module("mnist").load("mnist", data_dir, val_size, download)
    return _module("multimnist").load(mnist, self._shift())

  def train_pipeline(self, image_shape, batch_size, shard):
    """Pairs drawn on the fly; one process only (config.py refuses a cluster:
    `config.check_cluster`)."""
    del image_shape, shard
    return _module("multimnist").train_pipeline(batch_size, self._shift())

  def eval_pipeline(self, image_shape, batch_size):
    return _module("multimnist").eval_pipeline(batch_size, size=image_shape[0])

  def epoch_feed(self, pipe, train, order):
    """The digits once; the pipeline pairs the `order`'s first digits."""
    digits, labels = train
    return {pipe.images: digits, pipe.labels: labels, pipe.order: order}

  def fixed_batch(self, splits):
    """The first 32 validation pairs (fixed, unlike the training pairs):
    (images, labels [32, 2], targets [32, 2, h, w, 1])."""
    return tuple(a[:32] for a in splits["validation"])

  def affine_split(self, splits, max_rotation_deg=None):
    raise ValueError("--split=affine: the affine test set holds one digit an image; "
                     "--dataset=multimnist has two")


DEFAULT = "mnist"   # the data set of a run that does not name one
VAL_SIZE = 5000     # validation images held out from the end of the training file

TASKS = {"mnist": lambda _: Digits("mnist"),
         "fashion_mnist": lambda _: Digits("fashion_mnist"),
         "multimnist": DigitPairs}


def get(name, pair_shift=None):
  """The task of --dataset=`name` (`pair_shift`: MultiMNIST's largest shift
  of a digit; None: the paper's 4). Raises: ValueError for an unknown name."""
  if name not in TASKS:
    raise ValueError(f"--dataset={name}: expected one of {sorted(TASKS)}")
  return TASKS[name](pair_shift)
