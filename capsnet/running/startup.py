"""How the programs import TensorFlow: oneDNN's CPU kernels on
(TF_ENABLE_ONEDNN_OPTS=1; elsewhere than on CPUs with AVX512-VNNI, -BF16 or AMX
TensorFlow leaves them off and trains far slower), its C++ start-up notices
hidden, and Keras held back during the import (a quarter of its time; `tf.keras`
still works). A variable the user set is left as it is."""
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
