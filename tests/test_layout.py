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


def test_every_top_level_module_is_in_the_readme_layout_and_every_folder_is_checked():
  """Each of capsnet/*.py (the programs, and roofline.py beside the bench) is
  named in README.md's layout table, each program runs as `python -m`, and
  the import check above covers every folder under capsnet/."""
  readme = open(os.path.join(ROOT, "README.md")).read()
  layout = readme.split("| where | what |")[1].split("\n\n")[0]
  top = sorted(n for n in os.listdir(os.path.join(ROOT, "capsnet"))
               if n.endswith(".py") and n != "__init__.py")
  assert {"study.py", "along.py", "confirm.py", "answer.py", "bench.py", "roofline.py",
          "pretrained.py", "cluster.py"} <= set(top)
  for name in top:
    assert f"`capsnet/{name}`" in layout, f"capsnet/{name} is not in the README's layout"
    source = open(os.path.join(ROOT, "capsnet", name)).read()
    assert ('if __name__ == "__main__":' in source) == (name != "roofline.py"), name
  folders = sorted(n for n in os.listdir(os.path.join(ROOT, "capsnet"))
                   if os.path.isdir(os.path.join(ROOT, "capsnet", n)) and n != "__pycache__")
  assert folders == sorted(BELOW)


def _exits_or_flags(path):
  """The lines where a module imports absl's flags or app, or ends the
  process (sys.exit, os._exit, exit(), quit())."""
  found = []
  for node in ast.walk(ast.parse(open(path).read(), path)):
    if isinstance(node, ast.ImportFrom) and node.module in ("absl", "absl.flags", "absl.app"):
      if node.module != "absl" or {a.name for a in node.names} & {"flags", "app"}:
        found.append(f"{node.lineno}: from {node.module} import ...")
    elif isinstance(node, ast.Import):
      found += [f"{node.lineno}: import {a.name}" for a in node.names
                if a.name in ("absl.flags", "absl.app")]
    elif isinstance(node, ast.Call):
      f = node.func
      if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
          and (f.value.id, f.attr) in (("sys", "exit"), ("os", "_exit"))) or (
              isinstance(f, ast.Name) and f.id in ("exit", "quit")):
        found.append(f"{node.lineno}: {ast.unparse(f)}()")
  return found


def test_programs_alone_take_flags_and_exit(tmp_path):
  """A library module (the five folders) neither reads absl flags nor ends the
  process: it raises or returns, and the program decides."""
  offenders = {}
  for folder in BELOW:
    for name in sorted(os.listdir(os.path.join(ROOT, "capsnet", folder))):
      if name.endswith(".py"):
        found = _exits_or_flags(os.path.join(ROOT, "capsnet", folder, name))
        if found:
          offenders[f"capsnet/{folder}/{name}"] = found
  assert offenders == {}
  # the check itself finds each way in
  planted = tmp_path / "planted.py"
  planted.write_text("import sys\nfrom absl import flags\nimport absl.app\nsys.exit(1)\n"
                     "quit()\n")
  assert _exits_or_flags(str(planted)) == ["2: from absl import ...", "3: import absl.app",
                                           "4: sys.exit()", "5: quit()"]
