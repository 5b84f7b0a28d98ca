"""CapsNet layers (Sabour et al. 2017, Section 4); the model's only
`get_variable` calls. Shape comments: b = batch, i = in_caps (primary capsules),
o = out_caps (digit capsules), k = in_dim, d = out_dim.

`official=False` (capsule_layers="paper") gives the paper's text: Glorot uniform
weights, zero biases, W from N(0, 0.01), no DigitCaps bias. `official=True`
follows the authors' code (Sarasra/models, research/capsules): truncated normal
weights (stddev 0.05 for Conv1, else 0.1), biases 0.1, PrimaryCaps as a
one-iteration capsule layer and a bias on DigitCaps' `s_j`.

A `Precision` (from `network.precision_policy`) gives the variables' dtype and
the compute dtype of the convolutions and the decoder's matmuls (bfloat16 under
mixed precision); without one a layer computes in its input's dtype.
`conv_impl`'s rule, or a plan's `method`, picks how a convolution is computed;
every choice gives the same values and gradients.
"""
import collections

import tensorflow as tf

from capsnet.model import fast_conv
from capsnet.model import routing

Precision = collections.namedtuple("Precision", [
    "variables",   # dtype of the variables, capsules, routing and outputs
    "compute",     # dtype of the convolutions and the decoder's matmuls
])


def _precision(precision, x):
  """`precision`, or `x`'s dtype for both."""
  return precision or Precision(x.dtype, x.dtype)


def _cast(x, dtype):
  return x if x.dtype == dtype else tf.cast(x, dtype)


def _initializers(official, stddev=0.1):
  """(weights, biases) initialisers: the paper's default or the official code's."""
  if official:
    return (tf.compat.v1.truncated_normal_initializer(stddev=stddev),
            tf.compat.v1.constant_initializer(0.1))
  return tf.compat.v1.glorot_uniform_initializer(), tf.compat.v1.zeros_initializer()


def _conv(x, kernel, channels, stride, precision, conv_impl, relu=False,
          initializers=None, scale=None, method=None):
  """VALID convolution with bias (and ReLU), variables `weights` and `biases`,
  in the compute dtype: `[batch, out_h, out_w, channels]`. `method` (a plan's)
  or `conv_impl`'s rule picks the `fast_conv` method; `scale` multiplies the
  kernel (exact for a power of two), not the bias."""
  p = _precision(precision, x)
  in_ch = x.shape[-1]
  w_init, b_init = initializers or _initializers(False)
  w = tf.compat.v1.get_variable(
      "weights", [kernel, kernel, in_ch, channels], p.variables, w_init)
  bias = tf.compat.v1.get_variable("biases", [channels], p.variables, b_init)
  if scale is not None:
    w = w * scale
  xc, wc = _cast(x, p.compute), _cast(w, p.compute)
  method = method or fast_conv.choose_method(conv_impl, p.compute, stride,
                                             kernel * kernel * in_ch)
  return fast_conv.conv2d(xc, wc, _cast(bias, p.compute), stride, method, relu)


def conv1(images, channels, kernel, precision=None, conv_impl="custom_grad",
          official=False, method=None):
  """Conv1: `channels` kernel x kernel filters, stride 1, ReLU (256 9x9 in the
  paper), turning pixel intensities into local feature activities. Returns
  `[batch, h - kernel + 1, w - kernel + 1, channels]` in the compute dtype."""
  with tf.compat.v1.variable_scope("conv1"):
    return _conv(images, kernel, channels, 1, precision, conv_impl, relu=True,
                 initializers=_initializers(official, stddev=0.05), method=method)


def primary_caps(x, types, dim, kernel, stride, precision=None,
                 conv_impl="custom_grad", official=False, method=None):
  """PrimaryCaps: `types` channels of `dim`-D capsules from one convolution (32
  types of 8D capsules, 9x9, stride 2: 6x6x32 on MNIST), each squashed (Eq. 1).
  Returns u `[batch, in_caps, dim]` in the variables' dtype, ordered (row,
  column, type).

  `official`: as the authors' `conv_slim_capsule` with one routing iteration,
  the convolution divided by `types` plus a learned bias (0.1 at first; it takes
  the convolution bias's place), then squashed.
  """
  with tf.compat.v1.variable_scope("primary_caps"):
    p = _precision(precision, x)
    y = _conv(x, kernel, types * dim, stride, p, conv_impl,
              initializers=_initializers(official),
              scale=1.0 / types if official else None, method=method)
    y = _cast(y, p.variables)
    in_caps = y.shape[1] * y.shape[2] * types
    u = tf.reshape(y, [-1, in_caps, dim])           # [b, i, k]
    return routing.squash(u)


def digit_caps(u, out_caps, out_dim, num_iters, stop_gradient, official=False):
  """DigitCaps: the predictions `u_hat_j|i = W_ij u_i` of every primary capsule
  i for every digit capsule j, then routing by agreement.

  W `[in_caps, out_caps, in_dim, out_dim]` is not tiled over the batch: one
  batched matmul over the input capsules, `[i, b, k] @ [i, k, o*d]`, and a
  transpose. `official`: W from a truncated normal and a learned bias on `s_j`
  in every iteration. It runs in `u`'s dtype (float32 under every precision:
  memory-bound, bfloat16 would only add casts).

  Returns: v `[batch, out_caps, out_dim]`; the `num_iters` couplings `[batch,
  in_caps, out_caps]`, first first; u_hat `[b, i, o, d]`.
  """
  with tf.compat.v1.variable_scope("digit_caps"):
    in_caps, in_dim = u.shape[1], u.shape[2]
    w_init = (_initializers(True)[0] if official
              else tf.compat.v1.random_normal_initializer(stddev=0.01))
    w = tf.compat.v1.get_variable(
        "weights", [in_caps, out_caps, in_dim, out_dim], u.dtype, w_init)
    u_t = tf.transpose(u, [1, 0, 2])                            # [i, b, k]
    w_t = tf.reshape(tf.transpose(w, [0, 2, 1, 3]),
                     [in_caps, in_dim, out_caps * out_dim])      # [i, k, o*d]
    u_hat = tf.transpose(tf.matmul(u_t, w_t), [1, 0, 2])       # [b, i, o*d]
    u_hat = tf.reshape(u_hat, [-1, in_caps, out_caps, out_dim],
                       name="u_hat")                           # [b, i, o, d]
    bias = None
    if official:
      bias = tf.compat.v1.get_variable("biases", [out_caps, out_dim], u.dtype,
                                       _initializers(True)[1])
    v, couplings = routing.dynamic_routing(u_hat, num_iters, stop_gradient, bias)
    return v, couplings, u_hat


def decoder(capsules, units, out_pixels, precision=None, official=False):
  """Reconstruction decoder (Section 4.1, Figure 2): fully connected ReLU layers
  of `units` (512, 1024), then a sigmoid unit a pixel, on the masked, flattened
  DigitCaps `[batch, out_caps * out_dim]`. Returns `[batch, out_pixels]` in the
  variables' dtype."""
  p = _precision(precision, capsules)
  w_init, b_init = _initializers(official)
  with tf.compat.v1.variable_scope("decoder"):
    x = capsules
    sizes = list(units) + [out_pixels]
    for n, size in enumerate(sizes, start=1):
      with tf.compat.v1.variable_scope(f"fc{n}"):
        w = tf.compat.v1.get_variable(
            "weights", [x.shape[-1], size], p.variables, w_init)
        bias = tf.compat.v1.get_variable("biases", [size], p.variables, b_init)
        y = _cast(tf.matmul(_cast(x, p.compute), _cast(w, p.compute)),
                  p.variables) + bias
        x = tf.sigmoid(y) if n == len(sizes) else tf.nn.relu(y)
    return x
