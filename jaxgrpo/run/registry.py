"""Tasks by name: a task module registers itself on import (``register_task``); the run layer looks it up
by name (``task``), so no module below ``jaxgrpo.tasks`` imports a task (tests/test_layers.py).

A built-in task is imported on its first lookup (``BUILTIN``: name -> module). The registry stores the
module object, and callers read its functions at call time (``task("arithmetic").warm_up(...)``), so a
function patched on the module is the one that runs.

A task module provides what the run asks of it; the synthetic arithmetic task (``data.arithmetic``,
``model.synthetic``) provides ``build_tokenizer()``, ``model_config(spec, vocab_size)``,
``task_split(task, seed=)`` and ``warm_up(model, tokenizer, rows, task, seed=, log=, progress=)``.
"""

from __future__ import annotations

import importlib
import types

__all__ = ["BUILTIN", "register_task", "task"]

# name -> the module that registers it when imported
BUILTIN = {"arithmetic": "jaxgrpo.tasks.arithmetic"}
_TASKS: dict[str, types.ModuleType] = {}


def register_task(name: str, module: types.ModuleType) -> None:
  """Make ``module`` the task called ``name`` (a task module calls this at import:
  ``register_task("mine", sys.modules[__name__])``). Registering a name again replaces it."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"`name` must be a non-empty string; got {name!r}")
  if not isinstance(module, types.ModuleType):
    raise TypeError(f"`module` must be a module object; got {type(module).__name__}")
  _TASKS[name] = module


def task(name: str) -> types.ModuleType:
  """The module registered as ``name``, importing a built-in one on first use."""
  if name not in _TASKS and name in BUILTIN:
    importlib.import_module(BUILTIN[name])
  if name not in _TASKS:
    raise KeyError(f"no task {name!r} is registered (registered: {sorted(_TASKS)}; built-in: {sorted(BUILTIN)})")
  return _TASKS[name]
