"""Process sets of λ-GRPO: the prefix tree hidden in a group of completions.

Sullivan & Koller, "GRPO is Secretly a Process Reward Model" (arXiv:2509.21154). For trajectory ``i``
and completion position ``t`` (0-based, token ``t`` inclusive)::

    λ(i,t) = { j in group(i) : mask[j, 0..t] all true and tokens[j, 0..t] == tokens[i, 0..t] }

counted with multiplicity (identical completions are distinct members). ``|λ(i,t)| >= 1`` on real
tokens, 0 on padding, non-increasing in ``t``.

Algorithm (output-bound, inside jit, no Python loop over trajectories):

1. Hashing: each (token, position) pair is mixed to two pseudo-random uint32 words; summing them
   modulo 2**32 along ``t`` gives a 64-bit hash of every prefix (a cumulative Zobrist-style hash,
   :func:`prefix_hashes`). ``process_set_sizes`` sums the words per block of 64 tokens and then
   along blocks, which avoids a full-length cumsum.
2. For each trajectory ``i`` and each member ``j`` of its group, the longest common valid prefix
   ``lcp(i,j)``: whole blocks of 64 tokens are compared through 64-bit block-prefix hashes by binary
   search, and the first differing block is compared token by token.
3. ``|λ(i,t)| = #{j : lcp(i,j) > t}`` is a histogram of ``lcp(i, ·)`` followed by a reversed cumulative
   sum over ``t`` (blocked triangular matmuls); the process reward (sum of ``r_j`` over the same
   ``j``) is the same histogram with weights ``r_j``.

Cost: ``O(B*T + B*G*(64 + log T))`` with ``G`` the largest group (``max_group_size``); in practice one
pass over the tokens, one over the output, and ``B*G*64`` token comparisons. See
``scripts/bench_process_sets.py`` (≥ 10x faster per token than a host-side trie at 16x36x4096).

Hash collisions: two different prefixes of the same length get the same pair of words with probability
about 2**-64 per comparison, so a false merge is astronomically unlikely (~1e-12 for a million
pairs-by-position). ``exact=True`` compares tokens directly instead (``O(B*G*T)``, exact); tests use a
brute-force NumPy reference.

``mask`` is read as a right-padded completion mask: position ``t`` is real only if ``mask[i, 0..t]``
are all true (tokens after the first False count as padding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo import _checks
from jaxgrpo.advantages import group_baseline

_GOLDEN = np.uint32(0x9E3779B1)
_POS_MUL = np.uint32(0x85EBCA77)
_SEEDS = (np.uint32(0x2545F491), np.uint32(0x6C8E9CF5))
_BLOCK = 64  # tokens per hashed block in process_set_sizes


def _fmix32(h):
  """MurmurHash3's 32-bit finaliser: a bijective avalanche mix of uint32 words."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def prefix_hashes(tokens, mask):
  """64-bit hash of every completion prefix ``tokens[i, 0..t]``, as two uint32 words.

  ``H_w(i,t) = sum_{s<=t} fmix32(tokens[i,s]*φ + (s+1)*c + seed_w)  (mod 2**32)`` for the two words
  ``w``. Equal prefixes of equal length always hash equal; different ones collide with probability
  about 2**-64. Positions where ``mask`` is False still get a hash (callers combine it with the mask).

  Args:
    tokens: ``int32[B, T]`` completion tokens.
    mask: ``bool[B, T]`` true on real tokens.

  Returns:
    ``uint32[B, T, 2]``.
  """
  _checks.check_tokens_mask(tokens, mask)
  words = [jnp.cumsum(_mix(tokens, seed), axis=1, dtype=jnp.uint32) for seed in _SEEDS]
  return jnp.stack(words, axis=-1)


def _valid_lengths(mask):
  """int32[B]: length of the valid prefix, i.e. the index of the first False in each row (or T)."""
  t = mask.shape[1]
  first_false = jnp.argmin(mask, axis=1).astype(jnp.int32)
  return jnp.where(jnp.all(mask, axis=1), t, first_false)


def _mix(tokens, seed, offset: int = 0):
  """Pseudo-random uint32 word of every (token, position) pair."""
  pos = jnp.arange(offset + 1, offset + tokens.shape[1] + 1, dtype=jnp.uint32)[None, :]
  return _fmix32(tokens.astype(jnp.uint32) * _GOLDEN + pos * _POS_MUL + seed)


def _candidates(group_ids, max_group_size: int):
  """For every trajectory, the indices of (up to ``max_group_size``) members of its group.

  Returns ``(idx int32[B, G], ok bool[B, G])``; ``ok`` is False on slots past the group's end.
  """
  order = jnp.argsort(group_ids, stable=True)  # [B]
  sorted_ids = group_ids[order]
  start = jnp.searchsorted(sorted_ids, group_ids, side="left")  # [B]
  end = jnp.searchsorted(sorted_ids, group_ids, side="right")  # [B]
  slot = start[:, None] + jnp.arange(max_group_size)[None, :]  # [B, G]
  ok = slot < end[:, None]
  idx = order[jnp.clip(slot, 0, group_ids.shape[0] - 1)]
  return idx, ok


def _lcp_blocked(tokens, lengths, idx, ok, block: int):
  """Longest common valid prefix of i and idx[i, k]. int32[B, G].

  Whole blocks of ``block`` tokens are compared by 64-bit block-prefix hashes (binary search over
  blocks); the first block that differs is compared token by token, so the result is exact up to
  a block-level hash collision (~2**-64).
  """
  b, t = tokens.shape
  nb = -(-t // block)
  tok = jnp.pad(tokens, ((0, 0), (0, (nb + 1) * block - t)))  # room for the last window
  words = [_mix(tok[:, : nb * block], seed).reshape(b, nb, block).sum(axis=-1, dtype=jnp.uint32) for seed in _SEEDS]
  block_hash = jnp.stack([jnp.cumsum(w, axis=1, dtype=jnp.uint32) for w in words], -1)  # [B, nb, 2]
  rows = jnp.arange(b)[:, None]
  min_len = jnp.minimum(lengths[:, None], lengths[idx])  # [B, G]

  def body(_, lohi):
    lo, hi = lohi  # invariant: number of equal leading blocks in [lo, hi]
    mid = (lo + hi + 1) // 2
    p = jnp.clip(mid - 1, 0, nb - 1)
    same = jnp.all(block_hash[rows, p] == block_hash[idx, p], axis=-1)
    good = same & (mid * block <= min_len) & (lo < hi)
    return jnp.where(good, mid, lo), jnp.where(good | (lo >= hi), hi, mid - 1)

  lo = jnp.zeros(idx.shape, jnp.int32)
  hi = jnp.full(idx.shape, nb, jnp.int32)
  steps = max(1, int(np.ceil(np.log2(nb + 1))))
  full_blocks, _ = jax.lax.fori_loop(0, steps, body, (lo, hi))
  start = full_blocks * block  # [B, G]
  window = start[..., None] + jnp.arange(block)  # [B, G, block]
  same = (tok[rows[..., None], window] == tok[idx[..., None], window]) & (window < min_len[..., None])
  lcp = start + jnp.sum(jnp.cumprod(same.astype(jnp.int32), axis=-1), axis=-1)
  return jnp.where(ok, lcp, 0)


def _lcp_exact(tokens, lengths, idx, ok):
  """Longest common valid prefix by direct token comparison. int32[B, G]; O(B*G*T) memory."""
  pos = jnp.arange(tokens.shape[1])
  min_len = jnp.minimum(lengths[:, None], lengths[idx])
  same = (tokens[:, None, :] == tokens[idx]) & (pos < min_len[..., None])  # [B, G, T]
  lcp = jnp.sum(jnp.cumprod(same.astype(jnp.int32), axis=-1), axis=-1)
  return jnp.where(ok, lcp, 0)


def _reverse_cumsum(x, block: int):
  """out[:, s] = sum_{l >= s} x[:, l] in float32, as blocked triangular matmuls.

  XLA's CPU cumsum is an associative scan (log T passes); a [block, block] triangular matmul per
  block plus a short cumsum over block totals does the same in about one pass.
  """
  b, t = x.shape
  nb = -(-t // block)
  xb = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, nb * block - t))).reshape(b, nb, block)
  tril = jnp.tril(jnp.ones((block, block), jnp.float32))  # tril[r, s] = [r >= s]
  within = jnp.einsum("bnr,rs->bns", xb, tril, precision=jax.lax.Precision.HIGHEST)
  totals = within[:, :, 0]  # [B, nb]
  after = jnp.cumsum(totals[:, ::-1], axis=1)[:, ::-1] - totals  # blocks strictly later
  return (within + after[:, :, None]).reshape(b, nb * block)[:, :t]


def _suffix_histogram(lcp, weights, t: int, block: int):
  """out[i, s] = sum_k weights[i, k] * [lcp[i, k] > s] for s in [0, T). f32[B, T]."""
  b = lcp.shape[0]
  # lcp = l contributes to s = 0..l-1: put it at l-1 and sum from the right (l = 0: nowhere).
  pos = jnp.where(lcp > 0, lcp - 1, t)  # column t collects lcp = 0 and is dropped
  hist = jnp.zeros((b, t + 1), jnp.float32).at[jnp.arange(b)[:, None], pos].add(weights.astype(jnp.float32))
  hist = hist[:, :t]
  return _reverse_cumsum(hist, block)


def _group_lcp(tokens, mask, group_ids, max_group_size, exact, block=_BLOCK):
  b, t = _checks.check_tokens_mask(tokens, mask)
  _checks.check_group_ids(group_ids, b)
  ids = _checks.concrete_or_none(group_ids)
  largest = int(np.bincount(ids).max()) if ids is not None and ids.size else None
  if max_group_size is None:
    max_group_size = b if largest is None else largest
  if not isinstance(max_group_size, (int, np.integer)) or max_group_size < 1:
    raise ValueError(f"`max_group_size` must be a positive Python int or None; got {max_group_size!r}")
  max_group_size = min(int(max_group_size), b)
  if largest is not None and largest > max_group_size:
    raise ValueError(f"`max_group_size`={max_group_size} is smaller than the largest group ({largest} trajectories)")
  lengths = _valid_lengths(mask)
  idx, ok = _candidates(group_ids, max_group_size)
  if exact:
    lcp = _lcp_exact(tokens, lengths, idx, ok)
  else:
    lcp = _lcp_blocked(tokens, lengths, idx, ok, min(block, t))
  return idx, ok, lcp


def process_set_sizes(tokens, mask, group_ids, *, max_group_size: int | None = None, exact: bool = False):
  """``|λ(i,t)|``: how many members of i's group share its completion prefix up to token t.

  Args:
    tokens: ``int32[B, T]`` right-padded completions.
    mask: ``bool[B, T]`` true on real completion tokens.
    group_ids: ``int32[B]``, any order, unequal group sizes allowed.
    max_group_size: static bound on the largest group (e.g. G). ``None``: the largest group when
      ``group_ids`` is concrete, else ``B`` (always correct but ``O(B^2)`` pairs) — under ``jit``
      pass ``G``. Checked against the largest group when ``group_ids`` is concrete.
    exact: compare tokens directly instead of 64-bit prefix hashes (``O(B*G*T)`` memory).

  Returns:
    ``int32[B, T]``, ``|λ(i,t)|`` with token t inclusive and multiplicity counted, 0 on padding.

  Example (SPEC): {ABCD, ABEFHI, JKLM, JKLNQST, JKLNQU, VWYZ} → A,B = 2; J,K,L = 3; N,Q = 2; else 1.
  """
  _, ok, lcp = _group_lcp(tokens, mask, group_ids, max_group_size, exact)
  sizes = _suffix_histogram(lcp, ok, tokens.shape[1], min(_BLOCK, tokens.shape[1]))
  return jnp.round(sizes).astype(jnp.int32)


def process_rewards(rewards, tokens, mask, group_ids, *, max_group_size: int | None = None, exact: bool = False):
  """The implicit process reward ``R(i,t) = mean_{j in λ(i,t)} r_j`` (Monte-Carlo step value).

  Args:
    rewards: ``f32[B]`` outcome rewards; tokens, mask, group_ids, max_group_size, exact: as in
      :func:`process_set_sizes`.

  Returns:
    ``f32[B, T]``, 0 on padding. On tokens no other member shares, ``R(i,t) = r_i``.
  """
  _checks.check_rank(rewards, 1, "rewards", "float32[B]")
  _checks.check_float(rewards, "rewards", "float32[B]")
  _checks.check_dim(rewards, 0, np.shape(tokens)[0], "rewards", "one reward per row of tokens")
  sums, sizes = _process_sums(rewards, tokens, mask, group_ids, max_group_size, exact)
  return jnp.where(sizes > 0, sums / jnp.maximum(sizes, 1), 0.0)


def _process_sums(rewards, tokens, mask, group_ids, max_group_size, exact):
  idx, ok, lcp = _group_lcp(tokens, mask, group_ids, max_group_size, exact)
  t = tokens.shape[1]
  block = min(_BLOCK, t)
  r = jax.lax.stop_gradient(rewards.astype(jnp.float32))
  sums = _suffix_histogram(lcp, jnp.where(ok, r[idx], 0.0), t, block)
  sizes = jnp.round(_suffix_histogram(lcp, ok, t, block))
  return sums, sizes


def process_advantages(
  rewards,
  tokens,
  mask,
  group_ids,
  num_groups: int,
  *,
  scale: str = "group",
  ddof: int = 0,
  eps: float = 1e-6,
  max_group_size: int | None = None,
  exact: bool = False,
):
  """Step advantages ``A(i,t) = (R(i,t) - mean_g) / (std_g + eps)`` of the implicit PRM.

  The group statistics are those of the outcome rewards (exactly as in ``group_advantages`` with the
  same ``scale``/``ddof``/``eps``), applied to the process reward :func:`process_rewards`. The
  λ-GRPO theorem: token-mean GRPO == the PRM loss with these token advantages (each shared step
  counted ``|λ|`` times), so ``sum_{j in λ(i,t)} a_j = |λ(i,t)| * A(i,t)``.

  Returns:
    ``f32[B, T]``, 0 on padding.
  """
  mean, denom = group_baseline(rewards, group_ids, num_groups, scale=scale, ddof=ddof, eps=eps)
  sums, sizes = _process_sums(rewards, tokens, mask, group_ids, max_group_size, exact)
  real = sizes > 0
  r_proc = jnp.where(real, sums / jnp.maximum(sizes, 1), 0.0)
  return jnp.where(real, (r_proc - mean[:, None]) / denom[:, None], 0.0)


def process_tree_stats(tokens, mask, group_ids, num_groups: int, *, sizes=None, max_group_size: int | None = None):
  """Statistics of the per-group prefix trees B(G) that the λ-GRPO paper reports.

  Args:
    tokens, mask, group_ids: as in :func:`process_set_sizes`; num_groups: static int.
    sizes: optional precomputed ``process_set_sizes`` (``int32[B, T]``) to avoid recomputation.

  Returns:
    dict of ``f32`` scalars:

    - ``nontrivial_group_fraction``: among non-empty groups, the fraction with some token of
      ``|λ| > 1``.
    - ``mean_path_depth``: process steps root→leaf, i.e. ``1 + #{t in [1, len_i): |λ(i,t)| !=
      |λ(i,t-1)|}``, averaged over non-empty trajectories (a step is a maximal span shared by a
      fixed set of trajectories; sets nest, so a new step starts exactly where the size drops).
    - ``intermediate_proportion``: per trajectory, the fraction of its tokens with ``|λ| > 1``,
      averaged over non-empty trajectories.
    - ``mean_process_set_size``: mean ``|λ|`` over real tokens.
  """
  b, t = _checks.check_tokens_mask(tokens, mask)
  _checks.check_group_ids(group_ids, b, num_groups)
  if sizes is None:
    sizes = process_set_sizes(tokens, mask, group_ids, max_group_size=max_group_size)
  else:
    _checks.check_same_shape(sizes, "sizes", tokens, "tokens")
  real = sizes > 0
  lengths = jnp.sum(real, axis=1)  # [B]
  nonempty = lengths > 0
  n_traj = jnp.maximum(jnp.sum(nonempty), 1)
  drops = jnp.sum(real[:, 1:] & (sizes[:, 1:] != sizes[:, :-1]), axis=1)
  depth = jnp.where(nonempty, 1 + drops, 0)
  shared = jnp.sum(sizes > 1, axis=1)
  inter = jnp.where(nonempty, shared / jnp.maximum(lengths, 1), 0.0)
  grp_shared = jax.ops.segment_max((shared > 0).astype(jnp.int32), group_ids, num_segments=num_groups)
  grp_nonempty = jax.ops.segment_max(nonempty.astype(jnp.int32), group_ids, num_segments=num_groups)
  n_groups = jnp.maximum(jnp.sum(grp_nonempty > 0), 1)
  return {
    "nontrivial_group_fraction": jnp.sum(grp_shared > 0) / n_groups,
    "mean_path_depth": jnp.sum(depth) / n_traj,
    "intermediate_proportion": jnp.sum(inter) / n_traj,
    "mean_process_set_size": jnp.sum(sizes) / jnp.maximum(jnp.sum(real), 1),
  }
