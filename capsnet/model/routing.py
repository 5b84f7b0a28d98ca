"""Squash (Eq. 1) and dynamic routing (Procedure 1) of Sabour et al. 2017.

Tensor in, tensor out: this module owns no variables and reads no config.

Layout. The prediction vectors are `u_hat[batch, in_caps, out_caps, out_dim]`
and the logits `b` and coefficients `c` are `[batch, in_caps, out_caps]`, the
paper's `b_ij`, `c_ij` (i = input, j = output capsule).

`procedure_1` is Procedure 1 as the paper writes it: `s_j = sum_i c_ij
u_hat_j|i`, the agreement `u_hat_j|i . v_j`. `dynamic_routing`, which the
model uses, computes the same in two batched matmuls over the batch that
read `u_hat` in place, viewed as `[batch, in_caps, out_caps * out_dim]`
(no transpose and no `u_hat`-sized product of the large tensor):
- `s_j`: `c^T @ u_hat` gives `[batch, out_caps, out_caps * out_dim]`, every
  (j, j') pair, of which the diagonal j = j' is kept (out_caps times the
  FLOPs of the sum, still ~1% of the model's);
- the agreement: `u_hat @ V`, with `V[(j, d), j'] = v_jd delta_jj'`
  block-diagonal.
The two agree to rounding (tests/test_routing.py, float64); what the
matmuls buy on this machine: `python -m capsnet.bench --modes=routing`
(routing runs in float32 under both precisions).
"""
import tensorflow as tf

# Added under the square root of |s|^2 so that |s| and its gradient stay finite
# at s = 0 (the official `_squash` divides by |s| and gives NaN there). At
# |s|^2 >= 1e-6 the change in the value is below 1e-6 relative.
_NORM_EPS = 1e-12


def safe_norm(x, axis=-1, keepdims=False):
  """Euclidean norm along `axis` with a finite gradient at the zero vector."""
  return tf.sqrt(tf.reduce_sum(tf.square(x), axis=axis, keepdims=keepdims)
                 + _NORM_EPS)


def squash(s, axis=-1):
  """Squash non-linearity (Eq. 1): `|s|^2 / (1 + |s|^2) * s / |s|`.

  Keeps the direction of `s` and maps its length into [0, 1). Value and
  gradient are finite (both zero) at `s = 0`.

  Args:
    s: `[..., dim]` capsule input vectors.
    axis: the capsule dimension.
  Returns: a tensor of the shape of `s`.
  """
  with tf.name_scope("squash"):
    sq = tf.reduce_sum(tf.square(s), axis=axis, keepdims=True)
    norm = tf.sqrt(sq + _NORM_EPS)
    return s * (sq / ((1.0 + sq) * norm))


def ordered_sum(tensors):
  """`tensors[0] + tensors[1] + ...`, added left to right: the same bits in
  every run, however busy the machine.

  `tf.add_n`, and the AddN that `tf.gradients` puts where a tensor has
  several consumers, is not: TensorFlow's CPU kernel moves whichever input
  buffer it may reuse for its output to the front of the sum, and which one
  that is depends on which other ops still hold their inputs at that moment
  (measured: two 100-step `r3_recon_nostop` runs repeated bit for bit on an
  idle machine and differed in every variable beside a busy loop;
  docs/training.md). A binary add is commutative, so a chain of them gives
  one answer; a reshape between the links (flat, then the input's shape)
  keeps Grappler's arithmetic optimizer from merging the chain back into
  one AddN.
  """
  total = tensors[0]
  for k, t in enumerate(tensors[1:]):
    shape = [-1] if k % 2 == 0 else tf.shape(tensors[0])
    total = tf.add(tf.reshape(total, shape), tf.reshape(t, shape))
  return tf.reshape(total, tf.shape(tensors[0]))


def _reads(x, n):
  """`n` reads of `x` whose gradients are added in a fixed order
  (`ordered_sum`) rather than by one AddN."""
  @tf.custom_gradient
  def fan_out(x):
    return [tf.identity(x) for _ in range(n)], lambda *dys: ordered_sum(dys)
  return fan_out(x) if n > 2 else [x] * n


def _check(u_hat, num_iters):
  if u_hat.shape.rank != 4:
    raise ValueError("dynamic_routing: u_hat must be [batch, in_caps, "
                     f"out_caps, out_dim], got shape {u_hat.shape}")
  if num_iters < 1:
    raise ValueError(f"dynamic_routing: num_iters must be >= 1, got {num_iters}")


def procedure_1(u_hat, num_iters, stop_gradient=True, bias=None):
  """Routing by agreement as the paper's Procedure 1 writes it; arguments
  and results as `dynamic_routing`'s, which computes the same faster."""
  _check(u_hat, num_iters)
  with tf.compat.v1.variable_scope("routing"):
    u_stopped = tf.stop_gradient(u_hat) if stop_gradient else u_hat
    b = tf.zeros_like(u_hat[..., 0])                    # b_ij = 0
    couplings = []
    for r in range(num_iters):
      with tf.compat.v1.variable_scope(f"iter_{r}"):
        last = r == num_iters - 1
        u = u_hat if last else u_stopped
        c = tf.nn.softmax(b, axis=2, name="c")          # c_i = softmax(b_i)
        couplings.append(c)
        s = tf.reduce_sum(c[..., None] * u, axis=1)     # s_j = sum_i c_ij u_hat_j|i
        if bias is not None:
          s = s + bias
        v = squash(s)                                   # v_j = squash(s_j)
        if not last:
          b = b + tf.reduce_sum(u * v[:, None], axis=3)  # b_ij += u_hat_j|i . v_j
    return v, couplings


def dynamic_routing(u_hat, num_iters, stop_gradient=True, bias=None):
  """Routing by agreement (Procedure 1), unrolled in Python.

  One `variable_scope("iter_{r}")` per iteration. The logits `b` start at zero
  for every example (never shared across the batch); `c = softmax(b)` over the
  output capsules. With `stop_gradient=True` the inner iterations
  (r < num_iters - 1) read `tf.stop_gradient(u_hat)`: their forward values are
  unchanged, but no gradient flows through the coupling coefficients, so the
  loss reaches `u_hat` only through the last weighted sum
  `s = sum_i c_ij u_hat_j|i` with `c` acting as a constant. With
  `stop_gradient=False` every iteration reads the live `u_hat` (the 2r - 1
  reads' gradients added in a fixed order, `ordered_sum`).

  Args:
    u_hat: `[batch, in_caps, out_caps, out_dim]` prediction vectors.
    num_iters: number of routing iterations r >= 1.
    stop_gradient: whether the inner iterations read a stopped `u_hat`.
    bias: None, or `[out_caps, out_dim]` added to `s_j` before the squash in
      every iteration (the official code's capsule layer).
  Returns:
    v: `[batch, out_caps, out_dim]` output capsules (squashed).
    couplings: `num_iters` tensors `[batch, in_caps, out_caps]`, the coupling
      coefficients of each iteration, the first one first; each sums to 1
      over `out_caps`.
  Raises:
    ValueError: if `u_hat` is not rank 4 or `num_iters < 1`.
  """
  _check(u_hat, num_iters)
  in_caps, out_caps, out_dim = u_hat.shape[1:]
  with tf.compat.v1.variable_scope("routing"):
    eye = tf.eye(out_caps, dtype=u_hat.dtype)           # [o, o]
    flat = [-1, in_caps, out_caps * out_dim]
    u_live = tf.reshape(u_hat, flat, name="u_hat_flat")  # [b, i, o*d]
    if stop_gradient:   # the inner iterations' reads, then the last one's
      u_stopped = tf.reshape(tf.stop_gradient(u_hat), flat, name="u_hat_stopped_flat")
      reads = [u_stopped] * (2 * num_iters - 2) + [u_live]
    else:
      reads = _reads(u_live, 2 * num_iters - 1)
    b = tf.zeros_like(u_hat[..., 0])                    # [b, i, o]
    couplings = []
    for r in range(num_iters):
      with tf.compat.v1.variable_scope(f"iter_{r}"):
        last = r == num_iters - 1
        c = tf.nn.softmax(b, axis=2, name="c")          # [b, i, o]
        couplings.append(c)
        pairs = tf.matmul(c, reads[2 * r], transpose_a=True)  # [b, o, o*d]
        pairs = tf.reshape(pairs, [-1, out_caps, out_caps, out_dim])
        s = tf.reduce_sum(pairs * eye[:, :, None], axis=2, name="s")  # [b, o, d]
        if bias is not None:
          s = s + bias
        v = squash(s)                                   # [b, o, d]
        if not last:
          v_block = tf.reshape(v[:, :, :, None] * eye[:, None, :],
                               [-1, out_caps * out_dim, out_caps])  # [b, o*d, o]
          b = tf.add(b, tf.matmul(reads[2 * r + 1], v_block), name="b")  # [b, i, o]
    return v, couplings
