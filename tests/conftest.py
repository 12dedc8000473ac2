"""Makes the shared test helpers importable one way, ``from helpers import ...`` (tests/helpers.py),
whatever pytest's import mode (child processes get the same path from ``helpers.child_env``), and
releases compiled code between test modules."""

from __future__ import annotations

import gc
import os
import sys

import jax
import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
  sys.path.insert(0, _HERE)


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_code():
  """Drop JAX's compiled executables after each test module. One pytest process runs ~800 tests and
  compiles thousands of programs; kept alive, their code pages and buffers accumulate (a CI run
  aborted inside an XLA compile after ~760 tests). Tests reuse compiled steps only within a module."""
  yield
  jax.clear_caches()
  gc.collect()


@pytest.fixture
def full_fp32_matmuls():
  """Parity is about the port, not TF32: full-precision float32 dots on GPU/TPU (no-op on CPU). Model
  parity modules use it with ``pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")``."""
  with jax.default_matmul_precision("float32"):
    yield
