"""Fast VALID convolutions for the CPU: the values and gradients of
`tf.nn.conv2d`, in forms that oneDNN runs fast.

`conv2d(x, w, bias, stride, method, relu)` computes one by a `METHODS` name,
which `choose_method` picks by rule or a host's plan (`capsnet.running.planner`)
names: "conv2d" (TensorFlow's), "patch_gemm" (stride 1: the filter and bias
gradients as one GEMM), "dilated" (stride > 1: the gradients as stride-1
convolutions), "folded" (stride > 1, bfloat16: images side by side) and "dft"
(an exact DFT whose transforms are small real matmuls). Each is tested against
`tf.nn.conv2d` in float64; how each works and costs: docs/performance.md.
"""
import numpy as np
import tensorflow as tf

METHODS = ("conv2d", "patch_gemm", "dilated", "folded", "dft")

# Largest patch (kernel * kernel * in_channels) for "patch_gemm": its one-hot
# patch convolution costs patch^2 multiply-adds per output position, against
# patch * out_channels for the convolution itself.
MAX_GEMM_PATCH = 256

# Images side by side along the width in the "folded" method.
FOLD = 4


IMPLS = ("auto", "custom_grad", "conv2d", "dft")
# The model's convolutions, as a plan names them.
LAYERS = ("conv1", "primary_caps")


def on_gpu(device):
  """Whether `device` (e.g. "/gpu:0"; None: not given) is a GPU."""
  return device is not None and "gpu" in device.lower()


def resolve_impl(conv_impl, device=None):
  """The `conv_impl` a model on `device` computes with: "auto" is "conv2d" on a
  GPU, "custom_grad" elsewhere. Raises ValueError if unknown."""
  if conv_impl not in IMPLS:
    raise ValueError(f"conv_impl must be one of {IMPLS}, got {conv_impl!r}")
  if conv_impl != "auto":
    return conv_impl
  return "conv2d" if on_gpu(device) else "custom_grad"


def choose_method(conv_impl, dtype, stride, patch_size):
  """The `METHODS` name for one convolution of `stride` and `patch_size` (kernel
  area * input channels) in `dtype`, by `conv_impl`'s rule. Raises ValueError
  for an unknown `conv_impl`."""
  if conv_impl not in ("custom_grad", "conv2d", "dft"):
    raise ValueError("conv_impl must be 'custom_grad', 'conv2d' or 'dft', "
                     f"got {conv_impl!r}")
  if conv_impl == "conv2d":
    return "conv2d"
  if conv_impl == "dft" and stride > 1:
    return "dft"
  if stride == 1:
    return "patch_gemm" if patch_size <= MAX_GEMM_PATCH else "conv2d"
  return "folded" if tf.as_dtype(dtype) == tf.bfloat16 else "dilated"


def candidates(stride):
  """The methods that can compute a convolution of this stride."""
  if stride == 1:
    return ("conv2d", "patch_gemm", "dft")
  return ("conv2d", "dilated", "folded", "dft")


def format_plan(methods):
  """"conv1:patch_gemm,primary_caps:dft" from {layer: method}."""
  return ",".join(f"{layer}:{methods[layer]}" for layer in LAYERS)


def parse_plan(plan):
  """{layer: method} of a plan string ("" -> {}). Raises ValueError naming the
  plan for an unknown, missing or misfit layer or method."""
  if not plan:
    return {}
  methods = {}
  for part in plan.split(","):
    layer, _, method = part.partition(":")
    if layer not in LAYERS or method not in METHODS or layer in methods:
      raise ValueError(f"conv_plan={plan!r}: expected {format_plan(dict.fromkeys(LAYERS, 'M'))} "
                       f"with each M one of {METHODS}")
    methods[layer] = method
  if set(methods) != set(LAYERS):
    raise ValueError(f"conv_plan={plan!r}: names {sorted(methods)}, expected {list(LAYERS)}")
  if methods["conv1"] in ("dilated", "folded"):
    raise ValueError(f"conv_plan={plan!r}: conv1 has stride 1; {methods['conv1']!r} "
                     "needs a stride > 1")
  return methods


def conv2d(x, w, bias, stride, method, relu=False):
  """`relu(conv2d(x, w, stride, VALID) + bias)` computed by `method`.

  x `[batch, h, w, c]`, w `[k, k', c, n]` and bias `[n]` in one dtype. Raises
  ValueError for an unknown method or one that does not take the stride.
  """
  if method not in METHODS:
    raise ValueError(f"fast_conv.conv2d: method must be one of {METHODS}, got {method!r}")
  if (method == "patch_gemm") != (stride == 1) and method not in ("conv2d", "dft"):
    raise ValueError(f"fast_conv.conv2d: method {method!r} does not take "
                     f"stride {stride}")
  if method == "patch_gemm":
    return _patch_grad_conv(x, tf.convert_to_tensor(w), bias, relu)
  if method == "conv2d":
    y = tf.nn.conv2d(x, w, strides=stride, padding="VALID")
  elif method == "dft":
    with tf.name_scope("dft"):
      y = _dft_conv(x, tf.convert_to_tensor(w), stride)
  else:
    y = _strided_conv(x, tf.convert_to_tensor(w), stride, folded=method == "folded")
  y = tf.nn.bias_add(y, bias)
  return tf.nn.relu(y) if relu else y


def _patch_grad_conv(x, w, bias, relu):
  """Stride-1 `conv2d(x, w) + bias` (then ReLU) whose filter and bias gradients
  are one GEMM, `[patches, 1]^T @ dy`."""
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
  """conv2d(x, w, stride, VALID) whose gradients are stride-1 convolutions;
  `folded`: the "folded" method, else "dilated"."""
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
  """Input gradient of `conv2d(x, w, s, VALID)` as one stride-1 convolution: `w`
  (output channels as the batch) is the input, zero-padded by the convolution,
  and dy (flipped) the kernel, dilated by s.

  `dx[b, y, c] = sum_{o, n} dy[b, o, n] w[y - s*o, c, n]`: with `q = oh - 1 -
  o`, w's index is `y + s*q - s*(oh - 1)`.
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
  space-to-depth view of x, `FOLD` images side by side along the width.

  The kernel, zero-padded to a multiple of the stride, becomes `[ceil(k/s),
  ceil(k'/s), s*s*c, n]`; the output columns that straddle two images are
  dropped.
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
  """Input gradient of `conv2d(x, w, s, VALID)`, phase by phase: phase (py, px)
  of dx is the full correlation of dy with the sub-kernel `w[py::s, px::s]`,
  computed as a stride-1 input gradient, with `FOLD` images side by side (each
  followed by zero columns); one transpose interleaves the phases into `[batch,
  h, wd, c]`."""
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
      kr, kc = len(range(py, kh, s)), len(range(px, kw, s))   # the phase's kernel rows, columns
      ph, pw = oh + kr - 1, ow + kc - 1                # full correlation size
      rhs = tf.pad(dy, [[0, 0], [0, 0], [0, kc - 1], [0, 0]])
      rhs = _fold_width(rhs, fold)[:, :, :fold * pw - (kc - 1)]
      sizes = tf.stack([tf.shape(rhs)[0], ph, fold * pw, c])
      phase = tf.compat.v1.nn.conv2d_backprop_input(
          sizes, wp[:kr, py, :kc, px], rhs, strides=[1, 1, 1, 1], padding="VALID")
      phase = tf.reshape(phase, [-1, ph, fold, pw, c])
      phases.append(tf.pad(phase, [[0, 0], [0, rows - ph], [0, 0],
                                   [0, cols - pw], [0, 0]]))
  dx = tf.reshape(tf.stack(phases, axis=4), [-1, rows, fold, cols, s, s, c])
  dx = tf.transpose(dx, [0, 2, 1, 4, 3, 5, 6])      # [b/f, f, rows, s, cols, s, c]
  dx = tf.reshape(dx, [-1, rows * s, cols * s, c])
  return dx[:batch, :h, :wd]


def _kernel_phases(w, s):
  """`w` zero-padded to multiples of s, viewed as `[ceil(k/s), s, ceil(k'/s), s,
  c, n]`: `w[s*q + p]` at `[q, p]`."""
  kh, kw, c, n = w.shape
  rk, rl = -(-kh // s), -(-kw // s)
  wp = tf.pad(w, [[0, rk * s - kh], [0, rl * s - kw], [0, 0], [0, 0]])
  return tf.reshape(wp, [rk, s, rl, s, c, n])


def _fold_width(t, fold):
  """`[b, h, w, c]` -> `[b / fold, h, fold * w, c]`: images side by side."""
  _, h, wd, c = t.shape
  t = tf.reshape(t, [-1, fold, h, wd, c])
  return tf.reshape(tf.transpose(t, [0, 2, 1, 3, 4]), [-1, h, fold * wd, c])


def _dft_matrices(size, used, outputs, stride, real):
  """The DFT's real matrices along one axis (float64 numpy) of `size` positions
  of which the first `used` = N are read (N points), with `outputs` outputs at
  0, stride, ...; `real`: bins 0 .. N // 2 only.

  Returns (cos, -sin) [bins, size] of the forward transform and (icos, isin)
  [outputs, bins] of the inverse at the outputs (over N; a real DFT's bins
  weighted for their conjugate twins).
  """
  n = used
  bins = n // 2 + 1 if real else n
  f = np.arange(bins)[:, None]
  angle = 2 * np.pi * f * np.arange(size)[None, :] / n
  mask = (np.arange(size) < n)[None, :]
  cos, msin = np.cos(angle) * mask, -np.sin(angle) * mask
  p = stride * np.arange(outputs)[:, None]
  back = 2 * np.pi * p * np.arange(bins)[None, :] / n
  weight = np.ones(bins) / n
  if real:   # bins 1 .. ceil(N/2) - 1 stand for their twins N - f too
    weight[1:(n + 1) // 2] *= 2
  return cos, msin, np.cos(back) * weight, np.sin(back) * weight


# The products' operands as real combinations (a re + b im) of the DFTs, and
# how the products add up to the result's (re, im): Gauss's three real
# products for the complex product X conj(W) per bin (k1 = (Xr + Xi) Wr,
# k2 = Xr (-Wi - Wr), k3 = Xi (Wr - Wi); re = k1 - k3, im = k1 + k2), or in
# bfloat16 the parts themselves (four products, `_dft_conv`).
GAUSS = ([(1, 1), (1, 0), (0, 1)], [(1, 0), (-1, -1), (1, -1)], [(1, 1), (0, 1), (-1, 0)])
PARTS = ([(1, 0), (0, 1)], [(1, 0), (0, 1)], [(1, 0), (0, 1)])


def _dft2(t, rows, cols, mix, dtype):
  """Real combinations `mix` [(a, b), ...] (a re + b im) of the 2-D DFT of `t`
  `[h, w, ...]` (real along w) in two matmuls, by the `_dft_matrices` `rows` and
  `cols`: `[len(mix) * bins_h, bins_w * prod(...)]`."""
  (hc, hs), (wc, ws) = rows[:2], cols[:2]
  h, w = t.shape[0], t.shape[1]
  a_b = tf.matmul(tf.constant(np.concatenate([wc, ws]), dtype),
                  tf.reshape(t, [h, w, -1]))                 # [h, (re|im, bins_w), ...]
  # re = hc a - hs b, im = hs a + hc b, over the columns (h, re|im)
  re, im = np.stack([hc, -hs], axis=2), np.stack([hs, hc], axis=2)
  m = np.concatenate([ca * re + cb * im for ca, cb in mix]).reshape(-1, 2 * h)
  return tf.matmul(tf.constant(m, dtype), tf.reshape(a_b, [2 * h, -1]))


def _idft2(p, rows, cols, mix, dtype):
  """The real part of the inverse at the strided outputs of `re = sum_q a_q
  p_q`, `im = sum_q b_q p_q` for `mix` [(a_q, b_q), ...], in two matmuls:
  `[outputs_h, outputs_w, r]` from `p` `[len(mix) * bins_h, bins_w * r]`."""
  (hic, his), (wic, wis) = rows[2:], cols[2:]
  oh, bw = hic.shape[0], wic.shape[1]
  # z_re = hic re - his im, z_im = his re + hic im; rows (output row, re|im)
  zr = np.concatenate([ca * hic - cb * his for ca, cb in mix], axis=1)
  zi = np.concatenate([ca * his + cb * hic for ca, cb in mix], axis=1)
  m = np.stack([zr, zi], axis=1).reshape(2 * oh, -1)
  z = tf.matmul(tf.constant(m, dtype), p)                     # [(oh, re|im), bins_w * r]
  z = tf.reshape(z, [oh, 2 * bw, -1])
  return tf.matmul(tf.constant(np.concatenate([wic, -wis], axis=1), dtype), z)


def _dft_conv(x, w, stride):
  """conv2d(x, w, stride, VALID) by the discrete Fourier transform (exact).

  The correlation on the used extent N = stride (outputs - 1) + kernel is the
  inverse DFT of `X conj(W)`; nothing wraps round at the strided outputs. Per
  bin the complex product is Gauss's three real matmuls (`GAUSS`), one batched
  matmul. In bfloat16 the transforms are float32 and the contraction four
  bfloat16 products (`PARTS`): TensorFlow's CPU matmul rounds a bfloat16 product
  to bfloat16, and Gauss's k1 - k3 would cancel.
  """
  h, wd, c = x.shape[1], x.shape[2], x.shape[3]
  kh, kw, _, n = w.shape
  oh, ow = (h - kh) // stride + 1, (wd - kw) // stride + 1
  nh, nw = stride * (oh - 1) + kh, stride * (ow - 1) + kw
  bins = nh * (nw // 2 + 1)
  compute = x.dtype
  exact = tf.float64 if compute == tf.float64 else tf.float32
  rows, cols = _dft_matrices(h, nh, oh, stride, False), _dft_matrices(wd, nw, ow, stride, True)
  krows, kcols = _dft_matrices(kh, nh, oh, stride, False), _dft_matrices(kw, nw, ow, stride, True)
  x_mix, w_mix, y_mix = PARTS if compute == tf.bfloat16 else GAUSS
  xt = tf.transpose(tf.cast(x, exact), [1, 2, 0, 3])        # [h, w, b, c]
  xs = tf.reshape(_dft2(xt, rows, cols, x_mix, exact), [len(x_mix), bins, -1, c])
  ws = tf.reshape(_dft2(tf.cast(w, exact), krows, kcols, w_mix, exact),
                  [len(w_mix), bins, c, n])
  with tf.name_scope("products"):   # (the benchmark's roofline books them apart)
    if compute == tf.bfloat16:
      def low(t):
        return tf.cast(t, compute)
      def mm(a, b):
        return tf.cast(tf.matmul(low(a), low(b)), exact)
      (xr, xi), (wr, wi) = tf.unstack(xs), tf.unstack(ws)
      y = tf.stack([mm(xr, wr) + mm(xi, wi), mm(xi, wr) - mm(xr, wi)])
    else:
      y = tf.matmul(xs, ws)                                  # k1, k2, k3: [3, bins, b, n]
  y = _idft2(tf.reshape(y, [len(y_mix) * nh, -1]), rows, cols, y_mix, exact)
  y = tf.reshape(y, [oh, ow, -1, n])                          # [oh, ow, b, n]
  return tf.cast(tf.transpose(y, [2, 0, 1, 3]), compute)
