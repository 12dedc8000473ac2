"""Prefix-shared training (``TrainConfig.prefix_sharing``, ``jaxgrpo.step.prefix_tree``): the tree layout against
the sequences it holds (every scored token's parent column sees exactly that sequence's prefix, one key per depth),
the interval mask against an ancestor walk, the blockwise kernel's tree mask against a NumPy softmax, the packed
log-probs against the row-wise NumPy log-softmax (dense and blockwise attention), and the train step and reference
pass with sharing against the unshared step (GRPO, λ-GRPO, FRPO: parameters after the update and every metric,
λ sizes and tree statistics included).

Independent references: ``helpers.numpy_log_probs`` (full logits of unpacked ``[prompt ‖ completion]`` rows,
log-softmax in NumPy), a NumPy attention, the sequences themselves; the step with sharing is compared with the
step without (the same step's two layouts, itself checked against the hand-written update in
``tests/test_train_packing.py``)."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import flat_params, make_batch, numpy_log_probs, run_child, tiny_config, tiny_model

from jaxgrpo import models
from jaxgrpo.kernels.attention import blockwise_attention
from jaxgrpo.kernels.config import preset
from jaxgrpo.models.log_probs import packed_log_probs
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.parallel.target import target_platform
from jaxgrpo.step import packing, train
from jaxgrpo.step.prefix_tree import build_trees

B, P, T, G = 16, 6, 16, 4
L = 64


def _batch(seed=0):
  """Groups of G sharing a prompt (left-padded, lengths differing across groups), completions over a 3-token
  alphabet (shared completion prefixes), ragged lengths with one empty row; row 6 a copy of row 4 (identical
  rows), and the last group's prompts made distinct (no shared prefix; row 15 alone: a group of one in its
  tree)."""
  batch = make_batch(seed=seed, b=B, p=P, t=T, g=G)
  prompts, pmask = np.array(batch.prompt_tokens), np.array(batch.prompt_mask)
  comp, mask = np.array(batch.completions), np.array(batch.mask)
  distinct = 40 + np.arange(4 * P).reshape(4, P)  # group 3: four prompts with no token in common
  prompts[12:16] = np.where(pmask[12:16], distinct, 0)
  comp[6], mask[6] = comp[4], mask[4]
  rewards = np.array(batch.rewards)
  rewards[6] = rewards[4] + 0.5
  return batch._replace(prompt_tokens=prompts, prompt_mask=pmask, completions=comp, mask=mask, rewards=rewards)


def _sequences(batch):
  seqs, plens = [], []
  for b in range(B):
    p = np.asarray(batch.prompt_tokens[b])[np.asarray(batch.prompt_mask[b])]
    seqs.append(np.concatenate([p, np.asarray(batch.completions[b])[np.asarray(batch.mask[b])]]))
    plens.append(p.size)
  return seqs, np.asarray(plens)


def _visible(end, n):
  """The interval mask of one tree, ``[i, j]``: j ≤ i < end[j]."""
  i = np.arange(n)
  return (i[None, :] <= i[:, None]) & (i[:, None] < end[None, :])


# ----------------------------------------------------------------------------- the layout (NumPy)


@pytest.mark.parametrize("sharing", ["prompt", "tree"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_scored_token_sees_exactly_its_sequence_prefix(sharing, seed):
  """For every sequence k and completion token at depth d: the target column holds that token at depth d, and the
  column before it (whose hidden state scores it) sees, under the interval mask, exactly one key per depth
  0..d-1 holding the sequence's tokens — whatever the tree shares. Random sequences with many shared prefixes,
  identical ones, and tiny capacities (trees split)."""
  rng = np.random.default_rng(seed)
  seqs, plens = [], []
  for _ in range(12):
    p, c = int(rng.integers(1, 5)), int(rng.integers(1, 6))
    prompt = [7, 8, 9, 10][:p] if rng.random() < 0.7 else list(rng.integers(0, 3, p))
    seqs.append(np.asarray(prompt + list(rng.integers(0, 2, c))))
    plens.append(p)
  seqs.append(seqs[0].copy())
  plens.append(plens[0])
  for capacity in (10, 64):
    trees = build_trees(seqs, plens, sharing, capacity)
    assert sorted(int(k) for t in trees for k in t.members) == list(range(len(seqs)))
    for tree in trees:
      n = tree.tokens.size
      assert n <= capacity
      seen = _visible(tree.end, n)
      for k, targets in zip(tree.members, tree.targets):
        seq, p = seqs[k], plens[k]
        assert targets.size == seq.size - p
        for d, c in zip(range(p, seq.size), targets):
          assert tree.tokens[c] == seq[d] and tree.depth[c] == d
          keys = np.flatnonzero(seen[c - 1])
          assert sorted(tree.depth[keys]) == list(range(d)), (k, d)
          assert np.array_equal(tree.tokens[keys[np.argsort(tree.depth[keys])]], seq[:d])


@pytest.mark.parametrize("sharing", ["prompt", "tree"])
def test_interval_mask_is_the_ancestor_mask_and_sharing_saves_tokens(sharing):
  """The interval mask ``j ≤ i < end[j]`` equals the ancestor-or-self relation walked from the parent links; the
  tree holds fewer tokens than the sequences (prompt: each group's prompt once), and ``tree`` at most ``prompt``."""
  seqs, plens = _sequences(_batch())
  real = [k for k in range(B) if seqs[k].size > plens[k]]
  trees = build_trees([seqs[k] for k in real], plens[real], sharing, L)
  for tree in trees:
    n = tree.tokens.size
    walked = np.zeros((n, n), bool)
    for i in range(n):
      j = i
      while j >= 0:
        walked[i, j] = True
        assert tree.parent[j] < j
        j = tree.parent[j]
    assert np.array_equal(_visible(tree.end, n), walked)
  columns = sum(t.tokens.size for t in trees)
  rowwise = sum(seqs[k].size for k in real)
  shared_prompts = sum(plens[g * G] * (G - 1) for g in range(3))  # groups 0-2 share a prompt of G rows
  assert columns <= rowwise - shared_prompts + len(real)  # at most one copy per branch
  if sharing == "tree":
    assert columns <= sum(t.tokens.size for t in build_trees([seqs[k] for k in real], plens[real], "prompt", L))


# ----------------------------------------------------------------------------- the kernel and the model


def test_blockwise_tree_mask_equals_numpy_attention():
  """``blockwise_attention(kv_end=...)`` (blocks of 4 rows over a 2-row batch of 16, GQA) equals a NumPy softmax
  under the interval mask, forward and the gradient of a weighted sum."""
  rng = np.random.default_rng(0)
  Bq, S, H, N, K = 2, 16, 4, 2, 8
  q, k, v = (rng.standard_normal((Bq, S, h, K)).astype(np.float32) for h in (H, N, N))
  seg = np.ones((Bq, S), np.int32)
  seg[1, 12:] = 0  # padding
  parent = [-1, 0, 1, 2, 1, 4, 5, 0, 7, 8, 9, 10, 11, 12, 13, 14]
  end = np.zeros((Bq, S), np.int32)
  walked = np.zeros((S, S), bool)
  for i in range(S):
    j = i
    while j >= 0:
      walked[i, j] = True
      j = parent[j]
  end[0] = [max(np.flatnonzero(walked[:, j])) + 1 for j in range(S)]
  end[1] = np.where(np.arange(S) < 12, 12, 0)
  mask = np.stack([walked, (np.arange(S)[None] <= np.arange(S)[:, None]) & (np.arange(S)[:, None] < 12)])
  mask[1, 12:] = False
  w = rng.standard_normal((Bq, S, H, K)).astype(np.float32)

  def numpy_attention(q, k, v):
    kk, vv = np.repeat(k, H // N, axis=2), np.repeat(v, H // N, axis=2)
    s = np.einsum("bshk,bthk->bhst", q, kk) / np.sqrt(K)
    s = np.where(mask[:, None], s, -np.inf)
    m = np.max(np.where(np.isfinite(s), s, -1e30), -1, keepdims=True)
    p = np.where(mask[:, None], np.exp(s - m), 0.0)
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-30)
    return np.einsum("bhst,bthk->bshk", p, vv)

  def blockwise(q, k, v):
    return blockwise_attention(
      q, k, v, q_segment_ids=seg, kv_segment_ids=seg, kv_end=end, block_q=4, block_kv=4, dot_dtype=jnp.float32
    )

  # jitted: one program each (eager, every op would compile on its own first call)
  np.testing.assert_allclose(np.asarray(jax.jit(blockwise)(q, k, v)), numpy_attention(q, k, v), atol=2e-6)
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(blockwise(*a) * w), argnums=(0, 1, 2)))(q, k, v)
  eps = 1e-3  # central differences of the NumPy attention in float64, a few entries of each input
  for arg, g in enumerate(grads):
    for idx in [(0, 5, 0, 1), (0, 9, 1, 3), (1, 3, 1, 0)]:
      args = [np.array(x, np.float64) for x in (q, k, v)]
      args[arg][idx] += eps
      hi = np.sum(numpy_attention(*args) * w)
      args[arg][idx] -= 2 * eps
      lo = np.sum(numpy_attention(*args) * w)
      assert float(g[idx]) == pytest.approx((hi - lo) / (2 * eps), abs=2e-3), (arg, idx)


def _packed(batch, sharing, slots=1):
  slot = np.arange(B, dtype=np.int32) % slots
  return packing.pack_slots(
    batch.prompt_tokens, batch.prompt_mask, batch.completions, batch.mask, slot, num_slots=slots, row_length=L,
    sharing=sharing,
  )  # fmt: skip


@pytest.mark.parametrize("implementation", ["dense", "blockwise"])
@pytest.mark.parametrize("sharing", ["prompt", "tree"])
def test_packed_tree_log_probs_equal_the_rowwise_numpy_log_softmax(sharing, implementation):
  """Log-probs of the prefix-shared rows equal the unpacked rows' NumPy log-softmax (ragged groups, identical rows,
  a prompt shared by nobody, prompts of different lengths across groups, an empty completion), with fewer tokens in
  the forward than plain packing; their gradient (of a weighted sum) equals the row-wise one."""
  batch = _batch()
  model = models.set_attention(tiny_model(layers=2), implementation)
  pk = _packed(batch, sharing)
  plain = _packed(batch, "none")
  assert (pk.segment_ids > 0).sum() < (plain.segment_ids > 0).sum()
  args = [jnp.asarray(x) for x in (pk.tokens, pk.positions, pk.segment_ids, pk.head_index, pk.unpack_index)]
  logp, _ = jax.jit(lambda m: packed_log_probs(m, *args, kv_end=jnp.asarray(pk.kv_end), chunk_size=None))(model)
  np.testing.assert_allclose(np.asarray(logp), numpy_log_probs(model, batch), atol=2e-5)

  weights = np.random.default_rng(1).standard_normal((B, T)).astype(np.float32)
  assert_tree_gradients_equal_rowwise(model, batch, pk, weights)


def assert_tree_gradients_equal_rowwise(model, batch, pk, weights):
  """The gradient of ``Σ weights · logp`` over the packed rows ``pk`` equals that over the unpacked rows of
  ``batch`` (``models.completion_log_probs``), to float32 rounding (2e-5 of the largest entry)."""
  args = [jnp.asarray(x) for x in (pk.tokens, pk.positions, pk.segment_ids, pk.head_index, pk.unpack_index)]
  graphdef, params = nnx.split(model)

  def tree_loss(params):
    out, _ = packed_log_probs(nnx.merge(graphdef, params), *args, kv_end=jnp.asarray(pk.kv_end), chunk_size=None)
    return jnp.sum(out * weights)

  def row_loss(params):
    out, _ = models.completion_log_probs(
      nnx.merge(graphdef, params), batch.prompt_tokens, batch.prompt_mask, batch.completions, batch.mask,
      chunk_size=None,
    )  # fmt: skip
    return jnp.sum(out * weights)

  # one jitted program each (eager, every op would compile on its own first call)
  got, want = (flat_params(jax.jit(jax.grad(f))(params)) for f in (tree_loss, row_loss))
  for key in want:
    np.testing.assert_allclose(got[key], want[key], atol=2e-5 * max(1.0, np.abs(want[key]).max()), err_msg=key)


# ----------------------------------------------------------------------------- the step


@functools.lru_cache(maxsize=None)
def _step(name, sharing, micro=1, mini=1):
  """(params, metrics) after one step of preset ``name`` on :func:`_batch`, packed with ``sharing``, and the
  reference pass's log-probs with the same TrainConfig."""
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.sgd(0.5)
  model = models.build_model(tiny_config(1), rngs=nnx.Rngs(0))
  graphdef, state, shardings = train.init_train_state(model, opt, mesh)
  tc = train.TrainConfig(
    micro_batches=micro, mini_batches=mini, max_grad_norm=0.05, group_size=G, chunk_size=5, tree_stats=True,
    packing=L, prefix_sharing=sharing,
  )  # fmt: skip
  step = train.make_train_step(graphdef, opt, preset(name), mesh=mesh, shardings=shardings, train_config=tc)
  ref_logp = _ref_logp(graphdef, mesh, state.params, shardings.params, tc)
  state, metrics = step(state, _batch())
  return flat_params(state.params), {k: float(v) for k, v in metrics.items()}, ref_logp


def _ref_logp(graphdef, mesh, params, param_shardings, tc):
  """The reference pass's log-probs of the initial parameters on :func:`_batch` under ``tc``'s layout (it does not
  depend on the preset: computed once per layout, :func:`_ref_memo`)."""
  key = (tc.prefix_sharing, tc.micro_batches, tc.mini_batches)
  if key not in _ref_memo:
    ref = train.make_reference_fn(graphdef, mesh=mesh, param_shardings=param_shardings, train_config=tc)
    _ref_memo[key] = np.asarray(ref(jax.tree.map(jnp.copy, params), _batch()))
  return _ref_memo[key]


_ref_memo: dict = {}


@pytest.mark.parametrize(
  ("name", "sharing", "micro", "mini"),
  [("grpo", "prompt", 1, 1), ("lambda_grpo", "tree", 1, 1), ("lambda_frpo", "tree", 2, 1), ("grpo", "tree", 2, 2)],
)
def test_prefix_shared_step_equals_the_unshared_step(name, sharing, micro, mini):
  """GRPO, λ-GRPO and FRPO (β > 0: the reference pass too) with prefix sharing: the parameters after the update,
  every metric (λ sizes, tree statistics, loss, KL, entropy) and the reference log-probs equal plain packing's;
  two micro-batches share within each (the contiguous split), two mini-batches make the same two updates."""
  got, want = _step(name, sharing, micro, mini), _step(name, "none", micro, mini)
  for key in want[0]:
    np.testing.assert_allclose(got[0][key], want[0][key], atol=1e-6, rtol=1e-5, err_msg=key)
  assert got[1].keys() == want[1].keys()
  for key in want[1]:
    assert got[1][key] == pytest.approx(want[1][key], rel=2e-5, abs=1e-6), key
  np.testing.assert_allclose(got[2], want[2], atol=2e-5)


@pytest.mark.parametrize(("mini", "micro", "shards"), [(1, 2, 1), (1, 4, 1), (2, 2, 1), (1, 2, 2)])
def test_micro_batches_keep_each_group_whole(mini, micro, shards):
  """With sharing the step's split is contiguous (``batch_slots(contiguous=True)``, ``terms.split_micro``): each
  group's rows of a mini-batch are in one slot, every mini-batch holds the rows the interleaved split gives it
  (the same updates), the step's ``[M, K, R]`` split and the packer's slots agree, and K micro-batches lay out
  each group's prompt once per mini-batch — as many tree columns as one micro-batch per mini-batch."""
  from jaxgrpo.step.terms import merge_rows, split_micro

  slots = train.batch_slots(B, shards=shards, mini_batches=mini, micro_batches=micro, contiguous=True)
  interleaved = train.batch_slots(B, shards=shards, mini_batches=mini, micro_batches=micro)
  np.testing.assert_array_equal(slots // micro, interleaved // micro)  # the same device shard and mini-batch
  for g in range(B // G):  # G = 4 divides B/(shards·K) = 8, 4
    rows = slice(g * G, (g + 1) * G)
    assert np.unique(slots[rows]).size == mini, (g, slots[rows])
  split = np.asarray(split_micro(jnp.arange(B), mini, micro, blocks=shards, contiguous=True))  # [M, K, R]
  r = B // (mini * micro * shards)
  for m in range(mini):
    for k in range(micro):
      for d in range(shards):
        assert (slots[split[m, k, d * r : (d + 1) * r]] == d * mini * micro + m * micro + k).all()
  np.testing.assert_array_equal(
    np.asarray(merge_rows(jnp.asarray(split), mini, micro, blocks=shards, contiguous=True)), np.arange(B)
  )
  columns = lambda k, m: (
    train.pack_batch(_batch(), row_length=L, shards=shards, mini_batches=m, micro_batches=k, sharing="prompt").packed.segment_ids > 0
  ).sum()  # fmt: skip
  assert columns(micro, mini) == columns(1, mini)


def test_contiguous_split_keeps_groups_whole_under_the_documented_condition():
  """docs/prefix_sharing.md's condition — M = 1 and G divides R = B/(shards·M·K), or M·K divides G and G/M divides
  R — keeps every group's rows of a mini-batch in one micro-batch (two device shards, every small case)."""
  checked = 0
  for mini, micro, g, r in itertools.product(
    (1, 2, 3, 4), (2, 3, 4), (2, 3, 4, 6, 8, 12, 16, 24), (1, 2, 3, 4, 6, 8, 12)
  ):
    if not ((mini == 1 and r % g == 0) or (g % (mini * micro) == 0 and r % (g // mini) == 0)):
      continue
    b = 2 * mini * micro * r
    slots = train.batch_slots(b, shards=2, mini_batches=mini, micro_batches=micro, contiguous=True)
    for first in range(0, b, g):
      rows = slots[first : first + g]
      assert np.unique(rows).size == np.unique(rows // micro).size, (mini, micro, g, r, rows)
    checked += 1
  assert checked > 50


_SHARDED = r"""
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
from helpers import flat_params, tiny_config
from test_prefix_sharing import B, G, L, _batch
from jaxgrpo import models
from jaxgrpo.kernels.config import preset
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.step import train

assert jax.device_count() == 2
out = {}
for spec, packing, sharing in (("data=1", None, "none"), ("data=2", L, "tree")):
  mesh = shd.make_mesh(spec, devices=jax.devices()[: 1 if spec == "data=1" else 2])
  opt = optax.sgd(0.5)
  graphdef, state, shardings = train.init_train_state(models.build_model(tiny_config(1), rngs=nnx.Rngs(0)), opt, mesh)
  tc = train.TrainConfig(mini_batches=2, micro_batches=2, max_grad_norm=0.05, group_size=G, chunk_size=5,
                         packing=packing, prefix_sharing=sharing)
  if sharing == "tree":  # each group's rows of a mini-batch: one slot on one device
    slots = train.make_train_step(graphdef, opt, preset("lambda_frpo"), mesh=mesh, shardings=shardings,
                                  train_config=tc).pack(_batch()).packed.slot
    assert all(np.unique(slots[g * G:(g + 1) * G]).size == 2 for g in range(B // G)), slots
  ref = train.make_reference_fn(graphdef, mesh=mesh, param_shardings=shardings.params, train_config=tc)
  ref_logp = np.asarray(ref(jax.tree.map(jnp.copy, state.params), _batch()))
  step = train.make_train_step(graphdef, opt, preset("lambda_frpo"), mesh=mesh, shardings=shardings, train_config=tc)
  state, metrics = step(state, _batch()._replace(ref_logp=ref_logp))
  out[spec] = flat_params(state.params), float(metrics["loss"]), ref_logp
(want, want_loss, want_ref), (got, loss, got_ref) = out["data=1"], out["data=2"]
np.testing.assert_allclose(got_ref, want_ref, atol=2e-5)
assert abs(loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss)), (loss, want_loss)
for k in want:
  np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=str(k))
print("OK")
"""


@pytest.mark.subprocess
def test_contiguous_split_on_two_devices_equals_the_rowwise_step():
  """``data=2``, M = 2 mini-batches × K = 2 micro-batches, λ-FRPO with ``tree`` sharing (each device splits its
  own rows contiguously, each group's rows of a mini-batch in one slot): the reference log-probs, the loss and the
  parameters after the step equal the unpacked step on one device (interleaved split, the same mini-batches)."""
  assert run_child(_SHARDED, devices=2).strip().endswith("OK")


def test_reference_pass_with_sharing_equals_numpy():
  """The reference pass with ``prefix_sharing="tree"`` gives the NumPy log-softmax of the unpacked rows."""
  model = models.build_model(tiny_config(1), rngs=nnx.Rngs(0))
  want = numpy_log_probs(model, _batch())
  np.testing.assert_allclose(_step("lambda_grpo", "tree")[2], want, atol=2e-5)


def test_bad_prefix_sharing_settings_fail_in_one_line():
  with pytest.raises(ValueError, match="prefix_sharing.*needs `packing`"):
    train.TrainConfig(prefix_sharing="tree")
  with pytest.raises(ValueError, match="`prefix_sharing` must be one of"):
    train.TrainConfig(packing=64, prefix_sharing="trie")
  with pytest.raises(ValueError, match="`sharing` must be one of"):
    _packed(_batch(), "yes")
  model = models.set_attention(tiny_model(layers=1), "splash")  # a TPU program: the fused kernel asked by name
  pk = _packed(_batch(), "tree")
  args = [jnp.asarray(x) for x in (pk.tokens, pk.positions, pk.segment_ids, pk.kv_end)]
  with target_platform("tpu"), pytest.raises(ValueError, match="cannot take a prefix tree's mask"):
    jax.eval_shape(lambda t, p, s, e: model(t, p, segment_ids=s, kv_end=e), *args)
  with pytest.raises(ValueError, match="kv_end .* needs segment_ids"):
    model(args[0], args[1], kv_end=args[3])
