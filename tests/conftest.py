"""Makes the shared test helpers importable one way, ``from helpers import ...`` (tests/helpers.py),
whatever pytest's import mode (child processes get the same path from ``helpers.child_env``), shares
one persistent XLA compilation cache across the session, writes bytecode even under PYTHONDONTWRITEBYTECODE,
starts the slowest test modules first and the side venvs' builds in the background,
releases compiled code between test modules, and makes the property tests reproducible.

**Property tests (hypothesis) are derandomized.** Every run — CI, a submission's check, a developer's
plain ``pytest`` — loads the ``"derandomized"`` profile: each ``@given`` test draws the same cases on
every run (seeded by a hash of the test function; no example database), so a change is never rejected
by a random case that nobody's change introduced, and a failure reproduces with the same command. The
cases change only when the test itself (or hypothesis) changes. To explore with fresh random draws,
set ``JAXGRPO_HYPOTHESIS_RANDOM=1`` (or pass ``--hypothesis-profile=random``); a failure then prints its
seed, which ``--hypothesis-seed=N`` replays under that profile; add the failing case to the test as an
``@example(...)`` so that the derandomized runs keep it. Per-test ``settings(max_examples=...)`` made
in a test module inherit the loaded profile (it is loaded before the modules are imported).
"""

from __future__ import annotations

import collections
import gc
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
  sys.path.insert(0, _HERE)

# NumPy's OpenBLAS runs one thread per process (unless set): its idle threads spin like OpenMP's, and the suite's
# NumPy references are small products that gain nothing from a second thread on cores both workers already use.
# 300 products of 128 x 256 by 256 x 512 beside other jobs (load ~30): 4.4-5.0 CPU-s and 11-17 s wall with the
# default threads, 0.22 CPU-s and ~1 s with one. Set before anything imports NumPy; every child inherits it.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from helpers import TEST_XLA_FLAGS  # noqa: E402  (imports no jax)

# The compile flags of every test process (why: helpers.TEST_XLA_FLAGS). Set before jax is imported, inherited by
# the xdist workers and by children (helpers.child_env, helpers.cli_env set them too).
for _flag in TEST_XLA_FLAGS.split():
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

# Bytecode is written (``__pycache__``, git-ignored) even where PYTHONDONTWRITEBYTECODE is set, for this process, the
# xdist workers and every child: the suite starts a few hundred Pythons that import the same modules, and without
# bytecode each compiles them from source again — this checkout's (0.35 CPU-s a start for ``jaxgrpo.run.trainer``)
# and, in the side venvs, which are installed without bytecode (uv's default), jax, torch and vLLM (a ``.venv-tpu``
# child's ``import jax, flax.nnx, optax``: 2.45 CPU-s from source, 1.0 with bytecode; ``import vllm``: 16.7 vs 7.7).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
  sys.dont_write_bytecode = False

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402
from hypothesis import settings as _hypothesis_settings  # noqa: E402

HYPOTHESIS_RANDOM_ENV = "JAXGRPO_HYPOTHESIS_RANDOM"
_hypothesis_settings.register_profile("derandomized", derandomize=True, database=None, print_blob=True)
_hypothesis_settings.register_profile("random", derandomize=False, print_blob=True)
_hypothesis_settings.load_profile(
  "random" if os.environ.get(HYPOTHESIS_RANDOM_ENV, "") not in ("", "0") else "derandomized"
)

DURATIONS = os.path.join(_HERE, "durations.json")

CACHE_ENV = {
  # every program, however small or quick to compile (the suite's are tiny). No size bound: a bound turns
  # on JAX's LRU eviction, which on every write scans all entries under one file lock — O(n^2) over the
  # ~16,000 programs of a run; the full suite's last 10% crawled with both workers asleep on the lock. A
  # reader that catches an entry half-written by another process gets a warning and compiles instead.
  "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
  "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}


def pytest_configure(config):
  """One persistent XLA compilation cache for the whole session: the xdist workers, the test processes'
  children (``helpers.child_env``, ``helpers.cli_env``: ``scripts/train.py`` runs, 8-device children)
  inherit it through the environment, so a program compiled once — the same tiny model's train step,
  sampler and reference, built again by another test, module or run — is read back instead of recompiled.
  The key covers the program, the devices and ``XLA_FLAGS``, so 1- and 8-device runs keep separate entries.

  The directory is created by the first process (the xdist controller, or a plain pytest run) and deleted
  when it ends; set ``JAX_COMPILATION_CACHE_DIR`` yourself to keep a cache across runs. No test depends
  on a compile happening: compile counters listen to ``backend_compile`` events, which a cache hit emits too."""
  if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    path = tempfile.mkdtemp(prefix="jaxgrpo-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))
  for key, value in CACHE_ENV.items():
    os.environ.setdefault(key, value)
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  env = os.environ
  jax.config.update(
    "jax_persistent_cache_min_compile_time_secs", float(env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
  )
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", int(env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))
  _prebuild_side_venvs(config)


# side venvs (tests/helpers.py ensure_side_venv) -> the test modules that use them. Their builds wait on the package
# index, not the CPU (.venv-vllm: 176 s wall, 19 CPU-s): started in the background when a session that runs those
# modules begins, they are ready (or nearly) when the modules' turn comes, instead of a worker sleeping through them.
SIDE_VENVS = {
  "vllm": ("test_engine_vllm.py",),
  "tpu": ("test_tpu_aot.py", "test_plan.py"),
  "base": ("test_base_install.py",),
}


def _runs_module(args: list[str], module: str) -> bool:
  """Whether a session started with the path arguments ``args`` collects ``tests/<module>``."""
  target = os.path.join(_HERE, module)
  for arg in args or [_HERE]:
    path = os.path.abspath(arg.split("::")[0])
    if path == target or (os.path.isdir(path) and target.startswith(path.rstrip(os.sep) + os.sep)):
      return True
  return False


def _prebuild_side_venvs(config) -> None:
  """In the session's first process only (the xdist controller, or a plain pytest run), and not for
  ``--collect-only`` (no test runs). Each build logs to ``<tmp>/jaxgrpo-prebuild-<name>-<checkout hash>.log``:
  sessions of other checkouts keep their own logs."""
  if hasattr(config, "workerinput") or config.option.collectonly:
    return
  from helpers import side_venv_build_command

  args = [a for a in config.invocation_params.args if not a.startswith("-") and os.path.exists(a.split("::")[0])]
  for name, modules in SIDE_VENVS.items():
    if any(_runs_module(args, m) for m in modules):
      tag = hashlib.sha1(_HERE.encode()).hexdigest()[:8]
      log = open(os.path.join(tempfile.gettempdir(), f"jaxgrpo-prebuild-{name}-{tag}.log"), "w")
      child = subprocess.Popen(
        side_venv_build_command(name), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
      )
      config.add_cleanup(lambda c=child, f=log: _stop_build(c, f))


def _stop_build(child: subprocess.Popen, log) -> None:
  """At the session's end: a build still running (its modules were deselected, or the session stopped early) is
  stopped with its children; the venv's stamp is written only by a finished build, so the next session rebuilds."""
  if child.poll() is None:
    os.killpg(child.pid, signal.SIGTERM)
  child.wait()
  log.close()


def pytest_addoption(parser):
  parser.addoption(
    "--record-durations",
    action="store_true",
    help="update tests/durations.json (seconds per test module, setup + call + teardown) at the end of the run",
  )


def module_order(modules: list[str], seconds: dict[str, float]) -> list[str]:
  """The order the modules start in: slowest first by ``seconds`` (``tests/durations.json``), unlisted ones after
  in their given order, except that a module waiting on a side venv (:data:`SIDE_VENVS`) never starts the session:
  the slowest module that needs none goes before it. A session that begins with ``test_engine_vllm.py`` had its
  first worker sleep on the lock of the background ``.venv-vllm`` build (89 s wall, 20 CPU-s, fresh venv, uv's
  cache warm, load 16) for whatever of the build its collection did not cover; behind a module of its own the
  build is done by the time it starts."""
  rank = {m: (-seconds.get(m, 0), i) for i, m in enumerate(modules)}
  order = sorted(modules, key=rank.__getitem__)
  waits = {m for ms in SIDE_VENVS.values() for m in ms}
  first = next((m for m in order if m not in waits), None)
  if first is not None and order[0] in waits:
    order.remove(first)
    order.insert(0, first)
  return order


def pytest_collection_modifyitems(config, items):
  """Modules in :func:`module_order`; a module's tests stay together and in order (its module fixtures are built
  once). ``-n 2 --dist worksteal`` hands each worker a contiguous half of this order and an idle worker steals
  from the end of the other's queue: with the long runs (vLLM, subprocess trainer runs) at the front, what is
  left to steal at the end is short, and the two workers finish together instead of one running a 200 s test
  alone."""
  with open(DURATIONS) as f:
    seconds = json.load(f)
  position = {m: i for i, m in enumerate(module_order(list(dict.fromkeys(item.path.name for item in items)), seconds))}
  items.sort(key=lambda item: position[item.path.name])  # stable: the order inside a module is kept


_recorded = collections.Counter()


def pytest_runtest_logreport(report):
  _recorded[report.nodeid.split("::")[0].rsplit("/", 1)[-1]] += report.duration


def pytest_sessionfinish(session):
  """With ``--record-durations``, in the controller (or a run without xdist): the modules that ran get
  their measured seconds, the others keep theirs."""
  if session.config.getoption("--record-durations") and not hasattr(session.config, "workerinput"):
    with open(DURATIONS) as f:
      table = {**json.load(f), **{m: round(s) for m, s in _recorded.items()}}
    table = dict(sorted(table.items(), key=lambda kv: -kv[1]))
    with open(DURATIONS, "w") as f:
      json.dump(table, f, indent=0)
      f.write("\n")


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


# torch's OpenMP threads (libgomp: torch's CPU kernels in the test processes and their children) sleep between
# parallel regions instead of spinning: the same work and numbers, far less CPU where the cores are shared, as in the
# suite (two workers on two cores). A loop of 3,000 small torch products with 2 threads beside the other jobs:
# 15.1-18.8 CPU-s and 105 s wall spinning, 0.4 CPU-s and 1-4 s passive; the vLLM child (torch inside vLLM) 354.8 ->
# 234.5 CPU-s. Set here, before any test module imports torch; the workers and every child inherit it. A value
# already set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
