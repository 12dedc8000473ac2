import functools
import importlib.util
import os

import core_refs as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxgrpo as jg
from jaxgrpo.kernels import process_sets as ps

SETTINGS = settings(max_examples=60, deadline=None)
METHODS = ("pairwise", "sort")
# jitted once per test: hypothesis draws are padded to one shape (see core_refs.groups)
sizes_hash = jax.jit(jg.process_set_sizes, static_argnames="method")
sizes_exact = jax.jit(functools.partial(jg.process_set_sizes, exact=True, max_group_size=10))
sizes_bounded = jax.jit(jg.process_set_sizes, static_argnames=("max_group_size", "method"))
proc_rewards = jax.jit(functools.partial(jg.process_rewards, max_group_size=10), static_argnames="method")
proc_adv = jax.jit(
  functools.partial(jg.process_advantages, max_group_size=10), static_argnums=4, static_argnames=("ddof", "method")
)
tree_stats = jax.jit(jg.process_tree_stats, static_argnums=3, static_argnames=("per_group", "method"))


def test_spec_worked_example():
  tokens, mask, gid = ref.from_strings(["ABCD", "ABEFHI", "JKLM", "JKLNQST", "JKLNQU", "VWYZ"])
  want = [
    [2, 2, 1, 1, 0, 0, 0],
    [2, 2, 1, 1, 1, 1, 0],
    [3, 3, 3, 1, 0, 0, 0],
    [3, 3, 3, 2, 2, 1, 1],
    [3, 3, 3, 2, 2, 1, 0],
    [1, 1, 1, 1, 0, 0, 0],
  ]
  for exact in (False, True):
    np.testing.assert_array_equal(jg.process_set_sizes(tokens, mask, gid, exact=exact), want)


def test_spec_duplicates_example():
  tokens, mask, gid = ref.from_strings(["AB", "AB", "ABC", "X"])
  np.testing.assert_array_equal(jg.process_set_sizes(tokens, mask, gid), [[3, 3, 0], [3, 3, 0], [3, 3, 1], [1, 0, 0]])


def test_groups_are_separate_and_any_order():
  # the same completions in two shuffled groups do not merge across groups
  tokens, mask, _ = ref.from_strings(["AB", "AC", "AB", "AB"])
  gid = np.array([1, 0, 0, 1], np.int32)
  np.testing.assert_array_equal(jg.process_set_sizes(tokens, mask, gid), [[2, 2], [2, 1], [2, 1], [2, 2]])


@SETTINGS
@given(ref.groups())
def test_sizes_match_bruteforce(data):
  tokens, mask, gid, _, _ = data
  want = ref.sizes(tokens, mask, gid)
  np.testing.assert_array_equal(sizes_hash(tokens, mask, gid), want)  # traced ids, no bound: auto sorts
  np.testing.assert_array_equal(sizes_exact(tokens, mask, gid), want)
  # pairwise with the tight bound (the largest group: a program per bound drawn); sort reads no bound
  # beyond its poisoning check, so one program (the trivially safe bound B) covers it
  gmax = int(np.bincount(gid).max())
  np.testing.assert_array_equal(sizes_bounded(tokens, mask, gid, max_group_size=gmax, method="pairwise"), want)
  np.testing.assert_array_equal(sizes_bounded(tokens, mask, gid, max_group_size=len(gid), method="sort"), want)
  for method in ("auto",) + METHODS:  # eager: concrete ids, the bound derived from them
    np.testing.assert_array_equal(jg.process_set_sizes(tokens, mask, gid, method=method), want)


@SETTINGS
@given(ref.groups())
def test_process_rewards_and_advantages_match_bruteforce(data):
  tokens, mask, gid, rewards, ng = data
  want_r = ref.process_rewards(rewards, tokens, mask, gid)
  for method in METHODS:
    np.testing.assert_allclose(proc_rewards(rewards, tokens, mask, gid, method=method), want_r, rtol=1e-5, atol=1e-6)
  for ddof in (0, 1):
    mean, denom = ref.group_stats(rewards, gid, ddof=ddof)
    want_a = np.where(ref.sizes(tokens, mask, gid) > 0, (want_r - mean[:, None]) / denom[:, None], 0.0)
    for method in METHODS:
      got = proc_adv(rewards, tokens, mask, gid, ng, ddof=ddof, method=method)
      np.testing.assert_allclose(got, want_a, rtol=1e-4, atol=1e-4)


def _ref_tree_stats(tokens, mask, gid):
  s = ref.sizes(tokens, mask, gid)
  depths, inter = [], []
  for i in range(len(tokens)):
    row = s[i][s[i] > 0]
    if len(row) == 0:
      continue
    # count process steps: maximal spans with the same member *set*
    sets = [tuple(x) for x in ref.process_sets(tokens, mask, gid)[i] if x]
    depths.append(1 + sum(sets[k] != sets[k - 1] for k in range(1, len(sets))))
    inter.append(np.mean(row > 1))
  groups = [g for g in np.unique(gid) if (s[gid == g] > 0).any()]
  nontrivial = [g for g in groups if (s[gid == g] > 1).any()]
  return {
    "nontrivial_group_fraction": len(nontrivial) / max(len(groups), 1),
    "mean_path_depth": np.mean(depths) if depths else 0.0,
    "intermediate_proportion": np.mean(inter) if inter else 0.0,
    "mean_process_set_size": s[s > 0].mean() if (s > 0).any() else 0.0,
  }


@SETTINGS
@given(ref.groups())
def test_tree_stats_match_bruteforce(data):
  tokens, mask, gid, _, ng = data
  got = tree_stats(tokens, mask, gid, ng)
  want = _ref_tree_stats(tokens, mask, gid)
  assert set(got) == set(want)
  for k in want:
    np.testing.assert_allclose(float(got[k]), want[k], rtol=1e-5, err_msg=k)
  per_group = tree_stats(tokens, mask, gid, ng, per_group=True, method="sort")
  for g in range(ng):
    rows = gid == g
    want_g = _ref_tree_stats(tokens[rows], mask[rows], gid[rows]) if rows.any() else dict.fromkeys(want, 0.0)
    for k in want:
      assert per_group[k].shape == (ng,) and per_group[k].dtype == jnp.float32
      np.testing.assert_allclose(float(per_group[k][g]), want_g[k], rtol=1e-5, err_msg=f"{k}, group {g}")


def test_tree_stats_hand_example():
  # {ABCD, ABEF}: steps AB then CD / EF -> depth 2 each; half the tokens shared
  tokens, mask, gid = ref.from_strings(["ABCD", "ABEF", "XY"], group_ids=[0, 0, 1])
  got = jg.process_tree_stats(tokens, mask, gid, 2)
  assert float(got["mean_path_depth"]) == pytest.approx((2 + 2 + 1) / 3)
  assert float(got["intermediate_proportion"]) == pytest.approx((0.5 + 0.5 + 0) / 3)
  assert float(got["nontrivial_group_fraction"]) == pytest.approx(0.5)
  assert float(got["mean_process_set_size"]) == pytest.approx((2 * 4 + 1 * 4 + 2) / 10)


def test_jit_vmap_and_sizes_shape_dtype():
  tokens, mask, gid = ref.from_strings(["ABCD", "ABEF", "ABCD"])
  f = jax.jit(functools.partial(jg.process_set_sizes, max_group_size=3))
  out = f(tokens, mask, gid)
  assert out.dtype == jnp.int32 and out.shape == tokens.shape
  np.testing.assert_array_equal(out, [[3, 3, 2, 2], [3, 3, 1, 1], [3, 3, 2, 2]])
  batched = jax.vmap(jg.process_set_sizes, in_axes=(0, 0, None))(
    np.stack([tokens, tokens[::-1]]), np.stack([mask, mask]), gid
  )
  np.testing.assert_array_equal(batched[0], out)


def test_prefix_hashes_equal_iff_prefix_equal():
  tokens, mask, _ = ref.from_strings(["ABCD", "ABCE", "BACD", "ABCD"])
  h = np.asarray(jg.prefix_hashes(tokens, mask))
  assert h.shape == (4, 4, 2) and h.dtype == np.uint32
  np.testing.assert_array_equal(h[0], h[3])
  np.testing.assert_array_equal(h[0, :3], h[1, :3])
  assert not np.array_equal(h[0, 3], h[1, 3])
  assert not np.any(np.all(h[0] == h[2], axis=-1))  # permutation of a prefix hashes differently


def test_no_false_merges_on_many_random_prefixes():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 50000, size=(512, 64)).astype(np.int32)
  h = np.asarray(jg.prefix_hashes(tokens, np.ones_like(tokens, bool)))
  keys = h[:, :, 0].astype(np.uint64) << np.uint64(32) | h[:, :, 1].astype(np.uint64)
  for t in (0, 5, 63):
    prefixes = {tuple(row[: t + 1]) for row in tokens}
    assert len(set(keys[:, t].tolist())) == len(prefixes)


def test_max_group_size_too_small_is_an_error():
  tokens, mask, gid = ref.from_strings(["A", "A", "A"])
  with pytest.raises(ValueError, match="max_group_size"):
    jg.process_set_sizes(tokens, mask, gid, max_group_size=2)


@pytest.mark.parametrize(
  "bad, match",
  [
    (dict(tokens=np.zeros((2, 3), np.float32)), "tokens"),
    (dict(tokens=np.zeros((2,), np.int32)), "tokens"),
    (dict(mask=np.zeros((2, 3), np.int32)), "mask"),
    (dict(mask=np.zeros((2, 4), bool)), "mask"),
    (dict(group_ids=np.zeros((3,), np.int32)), "group_ids"),
    (dict(group_ids=np.array([0, -1], np.int32)), "group_ids"),
    (dict(group_ids=np.zeros((2,), np.float32)), "group_ids"),
  ],
)
def test_bad_inputs_name_the_argument(bad, match):
  args = dict(tokens=np.zeros((2, 3), np.int32), mask=np.ones((2, 3), bool), group_ids=np.zeros((2,), np.int32))
  args.update(bad)
  with pytest.raises((ValueError, TypeError), match=match):
    jg.process_set_sizes(args["tokens"], args["mask"], args["group_ids"])


def test_tree_stats_group_id_out_of_range():
  tokens, mask, _ = ref.from_strings(["AB", "AC"])
  with pytest.raises(ValueError, match="group_ids"):
    jg.process_tree_stats(tokens, mask, np.array([0, 2], np.int32), 2)


def _lcp_sizes(tokens, mask, gid):
  """NumPy reference through pairwise longest common valid prefixes (fast enough for long T)."""
  v = ref.valid_prefix(mask)
  b, t = tokens.shape
  out = np.zeros((b, t), np.int32)
  for i in range(b):
    for j in range(b):
      if gid[i] != gid[j]:
        continue
      same = v[i] & v[j] & (tokens[i] == tokens[j])
      lcp = t if same.all() else int(np.argmin(same))
      out[i, :lcp] += 1
  return out


@pytest.mark.parametrize("t", [63, 64, 65, 200, 300])
def test_long_completions_across_hash_blocks(t):
  # branch points on both sides of 64-token block boundaries, some exactly on them
  rng = np.random.default_rng(t)
  b = 10
  tokens = rng.integers(0, 5, size=(b, t)).astype(np.int32)
  cuts = [0, 1, 63, 64, 65, 127, 128, t - 1, t, rng.integers(0, t)]
  for k in range(1, b):
    cut = min(cuts[k], t)
    tokens[k, :cut] = tokens[rng.integers(0, k), :cut]
  lengths = rng.integers(t // 2, t + 1, size=b)
  lengths[:3] = t
  mask = np.arange(t)[None] < lengths[:, None]
  gid = np.array([0, 0, 0, 0, 0, 0, 0, 1, 1, 1], np.int32)
  want = _lcp_sizes(tokens, mask, gid)
  np.testing.assert_array_equal(jg.process_set_sizes(tokens, mask, gid), want)
  np.testing.assert_array_equal(jg.process_set_sizes(tokens, mask, gid, exact=True), want)


# ------------------------------------------------------------------------------------------------
# sort-and-segment vs pairwise at realistic lengths, adversarial groups


@functools.cache
def _long_noncontiguous_case():
  """3 interleaved groups of unequal size, duplicates, empty rows, branch points at block boundaries;
  the NumPy references (sizes and process rewards, a Python loop: computed once for both methods)."""
  rng = np.random.default_rng(7)
  b, t = 24, 300
  tokens = rng.integers(0, 3, size=(b, t)).astype(np.int32)
  for k in range(1, b):
    cut = int(rng.choice([0, 1, 63, 64, 65, 128, t - 1, t, int(rng.integers(0, t))]))
    tokens[k, :cut] = tokens[rng.integers(0, k), :cut]
  tokens[5] = tokens[4]
  lengths = rng.integers(0, t + 1, size=b)
  lengths[[1, 2]] = 0, t
  mask = np.arange(t)[None] < lengths[:, None]
  mask[3, 10] = False  # a hole: everything after it is padding
  gid = rng.choice([0, 2, 5], size=b).astype(np.int32)
  rewards = rng.normal(size=b).astype(np.float32)
  want_r = np.zeros((b, t))
  v = ref.valid_prefix(mask)
  for i in range(b):
    for s_ in range(t):
      if v[i, s_]:
        members = [
          j for j in range(b) if gid[j] == gid[i] and v[j, s_] and (tokens[j, : s_ + 1] == tokens[i, : s_ + 1]).all()
        ]
        want_r[i, s_] = rewards[members].mean()
  return tokens, mask, gid, rewards, _lcp_sizes(tokens, mask, gid), want_r


@pytest.mark.parametrize("method", METHODS)
def test_methods_agree_on_long_noncontiguous_groups(method):
  tokens, mask, gid, rewards, want, want_r = _long_noncontiguous_case()
  np.testing.assert_array_equal(jg.process_set_sizes(tokens, mask, gid, method=method), want)
  got = jg.process_rewards(rewards, tokens, mask, gid, method=method)
  np.testing.assert_allclose(got, want_r, rtol=1e-5, atol=1e-6)


@st.composite
def _long_groups(draw, b=12, t=130):
  """Fixed-shape long rows: branch points near 64-token block edges, duplicates, holes, empty rows."""
  seed = draw(st.integers(0, 2**32 - 1))
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 2, size=(b, t)).astype(np.int32)
  edges = [0, 1, 63, 64, 65, 127, 128, 129, t]
  for k in range(1, b):
    cut = draw(st.sampled_from(edges + [int(rng.integers(0, t + 1))]))
    tokens[k, :cut] = tokens[draw(st.integers(0, k - 1)), :cut]
    if draw(st.integers(0, 6)) == 0:
      tokens[k] = tokens[k - 1]
  lengths = np.array([draw(st.sampled_from([0, 1, 64, 65, t, int(rng.integers(0, t + 1))])) for _ in range(b)])
  mask = np.arange(t)[None] < lengths[:, None]
  if draw(st.booleans()):
    mask[draw(st.integers(0, b - 1)), draw(st.integers(0, t - 1))] = False  # a hole
  gid = np.array(draw(st.lists(st.integers(0, 3), min_size=b, max_size=b)), np.int32)
  return tokens, mask, gid


@settings(max_examples=40, deadline=None)
@given(_long_groups())
def test_methods_match_reference_on_long_rows(data):
  tokens, mask, gid = data
  want = _lcp_sizes(tokens, mask, gid)
  for method in METHODS:
    np.testing.assert_array_equal(sizes_bounded(tokens, mask, gid, max_group_size=12, method=method), want)


def test_methods_same_answer_at_scale():
  # 8 groups of 36 at T = 512 with realistic branching: the two hashed methods and the exact reference
  rng = np.random.default_rng(11)
  g, prompts, t = 36, 8, 512
  b = g * prompts
  tokens = rng.integers(0, 32000, size=(b, t)).astype(np.int32)
  for p in range(prompts):
    for k in range(1, g):
      cut = int(rng.integers(0, t))
      tokens[p * g + k, :cut] = tokens[p * g + int(rng.integers(0, k)), :cut]
  mask = np.arange(t)[None] < rng.integers(t // 2, t + 1, size=b)[:, None]
  gid = rng.permutation(np.repeat(np.arange(prompts, dtype=np.int32), g))
  exact = np.asarray(jg.process_set_sizes(tokens, mask, gid, exact=True))
  for method in METHODS:
    np.testing.assert_array_equal(jg.process_set_sizes(tokens, mask, gid, method=method), exact)


@pytest.mark.parametrize("method", METHODS)
def test_single_row_and_two_rows(method):
  jitted = jax.jit(functools.partial(jg.process_set_sizes, method=method, max_group_size=2))
  for strings in (["ABC"], ["ABC", "ABD"], ["ABC", "ABC"]):
    tokens, mask, gid = ref.from_strings(strings)
    want = ref.sizes(tokens, mask, gid)
    np.testing.assert_array_equal(jg.process_set_sizes(tokens, mask, gid, method=method), want)
    np.testing.assert_array_equal(jitted(tokens, mask, gid), want)


def test_exact_has_no_sort_form_and_bad_method():
  tokens, mask, gid = ref.from_strings(["AB", "AC"])
  with pytest.raises(ValueError, match="exact"):
    jg.process_set_sizes(tokens, mask, gid, exact=True, method="sort")
  with pytest.raises(ValueError, match="method"):
    jg.process_set_sizes(tokens, mask, gid, method="trie")


# ------------------------------------------------------------------------------------------------
# loud under jit (issue 14, item 5)


def test_group_larger_than_bound_is_poisoned_under_jit():
  tokens, mask, gid = ref.from_strings(["AB", "AB", "AB", "AB", "XY"], group_ids=[0, 0, 0, 0, 1])
  with pytest.raises(ValueError, match="max_group_size"):  # eager: a clear error
    jg.process_set_sizes(tokens, mask, gid, max_group_size=2)
  rewards = np.array([1.0, 0.0, 1.0, 0.0, 1.0], np.float32)
  bound = functools.partial(jg.process_set_sizes, max_group_size=2)

  @jax.jit  # every call in one program (one compile, not six)
  def under_jit(rewards, tokens, mask, gid):
    return (
      {method: bound(tokens, mask, gid, method=method) for method in ("auto", "pairwise")},
      jg.process_rewards(rewards, tokens, mask, gid, max_group_size=2),
      jg.process_advantages(rewards, tokens, mask, gid, num_groups=2, max_group_size=2),
      jg.process_tree_stats(tokens, mask, gid, num_groups=2, max_group_size=2, per_group=True),
      jg.process_set_sizes(tokens, mask, gid, method="sort"),  # the sort method has no bound to exceed
    )

  sizes, r, a, stats, sort_sizes = under_jit(rewards, tokens, mask, gid)
  for method, got in sizes.items():
    np.testing.assert_array_equal(got, [[-1, -1]] * 4 + [[1, 1]], err_msg=method)
  assert np.all(np.isnan(r[:4])) and np.array_equal(r[4], [1.0, 1.0])
  assert np.all(np.isnan(a[:4])) and np.array_equal(a[4], [0.0, 0.0])
  for v in stats.values():
    assert np.isnan(v[0]) and np.isfinite(v[1])
  np.testing.assert_array_equal(sort_sizes, [[4, 4]] * 4 + [[1, 1]])


def test_out_of_range_group_ids_are_poisoned_under_jit():
  tokens, mask, _ = ref.from_strings(["AB", "AC", "AB", "XY"])
  gid = np.array([0, 0, 2, -1], np.int32)  # 2 is out of range for num_groups=2, -1 everywhere
  rewards = np.array([1.0, 0.0, 1.0, 0.5], np.float32)

  @jax.jit  # both methods, every function: one program (one compile, not eight)
  def under_jit(rewards, tokens, mask, gid):
    kw = dict(max_group_size=4)
    return {
      method: (
        jg.process_set_sizes(tokens, mask, gid, method=method, **kw),
        jg.process_rewards(rewards, tokens, mask, gid, method=method, **kw),
        jg.process_advantages(rewards, tokens, mask, gid, num_groups=2, method=method, **kw),
        jg.process_tree_stats(tokens, mask, gid, num_groups=2, method=method, **kw),
      )
      for method in METHODS
    }

  for method, (sizes, r, adv, stats) in under_jit(rewards, tokens, mask, gid).items():
    np.testing.assert_array_equal(sizes, [[2, 1], [2, 1], [1, 1], [-1, -1]], err_msg=method)
    assert np.all(np.isnan(r[3])) and np.all(np.isfinite(r[:3])), method
    assert np.all(np.isnan(adv[2:])) and np.all(np.isfinite(adv[:2])), method
    assert all(np.isnan(v) for v in stats.values()), method
  for bad_gid in (gid, np.array([0, 0, 1, 2], np.int32)):
    with pytest.raises(ValueError, match="group_ids"):
      ps.check_process_set_inputs(tokens, mask, bad_gid, num_groups=2)
  with pytest.raises(ValueError, match="group_ids"):
    jg.process_advantages(rewards, tokens, mask, gid, 2)


def test_check_process_set_inputs():
  tokens, mask, gid = ref.from_strings(["AB", "AB", "AB", "XY"], group_ids=[0, 0, 0, 1])
  assert ps.check_process_set_inputs(tokens, mask, gid) == 3
  assert ps.check_process_set_inputs(tokens, mask, gid, 3, num_groups=2) == 3
  with pytest.raises(ValueError, match="max_group_size`=2 is smaller than the largest group \\(3"):
    ps.check_process_set_inputs(tokens, mask, gid, 2)
  with pytest.raises(ValueError, match="max_group_size"):
    ps.check_process_set_inputs(tokens, mask, gid, 0)
  with pytest.raises(TypeError, match="mask"):
    ps.check_process_set_inputs(tokens, mask.astype(np.int32), gid)
  with pytest.raises(TypeError, match="traced"):
    jax.jit(ps.check_process_set_inputs)(tokens, mask, gid)
  assert ps.check_process_set_inputs(tokens[:0], mask[:0], gid[:0], 2) == 0


# ------------------------------------------------------------------------------------------------
# degenerate shapes (issue 14, item 7)


@pytest.mark.parametrize("b, t", [(0, 5), (3, 0), (0, 0)])
def test_empty_batches_give_empty_outputs(b, t):
  tokens, mask = np.zeros((b, t), np.int32), np.zeros((b, t), bool)
  gid, rewards = np.zeros(b, np.int32), np.zeros(b, np.float32)
  for fn in (jg.process_set_sizes, jax.jit(jg.process_set_sizes)):
    out = fn(tokens, mask, gid)
    assert out.shape == (b, t) and out.dtype == jnp.int32
  assert jg.process_set_sizes(tokens, mask, gid, max_group_size=4, method="pairwise").shape == (b, t)
  assert jg.prefix_hashes(tokens, mask).shape == (b, t, 2)
  assert jg.process_rewards(rewards, tokens, mask, gid).shape == (b, t)
  adv = jg.process_advantages(rewards, tokens, mask, gid, 2)
  assert adv.shape == (b, t) and adv.dtype == jnp.float32
  stats = jg.process_tree_stats(tokens, mask, gid, 2)
  assert all(float(v) == 0.0 for v in stats.values())
  assert all(v.shape == (2,) for v in jg.process_tree_stats(tokens, mask, gid, 2, per_group=True).values())
  with pytest.raises(ValueError, match="max_group_size"):  # still checked: the user passed it
    jg.process_set_sizes(tokens, mask, gid, max_group_size=0)
  with pytest.raises(ValueError, match="scale"):
    jg.process_advantages(rewards, tokens, mask, gid, 2, scale="bogus")


# ------------------------------------------------------------------------------------------------
# non-finite rewards are missing samples (issue 14, item 3)


def _ref_process_rewards_missing(rewards, tokens, mask, gid):
  """R(i,t) over the members of λ(i,t) with a finite reward; 0 where there are none (NumPy)."""
  out = np.zeros(tokens.shape)
  for i, row in enumerate(ref.process_sets(tokens, mask, gid)):
    for s_, members in enumerate(row):
      finite = [rewards[j] for j in members if np.isfinite(rewards[j])]
      out[i, s_] = np.mean(finite) if finite else 0.0
  return out


@pytest.mark.parametrize("method", METHODS)
def test_nonfinite_rewards_are_missing_samples(method):
  tokens, mask, gid = ref.from_strings(["ABCD", "ABCE", "ABX", "QR", "QS", "Z"], group_ids=[0, 0, 0, 1, 1, 2])
  rewards = np.array([1.0, np.nan, 0.0, 2.0, 1.0, np.inf], np.float32)
  finite = np.isfinite(rewards)

  @jax.jit  # the kernels in one program (one compile, not four)
  def kernels(rewards, tokens, mask, gid):
    kw = dict(method=method, max_group_size=3)
    return (
      jg.process_set_sizes(tokens, mask, gid, **kw),
      jg.process_set_sizes(tokens, mask, gid, valid=jnp.isfinite(rewards), **kw),
      jg.process_rewards(rewards, tokens, mask, gid, **kw),
      jg.process_advantages(rewards, tokens, mask, gid, 3, **kw),
    )

  every, sizes, r, adv = kernels(rewards, tokens, mask, gid)
  np.testing.assert_array_equal(every, ref.sizes(tokens, mask, gid))  # no `valid`: every row is in the sample
  kept = np.where(finite[:, None], mask, False)  # a missing sample is an empty completion
  np.testing.assert_array_equal(sizes, ref.sizes(tokens, kept, gid))
  np.testing.assert_array_equal(sizes[0], [2, 2, 1, 1])  # "ABCE" (missing) does not share "ABC" with "ABCD"
  np.testing.assert_allclose(r, _ref_process_rewards_missing(rewards, tokens, kept, gid), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(r)[[1, 5]], 0.0)  # a missing sample's own row: no process set
  adv = np.asarray(adv)
  np.testing.assert_array_equal(adv[[1, 5]], 0.0)  # missing samples: advantage 0, never NaN
  for i in np.flatnonzero(finite):
    members = (gid == gid[i]) & finite
    m, sd = rewards[members].mean(), rewards[members].std()
    want_i = (_ref_process_rewards_missing(rewards, tokens, kept, gid)[i] - m) / (sd + 1e-6)
    np.testing.assert_allclose(adv[i], np.where(mask[i], want_i, 0.0), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# missing samples are in no process set (issue 33, item 9): an independent trie over the valid rows


def _trie(tokens, mask, gid, rewards):
  """A dict-of-prefixes counter over the rows in the sample (finite reward): for every (group, prefix)
  the number of valid rows through it and the sum of their rewards; then per (i, t) of a valid row,
  ``|λ(i,t)|``, the members and ``R(i,t)``. Missing rows and padding: size 0, no members, R 0."""
  lengths = np.cumprod(mask, axis=1).sum(axis=1)
  valid = np.isfinite(rewards)
  count, total, members = {}, {}, {}
  for j in np.flatnonzero(valid):
    for t in range(lengths[j]):
      key = (int(gid[j]), tuple(tokens[j, : t + 1].tolist()))
      count[key] = count.get(key, 0) + 1
      total[key] = total.get(key, 0.0) + float(rewards[j])
      members.setdefault(key, []).append(int(j))
  b, t_max = tokens.shape
  sizes, r_proc, sets = np.zeros((b, t_max), np.int64), np.zeros((b, t_max)), {}
  for i in np.flatnonzero(valid):
    for t in range(lengths[i]):
      key = (int(gid[i]), tuple(tokens[i, : t + 1].tolist()))
      sizes[i, t], r_proc[i, t], sets[i, t] = count[key], total[key] / count[key], members[key]
  return sizes, r_proc, sets


def _batch_with_missing(seed, b=12, t=9, n_groups=3, vocab=2):
  """Groups of unequal sizes (shuffled, non-contiguous), unequal lengths, long shared prefixes, duplicates,
  a NaN and an inf reward in a shared prefix, a missing row that is the only other member of a prefix."""
  rng = np.random.default_rng(seed)
  gid = rng.permutation(np.arange(b) % n_groups + (np.arange(b) >= b - 2)).astype(np.int32)  # 4 groups
  tokens = rng.integers(0, vocab, size=(b, t)).astype(np.int32)
  for i in range(1, b):  # branch off an earlier row of the group
    earlier = np.flatnonzero(gid[:i] == gid[i])
    if earlier.size:
      cut = rng.integers(1, t + 1)
      tokens[i, :cut] = tokens[rng.choice(earlier), :cut]
  lengths = rng.integers(1, t + 1, size=b)
  mask = np.arange(t)[None, :] < lengths[:, None]
  rewards = rng.choice(np.array([-1.0, 0.0, 0.5, 1.0], np.float32), size=b)
  shared = [i for i in range(b) if any(gid[j] == gid[i] and tokens[j, 0] == tokens[i, 0] for j in range(b) if j != i)]
  bad = rng.choice(shared, size=3, replace=False)
  rewards[bad] = [np.nan, np.inf, -np.inf]
  return tokens, mask, gid, rewards


@pytest.mark.parametrize("method", METHODS)
def test_missing_samples_are_in_no_process_set(method):
  """|λ|, R(i,t), A(i,t), the λ-GRPO weights and the tree statistics count only the rows in the sample,
  against a NumPy trie over the valid rows; the theorem's identity sum_{j in λ(i,t)} a_j = |λ(i,t)|·A(i,t)
  holds with missing samples (today a missing mate counts in |λ| with a_j = 0, and the identity fails)."""
  config = jg.preset("lambda_grpo")

  @jax.jit  # one program per method for every seed (one shape)
  def kernels(rewards, tokens, mask, gid):
    kw = dict(method=method, max_group_size=8)
    valid = jnp.isfinite(rewards)
    return (
      jg.process_set_sizes(tokens, mask, gid, valid=valid, **kw),
      jg.process_rewards(rewards, tokens, mask, gid, **kw),
      jg.process_advantages(rewards, tokens, mask, gid, 4, **kw),
      jg.group_advantages(rewards, gid, 4),
      jg.process_tree_stats(tokens, mask, gid, 4, valid=valid, **kw),
    )

  for seed in range(3):
    tokens, mask, gid, rewards = _batch_with_missing(seed)
    sizes, r_proc, step_adv, adv, stats = jax.tree.map(np.asarray, kernels(rewards, tokens, mask, gid))
    want_sizes, want_r, sets = _trie(tokens, mask, gid, rewards)
    np.testing.assert_array_equal(sizes, want_sizes)
    np.testing.assert_allclose(r_proc, want_r, rtol=1e-6, atol=1e-7)
    valid = np.isfinite(rewards)
    mean = {g: rewards[(gid == g) & valid].mean() for g in np.unique(gid)}
    std = {g: rewards[(gid == g) & valid].std() for g in np.unique(gid)}
    for (i, t), members in sets.items():
      g = gid[i]
      want_a = (want_r[i, t] - mean[g]) / (std[g] + 1e-6)
      np.testing.assert_allclose(step_adv[i, t], want_a, rtol=1e-5, atol=1e-5)
      # the theorem: the outcome advantages of λ(i,t) sum to |λ(i,t)| times the step advantage
      np.testing.assert_allclose(adv[members].sum(), sizes[i, t] * step_adv[i, t], rtol=1e-5, atol=1e-5)
    assert not np.any(step_adv[~valid]) and not np.any(sizes[~valid])
    # the λ-GRPO token weights (objective.rollout_advantages): 1/|λ| over the rows in the sample
    _, weights = jg.rollout_advantages(config, rewards, tokens, mask, gid, 4, max_group_size=8)
    want_w = np.where(want_sizes > 0, 1.0 / np.maximum(want_sizes, 1), 0.0)
    np.testing.assert_allclose(weights, want_w, rtol=1e-6)
    # tree statistics: those of the batch without its missing samples
    want_stats = _ref_tree_stats(tokens, np.where(valid[:, None], mask, False), gid)
    for k, v in want_stats.items():
      np.testing.assert_allclose(stats[k], v, rtol=1e-5, err_msg=k)


def test_all_valid_rows_give_bit_identical_results():
  tokens, mask, gid, rewards = _batch_with_missing(0)
  rewards = np.nan_to_num(rewards, nan=0.5, posinf=1.0, neginf=-1.0)
  every = np.ones(len(gid), bool)
  for method in METHODS:
    np.testing.assert_array_equal(
      jg.process_set_sizes(tokens, mask, gid, valid=every, method=method),
      jg.process_set_sizes(tokens, mask, gid, method=method),
    )
    a = jg.process_tree_stats(tokens, mask, gid, 4, valid=every, method=method)
    b = jg.process_tree_stats(tokens, mask, gid, 4, method=method)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_valid_is_checked():
  tokens, mask, gid = ref.from_strings(["AB", "AC"])
  with pytest.raises(TypeError, match=r"`valid` must be a boolean array \(bool\[B\]"):
    jg.process_set_sizes(tokens, mask, gid, valid=np.ones(2, np.float32))
  with pytest.raises(ValueError, match="`valid`"):
    jg.process_set_sizes(tokens, mask, gid, valid=np.ones(3, bool))
  sizes = jg.process_set_sizes(tokens, mask, gid)
  with pytest.raises(ValueError, match="pass `valid` to process_set_sizes when you give `sizes`"):
    jg.process_tree_stats(tokens, mask, gid, 1, sizes=sizes, valid=np.ones(2, bool))


# ------------------------------------------------------------------------------------------------
# fast direct calls (issue 13)


def test_direct_calls_do_not_retrace():
  traces = []

  def listen(event, _duration, fun_name=None, **_):
    if event == "/jax/core/compile/jaxpr_trace_duration":
      traces.append(fun_name)

  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 5, size=(16, 12)).astype(np.int32)
  mask = np.ones((16, 12), bool)
  rewards = rng.normal(size=16).astype(np.float32)
  gid = np.array([0] * 5 + [1] * 5 + [2] * 6, np.int32)
  jg.process_set_sizes(tokens, mask, gid)
  jg.process_advantages(rewards, tokens, mask, gid, 3)
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    for k in range(3):  # new data, placed or not, and largest groups 6..8 that round up to the same bound
      gid_k = np.array([0] * (6 + k) + [1] * 4 + [2] * (6 - k), np.int32)
      tokens_k = rng.integers(0, 5, size=(16, 12)).astype(np.int32)
      placed = [jax.device_put(x) for x in (tokens_k, mask, gid_k)]
      jg.process_set_sizes(tokens_k, mask, gid_k)
      jg.process_set_sizes(*placed)
      jg.process_advantages(rewards, tokens_k, mask, gid_k, 3)
      jg.process_advantages(jax.device_put(rewards), *placed, 3)
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert traces == []


class _Compiles:
  """Counts XLA compilations (``backend_compile`` events) inside the ``with`` block."""

  def __enter__(self):
    self.names = []
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    return self

  def _listen(self, event, _duration, fun_name=None, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      self.names.append(fun_name)

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listen)


def test_direct_calls_compile_once_per_shape_and_bucket():
  """Issue 23.7: on one batch shape, ``num_groups`` changing within a power-of-two bucket does not
  recompile ``process_advantages`` / ``process_tree_stats`` (it did: ``num_groups`` was static); a
  given ``max_group_size`` compiles once whatever the largest group; a derived bound compiles once
  more exactly when the largest group crosses a power of two (as documented)."""
  rng = np.random.default_rng(1)
  b, t = 24, 7  # a shape no other test of this module compiles
  mask = np.ones((b, t), bool)
  rewards = rng.normal(size=b).astype(np.float32)
  toks = lambda: rng.integers(0, 4, size=(b, t)).astype(np.int32)
  gid_for = lambda n: (np.arange(b) % n).astype(np.int32)  # n groups, the largest has ceil(b / n) rows
  kw = dict(max_group_size=8)  # the bound given: only num_groups varies here
  jg.process_advantages(rewards, toks(), mask, gid_for(5), 5, **kw)  # the first call of the bucket (5..8)
  jg.process_tree_stats(toks(), mask, gid_for(5), 5, **kw)
  with _Compiles() as c:
    for n in (6, 7, 8, 5):
      adv = jg.process_advantages(rewards, toks(), mask, gid_for(n), n, **kw)
      stats = jg.process_tree_stats(toks(), mask, gid_for(n), n, **kw)
      assert np.isfinite(np.asarray(adv)).all() and all(np.isfinite(float(v)) for v in stats.values())
  assert c.names == [], c.names
  with _Compiles() as c:  # num_groups 9 is the next bucket (9..16): one program each, then none
    for n in (9, 12, 16):
      jg.process_advantages(rewards, toks(), mask, gid_for(n), n, **kw)
  assert c.names == ["jit(_process_advantages)"], c.names
  # out-of-range ids are still poisoned with the exact num_groups (traced), not the bucket's
  ids = jax.device_put(np.where(np.arange(b) == 3, 13, gid_for(12)))  # 13 >= 12, inside the bucket (16)
  bad = jax.jit(lambda *a: jg.process_advantages(*a, 12, **kw))(rewards, toks(), mask, ids)  # no host check
  assert np.isnan(np.asarray(bad)[3]).all() and np.isfinite(np.delete(np.asarray(bad), 3, axis=0)).all()

  # the pairwise bound: given once, one program whatever the groups; derived, one per power of two
  jg.process_set_sizes(toks(), mask, gid_for(8), max_group_size=10)
  with _Compiles() as c:
    for n in (6, 4, 3):  # largest group 4, 6, 8
      jg.process_set_sizes(toks(), mask, gid_for(n), max_group_size=10)
  assert c.names == [], c.names
  jg.process_set_sizes(toks(), mask, gid_for(8))  # largest group 3: bound 4
  with _Compiles() as c:
    jg.process_set_sizes(toks(), mask, gid_for(6))  # largest 4: bound 4, no compile
    jg.process_set_sizes(toks(), mask, gid_for(4))  # largest 6: bound 8, one compile
    jg.process_set_sizes(toks(), mask, gid_for(3))  # largest 8: bound 8, none
  assert c.names == ["jit(_sizes_impl)"], c.names


def test_unbounded_pairwise_under_jit_warns_once(monkeypatch):
  monkeypatch.setattr(ps, "_WARNED", set())
  tokens, mask, gid = ref.from_strings(["AB", "AC", "XY"], group_ids=[0, 0, 1])
  f = jax.jit(functools.partial(jg.process_set_sizes, method="pairwise"))
  with pytest.warns(UserWarning, match="max_group_size.*O\\(B²\\)") as record:
    f(tokens, mask, gid)
    f(np.pad(tokens, ((0, 1), (0, 0))), np.pad(mask, ((0, 1), (0, 0))), np.append(gid, 1))  # a retrace
  assert len([w for w in record if "max_group_size" in str(w.message)]) == 1
  np.testing.assert_array_equal(f(tokens, mask, gid), [[2, 1], [2, 1], [1, 1]])


def test_inside_outer_jit_equals_direct():
  tokens, mask, gid = ref.from_strings(["ABCD", "ABCE", "ABX", "QR"], group_ids=[1, 1, 1, 0])
  rewards = np.array([1.0, 0.0, 0.5, 2.0], np.float32)

  @jax.jit
  def both(rewards, tokens, mask, gid):
    return jg.process_advantages(rewards, tokens, mask, gid, 2, max_group_size=3), jg.prefix_hashes(tokens, mask)

  adv, h = both(rewards, tokens, mask, gid)
  np.testing.assert_allclose(adv, jg.process_advantages(rewards, tokens, mask, gid, 2), rtol=1e-6)
  np.testing.assert_array_equal(h, jg.prefix_hashes(tokens, mask))


@pytest.mark.slow
def test_bench_process_sets_smoke(capsys):
  path = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_process_sets.py")
  spec = importlib.util.spec_from_file_location("bench_process_sets", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  # --quick's sizes with one group size (--quick runs G = 2 and 5: twice the compiles, the same code)
  rows = bench.main("--groups 5 --length 70 --prompts 3 --max-rows 0 --repeats 1".split())
  assert rows and all(r["trie_s_per_token"] > 0 for r in rows)
  assert "sort" in capsys.readouterr().out


@pytest.mark.parametrize("preset, tree_stats", [("lambda_grpo", False), ("grpo", True)])
def test_train_step_tree_stats_leave_missing_samples_out(preset, tree_stats):
  """The train step's ``tree/*`` metrics (λ presets: from the 1/|λ| weights; others with ``tree_stats``: from
  ``process_set_sizes``) describe the trees of the rows in the sample: a NaN-reward row that shares a prefix
  is left out, as the trie over the valid rows says."""
  import optax
  from helpers import make_batch, tiny_model

  from jaxgrpo.parallel import sharding as shd
  from jaxgrpo.step import train

  batch = make_batch()
  comp, mask, gid = batch.completions, batch.mask, batch.group_ids
  shared = np.flatnonzero((ref.sizes(comp, mask, gid) > 1).any(axis=1))
  rewards = batch.rewards.copy()
  rewards[shared[:2]] = [np.nan, np.inf]  # two rows that share a prefix with a mate
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.sgd(1e-3)
  graphdef, state, shardings = train.init_train_state(tiny_model(layers=1), opt, mesh)
  tc = train.TrainConfig(group_size=int(np.bincount(gid).max()), tree_stats=tree_stats, chunk_size=5)
  step = train.make_train_step(graphdef, opt, jg.preset(preset), mesh=mesh, shardings=shardings, train_config=tc)
  _, metrics = step(state, batch._replace(rewards=rewards))
  want = _ref_tree_stats(comp, np.where(np.isfinite(rewards)[:, None], mask, False), gid)
  for k, v in want.items():
    np.testing.assert_allclose(float(metrics[f"tree/{k}"]), v, rtol=1e-5, err_msg=k)
  assert float(metrics["rewards_nonfinite"]) == 2
