import functools

import core_refs as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import jaxgrpo as jg

SETTINGS = settings(max_examples=60, deadline=None)
# jitted once per test: hypothesis draws are padded to one shape (see core_refs.groups)
sizes_hash = jax.jit(jg.process_set_sizes)
sizes_exact = jax.jit(functools.partial(jg.process_set_sizes, exact=True))
sizes_bounded = jax.jit(jg.process_set_sizes, static_argnames="max_group_size")
proc_rewards = jax.jit(jg.process_rewards)
proc_adv = jax.jit(jg.process_advantages, static_argnums=4, static_argnames="ddof")
tree_stats = jax.jit(jg.process_tree_stats, static_argnums=3)


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
  np.testing.assert_array_equal(sizes_hash(tokens, mask, gid), want)
  np.testing.assert_array_equal(sizes_exact(tokens, mask, gid), want)
  gmax = int(np.bincount(gid).max())
  np.testing.assert_array_equal(sizes_bounded(tokens, mask, gid, max_group_size=gmax), want)


@SETTINGS
@given(ref.groups())
def test_process_rewards_and_advantages_match_bruteforce(data):
  tokens, mask, gid, rewards, ng = data
  want_r = ref.process_rewards(rewards, tokens, mask, gid)
  np.testing.assert_allclose(proc_rewards(rewards, tokens, mask, gid), want_r, rtol=1e-5, atol=1e-6)
  for ddof in (0, 1):
    mean, denom = ref.group_stats(rewards, gid, ddof=ddof)
    want_a = np.where(ref.sizes(tokens, mask, gid) > 0, (want_r - mean[:, None]) / denom[:, None], 0.0)
    got = proc_adv(rewards, tokens, mask, gid, ng, ddof=ddof)
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
