"""Prefix-shared training on multi-turn trajectories (``TrainConfig.prefix_sharing`` with ``Batch.policy_mask``).

A multi-turn trajectory is one sequence ``prompt ‖ turn_1 ‖ obs_1 ‖ turn_2 ‖ …`` whose observation tokens are real
(``mask``) but carry no loss (``policy_mask`` False). With ``tree`` sharing the trajectories of a group that made
the same turns and received the same observations share that history: it is laid out, and computed, once.

Independent references: a NumPy trie over each micro-batch's sequences (observation tokens included) gives the
number of distinct prefixes the tree layout must hold; the hand-written full-batch update of ``tests/helpers.py``
(loss over policy tokens, λ sizes from a NumPy trie over the interleaved tokens) gives the parameters after the
step; ``helpers.numpy_log_probs`` (unpacked rows, NumPy log-softmax) gives the reference pass's log-probs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import flat_params, numpy_log_probs, reference_update, tiny_model
from test_policy_mask import trie_sizes
from test_prefix_sharing import assert_tree_gradients_equal_rowwise

from jaxgrpo.kernels.config import preset
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.step import packing, train

B, P, T, G = 16, 5, 24, 4
L = 96
LR = 0.5

# trajectories as (kind, tokens) spans: "p" policy turn, "o" observation (the environment's tokens)
CALL, OBS_A, OBS_B = [20, 21, 22, 23], [40, 41, 42], [40, 43, 42]
TRAJECTORIES = [
  # group 0: the same call and tool result (a shared history of 7 tokens), then ragged answers; one takes a turn 3
  [("p", CALL), ("o", OBS_A), ("p", [30, 31, 2])],
  [("p", CALL), ("o", OBS_A), ("p", [30, 32, 2])],
  [("p", CALL), ("o", OBS_A), ("p", [33, 2]), ("o", [44, 45]), ("p", [34, 35, 36, 2])],
  [("p", CALL), ("o", OBS_A), ("p", [30, 31, 37, 38, 2])],
  # group 1: identical trajectories (rows 4 and 5), a different tool result after the same call (row 6), one
  # turn only (row 7)
  [("p", CALL), ("o", OBS_A), ("p", [30, 2])],
  [("p", CALL), ("o", OBS_A), ("p", [30, 2])],
  [("p", CALL), ("o", OBS_B), ("p", [31, 2])],
  [("p", [25, 26, 2])],
  # group 2: no shared history (every first turn differs), multi-turn all the same
  [("p", [50, 21]), ("o", OBS_A), ("p", [30, 2])],
  [("p", [51, 21]), ("o", OBS_A), ("p", [30, 2])],
  [("p", [52, 21]), ("o", OBS_A), ("p", [30, 2])],
  [("p", [53, 21]), ("o", OBS_A), ("p", [30, 2])],
  # group 3: distinct prompts (nothing shared at all), the same trajectory
  [("p", CALL), ("o", OBS_A), ("p", [30, 2])],
  [("p", CALL), ("o", OBS_A), ("p", [30, 2])],
  [("p", CALL), ("o", OBS_A), ("p", [30, 2])],
  [("p", CALL), ("o", OBS_A), ("p", [30, 2])],
]


def multiturn_batch(seed=0) -> train.Batch:
  """:data:`TRAJECTORIES` as a batch: one prompt per group (left-padded, lengths differing; group 3's four prompts
  distinct), ``mask`` on every trajectory token, ``policy_mask`` on the policy turns, rollout log-probs 0 on the
  observations (as the multi-turn rollout records them)."""
  rng = np.random.default_rng(seed)
  prompts, pmask = np.zeros((B, P), np.int32), np.zeros((B, P), bool)
  comp, mask, policy = np.zeros((B, T), np.int32), np.zeros((B, T), bool), np.zeros((B, T), bool)
  for b, spans in enumerate(TRAJECTORIES):
    g = b // G
    plen = (5, 3, 4, 2)[g]
    prompt = [60 + g, 61, 62, 63, 64][:plen] if g < 3 else [70 + 4 * (b % G) + j for j in range(plen)]
    prompts[b, P - plen :], pmask[b, P - plen :] = prompt, True
    col = 0
    for kind, tokens in spans:
      comp[b, col : col + len(tokens)] = tokens
      mask[b, col : col + len(tokens)] = True
      policy[b, col : col + len(tokens)] = kind == "p"
      col += len(tokens)
  old = np.where(policy, np.log(1.0 / 128) + 0.3 * rng.standard_normal((B, T)), 0).astype(np.float32)
  ref = np.where(policy, old + 0.2 * rng.standard_normal((B, T)), 0).astype(np.float32)
  rewards = rng.integers(0, 2, B).astype(np.float32) + 0.1 * rng.random(B).astype(np.float32)
  gids = np.repeat(np.arange(B // G), G).astype(np.int32)
  return train.Batch(prompts, pmask, comp, mask, old, gids, rewards, ref, policy_mask=policy)


def _sequences(batch, rows):
  out = []
  for b in rows:
    p = np.asarray(batch.prompt_tokens[b])[np.asarray(batch.prompt_mask[b])]
    out.append(np.concatenate([p, np.asarray(batch.completions[b])[np.asarray(batch.mask[b])]]).tolist())
  return out


def trie_columns(sequences, prompt_only_lengths=None) -> int:
  """Columns a prefix-tree layout needs for ``sequences``: one per distinct prefix (a trie node), plus one copy of
  the branch point before every branch but the first of a node. ``prompt_only_lengths``: share at most each
  sequence's first ``n`` tokens (the ``prompt`` mode), counting the rest once per sequence."""
  trie, columns = {}, 0
  for k, seq in enumerate(sequences):
    shareable = len(seq) if prompt_only_lengths is None else prompt_only_lengths[k]
    node = trie
    for d, tok in enumerate(seq):
      if d >= shareable:  # a fresh chain under the shared prefix
        columns += len(seq) - d
        node.setdefault("#children", 0)
        node["#children"] += 1
        break
      if tok not in node:
        node[tok] = {}
        columns += 1
        node.setdefault("#children", 0)
        node["#children"] += 1
      node = node[tok]

  def copies(node):
    n = max(node.get("#children", 0) - 1, 0)
    return n + sum(copies(v) for k, v in node.items() if k != "#children")

  # the root's children are separate trees (segments), no copy between them
  return columns + sum(copies(v) for k, v in trie.items() if k != "#children")


def _tree_columns(pk) -> np.ndarray:
  """Real columns per slot of a PackedSlots."""
  s = pk.head_index.shape[0]
  return (pk.segment_ids > 0).reshape(s, -1).sum(1)


@pytest.mark.parametrize("micro", [1, 2])
def test_tree_lays_out_each_shared_turn_and_observation_once(micro):
  """The tree layout holds each distinct prefix of a micro-batch's trajectories — observation tokens included —
  exactly once (plus one branch-point copy per extra branch): the column count of a NumPy trie over the
  sequences, far fewer than the sequences' tokens; ``prompt`` shares the prompts only."""
  batch = multiturn_batch()
  splits = micro
  step_slots = train.batch_slots(B, shards=1, micro_batches=micro, contiguous=True)
  for sharing in ("prompt", "tree"):
    pk = train.pack_batch(batch, row_length=L, micro_batches=micro, sharing=sharing)
    assert np.array_equal(pk.packed.slot, step_slots)
    got = _tree_columns(pk.packed)
    for s in range(splits):
      rows = np.flatnonzero(step_slots == s)
      seqs = _sequences(batch, rows)
      if sharing == "tree":
        assert got[s] == trie_columns(seqs), s
      else:
        groups = {}
        for b in rows:  # prompt: each group's prompt once, each trajectory whole after it
          groups.setdefault(int(batch.group_ids[b]), []).append(b)
        want = sum(
          trie_columns(_sequences(batch, g), [int(batch.prompt_mask[b].sum()) for b in g]) for g in groups.values()
        )
        assert got[s] == want, s
  columns = {
    sharing: _tree_columns(train.pack_batch(batch, row_length=L, micro_batches=micro, sharing=sharing).packed).sum()
    for sharing in ("prompt", "tree")
  }
  rowwise = int(np.asarray(batch.mask).sum() + np.asarray(batch.prompt_mask).sum())
  assert columns["tree"] < columns["prompt"] < rowwise  # the shared turns and observations: once


@functools.lru_cache(maxsize=None)
def _step(name, sharing, micro=1, packed=True):
  """(params, metrics, reference log-probs) after one step of preset ``name`` (β = 0.04) on the multi-turn batch."""
  config = preset(name, beta=0.04)
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.sgd(LR)
  graphdef, state, shardings = train.init_train_state(tiny_model(layers=1), opt, mesh)
  tc = train.TrainConfig(
    micro_batches=micro, max_grad_norm=1e30, group_size=G, chunk_size=8, tree_stats=True,
    packing=L if packed else None, prefix_sharing=sharing,
  )  # fmt: skip
  ref = train.make_reference_fn(graphdef, mesh=mesh, param_shardings=shardings.params, train_config=tc)
  ref_logp = np.asarray(ref(jax.tree.map(jnp.copy, state.params), multiturn_batch()))
  step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc)
  state, metrics = step(state, multiturn_batch())
  return flat_params(state.params), {k: float(v) for k, v in jax.device_get(metrics).items()}, ref_logp


@pytest.mark.parametrize(("sharing", "micro"), [("tree", 1), ("tree", 2), ("prompt", 2)])
def test_multiturn_step_with_sharing_equals_the_handwritten_update(sharing, micro):
  """λ-GRPO with β > 0 on multi-turn trajectories, prefix-shared: the parameters equal the hand-written update
  (loss over policy tokens only, λ sizes from a NumPy trie over the interleaved tokens, unpacked rows) to float32
  rounding; every metric — λ sizes and tree statistics included — equals the unpacked step's; the reference pass
  gives the NumPy log-softmax of the unpacked rows."""
  batch = multiturn_batch()
  config = preset("lambda_grpo", beta=0.04)
  mask, pm = np.asarray(batch.mask), np.asarray(batch.policy_mask)
  sizes = trie_sizes(np.asarray(batch.completions), mask, np.asarray(batch.group_ids))
  weights = np.where(sizes > 0, 1.0 / np.maximum(sizes, 1), 0.0).astype(np.float32)
  want, want_metrics, _ = reference_update(
    tiny_model(layers=1), batch, config, lr=LR, max_grad_norm=1e30, token_weights=weights, loss_mask=pm
  )
  got, metrics, ref_logp = _step("lambda_grpo", sharing, micro)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-6, err_msg=str(k))
  assert metrics["loss"] == pytest.approx(want_metrics["loss"], rel=1e-5, abs=1e-7)
  assert metrics["tokens"] == pm.sum() < mask.sum()
  _, rowwise, _ = _step("lambda_grpo", "none", micro, packed=False)
  assert metrics.keys() == rowwise.keys()
  for key in rowwise:
    assert metrics[key] == pytest.approx(rowwise[key], rel=2e-5, abs=1e-6), key
  np.testing.assert_allclose(ref_logp, numpy_log_probs(tiny_model(layers=1), batch), atol=2e-5)


def test_multiturn_packed_log_prob_gradients_equal_the_rowwise_ones():
  """The gradient of a weighted sum of the tree-packed log-probs (weights on policy tokens only, as the loss reads
  them) equals the unpacked rows' gradient: shared turns and observations receive the sum over the trajectories
  through them."""
  batch = multiturn_batch()
  pk = packing.pack_slots(
    batch.prompt_tokens, batch.prompt_mask, batch.completions, batch.mask, np.zeros(B, np.int32), num_slots=1,
    row_length=L, sharing="tree",
  )  # fmt: skip
  weights = np.random.default_rng(1).standard_normal((B, T)).astype(np.float32) * np.asarray(batch.policy_mask)
  assert_tree_gradients_equal_rowwise(tiny_model(layers=2), batch, pk, weights)
