"""A task per data set, chosen once from --dataset: its splits, its training
and evaluation pipelines (one `mnist.Pipeline` type), the feed of an epoch,
the fixed batch of the gradient diagnostic and whether an image holds one
digit or two. The programs ask the task; no other module compares data set
names (but config.py, which maps the flags to a task) or guesses from a
label's rank.

- `Digits`: MNIST and Fashion-MNIST, one label an image; training images are
  fed in the epoch's order and shifted by up to 2 pixels.
- `DigitPairs`: MultiMNIST (Section 6), made from the MNIST files; two
  labels an image; training pairs are drawn on the fly from the digits,
  validation and test are fixed pairs with their two reconstruction targets.

The data modules (and TensorFlow with them) are imported when a task first
reads or pipes data, so that `two_digits` answers without them (the study).
"""
import importlib


def _module(name):
  return importlib.import_module(f"capsnet.data.{name}")


class Digits:
  """A data set of one digit (or garment) an image: MNIST, Fashion-MNIST."""
  two_digits = False

  def __init__(self, name):
    self.name = name
    self.files = name          # data/<files>/ holds its four .gz files

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
    """The gradient diagnostic's batch: the first 32 training images."""
    return tuple(a[:32] for a in splits["train"])

  def affine_split(self, splits, max_rotation_deg=None):
    """(images, labels) of the affine test set (`affine`), made from the test
    split; `max_rotation_deg`: another largest rotation, the other ranges
    affNIST's (the severity sweep; not md5-checked). MNIST only.

    Raises: ValueError for another data set.
    """
    if self.name != "mnist":
      raise ValueError(f"--split=affine: the affine test set is made from MNIST's test "
                       f"images, not from --dataset={self.name}'s")
    affine = _module("affine")
    images, labels = splits["test"]
    if max_rotation_deg is None:
      return affine.test_set(images), labels
    ranges = affine.Ranges(**dict(vars(affine.AFFNIST), rotation_deg=max_rotation_deg))
    return affine.make(images, ranges)[0], labels


class DigitPairs:
  """MultiMNIST: two overlapping MNIST digits an image (Section 6), each
  shifted by up to `pair_shift` pixels."""
  two_digits = True
  name = "multimnist"
  files = "mnist"

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
    del image_shape
    if shard != (0, 1):
      raise ValueError("--dataset=multimnist does not run on a cluster yet")
    return _module("multimnist").train_pipeline(batch_size, self._shift())

  def eval_pipeline(self, image_shape, batch_size):
    return _module("multimnist").eval_pipeline(batch_size, size=image_shape[0])

  def epoch_feed(self, pipe, train, order):
    """The digits once; the pipeline pairs the `order`'s first digits."""
    digits, labels = train
    return {pipe.images: digits, pipe.labels: labels, pipe.order: order}

  def fixed_batch(self, splits):
    """The first 32 validation pairs (fixed, unlike the training pairs)."""
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
