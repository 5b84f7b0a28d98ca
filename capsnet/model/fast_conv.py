"""Fast VALID convolutions for the CPU: the same values and gradients as
`tf.nn.conv2d`, computed in forms that oneDNN runs fast.

One entry point, `conv2d(x, w, bias, stride, method, relu)`, and one place
that chooses: `resolve_impl` turns the config's `conv_impl` ("auto":
these forms on the CPU, TensorFlow's on a GPU, where cuDNN's strided
gradients are fast) into "custom_grad" or "conv2d" for a device, and
`choose_method` picks each convolution's method. The methods:

- "conv2d": TensorFlow's convolution and its own gradients.
- "patch_gemm" (stride 1): the filter and bias gradients are one GEMM of the
  input patches with dy. For a layer with few input taps (Conv1: 81) this
  replaces Conv2DBackpropFilter and BiasAddGrad.
- "dilated" (stride > 1, float32): the forward pass is conv2d; the input
  gradient is one stride-1 convolution with the roles turned round (w as the
  input, dy as a kernel dilated by the stride), the filter gradient one
  convolution of x with dy as a dilated kernel. TensorFlow's strided
  Conv2DBackpropInput/Filter run far below the forward convolution's speed.
- "folded" (stride > 1, bfloat16): the forward pass is a stride-1
  convolution over a space-to-depth view of x with `FOLD` images side by
  side along the width, the input gradient the stride^2 phases of a stride-1
  Conv2DBackpropInput folded the same way, the filter gradient as in
  "dilated". oneDNN's bfloat16 convolutions run well below their speed on
  narrow output rows (PrimaryCaps: 6 wide); the folded rows are 4 times as
  wide.

Every method is tested against `tf.nn.conv2d` in float64, value and all
gradients (tests/test_fast_conv.py). Timings that chose them are in the
commit history and `python -m capsnet.bench`.
"""
import tensorflow as tf

METHODS = ("conv2d", "patch_gemm", "dilated", "folded")

# Largest patch (kernel * kernel * in_channels) for "patch_gemm": its one-hot
# patch convolution costs patch^2 multiply-adds per output position, against
# patch * out_channels for the convolution itself.
MAX_GEMM_PATCH = 256

# Images side by side along the width in the "folded" method.
FOLD = 4


IMPLS = ("auto", "custom_grad", "conv2d")


def resolve_impl(conv_impl, device=None):
  """"custom_grad" or "conv2d" for a model placed on `device`.

  "auto" is "conv2d" on a GPU device (e.g. "/gpu:0", "/device:GPU:1") and
  "custom_grad" anywhere else (the CPU, or no device given).
  Raises: ValueError for an unknown `conv_impl`.
  """
  if conv_impl not in IMPLS:
    raise ValueError(f"conv_impl must be one of {IMPLS}, got {conv_impl!r}")
  if conv_impl != "auto":
    return conv_impl
  on_gpu = device is not None and "gpu" in device.lower()
  return "conv2d" if on_gpu else "custom_grad"


def choose_method(conv_impl, dtype, stride, patch_size):
  """The method for one convolution; the only place that decides.

  Args:
    conv_impl: "custom_grad" (the fast forms below) or "conv2d" (from
      `resolve_impl`).
    dtype: the compute dtype of the convolution.
    stride: its stride.
    patch_size: kernel height * kernel width * input channels.
  Returns: one of `METHODS`.
  Raises:
    ValueError: an unknown `conv_impl`.
  """
  if conv_impl not in ("custom_grad", "conv2d"):
    raise ValueError(f"conv_impl must be 'custom_grad' or 'conv2d', got {conv_impl!r}")
  if conv_impl == "conv2d":
    return "conv2d"
  if stride == 1:
    return "patch_gemm" if patch_size <= MAX_GEMM_PATCH else "conv2d"
  return "folded" if tf.as_dtype(dtype) == tf.bfloat16 else "dilated"


def conv2d(x, w, bias, stride, method, relu=False):
  """`relu(conv2d(x, w, stride, VALID) + bias)` computed by `method`.

  Args:
    x: `[batch, h, w, c]` (the batch may be unknown).
    w: `[k, k', c, n]`, a tensor or variable in x's dtype.
    bias: `[n]` in x's dtype.
    stride: int.
    method: one of `METHODS` ("patch_gemm" needs stride 1; "dilated" and
      "folded" need stride > 1).
    relu: apply a ReLU.
  Returns: `[batch, (h - k) // stride + 1, (w - k') // stride + 1, n]`.
  Raises:
    ValueError: an unknown method, or one that does not fit the stride.
  """
  if method not in METHODS:
    raise ValueError(f"fast_conv.conv2d: method must be one of {METHODS}, got {method!r}")
  if (method == "patch_gemm") != (stride == 1) and method != "conv2d":
    raise ValueError(f"fast_conv.conv2d: method {method!r} does not take "
                     f"stride {stride}")
  if method == "patch_gemm":
    return _patch_grad_conv(x, tf.convert_to_tensor(w), bias, relu)
  if method == "conv2d":
    y = tf.nn.conv2d(x, w, strides=stride, padding="VALID")
  else:
    y = _strided_conv(x, tf.convert_to_tensor(w), stride, folded=method == "folded")
  y = tf.nn.bias_add(y, bias)
  return tf.nn.relu(y) if relu else y


def _patch_grad_conv(x, w, bias, relu):
  """Stride-1 VALID `conv2d(x, w) + bias` (then ReLU) whose filter and bias
  gradients are one GEMM, `[patches, 1]^T @ dy`; the input gradient is
  TensorFlow's (pruned when nothing needs it, as for the images).

  Args:
    x: `[batch, h, w, c]`; w: `[k, k', c, n]`; bias: `[n]`; relu: bool.
  Returns: `[batch, h - k + 1, w - k' + 1, n]`.
  """
  @tf.custom_gradient
  def conv(x, w, bias):
    y = tf.nn.bias_add(tf.nn.conv2d(x, w, strides=1, padding="VALID"), bias)
    if relu:
      y = tf.nn.relu(y)

    def grad(dy):
      dz = tf.raw_ops.ReluGrad(gradients=dy, features=y) if relu else dy
      kh, kw, c, n = w.shape
      # The patches as a convolution with a one-hot kernel: exact (products
      # with 1 and sums of zeros) and faster than extract_patches.
      one_hot = tf.reshape(tf.eye(kh * kw * c, dtype=x.dtype), [kh, kw, c, kh * kw * c])
      patches = tf.nn.conv2d(x, one_hot, strides=1, padding="VALID")
      patches = tf.reshape(patches, [-1, kh * kw * c])  # [(b, y, x), (ky, kx, c)]
      patches = tf.concat([patches, tf.ones_like(patches[:, :1])], axis=1)
      g = tf.matmul(patches, tf.reshape(dz, [-1, n]), transpose_a=True)
      dx = tf.compat.v1.nn.conv2d_backprop_input(
          tf.shape(x), w, dz, strides=[1, 1, 1, 1], padding="VALID")
      return dx, tf.reshape(g[:-1], w.shape), g[-1]
    return y, grad
  return conv(x, w, bias)


def _strided_conv(x, w, stride, folded):
  """conv2d(x, w, stride, VALID) whose gradients are stride-1 convolutions.

  Args:
    x: `[batch, h, w, c]`; w: `[k, k', c, n]` (a tensor); stride: int.
    folded: the "folded" method (folded forward and phase input gradient);
      else "dilated" (conv2d forward, dilated input gradient).
  Returns: `[batch, (h - k) // stride + 1, (w - k') // stride + 1, n]`.
  """
  @tf.custom_gradient
  def conv(x, w):
    if folded:
      return _folded_conv(x, w, stride), grad
    return tf.nn.conv2d(x, w, strides=stride, padding="VALID"), grad

  def grad(dy):
    s = stride
    kh, kw = w.shape[0], w.shape[1]
    h, wd = x.shape[1], x.shape[2]
    oh, ow = dy.shape[1], dy.shape[2]
    if folded:
      dx = _phase_input_grad(dy, w, h, wd, s)
    else:
      dx = _dilated_input_grad(dy, w, h, wd, s)
    # Only the rows and columns that some kernel tap reads.
    used_h, used_w = s * (oh - 1) + kh, s * (ow - 1) + kw
    x_t = tf.transpose(x[:, :used_h, :used_w], [3, 1, 2, 0])   # [c, h', w', batch]
    dy_t = tf.transpose(dy, [1, 2, 0, 3])            # [oh, ow, batch, n]
    dw = tf.nn.conv2d(x_t, dy_t, strides=1, padding="VALID", dilations=s)
    dw = tf.transpose(dw, [1, 2, 0, 3])              # [kh, kw, c, n]
    return dx, dw
  return conv(x, w)


def _dilated_input_grad(dy, w, h, wd, s):
  """Input gradient of `conv2d(x, w, s, VALID)` as one stride-1 convolution:
  `w` (output channels as the batch) is the input, zero-padded by the
  convolution itself, and dy (flipped, batch as output channels) the kernel,
  dilated by the stride. oneDNN skips the padded taps.

  `dx[b, y, c] = sum_{o, n} dy[b, o, n] w[y - s*o, c, n]`: with
  `q = oh - 1 - o`, w's index is `y + s*q - s*(oh - 1)`.

  Returns: `[batch, h, wd, c]`.
  """
  kh, kw = w.shape[0], w.shape[1]
  oh, ow = dy.shape[1], dy.shape[2]
  w_in = tf.transpose(w, [2, 0, 1, 3])                      # [c, kh, kw, n]
  dy_k = tf.transpose(tf.reverse(dy, [1, 2]), [1, 2, 3, 0])  # [oh, ow, n, b]
  pads = [[0, 0], [s * (oh - 1), h - kh], [s * (ow - 1), wd - kw], [0, 0]]
  dx = tf.nn.conv2d(w_in, dy_k, strides=1, padding=pads, dilations=s)
  return tf.transpose(dx, [3, 1, 2, 0])                     # [b, h, w, c]


def _folded_conv(x, w, stride):
  """conv2d(x, w, stride, VALID) as one stride-1 convolution over a
  space-to-depth view of x, with `FOLD` images side by side along the width.

  The kernel, zero-padded to a multiple of the stride, is rearranged to
  `[ceil(k/s), ceil(k'/s), s*s*c, n]`, so each output is the same sum of
  products plus products with zero taps. The folded input gives rows of
  FOLD * (w / s) - ceil(k'/s) + 1 outputs, of which the columns that
  straddle two images are dropped.

  Args:
    x: `[batch, h, w, c]` (any batch size: padded to a multiple of FOLD);
    w: `[k, k', c, n]`; stride: int.
  Returns: `[batch, (h - k) // stride + 1, (w - k') // stride + 1, n]`.
  """
  s, fold = stride, FOLD
  h, wd, c = x.shape[1], x.shape[2], x.shape[3]
  kh, kw, _, n = w.shape
  oh, ow = (h - kh) // s + 1, (wd - kw) // s + 1
  hs, ws = -(-h // s), -(-wd // s)
  batch = tf.shape(x)[0]
  x = tf.pad(x, [[0, (-batch) % fold], [0, hs * s - h], [0, ws * s - wd], [0, 0]])
  x = tf.reshape(x, [-1, fold, hs, s, ws, s, c])
  x = tf.transpose(x, [0, 2, 1, 4, 3, 5, 6])         # [b/f, hs, f, ws, s, s, c]
  x = tf.reshape(x, [-1, hs, fold * ws, s * s * c])
  wp = tf.transpose(_kernel_phases(w, s), [0, 2, 1, 3, 4, 5])  # [rk, rl, s, s, c, n]
  wp = tf.reshape(wp, [wp.shape[0], wp.shape[1], s * s * c, n])
  y = tf.nn.conv2d(x, wp, strides=1, padding="VALID")  # [b/f, hs-rk+1, f*ws-rl+1, n]
  y = tf.pad(y[:, :oh], [[0, 0], [0, 0], [0, fold * ws - y.shape[2]], [0, 0]])
  y = tf.reshape(y, [-1, oh, fold, ws, n])[:, :, :, :ow]
  y = tf.reshape(tf.transpose(y, [0, 2, 1, 3, 4]), [-1, oh, ow, n])
  return y[:batch]


def _phase_input_grad(dy, w, h, wd, s):
  """Input gradient of `conv2d(x, w, s, VALID)` from dy, phase by phase.

  Phase (py, px) of dx (rows y = s*m + py, columns s*l + px) is the full
  correlation of dy with the flipped sub-kernel `w[py::s, px::s]`, computed
  as the input gradient of a stride-1 VALID convolution with the sub-kernel
  as it is (w is neither flipped nor transposed). `FOLD` images lie side by
  side along the width, each followed by L - 1 zero columns, so the
  convolution's rows are FOLD times as wide and every output column belongs
  to one image. The phases are interleaved into `[batch, h, w, c]` by one
  transpose.

  Args:
    dy: `[batch, oh, ow, n]`; w: `[k, k', c, n]`; h, wd: x's height and
    width; s: the stride.
  Returns: `[batch, h, wd, c]`.
  """
  fold = FOLD
  oh, ow = dy.shape[1], dy.shape[2]
  kh, kw, c, _ = w.shape
  rows, cols = -(-h // s), -(-wd // s)              # phase grid size
  batch = tf.shape(dy)[0]
  dy = tf.pad(dy, [[0, (-batch) % fold], [0, 0], [0, 0], [0, 0]])
  wp = _kernel_phases(w, s)
  phases = []
  for py in range(s):
    for px in range(s):
      j, l = len(range(py, kh, s)), len(range(px, kw, s))
      ph, pw = oh + j - 1, ow + l - 1                # full correlation size
      rhs = tf.pad(dy, [[0, 0], [0, 0], [0, l - 1], [0, 0]])
      rhs = _fold_width(rhs, fold)[:, :, :fold * pw - (l - 1)]
      sizes = tf.stack([tf.shape(rhs)[0], ph, fold * pw, c])
      phase = tf.compat.v1.nn.conv2d_backprop_input(
          sizes, wp[:j, py, :l, px], rhs, strides=[1, 1, 1, 1], padding="VALID")
      phase = tf.reshape(phase, [-1, ph, fold, pw, c])
      phases.append(tf.pad(phase, [[0, 0], [0, rows - ph], [0, 0],
                                   [0, cols - pw], [0, 0]]))
  dx = tf.reshape(tf.stack(phases, axis=4), [-1, rows, fold, cols, s, s, c])
  dx = tf.transpose(dx, [0, 2, 1, 4, 3, 5, 6])      # [b/f, f, rows, s, cols, s, c]
  dx = tf.reshape(dx, [-1, rows * s, cols * s, c])
  return dx[:batch, :h, :wd]


def _kernel_phases(w, s):
  """`w` `[k, k', c, n]` zero-padded to multiples of s and viewed as
  `[ceil(k/s), s, ceil(k'/s), s, c, n]`: `w[s*q + p]` at `[q, p]`."""
  kh, kw, c, n = w.shape
  rk, rl = -(-kh // s), -(-kw // s)
  wp = tf.pad(w, [[0, rk * s - kh], [0, rl * s - kw], [0, 0], [0, 0]])
  return tf.reshape(wp, [rk, s, rl, s, c, n])


def _fold_width(t, fold):
  """`[b, h, w, c]` -> `[b / fold, h, fold * w, c]`: images side by side."""
  _, h, wd, c = t.shape
  t = tf.reshape(t, [-1, fold, h, wd, c])
  return tf.reshape(tf.transpose(t, [0, 2, 1, 3, 4]), [-1, h, fold * wd, c])
