"""Using a trained model: your own images, the routing picture, the
SavedModel. One small trained run is shared; the own-image accuracy test
uses the shipped weights (pretrained/)."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from capsnet.data import mnist
from capsnet.running import evaluation
from capsnet.running import runs
from capsnet.using import pictures
from capsnet.using import serving
from conftest import MNIST
from conftest import ROOT
from conftest import TWO_TOWERS
from conftest import eval_here
from conftest import last_line
from conftest import needs_mnist

PRETRAINED = os.path.join(ROOT, "pretrained", "r3_recon")
needs_pretrained = pytest.mark.skipif(
    not os.path.exists(os.path.join(PRETRAINED, "config.json")),
    reason=f"no shipped weights in {PRETRAINED}")


@pytest.fixture(scope="module")
def small_run(trained_once):
  """One epoch of 50 steps on 1,600 images (about 80% validation accuracy),
  trained once for the session (`TWO_TOWERS`)."""
  return trained_once(*TWO_TOWERS)


@pytest.fixture(scope="module")
def mnist_test_split():
  return mnist.load("mnist", MNIST, 5000, download_missing=False)["test"]


def write_as_photos(digits, folder, seed=0):
  """MNIST digits as a person might photograph them: dark on light, 3x
  larger, off centre on a wider canvas. Returns the paths."""
  rng = np.random.RandomState(seed)
  paths = []
  for k, digit in enumerate(digits):
    canvas = np.full([124, 134], 255, np.uint8)
    top, left = rng.randint(0, 40), rng.randint(0, 50)
    canvas[top:top + 84, left:left + 84] = 255 - np.kron(digit[..., 0], np.ones([3, 3]))
    path = os.path.join(folder, f"digit{k:03d}.png")
    with open(path, "wb") as f:
      f.write(pictures.encode_png(canvas[..., None]))
    paths.append(path)
  return paths


def test_preprocess_makes_an_mnist_digit(tmp_path):
  """A light-on-dark RGB bar, any size: grey, white on black, in the 20x20
  box (keeping its aspect ratio), centre of mass at the field's centre."""
  image = np.zeros([60, 90, 3], np.uint8)
  image[10:50, 20:30] = (250, 240, 230)         # a 40x10 bar, off centre
  path = str(tmp_path / "bar.png")
  with open(path, "wb") as f:
    f.write(pictures.encode_png(image))
  digit = pictures.preprocess(path)[..., 0].astype(float)
  assert digit.shape == (28, 28)
  rows, cols = np.nonzero(digit > 0)
  assert rows.max() - rows.min() + 1 == 20 and cols.max() - cols.min() + 1 == 5
  com = [(digit.sum(1) * np.arange(28)).sum() / digit.sum(),
         (digit.sum(0) * np.arange(28)).sum() / digit.sum()]
  np.testing.assert_allclose(com, [13.5, 13.5], atol=0.5)
  inverted = 255 - image
  with open(path, "wb") as f:
    f.write(pictures.encode_png(inverted))
  np.testing.assert_array_equal(pictures.preprocess(path)[..., 0], digit)
  (tmp_path / "blank.png").write_bytes(pictures.encode_png(np.full([9, 9, 1], 200, np.uint8)))
  with pytest.raises(pictures.ImageError, match="blank.png: no ink found"):
    pictures.preprocess(str(tmp_path / "blank.png"))


@needs_mnist
@needs_pretrained
def test_photographed_test_digits_classified_as_the_originals(tmp_path, mnist_test_split):
  images, _ = mnist_test_split
  paths = write_as_photos(images[:100], str(tmp_path))
  ckpt, run = runs.resolve(PRETRAINED, "best")
  cfg = runs.RunFolder(run).load_config()[0]
  original = serving.classify(cfg, ckpt, images[:100])["classes"]
  photos = serving.classify(cfg, ckpt, np.stack([pictures.preprocess(p) for p in paths]))
  assert (photos["classes"] == original).sum() >= 98


@needs_mnist
def test_images_cli_prints_writes_and_reports_bad_files(small_run, mnist_test_split, tmp_path):
  images, _ = mnist_test_split
  paths = write_as_photos(images[:3], str(tmp_path))
  bad = tmp_path / "broken.png"
  bad.write_bytes(b"not an image")
  out = tmp_path / "out"
  proc = eval_here(f"--checkpoint={small_run}", "--images", paths[0], str(bad),
                   *paths[1:], f"--out_dir={out}", "--json")
  assert proc.returncode == 1                      # one file failed...
  assert last_line(proc) == (f"eval.py: error: {bad}: cannot read or decode the image "
                             "(Unknown image file format. One of JPEG, JPEG XL, PNG, "
                             "GIF, BMP, WebP required.)")
  report = json.loads(proc.stdout)                  # ...the others were classified
  assert [r["file"] for r in report] == paths
  ckpt, run = runs.resolve(small_run, "best")
  cfg = runs.RunFolder(run).load_config()[0]
  expected = serving.classify(cfg, ckpt, np.stack([pictures.preprocess(p) for p in paths]))
  assert [r["class"] for r in report] == expected["classes"].tolist()
  np.testing.assert_allclose([r["lengths"] for r in report], expected["lengths"], atol=1e-6)
  for r in report:
    for png in r["pictures"]:
      with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        picture = sess.run(tf.io.decode_png(open(png, "rb").read()))
      assert picture.shape[2] == 3 and picture.shape[0] in (112, 28 * 6 + 16)
  proc = eval_here(f"--checkpoint={small_run}", "--images", paths[0],
                   f"--out_dir={out}")
  assert proc.returncode == 0
  assert proc.stdout.startswith(f"{paths[0]}: {report[0]['class']}  lengths ")


@needs_mnist
def test_routing_picture_draws_the_models_coefficients(small_run, mnist_test_split):
  images, labels = mnist_test_split
  ckpt, run = runs.resolve(small_run, "best")
  cfg = runs.RunFolder(run).load_config()[0]
  drawn = serving.classify(cfg, ckpt, images[:2])            # what eval.py draws
  with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
    ev = evaluation.build(cfg, 2)
    tf.compat.v1.train.Saver().restore(sess, ckpt)
    sess.run(ev.iterator.initializer, {ev.images: images[:2], ev.labels: labels[:2]})
    graph_c, preds = sess.run([ev.outputs.couplings, ev.outputs.predictions])
  np.testing.assert_array_equal(drawn["classes"], preds)
  for k in range(2):
    cs = drawn["couplings"][k]                                 # [r, in_caps, classes]
    assert cs.shape == (cfg.iter_routing, cfg.in_caps, cfg.num_classes)
    np.testing.assert_allclose(cs.sum(axis=2), 1.0, atol=1e-5)
    for r in range(cfg.iter_routing):
      np.testing.assert_allclose(cs[r], graph_c[r][k], atol=1e-6)
    grids = pictures.routing_grids(cs, preds[k], cfg.primary_size, cfg.primary_types)
    expected = graph_c[-1][k][:, preds[k]].reshape(6, 6, cfg.primary_types).mean(axis=2)
    np.testing.assert_allclose(grids[-1], expected, atol=1e-6)
    entropy = -(cs.astype(np.float64) * np.log(cs.astype(np.float64))).sum(axis=2).mean(
        axis=1)   # [r]: the mean over input capsules of the entropy of c_i
    np.testing.assert_allclose(drawn["routing_entropy"][k], entropy, rtol=1e-12)
    figure = pictures.routing_figure(images[k, ..., 0], grids, list(entropy))
    assert figure.shape == (28 * 6 + 16, 3 * 28 * 6 + 2 * 8, 3)


@needs_mnist
def test_an_interrupted_export_leaves_no_folder_and_the_next_one_cleans_up(
    small_run, tmp_path, monkeypatch):
  """A SavedModel is written beside its destination and renamed into place
  whole: an export that fails while writing leaves nothing at the
  destination, and the next export removes its half-written folder."""
  ckpt, run = runs.resolve(small_run, "best")
  cfg = runs.RunFolder(run).load_config()[0]
  folder = str(tmp_path / "savedmodel")
  real_save = tf.compat.v1.saved_model.Builder.save
  def save_then_die(builder, *args, **kwargs):
    real_save(builder, *args, **kwargs)
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(tf.compat.v1.saved_model.Builder, "save", save_then_die)
  with pytest.raises(OSError):
    serving.export(cfg, ckpt, folder)
  assert not os.path.exists(folder) and os.path.isdir(folder + ".partial")
  monkeypatch.setattr(tf.compat.v1.saved_model.Builder, "save", real_save)
  said = []
  serving.export(cfg, ckpt, folder, log=said.append)
  assert said == [f"{folder}.partial: removed, a half-written export (one that was "
                  "stopped)"]
  assert not os.path.exists(folder + ".partial")
  assert os.path.exists(os.path.join(folder, "saved_model.pb"))


@needs_mnist
def test_conv_impl_auto_plans_for_own_images_too(small_run, mnist_test_split, tmp_path):
  """--conv_impl=auto means the forward pass planned on this host in every
  mode: with --images as when scoring a split (the same classes)."""
  images, _ = mnist_test_split
  paths = write_as_photos(images[:2], str(tmp_path))
  plain = eval_here(f"--checkpoint={small_run}", "--images", *paths,
                    f"--out_dir={tmp_path / 'a'}", "--json")
  planned = eval_here(f"--checkpoint={small_run}", "--images", *paths, "--conv_impl=auto",
                      f"--out_dir={tmp_path / 'b'}", "--json")
  assert plain.returncode == planned.returncode == 0, planned.stderr[-2000:]
  assert "planner: fp32 inference, conv1: " in planned.stderr
  assert "planner:" not in plain.stderr
  assert ([r["class"] for r in json.loads(planned.stdout)]
          == [r["class"] for r in json.loads(plain.stdout)])


@pytest.mark.integration
@needs_mnist
def test_savedmodel_loads_without_project_code(small_run, mnist_test_split, tmp_path):
  images, _ = mnist_test_split
  folder = str(tmp_path / "savedmodel")
  proc = eval_here(f"--checkpoint={small_run}", f"--export_savedmodel={folder}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  with pytest.raises(runs.RunError, match=re.escape(
      f"--export_savedmodel={folder}: exists; give a new folder")):
    serving.export(None, None, folder)
  np.save(tmp_path / "images.npy", images[:100])
  script = f"""
import sys
import numpy as np
import tensorflow as tf
assert not any(m.startswith("capsnet") for m in sys.modules)
assert {ROOT!r} not in sys.path
f = tf.saved_model.load({folder!r}).signatures["serving_default"]
out = f(images=tf.constant(np.load({str(tmp_path / 'images.npy')!r})))
np.savez({str(tmp_path / 'out.npz')!r}, **{{k: v.numpy() for k, v in out.items()}})
print(f.structured_input_signature)
"""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  done = subprocess.run([sys.executable, "-I", "-c", script], cwd=str(tmp_path), env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  out = np.load(tmp_path / "out.npz")
  assert out["reconstructions"].shape == (100, 784)
  # The classes and lengths eval.py gives (its --images mode runs this).
  ckpt, run = runs.resolve(small_run, "best")
  expected = serving.classify(runs.RunFolder(run).load_config()[0], ckpt, images[:100])
  np.testing.assert_array_equal(out["classes"], expected["classes"])
  np.testing.assert_allclose(out["lengths"], expected["lengths"], atol=1e-5)
  # serving_default takes uint8 images by name, any batch size
  assert done.stdout.strip() == ("((), {'images': TensorSpec(shape=(None, 28, 28, 1), "
                                 "dtype=tf.uint8, name='images')})")


@needs_mnist
def test_shipped_weights_are_the_model_variables_only(small_run, mnist_test_split, tmp_path):
  from capsnet import pretrained
  out = str(tmp_path / "shipped")
  prefix = pretrained.ship(small_run, out)
  ckpt, run = runs.resolve(small_run, "best")
  assert prefix == os.path.join(out, "best", os.path.basename(ckpt))
  shipped = dict(tf.train.list_variables(prefix))
  model_vars = {n: s for n, s in tf.train.list_variables(ckpt)
                if n.startswith("capsnet/") and "Adam" not in n}
  assert shipped == model_vars                      # no slots, no run state
  saved = json.load(open(os.path.join(out, "config.json")))
  assert saved["shipped_from"]["step"] == int(ckpt.rsplit("-", 1)[1])
  images = mnist_test_split[0][:50]
  cfg = runs.RunFolder(run).load_config()[0]
  np.testing.assert_array_equal(
      serving.classify(runs.RunFolder(out).load_config()[0], *runs.resolve(out, "best")[:1],
                       images)["classes"],
      serving.classify(cfg, ckpt, images)["classes"])
  with pytest.raises(runs.RunError, match=f"--out={out}: exists; give a new folder"):
    pretrained.ship(small_run, out)
