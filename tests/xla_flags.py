"""The suite's XLA compile flags, in a module of their own that imports nothing: ``tests/helpers.py`` re-exports
them (``from helpers import TEST_XLA_FLAGS``), and the vLLM child (``tests/vllm_checks.py``, in vLLM's venv, where
helpers' hypothesis is not installed) passes the same settings to its jitted checks as compiler options."""

from __future__ import annotations

#: XLA flags of every test process and child (tests/conftest.py sets them before jax is imported; child_env and
#: cli_env pass them on). The suite compiles thousands of tiny programs, so compile time is most of its time:
#: LLVM at -O0 and XLA:CPU's older loop emitters instead of the MLIR fusion emitters compile a tiny train step in
#: 1.3 s instead of 4.0 s (CPU time; test_losses + test_advantages_kl: 52 -> 29 s). They change results only at
#: rounding level (summation order); every process of a test uses the same flags, so bit-for-bit comparisons
#: between processes hold. One LLVM module per program instead of XLA:CPU's default split into 32 for parallel
#: codegen: on 2 cores the split costs more than it gains for programs this small (4 test modules, -n 2, measured
#: twice each on an Intel Xeon: 113.7 -> 101.4 CPU-s; code generation only, the same numbers).
TEST_XLA_FLAGS = (
  "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
)


def as_compiler_options(flags: str) -> dict[str, bool | int | str]:
  """``"--name=value ..."`` as ``jax.jit(..., compiler_options=...)`` takes them (the flags a process cannot change
  once XLA has started, given per program): ``{"name": value}``, booleans and integers typed (XLA refuses the
  string ``"false"`` for a boolean option)."""

  def value(text: str) -> bool | int | str:
    if text.lower() in ("true", "false"):
      return text.lower() == "true"
    return int(text) if text.lstrip("-").isdigit() else text

  return {name: value(v) for name, _, v in (flag.removeprefix("--").partition("=") for flag in flags.split())}
