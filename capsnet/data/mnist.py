"""MNIST / Fashion-MNIST: verified IDX files, download with md5, tf.data
pipeline.

Files live in `data/<dataset>/` (git-ignored), checked by size, md5 and contents
at every start, so a folder of correct files may be read-only. Missing files are
fetched from the mirrors to a temporary file, renamed only once the md5 matches.
"""
import collections
import gzip
import hashlib
import os
import struct
import tempfile
import urllib.error
import urllib.request

import numpy as np
import tensorflow as tf

IMAGE_MAGIC = 2051   # 0x00000803: unsigned byte, 3 dimensions
LABEL_MAGIC = 2049   # 0x00000801: unsigned byte, 1 dimension
AUGMENT_SHIFT = 2    # the paper's augmentation: shifts of up to 2 pixels

# name -> its files: (file name, md5 of the .gz, size in bytes), as
# published; the image size and the number of classes; the mirrors.
DATASETS = {
    "mnist": {
        "image_shape": (28, 28),
        "num_classes": 10,
        "files": {
            "train_images": ("train-images-idx3-ubyte.gz",
                             "f68b3c2dcbeaaa9fbdd348bbdeb94873", 9912422),
            "train_labels": ("train-labels-idx1-ubyte.gz",
                             "d53e105ee54ea40749a09fcbcd1e9432", 28881),
            "test_images": ("t10k-images-idx3-ubyte.gz",
                            "9fb629c4189551a2d022fa330f9573f3", 1648877),
            "test_labels": ("t10k-labels-idx1-ubyte.gz",
                            "ec29112dd5afa0611ce80d1b7f02629c", 4542),
        },
        "mirrors": [
            "https://ossci-datasets.s3.amazonaws.com/mnist/",
            "https://storage.googleapis.com/cvdf-datasets/mnist/",
            "http://yann.lecun.com/exdb/mnist/",
        ],
    },
    "fashion_mnist": {
        "image_shape": (28, 28),
        "num_classes": 10,
        "files": {
            "train_images": ("train-images-idx3-ubyte.gz",
                             "8d4fb7e6c68d591d4c3dfef9ec88bf0d", 26421880),
            "train_labels": ("train-labels-idx1-ubyte.gz",
                             "25c81989df183df01b3e8a0aad5dffbe", 29515),
            "test_images": ("t10k-images-idx3-ubyte.gz",
                            "bef4ecab320f06d8554ea6380940ec79", 4422102),
            "test_labels": ("t10k-labels-idx1-ubyte.gz",
                            "bb300cfdad3c16e7a12a480ee83cd310", 5148),
        },
        "mirrors": [
            "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
            "https://storage.googleapis.com/tensorflow/tf-keras-datasets/",
            "https://github.com/zalandoresearch/fashion-mnist/raw/master/data/fashion/",
        ],
    },
}


class DataError(ValueError):
  """A data file is missing, corrupt or cannot be fetched."""


def read_idx(path, magic):
  """The uint8 array of a gzipped IDX file: `[n, rows, cols]` for IMAGE_MAGIC,
  `[n]` for LABEL_MAGIC. Raises DataError naming the file for an unreadable
  gzip, a wrong magic number or a size that does not fit the header."""
  try:
    with gzip.open(path, "rb") as f:
      raw = f.read()
  except (OSError, EOFError) as e:
    raise DataError(f"{path}: not a readable gzip file ({e})") from e
  if len(raw) < 8:
    raise DataError(f"{path}: {len(raw)} bytes, too short for an IDX header")
  got_magic, = struct.unpack(">I", raw[:4])
  if got_magic != magic:
    raise DataError(f"{path}: IDX magic number {got_magic}, expected {magic}")
  ndim = magic & 0xFF
  header = 4 + 4 * ndim
  if len(raw) < header:
    raise DataError(f"{path}: {len(raw)} bytes, too short for a {ndim}-d IDX header")
  dims = struct.unpack(f">{ndim}I", raw[4:header])
  expected = int(np.prod(dims))
  if len(raw) - header != expected:
    raise DataError(f"{path}: header says {'x'.join(map(str, dims))} = "
                    f"{expected} bytes of data, file has {len(raw) - header}")
  return np.frombuffer(raw, np.uint8, offset=header).reshape(dims)


def md5_of(path):
  h = hashlib.md5()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _check_present(path, md5, size):
  """Size, then md5. Raises DataError naming the file."""
  st = os.stat(path)
  if st.st_size != size:
    raise DataError(f"{path}: {st.st_size} bytes, expected {size}; the file is "
                    "corrupt or from another data set (delete it to fetch again)")
  got = md5_of(path)
  if got != md5:
    raise DataError(f"{path}: md5 {got}, expected {md5}; the file is corrupt "
                    "(delete it to fetch again)")


def download(url, path, md5, timeout=30.0):
  """Fetches `url` to `path` via a temporary file, kept only if the md5 matches.
  Raises DataError (nothing left behind) on failure."""
  folder = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".part",
                             dir=folder)
  try:
    h = hashlib.md5()
    with os.fdopen(fd, "wb") as out, \
        urllib.request.urlopen(url, timeout=timeout) as response:
      for chunk in iter(lambda: response.read(1 << 20), b""):
        h.update(chunk)
        out.write(chunk)
    if h.hexdigest() != md5:
      raise DataError(f"{url}: md5 {h.hexdigest()}, expected {md5}")
    os.replace(tmp, path)
  except (OSError, urllib.error.URLError) as e:   # HTTPError is a URLError
    raise DataError(f"{url}: {e}") from e
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def ensure_files(dataset, data_dir, download_missing=True, mirrors=None,
                 timeout=30.0):
  """{"train_images": path, ...}: the four files of `dataset` in `data_dir`,
  verified, missing ones fetched from `mirrors` (default: the data set's) where
  `download_missing`. Raises DataError for an unknown data set, a corrupt file,
  or files missing (the message says how to supply them)."""
  if dataset not in DATASETS:
    raise DataError(f"unknown dataset {dataset!r}, expected one of {sorted(DATASETS)}")
  spec = DATASETS[dataset]
  mirrors = spec["mirrors"] if mirrors is None else mirrors
  if os.path.exists(data_dir) and not os.path.isdir(data_dir):
    raise DataError(f"{data_dir}: is a file, expected the folder of the "
                    f"{dataset} files (--data_dir)")
  paths, missing = {}, []
  for key, (name, md5, size) in spec["files"].items():
    path = paths[key] = os.path.join(data_dir, name)
    if os.path.exists(path):
      _check_present(path, md5, size)
    else:
      missing.append((name, md5))
  failures = []
  if missing and download_missing:
    try:
      os.makedirs(data_dir, exist_ok=True)
    except OSError as e:
      raise DataError(f"{data_dir}: cannot create the folder for the downloads "
                      f"({e.strerror})") from None
    still = []
    for name, md5 in missing:
      path = os.path.join(data_dir, name)
      for base in mirrors:
        try:
          download(base + name, path, md5, timeout)
          break
        except DataError as e:
          failures.append(str(e))
      if not os.path.exists(path):   # download() checked the md5
        still.append((name, md5))
    missing = still
  if missing:
    names = ", ".join(n for n, _ in missing)
    why = (f"download failed ({'; '.join(failures[-3:])})" if download_missing
           else "downloads are off (--download=false)")
    raise DataError(
        f"missing {names} in {data_dir}: {why}. Copy the original {dataset} "
        f"files there, or pass --data_dir pointing at a folder that has them")
  return paths


def load(dataset, data_dir, val_size, download_missing=True, mirrors=None):
  """{split: (images `[n, rows, cols, 1]` uint8, labels `[n]` int32)}: train
  (the first 60000 - val_size), validation (the training file's last val_size),
  test. Raises DataError (`ensure_files`, `read_idx`, val_size)."""
  paths = ensure_files(dataset, data_dir, download_missing, mirrors)
  spec = DATASETS[dataset]
  arrays = {}
  for split in ("train", "test"):
    image_path, label_path = paths[f"{split}_images"], paths[f"{split}_labels"]
    images = read_idx(image_path, IMAGE_MAGIC)
    labels = read_idx(label_path, LABEL_MAGIC)
    if len(images) != len(labels):
      raise DataError(f"{image_path}: {len(images)} images but "
                      f"{label_path} has {len(labels)} labels")
    if "image_shape" in spec and images.shape[1:] != tuple(spec["image_shape"]):
      raise DataError(f"{image_path}: images of {images.shape[1]}x{images.shape[2]}, "
                      f"expected {spec['image_shape'][0]}x{spec['image_shape'][1]}")
    if "num_classes" in spec and len(labels) and labels.max() >= spec["num_classes"]:
      raise DataError(f"{label_path}: label {labels.max()} at index "
                      f"{int(labels.argmax())}, expected labels in "
                      f"[0, {spec['num_classes']})")
    arrays[split] = (images[..., None], labels.astype(np.int32))
  train_x, train_y = arrays["train"]
  if not 0 <= val_size < len(train_x):
    raise DataError(f"val_size={val_size}: expected 0 <= val_size < "
                    f"{len(train_x)} (the training file's size)")
  cut = len(train_x) - val_size
  return {"train": (train_x[:cut], train_y[:cut]),
          "validation": (train_x[cut:], train_y[cut:]),
          "test": arrays["test"]}


def pixels(images):
  """uint8 pixels as float32 in [0, 1]: the one place that scales them."""
  return tf.cast(images, tf.float32) / 255.0


def epoch_order(n, seed, epoch):
  """The training order of epoch `epoch`: a permutation fixed by (seed, epoch)."""
  return np.random.RandomState([seed, epoch]).permutation(n)


def shard_order(order, batch_size, index, count):
  """Worker `index` of `count`'s part of an epoch order: of each global batch
  of `count * batch_size` consecutive examples, its `batch_size`; the
  incomplete last global batch is dropped."""
  if count == 1:
    return order
  steps = len(order) // (batch_size * count)
  return order[:steps * batch_size * count].reshape(steps, count, batch_size)[:, index] \
      .reshape(-1)


def random_shift(images, seed, max_shift=AUGMENT_SHIFT, shard=(0, 1)):
  """`(images shifted by their own random (dy, dx) in [-max_shift, max_shift],
  zero-filled; shifts [batch, 2] int32)`, from the stateless `seed`. `shard`
  (index, count): the images are part `index` of a batch `count` times as large
  and get that part of its shifts."""
  rows, cols = images.shape[1], images.shape[2]
  index, count = shard
  batch = tf.shape(images)[0]
  shifts = tf.random.stateless_uniform([batch * count if count > 1 else batch, 2],
                                       seed, -max_shift, max_shift + 1, dtype=tf.int32)
  if count > 1:
    shifts = shifts[index * batch:(index + 1) * batch]
  pad = [[0, 0], [max_shift, max_shift], [max_shift, max_shift], [0, 0]]
  padded = tf.pad(images, pad)
  # Output pixel (y, x) takes padded pixel (y + max_shift - dy, x + max_shift - dx).
  row_idx = tf.range(rows)[None, :] + (max_shift - shifts[:, :1])
  col_idx = tf.range(cols)[None, :] + (max_shift - shifts[:, 1:])
  out = tf.gather(padded, row_idx, axis=1, batch_dims=1)
  out = tf.gather(out, col_idx, axis=2, batch_dims=1)
  return out, shifts


def make_dataset(images, labels, batch_size, augment=False, seed=0,
                 drop_remainder=False, prefetch=2, first_batch=0, shard=(0, 1)):
  """Batches of `(images float32 in [0, 1], labels int32)` over arrays (or
  tensors fed at initialisation) in the order given. With `augment` batch k is
  shifted with the stateless seed (seed, first_batch + k), so a run is
  reproducible and resumable mid-epoch; `shard` as for `random_shift`."""
  ds = tf.data.Dataset.from_tensor_slices((images, labels))
  ds = ds.batch(batch_size, drop_remainder=drop_remainder).enumerate()

  def prepare(k, batch):
    x, y = batch
    if augment:
      k = k + tf.cast(first_batch, tf.int64)
      x, _ = random_shift(x, tf.stack([tf.cast(seed, tf.int64), k]), shard=shard)
    return pixels(x), tf.cast(y, tf.int32)
  ds = ds.map(prepare, num_parallel_calls=2)
  return ds.prefetch(prefetch).with_options(dataset_options())


def dataset_options():
  """No autotuning: re-initialising an iterator idle for a while blocked for ~15
  s in TF 2.21; fixed pools do not."""
  options = tf.data.Options()
  options.autotune.enabled = False
  return options


Pipeline = collections.namedtuple("Pipeline", [   # every task's pipeline
    "images",       # uint8 placeholder [n, rows, cols, channels], fed at init
                    #   (MultiMNIST training: the digits to pair)
    "labels",       # int32 placeholder [n] ([n, 2]: MultiMNIST evaluation)
    "targets",      # uint8 placeholder [n, 2, rows, cols, 1]: MultiMNIST
                    #   evaluation's reconstruction targets; else None
    "order",        # int64 placeholder [n]: MultiMNIST training's first
                    #   digits, in the epoch's order; else None
    "seed",         # int64 placeholder: the epoch's augmentation (or pair)
                    #   seed; None without augmentation
    "first_batch",  # int64 placeholder: index of the first batch (None without)
    "iterator",     # run iterator.initializer with the placeholders fed
    "batch",        # (images [batch, ...] float32 in [0, 1], labels, targets
                    #   float32 in [0, 1] or None)
])


def fed_pipeline(image_shape, batch_size, augment=False, drop_remainder=False,
                 name="input", shard=(0, 1)):
  """A `Pipeline` on the CPU: placeholders for one split's arrays, fed when
  `iterator.initializer` runs (so one graph serves every split and epoch order),
  and the batches over them (`make_dataset`; `augment` adds the `seed` and
  `first_batch` placeholders)."""
  with tf.device("/cpu:0"), tf.name_scope(name):
    images = tf.compat.v1.placeholder(tf.uint8, [None, *image_shape], name="images")
    labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
    seed = first_batch = None
    if augment:
      seed = tf.compat.v1.placeholder(tf.int64, [], name="seed")
      first_batch = tf.compat.v1.placeholder(tf.int64, [], name="first_batch")
    ds = make_dataset(images, labels, batch_size, augment=augment,
                      seed=0 if seed is None else seed, drop_remainder=drop_remainder,
                      first_batch=0 if first_batch is None else first_batch,
                      shard=shard)
    iterator = tf.compat.v1.data.make_initializable_iterator(ds)
    batch_images, batch_labels = iterator.get_next()
  return Pipeline(images, labels, None, None, seed, first_batch, iterator,
                  (batch_images, batch_labels, None))
