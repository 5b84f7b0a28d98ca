"""CapsNet layers (Sabour et al. 2017, Section 4). The only `get_variable` calls.

Axis names used in shapes and einsum letters throughout:
  b = batch, i = in_caps (primary capsules), o = out_caps (digit capsules),
  k = in_dim (primary capsule dimension), d = out_dim (digit capsule dimension).

Every layer takes plain ints. `compute_dtype` (None or tf.bfloat16) is the
dtype in which a layer's convolution or large matmul runs; variables keep the
input dtype and results are cast back to it (mixed precision).
"""
import tensorflow as tf

from capsnet import routing


def _cast(x, dtype):
  return x if dtype is None or x.dtype == dtype else tf.cast(x, dtype)


def _conv(x, kernel, channels, stride, compute_dtype, impl="custom_grad"):
  """VALID convolution with bias; variables `weights` and `biases`.

  Args:
    x: `[batch, height, width, in_channels]`.
    impl: "custom_grad" (`_strided_conv`: the gradients of a strided
      convolution as stride-1 convolutions) or "conv2d" (tf.nn.conv2d with
      TensorFlow's own gradients); equal in value and gradient.
  Returns: `[batch, out_h, out_w, channels]` in the dtype of `x`.
  """
  in_ch = x.shape[-1]
  w = tf.compat.v1.get_variable(
      "weights", [kernel, kernel, in_ch, channels], x.dtype,
      tf.compat.v1.glorot_uniform_initializer())
  bias = tf.compat.v1.get_variable("biases", [channels], x.dtype,
                                   tf.compat.v1.zeros_initializer())
  xc, wc = _cast(x, compute_dtype), _cast(w, compute_dtype)
  if impl == "custom_grad" and stride > 1:
    y = _strided_conv(xc, tf.convert_to_tensor(wc), stride)
  elif impl in ("custom_grad", "conv2d"):
    y = tf.nn.conv2d(xc, wc, strides=stride, padding="VALID")
  else:
    raise ValueError(f"conv impl must be 'custom_grad' or 'conv2d', got {impl!r}")
  return _cast(y, x.dtype) + bias


def _strided_conv(x, w, stride):
  """conv2d(x, w, stride, VALID) whose gradients are stride-1 convolutions.

  TensorFlow's strided Conv2DBackpropInput/Filter run on the CPU at a
  fraction of the forward convolution's speed (bench: 2-3x slower in bf16).
  Both gradients are rewritten as forward convolutions, which oneDNN runs fast:
  - input: for each of the stride^2 phases (py, px) of the input grid, a
    full correlation of dy with the flipped sub-kernel w[py::s, px::s]; the
    phases are interleaved with depth_to_space.
  - filter: a convolution of x (batch as channels) with dy as a kernel
    dilated by the stride.

  Args:
    x: `[batch, h, w, c]`; w: `[k, k, c, n]` (a tensor); stride: int.
  Returns: `[batch, (h - k) // stride + 1, (w - k) // stride + 1, n]`.
  """
  @tf.custom_gradient
  def conv(x, w):
    return tf.nn.conv2d(x, w, strides=stride, padding="VALID"), grad

  def grad(dy):
    s = stride
    kh, kw = w.shape[0], w.shape[1]
    h, wd = x.shape[1], x.shape[2]
    rows, cols = -(-h // s), -(-wd // s)           # phase grid size
    phases = []
    for py in range(s):
      for px in range(s):
        j, l = len(range(py, kh, s)), len(range(px, kw, s))
        # w[py::s, px::s] flipped in space, in one strided slice.
        flipped = w[py + s * (j - 1)::-s, px + s * (l - 1)::-s]   # [J, L, c, n]
        kernel = tf.transpose(flipped, [0, 1, 3, 2])               # [J, L, n, c]
        padded = tf.pad(dy, [[0, 0], [j - 1, j - 1], [l - 1, l - 1], [0, 0]])
        phase = tf.nn.conv2d(padded, kernel, strides=1, padding="VALID")
        phases.append(tf.pad(phase, [[0, 0], [0, rows - phase.shape[1]],
                                     [0, cols - phase.shape[2]], [0, 0]]))
    dx = tf.nn.depth_to_space(tf.concat(phases, axis=3), s)[:, :h, :wd, :]
    x_t = tf.transpose(x, [3, 1, 2, 0])              # [c, h, w, batch]
    dy_t = tf.transpose(dy, [1, 2, 0, 3])            # [oh, ow, batch, n]
    dw = tf.nn.conv2d(x_t, dy_t, strides=1, padding="VALID", dilations=s)
    dw = tf.transpose(dw[:, :kh, :kw, :], [1, 2, 0, 3])
    return dx, dw
  return conv(x, w)


def conv1(images, channels, kernel, compute_dtype=None):
  """Conv1: `channels` kernel x kernel filters, stride 1, ReLU.

  Args:
    images: `[batch, height, width, image_channels]` in [0, 1].
  Returns: `[batch, height - kernel + 1, width - kernel + 1, channels]`.
  """
  with tf.compat.v1.variable_scope("conv1"):
    return tf.nn.relu(_conv(images, kernel, channels, 1, compute_dtype))


def primary_caps(x, types, dim, kernel, stride, compute_dtype=None,
                 conv_impl="custom_grad"):
  """PrimaryCaps: a convolution to `types * dim` channels, cut into capsules.

  Args:
    x: `[batch, h, w, channels]` Conv1 output.
  Returns:
    u: `[batch, in_caps, dim]` squashed primary capsules, with
      `in_caps = out_h * out_w * types`.
  """
  with tf.compat.v1.variable_scope("primary_caps"):
    y = _conv(x, kernel, types * dim, stride, compute_dtype, conv_impl)
    in_caps = y.shape[1] * y.shape[2] * types
    u = tf.reshape(y, [-1, in_caps, dim])           # [b, i, k]
    return routing.squash(u)


def digit_caps(u, out_caps, out_dim, num_iters, stop_gradient,
               compute_dtype=None):
  """DigitCaps: `u_hat = W u` per (input, output) capsule pair, then routing.

  W is `[in_caps, out_caps, in_dim, out_dim]` and is not tiled over the batch:
  one batched matmul over the input capsules computes all predictions,
  `[i, b, k] @ [i, k, o*d]`, and one transpose puts the batch first (moving
  rows of o*d contiguous values, ~3x cheaper than the einsum to [b, o, i, d]
  in forward plus backward). No bias is added to `s_j`.

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
    u_t = tf.transpose(_cast(u, compute_dtype), [1, 0, 2])      # [i, b, k]
    w_t = tf.reshape(tf.transpose(_cast(w, compute_dtype), [0, 2, 1, 3]),
                     [in_caps, in_dim, out_caps * out_dim])      # [i, k, o*d]
    u_hat = tf.transpose(tf.matmul(u_t, w_t), [1, 0, 2])       # [b, i, o*d]
    u_hat = tf.reshape(_cast(u_hat, u.dtype), [-1, in_caps, out_caps, out_dim],
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
