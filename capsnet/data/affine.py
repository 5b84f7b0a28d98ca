"""The affine test set: each MNIST test image once (file order), affinely
transformed, 28x28, from a fixed seed.

A rotation, shear and horizontal and vertical scale drawn uniformly in affNIST's
ranges (rotation within 20 degrees, shear within 0.2, scales in [0.8, 1.2]) and
a translation within 2 pixels, about the image's centre; a draw that moves the
ink out of the frame is repeated. Resampled bilinearly (zero fill) in float64,
rounded to uint8. Not the paper's 40x40 affNIST (docs/short.md). Made afresh
each time (about a second) and checked against `MD5`, so no cache can go stale.
"""
import dataclasses
import hashlib

import numpy as np

SEED = 2017
SIZE = 28
CENTRE = (SIZE - 1) / 2.0   # the pixel grid's centre, 13.5
MAX_DRAWS = 1000            # redraws of one image before giving up


@dataclasses.dataclass(frozen=True)
class Ranges:
  """The largest transformation of each kind; each is drawn uniformly."""
  rotation_deg: float = 20.0    # within +-rotation_deg
  shear: float = 0.2            # within +-shear (x += shear * y)
  scale_low: float = 0.8        # each axis' scale in [scale_low, scale_high]
  scale_high: float = 1.2
  shift: float = 2.0            # translation within +-shift pixels, each axis

  def __post_init__(self):
    if not (0 <= self.rotation_deg <= 180 and self.shear >= 0 and self.shift >= 0
            and 0 < self.scale_low <= self.scale_high):
      raise ValueError(f"affine.Ranges: expected 0 <= rotation_deg <= 180, shear >= 0, "
                       f"shift >= 0 and 0 < scale_low <= scale_high, got {self}")


AFFNIST = Ranges()
# The md5 of the affine test set (the uint8 images of make(images, AFFNIST,
# SEED), [10000, 28, 28, 1]) by the md5 of the MNIST test images it is made from.
MNIST_TEST_MD5 = "240610fa99e73bfa49df8e7fc24d3206"
MD5 = {MNIST_TEST_MD5: "24bdf57910d24d52773ee3513c49ae02"}


class AffineError(ValueError):
  """The affine set came out other than recorded; the message says how."""


def forward_matrix(params):
  """The `[2, 3]` float64 [A | b] mapping input (x, y) (x the column) to output
  pixel coordinates, out = A (in - c) + c + t, for `params` (rotation in
  radians, shear, scale_x, scale_y, shift_x, shift_y)."""
  theta, shear, sx, sy, tx, ty = params[:6]
  rot = np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
  a = rot @ np.array([[1.0, shear], [0.0, 1.0]]) @ np.diag([sx, sy])
  c = np.array([CENTRE, CENTRE])
  b = c + np.array([tx, ty]) - a @ c
  return np.concatenate([a, b[:, None]], axis=1)


def projective_transform(params):
  """ImageProjectiveTransformV3's 8 numbers for `params`: the inverse map,
  from output pixel coordinates to the input's."""
  m = forward_matrix(params)
  inv = np.linalg.inv(m[:, :2])
  offset = -inv @ m[:, 2]
  return np.array([inv[0, 0], inv[0, 1], offset[0], inv[1, 0], inv[1, 1], offset[1],
                   0.0, 0.0])


def ink_box(image):
  """Corners (x, y) of the bounding box of the pixels > 0, `[4, 2]`; None for
  an empty image."""
  rows, cols = np.nonzero(image.reshape(image.shape[0], image.shape[1]))
  if not len(rows):
    return None
  x0, x1, y0, y1 = cols.min(), cols.max(), rows.min(), rows.max()
  return np.array([[x0, y0], [x1, y0], [x0, y1], [x1, y1]], np.float64)


def fits(params, box, size=SIZE):
  """The transformed ink box stays inside the frame [0, size - 1]."""
  if box is None:
    return True
  m = forward_matrix(params)
  corners = box @ m[:, :2].T + m[:, 2]
  return bool((corners >= 0).all() and (corners <= size - 1).all())


def draw(images, ranges=AFFNIST, seed=SEED):
  """One parameter row an image, `[n, 6]` float64 (`forward_matrix`'s), each
  draw repeated until the ink fits the frame; deterministic in (images, ranges,
  seed). Raises AffineError if an image fits no draw in MAX_DRAWS."""
  rng = np.random.default_rng(seed)
  out = np.zeros([len(images), 6])
  rot = np.deg2rad(ranges.rotation_deg)
  for i, image in enumerate(images):
    box = ink_box(image)
    for _ in range(MAX_DRAWS):
      p = np.array([rng.uniform(-rot, rot), rng.uniform(-ranges.shear, ranges.shear),
                    rng.uniform(ranges.scale_low, ranges.scale_high),
                    rng.uniform(ranges.scale_low, ranges.scale_high),
                    rng.uniform(-ranges.shift, ranges.shift),
                    rng.uniform(-ranges.shift, ranges.shift)])
      if fits(p, box, image.shape[1]):
        break
    else:
      raise AffineError(f"affine.draw: image {i} fits no draw of {ranges} in "
                        f"{MAX_DRAWS} tries")
    out[i] = p
  return out


def apply(images, params):
  """The uint8 images `[n, h, w, 1]` transformed by their `draw` rows,
  bilinearly, zero fill."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  transforms = np.stack([projective_transform(p) for p in params]).astype(np.float32)
  with tf.Graph().as_default():
    # Fed, not constants: 10,000 images as a tf.constant (63 MB of float64
    # in the graph) took 3.0-3.5 s to build and optimise, the transform 0.1 s.
    images_in = tf.compat.v1.placeholder(tf.float64, images.shape)
    transforms_in = tf.compat.v1.placeholder(tf.float32, transforms.shape)
    out = tf.raw_ops.ImageProjectiveTransformV3(
        images=images_in, transforms=transforms_in,
        output_shape=tf.constant(images.shape[1:3], tf.int32),
        fill_value=tf.constant(0.0, tf.float32), interpolation="BILINEAR",
        fill_mode="CONSTANT")
    with tf.compat.v1.Session() as sess:
      result = sess.run(out, {images_in: images.astype(np.float64),
                              transforms_in: transforms})
  return np.clip(np.round(result), 0, 255).astype(np.uint8)


def md5(images):
  return hashlib.md5(np.ascontiguousarray(images, np.uint8).tobytes()).hexdigest()


def make(images, ranges=AFFNIST, seed=SEED):
  """(transformed images, parameters) of `images` (`[n, 28, 28, 1]` uint8)."""
  params = draw(images, ranges, seed)
  return apply(images, params), params


def test_set(test_images, ranges=AFFNIST, seed=SEED):
  """The affine copy of the MNIST test images (affNIST's ranges, the seed).
  Raises AffineError naming both md5s if its md5 is not `MD5`."""
  images, _ = make(test_images, ranges, seed)
  expected = MD5.get(md5(test_images)) if (ranges, seed) == (AFFNIST, SEED) else None
  if expected is not None and md5(images) != expected:
    raise AffineError(f"the affine test set has md5 {md5(images)}, expected {expected}: "
                      "this TensorFlow or NumPy resamples or draws differently from "
                      "the one that recorded it")
  return images


def parse_sweep(values):
  """--affine_sweep's largest rotations as degrees. Raises ValueError naming the
  flag for a value not a number in [0, 180]."""
  try:
    degrees = [float(d) for d in values]
  except ValueError:
    degrees = [-1.0]
  if any(not 0 <= d <= 180 for d in degrees):
    raise ValueError(f"--affine_sweep={','.join(values)}: expected rotations in degrees "
                     "between 0 and 180")
  return degrees
