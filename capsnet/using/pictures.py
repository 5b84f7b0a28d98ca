"""Your own digit images in MNIST's form, and the pictures eval.py draws of what
the model does with them (NumPy, but TensorFlow's image ops decode and resize).

MNIST's digits (LeCun et al.) are grey, size-normalised into a 20x20 box keeping
their aspect ratio, then centred in 28x28 by centre of mass; `preprocess` does
the same to any image, inverting a light background.
"""
import re

import numpy as np
import tensorflow as tf

BOX = 20        # the digit's size-normalised box
FIELD = 28      # the image


class ImageError(ValueError):
  """An image that cannot be read, decoded or used; the message names it."""


def preprocess(path):
  """An image file (PNG, JPEG, GIF or BMP; any size, colour or grey, either
  polarity) as an MNIST digit: uint8 `[28, 28, 1]`, white ink on black. Raises
  ImageError naming the file."""
  grey = _decode_grey(path)                                  # [h, w] in [0, 1]
  def edges(a):
    return np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]])
  ink = 1.0 - grey if edges(grey).mean() > 0.5 else grey      # ink bright
  background = np.median(edges(ink))
  ink = np.clip((ink - background) / max(1.0 - background, 1e-6), 0, 1)
  if ink.max() <= 0.05:
    raise ImageError(f"{path}: no ink found (a blank image?)")
  rows, cols = np.nonzero(ink > 0.1 * ink.max())
  crop = ink[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
  crop = crop / crop.max()
  h, w = crop.shape
  scale = BOX / max(h, w)
  size = [max(1, round(h * scale)), max(1, round(w * scale))]
  small = _evaluate(lambda: tf.image.resize(crop[..., None], size, method="area",
                                            antialias=True))[..., 0]
  return _centre_by_mass(np.clip(small, 0, 1))


def _decode_grey(path):
  try:
    image = _evaluate(lambda: tf.io.decode_image(
        tf.io.read_file(path), channels=4, expand_animations=False))
  except (tf.errors.OpError, ValueError) as e:
    # The reason is the last line once TensorFlow's node annotations are
    # gone: "{{function_node ...}} <reason> [Op:DecodeImage]" (eager), or
    # "<reason>" then "[[{{node decode_image/DecodeImage}}]]" (graph mode).
    lines = [re.sub(r"\[\[\{\{[^}]*\}\}\]\]|\{\{[^}]*\}\}|\[Op:\w+\].*$", "", line).strip()
             for line in (getattr(e, "message", None) or str(e)).splitlines()]
    reason = ([line for line in lines if line] or [type(e).__name__])[-1][:120]
    raise ImageError(f"{path}: cannot read or decode the image ({reason})") from None
  rgba = image.astype(np.float32) / 255.0
  alpha = rgba[..., 3:]
  rgb = rgba[..., :3] * alpha + (1.0 - alpha)                 # over white
  return rgb @ np.array([0.2989, 0.5870, 0.1140], np.float32)  # as rgb_to_grayscale


def _centre_by_mass(digit):
  """`digit` (at most 20x20) in a 28x28 field with its centre of mass at
  the field's centre, kept whole inside the field."""
  h, w = digit.shape
  total = digit.sum()
  cy = (digit.sum(1) * np.arange(h)).sum() / total
  cx = (digit.sum(0) * np.arange(w)).sum() / total
  top = int(np.clip(round((FIELD - 1) / 2 - cy), 0, FIELD - h))
  left = int(np.clip(round((FIELD - 1) / 2 - cx), 0, FIELD - w))
  field = np.zeros([FIELD, FIELD], np.float32)
  field[top:top + h, left:left + w] = digit
  return (field * 255).round().astype(np.uint8)[..., None]


# A 3x5 pixel font for the labels in the pictures: digits, ".", " ", "H".
_GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001010010010", "8": "111101111101111",
    "9": "111101111001111", ".": "000000000000010", " ": "000000000000000",
    "H": "101101111101101", "=": "000111000111000", "c": "000111100100111",
    "-": "000000111000000", "L": "100100100100111", "P": "111101111100100",
}


def text(string, scale=2):
  """`string` in the 3x5 font as a bool array (True = ink)."""
  glyphs = [np.array(list(_GLYPHS[ch]), int).reshape(5, 3).astype(bool)
            for ch in string]
  spaced = []
  for g in glyphs:
    spaced += [g, np.zeros([5, 1], bool)]
  line = np.concatenate(spaced[:-1] or [np.zeros([5, 1], bool)], axis=1)
  return np.kron(line, np.ones([scale, scale], bool))


def _paint(canvas, mask, top, left, colour):
  h, w = mask.shape
  region = canvas[top:top + h, left:left + w]
  region[mask[:region.shape[0], :region.shape[1]]] = colour


def report(image, reconstruction, lengths, prediction, zoom=4):
  """One picture (uint8 `[H, W, 3]`): the input `[28, 28]`, its reconstruction
  `[784]` (or None) and the capsule lengths as bars over their digits, the
  `prediction` in red, a dashed line at 0.5."""
  size = FIELD * zoom
  def grey(a):
    return np.repeat(np.kron(a, np.ones([zoom, zoom]))[..., None], 3, axis=2)
  panels = [grey(image / 255.0)]
  if reconstruction is not None:
    panels.append(grey(np.reshape(reconstruction, [FIELD, FIELD])))
  bar_w, gap, height = 14, 4, size - 16
  chart = np.ones([size, len(lengths) * (bar_w + gap) + gap, 3])
  for k, length in enumerate(lengths):
    left = gap + k * (bar_w + gap)
    top = height - int(round(min(max(length, 0), 1) * height))
    colour = (0.85, 0.1, 0.1) if k == prediction else (0.35, 0.35, 0.35)
    chart[top:height, left:left + bar_w] = colour
    _paint(chart, text(str(k)), height + 3, left + 4, (0, 0, 0))
  chart[height // 2, ::4] = (0.6, 0.6, 0.9)
  spacer = np.ones([size, 8, 3])
  row = np.concatenate(sum(([p, spacer] for p in panels), []) + [chart], axis=1)
  return (np.clip(row, 0, 1) * 255).round().astype(np.uint8)


def routing_grids(couplings, prediction, grid, types):
  """`num_iters` arrays `[grid, grid]`: the couplings (one image's `[in_caps,
  num_classes]` an iteration, in_caps ordered (row, column, type)) to the
  predicted capsule, averaged over the `types` at each position."""
  return [c[:, prediction].reshape(grid, grid, types).mean(axis=2) for c in couplings]


def routing_figure(image, grids, entropies, kernels=(9, 9), stride=2, zoom=6):
  """One panel per routing iteration (uint8 `[H, W, 3]`): the input in grey and,
  over each PrimaryCaps position's receptive-field centre, a red square from
  none at the smallest mean coupling over the panels to full at the largest;
  below, the mean entropy H (nats) and that range of c."""
  size = image.shape[0] * zoom
  top = (kernels[0] + kernels[1] - 2) // 2      # centre of position (0, 0)
  low = min(g.min() for g in grids)
  high = max(g.max() for g in grids)
  panels = []
  for grid, entropy in zip(grids, entropies, strict=True):
    panel = np.repeat(np.kron(image / 255.0, np.ones([zoom, zoom]))[..., None], 3, 2)
    panel = 0.15 + 0.7 * panel
    for (i, j), value in np.ndenumerate(grid):
      y, x = (top + stride * i - 1) * zoom, (top + stride * j - 1) * zoom
      a = 0.75 * (value - low) / (high - low) if high > low else 0.0
      cell = panel[y:y + stride * zoom, x:x + stride * zoom]
      cell[:] = (1 - a) * cell + a * np.array([0.95, 0.1, 0.1])
    label = np.ones([16, size, 3])
    _paint(label, text(f"H={entropy:.3f} c={low:.3f}-{high:.3f}".replace("0.", "."),
                       scale=2), 3, 4, (0, 0, 0))
    panels += [np.concatenate([panel, label], axis=0), np.ones([size + 16, 8, 3])]
  row = np.concatenate(panels[:-1], axis=1)
  return (np.clip(row, 0, 1) * 255).round().astype(np.uint8)


def tile(images, columns, gap=2):
  """`[n, h, w]` or `[n, h, w, c]` floats in [0, 1] -> one uint8 `[H, W, c]`
  grid (c = 1 for `[n, h, w]`), row-major, `columns` a row, white `gap`
  pixels between and white where a row is short."""
  images = np.asarray(images)
  if images.ndim == 3:
    images = images[..., None]
  n, h, w, c = images.shape
  rows = -(-n // columns)
  grid = np.ones([rows * (h + gap) - gap, columns * (w + gap) - gap, c],
                 np.result_type(images.dtype, np.float32))
  for k, img in enumerate(images):
    r, col = divmod(k, columns)
    grid[r * (h + gap):r * (h + gap) + h, col * (w + gap):col * (w + gap) + w] = img
  return (np.clip(grid, 0, 1) * 255).round().astype(np.uint8)


# Figure 4's perturbations of one capsule dimension at a time (11 values).
PERTURBATIONS = np.round(np.arange(-0.25, 0.2501, 0.05), 2)


def perturbed_capsules(v, prediction):
  """Figure 4's decoder inputs for one image: its digit capsules `v
  [classes, dim]` with dimension d of the `prediction`'s capsule moved by
  each of `PERTURBATIONS`, d by d. Returns `[dim * 11, classes, dim]`."""
  classes, dim = v.shape
  caps = np.repeat(v[None], dim * len(PERTURBATIONS), axis=0)
  caps = caps.reshape(dim, len(PERTURBATIONS), classes, dim)
  for d in range(dim):
    caps[d, :, prediction, d] += PERTURBATIONS
  return caps.reshape(-1, classes, dim)


def figure4(blocks):
  """Figure 4 of the paper: per image a block of its decoded perturbed
  capsules, `[dim * 11, s, s]` in [0, 1] (rows: dimensions, columns:
  perturbations), the blocks side by side 8 pixels apart. Returns uint8
  `[H, W, 1]`."""
  tiles = [tile(b, columns=len(PERTURBATIONS)) for b in blocks]
  return tile(np.stack(tiles) / np.float32(255), columns=len(tiles), gap=8)


def figure5(inputs, reconstructions, labels, predictions, zoom=3, per_row=6):
  """Figure 5 of the paper (uint8 `[H, W, 3]`, `per_row` tiles a row): each case
  the input `[s, s]` (grey) above its two reconstructions overlaid, the first
  red, the second green, and "L<labels> P<predicted>" below."""
  size = inputs.shape[1]
  cases = []
  for k in range(len(inputs)):
    grey = np.repeat(inputs[k][..., None], 3, axis=2)
    r = reconstructions[k].reshape(2, size, size)
    overlay = np.stack([r[0], r[1], np.zeros_like(r[0])], axis=2)
    case = np.kron(np.concatenate([grey, np.ones([2, size, 3]), overlay], axis=0),
                   np.ones([zoom, zoom, 1]))
    label = np.ones([14, case.shape[1], 3])
    _paint(label, text(f"L{labels[k][0]}{labels[k][1]} P{predictions[k][0]}"
                       f"{predictions[k][1]}"), 2, 2, (0, 0, 0))
    cases.append(np.concatenate([case, label], axis=0))
  return tile(cases, per_row, gap=6)


def encode_png(array):
  """uint8 `[H, W, C]` -> PNG bytes."""
  return _evaluate(lambda: tf.io.encode_png(array))


def _evaluate(make):
  """The value of the tensor `make()` builds, eagerly or, in graph mode
  (tf.compat.v1 programs), in a graph and session of its own."""
  if tf.executing_eagerly():
    return make().numpy()
  with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
    return sess.run(make())
