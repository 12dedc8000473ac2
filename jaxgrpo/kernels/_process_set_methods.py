"""The two methods that compute λ-GRPO's process sets (``jaxgrpo.kernels.process_sets``), inside ``jit``.

Both return, for tokens ``int32[B, T]``, mask ``bool[B, T]`` and group ids ``int32[B]``, the sizes
``|λ(i,t)|`` and sums ``Σ_{j∈λ(i,t)} w_j`` of per-row weights, ``f32[B, T]`` each (:func:`method_sums`), equal
up to 64-bit hash collisions (``jaxgrpo.kernels.prefix_hash``), with no Python loop over trajectories:

- ``"sort"`` (sort-and-segment): the rows are sorted once by (group id, completion), comparing two
  rows at their first difference, found through the block-prefix hashes (a bitonic network,
  ``O(B·log²B)`` comparisons of ``O(64 + log T)`` each). In that order the rows sharing any prefix
  ``tokens[·, 0..t]`` are contiguous, so at every ``t`` each run of sorted neighbours whose common
  valid prefix is longer than ``t`` is one process set: ``|λ|`` is the run length, the sums are sums
  over the run (two scans over the rows, ``O(B·T)``) — the partition of sorting (group id, prefix
  hash at ``t``) at every ``t``, with one sort instead of ``T``. Independent of G; memory ``O(B·T)``.
- ``"pairwise"``: for each row and each of (up to ``bound``) members of its group, the longest common
  valid prefix (64-token blocks compared by block hashes with a binary search, then token by token
  inside the first differing block); ``|λ(i,t)| = #{j : lcp(i,j) > t}`` is a suffix histogram.
  ``O(B·T + B·G·(64 + log T))``: cheap for small groups, growing with G. ``exact=True`` compares
  tokens directly (``O(B·G·T)`` memory): the brute-force reference.

Rows outside the sample (``valid`` false: missing samples, non-finite rewards) are members of no
process set in either method (:func:`method_sums`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo.kernels.prefix_hash import block_hashes

__all__: list[str] = []

_BLOCK = 64  # tokens per hashed block (both methods compare rows block by block)


def _valid_lengths(mask):
  """int32[B]: length of the valid prefix, i.e. the index of the first False in each row (or T)."""
  t = mask.shape[1]
  first_false = jnp.argmin(mask, axis=1).astype(jnp.int32)
  return jnp.where(jnp.all(mask, axis=1), t, first_false)


# ------------------------------------------------------------------------------------------------ pairwise


def _candidates(group_ids, bound: int):
  """For every trajectory, the indices of (up to ``bound``) members of its group.

  Returns ``(idx int32[B, G], ok bool[B, G], overflow bool[B])``; ``ok`` is False on slots past the
  group's end, ``overflow`` marks rows of groups larger than ``bound``.
  """
  order = jnp.argsort(group_ids, stable=True)  # [B]
  sorted_ids = group_ids[order]
  start = jnp.searchsorted(sorted_ids, group_ids, side="left")  # [B]
  end = jnp.searchsorted(sorted_ids, group_ids, side="right")  # [B]
  slot = start[:, None] + jnp.arange(bound)[None, :]  # [B, G]
  ok = slot < end[:, None]
  idx = order[jnp.clip(slot, 0, group_ids.shape[0] - 1)]
  return idx, ok, end - start > bound


def _lcp_pairs(tok, block_hash, lengths, a, c, block: int):
  """Longest common valid prefix of rows ``a`` and ``c`` (index arrays of one shape), int32 of that shape.

  Whole blocks are compared by their 64-bit block-prefix hashes (binary search over blocks); the first
  block that differs is compared token by token, so the result is exact up to a block-level hash
  collision. Symmetric in ``a`` and ``c``.
  """
  nb = block_hash.shape[1]
  min_len = jnp.minimum(lengths[a], lengths[c])

  def body(_, lohi):
    lo, hi = lohi  # invariant: number of equal leading blocks in [lo, hi]
    mid = (lo + hi + 1) // 2
    p = jnp.clip(mid - 1, 0, nb - 1)
    same = jnp.all(block_hash[a, p] == block_hash[c, p], axis=-1)
    good = same & (mid * block <= min_len) & (lo < hi)
    return jnp.where(good, mid, lo), jnp.where(good | (lo >= hi), hi, mid - 1)

  lo = jnp.zeros(a.shape, jnp.int32)
  hi = jnp.full(a.shape, nb, jnp.int32)
  steps = max(1, int(np.ceil(np.log2(nb + 1))))
  full_blocks, _ = jax.lax.fori_loop(0, steps, body, (lo, hi))
  start = (full_blocks * block).reshape(-1)  # the first block that may differ

  def windows(rows):  # contiguous slices, not element gathers. A window that starts past the last block
    # (both rows equal to the end) is shifted back by dynamic_slice; every position in it is masked below.
    return jax.vmap(lambda r, s: jax.lax.dynamic_slice(tok, (r, s), (1, block))[0])(rows.reshape(-1), start)

  differs = (windows(a) != windows(c)) | (start[:, None] + jnp.arange(block) >= min_len.reshape(-1, 1))
  first = jnp.where(jnp.any(differs, axis=-1), jnp.argmax(differs, axis=-1), block)
  return (start + first).reshape(a.shape)


def _lcp_blocked(tokens, lengths, idx, ok, block: int):
  """Longest common valid prefix of i and idx[i, k] (hashed blocks, then tokens). int32[B, G]."""
  tok, block_hash = block_hashes(tokens, block)
  rows = jnp.broadcast_to(jnp.arange(tokens.shape[0])[:, None], idx.shape)
  return jnp.where(ok, _lcp_pairs(tok, block_hash, lengths, rows, idx, block), 0)


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


def _pairwise(tokens, mask, group_ids, weights, bound: int, exact: bool):
  """Pairwise method: ``(sizes f32[B, T], [sum_{j in λ} w_j for w in weights] f32[B, T] each, overflow)``."""
  t = tokens.shape[1]
  block = min(_BLOCK, t)
  lengths = _valid_lengths(mask)
  idx, ok, overflow = _candidates(group_ids, bound)
  lcp = _lcp_exact(tokens, lengths, idx, ok) if exact else _lcp_blocked(tokens, lengths, idx, ok, block)
  sizes = _suffix_histogram(lcp, ok, t, block)
  sums = [_suffix_histogram(lcp, jnp.where(ok, w[idx], 0.0), t, block) for w in weights]
  return sizes, sums, overflow


# ------------------------------------------------------------------------------------------------ sort


def _bitonic_stages(n: int) -> np.ndarray:
  """int32[S, 2]: the (k, j) compare-exchange stages of a bitonic sorting network on n = 2**m elements."""
  return np.array([(k, j) for k in (2**e for e in range(1, n.bit_length())) for j in _halves(k)], np.int32).reshape(
    -1, 2
  )


def _halves(k: int):
  j = k // 2
  while j >= 1:
    yield j
    j //= 2


def _sorted_rows(tokens, lengths, group_ids, block: int):
  """Rows in (group id, completion) lexicographic order, and the common valid prefix of neighbours.

  Returns ``(perm int32[B], adj int32[B])``: ``perm[k]`` is the row at sorted position ``k``;
  ``adj[k]`` the longest common valid prefix of rows ``perm[k-1]`` and ``perm[k]`` (0 across groups and
  at ``k = 0``). A valid prefix that ends is smaller than any continuation, so for every ``t`` the rows
  sharing a prefix ``tokens[·, 0..t]`` are contiguous in this order (the order of a depth-first walk of
  the group's prefix tree). Sorted by a bitonic network (``O(B log² B)`` comparisons) whose comparator
  finds the first difference of two rows through the 64-bit block-prefix hashes, as the pairwise method.
  """
  b = tokens.shape[0]
  n = 1 << max(b - 1, 0).bit_length()  # network size: B rounded up to a power of two
  tok, block_hash = block_hashes(tokens, block)

  def less(x, y):  # is row x strictly before row y? Network filler rows (index >= B) go last.
    fx, fy = x >= b, y >= b
    x, y = jnp.minimum(x, b - 1), jnp.minimum(y, b - 1)
    lcp = _lcp_pairs(tok, block_hash, lengths, x, y, block)
    ended = lcp >= jnp.minimum(lengths[x], lengths[y])
    at = jnp.clip(lcp, 0, tok.shape[1] - 1)
    by_tokens = jnp.where(ended, lengths[x] < lengths[y], tok[x, at] < tok[y, at])
    by_group = jnp.where(group_ids[x] == group_ids[y], by_tokens, group_ids[x] < group_ids[y])
    return jnp.where(fx == fy, by_group, fy)

  half = jnp.arange(n // 2)
  stages = jnp.asarray(_bitonic_stages(n))

  def stage(s, perm):
    k, j = stages[s, 0], stages[s, 1]
    lo = (half // j) * (2 * j) + half % j  # the lower index of each compare-exchange pair
    hi = lo + j
    x, y = perm[lo], perm[hi]
    swap = jnp.where((lo & k) == 0, less(y, x), less(x, y))  # ascending / descending halves
    return perm.at[lo].set(jnp.where(swap, y, x)).at[hi].set(jnp.where(swap, x, y))

  perm = jnp.arange(n, dtype=jnp.int32)
  if stages.shape[0]:  # none for a single row
    perm = jax.lax.fori_loop(0, stages.shape[0], stage, perm)
  perm = perm[:b]
  prev, cur = perm[:-1], perm[1:]
  adj = jnp.where(group_ids[prev] == group_ids[cur], _lcp_pairs(tok, block_hash, lengths, prev, cur, block), 0)
  return perm, jnp.concatenate([jnp.zeros(1, jnp.int32), adj])


def _run_totals(adj, values, t: int):
  """Run totals along sorted rows, at every position: ``[f32[B, T]]``, one per ``f32[B]`` in ``values``.

  At position ``s`` a run starts at sorted row ``k`` when ``adj[k] <= s``. Row ``k``'s total at ``s`` is the
  sum of ``values`` over its run. Two sequential scans over the rows, each step a vector op over the T
  positions (``O(B·T)``; an associative scan would cost ``O(B·T·log B)`` and is several times slower
  on CPU): forward, running sums restarted at every run start (summed within the run only, no
  cancellation against other runs); backward, each run's last running sum copied to its members.
  """
  pos = jnp.arange(t)
  values = jnp.stack(values, axis=1)  # [B, V]
  nxt = jnp.concatenate([adj[1:], jnp.zeros(1, adj.dtype)])  # adj of the next row; 0: the last row ends every run

  def forward(run, x):
    a, v = x
    run = jnp.where((a <= pos)[None, :], v[:, None], run + v[:, None])  # [V, T]
    return run, run

  _, running = jax.lax.scan(forward, jnp.zeros((values.shape[1], t), jnp.float32), (adj, values))

  def backward(total, x):
    a_next, run = x
    total = jnp.where((a_next <= pos)[None, :], run, total)
    return total, total

  _, totals = jax.lax.scan(backward, jnp.zeros((values.shape[1], t), jnp.float32), (nxt, running), reverse=True)
  return [totals[:, v] for v in range(values.shape[1])]


def _sort_segment(tokens, mask, group_ids, weights):
  """Sort-and-segment method: ``(sizes f32[B, T], [sum_{j in λ} w_j for w in weights] f32[B, T] each)``.

  One sort of the rows by (group id, completion) puts every process set of every position into one
  contiguous run; at position ``t`` a run breaks between sorted neighbours whose common valid prefix is
  at most ``t`` long. Run lengths are ``|λ|``, sums over the runs are the reward sums.
  """
  b, t = tokens.shape
  lengths = _valid_lengths(mask)
  perm, adj = _sorted_rows(tokens, lengths, group_ids, min(_BLOCK, t))
  totals = _run_totals(adj, [jnp.ones(b, jnp.float32)] + [w[perm] for w in weights], t)
  inv = jnp.zeros(b, jnp.int32).at[perm].set(jnp.arange(b, dtype=jnp.int32), unique_indices=True)
  valid = jnp.arange(t)[None, :] < lengths[:, None]
  out = [jnp.where(valid, x[inv], 0.0) for x in totals]
  return out[0], out[1:]


# ------------------------------------------------------------------------------------------------ dispatch


def method_sums(tokens, mask, group_ids, weights, method, bound, exact, valid=None):
  """(sizes f32[B, T], sums, overflow bool[B]) by the chosen method.

  ``valid`` (``bool[B]`` or None: every row): rows outside the sample (missing samples) are members of
  no process set. Both methods see such a row as an empty completion — a valid prefix of length 0
  shares no token with any row — so it counts in no other row's ``|λ|`` or sums and its own sizes
  and sums are 0, as on padding. With every row valid the mask is unchanged (bit-identical results).
  """
  if valid is not None:
    mask = mask & valid[:, None]
  if method == "sort":
    sizes, sums = _sort_segment(tokens, mask, group_ids, weights)
    return sizes, sums, jnp.zeros(tokens.shape[0], bool)
  return _pairwise(tokens, mask, group_ids, weights, bound, exact)
