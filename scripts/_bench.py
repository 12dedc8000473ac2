"""Timing helpers shared by the ``scripts/bench_*.py`` benchmarks (one implementation of each).

- :func:`timed`: wall seconds of one call, waiting for its (JAX) result.
- :func:`median_time`: warm-up calls, then the median of ``repeats`` timed calls.
- :func:`alternating_times`: several variants timed round-robin (the order rotated every round), so
  that machine noise hits every variant alike; medians with :func:`medians`.
- :func:`matmul_flops`, :func:`read_bandwidth`: this machine's float32 matmul throughput and memory
  read bandwidth, measured in the same run as the benchmark (the peaks MFU and roofline floors use).
- :func:`backend_line`: one line naming jax, the backend and the devices.
- :func:`grpo_batch`: a random NumPy GRPO batch of given rows, group, prompt and completion lengths.

A bench script imports it as ``import _bench`` after putting its own directory on ``sys.path``
(so that tests can load the script by its path).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo.models import Qwen3Config
from jaxgrpo.step import train

__all__ = [
  "add_model_args",
  "timed",
  "median_time",
  "alternating_times",
  "medians",
  "matmul_flops",
  "read_bandwidth",
  "backend_line",
  "grpo_batch",
]


def timed(fn: Callable[[], Any]) -> float:
  """Seconds of one call of ``fn()``, including the wait for every JAX array it returns."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t0


def median_time(fn: Callable[[], Any], repeats: int, *, warmup: int = 1) -> float:
  """The median of ``repeats`` :func:`timed` calls of ``fn``, after ``warmup`` untimed ones
  (compilation, caches)."""
  if repeats < 1:
    raise ValueError(f"`repeats` must be >= 1; got {repeats}")
  for _ in range(warmup):
    jax.block_until_ready(fn())
  return statistics.median(timed(fn) for _ in range(repeats))


def alternating_times(
  fns: Sequence[Callable[[], Any]],
  repeats: int,
  *,
  warmup: int = 1,
  rotate: bool = True,
  on_round: Callable[[int, list[float]], None] | None = None,
) -> list[list[float]]:
  """``times[i][r]``: seconds of ``fns[i]`` in round ``r``; every round calls every function once.

  Args:
    fns: the variants (zero-argument callables; stateful ones may update their state).
    repeats: rounds.
    warmup: untimed calls of each function first.
    rotate: start round ``r`` with function ``r mod len(fns)`` (else always in the given order).
    on_round: called after each round with ``(r, [seconds of each function in this round])``.
  """
  if repeats < 1:
    raise ValueError(f"`repeats` must be >= 1; got {repeats}")
  for fn in fns:
    for _ in range(warmup):
      jax.block_until_ready(fn())
  times: list[list[float]] = [[] for _ in fns]
  n = len(fns)
  for r in range(repeats):
    order = [(r + j) % n for j in range(n)] if rotate else list(range(n))
    for i in order:
      times[i].append(timed(fns[i]))
    if on_round is not None:
      on_round(r, [times[i][-1] for i in range(n)])
  return times


def medians(times: Sequence[Sequence[float]]) -> list[float]:
  """The median of each row of :func:`alternating_times`' result."""
  return [statistics.median(t) for t in times]


def matmul_flops(m: int = 2048, k: int = 2048, n: int = 2048, *, repeats: int = 5) -> float:
  """Median float32 matmul throughput in FLOP/s of a jitted ``f32[m, k] @ f32[k, n]`` on the default
  backend (``2·m·k·n`` FLOPs per call)."""
  a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
  f = jax.jit(jnp.matmul)
  return 2 * m * k * n / median_time(lambda: f(a, b), repeats)


def read_bandwidth(num_bytes: int = 256 * 2**20, *, repeats: int = 5) -> float:
  """Memory read bandwidth in bytes/s: a jitted sum over ``f32[num_bytes / 4]`` (median)."""
  x = jnp.ones((num_bytes // 4,), jnp.float32)
  f = jax.jit(jnp.sum)
  return num_bytes / median_time(lambda: f(x), repeats)


def backend_line() -> str:
  """``"jax <version>, <backend> (<device kind>), <n> device(s)"``."""
  devices = jax.devices()
  return f"jax {jax.__version__}, {jax.default_backend()} ({devices[0].device_kind}), {len(devices)} device(s)"


def add_model_args(p) -> None:
  """The Qwen3-architecture workload's shape flags (default: the 20.5M-parameter model of the sampler benches:
  vocab 32000, width 384, 4 layers, 8 heads / 4 kv heads of 32, intermediate 1536) and ``--seed``."""
  p.add_argument("--vocab", type=int, default=32000)
  p.add_argument("--hidden", type=int, default=384)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=4)
  p.add_argument("--head-dim", type=int, default=32)
  p.add_argument("--intermediate", type=int, default=1536)
  p.add_argument("--seed", type=int, default=0)


def grpo_batch(rng, b: int, g: int, p: int, t: int, vocab: int):
  """A NumPy ``jaxgrpo.step.train.Batch`` of ``b`` rows in groups of ``g``: prompts of ``p`` tokens, completions of
  ``t`` (one full-length row per group, so the bucket is ``t``), rollout and reference log-probs."""
  prompts = np.repeat(rng.integers(1, vocab, (b // g, p)), g, axis=0).astype(np.int32)
  lens = rng.integers(t // 2, t + 1, b)
  lens[::g] = t
  mask = np.arange(t)[None] < lens[:, None]
  comp = np.where(mask, rng.integers(1, vocab, (b, t)), 0).astype(np.int32)
  old = np.where(mask, -3.0 + 0.3 * rng.standard_normal((b, t)), 0).astype(np.float32)
  rewards = rng.integers(0, 2, b).astype(np.float32)
  gids = np.repeat(np.arange(b // g), g).astype(np.int32)
  return train.Batch(prompts, np.ones((b, p), bool), comp, mask, old, gids, rewards, old + 0.01)


def qwen3_config(shape, tokens: int) -> Qwen3Config:
  """The tied-embedding Qwen3 of a peers workload's ``ModelShape`` (``scripts/peers/common.py``: vocab, hidden,
  layers, heads, kv_heads, head_dim, intermediate), with positions for ``tokens`` (prompt + new; at least 512)."""
  return Qwen3Config(
    vocab_size=shape.vocab,
    hidden_size=shape.hidden,
    num_layers=shape.layers,
    num_heads=shape.heads,
    num_kv_heads=shape.kv_heads,
    head_dim=shape.head_dim,
    intermediate_size=shape.intermediate,
    tie_word_embeddings=True,
    max_position_embeddings=max(512, tokens),
  )
