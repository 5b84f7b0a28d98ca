"""How the programs (train.py, eval.py, capsnet.pretrained) import
TensorFlow: with oneDNN, without its start-up notices, and without Keras.

- oneDNN's CPU kernels on (TF_ENABLE_ONEDNN_OPTS=1) unless the user has set
  the variable: TensorFlow turns them on by itself only on CPUs with
  AVX512-VNNI, AVX512-BF16 or AMX, and elsewhere its Eigen kernels train
  far slower (docs/performance.md). `host.describe` records the setting.
- TensorFlow's C++ start-up notices are hidden unless the user has set
  TF_CPP_MIN_LOG_LEVEL (the import runs with standard error pointed at
  /dev/null; an import that fails still raises with its traceback).
- Keras, which `import tensorflow` imports only to register optimizers
  capsnet never uses, is held back while TensorFlow imports (a quarter of
  the import's time); `tf.keras` and `import keras` still work afterwards.
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
