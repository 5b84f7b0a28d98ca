"""How the programs (train.py, eval.py, capsnet.pretrained) import
TensorFlow: with oneDNN, without its start-up notices, and without Keras.

- oneDNN's CPU kernels on (TF_ENABLE_ONEDNN_OPTS=1) unless the user has set
  TF_ENABLE_ONEDNN_OPTS. TensorFlow turns them on by itself only on CPUs
  with AVX512-VNNI, AVX512-BF16 or AMX; elsewhere its own Eigen kernels run,
  and there the step is far slower: on a 2-core AMD EPYC (Zen 3, AVX2, no
  AVX-512) the fp32 training step by the DFT method trained 82.3 and 73.5
  images/s with TF_ENABLE_ONEDNN_OPTS=0 against 191.2 and 221.2 with 1
  (`python -m capsnet.bench --modes=train --variants=ours --convs=dft,conv2d
  --precision=fp32 --rounds=1 --steps=5 --warmup=2 --peak_size=1024`, the
  two settings alternating, 2026-12-03; docs/performance.md). Where
  TensorFlow turns oneDNN on itself this changes nothing. float64, the
  exactness tests' dtype, does not run in oneDNN. `host.describe` records
  the setting, and the convolution plan is keyed by it.

- TensorFlow's C++ start-up notices (oneDNN, CUDA stubs, CPU features) are
  hidden unless the user has set TF_CPP_MIN_LOG_LEVEL. Some are printed
  while `tensorflow` is imported, before its log level applies, so the
  import runs with standard error pointed at /dev/null; an import that
  fails still raises, and its traceback is printed as usual.
- `import tensorflow` also imports Keras (and, through Keras, matplotlib's
  pyplot when it is installed) to register Keras' optimizers, which
  capsnet never uses: about 0.7 s of CPU and 0.9 s of wall time of every
  start here, a quarter of the import. Keras is held back while TensorFlow
  imports (TensorFlow then runs as it does where Keras is not installed);
  `tf.keras` and `import keras` still work afterwards, on first use.
"""
import contextlib
import os
import sys


# TensorFlow's switch of its oneDNN kernels, read once, when it is imported.
ONEDNN = "TF_ENABLE_ONEDNN_OPTS"


def import_tensorflow():
  """Imports TensorFlow as the module docstring says (call before any other
  import of it; does nothing once it is imported)."""
  if "tensorflow" in sys.modules:
    return
  os.environ.setdefault(ONEDNN, "1")
  with _without_keras():
    if "TF_CPP_MIN_LOG_LEVEL" in os.environ:
      import tensorflow  # noqa: F401
    else:
      os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
      with _stderr_to_devnull():
        import tensorflow  # noqa: F401


@contextlib.contextmanager
def _without_keras():
  """`import keras` fails inside (TensorFlow catches that ImportError)."""
  if "keras" in sys.modules:   # already imported by the caller: leave it
    yield
    return
  sys.modules["keras"] = None
  try:
    yield
  finally:
    if sys.modules.get("keras", 0) is None:
      del sys.modules["keras"]


@contextlib.contextmanager
def _stderr_to_devnull():
  sys.stderr.flush()
  saved = os.dup(2)
  devnull = os.open(os.devnull, os.O_WRONLY)
  try:
    os.dup2(devnull, 2)
    yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)
    os.close(devnull)
