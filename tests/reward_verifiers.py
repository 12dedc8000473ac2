"""Verifier functions for the worker-process tests of tests/test_rewards.py, in a module of their own:
the worker process imports a verifier's module by name, and this one imports nothing beyond the
standard library (the test module would pull hypothesis and pytest into every worker start)."""

from __future__ import annotations

import os
import sys
import time


def hanging_verifier(pred, gold):
  if pred == "hang":
    while True:
      pass
  if pred == "boom":
    raise ZeroDivisionError("verifier bug")
  return pred == gold


def dying_verifier(pred, gold):
  if pred == "die":
    os._exit(3)
  return pred == gold


_CALLS = []


def slow_first_verifier(pred, gold):  # like math-verify: the first call imports sympy (seconds)
  if not _CALLS:
    time.sleep(3.0)
  _CALLS.append(pred)
  return pred == gold


def loaded_modules(names: str) -> list[str]:
  """Which of the comma-separated module ``names`` the worker process has imported."""
  return [n for n in names.split(",") if n in sys.modules]
