"""The order in which tests/conftest.py starts the test modules (``module_order``): slowest first by
tests/durations.json, and never a module that waits on a side venv's background build at the very front."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import DURATIONS, SIDE_VENVS, module_order
from helpers import ROOT, child_env, cli_env

TESTS = os.path.join(ROOT, "tests")

WAITS = {m for modules in SIDE_VENVS.values() for m in modules}


def test_a_side_venv_module_never_starts_the_session_and_the_rest_is_slowest_first():
  seconds = {"test_engine_vllm.py": 450, "test_a.py": 300, "test_b.py": 200, "test_tpu_aot.py": 100}
  modules = ["test_b.py", "test_new.py", "test_tpu_aot.py", "test_a.py", "test_engine_vllm.py", "test_c.py"]
  # the slowest module that needs no venv moves in front of the vLLM one; unlisted modules follow in their order
  assert module_order(modules, seconds) == [
    "test_a.py",
    "test_engine_vllm.py",
    "test_b.py",
    "test_tpu_aot.py",
    "test_new.py",
    "test_c.py",
  ]
  # without a side-venv module in front, the order is by seconds alone
  del seconds["test_engine_vllm.py"]
  assert module_order(["test_c.py", "test_b.py", "test_a.py"], seconds) == ["test_a.py", "test_b.py", "test_c.py"]
  # only side-venv modules: nothing to move
  assert module_order(["test_tpu_aot.py", "test_plan.py"], {"test_plan.py": 9}) == ["test_plan.py", "test_tpu_aot.py"]


def test_the_recorded_durations_start_with_a_module_that_waits_on_no_build():
  with open(DURATIONS) as f:
    seconds = json.load(f)
  order = module_order(list(seconds), seconds)
  assert sorted(order) == sorted(seconds)
  assert order[0] not in WAITS, order[:3]
  slowest = max(seconds, key=seconds.get)
  assert order.index(slowest) <= 1, order[:3]  # the slowest module still starts first or second


def test_the_session_and_its_children_write_bytecode_even_where_the_environment_says_not_to(tmp_path):
  """tests/conftest.py drops PYTHONDONTWRITEBYTECODE for the session (the few hundred Pythons it starts import the
  same modules; the side venvs hold no bytecode): a fresh Python started with it set, importing the conftest, ends
  up writing bytecode and passes no such setting on; a child of the suite then writes the ``__pycache__`` of a
  module it imports."""
  assert not sys.dont_write_bytecode and "PYTHONDONTWRITEBYTECODE" not in os.environ  # this process (an xdist worker)
  code = (
    "import os, sys; sys.path.insert(0, sys.argv[1]); import conftest; "
    "print(sys.dont_write_bytecode, 'PYTHONDONTWRITEBYTECODE' in os.environ)"
  )
  env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": ROOT}
  out = subprocess.run([sys.executable, "-c", code, TESTS], env=env, capture_output=True, text=True, check=True)
  assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr[-2000:]
  (tmp_path / "probe_module.py").write_text("X = 1\n")
  child = cli_env()
  assert "PYTHONDONTWRITEBYTECODE" not in child and "PYTHONDONTWRITEBYTECODE" not in child_env(1)
  subprocess.run([sys.executable, "-c", "import probe_module"], env=child, cwd=tmp_path, check=True)
  assert list((tmp_path / "__pycache__").glob("probe_module.*.pyc")), sorted(p.name for p in tmp_path.iterdir())


def test_a_collect_only_session_starts_no_side_venv_build():
  """``pytest --collect-only`` runs no test, so tests/conftest.py starts no background venv build for it (before: the
  builds of the selected side-venv modules started and were killed at the session's end)."""
  from types import SimpleNamespace

  from conftest import _prebuild_side_venvs

  cleanups = []
  config = SimpleNamespace(
    option=SimpleNamespace(collectonly=True),
    invocation_params=SimpleNamespace(args=(os.path.join(TESTS, "test_engine_vllm.py"),)),
    add_cleanup=cleanups.append,  # a started build registers its stop here
  )
  _prebuild_side_venvs(config)
  assert cleanups == []
