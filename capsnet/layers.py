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


def _conv(x, kernel, channels, stride, compute_dtype, impl="conv2d"):
  """VALID convolution with bias; variables `weights` and `biases`.

  Args:
    x: `[batch, height, width, in_channels]`.
    impl: "conv2d" (tf.nn.conv2d) or "gemm" (image patches times the weights
      as one large matmul); equal in value and gradient.
  Returns: `[batch, out_h, out_w, channels]` in the dtype of `x`.
  """
  in_ch = x.shape[-1]
  w = tf.compat.v1.get_variable(
      "weights", [kernel, kernel, in_ch, channels], x.dtype,
      tf.compat.v1.glorot_uniform_initializer())
  bias = tf.compat.v1.get_variable("biases", [channels], x.dtype,
                                   tf.compat.v1.zeros_initializer())
  xc, wc = _cast(x, compute_dtype), _cast(w, compute_dtype)
  if impl == "conv2d":
    y = tf.nn.conv2d(xc, wc, strides=stride, padding="VALID")
  elif impl == "gemm":
    patches = tf.image.extract_patches(
        xc, sizes=[1, kernel, kernel, 1], strides=[1, stride, stride, 1],
        rates=[1, 1, 1, 1], padding="VALID")       # [b, oh, ow, k*k*in_ch]
    # extract_patches orders each patch as (row, col, channel), as conv2d's
    # filter is laid out, so the filter reshapes to [k*k*in_ch, channels].
    y = tf.tensordot(patches, tf.reshape(wc, [-1, channels]), axes=1)
  else:
    raise ValueError(f"conv impl must be 'conv2d' or 'gemm', got {impl!r}")
  return _cast(y, x.dtype) + bias


def conv1(images, channels, kernel, compute_dtype=None):
  """Conv1: `channels` kernel x kernel filters, stride 1, ReLU.

  Args:
    images: `[batch, height, width, image_channels]` in [0, 1].
  Returns: `[batch, height - kernel + 1, width - kernel + 1, channels]`.
  """
  with tf.compat.v1.variable_scope("conv1"):
    return tf.nn.relu(_conv(images, kernel, channels, 1, compute_dtype))


def primary_caps(x, types, dim, kernel, stride, compute_dtype=None,
                 conv_impl="conv2d"):
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
  one einsum computes all predictions. No bias is added to `s_j`.

  Args:
    u: `[batch, in_caps, in_dim]` primary capsules.
    out_caps, out_dim: number and dimension of the output capsules.
    num_iters, stop_gradient: see `routing.dynamic_routing`.
  Returns:
    v: `[batch, out_caps, out_dim]`.
    c: `[batch, in_caps, out_caps]` coupling coefficients (last iteration).
    u_hat: `[batch, out_caps, in_caps, out_dim]` prediction vectors.
  """
  with tf.compat.v1.variable_scope("digit_caps"):
    in_caps, in_dim = u.shape[1], u.shape[2]
    w = tf.compat.v1.get_variable(
        "weights", [in_caps, out_caps, in_dim, out_dim], u.dtype,
        tf.compat.v1.random_normal_initializer(stddev=0.01))
    u_hat = tf.einsum("bik,iokd->boid", _cast(u, compute_dtype),
                      _cast(w, compute_dtype))
    u_hat = tf.identity(_cast(u_hat, u.dtype), name="u_hat")  # [b, o, i, d]
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
