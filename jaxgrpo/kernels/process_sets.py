"""Process sets of λ-GRPO: the prefix tree hidden in a group of completions.

Sullivan & Koller, "GRPO is Secretly a Process Reward Model" (arXiv:2509.21154). For trajectory ``i``
and completion position ``t`` (0-based, token ``t`` inclusive)::

    λ(i,t) = { j in group(i) : mask[j, 0..t] all true and tokens[j, 0..t] == tokens[i, 0..t] }

counted with multiplicity (identical completions are distinct members). ``|λ(i,t)| >= 1`` on real
tokens, 0 on padding, non-increasing in ``t``. ``mask`` is read as a right-padded completion mask:
position ``t`` is real only if ``mask[i, 0..t]`` are all true. Inputs: ``tokens int32[B, T]``,
``mask bool[B, T]``, ``group_ids int32[B]``; outputs ``[B, T]`` (tree statistics: scalars).

One job: |λ| and what is derived from it (process rewards ``R(i,t)``, step advantages,
tree statistics), with the argument checks, the choice of method and the compile rules they share.
The pieces are their own modules: prefix hashing (``jaxgrpo.kernels.prefix_hash``: what is certain, what is
probabilistic) and the two methods (``jaxgrpo.kernels._process_set_methods``). ``method="auto"`` (default)
takes ``"pairwise"`` while the group-size bound is at most :data:`SORT_MIN_GROUP_SIZE`, else
``"sort"``, and ``"sort"`` when the bound is unknown (traced ``group_ids``, no ``max_group_size``);
``exact=True`` compares tokens pairwise (``O(B·G·T)`` memory), the brute-force reference.

**Compiles.** The public functions check their arguments (shapes and dtypes at trace time, values
when concrete), then call module-level jitted kernels; inside an outer ``jit`` they trace as usual. A
direct call compiles exactly once per combination of: the arrays' shapes and dtypes, the method, the
pairwise bound (``min(max_group_size, B)`` when given — pass it to compile once per shape; else, with
concrete ``group_ids``, the largest group rounded up to a power of two; traced ``group_ids`` and no
bound: ``B``, ``O(B²)`` pairs, with a warning), ``exact``, ``scale``/``ddof``/``eps``, and
``num_groups``' power-of-two bucket (``num_groups`` itself is traced;
``process_tree_stats(per_group=True)`` compiles per ``num_groups``, its output's shape).

**Under jit** a row whose group id is out of range (negative, or ``>= num_groups``) and every row of
a group larger than a pairwise bound are *poisoned*: sizes ``-1``, rewards, advantages and tree
statistics ``NaN`` on the whole row; :func:`check_process_set_inputs` raises on the same conditions
on the host. ``B = 0`` or ``T = 0`` give empty outputs (tree statistics 0).

**Missing samples.** A row with a non-finite reward is a missing sample (``jaxgrpo.kernels.advantages``): it
is not part of the group's sample, so it is a member of no process set. λ(i,t) is a subset of the
group, and the group's statistics (mean, std) already leave the row out; counting it in a mate's
``|λ|`` would halve that mate's λ-GRPO weight on their shared tokens and break the theorem's identity
``Σ_{j∈λ(i,t)} a_j = |λ(i,t)|·A(i,t)`` (the row's advantage is 0, not ``A``). So the row is treated as
an empty completion: ``|λ|`` 0 on its tokens (as on padding), absent from every other row's ``|λ|``,
``R`` and tree statistics. ``process_rewards``/``process_advantages`` read it from the rewards;
``process_set_sizes``/``process_tree_stats`` take it as ``valid=`` (``bool[B]``, e.g.
``jnp.isfinite(rewards)``; None: every row is in the sample). With every row valid, the results are
bit-identical to a call without ``valid``.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo import _checks
from jaxgrpo.kernels._numerics import pow2_scale
from jaxgrpo.kernels._process_set_methods import method_sums
from jaxgrpo.kernels.advantages import group_baseline, standardize
from jaxgrpo.kernels.prefix_hash import prefix_hashes

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

_WARNED: set[str] = set()  # functions that already warned about an unbounded pairwise call


# ------------------------------------------------------------------------------------------------ shared


def _bad_rows(group_ids, num_groups):
  """bool[B]: rows whose group id is out of range (negative, or >= num_groups when it is given)."""
  bad = group_ids < 0
  if num_groups is not None:
    bad = bad | (group_ids >= num_groups)
  return bad


def _check_valid(valid, b: int) -> None:
  if valid is None:
    return
  _checks.check_rank(valid, 1, "valid", "bool[B] (True: the row is in the sample, e.g. jnp.isfinite(rewards))")
  _checks.check_bool(valid, "valid", "bool[B] (True: the row is in the sample, e.g. jnp.isfinite(rewards))")
  _checks.check_dim(valid, 0, b, "valid", "one flag per row of tokens")


def _reward_weights(rewards):
  """(value f32[B], present f32[B]): finite rewards and a 0/1 flag; non-finite ones are missing (0, 0)."""
  r = jax.lax.stop_gradient(rewards.astype(jnp.float32))
  finite = jnp.isfinite(r)
  return jnp.where(finite, r, 0.0), finite.astype(jnp.float32)


# ------------------------------------------------------------------------------------------------ kernels


def _sizes_impl(tokens, mask, group_ids, valid=None, *, method, bound, exact, num_groups=None):
  group_ids = group_ids.astype(jnp.int32)
  sizes, _, overflow = method_sums(tokens, mask, group_ids, [], method, bound, exact, valid)
  bad = overflow | _bad_rows(group_ids, num_groups)
  return jnp.where(bad[:, None], -1, jnp.round(sizes).astype(jnp.int32))


def _rewards_impl(rewards, tokens, mask, group_ids, *, method, bound, exact):
  """(R f32[B, T] (0 on padding), real bool[B, T], overflow bool[B]); a missing sample (non-finite reward)
  is in no process set: 0 on its own row, left out of every other row's R."""
  value, present = _reward_weights(rewards)
  scale = _huge_group_scale(value, group_ids)  # [B]; 1 unless the group has a reward past 2**120
  weights = [value / scale, present]
  sizes, (sums, counts), overflow = method_sums(tokens, mask, group_ids, weights, method, bound, exact, present > 0)
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
  adv = jnp.where(real, standardize(r_proc, mean[:, None], denom[:, None]), 0.0)
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
  tokens,
  mask,
  group_ids,
  *,
  valid=None,
  max_group_size: int | None = None,
  exact: bool = False,
  method: str = "auto",
):
  """``|λ(i,t)|``: how many members of i's group share its completion prefix up to token t.

  Only rows in the sample count: ``|λ(i,t)| = #{j in group(i), valid[j] : mask[j, 0..t] and
  tokens[j, 0..t] == tokens[i, 0..t]}`` (module docstring, "Missing samples").

  Args:
    tokens: ``int32[B, T]`` right-padded completions.
    mask: ``bool[B, T]`` true on real completion tokens.
    group_ids: ``int32[B]`` in ``[0, 2**31)``, any order, unequal and non-contiguous groups allowed.
    valid: ``bool[B]`` or None (every row): False marks a row outside the sample (a missing sample,
      e.g. ``~jnp.isfinite(rewards)``); it is in no process set — 0 on its own tokens, not counted in
      any other row's ``|λ|``.
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
    ``int32[B, T]``, ``|λ(i,t)|`` with token t inclusive and multiplicity counted, 0 on padding and on
    rows with ``valid`` False; ``-1`` on
    every position of a poisoned row (negative group id, or a group larger than the pairwise bound
    under ``jit``). ``B = 0`` or ``T = 0``: an empty array.

  Example (SPEC): {ABCD, ABEFHI, JKLM, JKLNQST, JKLNQU, VWYZ} → A,B = 2; J,K,L = 3; N,Q = 2; else 1.
  """
  b, t, method, bound = _plan("process_set_sizes", tokens, mask, group_ids, max_group_size, exact, method)
  _check_valid(valid, b)
  if b == 0 or t == 0:
    return jnp.zeros((b, t), jnp.int32)
  return _process_set_sizes(tokens, mask, group_ids, valid, method=method, bound=bound, exact=bool(exact))


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
  """The implicit process reward ``R(i,t) = mean_{j in λ(i,t)} r_j`` (Monte-Carlo step value).

  Args:
    rewards: ``f32[B]`` outcome rewards; a non-finite reward is a missing sample: a member of no process
      set (module docstring), so left out of every mean and ``R`` is 0 on its own row. tokens, mask, group_ids, max_group_size, exact, method: as in
      :func:`process_set_sizes`.

  Returns:
    ``f32[B, T]``, 0 on padding and on a missing sample's row; NaN on every
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
      0 and it is in no process set, so left out of every ``R`` and ``|λ|`` (and of the group
      statistics, by ``group_baseline``) — the identity above holds with missing samples.
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
def _process_tree_stats(tokens, mask, group_ids, sizes, valid, num_groups, *, groups, per_group, method, bound):
  group_ids = group_ids.astype(jnp.int32)
  if sizes is None:
    sizes = _sizes_impl(tokens, mask, group_ids, valid, method=method, bound=bound, exact=False, num_groups=num_groups)
  return _tree_stats_impl(sizes, group_ids, num_groups, groups=groups, per_group=per_group)


def process_tree_stats(
  tokens,
  mask,
  group_ids,
  num_groups: int,
  *,
  sizes=None,
  valid=None,
  max_group_size: int | None = None,
  per_group: bool = False,
  method: str = "auto",
):
  """Statistics of the per-group prefix trees B(G) that the λ-GRPO paper reports.

  Args:
    tokens, mask, group_ids: as in :func:`process_set_sizes`; num_groups: static int, every group id in
      ``[0, num_groups)``.
    sizes: optional precomputed ``process_set_sizes`` (``int32[B, T]``) to avoid recomputation.
    valid: ``bool[B]`` or None, as in :func:`process_set_sizes` (used only when ``sizes`` is None; pass
      it to ``process_set_sizes`` otherwise): a row outside the sample is an empty trajectory here.
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
    if valid is not None:
      raise ValueError(
        "process_tree_stats: pass `valid` to process_set_sizes when you give `sizes` (the sizes already say which "
        "rows are in the sample); got both `sizes` and `valid`"
      )
  _check_valid(valid, b)
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
    valid,
    jnp.int32(num_groups),
    groups=groups,
    per_group=bool(per_group),
    method=method,
    bound=bound,
  )
