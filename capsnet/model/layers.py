"""CapsNet layers (Sabour et al. 2017, Section 4). The model's only `get_variable`
calls (the benchmark's naive baseline, `bench.tiled_digit_caps`, has its own).

Axis names used in the shape comments throughout:
  b = batch, i = in_caps (primary capsules), o = out_caps (digit capsules),
  k = in_dim (primary capsule dimension), d = out_dim (digit capsule dimension).

Initialisers. `official=False` (the default, `capsule_layers="paper"`): Glorot
uniform weights and zero biases, W of DigitCaps from N(0, 0.01), and no bias
in DigitCaps, the layers as the paper's text and its parameter count have
them. `official=True` (`capsule_layers="official"`) follows the authors' code
(Sarasra/models, research/capsules): truncated normal weights, stddev 0.05
for Conv1 and 0.1 elsewhere, every bias 0.1, PrimaryCaps as a one-iteration
capsule layer over its 32 types (`primary_caps`) and DigitCaps with a learned
bias on `s_j` (`digit_caps`).

Every layer takes plain ints, and a `Precision` (decided once, from the
config, by `network.precision_policy`): the variables' dtype, and the compute
dtype in which a layer's convolution or large matmul runs (bfloat16 under
mixed precision). Conv1's output stays in the compute dtype for the
PrimaryCaps convolution; the capsules, routing and decoder outputs are in
the variables' dtype again. Without a `Precision` a layer computes in its
input's dtype. `conv_impl` picks how
the convolutions are computed (`fast_conv.choose_method`), or a plan's
`method` does; every choice gives the same values and gradients.
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
  """VALID convolution with bias (and ReLU); variables `weights`, `biases`.

  Args:
    x: `[batch, height, width, in_channels]`.
    conv_impl: "custom_grad", "conv2d" or "dft" (see `fast_conv.choose_method`).
    method: a `fast_conv.METHODS` name from a plan, instead of `conv_impl`'s rule.
    initializers: (weights, biases) initialisers; default `_initializers(False)`.
    scale: if given, the convolution's output (not its bias) is multiplied
      by it, as the kernel is before the convolution (a power of two is
      exact in every dtype).
  Returns: `[batch, out_h, out_w, channels]` in the compute dtype; the bias
    is added in that dtype.
  """
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
  paper), turning pixel intensities into local feature activities.

  Args:
    images: `[batch, height, width, image_channels]` in [0, 1].
    official: the official code's initialisers (kernel stddev 0.05, bias 0.1).
    method: the convolution's method from a plan (see `_conv`).
  Returns: `[batch, height - kernel + 1, width - kernel + 1, channels]`, in
    the compute dtype (the input of the PrimaryCaps convolution).
  """
  with tf.compat.v1.variable_scope("conv1"):
    return _conv(images, kernel, channels, 1, precision, conv_impl, relu=True,
                 initializers=_initializers(official, stddev=0.05), method=method)


def primary_caps(x, types, dim, kernel, stride, precision=None,
                 conv_impl="custom_grad", official=False, method=None):
  """PrimaryCaps: `types` channels of `dim`-D capsules from one convolution
  (32 types of 8D capsules, 9x9 kernels, stride 2 in the paper: 6x6x32
  capsules on MNIST), each squashed (Eq. 1).

  With `official=True`, as the official code's `conv_slim_capsule` with one
  routing iteration: the coupling is a softmax of zeros over the `types`
  output types, so each capsule's input is the convolution divided by
  `types`, plus a learned bias `[types * dim]` (0.1 at first; it takes the
  place of the convolution's bias, so the parameter count is the same), then
  squashed.

  Args:
    x: `[batch, h, w, channels]` Conv1 output.
    method: the convolution's method from a plan (see `_conv`).
  Returns:
    u: `[batch, in_caps, dim]` primary capsules, in the variables' dtype,
      `in_caps = out_h * out_w * types`, ordered (row, column, type).
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
  """DigitCaps: the predictions `u_hat_j|i = W_ij u_i` of every primary
  capsule i for every digit capsule j, then routing by agreement.

  W is `[in_caps, out_caps, in_dim, out_dim]`, shared by all examples and not
  tiled over the batch: one batched matmul over the input capsules,
  `[i, b, k] @ [i, k, o*d]`, computes all predictions, and one transpose puts
  the batch first. No bias is added to `s_j` (with `official=True`: W from a
  truncated normal, stddev 0.1, and a learned bias `[out_caps, out_dim]`,
  0.1 at first, added to `s_j` before the squash in every iteration, as the
  official code's `capsule` layer has it). It runs in the dtype of `u`
  (float32 under every precision): with 8 multiply-adds per output value it is
  bound by memory, and bfloat16 would only add casts of the largest tensor.

  Args:
    u: `[batch, in_caps, in_dim]` primary capsules.
    out_caps, out_dim: number and dimension of the output capsules.
    num_iters, stop_gradient: see `routing.dynamic_routing`.
  Returns:
    v: `[batch, out_caps, out_dim]`.
    couplings: `num_iters` tensors `[batch, in_caps, out_caps]`, the coupling
      coefficients of each routing iteration, the first one first.
    u_hat: `[batch, in_caps, out_caps, out_dim]` prediction vectors.
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
  """Reconstruction decoder (Section 4.1, Figure 2): fully connected ReLU
  layers (512, 1024 in the paper), then a sigmoid layer of one unit a pixel.
  `official`: the official code's initialisers (stddev 0.1, biases 0.1).

  Args:
    capsules: `[batch, out_caps * out_dim]` DigitCaps with all but one
      capsule masked to zero, flattened.
    units: hidden layer sizes, e.g. (512, 1024).
    out_pixels: size of the output layer (height * width * channels).
  Returns: `[batch, out_pixels]` in (0, 1), in the variables' dtype (the
    matmuls run in the compute dtype).
  """
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
