"""Writing files so that a crash never leaves one half-written."""
import json
import os


def atomic_write(path, data):
  """Writes `data` (str or bytes) to `path` via a temporary file and a rename."""
  tmp = path + ".tmp"
  with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
    f.write(data)
  os.replace(tmp, path)


def write_json(path, obj):
  atomic_write(path, json.dumps(obj, indent=2))
