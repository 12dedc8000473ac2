"""What the target platform decides inside the models: how a bfloat16 product runs on XLA:CPU (the AMX
permission request, :func:`cpu_bf16_dots`, the hand-written mixed kernel :func:`mixed_einsum`) and the dtype of
the KV cache (:func:`kv_cache_dtype`, :func:`cpu_kv_cache`).

Every choice here reads :func:`jaxgrpo.parallel.target.current_platform` (the platform of the devices the program
is compiled for, never the host's backend) when a program is traced; accelerators keep XLA's own bf16 products
and the compute dtype (docs/models.md, "Mixed precision on the CPU" and "Target platform"). The layers
(``jaxgrpo.models.layers``, ``jaxgrpo.models.attention``, ``jaxgrpo.models.moe``) call these functions and
test no platform themselves.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import errno
import functools
import platform
import sys
from typing import Iterator

import jax
import jax.numpy as jnp

from jaxgrpo.parallel.target import current_platform

__all__ = [
  "CPU_BF16_DOTS",
  "CPU_KV_CACHE",
  "amx_granted",
  "amx_request",
  "cpu_bf16_dots",
  "cpu_kv_cache",
  "kv_cache_dtype",
]


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar, value) -> Iterator[None]:
  """``var`` set to ``value`` inside the block, restored after (the body of every trace-time switch here)."""
  token = var.set(value)
  try:
    yield
  finally:
    var.reset(token)


_CPU_BF16_DOTS: contextvars.ContextVar[str] = contextvars.ContextVar("jaxgrpo_cpu_bf16_dots", default="auto")
CPU_BF16_DOTS = ("auto", "native", "float32")
_CPU_KV_CACHE: contextvars.ContextVar[str] = contextvars.ContextVar("jaxgrpo_cpu_kv_cache", default="float32")
CPU_KV_CACHE = ("float32", "compute")


@contextlib.contextmanager
def cpu_bf16_dots(mode: str) -> Iterator[None]:
  """How the bfloat16 products of :func:`dense` run on XLA:CPU while models are traced inside the block:

  - ``"native"``: bf16 operands, float32 accumulation (:func:`mixed_einsum`, forward and backward);
  - ``"float32"``: the operands cast to float32 first, the product in float32, the result rounded back to the
    activation dtype (the same exact products and float32 accumulation, another summation order);
  - ``"auto"`` (the default): ``"native"`` where the process may use Intel AMX (:func:`amx_granted`), else
    ``"float32"``. Measured on the 20m GRPO iteration (``scripts/bench_precision.py``, BENCHMARKS.md "Mixed
    precision without AMX"): native bf16 is 1.50x faster than float32 with AMX and 1.47x slower without it
    (the same Intel Xeon refused AMX by ``scripts/no_amx.py``: avx512_bf16 only).

  Accelerators are not affected (their bf16 matmul is native). Read at trace time, like
  ``jaxgrpo.models.layers.forward_mode_autodiff``."""
  if mode not in CPU_BF16_DOTS:
    raise ValueError(f"cpu_bf16_dots: mode must be one of {CPU_BF16_DOTS}; got {mode!r}")
  with scoped(_CPU_BF16_DOTS, mode):
    yield


@contextlib.contextmanager
def cpu_kv_cache(mode: str) -> Iterator[None]:
  """The dtype of a bf16 model's KV cache on XLA:CPU for the programs traced inside the block
  (:func:`kv_cache_dtype`): ``"float32"`` (the default: the same bf16-rounded values in float32, the faster decode)
  or ``"compute"`` (bf16: half the cache's bytes, where memory matters more than decode speed; the 20m rollout ran
  1.7x slower that way with AMX, 1.3x without). Other dtypes and backends are not affected. Read at trace time."""
  if mode not in CPU_KV_CACHE:
    raise ValueError(f"cpu_kv_cache: mode must be one of {CPU_KV_CACHE}; got {mode!r}")
  with scoped(_CPU_KV_CACHE, mode):
    yield


_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18  # Linux x86-64 (asm/prctl.h)


def amx_request() -> int:
  """Linux's AMX permission request in this process (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, which
  XLA:CPU's kernels make themselves before using AMX): 0 when granted, else its errno (EPERM in a process refused it
  by ``scripts/no_amx.py``; EINVAL or another value on a CPU or kernel without AMX); ENOSYS off Linux x86-64."""
  if sys.platform != "linux" or platform.machine() != "x86_64":
    return errno.ENOSYS
  libc = ctypes.CDLL(None, use_errno=True)
  return 0 if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0 else ctypes.get_errno()


@functools.cache
def amx_granted() -> bool:
  """Whether this process may use Intel AMX (:func:`amx_request` succeeds); asked once per process."""
  return amx_request() == 0


def native_bf16_dots() -> bool:
  mode = _CPU_BF16_DOTS.get()
  return amx_granted() if mode == "auto" else mode == "native"


def kv_cache_dtype(dtype):
  """The KV cache's dtype for a model computing in ``dtype``: ``dtype`` itself, except bfloat16 for a CPU target
  (:func:`jaxgrpo.parallel.target.current_platform`: the program's devices, not the host's backend), where
  the cache holds the same bf16-rounded keys and values in float32 (the same numbers, twice the bytes). The
  decoding attention reads the cache in float32 either way (a multiply-and-reduce accumulated in float32); from a
  bf16 cache XLA:CPU writes a whole float32 copy of every layer's cache at every decode step (its loop fusion
  takes the conversion with the cache update; the reduction then runs in YNNPACK, which reads float32). Measured
  on the 20m rollout (BENCHMARKS.md, "Mixed precision on the CPU"): 1.7x faster with AMX, 1.3x without it.
  Accelerators keep the compute dtype; :func:`cpu_kv_cache` ``("compute")`` keeps it on the CPU too (half the bytes).
  Read at trace time."""
  if jnp.dtype(dtype) == jnp.bfloat16 and current_platform() == "cpu" and _CPU_KV_CACHE.get() == "float32":
    return jnp.float32
  return dtype


def f32_operands_on_cpu(*xs, preferred_element_type=None):
  """XLA:CPU has no bf16 × bf16 → f32 kernel for the dot layouts its YNNPACK fusion declines
  ("Unsupported element type for DotThunk", see :func:`mixed_on_cpu`): for the dots ``dense`` does
  not route to :func:`mixed_einsum` (attention, the MoE dispatch, mixed operand dtypes), operands
  asked to accumulate in float32 are upcast first. Exact (a product of two bf16 numbers is exact in
  float32) and for a CPU target only (:func:`jaxgrpo.parallel.target.current_platform`); accelerators keep the
  low-precision matmul."""
  if preferred_element_type == jnp.float32 and current_platform() == "cpu" and any(x.dtype != jnp.float32 for x in xs):
    return tuple(x.astype(jnp.float32) for x in xs)
  return xs


def mixed_on_cpu(*xs) -> bool:
  """Whether the 2-D dot of ``dense`` may run as :func:`mixed_einsum` (bf16 operands, float32
  accumulation): on XLA:CPU, every operand bfloat16, and outside ``jax.shard_map`` regions where an operand varies
  over a mesh axis (the hand-written backward does not sum weight gradients over them). ``dense`` also keeps the
  plain dot inside ``jaxgrpo.models.layers.forward_mode_autodiff`` (a ``custom_vjp`` has no forward mode).

  Chosen by the target platform (:func:`jaxgrpo.parallel.target.current_platform`), dtype and layout; whether the products then take bf16 or float32 operands by
  :func:`cpu_bf16_dots` (AMX or not). XLA:CPU (jax 0.10.2) hands a bf16 × bf16 →
  f32 dot to its YNNPACK fusion, which picks the CPU's bf16 kernel at run time; a dot YNNPACK declines
  falls to XLA's own DotThunk, which has no bf16 × bf16 → f32 kernel ("Unsupported element type for
  DotThunk::Execute: BF16 x BF16 = F32", raised when the program runs). The 2-D products of ``dense``
  and their backward products run (``tests/test_mixed_precision.py``); the batched attention einsums
  over a KV cache laid out ``[B, N, K, T]`` do not, so attention and the MoE dispatch keep
  :func:`f32_operands_on_cpu` (docs/models.md, "Mixed precision on the CPU")."""
  if current_platform() != "cpu":
    return False
  if not all(x.dtype == jnp.bfloat16 for x in xs):
    return False
  return not any(_varying(x) for x in xs)


def _varying(x) -> frozenset:
  """The manual mesh axes ``x`` varies over inside ``jax.shard_map`` (empty outside)."""
  t = jax.typeof(x)
  manual = getattr(t, "manual_axis_type", None)
  return frozenset(manual.varying) if manual is not None else frozenset(getattr(t, "vma", ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def mixed_einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """``einsum(spec, a, b)`` of bf16 operands accumulated in float32 (returns float32), with a backward
  whose products also take bf16 operands: the cotangent is rounded to bf16 first, as the cotangent of
  a bf16 activation is in any bf16 training (JAX's own transpose would multiply the float32 cotangent
  by the bf16 operand, a mixed-dtype dot XLA:CPU runs slower than float32). ``spec`` ``"A,B->C"``
  with every index of A and of B in one of the other two terms (a plain contraction)."""
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _mixed_einsum_fwd(spec, a, b):
  return mixed_einsum(spec, a, b), (a, b)


def _mixed_einsum_bwd(spec, res, g):
  a, b = res
  ins, out = spec.split("->")
  sa, sb = ins.split(",")
  g = g.astype(a.dtype)
  da = jnp.einsum(f"{out},{sb}->{sa}", g, b, preferred_element_type=jnp.float32)
  db = jnp.einsum(f"{sa},{out}->{sb}", a, g, preferred_element_type=jnp.float32)
  return da.astype(a.dtype), db.astype(b.dtype)


mixed_einsum.defvjp(_mixed_einsum_fwd, _mixed_einsum_bwd)
