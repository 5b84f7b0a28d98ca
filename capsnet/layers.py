"""CapsNet layers (Sabour et al. 2017, Section 4). The only `get_variable` calls.

Axis names used in shapes and einsum letters throughout:
  b = batch, i = in_caps (primary capsules), o = out_caps (digit capsules),
  k = in_dim (primary capsule dimension), d = out_dim (digit capsule dimension).

Every layer takes plain ints. `compute_dtype` (None or tf.bfloat16) is the
dtype in which a layer's convolution or large matmul runs (mixed precision):
variables are float32 (or the input's dtype without a compute dtype), Conv1's
output stays in the compute dtype for the PrimaryCaps convolution, and the
capsules, routing and decoder outputs are float32 again.
"""
import tensorflow as tf

from capsnet import routing


def _cast(x, dtype):
  return x if dtype is None or x.dtype == dtype else tf.cast(x, dtype)


# Largest patch (kernel * kernel * in_channels) for `_patch_grad_conv`: its
# one-hot convolution costs patch^2 multiply-adds per output position, against
# patch * out_channels for the convolution itself.
_MAX_GEMM_PATCH = 256


def _conv(x, kernel, channels, stride, compute_dtype, impl="custom_grad",
          relu=False):
  """VALID convolution with bias (and ReLU); variables `weights`, `biases`.

  Args:
    x: `[batch, height, width, in_channels]`.
    impl: "custom_grad" or "conv2d" (tf.nn.conv2d with TensorFlow's own
      gradients); equal in value and gradient. "custom_grad" computes the
      gradients of a strided convolution as stride-1 convolutions
      (`_strided_conv`) and the filter and bias gradients of a stride-1
      convolution with few input taps (Conv1: 81) as one patches GEMM
      (`_patch_grad_conv`).
    relu: apply a ReLU.
  Returns: `[batch, out_h, out_w, channels]` in `compute_dtype` (if given),
    else in the dtype of `x`; the bias is added in that dtype.
  """
  if impl not in ("custom_grad", "conv2d"):
    raise ValueError(f"conv impl must be 'custom_grad' or 'conv2d', got {impl!r}")
  in_ch = x.shape[-1]
  dtype = _variable_dtype(x)
  w = tf.compat.v1.get_variable(
      "weights", [kernel, kernel, in_ch, channels], dtype,
      tf.compat.v1.glorot_uniform_initializer())
  bias = tf.compat.v1.get_variable("biases", [channels], dtype,
                                   tf.compat.v1.zeros_initializer())
  xc, wc = _cast(x, compute_dtype), _cast(w, compute_dtype)
  bc = _cast(bias, xc.dtype)
  if impl == "custom_grad" and stride == 1 and kernel ** 2 * in_ch <= _MAX_GEMM_PATCH:
    return _patch_grad_conv(xc, tf.convert_to_tensor(wc), bc, relu)
  if impl == "custom_grad" and stride > 1:
    y = _strided_conv(xc, tf.convert_to_tensor(wc), stride)
  else:
    y = tf.nn.conv2d(xc, wc, strides=stride, padding="VALID")
  y = tf.nn.bias_add(y, bc)
  return tf.nn.relu(y) if relu else y


def _patch_grad_conv(x, w, bias, relu):
  """Stride-1 VALID `conv2d(x, w) + bias` (then ReLU) whose filter and bias
  gradients are one GEMM: `[patches, 1]^T @ dy`.

  For Conv1 (one input channel, 81 taps, 51,200 output positions per batch
  of 128) the patches cost one small convolution and the GEMM replaces
  TensorFlow's Conv2DBackpropFilter and BiasAddGrad (microbench, ReLU
  gradient included: 23 -> 12 ms per step in bfloat16, 19 -> 15 ms in
  float32). The input gradient is TensorFlow's (and is pruned when, as for
  the images, nothing needs it).

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
      # with 1 and sums of zeros) and 6-14x faster than extract_patches here.
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


def _variable_dtype(x):
  """float32 for bfloat16 activations (mixed precision), else x's dtype."""
  return tf.float32 if x.dtype == tf.bfloat16 else x.dtype


# Images side by side along the width in `_folded_conv` (bf16 forward).
_FORWARD_FOLD = 4


def _folded_conv(x, w, stride, fold=_FORWARD_FOLD):
  """conv2d(x, w, stride, VALID) as one stride-1 convolution over a
  space-to-depth view of x, with `fold` images side by side along the width.

  The kernel, zero-padded to a multiple of the stride, is rearranged to
  `[ceil(k/s), ceil(k'/s), s*s*c, n]`, so each output is the same sum of
  products plus products with zero taps. oneDNN's bfloat16 convolution runs
  well below its speed on this layer's 6-wide output rows; the folded input
  gives rows of fold * (w / s) - ceil(k'/s) + 1 outputs, of which the columns
  that straddle two images are dropped. Paper PrimaryCaps, batch 128
  (microbench, median of 3 x 8 steps, layout changes included): bfloat16
  fold 4: 49 ms, fold 2: 50, fold 1: 61, strided conv2d: 62; float32 fold 4:
  357 ms against 220, so float32 keeps conv2d.

  Args:
    x: `[batch, h, w, c]` (any batch size: padded to a multiple of `fold`);
    w: `[k, k', c, n]`; stride: int; fold: images per row.
  Returns: `[batch, (h - k) // stride + 1, (w - k') // stride + 1, n]`.
  """
  s = stride
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


def _strided_conv(x, w, stride, input_grad=None, forward=None):
  """conv2d(x, w, stride, VALID) whose gradients are stride-1 convolutions.

  TensorFlow's strided Conv2DBackpropInput/Filter run on the CPU at a
  fraction of the forward convolution's speed (bench: 2-3x slower in bf16).
  Both gradients are rewritten as forward convolutions, which oneDNN runs fast:
  - input, "phases": for each of the stride^2 phases (py, px) of the input
    grid, a full correlation of dy with the flipped sub-kernel
    w[py::s, px::s], as a stride-1 Conv2DBackpropInput; the phases are
    interleaved by one transpose (`_phase_input_grad`). "folded_phases":
    the same with 4 images side by side along the width.
  - input, "dilated": one convolution with the roles turned round: `w` (out
    channels as the batch) is the input, zero-padded by the convolution
    itself, and dy (flipped, batch as output channels) the kernel, dilated
    by the stride. oneDNN skips the padded taps, so it does only the useful
    FLOPs, over a 20 x 20 instead of a 10 x 10 output grid.
  - filter: a convolution of x (batch as channels) with dy as a kernel
    dilated by the stride.
  Paper PrimaryCaps, batch 128, input gradient alone (microbench, mean of
  2 medians of 8 steps): float32 "dilated" 170 ms, "phases" 213,
  "folded_phases" 234; bfloat16 245, 71 and 56 ms; hence the default by
  dtype.

  The forward pass is conv2d, or in bfloat16 `_folded_conv` (step trace:
  39-44 ms against 53-55 ms).

  Args:
    x: `[batch, h, w, c]`; w: `[k, k, c, n]` (a tensor); stride: int.
    input_grad: "phases", "folded_phases" or "dilated"; None:
      "folded_phases" for bfloat16, else "dilated".
    forward: "conv2d" or "folded"; None: "folded" for bfloat16, else "conv2d".
  Returns: `[batch, (h - k) // stride + 1, (w - k) // stride + 1, n]`.
  """
  bf16 = x.dtype == tf.bfloat16
  if input_grad is None:
    input_grad = "folded_phases" if bf16 else "dilated"
  if input_grad not in ("phases", "folded_phases", "dilated"):
    raise ValueError("input_grad must be 'phases', 'folded_phases' or 'dilated', "
                     f"got {input_grad!r}")
  if forward is None:
    forward = "folded" if bf16 else "conv2d"
  if forward not in ("conv2d", "folded"):
    raise ValueError(f"forward must be 'conv2d' or 'folded', got {forward!r}")

  @tf.custom_gradient
  def conv(x, w):
    if forward == "folded":
      return _folded_conv(x, w, stride), grad
    return tf.nn.conv2d(x, w, strides=stride, padding="VALID"), grad

  def grad(dy):
    s = stride
    kh, kw = w.shape[0], w.shape[1]
    h, wd = x.shape[1], x.shape[2]
    oh, ow = dy.shape[1], dy.shape[2]
    if input_grad == "dilated":
      # dx[b, y, c] = sum_{o, n} dy[b, o, n] w[y - s*o, c, n]: with
      # q = oh - 1 - o, w's index is y + s*q - s*(oh - 1).
      w_in = tf.transpose(w, [2, 0, 1, 3])                      # [c, kh, kw, n]
      dy_k = tf.transpose(tf.reverse(dy, [1, 2]), [1, 2, 3, 0])  # [oh, ow, n, b]
      pads = [[0, 0], [s * (oh - 1), h - kh], [s * (ow - 1), wd - kw], [0, 0]]
      dx = tf.nn.conv2d(w_in, dy_k, strides=1, padding=pads, dilations=s)
      dx = tf.transpose(dx, [3, 1, 2, 0])                       # [b, h, w, c]
    else:
      fold = _FORWARD_FOLD if input_grad == "folded_phases" else 1
      dx = _phase_input_grad(dy, w, h, wd, s, fold)
    # Only the rows and columns that some kernel tap reads.
    used_h, used_w = s * (oh - 1) + kh, s * (ow - 1) + kw
    x_t = tf.transpose(x[:, :used_h, :used_w], [3, 1, 2, 0])   # [c, h', w', batch]
    dy_t = tf.transpose(dy, [1, 2, 0, 3])            # [oh, ow, batch, n]
    dw = tf.nn.conv2d(x_t, dy_t, strides=1, padding="VALID", dilations=s)
    dw = tf.transpose(dw, [1, 2, 0, 3])              # [kh, kw, c, n]
    return dx, dw
  return conv(x, w)


def _phase_input_grad(dy, w, h, wd, s, fold):
  """Input gradient of `conv2d(x, w, s, VALID)` from dy, phase by phase.

  Phase (py, px) of dx (rows y = s*m + py, columns s*l + px) is the full
  correlation of dy with the flipped sub-kernel `w[py::s, px::s]`, computed
  as the input gradient of a stride-1 VALID convolution with the sub-kernel
  as it is (oneDNN runs that well; w is neither flipped nor transposed). The
  phases are interleaved into `[batch, h, w, c]` by one transpose. With
  `fold > 1`, `fold` images lie side by side along the width, each followed
  by L - 1 zero columns, so the convolution's rows are fold times as wide
  and every output column belongs to one image (bfloat16 paper PrimaryCaps,
  batch 128: one 5x5 phase 13.1 ms unfolded, 9.6 ms with fold 4,
  microbench).

  Args:
    dy: `[batch, oh, ow, n]`; w: `[k, k', c, n]`; h, wd: x's height and
    width; s: the stride; fold: images per row (1: no folding).
  Returns: `[batch, h, wd, c]`.
  """
  oh, ow = dy.shape[1], dy.shape[2]
  kh, kw, c, _ = w.shape
  rows, cols = -(-h // s), -(-wd // s)              # phase grid size
  batch = tf.shape(dy)[0]
  if fold > 1:
    dy = tf.pad(dy, [[0, (-batch) % fold], [0, 0], [0, 0], [0, 0]])
  wp = _kernel_phases(w, s)
  phases = []
  for py in range(s):
    for px in range(s):
      j, l = len(range(py, kh, s)), len(range(px, kw, s))
      ph, pw = oh + j - 1, ow + l - 1                # full correlation size
      rhs = dy
      if fold > 1:
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
  return (dx[:batch] if fold > 1 else dx)[:, :h, :wd]


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


def conv1(images, channels, kernel, compute_dtype=None, conv_impl="custom_grad"):
  """Conv1: `channels` kernel x kernel filters, stride 1, ReLU.

  Args:
    images: `[batch, height, width, image_channels]` in [0, 1].
    conv_impl: see `_conv`.
  Returns: `[batch, height - kernel + 1, width - kernel + 1, channels]`, in
    `compute_dtype` if given (the input of the PrimaryCaps convolution).
  """
  with tf.compat.v1.variable_scope("conv1"):
    return _conv(images, kernel, channels, 1, compute_dtype, conv_impl, relu=True)


def primary_caps(x, types, dim, kernel, stride, compute_dtype=None,
                 conv_impl="custom_grad"):
  """PrimaryCaps: a convolution to `types * dim` channels, cut into capsules.

  Args:
    x: `[batch, h, w, channels]` Conv1 output.
  Returns:
    u: `[batch, in_caps, dim]` squashed primary capsules (float32 for
      bfloat16 `x`), with `in_caps = out_h * out_w * types`.
  """
  with tf.compat.v1.variable_scope("primary_caps"):
    y = _conv(x, kernel, types * dim, stride, compute_dtype, conv_impl)
    y = _cast(y, _variable_dtype(x))
    in_caps = y.shape[1] * y.shape[2] * types
    u = tf.reshape(y, [-1, in_caps, dim])           # [b, i, k]
    return routing.squash(u)


def digit_caps(u, out_caps, out_dim, num_iters, stop_gradient):
  """DigitCaps: `u_hat = W u` per (input, output) capsule pair, then routing.

  W is `[in_caps, out_caps, in_dim, out_dim]` and is not tiled over the batch:
  one batched matmul over the input capsules computes all predictions,
  `[i, b, k] @ [i, k, o*d]`, and one transpose puts the batch first (moving
  rows of o*d contiguous values, ~3x cheaper than the einsum to [b, o, i, d]
  in forward plus backward). No bias is added to `s_j`. It runs in the dtype of
  `u` (float32) under every precision: with 8 multiply-adds per output value
  it is bound by memory, not by FLOPs, and computing it in bfloat16 only
  added casts of the largest tensor (bench: forward plus backward 37.8 ms in
  bfloat16 with casts, 35.8 ms in float32).

  Args:
    u: `[batch, in_caps, in_dim]` primary capsules.
    out_caps, out_dim: number and dimension of the output capsules.
    num_iters, stop_gradient: see `routing.dynamic_routing`.
  Returns:
    v: `[batch, out_caps, out_dim]`.
    c: `[batch, in_caps, out_caps]` coupling coefficients (last iteration).
    u_hat: `[batch, in_caps, out_caps, out_dim]` prediction vectors.
  """
  with tf.compat.v1.variable_scope("digit_caps"):
    in_caps, in_dim = u.shape[1], u.shape[2]
    w = tf.compat.v1.get_variable(
        "weights", [in_caps, out_caps, in_dim, out_dim], u.dtype,
        tf.compat.v1.random_normal_initializer(stddev=0.01))
    u_t = tf.transpose(u, [1, 0, 2])                            # [i, b, k]
    w_t = tf.reshape(tf.transpose(w, [0, 2, 1, 3]),
                     [in_caps, in_dim, out_caps * out_dim])      # [i, k, o*d]
    u_hat = tf.transpose(tf.matmul(u_t, w_t), [1, 0, 2])       # [b, i, o*d]
    u_hat = tf.reshape(u_hat, [-1, in_caps, out_caps, out_dim],
                       name="u_hat")                           # [b, i, o, d]
    v, c = routing.dynamic_routing(u_hat, num_iters, stop_gradient)
    return v, c, u_hat


def decoder(capsules, units, out_pixels, compute_dtype=None):
  """Reconstruction decoder: fully connected ReLU layers, then sigmoid.

  Args:
    capsules: `[batch, out_caps * out_dim]` masked, flattened DigitCaps.
    units: hidden layer sizes, e.g. (512, 1024).
    out_pixels: size of the output layer (height * width * channels).
  Returns: `[batch, out_pixels]` in (0, 1).
  """
  with tf.compat.v1.variable_scope("decoder"):
    x = capsules
    sizes = list(units) + [out_pixels]
    for n, size in enumerate(sizes, start=1):
      with tf.compat.v1.variable_scope(f"fc{n}"):
        w = tf.compat.v1.get_variable(
            "weights", [x.shape[-1], size], capsules.dtype,
            tf.compat.v1.glorot_uniform_initializer())
        bias = tf.compat.v1.get_variable("biases", [size], capsules.dtype,
                                         tf.compat.v1.zeros_initializer())
        y = _cast(tf.matmul(_cast(x, compute_dtype), _cast(w, compute_dtype)),
                  capsules.dtype) + bias
        x = tf.sigmoid(y) if n == len(sizes) else tf.nn.relu(y)
    return x
