"""Quiet start for the programs (train.py, eval.py): TensorFlow's C++
start-up notices (oneDNN, CUDA stubs, CPU features) are hidden unless the
user has set TF_CPP_MIN_LOG_LEVEL.

Some of them are printed while `tensorflow` is imported, before its log
level applies, so the import runs with standard error pointed at /dev/null;
an import that fails still raises, and its traceback is printed as usual.
"""
import os
import sys


def quiet_tensorflow():
  """Imports TensorFlow without its start-up notices (call before any
  other import of it). Does nothing if TF_CPP_MIN_LOG_LEVEL is set."""
  if "TF_CPP_MIN_LOG_LEVEL" in os.environ or "tensorflow" in sys.modules:
    return
  os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
  sys.stderr.flush()
  saved = os.dup(2)
  devnull = os.open(os.devnull, os.O_WRONLY)
  try:
    os.dup2(devnull, 2)
    import tensorflow  # noqa: F401
  finally:
    os.dup2(saved, 2)
    os.close(saved)
    os.close(devnull)
