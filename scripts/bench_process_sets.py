"""Benchmark: `process_set_sizes` (jitted, hashed prefixes) vs a pure-Python recursive-split trie.

The trie is the λ-GRPO authors' approach (a trie per group on the host), written here independently:
at each position it partitions the trajectories that still share a prefix by their next token;
a partition of one is filled to its end in bulk.

Groups are realistic: each trajectory branches off a random earlier one at a random point.

    python scripts/bench_process_sets.py            # the four sizes of the issue
    python scripts/bench_process_sets.py --quick    # a small smoke run
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import numpy as np

import jaxgrpo as jg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/_bench.py, also when loaded by path
import _bench  # noqa: E402


def make_groups(prompts: int, group_size: int, length: int, seed: int = 0, vocab: int = 32000):
  rng = np.random.default_rng(seed)
  b = prompts * group_size
  tokens = rng.integers(0, vocab, size=(b, length), dtype=np.int32)
  for p in range(prompts):
    base = p * group_size
    for k in range(1, group_size):
      parent = base + rng.integers(0, k)
      cut = int(rng.integers(0, length))
      tokens[base + k, :cut] = tokens[parent, :cut]
  lengths = rng.integers(length // 2, length + 1, size=b)
  mask = np.arange(length)[None, :] < lengths[:, None]
  group_ids = np.repeat(np.arange(prompts, dtype=np.int32), group_size)
  return tokens, mask, group_ids


def trie_sizes(tokens: np.ndarray, mask: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
  """|λ(i,t)| by recursive splitting of each group on the host (explicit stack, no recursion limit)."""
  lengths = mask.sum(axis=1)
  out = np.zeros(tokens.shape, np.int32)
  rows = tokens.tolist()
  for g in np.unique(group_ids):
    stack = [(list(np.flatnonzero(group_ids == g)), 0)]
    while stack:
      members, t = stack.pop()
      alive = [j for j in members if lengths[j] > t]
      if len(alive) == 1:
        j = alive[0]
        out[j, t : lengths[j]] = 1
        continue
      parts: dict[int, list[int]] = {}
      for j in alive:
        parts.setdefault(rows[j][t], []).append(j)
      for part in parts.values():
        if len(part) == 1:
          out[part[0], t : lengths[part[0]]] = 1
        else:
          out[part, t] = len(part)
          stack.append((part, t + 1))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()

  sizes = [(2, 4, 64), (4, 6, 128)] if args.quick else [(4, 6, 1024), (16, 36, 1024), (16, 36, 4096), (64, 36, 4096)]
  print(f"{_bench.backend_line()}; {args.repeats} repeats, medians")
  header = (
    f"{'prompts x G x T':>18} {'tokens':>9} {'trie s/tok':>11} {'ours(G) s/tok':>14} "
    f"{'ours(B) s/tok':>14} {'trie/ours(G)':>13} {'compile s':>10}"
  )
  print(header)
  rows = []
  for prompts, g, t in sizes:
    tokens, mask, gid = make_groups(prompts, g, t)
    n = tokens.size
    bounded = jax.jit(functools.partial(jg.process_set_sizes, max_group_size=g))
    unbounded = jax.jit(jg.process_set_sizes)
    args_dev = [jax.device_put(x) for x in (tokens, mask, gid)]
    t0 = time.perf_counter()
    ours = np.asarray(bounded(*args_dev))
    compile_s = time.perf_counter() - t0
    want = trie_sizes(tokens, mask, gid)
    assert np.array_equal(ours, want), "hashed sizes disagree with the trie"
    t_trie = _bench.median_time(
      lambda tokens=tokens, mask=mask, gid=gid: trie_sizes(tokens, mask, gid), max(1, min(args.repeats, 3)), warmup=0
    )
    t_ours = _bench.median_time(lambda f=bounded, a=args_dev: f(*a), args.repeats, warmup=0)  # compiled above
    t_unb = _bench.median_time(lambda f=unbounded, a=args_dev: f(*a), args.repeats)
    rows.append((prompts, g, t, n, t_trie / n, t_ours / n, t_unb / n))
    print(
      f"{f'{prompts}x{g}x{t}':>18} {n:>9} {t_trie / n:>11.2e} {t_ours / n:>14.2e} {t_unb / n:>14.2e} "
      f"{t_trie / t_ours:>12.1f}x {compile_s:>10.2f}",
      flush=True,
    )
  return rows


if __name__ == "__main__":
  main()
