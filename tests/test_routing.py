"""squash and routing against NumPy and hand derivations; the model's
matmul form of routing against the paper's sums (`procedure_1`)."""
import numpy as np
import pytest
import tensorflow as tf

from capsnet.model import routing


def np_squash(s):
  sq = np.sum(s ** 2, axis=-1, keepdims=True)
  return sq / (1 + sq) * s / np.sqrt(sq)


def run(fetches, feed=None):
  with tf.compat.v1.Session() as sess:
    return sess.run(fetches, feed)


def test_squash_norm_below_one_and_direction_kept():
  s = np.random.RandomState(0).randn(5, 7, 4) * np.array([0.01, 0.5, 3.0, 50.0])
  with tf.Graph().as_default():
    out = run(routing.squash(tf.constant(s)))
  norms = np.linalg.norm(out, axis=-1)
  assert np.all(norms < 1.0)
  np.testing.assert_allclose(norms, np.linalg.norm(np_squash(s), axis=-1), rtol=1e-9)
  cos = np.sum(out * s, -1) / (norms * np.linalg.norm(s, axis=-1))
  np.testing.assert_allclose(cos, 1.0, atol=1e-12)


def test_squash_value_and_gradient_finite_at_zero():
  with tf.Graph().as_default():
    s = tf.zeros([2, 3], tf.float64)
    v = routing.squash(s)
    grad = tf.gradients(tf.reduce_sum(v), s)[0]
    v_val, g_val = run([v, grad])
  np.testing.assert_array_equal(v_val, np.zeros([2, 3]))
  assert np.all(np.isfinite(g_val))
  np.testing.assert_array_equal(g_val, np.zeros([2, 3]))


def test_squash_gradient_matches_finite_differences():
  s = np.random.RandomState(1).randn(3, 4)
  with tf.Graph().as_default(), tf.compat.v1.Session():
    theo, num = tf.test.compute_gradient(routing.squash, [s])
  np.testing.assert_allclose(theo[0], num[0], atol=1e-8)


@pytest.mark.parametrize("iters", [1, 2, 3])
def test_coupling_coefficients_sum_to_one_over_out_caps(iters):
  u_hat = np.random.RandomState(0).randn(4, 6, 3, 2)   # [b, i, o, d]
  with tf.Graph().as_default():
    v, couplings = routing.dynamic_routing(tf.constant(u_hat), iters)
    v_val, cs = run([v, couplings])
  assert len(cs) == iters and v_val.shape == (4, 3, 2)
  for c_val in cs:
    assert c_val.shape == (4, 6, 3)                    # [b, i, o]
    np.testing.assert_allclose(c_val.sum(axis=2), 1.0, atol=1e-12)
  np.testing.assert_allclose(cs[0], 1.0 / 3, rtol=1e-12)   # b starts at zero
  if iters > 1:   # routing moved c away from uniform
    assert np.abs(cs[-1] - 1.0 / 3).max() > 1e-3


def test_routing_is_per_example():
  u_hat = np.random.RandomState(0).randn(4, 6, 3, 2) * 2
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float64, [None, 6, 3, 2])
    v, couplings = routing.dynamic_routing(x, 3)
    c = couplings[-1]
    v4, c4 = run([v, c], {x: u_hat})
    v1, c1 = run([v, c], {x: u_hat[:1]})
  np.testing.assert_allclose(v4[:1], v1, rtol=1e-12)
  np.testing.assert_allclose(c4[:1], c1, rtol=1e-12)
  assert np.abs(c4[1] - c4[0]).max() > 1e-3   # examples route differently


def test_one_iteration_is_squash_of_the_mean_over_out_caps():
  u_hat = np.random.RandomState(2).randn(2, 5, 3, 4)   # [b, i, o, d]
  with tf.Graph().as_default():
    v, couplings = routing.dynamic_routing(tf.constant(u_hat), 1)
    v_val, c_val = run([v, couplings[0]])
  expected = np_squash(u_hat.sum(axis=1) / 3)           # uniform c = 1/out_caps
  np.testing.assert_allclose(v_val, expected, rtol=1e-9)
  np.testing.assert_allclose(c_val, 1.0 / 3)


def test_three_iterations_match_numpy_procedure_1():
  u_hat = np.random.RandomState(3).randn(2, 5, 3, 4)   # [b, i, o, d]
  b = np.zeros([2, 5, 3])
  cs = []
  for r in range(3):
    c = np.exp(b) / np.exp(b).sum(axis=2, keepdims=True)
    cs.append(c)
    v = np_squash(np.einsum("bio,biod->bod", c, u_hat))
    if r < 2:
      b = b + np.einsum("biod,bod->bio", u_hat, v)
  for form in (routing.dynamic_routing, routing.procedure_1):
    with tf.Graph().as_default():
      v_tf, cs_tf = run(form(tf.constant(u_hat), 3))
    np.testing.assert_allclose(v_tf, v, rtol=1e-9)
    for c_tf, c in zip(cs_tf, cs, strict=True):
      np.testing.assert_allclose(c_tf, c, rtol=1e-9)


@pytest.mark.parametrize("iters,stop,bias", [(1, True, False), (3, True, False),
                                             (3, False, False), (2, True, True)])
def test_the_matmul_form_is_procedure_1_in_float64(iters, stop, bias):
  """dynamic_routing (the model's two batched matmuls) and procedure_1 (the
  paper's sums): the same outputs, couplings and gradients (to u_hat and
  to the bias), with and without the stop, to float64 rounding."""
  rng = np.random.RandomState(iters)
  with tf.Graph().as_default() as graph:
    u_hat = tf.constant(rng.randn(3, 7, 4, 5) * 0.5)     # [b, i, o, d]
    weights = tf.constant(rng.randn(3, 4, 5))
    b = tf.constant(rng.randn(4, 5) * 0.1) if bias else None
    got = {}
    for form in (routing.dynamic_routing, routing.procedure_1):
      with tf.compat.v1.variable_scope(form.__name__):
        v, couplings = form(u_hat, iters, stop, b)
        loss = tf.reduce_sum(v * weights)
        grads = tf.gradients(loss, [u_hat] + ([b] if bias else []))
        got[form.__name__] = (v, couplings, grads)
    with tf.compat.v1.Session(graph=graph) as sess:
      fast, plain = sess.run([got["dynamic_routing"], got["procedure_1"]])
  for a, b_ in zip(tf.nest.flatten(fast), tf.nest.flatten(plain), strict=True):
    np.testing.assert_allclose(a, b_, rtol=1e-12, atol=1e-14)


def test_bad_inputs_raise():
  with tf.Graph().as_default():
    for form in (routing.dynamic_routing, routing.procedure_1):
      with pytest.raises(ValueError, match=r"u_hat must be .*got shape \(2, 3, 4\)"):
        form(tf.zeros([2, 3, 4]), 3)
      with pytest.raises(ValueError, match="num_iters must be >= 1, got 0"):
        form(tf.zeros([2, 3, 4, 5]), 0)
