"""Squash (Eq. 1) and dynamic routing (Procedure 1) of Sabour et al. 2017;
tensors in and out, no variables, no config.

`u_hat` is `[batch, in_caps, out_caps, out_dim]`, the logits `b` and couplings
`c` `[batch, in_caps, out_caps]` (the paper's `b_ij`, `c_ij`). `procedure_1` is
Procedure 1 as the paper writes it. `dynamic_routing`, which the model uses,
computes the same in two batched matmuls that read `u_hat` in place as `[batch,
in_caps, out_caps * out_dim]`: `s_j` as the diagonal j = j' of `c^T @ u_hat`,
the agreement as `u_hat @ V` with `V[(j, d), j'] = v_jd delta_jj'`. They agree
to rounding (tests/test_routing.py); the speed: `python -m capsnet.bench
--modes=routing`.
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
  """Squash non-linearity (Eq. 1) along `axis`: `|s|^2 / (1 + |s|^2) * s / |s|`,
  the direction of `s` kept, its length mapped into [0, 1); value and gradient
  are finite (zero) at `s = 0`."""
  with tf.name_scope("squash"):
    sq = tf.reduce_sum(tf.square(s), axis=axis, keepdims=True)
    norm = tf.sqrt(sq + _NORM_EPS)
    return s * (sq / ((1.0 + sq) * norm))


def ordered_sum(tensors):
  """`tensors[0] + tensors[1] + ...`, added left to right: the same bits in
  every run, however busy the machine.

  `tf.add_n` (and the AddN `tf.gradients` puts where a tensor has several
  consumers) is not: the CPU kernel moves whichever input buffer it may reuse to
  the front of the sum, which depends on timing (docs/training.md). A reshape
  between the links keeps Grappler from merging the chain into AddN.
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
  """Routing by agreement (Procedure 1), unrolled in Python, one
  `variable_scope("iter_{r}")` per iteration.

  The logits `b` start at zero for every example; `c = softmax(b)` over the
  output capsules. With `stop_gradient` the inner iterations read
  `tf.stop_gradient(u_hat)`: the same values, but no gradient flows through the
  coupling coefficients, so the loss reaches `u_hat` only through the last
  weighted sum `s = sum_i c_ij u_hat_j|i`, `c` acting as a constant. Without it
  every iteration reads the live `u_hat` (the 2r - 1 reads' gradients added by
  `ordered_sum`). `bias` `[out_caps, out_dim]` (the official code's) is added to
  `s_j` in every iteration.

  Returns: v `[batch, out_caps, out_dim]` (squashed); the `num_iters` coupling
  coefficients `[batch, in_caps, out_caps]`, first first. Raises ValueError if
  `u_hat` is not rank 4 or `num_iters < 1`.
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
