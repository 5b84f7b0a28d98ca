"""The layout README.md describes: the library under capsnet/ in five folders,
each importing only itself and the folders below it, and no library module
importing a program (train.py, eval.py, config.py, capsnet/*.py)."""
import ast
import os

from conftest import ROOT

# A folder may import itself and the folders listed for it.
BELOW = {"model": set(), "data": set(), "running": {"model", "data"},
         "using": {"model", "data", "running"}, "science": {"data", "running"}}


def _project_imports(path):
  """The project modules a file imports, as dotted names."""
  tree = ast.parse(open(path).read(), path)
  names = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      if node.module == "capsnet" or node.module.split(".")[-1] in BELOW:
        names += [f"{node.module}.{a.name}" for a in node.names]
      elif node.module.startswith("capsnet.") or node.module in ("config", "train", "eval"):
        names.append(node.module)
    elif isinstance(node, ast.Import):
      names += [a.name for a in node.names
                if a.name.startswith("capsnet") or a.name in ("config", "train", "eval")]
  return names


def test_each_folder_imports_only_itself_and_the_folders_below():
  seen = {}
  for folder, allowed in BELOW.items():
    for name in sorted(os.listdir(os.path.join(ROOT, "capsnet", folder))):
      if not name.endswith(".py"):
        continue
      imports = _project_imports(os.path.join(ROOT, "capsnet", folder, name))
      seen[f"{folder}/{name}"] = imports
      for module in imports:
        parts = module.split(".")
        assert parts[0] == "capsnet" and len(parts) >= 3, (
            f"capsnet/{folder}/{name} imports the program {module}")
        assert parts[1] == folder or parts[1] in allowed, (
            f"capsnet/{folder}/{name} imports {module}, above it")
  # The check saw the layout it guards: the graph builder uses the layers,
  # the run folder the graph builder, serving the run folder.
  assert "capsnet.model.layers" in seen["model/network.py"]
  assert "capsnet.model.network" in seen["running/runs.py"]
  assert "capsnet.running.runs" in seen["using/serving.py"]
  assert "capsnet.science.grids" in seen["science/blocks.py"]


def test_every_program_in_the_readme_is_a_top_level_module():
  readme = open(os.path.join(ROOT, "README.md")).read()
  for program in ("study", "bench", "pretrained", "cluster"):
    assert f"capsnet/{program}.py" in readme
    assert os.path.isfile(os.path.join(ROOT, "capsnet", f"{program}.py"))
