"""Loss only on the policy's tokens (``Batch.policy_mask``), and λ-GRPO/FRPO across turns.

Interleaved trajectories ``turn ‖ obs ‖ turn …``: the observation tokens are context (attention,
process sets) and nothing else. Checked against the hand-written full-batch update of tests/helpers.py
with the loss restricted to the policy tokens, λ sizes from a NumPy trie over the interleaved tokens
and FRPO's future KL summed over policy tokens only — all written from the definitions here."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import G, flat_params, make_batch, reference_update, tiny_model

from jaxgrpo.kernels.config import preset
from jaxgrpo.kernels.process_sets import process_set_sizes
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.step import train

LR = 0.5


def interleaved_batch(seed=0):
  """make_batch's rollout, with observation spans at columns 2-3 and 6-8 of every row (where real):
  tokens drawn from a small alphabet, so observations sometimes differ after a shared policy prefix."""
  batch = make_batch(seed, vocab_small=2)
  mask = np.asarray(batch.mask)
  obs = np.zeros_like(mask)
  obs[:, [2, 3, 6, 7, 8]] = True
  obs &= mask
  policy = mask & ~obs
  rng = np.random.default_rng(seed + 1)
  comp = np.where(obs, rng.integers(40, 42, mask.shape), batch.completions).astype(np.int32)
  old = np.where(policy, batch.old_logp, 0.0).astype(np.float32)  # the rollout: 0 on observations
  return batch._replace(completions=comp, old_logp=old, policy_mask=policy)


def garbage(batch, seed=7):
  """The same batch with arbitrary old/ref/behaviour log-probs on the observation tokens."""
  obs = np.asarray(batch.mask) & ~np.asarray(batch.policy_mask)
  rng = np.random.default_rng(seed)
  noisy = lambda x: None if x is None else np.where(obs, -5.0 * rng.random(obs.shape), x).astype(np.float32)
  return batch._replace(
    old_logp=noisy(batch.old_logp), ref_logp=noisy(batch.ref_logp), behavior_logp=noisy(batch.behavior_logp)
  )


def trie_sizes(comp, mask, gids):
  """|λ(i,t)| from a prefix trie per group over the interleaved tokens (SPEC "Process sets")."""
  b, t = comp.shape
  out = np.zeros((b, t), np.int64)
  tries = {}
  for i in range(b):  # insert: count the trajectories through each node
    node = tries.setdefault(int(gids[i]), {})
    for s in range(t):
      if not mask[i, s]:
        break
      child = node.setdefault(int(comp[i, s]), [0, {}])
      child[0] += 1
      node = child[1]
  for i in range(b):  # read
    node = tries[int(gids[i])]
    for s in range(t):
      if not mask[i, s]:
        break
      count, node = node[int(comp[i, s])]
      out[i, s] = count
  return out


def numpy_frpo_advantages(config, batch):
  """a_i − β·Σ_{j≥t, j policy} (old_j − ref_j): the k1 cost to go over the policy tokens only."""
  r, gids = np.asarray(batch.rewards, np.float64), np.asarray(batch.group_ids)
  a = np.zeros_like(r)
  for gi in np.unique(gids):
    sel = gids == gi
    a[sel] = (r[sel] - r[sel].mean()) / (r[sel].std(ddof=config.std_ddof) + config.std_eps)
  pm = np.asarray(batch.policy_mask)
  delta = np.where(pm, np.asarray(batch.old_logp, np.float64) - np.asarray(batch.ref_logp, np.float64), 0.0)
  togo = np.cumsum(delta[:, ::-1], axis=1)[:, ::-1]
  return (a[:, None] - config.beta * togo).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _step(name, overrides, packing=None):
  config = preset(name, **dict(overrides))
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  model = tiny_model(layers=1)
  opt = optax.sgd(LR)
  graphdef, _, shardings = train.init_train_state(model, opt, mesh)
  tc = train.TrainConfig(max_grad_norm=1e30, group_size=G, chunk_size=8, packing=packing)
  return (
    config,
    mesh,
    opt,
    train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc),
  )


def _update(name, overrides, batch, packing=None):
  config, mesh, opt, step = _step(name, tuple(sorted(overrides.items())), packing)
  _, state, _ = train.init_train_state(tiny_model(layers=1), opt, mesh)
  if not step.reads_ref_logp:
    batch = batch._replace(ref_logp=None)
  state, metrics = step(state, batch)
  return flat_params(state.params), {k: float(v) for k, v in jax.device_get(metrics).items()}


def test_trie_reference_splits_at_differing_observations():
  batch = interleaved_batch()
  comp, mask, gids = (np.asarray(x) for x in (batch.completions, batch.mask, batch.group_ids))
  want = trie_sizes(comp, mask, gids)
  got = np.asarray(process_set_sizes(comp, mask, gids, max_group_size=G))
  np.testing.assert_array_equal(np.where(mask, got, 0), want)
  # the test data exercises the point: some pair shares every policy token of a prefix yet splits
  # at an observation token
  pm = np.asarray(batch.policy_mask)
  split_at_obs = (mask & ~pm)[:, 1:] & (want[:, 1:] < want[:, :-1])
  assert split_at_obs.any()


@pytest.mark.parametrize(
  "name, overrides",
  [pytest.param("lambda_grpo", dict(beta=0.04), marks=pytest.mark.slow), ("lambda_frpo", dict(beta=0.5))],
)
def test_step_trains_on_policy_tokens_only(name, overrides):
  """The step's update == the hand-written update with the loss over policy tokens, λ from the trie
  over the interleaved tokens, FRPO's cost to go over policy tokens; garbage log-probs on the
  observation tokens change nothing."""
  batch = interleaved_batch()
  config = preset(name, **overrides)
  mask, pm = np.asarray(batch.mask), np.asarray(batch.policy_mask)
  weights = None
  if config.process_weights:
    sizes = trie_sizes(np.asarray(batch.completions), mask, np.asarray(batch.group_ids))
    weights = np.where(sizes > 0, 1.0 / np.maximum(sizes, 1), 0.0).astype(np.float32)
  adv = numpy_frpo_advantages(config, batch) if config.kl_placement == "future" else None
  if adv is not None and weights is None:
    weights = np.ones_like(adv)
  want, want_metrics, _ = reference_update(
    tiny_model(layers=1), batch, config, lr=LR, max_grad_norm=1e30, advantages=adv, token_weights=weights, loss_mask=pm
  )
  got, metrics = _update(name, overrides, batch)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-7, err_msg=str(k))
  assert metrics["loss"] == pytest.approx(want_metrics["loss"], rel=1e-5, abs=1e-7)
  assert metrics["tokens"] == pm.sum() < mask.sum()
  assert metrics["entropy"] == pytest.approx(want_metrics["entropy"], rel=1e-5)
  same, _ = _update(name, overrides, garbage(batch))
  for k in got:
    np.testing.assert_array_equal(same[k], got[k], err_msg=str(k))
  if name == "lambda_grpo":  # and the mask matters: without it the update differs
    full, _ = _update(name, overrides, batch._replace(policy_mask=None))
    assert any(not np.allclose(full[k], got[k]) for k in got)


@pytest.mark.slow
def test_observation_log_probs_change_no_gradient_entropy_importance_packing():
  """With the entropy bonus, token-level importance correction and KL in the loss, unpacked and
  packed: arbitrary observation log-probs (old, ref, behaviour) give bit-identical updates, and the
  packed step gives the unpacked update."""
  batch = interleaved_batch(seed=3)
  rng = np.random.default_rng(0)
  behavior = np.where(batch.policy_mask, batch.old_logp + 0.1 * rng.standard_normal(batch.mask.shape), 0.0)
  batch = batch._replace(behavior_logp=behavior.astype(np.float32))
  overrides = dict(beta=0.04, entropy_coef=0.01, importance_correction="tis")
  base, m = _update("lambda_grpo", overrides, batch)
  noisy, _ = _update("lambda_grpo", overrides, garbage(batch))
  packed, mp = _update("lambda_grpo", overrides, batch, packing=32)
  init = flat_params(nnx.split(tiny_model(layers=1))[1])
  assert any(not np.allclose(base[k], init[k]) for k in base)
  for k in base:
    np.testing.assert_array_equal(noisy[k], base[k], err_msg=str(k))
    np.testing.assert_allclose(packed[k], base[k], rtol=1e-5, atol=1e-6, err_msg=str(k))
  assert mp["tokens"] == m["tokens"] == np.asarray(batch.policy_mask).sum()


def test_policy_mask_outside_mask_is_refused():
  batch = interleaved_batch()
  bad = np.asarray(batch.policy_mask).copy()
  bad[0, -1] = True
  assert not batch.mask[0, -1]
  _, _, _, step = _step("grpo", ())
  with pytest.raises(ValueError, match="policy_mask must be a subset of batch.mask"):
    step.check_batch(batch._replace(policy_mask=bad))


def test_pad_to_bucket_keeps_policy_mask():
  batch = interleaved_batch()
  out = train.pad_to_bucket(batch, buckets=(16,))
  assert out.policy_mask.shape == (batch.mask.shape[0], 16) and not out.policy_mask[:, 12:].any()
  np.testing.assert_array_equal(out.policy_mask[:, :12], batch.policy_mask)
