"""Process sets of λ-GRPO: the prefix tree hidden in a group of completions.

Sullivan & Koller, "GRPO is Secretly a Process Reward Model" (arXiv:2509.21154). For trajectory ``i``
and completion position ``t`` (0-based, token ``t`` inclusive)::

    λ(i,t) = { j in group(i) : mask[j, 0..t] all true and tokens[j, 0..t] == tokens[i, 0..t] }

counted with multiplicity (identical completions are distinct members). ``|λ(i,t)| >= 1`` on real
tokens, 0 on padding, non-increasing in ``t``.

Algorithm (output-bound, inside jit, no Python loop over trajectories):

1. ``prefix_hashes``: a 64-bit hash of every prefix, as two uint32 words. Each (token, position) pair
   is mixed to two pseudo-random words and the words are summed along ``t`` modulo 2**32 (a cumulative
   Zobrist-style hash), so all ``B*T`` hashes cost one ``cumsum``.
2. For each trajectory ``i`` and each member ``j`` of its group, the longest common valid prefix
   ``lcp(i,j)`` is found by binary search on hash equality (``log2(T)`` gathers per pair).
3. ``|λ(i,t)| = #{j : lcp(i,j) > t}`` is a histogram of ``lcp(i, ·)`` followed by a reversed cumulative
   sum over ``t``; the process reward (sum of ``r_j`` over the same ``j``) is the same histogram with
   weights ``r_j``.

Cost: ``O(B*T + B*G*log T)`` with ``G`` the candidate group size (``max_group_size``, default ``B``).

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
    tok = tokens.astype(jnp.uint32)
    pos = jnp.arange(1, tokens.shape[1] + 1, dtype=jnp.uint32)[None, :]
    base = tok * _GOLDEN + pos * _POS_MUL
    words = [jnp.cumsum(_fmix32(base + seed), axis=1, dtype=jnp.uint32) for seed in _SEEDS]
    return jnp.stack(words, axis=-1)


def _valid_prefix(mask):
    """bool[B, T]: mask[i, 0..t] all true."""
    return jnp.cumprod(mask.astype(jnp.int32), axis=1).astype(bool)


def _candidates(group_ids, max_group_size: int):
    """For every trajectory, the indices of (up to ``max_group_size``) members of its group.

    Returns ``(idx int32[B, G], ok bool[B, G])``; ``ok`` is False on slots past the group's end.
    Groups larger than ``max_group_size`` are truncated silently in jit; callers check when concrete.
    """
    order = jnp.argsort(group_ids, stable=True)                        # [B]
    sorted_ids = group_ids[order]
    start = jnp.searchsorted(sorted_ids, group_ids, side="left")       # [B]
    end = jnp.searchsorted(sorted_ids, group_ids, side="right")        # [B]
    slot = start[:, None] + jnp.arange(max_group_size)[None, :]        # [B, G]
    ok = slot < end[:, None]
    idx = order[jnp.clip(slot, 0, group_ids.shape[0] - 1)]
    return idx, ok


def _lcp_hash(hashes, valid, idx, ok):
    """Longest common valid prefix of i and idx[i, k] by binary search on hash equality. int32[B, G]."""
    b, t = valid.shape
    rows = jnp.arange(b)[:, None]

    def equal_up_to(p):  # p: int32[B, G] in [0, T): prefixes of length p+1 equal and both valid
        hi = hashes[rows, p]                                   # [B, G, 2]
        hj = hashes[idx, p]
        return valid[rows, p] & valid[idx, p] & jnp.all(hi == hj, axis=-1)

    def body(_, lohi):
        lo, hi = lohi                   # invariant: lcp in [lo, hi]
        mid = (lo + hi + 1) // 2        # candidate length, >= 1 while lo < hi
        good = equal_up_to(jnp.clip(mid - 1, 0, t - 1)) & (lo < hi)
        return jnp.where(good, mid, lo), jnp.where(good | (lo >= hi), hi, mid - 1)

    lo = jnp.zeros(idx.shape, jnp.int32)
    hi = jnp.full(idx.shape, t, jnp.int32)
    steps = max(1, int(np.ceil(np.log2(t + 1))))
    lo, _ = jax.lax.fori_loop(0, steps, body, (lo, hi))
    return jnp.where(ok, lo, 0)


def _lcp_exact(tokens, valid, idx, ok):
    """Longest common valid prefix by direct token comparison. int32[B, G]; O(B*G*T) memory."""
    same = valid[:, None, :] & valid[idx] & (tokens[:, None, :] == tokens[idx])   # [B, G, T]
    lcp = jnp.sum(jnp.cumprod(same.astype(jnp.int32), axis=-1), axis=-1)
    return jnp.where(ok, lcp, 0)


def _suffix_histogram(lcp, weights, t: int):
    """out[i, s] = sum_k weights[i, k] * [lcp[i, k] > s] for s in [0, T). f32/int [B, T]."""
    b = lcp.shape[0]
    hist = jnp.zeros((b, t + 1), weights.dtype).at[jnp.arange(b)[:, None], lcp].add(weights)
    tail = jnp.cumsum(hist[:, ::-1], axis=1)[:, ::-1]          # tail[s] = sum_{l >= s} hist[l]
    return tail[:, 1:]


def _group_lcp(tokens, mask, group_ids, max_group_size, exact):
    b, t = _checks.check_tokens_mask(tokens, mask)
    _checks.check_group_ids(group_ids, b)
    if max_group_size is None:
        max_group_size = b
    if not isinstance(max_group_size, (int, np.integer)) or max_group_size < 1:
        raise ValueError(f"`max_group_size` must be a positive Python int or None; got {max_group_size!r}")
    max_group_size = min(int(max_group_size), b)
    ids = _checks.concrete_or_none(group_ids)
    if ids is not None and ids.size and np.bincount(ids).max() > max_group_size:
        raise ValueError(f"`max_group_size`={max_group_size} is smaller than the largest group "
                         f"({np.bincount(ids).max()} trajectories)")
    valid = _valid_prefix(mask)
    idx, ok = _candidates(group_ids, max_group_size)
    if exact:
        lcp = _lcp_exact(tokens, valid, idx, ok)
    else:
        lcp = _lcp_hash(prefix_hashes(tokens, mask), valid, idx, ok)
    return idx, ok, lcp


def process_set_sizes(tokens, mask, group_ids, *, max_group_size: int | None = None,
                      exact: bool = False):
    """``|λ(i,t)|``: how many members of i's group share its completion prefix up to token t.

    Args:
      tokens: ``int32[B, T]`` right-padded completions.
      mask: ``bool[B, T]`` true on real completion tokens.
      group_ids: ``int32[B]``, any order, unequal group sizes allowed.
      max_group_size: static bound on the largest group (e.g. G). ``None`` uses ``B`` (always
        correct, ``O(B^2 log T)``); giving ``G`` makes it ``O(B*G*log T)``. Checked when concrete.
      exact: compare tokens directly instead of 64-bit prefix hashes (``O(B*G*T)`` memory).

    Returns:
      ``int32[B, T]``, ``|λ(i,t)|`` with token t inclusive and multiplicity counted, 0 on padding.

    Example (SPEC): {ABCD, ABEFHI, JKLM, JKLNQST, JKLNQU, VWYZ} → A,B = 2; J,K,L = 3; N,Q = 2; else 1.
    """
    _, ok, lcp = _group_lcp(tokens, mask, group_ids, max_group_size, exact)
    return _suffix_histogram(lcp, ok.astype(jnp.int32), tokens.shape[1])


def process_rewards(rewards, tokens, mask, group_ids, *, max_group_size: int | None = None,
                    exact: bool = False):
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
    r = jax.lax.stop_gradient(rewards.astype(jnp.float32))
    sums = _suffix_histogram(lcp, jnp.where(ok, r[idx], 0.0), t)
    sizes = _suffix_histogram(lcp, ok.astype(jnp.float32), t)
    return sums, sizes


def process_advantages(rewards, tokens, mask, group_ids, num_groups: int, *, scale: str = "group",
                       ddof: int = 0, eps: float = 1e-6, max_group_size: int | None = None,
                       exact: bool = False):
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


def process_tree_stats(tokens, mask, group_ids, num_groups: int, *, sizes=None,
                       max_group_size: int | None = None):
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
    lengths = jnp.sum(real, axis=1)                                        # [B]
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
