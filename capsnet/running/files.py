"""Writing files so that a crash never leaves one half-written."""
import json
import os
import tempfile


def atomic_write(path, data):
  """Writes `data` (str or bytes) to `path` via a temporary file and a rename."""
  tmp = path + ".tmp"
  with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
    f.write(data)
  os.replace(tmp, path)


def write_json(path, obj):
  atomic_write(path, json.dumps(obj, indent=2))


def append_jsonl(path, row):
  """Appends one JSON line (metrics.jsonl, diagnostics.jsonl)."""
  with open(path, "a") as f:
    f.write(json.dumps(row) + "\n")


def probe_writable(folder):
  """Writes and removes a file in `folder`, which exists: the one check
  that the programs can write there before they start any work.
  Raises: OSError (with its strerror) where they cannot."""
  with tempfile.TemporaryFile(dir=folder):
    pass
