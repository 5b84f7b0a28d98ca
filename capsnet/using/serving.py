"""The trained model as a function of uint8 images: eval.py's own-image mode,
and a SavedModel that loads without this project's code.

    python eval.py --checkpoint pretrained/r3_recon --export_savedmodel /tmp/capsnet
    saved_model_cli show --all --dir /tmp/capsnet

`serving_default` takes `images`, uint8 `[N, H, W, C]` (white ink on black), and
returns `classes` `[N]`, `lengths` `[N, num_classes]` and, with the decoder,
`reconstructions` `[N, H*W*C]` in [0, 1].
"""
import os
import shutil

import tensorflow as tf

from capsnet.data import mnist
from capsnet.model import network
from capsnet.running import evaluation
from capsnet.running import runs


def _graph(cfg):
  """In the default graph: the images placeholder and the named outputs."""
  shape = [None, cfg.image_size, cfg.image_size, cfg.image_channels]
  images = tf.compat.v1.placeholder(tf.uint8, shape, name="images")
  x = mnist.pixels(images)
  out = network.forward(x, tf.zeros(tf.shape(images)[:1], tf.int32), cfg, training=False)
  outputs = {"classes": tf.identity(out.predictions, name="classes"),
             "lengths": tf.identity(out.lengths, name="lengths")}
  if out.reconstructions is not None:
    outputs["reconstructions"] = tf.identity(out.reconstructions, name="reconstructions")
  return images, outputs, out.couplings


def _restore(sess, ckpt, weights="auto"):
  """Restores the model's variables (the weights the run chose, raw or
  averaged, by default); RunError for another architecture."""
  saver, _ = runs.model_saver(ckpt, tf.compat.v1.global_variables(), weights)
  saver.restore(sess, ckpt)


def classify(cfg, ckpt, images, weights="auto"):
  """{classes, lengths, reconstructions (with the decoder), couplings `[N,
  iter_routing, in_caps, classes]`, routing_entropy `[N, iter_routing]`} of
  uint8 `images` (`weights`: `runs.model_saver`'s)."""
  with tf.Graph().as_default():
    images_in, outputs, couplings = _graph(cfg)
    outputs["couplings"] = tf.stack(couplings, axis=1)
    outputs["routing_entropy"] = evaluation.couplings_moved(couplings)["entropy"]
    with tf.compat.v1.Session() as sess:
      _restore(sess, ckpt, weights)
      return sess.run(outputs, {images_in: images})


def export(cfg, ckpt, folder, weights="auto", log=print):
  """Writes a SavedModel of the checkpoint whole or not at all, via
  `<folder>.partial` (one left by a killed export is removed, saying so). Raises
  RunError if `folder` exists or the checkpoint does not fit."""
  folder = os.path.normpath(folder)
  if os.path.exists(folder):
    raise runs.RunError(f"--export_savedmodel={folder}: exists; give a new folder")
  partial = folder + ".partial"
  if os.path.exists(partial):
    log(f"{partial}: removed, a half-written export (one that was stopped)")
    shutil.rmtree(partial)
  _write_savedmodel(cfg, ckpt, partial, weights)
  os.rename(partial, folder)


def _write_savedmodel(cfg, ckpt, folder, weights):
  with tf.Graph().as_default():
    images, outputs, _ = _graph(cfg)
    with tf.compat.v1.Session() as sess:
      _restore(sess, ckpt, weights)
      signature = tf.compat.v1.saved_model.predict_signature_def(
          inputs={"images": images}, outputs=outputs)
      builder = tf.compat.v1.saved_model.Builder(folder)
      builder.add_meta_graph_and_variables(
          sess, [tf.compat.v1.saved_model.tag_constants.SERVING],
          signature_def_map={"serving_default": signature}, strip_default_attrs=True)
      builder.save()

