"""What stop_gradient in the routing loop does, and does not, change.

Forward values: nothing. Gradients: nothing for r = 1; for r >= 2 the stop
removes exactly the part of the gradient that flows through the coupling
coefficients c, i.e. the stopped gradient is the gradient of the same loss
with c held constant at its forward value.
"""
import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from capsnet.model import losses
from capsnet.model import network
from capsnet.model import routing
from conftest import run_and_list_nodes

GRAD_VARS = ("capsnet/digit_caps/weights", "capsnet/primary_caps/weights",
             "capsnet/conv1/weights")


def _two_mode_graph(cfg, iters, seed=0, batch=3):
  """Builds the model twice on the same variables: stop on and stop off."""
  rng = np.random.RandomState(seed)
  images = tf.constant(rng.rand(batch, cfg.image_size, cfg.image_size, 1))
  labels = tf.constant(rng.randint(0, cfg.num_classes, batch))
  outs = {}
  for stop in (True, False):
    mode_cfg = dataclasses.replace(cfg, iter_routing=iters, stop_gradient=stop)
    with tf.name_scope(f"stop_{stop}"):
      outs[stop] = network.forward(images, labels, mode_cfg, training=True)
  return outs


def _init_random(sess, seed=1, scale=0.3):
  """Random variables of a size at which routing moves c well off uniform
  (the default init, W ~ N(0, 0.01), leaves c almost uniform)."""
  rng = np.random.RandomState(seed)
  for var in tf.compat.v1.global_variables():
    var.load(rng.randn(*var.shape) * scale, sess)


def _grads(out):
  var = {v.op.name: v for v in tf.compat.v1.global_variables()}
  targets = [var[n] for n in GRAD_VARS] + [out.u]
  return tf.gradients(out.loss, targets)


@pytest.mark.parametrize("iters", [1, 2, 3])
def test_forward_identical_with_and_without_stop(tiny_cfg, iters):
  with tf.Graph().as_default():
    outs = _two_mode_graph(tiny_cfg, iters)
    def fetch(o):
      return [o.v, *o.couplings, o.lengths, o.margin_loss, o.recon_loss,
              o.reconstructions, o.loss]
    with tf.compat.v1.Session() as sess:
      _init_random(sess)
      on, off = sess.run([fetch(outs[True]), fetch(outs[False])])
  for a, b in zip(on, off, strict=True):
    np.testing.assert_array_equal(a, b)


def test_one_iteration_gradients_identical(tiny_cfg):
  with tf.Graph().as_default():
    outs = _two_mode_graph(tiny_cfg, 1)
    assert len(tf.compat.v1.trainable_variables()) == 9   # shared, not doubled
    with tf.compat.v1.Session() as sess:
      _init_random(sess)
      on, off = sess.run([_grads(outs[True]), _grads(outs[False])])
  for a, b in zip(on, off, strict=True):
    assert np.abs(a).max() > 0
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("iters", [2, 3])
def test_more_iterations_gradients_differ(tiny_cfg, iters):
  with tf.Graph().as_default():
    outs = _two_mode_graph(tiny_cfg, iters)
    with tf.compat.v1.Session() as sess:
      _init_random(sess)
      on, off = sess.run([_grads(outs[True]), _grads(outs[False])])
  for name, a, b in zip(GRAD_VARS + ("primary capsules",), on, off, strict=True):
    rel = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert rel > 1e-4, f"{name}: relative gradient difference {rel:.2e}"


# Routing on its own: loss(u, W) for u [b, i, k] primary capsules and
# W [i, o, k, d]; margin loss of the routed capsules. Lengths are kept away
# from the margin-loss kinks at 0.1 and 0.9 by the scale of W.
RNG = np.random.RandomState(0)
U = RNG.randn(2, 5, 3) * 0.5               # [b, i, k]
W = RNG.randn(5, 3, 3, 4) * 0.6            # [i, o, k, d]
LABELS = np.array([0, 2])


def _routed_loss(u, w, iters, stop, c_fixed=None):
  u_hat = tf.einsum("bik,iokd->biod", u, w)
  if c_fixed is None:
    v, _ = routing.dynamic_routing(u_hat, iters, stop)
  else:   # c_fixed: [b, i, o] held constant
    v = routing.squash(tf.einsum("bio,biod->bod", c_fixed, u_hat))
  return tf.reduce_mean(losses.margin_loss(routing.safe_norm(v), LABELS))


def _check_away_from_kinks(iters):
  with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
    u_hat = tf.einsum("bik,iokd->biod", U, W)
    lengths = sess.run(routing.safe_norm(routing.dynamic_routing(u_hat, iters)[0]))
  assert np.min(np.abs(lengths - 0.1)) > 0.02 and np.min(np.abs(lengths - 0.9)) > 0.02


@pytest.mark.parametrize("iters", [1, 2, 3])
def test_gradient_without_stop_matches_finite_differences(iters):
  _check_away_from_kinks(iters)
  with tf.Graph().as_default(), tf.compat.v1.Session():
    theo, num = tf.test.compute_gradient(
        lambda u, w: _routed_loss(u, w, iters, stop=False), [U, W])
  for t, n in zip(theo, num, strict=True):
    assert np.abs(n).max() > 1e-3
    np.testing.assert_allclose(t, n, atol=1e-6)


@pytest.mark.parametrize("iters", [2, 3])
def test_stopped_gradient_is_gradient_with_c_held_fixed(iters):
  _check_away_from_kinks(iters)
  with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
    u, w = tf.constant(U), tf.constant(W)
    _, couplings = routing.dynamic_routing(tf.einsum("bik,iokd->biod", u, w), iters)
    c_fixed = sess.run(couplings[-1])
    analytic = sess.run(tf.gradients(_routed_loss(u, w, iters, stop=True), [u, w]))
    # Finite differences of the loss in which c is a constant.
    _, fixed_num = tf.test.compute_gradient(
        lambda u, w: _routed_loss(u, w, iters, stop=True, c_fixed=c_fixed), [U, W])
    # ...and of the full loss, where c moves with u and W.
    _, full_num = tf.test.compute_gradient(
        lambda u, w: _routed_loss(u, w, iters, stop=False), [U, W])
  for a, fixed, full in zip(analytic, fixed_num, full_num, strict=True):
    np.testing.assert_allclose(a.reshape(-1), fixed.reshape(-1), atol=1e-6)
    # The part of the gradient carried by c is far above the FD error.
    assert np.linalg.norm(a.reshape(-1) - full.reshape(-1)) > 1e-3


def _through_identities(t):
  """The tensor behind `t`'s identities (without the stop, the reads of u_hat
  are identities whose gradients routing adds in a fixed order)."""
  while t.op.type in ("Identity", "IdentityN"):
    t = t.op.inputs[t.value_index if t.op.type == "IdentityN" else 0]
  return t


@pytest.mark.parametrize("iters", [2, 3])
def test_graph_structure(tiny_cfg, iters):
  graph = tf.Graph()
  with graph.as_default():
    outs = _two_mode_graph(tiny_cfg, iters)
    for stop, out in outs.items():
      scope = f"stop_{stop}/capsnet/digit_caps/routing"
      names = [op.name for op in graph.get_operations()]
      for r in range(iters):
        assert any(n.startswith(f"{scope}/iter_{r}/") for n in names)
      assert not any(n.startswith(f"{scope}/iter_{iters}/") for n in names)
      stopped = [op for op in graph.get_operations()
                 if op.type == "StopGradient" and op.name.startswith(scope)]
      assert len(stopped) == (1 if stop else 0)
      for r, c in enumerate(out.couplings):
        # The weighted sum of iteration r: the product of c with u_hat.
        (s_op,) = [op for op in c.consumers() if op.type == "BatchMatMulV2"]
        reads = _through_identities(s_op.inputs[1])  # u_hat as [batch, in_caps, o*d]
        assert reads.op.type == "Reshape"
        s = graph.get_tensor_by_name(f"{scope}/iter_{r}/s:0")
        grad = tf.gradients(s, out.u_hat)[0]
        if stop and r < iters - 1:
          assert reads.op.inputs[0] is stopped[0].outputs[0]
          assert grad is None
        else:
          assert reads.op.inputs[0] is out.u_hat
          assert grad is not None


def test_routing_reads_are_not_summed_by_an_add_n(tiny_cfg):
  """The CPU AddN kernel sums its inputs in an order that depends on which
  input buffer it may reuse at that moment, so a sum of three or more can
  change in its last bits from run to run on a busy machine. Without the
  stop u_hat has 2r - 1 readers (two matmuls an inner iteration, one in the
  last); their gradients must be added by `routing.ordered_sum`, not by the
  AddN tf.gradients would put there. Checked on the graph that runs, after
  Grappler (which merges chains of adds into AddN), in one Adam step."""
  cfg = dataclasses.replace(tiny_cfg, iter_routing=3, stop_gradient=False)
  with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
    images = tf.constant(np.random.RandomState(0).rand(3, cfg.image_size, cfg.image_size, 1))
    out = network.forward(images, tf.constant([1, 2, 3]), cfg, training=True)
    step = tf.compat.v1.train.AdamOptimizer(1e-3).minimize(out.loss)
    sess.run(tf.compat.v1.global_variables_initializer())
    _, nodes = run_and_list_nodes(sess, step)
  reads = [n.name for n in nodes if "/routing/" in n.name and "MatMul" in n.op]
  assert len(reads) >= 5      # the routing's matmuls and their gradients ran
  wide = [n.name for n in nodes if n.op == "AddN"
          and sum(not i.startswith("^") for i in n.input) > 2
          and any("/routing/" in i and "MatMul" in i for i in n.input)]
  assert wide == []
