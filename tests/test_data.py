"""IDX reading, verification, download and the tf.data pipeline.

Synthetic IDX files are written to tmp_path; the real-data test reads data/.
"""
import functools
import gzip
import hashlib
import http.server
import os
import struct
import threading

import numpy as np
import pytest
import tensorflow as tf

from capsnet.data import mnist
from capsnet.data import tasks
from conftest import ROOT
from conftest import needs_mnist


def write_idx(path, array, magic=None):
  array = np.asarray(array, np.uint8)
  magic = magic if magic is not None else 0x0800 | array.ndim
  header = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
  with gzip.open(path, "wb") as f:
    f.write(header + array.tobytes())
  return path


def tiny_dataset(folder, n_train=12, n_test=5):
  """Four IDX files in `folder` and a DATASETS-style spec for them."""
  rng = np.random.RandomState(0)
  arrays = {"train_images": rng.randint(0, 256, (n_train, 4, 4)),
            "train_labels": rng.randint(0, 10, n_train),
            "test_images": rng.randint(0, 256, (n_test, 4, 4)),
            "test_labels": rng.randint(0, 10, n_test)}
  files = {}
  for key, arr in arrays.items():
    path = write_idx(os.path.join(folder, f"{key}.gz"), arr)
    with open(path, "rb") as f:
      blob = f.read()
    files[key] = (f"{key}.gz", hashlib.md5(blob).hexdigest(), len(blob))
  return arrays, {"files": files, "mirrors": []}


@pytest.fixture
def tiny(tmp_path, monkeypatch):
  arrays, spec = tiny_dataset(str(tmp_path))
  monkeypatch.setitem(mnist.DATASETS, "tiny", spec)
  return tmp_path, arrays, spec


def test_round_trip_and_splits(tiny):
  folder, arrays, _ = tiny
  splits = mnist.load("tiny", str(folder), val_size=3)
  np.testing.assert_array_equal(splits["train"][0][..., 0], arrays["train_images"][:9])
  np.testing.assert_array_equal(splits["validation"][1], arrays["train_labels"][9:])
  np.testing.assert_array_equal(splits["test"][0][..., 0], arrays["test_images"])
  assert splits["train"][0].shape == (9, 4, 4, 1) and splits["train"][0].dtype == np.uint8
  assert splits["validation"][0].shape == (3, 4, 4, 1)
  assert mnist.load("tiny", str(folder), val_size=0)["validation"][0].shape == (0, 4, 4, 1)
  with pytest.raises(mnist.DataError, match="val_size=12: expected 0 <= val_size < 12"):
    mnist.load("tiny", str(folder), val_size=12)


def test_md5_checked_at_every_start_and_nothing_written(tiny, monkeypatch):
  folder, _, spec = tiny
  calls = []
  real = mnist.md5_of
  monkeypatch.setattr(mnist, "md5_of", lambda p: calls.append(p) or real(p))
  before = sorted(os.listdir(folder)), os.stat(folder).st_mtime_ns
  mnist.ensure_files("tiny", str(folder))
  mnist.ensure_files("tiny", str(folder))
  assert len(calls) == 8
  # Nothing written beside the files: a read-only folder of them works.
  assert (sorted(os.listdir(folder)), os.stat(folder).st_mtime_ns) == before
  # A same-size file with the old mtime (cp -p, rsync -a, tar) is caught.
  path = folder / "train_labels.gz"
  stat = os.stat(path)
  blob = bytearray(path.read_bytes())
  blob[-9] ^= 0xFF
  path.write_bytes(bytes(blob))
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  with pytest.raises(mnist.DataError, match=r"train_labels\.gz: md5 [0-9a-f]{32}, "
                     "expected " + spec["files"]["train_labels"][1]):
    mnist.ensure_files("tiny", str(folder))


def test_data_dir_that_is_a_file(tmp_path):
  path = tmp_path / "file"
  path.write_text("x")
  with pytest.raises(mnist.DataError, match=f"{path}: is a file, expected the folder "
                     "of the mnist files"):
    mnist.ensure_files("mnist", str(path), download_missing=False)


@pytest.mark.parametrize("bad,message", [
    ("label", r"train_labels\.gz: label 42 at index 5, expected labels in \[0, 10\)"),
    ("shape", r"test_images\.gz: images of 5x4, expected 4x4"),
])
def test_labels_out_of_range_and_wrong_image_size(tmp_path, monkeypatch, bad, message):
  arrays, spec = tiny_dataset(str(tmp_path))
  if bad == "label":
    labels = arrays["train_labels"].copy()
    labels[5] = 42
    write_idx(str(tmp_path / "train_labels.gz"), labels, mnist.LABEL_MAGIC)
  else:
    write_idx(str(tmp_path / "test_images.gz"), np.zeros((5, 5, 4)), mnist.IMAGE_MAGIC)
  spec = dict(spec, image_shape=(4, 4), num_classes=10, files={
      key: (name, mnist.md5_of(str(tmp_path / name)), os.path.getsize(tmp_path / name))
      for key, (name, _, _) in spec["files"].items()})
  monkeypatch.setitem(mnist.DATASETS, "tiny", spec)
  with pytest.raises(mnist.DataError, match=message):
    mnist.load("tiny", str(tmp_path), val_size=3)


def test_bad_magic(tmp_path):
  path = write_idx(str(tmp_path / "x.gz"), np.zeros((2, 3, 3)), magic=2049 + 7)
  with pytest.raises(mnist.DataError, match=r"x\.gz: IDX magic number 2056, expected 2051"):
    mnist.read_idx(path, mnist.IMAGE_MAGIC)


def test_header_size_mismatch(tmp_path):
  path = str(tmp_path / "x.gz")
  with gzip.open(path, "wb") as f:
    f.write(struct.pack(">IIII", 2051, 3, 2, 2) + bytes(11))
  with pytest.raises(mnist.DataError,
                     match=r"x\.gz: header says 3x2x2 = 12 bytes of data, file has 11"):
    mnist.read_idx(path, mnist.IMAGE_MAGIC)


def test_truncated_gzip(tmp_path):
  good = write_idx(str(tmp_path / "good.gz"), np.zeros((50, 8, 8)))
  with open(good, "rb") as f:
    blob = f.read()
  bad = tmp_path / "cut.gz"
  bad.write_bytes(blob[: len(blob) // 2])
  with pytest.raises(mnist.DataError, match=r"cut\.gz: not a readable gzip file"):
    mnist.read_idx(str(bad), mnist.IMAGE_MAGIC)


def test_md5_mismatch_and_wrong_size(tiny):
  folder, _, spec = tiny
  path = folder / "test_labels.gz"
  blob = bytearray(path.read_bytes())
  blob[-9] ^= 0xFF                      # same size, other bytes
  path.write_bytes(bytes(blob))
  with pytest.raises(mnist.DataError, match=r"test_labels\.gz: md5 [0-9a-f]{32}, expected "
                     + spec["files"]["test_labels"][1]):
    mnist.ensure_files("tiny", str(folder))
  path.write_bytes(bytes(blob[:-1]))
  with pytest.raises(mnist.DataError, match=r"test_labels\.gz: \d+ bytes, expected \d+"):
    mnist.ensure_files("tiny", str(folder))


class _Server:
  """HTTP server on 127.0.0.1 serving `routes` {path: bytes}; others 404."""

  def __init__(self, routes):
    handler = functools.partial(self._Handler, routes)
    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    self.url = f"http://127.0.0.1:{self.httpd.server_port}"
    threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

  class _Handler(http.server.BaseHTTPRequestHandler):
    def __init__(self, routes, *args, **kwargs):
      self.routes = routes
      super().__init__(*args, **kwargs)

    def do_GET(self):
      body = self.routes.get(self.path)
      self.send_response(200 if body is not None else 404)
      self.end_headers()
      if body is not None:
        self.wfile.write(body)

    def log_message(self, *args):
      pass


@pytest.fixture
def remote(tmp_path, monkeypatch):
  """A tiny data set published only on a local server; empty local folder."""
  src = tmp_path / "src"
  src.mkdir()
  arrays, spec = tiny_dataset(str(src))
  monkeypatch.setitem(mnist.DATASETS, "tiny", spec)
  files = {name: (src / name).read_bytes() for name, _, _ in spec["files"].values()}
  dest = tmp_path / "cache"
  return files, arrays, dest


def test_download_second_mirror(remote):
  files, arrays, dest = remote
  server = _Server({f"/good/{n}": b for n, b in files.items()})
  try:
    paths = mnist.ensure_files("tiny", str(dest),
                              mirrors=[server.url + "/missing/", server.url + "/good/"])
  finally:
    server.httpd.shutdown()
  np.testing.assert_array_equal(mnist.read_idx(paths["test_labels"], mnist.LABEL_MAGIC),
                                arrays["test_labels"])
  assert sorted(os.listdir(dest)) == sorted(files)


def test_corrupt_download_leaves_nothing(remote):
  files, _, dest = remote
  server = _Server({f"/bad/{n}": b[:-1] + b"x" for n, b in files.items()})
  try:
    with pytest.raises(mnist.DataError, match=r"missing .*train_images\.gz.* in .*cache: "
                       r"download failed .*md5 [0-9a-f]+, expected"):
      mnist.ensure_files("tiny", str(dest), mirrors=[server.url + "/bad/"])
  finally:
    server.httpd.shutdown()
  assert os.listdir(dest) == []


def test_download_off_names_missing_files(remote):
  _, _, dest = remote
  with pytest.raises(mnist.DataError, match=r"missing train_images\.gz, train_labels\.gz, "
                     r"test_images\.gz, test_labels\.gz in .*cache: downloads are off"
                     r".*--data_dir"):
    mnist.ensure_files("tiny", str(dest), download_missing=False)


def _run_dataset(ds):
  it = tf.compat.v1.data.make_one_shot_iterator(ds).get_next()
  out = []
  with tf.compat.v1.Session() as sess:
    while True:
      try:
        out.append(sess.run(it))
      except tf.errors.OutOfRangeError:
        return out


def test_augmentation_is_an_exact_shift_of_at_most_two_pixels():
  rng = np.random.RandomState(0)
  images = rng.randint(1, 256, (40, 10, 10, 1)).astype(np.uint8)  # no zeros
  labels = rng.randint(0, 10, 40).astype(np.int32)
  with tf.Graph().as_default():
    batches = _run_dataset(mnist.make_dataset(images, labels, 16, augment=True, seed=3))
  x = np.concatenate([b[0] for b in batches])
  y = np.concatenate([b[1] for b in batches])
  np.testing.assert_array_equal(y, labels)
  seen = set()
  for src, aug in zip(images[..., 0] / 255.0, x[..., 0], strict=True):
    matches = []
    for dy in range(-2, 3):
      for dx in range(-2, 3):
        shifted = np.zeros_like(src)
        ys, xs = slice(max(dy, 0), 10 + min(dy, 0)), slice(max(dx, 0), 10 + min(dx, 0))
        yt, xt = slice(max(-dy, 0), 10 + min(-dy, 0)), slice(max(-dx, 0), 10 + min(-dx, 0))
        shifted[ys, xs] = src[yt, xt]
        if np.array_equal(shifted.astype(np.float32), aug):
          matches.append((dy, dx))
    assert len(matches) == 1
    seen.add(matches[0])
  assert len(seen) > 10         # many different shifts occur


def test_augmentation_reproducible_with_seed():
  images = np.random.RandomState(0).randint(0, 256, (20, 8, 8, 1)).astype(np.uint8)
  labels = np.arange(20, dtype=np.int32)
  runs = []
  for seed in (5, 5, 6):
    with tf.Graph().as_default():
      batches = _run_dataset(mnist.make_dataset(images, labels, 8, augment=True, seed=seed))
    runs.append(np.concatenate([b[0] for b in batches]))
  np.testing.assert_array_equal(runs[0], runs[1])
  assert not np.array_equal(runs[0], runs[2])


def test_epoch_order_is_a_seeded_permutation():
  a, b, c = mnist.epoch_order(100, 1, 0), mnist.epoch_order(100, 1, 0), mnist.epoch_order(100, 1, 1)
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(np.sort(a), np.arange(100))
  assert not np.array_equal(a, c)


@pytest.mark.parametrize("n,batch", [(23, 5), (10, 10), (7, 16)])
def test_eval_pipeline_yields_every_example_once(n, batch):
  images = np.zeros((n, 4, 4, 1), np.uint8)
  labels = np.arange(n, dtype=np.int32)
  with tf.Graph().as_default():
    batches = _run_dataset(mnist.make_dataset(images, labels, batch))
  assert [len(b[1]) for b in batches] == [batch] * (n // batch) + ([n % batch] if n % batch else [])
  np.testing.assert_array_equal(np.concatenate([b[1] for b in batches]), labels)


MNIST_DIR = os.path.join(ROOT, "data", "mnist")


@needs_mnist   # (skips without the files, fails in CI)
def test_real_mnist_md5_and_label_histograms():
  for name, md5, size in mnist.DATASETS["mnist"]["files"].values():
    path = os.path.join(MNIST_DIR, name)
    assert os.path.getsize(path) == size
    assert mnist.md5_of(path) == md5
  splits = mnist.load("mnist", MNIST_DIR, val_size=0, download_missing=False)
  assert splits["train"][0].shape == (60000, 28, 28, 1)
  assert np.bincount(splits["train"][1]).tolist() == [
      5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
  assert np.bincount(splits["test"][1]).tolist() == [
      980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
  default = tasks.get(tasks.DEFAULT).load(MNIST_DIR, tasks.VAL_SIZE, download=False)
  assert [len(default[s][1]) for s in ("train", "validation", "test")] == [55000, 5000, 10000]


def test_shards_of_a_batch_shift_as_the_whole_batch_does():
  """Two workers' halves of each batch of 8 (from shard_order) get exactly
  the images and shifts that one pipeline with batches of 8 gives."""
  rng = np.random.RandomState(0)
  images = rng.randint(0, 256, (20, 6, 6, 1)).astype(np.uint8)
  labels = np.arange(20) % 10
  order = mnist.epoch_order(20, 1, 0)
  def batches(order, batch, shard):
    ds = mnist.make_dataset(images[order], labels[order], batch, augment=True, seed=5,
                           drop_remainder=True, shard=shard)
    return _run_dataset(ds)
  whole = batches(order, 8, (0, 1))
  halves = [batches(mnist.shard_order(order, 4, w, 2), 4, (w, 2)) for w in range(2)]
  assert len(whole) == len(halves[0]) == len(halves[1]) == 2   # 16 of 20 used
  for k in range(2):
    np.testing.assert_array_equal(np.concatenate([halves[0][k][0], halves[1][k][0]]),
                                  whole[k][0])
    np.testing.assert_array_equal(np.concatenate([halves[0][k][1], halves[1][k][1]]),
                                  whole[k][1])
  np.testing.assert_array_equal(mnist.shard_order(order, 4, 1, 2),
                                order[[4, 5, 6, 7, 12, 13, 14, 15]])
