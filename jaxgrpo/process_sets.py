"""Process sets of λ-GRPO: the prefix tree hidden in a group of completions.

Sullivan & Koller, "GRPO is Secretly a Process Reward Model" (arXiv:2509.21154). For trajectory ``i``
and completion position ``t`` (0-based, token ``t`` inclusive)::

    λ(i,t) = { j in group(i) : mask[j, 0..t] all true and tokens[j, 0..t] == tokens[i, 0..t] }

counted with multiplicity (identical completions are distinct members). ``|λ(i,t)| >= 1`` on real
tokens, 0 on padding, non-increasing in ``t``. ``mask`` is read as a right-padded completion mask:
position ``t`` is real only if ``mask[i, 0..t]`` are all true.

**Prefix hashes.** Every (token, position) pair is mixed to two 32-bit words by two *different*
non-linear mixers (word 0: ``F(F(tok ^ s0) + L(pos ^ q0))``, word 1: ``L(L(tok ^ s1) ^ F(pos ^ q1))``
with ``F`` MurmurHash3's finaliser and ``L`` the "lowbias32" finaliser, both bijections of uint32);
summing each word along ``t`` modulo 2**32 gives a 64-bit hash of every prefix (:func:`prefix_hashes`).
What is guaranteed, and what is not:

- *Certain:* equal prefixes of equal length hash equal; two prefixes of equal length that differ in
  exactly one position hash differently in *both* words (each word is a bijection of the token at a
  fixed position).
- *Probabilistic:* if the per-(token, position) words were uniformly random and independent, two
  prefixes that differ anywhere would collide with probability exactly 2**-64 — over the choice of
  the hash function, for inputs chosen independently of it (~5e-8 for 1e12 compared pairs). The
  mixers are fixed pseudo-random functions, so this is a heuristic for them: the words are not
  linear in token or position, and neither word is a function of the other, so structured inputs
  (token differences tied to position differences, arithmetic progressions, swaps, shifts) collide
  no more often than random ones (tests check such families word by word).
- *Not guaranteed:* the hash is not cryptographic. Someone who knows the constants can build a
  collision with about 2**32 work (a birthday search). For adversarial token sequences use
  ``exact=True``.

**Two methods** compute the same sizes (up to 64-bit hash collisions), both inside ``jit`` without a
Python loop over trajectories:

- ``method="sort"`` (the design's *sort-and-segment*): the ``B`` rows are sorted once by (group id,
  completion), comparing two rows at their first difference, found through the 64-bit block-prefix
  hashes (a bitonic network, ``O(B·log²B)`` comparisons of ``O(64 + log T)`` each). In that order the
  rows sharing any prefix ``tokens[·, 0..t]`` are contiguous, so at every position ``t`` each run of
  sorted neighbours whose common valid prefix is longer than ``t`` is one process set: ``|λ|`` is the run
  length and process rewards are sums over the run (two scans over the rows, ``O(B·T)``). This is the
  same partition as sorting the keys (group id, prefix hash at ``t``) at every ``t``, with one sort
  instead of ``T``. Independent of the group size ``G``; memory ``O(B·T)``.
- ``method="pairwise"``: for each trajectory and each of (up to ``max_group_size``) members of its
  group, the longest common valid prefix (64-token blocks compared by 64-bit block hashes with a
  binary search, then token by token inside the first differing block); ``|λ(i,t)| = #{j : lcp(i,j) >
  t}`` is a suffix histogram. ``O(B·T + B·G·(64 + log T))``: cheap for small groups, growing with G.
- ``method="auto"`` (default) takes ``"pairwise"`` while the group-size bound is at most
  :data:`SORT_MIN_GROUP_SIZE`, else ``"sort"``, and ``"sort"`` when the bound is unknown (traced
  ``group_ids`` and no ``max_group_size``).
- ``exact=True`` compares tokens pairwise (``O(B·G·T)`` memory): the brute-force reference.

**Calling.** The public functions check their arguments (shapes and dtypes at trace time, values when
the arrays are concrete), then call module-level jitted kernels with the static arguments declared, so
a direct call costs what it costs inside ``jit`` after the first call of a shape; inside an outer
``jit`` they trace as usual. The group-size bound of the pairwise method is static: when ``group_ids``
is concrete and ``max_group_size`` is not given it is the largest group rounded up to a power of two
(so batches whose largest group changes from 33 to 36 share one compiled program); when ``group_ids``
is traced and no bound is given, the pairwise method must assume ``B`` (``O(B²)`` pairs) and warns
once. A direct call compiles exactly once per combination of: the arrays' shapes and dtypes, the
method, the pairwise bound (``min(max_group_size, B)`` when given — the same every call, so pass it
once to compile once per shape; else the derived power of two above), ``exact``, ``scale``/``ddof``/
``eps``, and ``num_groups``' power-of-two bucket (``num_groups`` itself is a traced input;
``process_tree_stats(per_group=True)`` compiles per ``num_groups``, its output's shape).

**Failing loudly under jit.** Values cannot raise inside ``jit``. A row whose group id is out of range
(negative, or ``>= num_groups`` where ``num_groups`` is an argument), and every row of a group larger
than a pairwise bound, are *poisoned*: sizes ``-1`` and rewards, advantages and tree statistics
``NaN`` on the whole row. :func:`check_process_set_inputs` raises on the same conditions on the host.

**Degenerate shapes.** ``B = 0`` or ``T = 0`` give empty outputs of the right shape (tree statistics
0) after the usual argument checks.

**Non-finite rewards** are missing samples (the library's policy): they are left out of the mean
``R(i,t)`` (``|λ|``, the structure, is unchanged) and a missing trajectory's step advantages are 0.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo import _checks
from jaxgrpo._numerics import pow2_scale
from jaxgrpo.advantages import group_baseline, standardize

__all__ = [
  "PROCESS_SET_METHODS",
  "SORT_MIN_GROUP_SIZE",
  "check_process_set_inputs",
  "group_size_bound",
  "prefix_hashes",
  "process_set_sizes",
  "process_rewards",
  "process_advantages",
  "process_tree_stats",
]

PROCESS_SET_METHODS = ("auto", "pairwise", "sort")

# Crossover of method="auto": pairwise while the group-size bound G is <= this, sort above it.
# Both hash the B·T tokens; beyond that pairwise compares B·G row pairs (64-token windows), sort makes
# ~B·log²(B)/4 such comparisons plus two O(B·T) scans. Chosen by measurement (scripts/bench_process_sets.py;
# the figures are in BENCHMARKS.md, "Pairwise vs sort-and-segment").
SORT_MIN_GROUP_SIZE = 64

_BLOCK = 64  # tokens per hashed block (both methods compare rows block by block)
_WORD_SEEDS = (np.uint32(0x2545F491), np.uint32(0x6C8E9CF5))  # token seeds s0, s1
_POS_SEEDS = (np.uint32(0x9E3779B9), np.uint32(0x7F4A7C15))  # position seeds q0, q1
_WARNED: set[str] = set()  # functions that already warned about an unbounded pairwise call


# ------------------------------------------------------------------------------------------------ hashing


def _fmix32(h):
  """MurmurHash3's 32-bit finaliser: a bijective avalanche mix of uint32 words."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _lowbias32(h):
  """C. Wellons' "lowbias32" finaliser (hash-prospector): another bijective uint32 mix, other constants."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x7FEB352D)
  h = h ^ (h >> 15)
  h = h * jnp.uint32(0x846CA68B)
  return h ^ (h >> 16)


def _token_words(tokens, pos):
  """The two uint32 words of every (token, position) pair; ``pos`` broadcasts against ``tokens``.

  Word 0 adds a mixed token to a mixed position and mixes again with MurmurHash3's finaliser; word 1
  XORs differently seeded mixes and finishes with lowbias32. Both are bijective in the token at a fixed
  position and non-linear in both inputs.
  """
  tok = tokens.astype(jnp.uint32)
  pos = pos.astype(jnp.uint32)
  w0 = _fmix32(_fmix32(tok ^ _WORD_SEEDS[0]) + _lowbias32(pos ^ _POS_SEEDS[0]))
  w1 = _lowbias32(_lowbias32(tok ^ _WORD_SEEDS[1]) ^ _fmix32(pos ^ _POS_SEEDS[1]))
  return w0, w1


@jax.jit
def _prefix_hashes(tokens):
  w0, w1 = _token_words(tokens, jnp.arange(tokens.shape[1])[None, :])
  return jnp.stack([jnp.cumsum(w, axis=1, dtype=jnp.uint32) for w in (w0, w1)], axis=-1)


def prefix_hashes(tokens, mask):
  """64-bit hash of every completion prefix ``tokens[i, 0..t]``, as two uint32 words.

  ``H_w(i,t) = sum_{s<=t} h_w(tokens[i,s], s)  (mod 2**32)`` for the two words ``w``, with ``h_0`` and
  ``h_1`` two different non-linear mixes of (token, position) (module docstring: what is certain, what
  is probabilistic). Positions where ``mask`` is False still get a hash (callers combine it with the
  mask).

  Args:
    tokens: ``int32[B, T]`` completion tokens.
    mask: ``bool[B, T]`` true on real tokens.

  Returns:
    ``uint32[B, T, 2]``.
  """
  b, t = _checks.check_tokens_mask(tokens, mask)
  if b == 0 or t == 0:
    return jnp.zeros((b, t, 2), jnp.uint32)
  return _prefix_hashes(tokens)


# ------------------------------------------------------------------------------------------------ shared


def _valid_lengths(mask):
  """int32[B]: length of the valid prefix, i.e. the index of the first False in each row (or T)."""
  t = mask.shape[1]
  first_false = jnp.argmin(mask, axis=1).astype(jnp.int32)
  return jnp.where(jnp.all(mask, axis=1), t, first_false)


def _bad_rows(group_ids, num_groups):
  """bool[B]: rows whose group id is out of range (negative, or >= num_groups when it is given)."""
  bad = group_ids < 0
  if num_groups is not None:
    bad = bad | (group_ids >= num_groups)
  return bad


def _reward_weights(rewards):
  """(value f32[B], present f32[B]): finite rewards and a 0/1 flag; non-finite ones are missing (0, 0)."""
  r = jax.lax.stop_gradient(rewards.astype(jnp.float32))
  finite = jnp.isfinite(r)
  return jnp.where(finite, r, 0.0), finite.astype(jnp.float32)


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


def _block_hashes(tokens, block: int):
  """``(tok int32[B, nb·block], block_hash uint32[B, nb, 2])``: tokens zero-padded to whole blocks and the
  64-bit prefix hash at the end of every block of ``block`` tokens."""
  b, t = tokens.shape
  nb = -(-t // block)
  tok = jnp.pad(tokens, ((0, 0), (0, nb * block - t))) if nb * block > t else tokens
  words = _token_words(tok, jnp.arange(nb * block)[None, :])
  block_sums = [w.reshape(b, nb, block).sum(axis=-1, dtype=jnp.uint32) for w in words]
  return tok, jnp.stack([jnp.cumsum(w, axis=1, dtype=jnp.uint32) for w in block_sums], -1)


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
  tok, block_hash = _block_hashes(tokens, block)
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
  tok, block_hash = _block_hashes(tokens, block)

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


# ------------------------------------------------------------------------------------------------ kernels


def _sums(tokens, mask, group_ids, weights, method, bound, exact):
  """(sizes f32[B, T], sums, overflow bool[B]) by the chosen method."""
  if method == "sort":
    sizes, sums = _sort_segment(tokens, mask, group_ids, weights)
    return sizes, sums, jnp.zeros(tokens.shape[0], bool)
  return _pairwise(tokens, mask, group_ids, weights, bound, exact)


def _sizes_impl(tokens, mask, group_ids, *, method, bound, exact, num_groups=None):
  group_ids = group_ids.astype(jnp.int32)
  sizes, _, overflow = _sums(tokens, mask, group_ids, [], method, bound, exact)
  bad = overflow | _bad_rows(group_ids, num_groups)
  return jnp.where(bad[:, None], -1, jnp.round(sizes).astype(jnp.int32))


def _rewards_impl(rewards, tokens, mask, group_ids, *, method, bound, exact):
  """(R f32[B, T] (0 on padding), real bool[B, T], overflow bool[B]); missing rewards left out of R."""
  value, present = _reward_weights(rewards)
  scale = _huge_group_scale(value, group_ids)  # [B]; 1 unless the group has a reward past 2**120
  sizes, (sums, counts), overflow = _sums(tokens, mask, group_ids, [value / scale, present], method, bound, exact)
  counts = jnp.round(counts)
  real = sizes > 0.5
  r_proc = jnp.where(real & (counts > 0), sums / jnp.maximum(counts, 1.0), 0.0) * scale[:, None]
  return r_proc, real, overflow


def _huge_group_scale(value, group_ids):
  """f32[B]: a power of two >= the largest |reward| of each row's group where that is past 2**120, else 1.

  A process set's sum of such rewards would overflow; summing ``value / scale`` (exact: a power of two)
  and scaling the mean back does not. Groups are bucketed by ``id mod B`` (static segment count): a
  collision only gives a larger, still exact, scale.
  """
  b = value.shape[0]
  bucket = jnp.mod(group_ids, b)
  s = pow2_scale(jax.ops.segment_max(jnp.abs(value), bucket, num_segments=b))[bucket]
  return jnp.where(s >= 2.0**120, s, 1.0)


@jax.jit(static_argnames=("method", "bound", "exact"))
def _process_rewards(rewards, tokens, mask, group_ids, *, method, bound, exact):
  group_ids = group_ids.astype(jnp.int32)
  r_proc, _, overflow = _rewards_impl(rewards, tokens, mask, group_ids, method=method, bound=bound, exact=exact)
  return jnp.where((overflow | _bad_rows(group_ids, None))[:, None], jnp.nan, r_proc)


def _groups_bucket(num_groups: int) -> int:
  """The static segment count for ``num_groups`` groups: the next power of two (empty groups are
  ignored by every statistic), so calls whose ``num_groups`` differ within a bucket share one compiled
  program; the exact ``num_groups`` enters as a traced scalar (the out-of-range poisoning)."""
  return 1 << max(int(num_groups) - 1, 0).bit_length()


@jax.jit(static_argnames=("groups", "scale", "ddof", "eps", "method", "bound", "exact"))
def _process_advantages(
  rewards, tokens, mask, group_ids, num_groups, *, groups, scale, ddof, eps, method, bound, exact
):
  group_ids = group_ids.astype(jnp.int32)
  mean, denom = group_baseline(rewards, group_ids, groups, scale=scale, ddof=ddof, eps=eps)
  r_proc, real, overflow = _rewards_impl(rewards, tokens, mask, group_ids, method=method, bound=bound, exact=exact)
  keep = real & jnp.isfinite(rewards)[:, None]  # a missing sample's steps get advantage 0
  adv = jnp.where(keep, standardize(r_proc, mean[:, None], denom[:, None]), 0.0)
  return jnp.where((overflow | _bad_rows(group_ids, num_groups))[:, None], jnp.nan, adv)


_process_set_sizes = jax.jit(_sizes_impl, static_argnames=("method", "bound", "exact", "num_groups"))


# ------------------------------------------------------------------------------------------------ checks


def _check_max_group_size(max_group_size):
  if max_group_size is None:
    return
  if isinstance(max_group_size, bool) or not isinstance(max_group_size, (int, np.integer)) or max_group_size < 1:
    raise ValueError(f"`max_group_size` must be a positive Python int or None; got {max_group_size!r}")


def _largest_group(group_ids) -> int | None:
  """The size of the largest group if ``group_ids`` is concrete (0 for an empty batch), else None."""
  ids = _checks.concrete_or_none(group_ids)
  if ids is None:
    return None
  return int(np.bincount(ids).max()) if ids.size else 0


def group_size_bound(group_ids) -> int | None:
  """The static group-size bound derived from concrete ``group_ids``: the largest group's size rounded
  up to a power of two (so a new batch recompiles only when its largest group crosses a power of two),
  at most B; None when ``group_ids`` is traced. What ``process_set_sizes`` uses when
  ``max_group_size`` is None; call it on the host before an outer ``jit`` to pass the same bound in."""
  largest = _largest_group(group_ids)
  if largest is None:
    return None
  return min(1 << max(largest - 1, 0).bit_length(), max(int(np.shape(group_ids)[0]), 1))


def _plan(fn: str, tokens, mask, group_ids, max_group_size, exact, method, num_groups=None):
  """Argument checks and the static choices of one call: ``(b, t, method, bound)``.

  ``bound`` is the pairwise method's static group-size bound (None for the sort method, so its compiled
  programs do not depend on it).
  """
  b, t = _checks.check_tokens_mask(tokens, mask)
  _checks.check_group_ids(group_ids, b, num_groups)
  _checks.check_choice(method, PROCESS_SET_METHODS, "method")
  if not isinstance(exact, (bool, np.bool_)):
    raise TypeError(f"`exact` must be a Python bool; got {exact!r}")
  if exact and method == "sort":
    raise ValueError(
      "`exact=True` is the pairwise brute-force reference (direct token comparison); it has no sort form. "
      "Pass method='pairwise' or 'auto' with it."
    )
  _check_max_group_size(max_group_size)
  largest = _largest_group(group_ids)
  if largest is not None and max_group_size is not None and largest > max_group_size:
    raise ValueError(f"`max_group_size`={max_group_size} is smaller than the largest group ({largest} trajectories)")
  if b == 0 or t == 0:
    return b, t, "pairwise", 1
  if max_group_size is not None:
    bound = min(int(max_group_size), b)
  elif largest is not None:
    bound = group_size_bound(group_ids)
  else:
    bound = None
  if method == "auto":
    method = "pairwise" if exact or (bound is not None and bound <= SORT_MIN_GROUP_SIZE) else "sort"
  if method == "sort":
    return b, t, method, None
  if bound is None:
    _warn_unbounded(fn, b)
    bound = b
  return b, t, method, bound


def _warn_unbounded(fn: str, b: int) -> None:
  if fn in _WARNED:
    return
  _WARNED.add(fn)
  warnings.warn(
    f"{fn}: `group_ids` is traced and `max_group_size` is not given, so the pairwise method compares every "
    f"pair of the B={b} rows (O(B²) pairs instead of O(B·G)). Pass `max_group_size=G` (static), or use "
    "method='sort' (or 'auto'), whose cost does not depend on the group size. (Warned once per process.)",
    stacklevel=4,
  )


def check_process_set_inputs(tokens, mask, group_ids, max_group_size: int | None = None, *, num_groups=None) -> int:
  """Host-side check of a concrete batch before it enters a jitted program; returns the largest group.

  Inside ``jit`` the process-set kernels cannot raise on values; they poison the affected rows instead
  (sizes -1, NaN rewards/advantages). Call this on the concrete batch first to get a clear error:

  - shapes and dtypes as in :func:`process_set_sizes`;
  - every group id in ``[0, num_groups)`` (``[0, 2**31)`` when ``num_groups`` is None);
  - the largest group at most ``max_group_size`` when it is given (the pairwise method's bound).

  Args:
    tokens: ``int32[B, T]``; mask: ``bool[B, T]``; group_ids: ``int32[B]``, all concrete (NumPy or
      committed JAX arrays).
    max_group_size: the static bound the jitted call will use, or None.
    num_groups: the static number of groups the jitted call will use, or None.

  Returns:
    The size of the largest group (0 for an empty batch), e.g. to pass as ``max_group_size``.

  Raises:
    TypeError: an argument is traced (call this outside ``jit``), or a dtype is wrong.
    ValueError: a shape, a group id or the group-size bound is wrong.
  """
  for name, x in (("tokens", tokens), ("mask", mask), ("group_ids", group_ids)):
    if isinstance(x, jax.core.Tracer):
      raise TypeError(f"check_process_set_inputs needs concrete arrays (call it before jit); `{name}` is traced")
  b, _ = _checks.check_tokens_mask(tokens, mask)
  _checks.check_group_ids(group_ids, b, num_groups)
  _check_max_group_size(max_group_size)
  largest = _largest_group(group_ids)
  if max_group_size is not None and largest > max_group_size:
    raise ValueError(f"`max_group_size`={max_group_size} is smaller than the largest group ({largest} trajectories)")
  return largest


def _check_rewards(rewards, b: int) -> None:
  _checks.check_rank(rewards, 1, "rewards", "float32[B]")
  _checks.check_float(rewards, "rewards", "float32[B]")
  _checks.check_dim(rewards, 0, b, "rewards", "one reward per row of tokens")


# ------------------------------------------------------------------------------------------------ public


def process_set_sizes(
  tokens, mask, group_ids, *, max_group_size: int | None = None, exact: bool = False, method: str = "auto"
):
  """``|λ(i,t)|``: how many members of i's group share its completion prefix up to token t.

  Args:
    tokens: ``int32[B, T]`` right-padded completions.
    mask: ``bool[B, T]`` true on real completion tokens.
    group_ids: ``int32[B]`` in ``[0, 2**31)``, any order, unequal and non-contiguous groups allowed.
    max_group_size: static bound on the largest group (e.g. G) for the pairwise method, checked against
      the groups when ``group_ids`` is concrete. ``None``: the largest group rounded up to a power of
      two when ``group_ids`` is concrete; when it is traced, ``method="auto"`` then sorts (no bound
      needed) and ``method="pairwise"`` uses ``B`` (``O(B²)`` pairs; warns once).
    exact: compare tokens directly instead of 64-bit prefix hashes (pairwise, ``O(B·G·T)`` memory): the
      brute-force reference.
    method: ``"sort"`` (sort-and-segment, ``O(B·T + B·log²B·64)``, independent of G), ``"pairwise"``
      (``O(B·T + B·G·(64 + log T))``) or ``"auto"`` (pairwise up to :data:`SORT_MIN_GROUP_SIZE`, sort
      above it or when the bound is unknown).

  Returns:
    ``int32[B, T]``, ``|λ(i,t)|`` with token t inclusive and multiplicity counted, 0 on padding; ``-1`` on
    every position of a poisoned row (negative group id, or a group larger than the pairwise bound
    under ``jit``). ``B = 0`` or ``T = 0``: an empty array.

  Example (SPEC): {ABCD, ABEFHI, JKLM, JKLNQST, JKLNQU, VWYZ} → A,B = 2; J,K,L = 3; N,Q = 2; else 1.
  """
  b, t, method, bound = _plan("process_set_sizes", tokens, mask, group_ids, max_group_size, exact, method)
  if b == 0 or t == 0:
    return jnp.zeros((b, t), jnp.int32)
  return _process_set_sizes(tokens, mask, group_ids, method=method, bound=bound, exact=bool(exact))


def process_rewards(
  rewards,
  tokens,
  mask,
  group_ids,
  *,
  max_group_size: int | None = None,
  exact: bool = False,
  method: str = "auto",
):
  """The implicit process reward ``R(i,t) = mean_{j in λ(i,t), r_j finite} r_j`` (Monte-Carlo step value).

  Args:
    rewards: ``f32[B]`` outcome rewards; a non-finite reward is a missing sample, left out of every
      mean it would enter. tokens, mask, group_ids, max_group_size, exact, method: as in
      :func:`process_set_sizes`.

  Returns:
    ``f32[B, T]``, 0 on padding and where no member of ``λ(i,t)`` has a finite reward; NaN on every
    position of a poisoned row. On tokens no other member shares, ``R(i,t) = r_i``. No gradient flows
    to ``rewards``.
  """
  b, t, method, bound = _plan("process_rewards", tokens, mask, group_ids, max_group_size, exact, method)
  _check_rewards(rewards, b)
  if b == 0 or t == 0:
    return jnp.zeros((b, t), jnp.float32)
  return _process_rewards(rewards, tokens, mask, group_ids, method=method, bound=bound, exact=bool(exact))


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
  method: str = "auto",
):
  """Step advantages ``A(i,t) = (R(i,t) - mean_g) / (std_g + eps)`` of the implicit PRM.

  The group statistics are those of the outcome rewards (``advantages.group_baseline`` with the same
  ``scale``/``ddof``/``eps``), applied to the process reward :func:`process_rewards`. The λ-GRPO
  theorem: token-mean GRPO == the PRM loss with these token advantages (each shared step counted
  ``|λ|`` times), so ``sum_{j in λ(i,t)} a_j = |λ(i,t)| * A(i,t)``.

  Args:
    rewards: ``f32[B]``; a non-finite reward is a missing sample: its trajectory's step advantages are
      0 and it is left out of ``R`` (and of the group statistics, by ``group_baseline``).
    tokens, mask, group_ids, max_group_size, exact, method: as in :func:`process_set_sizes`.
    num_groups: static int, every group id in ``[0, num_groups)``.
    scale, ddof, eps: static, as in ``group_advantages``.

  Returns:
    ``f32[B, T]``, 0 on padding; NaN on every position of a poisoned row (group id out of
    ``[0, num_groups)``, or a group larger than the pairwise bound, under ``jit``).
  """
  b, t, method, bound = _plan(
    "process_advantages", tokens, mask, group_ids, max_group_size, exact, method, num_groups=num_groups
  )
  _check_rewards(rewards, b)
  if b == 0 or t == 0:
    group_baseline(rewards, group_ids, num_groups, scale=scale, ddof=ddof, eps=eps)  # its argument checks
    return jnp.zeros((b, t), jnp.float32)
  return _process_advantages(
    rewards,
    tokens,
    mask,
    group_ids,
    jnp.int32(num_groups),
    groups=_groups_bucket(num_groups),
    scale=scale,
    ddof=ddof,
    eps=eps,
    method=method,
    bound=bound,
    exact=bool(exact),
  )


def _tree_stats_impl(sizes, group_ids, num_groups, *, groups, per_group):
  """``groups`` (static) segments; ``num_groups`` (traced, <= groups) for the out-of-range check."""
  real = sizes > 0
  lengths = jnp.sum(real, axis=1)  # [B]
  nonempty = lengths > 0
  drops = jnp.sum(real[:, 1:] & (sizes[:, 1:] != sizes[:, :-1]), axis=1)
  depth = jnp.where(nonempty, 1 + drops, 0).astype(jnp.float32)
  shared = jnp.sum(sizes > 1, axis=1)
  inter = jnp.where(nonempty, shared / jnp.maximum(lengths, 1), 0.0)
  size_sum = jnp.sum(jnp.where(real, sizes, 0), axis=1).astype(jnp.float32)
  poisoned = jnp.any(sizes < 0, axis=1) | _bad_rows(group_ids, num_groups)

  def seg(x, op=jax.ops.segment_sum):
    return op(x, group_ids, num_segments=groups)

  def ratio(num, den):
    return jnp.where(den > 0, num / jnp.maximum(den, 1), 0.0)

  grp_nonempty = seg(nonempty.astype(jnp.int32), jax.ops.segment_max) > 0
  grp_shared = seg((shared > 0).astype(jnp.int32), jax.ops.segment_max) > 0
  if per_group:
    n_traj = seg(nonempty.astype(jnp.float32))
    stats = {
      "nontrivial_group_fraction": grp_shared.astype(jnp.float32),
      "mean_path_depth": ratio(seg(depth), n_traj),
      "intermediate_proportion": ratio(seg(inter), n_traj),
      "mean_process_set_size": ratio(seg(size_sum), seg(lengths.astype(jnp.float32))),
    }
    # a poisoned row poisons its group; an out-of-range id belongs to no group, so it poisons them all
    bad = (seg(poisoned.astype(jnp.int32), jax.ops.segment_max) > 0) | jnp.any(_bad_rows(group_ids, num_groups))
  else:
    n_traj = jnp.sum(nonempty)
    stats = {
      "nontrivial_group_fraction": ratio(jnp.sum(grp_shared), jnp.sum(grp_nonempty)),
      "mean_path_depth": ratio(jnp.sum(depth), n_traj),
      "intermediate_proportion": ratio(jnp.sum(inter), n_traj),
      "mean_process_set_size": ratio(jnp.sum(size_sum), jnp.sum(lengths)),
    }
    bad = jnp.any(poisoned)
  return {k: jnp.where(bad, jnp.nan, v).astype(jnp.float32) for k, v in stats.items()}


@jax.jit(static_argnames=("groups", "per_group", "method", "bound"))
def _process_tree_stats(tokens, mask, group_ids, sizes, num_groups, *, groups, per_group, method, bound):
  group_ids = group_ids.astype(jnp.int32)
  if sizes is None:
    sizes = _sizes_impl(tokens, mask, group_ids, method=method, bound=bound, exact=False, num_groups=num_groups)
  return _tree_stats_impl(sizes, group_ids, num_groups, groups=groups, per_group=per_group)


def process_tree_stats(
  tokens,
  mask,
  group_ids,
  num_groups: int,
  *,
  sizes=None,
  max_group_size: int | None = None,
  per_group: bool = False,
  method: str = "auto",
):
  """Statistics of the per-group prefix trees B(G) that the λ-GRPO paper reports.

  Args:
    tokens, mask, group_ids: as in :func:`process_set_sizes`; num_groups: static int, every group id in
      ``[0, num_groups)``.
    sizes: optional precomputed ``process_set_sizes`` (``int32[B, T]``) to avoid recomputation.
    max_group_size, method: as in :func:`process_set_sizes` (used only when ``sizes`` is None).
    per_group: static; False: batch statistics (``f32`` scalars); True: one value per group
      (``f32[num_groups]``), 0 for an empty group (no trajectory with a real token).

  Returns:
    dict of ``f32`` scalars (or ``f32[num_groups]``); all 0 for an empty batch; NaN when a row is
    poisoned (a ``-1`` in ``sizes`` or a group id out of range under ``jit``) — per group: in the
    groups of the poisoned rows, NaN everywhere if the id itself is out of range:

    - ``nontrivial_group_fraction``: among non-empty groups, the fraction with some token of
      ``|λ| > 1`` (per group: 1.0 or 0.0).
    - ``mean_path_depth``: process steps root→leaf, i.e. ``1 + #{t in [1, len_i): |λ(i,t)| !=
      |λ(i,t-1)|}``, averaged over non-empty trajectories (a step is a maximal span shared by a
      fixed set of trajectories; sets nest, so a new step starts exactly where the size drops).
    - ``intermediate_proportion``: per trajectory, the fraction of its tokens with ``|λ| > 1``,
      averaged over non-empty trajectories.
    - ``mean_process_set_size``: mean ``|λ|`` over real tokens.
  """
  b, t, method, bound = _plan(
    "process_tree_stats", tokens, mask, group_ids, max_group_size, False, method, num_groups=num_groups
  )
  if not isinstance(per_group, (bool, np.bool_)):
    raise TypeError(f"`per_group` must be a Python bool; got {per_group!r}")
  if sizes is not None:
    _checks.check_same_shape(sizes, "sizes", tokens, "tokens")
    _checks.check_int(sizes, "sizes", "int32[B, T]")
  if b == 0 or t == 0:
    shape = (num_groups,) if per_group else ()
    names = ("nontrivial_group_fraction", "mean_path_depth", "intermediate_proportion", "mean_process_set_size")
    return {k: jnp.zeros(shape, jnp.float32) for k in names}
  groups = num_groups if per_group else _groups_bucket(num_groups)  # per group: the output's shape
  return _process_tree_stats(
    tokens,
    mask,
    group_ids,
    sizes,
    jnp.int32(num_groups),
    groups=groups,
    per_group=bool(per_group),
    method=method,
    bound=bound,
  )
