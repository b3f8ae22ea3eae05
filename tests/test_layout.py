"""The house: which folder may import which, no module imports in a circle, the commands.

Imports are read from the source (every `import` statement, at the top of a
module or inside a function alike), so a circle hidden behind a lazy import
counts too. The commands run as a user types them, old module names included.
"""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("cutbce", "trainer")
# The training path: what `python -m trainer.main` runs. It never needs a command.
TRAINING_PATH = ("trainer.evaluate", "trainer.loop", "trainer.model", "trainer.sampled",
                 "trainer.train", "trainer.workdir.checkpoint", "trainer.workdir.fingerprint",
                 "trainer.workdir.lock", "trainer.workdir.logs", "trainer.workdir.paths",
                 "trainer.workdir.preemption")
# The command lines under their old names: only these and trainer.main import the commands.
OLD_NAMES = ("trainer.compile", "trainer.export", "trainer.recommend")
# Old import paths of modules that moved into trainer/workdir/ (scripts still use them).
OLD_MODULE_NAMES = ("trainer.checkpoint", "trainer.logs")
# trainer's top level: what a step computes and the loop, main, the old names; nothing else.
# A guard of the workdir goes to trainer/workdir/, a setting to trainer/config/.
TOP_LEVEL = ("trainer", "trainer.evaluate", "trainer.libtpu_env", "trainer.loop",
             "trainer.main", "trainer.model", "trainer.sampled", "trainer.train",
             *OLD_NAMES, *OLD_MODULE_NAMES)


def _modules() -> dict[str, pathlib.Path]:
  modules = {}
  for package in PACKAGES:
    for file in (ROOT / package).rglob("*.py"):
      parts = file.relative_to(ROOT).with_suffix("").parts
      modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
  return modules


MODULES = _modules()


def _imports(name: str) -> set[str]:
  """The project modules `name` imports (a package's name stands for its `__init__`)."""
  file = MODULES[name]
  package = name if file.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(file.read_text(), str(file))):
    if isinstance(node, ast.Import):
      candidates = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      names = [f"{base}.{alias.name}" for alias in node.names]
      candidates = [n for n in names if n in MODULES] or [base]
    else:
      continue
    for candidate in candidates:
      while candidate and candidate not in MODULES:
        candidate = candidate.rpartition(".")[0]
      if candidate and candidate != name:
        found.add(candidate)
  return found


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for other in graph[node]:
      if other not in index:
        visit(other)
        low[node] = min(low[node], low[other])
      elif other in on_stack:
        low[node] = min(low[node], index[other])
    if low[node] == index[node]:
      component = []
      while True:
        other = stack.pop()
        on_stack.discard(other)
        component.append(other)
        if other == node:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return found


def _inside(name: str, folder: str) -> bool:
  return name == folder or name.startswith(folder + ".")


def test_the_import_reader_sees_what_it_must():
  assert "cutbce.backends" in GRAPH["cutbce.tiled"]
  assert "trainer.commands.cli" in GRAPH["trainer.main"]  # a lazy import counts
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_in_a_circle():
  assert _cycles(GRAPH) == []


@pytest.mark.parametrize("folder,allowed", [
    # the op knows nothing of the trainer; kernels know nothing of the ops
    ("cutbce", ()),
    ("cutbce.kernels", ("cutbce.variants",)),
    # data: only paths and the generic description of settings (its command's flags)
    # (and what an output folder may hold: trainer.workdir.outputs)
    ("trainer.data", ("trainer.workdir.paths", "trainer.workdir.outputs",
                      "trainer.config.schema", "trainer.config.budget")),
    # settings: backend names, paths and the data sources' options
    ("trainer.config", ("cutbce", "trainer.workdir.paths", "trainer.data")),
    # the workdir's guards: only the settings' one-line error
    ("trainer.workdir", ("trainer.config.schema",)),
])
def test_each_folder_imports_only_what_it_may(folder, allowed):
  wrong = sorted(
      f"{name} -> {other}" for name, others in GRAPH.items() if _inside(name, folder)
      for other in others
      if not _inside(other, folder) and not any(_inside(other, a) for a in allowed)
      and other != folder.split(".")[0])  # the top package's `__init__` (a docstring)
  assert wrong == []


def test_only_main_and_the_old_names_import_the_commands():
  importers = sorted(name for name, others in GRAPH.items()
                     if not _inside(name, "trainer.commands")
                     and any(_inside(other, "trainer.commands") for other in others))
  assert importers == sorted(("trainer.main", *OLD_NAMES))
  assert not set(importers) & set(TRAINING_PATH)


def test_the_top_level_holds_only_the_step_the_loop_and_the_old_names():
  top = sorted(name for name, file in MODULES.items()
               if name.startswith("trainer") and name.count(".") <= 1
               and file.parent == ROOT / "trainer")
  assert top == sorted(TOP_LEVEL), "a workdir guard goes to trainer/workdir/"


@pytest.mark.parametrize("old", OLD_MODULE_NAMES)
def test_an_old_module_name_is_the_moved_module(old):
  import importlib  # pylint: disable=import-outside-toplevel
  new = old.replace("trainer.", "trainer.workdir.", 1)
  assert importlib.import_module(old) is importlib.import_module(new)
  assert GRAPH[old] == {new}


def test_every_folder_says_what_lives_there():
  for name, file in MODULES.items():
    if file.name == "__init__.py":
      doc = ast.get_docstring(ast.parse(file.read_text()))
      assert doc and len(doc.split()) >= 12, f"{file.relative_to(ROOT)} needs a docstring"
      assert "Imports:" in doc, f"{file.relative_to(ROOT)} must say what it may import"


COMMANDS = {  # module -> a word its --help must show
    "trainer.main": "--workdir", "trainer.data": "--dataset",
    "trainer.evaluate": "--split", "trainer.recommend": "--top_k",
    "trainer.export": "--out", "trainer.compile": "--topology",
}  # the old names run the modules of trainer.commands as `__main__` (runpy)


@pytest.mark.parametrize("module", sorted(COMMANDS))
def test_each_command_line_answers_help(module):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", module, "--help"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
                        check=False)
  # absl's own --help (trainer.main, trainer.compile) exits 1 after printing the usage.
  assert done.returncode in (0, 1), done.stderr[-2000:]
  assert COMMANDS[module] in done.stdout + done.stderr, (done.stdout + done.stderr)[-2000:]
  assert "Traceback" not in done.stderr and "RuntimeWarning" not in done.stderr, done.stderr
