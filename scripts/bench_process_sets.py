"""Benchmark: process-set sizes by a host-side Python trie vs ``process_set_sizes`` pairwise vs sort.

Three ways to compute ``|λ(i,t)|`` on the same batch, timed in the same run:

- ``trie``: a per-group prefix trie built on the host in pure Python (the λ-GRPO authors' approach,
  written here independently): insert every trajectory token by token, counting how many pass
  through each node; ``|λ(i,t)|`` is the count of the node trajectory ``i`` reaches at ``t``.
- ``pairwise``: ``process_set_sizes(method="pairwise", max_group_size=G)`` under ``jit``
  (``O(B·T + B·G·(64 + log T))``).
- ``sort``: ``process_set_sizes(method="sort")`` under ``jit`` (sort-and-segment over prefix hashes:
  one sort of the rows, then runs per position; ``O(B·T + B·log²B·64)``, independent of G).

First, direct calls (no outer ``jit``) of ``process_set_sizes`` and ``process_advantages`` on a
16 x 12 batch, after a warm-up call: what a notebook or research script pays per call. Then the sweep.
The jitted calls are timed as the train step uses them (``group_ids`` traced, the bound static), after
one warm-up call; the script asserts all three give identical sizes. Groups are realistic: each
trajectory branches off a random earlier one of its group at a random point; lengths are uniform in
``[T/2, T]``; vocabulary 32000. The three are timed in ``--repeats``
alternating rounds (each round calls all three, rotating the order, so a change of the machine's load
hits every column alike); per-token times are medians over the rounds, ratios are against the trie
measured in the same rounds, and each row prints the load average. ``--hash-cost`` adds, per G, the
block hashes' time against the former linear hash's (the cost of the non-linear mixers) beside the
whole pairwise call. ``SORT_MIN_GROUP_SIZE`` (``method="auto"``'s crossover, 64) was set
from this sweep: pairwise wins at G = 8 and 36, the two tie at 128, sort wins at 512 (BENCHMARKS.md).

Default sweep: G in {8, 36, 128, 512} at T = 4096 with 16 prompts, except that the number of prompts
is cut so the batch has at most 16 x 36 = 576 rows (G = 128: 4 prompts; G = 512: 1 prompt): every G
then runs at about the same B, so the columns show the effect of G, and the pairwise method's
``[B, G, 64]`` comparison windows stay small (16 x 512 rows would need several GB). ``--max-rows 0``
runs 16 prompts at every G. The table says how many prompts each row used.

    python scripts/bench_process_sets.py            # the sweep above
    python scripts/bench_process_sets.py --quick    # a small smoke run
    python scripts/bench_process_sets.py --groups 36 --length 1024 --prompts 16 --max-rows 0
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxgrpo as jg
from jaxgrpo.kernels import prefix_hash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/_bench.py, also when loaded by path
import _bench  # noqa: E402


def make_groups(prompts: int, group_size: int, length: int, seed: int = 0, vocab: int = 32000):
  """tokens int32[B, T], mask bool[B, T], group_ids int32[B] of ``prompts`` groups of ``group_size``."""
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
  """|λ(i,t)| from one prefix trie per group, built and read on the host in pure Python.

  A node is an int; the trie is one dict ``(node << 32 | token) -> child`` plus a list of pass counts,
  built per group and dropped after it (memory: one entry per distinct prefix of the group).
  """
  valid = np.cumprod(mask, axis=1, dtype=bool)
  lengths = valid.sum(axis=1)
  out = np.zeros(tokens.shape, np.int32)
  for g in np.unique(group_ids):
    members = np.flatnonzero(group_ids == g)
    children: dict[int, int] = {}
    counts = [0]  # node 0 is the root
    paths = []
    for i in members:
      node, path = 0, []
      for tok in tokens[i, : lengths[i]].tolist():
        key = node << 32 | tok
        child = children.get(key)
        if child is None:
          child = children[key] = len(counts)
          counts.append(0)
        counts[child] += 1
        node = child
        path.append(child)
      paths.append(path)
    for i, path in zip(members, paths):
      out[i, : len(path)] = [counts[n] for n in path]
  return out


def _jitted(method: str, g: int):
  return jax.jit(functools.partial(jg.process_set_sizes, method=method, max_group_size=g))


def bench_one(prompts: int, g: int, t: int, repeats: int) -> dict:
  """One batch shape: compile and check both methods against the trie, then time the trie, pairwise
  and sort in alternating rounds (each round calls all three, rotating the order), so a change of the
  machine's load hits every column alike; medians over the rounds."""
  tokens, mask, gid = make_groups(prompts, g, t)
  n = tokens.size
  args = [jax.device_put(x) for x in (tokens, mask, gid)]
  row = dict(prompts=prompts, group_size=g, length=t, rows=tokens.shape[0], tokens=n)
  want = trie_sizes(tokens, mask, gid)
  fns = [lambda: trie_sizes(tokens, mask, gid)]
  for method in ("pairwise", "sort"):
    f = _jitted(method, g)
    t0 = time.perf_counter()
    got = np.asarray(f(*args))
    row[f"{method}_compile_s"] = time.perf_counter() - t0
    if not np.array_equal(got, want):
      raise AssertionError(f"{method} sizes disagree with the trie at prompts={prompts}, G={g}, T={t}")
    fns.append(lambda f=f: f(*args))  # compiled above
  times = _bench.alternating_times(fns, repeats, warmup=0)
  for name, median in zip(("trie", "pairwise", "sort"), _bench.medians(times)):
    row[f"{name}_s_per_token"] = median / n
  row["load_average"] = os.getloadavg()[0]
  return row


def _linear_block_hashes(tokens, block: int):
  """The former prefix hash's block sums (before the non-linear mixers): one MurmurHash3 finaliser of
  ``tok·φ + pos·c + seed`` per word. Only for ``--hash-cost``: what the hash change cost."""
  b, t = tokens.shape
  nb = -(-t // block)
  tok = jnp.pad(tokens, ((0, 0), (0, nb * block - t))).astype(jnp.uint32)
  pos = jnp.arange(1, nb * block + 1, dtype=jnp.uint32)[None, :]
  words = [
    prefix_hash._fmix32(tok * np.uint32(0x9E3779B1) + pos * np.uint32(0x85EBCA77) + seed)
    for seed in (np.uint32(0x2545F491), np.uint32(0x6C8E9CF5))
  ]
  sums = [w.reshape(b, nb, block).sum(axis=-1, dtype=jnp.uint32) for w in words]
  return jnp.stack([jnp.cumsum(w, axis=1, dtype=jnp.uint32) for w in sums], -1)


def hash_cost(prompts: int, g: int, t: int, repeats: int) -> dict:
  """Median seconds of the block hashes (current non-linear mixers vs the former linear pre-image)
  and of the whole pairwise call, in alternating rounds."""
  tokens, mask, gid = (jax.device_put(x) for x in make_groups(prompts, g, t))
  new = jax.jit(lambda x: prefix_hash.block_hashes(x, 64)[1])
  old = jax.jit(lambda x: _linear_block_hashes(x, 64))
  full = _jitted("pairwise", g)
  times = _bench.alternating_times([lambda: new(tokens), lambda: old(tokens), lambda: full(tokens, mask, gid)], repeats)
  return dict(zip(("hash_nonlinear_s", "hash_linear_s", "pairwise_s"), _bench.medians(times)))


def direct_calls(repeats: int) -> dict:
  """Median seconds of direct (no outer jit) calls on a 16 x 12 batch, after one warm-up call each."""
  tokens, mask, gid = make_groups(4, 4, 12)
  rewards = np.linspace(0.0, 1.0, tokens.shape[0], dtype=np.float32)
  calls = {
    "process_set_sizes": lambda: jg.process_set_sizes(tokens, mask, gid),
    "process_advantages": lambda: jg.process_advantages(rewards, tokens, mask, gid, 4),
  }
  out = {}
  for name, call in calls.items():
    out[name] = _bench.median_time(call, max(repeats, 20))
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
  parser.add_argument("--groups", type=int, nargs="+", default=[8, 36, 128, 512], help="group sizes G")
  parser.add_argument("--length", type=int, default=4096, help="completion length T")
  parser.add_argument("--prompts", type=int, default=16, help="prompts (groups) per batch")
  parser.add_argument("--max-rows", type=int, default=16 * 36, help="cut prompts so rows <= this (0: no cut)")
  parser.add_argument("--repeats", type=int, default=5, help="alternating rounds (medians over them)")
  parser.add_argument(
    "--hash-cost", action="store_true", help="also time the block hashes vs the former linear hash, per G"
  )
  args = parser.parse_args(argv)
  if args.quick:
    args.groups, args.length, args.prompts, args.max_rows, args.repeats = [2, 5], 70, 3, 0, 1

  print(f"{_bench.backend_line()}; {args.repeats} alternating rounds, medians; load average {os.getloadavg()[0]:.1f}")
  print(f"auto method: pairwise up to G = {jg.kernels.process_sets.SORT_MIN_GROUP_SIZE}, sort above")
  header = (
    f"{'prompts x G x T':>16} {'tokens':>10} {'trie s/tok':>11} {'pairwise s/tok':>15} {'sort s/tok':>11} "
    f"{'trie/pairwise':>14} {'trie/sort':>10} {'pairwise/sort':>14} {'compile s (pw, sort)':>21} {'load':>5}"
  )
  direct = direct_calls(args.repeats)
  print(
    "direct calls on a 16 x 12 batch (NumPy in, after a warm-up): "
    + ", ".join(f"{name} {sec * 1e3:.2f} ms" for name, sec in direct.items())
  )
  print(header)
  rows = []
  for g in args.groups:
    prompts = args.prompts
    if args.max_rows:
      prompts = max(1, min(prompts, args.max_rows // g))
    row = bench_one(prompts, g, args.length, args.repeats)
    rows.append(row)
    trie, pw, srt = row["trie_s_per_token"], row["pairwise_s_per_token"], row["sort_s_per_token"]
    print(
      f"{f'{prompts}x{g}x{args.length}':>16} {row['tokens']:>10} {trie:>11.2e} {pw:>15.2e} {srt:>11.2e} "
      f"{trie / pw:>13.1f}x {trie / srt:>9.1f}x {pw / srt:>13.2f}x "
      f"{row['pairwise_compile_s']:>10.1f} {row['sort_compile_s']:>10.1f} {row['load_average']:>5.1f}",
      flush=True,
    )
    if args.hash_cost:
      cost = hash_cost(prompts, g, args.length, args.repeats)
      row.update(cost)
      print(
        f"{'':>16} block hashes {cost['hash_nonlinear_s'] * 1e3:.2f} ms (former linear hash "
        f"{cost['hash_linear_s'] * 1e3:.2f} ms) of a {cost['pairwise_s'] * 1e3:.2f} ms pairwise call",
        flush=True,
      )
  return rows


if __name__ == "__main__":
  main()
