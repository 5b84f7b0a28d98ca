"""capsnet.model.fast_conv: every method equals tf.nn.conv2d, and the one place that
chooses among them."""
import numpy as np
import pytest
import tensorflow as tf

from capsnet.model import fast_conv

# (height, width, kernel, stride): sizes that are not multiples of the stride,
# non-square inputs, and a row/column that no output window covers.
STRIDED = [(10, 11, 3, 2), (20, 21, 9, 2), (11, 12, 4, 3), (13, 14, 5, 3)]
STRIDE_ONE = [(9, 8, 3, 1), (12, 13, 5, 1)]


def _run(method, h, w, kernel, stride, relu, channels=3, dtype=np.float64):
  """Value and gradients (x, w, bias) of one method, with a batch of 5 fed
  at run time (not a multiple of the fold) and a random upstream gradient."""
  rng = np.random.RandomState(1)
  x = rng.randn(5, h, w, channels)
  k = rng.randn(kernel, kernel, channels, 4)
  b = rng.randn(4)
  out_h, out_w = (h - kernel) // stride + 1, (w - kernel) // stride + 1
  up = rng.randn(5, out_h, out_w, 4)
  with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
    xt = tf.compat.v1.placeholder(dtype, [None, h, w, channels])
    kt, bt = tf.constant(k, dtype), tf.constant(b, dtype)
    y = fast_conv.conv2d(xt, kt, bt, stride, method, relu)
    grads = tf.gradients(y, [xt, kt, bt], grad_ys=tf.constant(up, dtype))
    return sess.run([y, *grads], {xt: x})


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("method,shape", [
    *[("dilated", s) for s in STRIDED], *[("folded", s) for s in STRIDED],
    *[("patch_gemm", s) for s in STRIDE_ONE],
    *[("dft", s) for s in STRIDED + STRIDE_ONE]])
def test_method_equals_conv2d_in_value_and_gradients(method, shape, relu):
  ours = _run(method, *shape, relu)
  theirs = _run("conv2d", *shape, relu)
  h, w, kernel, stride = shape
  assert ours[0].shape == (5, (h - kernel) // stride + 1, (w - kernel) // stride + 1, 4)
  assert (theirs[0] == 0).any() == relu          # the ReLU does cut
  for name, a, b in zip(("value", "dx", "dw", "dbias"), theirs, ours, strict=True):
    assert np.abs(a).max() > 0, name
    np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12, err_msg=name)


def _errors_against_float64(method, dtype, channels):
  """[(output, `method`'s relative (Frobenius) error in `dtype`, conv2d's in
  it)] against conv2d in float64, on PrimaryCaps' 20x20 9x9 stride-2 shape."""
  exact = _run("conv2d", 20, 20, 9, 2, False, channels=channels)
  ours = _run(method, 20, 20, 9, 2, False, channels=channels, dtype=dtype)
  theirs = _run("conv2d", 20, 20, 9, 2, False, channels=channels, dtype=dtype)
  def err(t, a):
    return np.linalg.norm(np.asarray(t, np.float64) - a) / np.linalg.norm(a)
  return [(name, err(b, a), err(c, a)) for name, a, b, c in
          zip(("value", "dx", "dw", "dbias"), exact, ours, theirs, strict=True)]


def test_folded_method_in_bfloat16_is_close_to_conv2d():
  """The dtype it is chosen for: as close to the float64 result as
  TensorFlow's own bfloat16 convolution is (bf16 rounding only)."""
  for name, ours, theirs in _errors_against_float64("folded", tf.bfloat16.as_numpy_dtype, 8):
    assert ours < max(2 * theirs, 1e-2), (name, ours, theirs)


def test_dft_method_on_the_paper_primary_caps_shape_is_exact():
  """PrimaryCaps' shape (20x20 in, 9x9, stride 2; fewer channels): the DFT
  of size 19 reads input positions 0..18 only and nothing wraps round."""
  theirs = _run("conv2d", 20, 20, 9, 2, False, channels=6)
  ours = _run("dft", 20, 20, 9, 2, False, channels=6)
  for name, a, b in zip(("value", "dx", "dw", "dbias"), theirs, ours, strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12, err_msg=name)
  assert np.abs(ours[1][:, 19]).max() == 0 and np.abs(ours[1][:, :, 19]).max() == 0


# Relative (Frobenius) error against float64 of a method in a lower dtype:
# float32's measured ~1e-7 (bound 1e-5); bfloat16's is TensorFlow's own bf16
# convolution's (2^-8 rounding of inputs and output, ~3e-3; the DFT's
# transforms stay in float32 and only its contraction is bf16).
@pytest.mark.parametrize("dtype,bound", [(np.float32, 1e-5), ("bf16", 2e-2)])
def test_dft_method_in_lower_precision_is_close_to_float64(dtype, bound):
  dtype = tf.bfloat16.as_numpy_dtype if dtype == "bf16" else dtype
  for name, ours, theirs in _errors_against_float64("dft", dtype, 16):
    assert ours < bound, (name, ours)
    assert ours < max(2 * theirs, 1e-6), (name, ours, theirs)


def test_plans_parse_and_refuse_what_does_not_fit():
  plan = "conv1:patch_gemm,primary_caps:dft"
  assert fast_conv.parse_plan(plan) == {"conv1": "patch_gemm", "primary_caps": "dft"}
  assert fast_conv.format_plan(fast_conv.parse_plan(plan)) == plan
  assert fast_conv.parse_plan("") == {}
  for bad, why in [("conv1:fft,primary_caps:dft", "expected conv1:M,primary_caps:M"),
                   ("conv1:dft", r"names \['conv1'\], expected"),
                   ("conv1:folded,primary_caps:dft", "conv1 has stride 1")]:
    with pytest.raises(ValueError, match=why):
      fast_conv.parse_plan(bad)
  assert fast_conv.candidates(1) == ("conv2d", "patch_gemm", "dft")
  assert fast_conv.candidates(2) == ("conv2d", "dilated", "folded", "dft")


@pytest.mark.parametrize("conv_impl,dtype,stride,patch,method", [
    ("custom_grad", tf.float32, 1, 81, "patch_gemm"),      # paper Conv1
    ("custom_grad", tf.bfloat16, 1, 81, "patch_gemm"),
    ("custom_grad", tf.float32, 1, 256, "patch_gemm"),
    ("custom_grad", tf.float32, 1, 576, "conv2d"),          # 3x3 over 64 channels
    ("custom_grad", tf.float32, 2, 20736, "dilated"),       # paper PrimaryCaps
    ("custom_grad", tf.float64, 2, 20736, "dilated"),
    ("custom_grad", tf.bfloat16, 2, 20736, "folded"),
    ("conv2d", tf.bfloat16, 2, 20736, "conv2d"),
    ("conv2d", tf.float32, 1, 81, "conv2d"),
    ("dft", tf.bfloat16, 2, 20736, "dft"),
    ("dft", tf.float32, 1, 81, "patch_gemm"),     # dft: the strided convolutions
])
def test_choose_method(conv_impl, dtype, stride, patch, method):
  assert fast_conv.choose_method(conv_impl, dtype, stride, patch) == method


@pytest.mark.parametrize("conv_impl,device,resolved", [
    ("auto", None, "custom_grad"), ("auto", "/cpu:0", "custom_grad"),
    ("auto", "/gpu:0", "conv2d"), ("auto", "/device:GPU:1", "conv2d"),
    ("custom_grad", "/gpu:0", "custom_grad"), ("conv2d", "/cpu:0", "conv2d")])
def test_resolve_impl_by_device(conv_impl, device, resolved):
  assert fast_conv.resolve_impl(conv_impl, device) == resolved


def test_unknown_or_mismatched_methods_raise():
  x, w, b = tf.zeros([1, 10, 10, 3]), tf.zeros([3, 3, 3, 4]), tf.zeros([4])
  with pytest.raises(ValueError, match="conv_impl must be 'custom_grad', "
                     "'conv2d' or 'dft', got 'fft'"):
    fast_conv.choose_method("fft", tf.float32, 1, 9)
  with pytest.raises(ValueError, match=r"conv_impl must be one of \('auto', "
                     r"'custom_grad', 'conv2d', 'dft'\), got 'fft'"):
    fast_conv.resolve_impl("fft")
  with pytest.raises(ValueError, match=r"method must be one of \('conv2d', "
                     r"'patch_gemm', 'dilated', 'folded', 'dft'\), got 'phases'"):
    fast_conv.conv2d(x, w, b, 2, "phases")
  with pytest.raises(ValueError, match="method 'patch_gemm' does not take stride 2"):
    fast_conv.conv2d(x, w, b, 2, "patch_gemm")
  with pytest.raises(ValueError, match="method 'folded' does not take stride 1"):
    fast_conv.conv2d(x, w, b, 1, "folded")
