"""Sequence packing in the train step and the reference pass (one device): packed == unpacked for every
preset in ``jaxgrpo.PRESETS`` (loss, gradients, λ sizes; three presets' packed steps under the remat
policies, which so equal none), the reference pass's per-completion log-probs, against the hand-written
full-batch update, micro-batch invariance, the pluggable hooks (GSPO, RLOO) unchanged, random segment
lengths (hypothesis), the rules table and bad packed batches.

Cost: each distinct step is one XLA compile (~4 s CPU), so every step is built once (``_run`` is cached)
and the tests share them: the reference pass does not depend on the preset and is checked once per
layout; the remat policies ride on three presets' packed steps; both hooks go in one step.

The independent references are ``helpers.reference_update`` (plain SGD on the loss written out by hand,
unpacked ``[prompt ‖ completion]`` rows, full logits) and ``helpers.numpy_log_probs`` (NumPy
log-softmax of the full logits); packed vs unpacked compares the two layouts of the same step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import (
  flat_params,
  load_example,
  make_batch,
  numpy_log_probs,
  reference_update,
  tiny_config,
  tiny_model,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

import jaxgrpo
from jaxgrpo import models, rloo_advantages
from jaxgrpo.kernels.config import preset
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.step import packing, train

LR, CLIP = 0.5, 0.05
B, P, T, G = 16, 4, 24, 4
L = P + T  # a sequence with a full prompt and a full completion fills a row exactly
LAYERS = 1  # one decoder layer: packing acts in every layer alike (segment-masked attention, positions), and
# each step program compiles in about half the time of the 2-layer model's


def _batch(seed=0, missing=True):
  """Ragged completions of 0..T tokens (one row empty, one exactly filling a row), shared prefixes
  inside groups (λ sizes > 1), and (``missing``) one missing sample (NaN reward)."""
  batch = make_batch(seed=seed, b=B, p=P, t=T, g=G)
  prompt_mask, mask = np.array(batch.prompt_mask), np.array(batch.mask)
  prompt_mask[5], mask[5] = True, True  # 4 + 24 = L tokens: a row of its own
  rewards = np.array(batch.rewards)
  rewards[9] = np.nan if missing else rewards[9]
  completions = np.where(mask, np.maximum(batch.completions, 1), 0).astype(np.int32)
  prompts = np.where(prompt_mask, np.maximum(batch.prompt_tokens, 1), 0).astype(np.int32)
  return batch._replace(
    prompt_tokens=prompts, prompt_mask=prompt_mask, completions=completions, mask=mask, rewards=rewards
  )


def _make(config, *, packing=None, micro=1, mini=1, model=None, rows=None, **fns):
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.sgd(LR)
  graphdef, state, shardings = train.init_train_state(model or tiny_model(layers=LAYERS), opt, mesh)
  tc = train.TrainConfig(
    micro_batches=micro,
    mini_batches=mini,
    max_grad_norm=CLIP,
    group_size=G,
    chunk_size=5,
    tree_stats=True,
    packing=packing,
    packing_rows=rows,
  )
  step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc, **fns)
  ref = train.make_reference_fn(graphdef, mesh=mesh, param_shardings=shardings.params, train_config=tc)
  return step, ref, state


@functools.lru_cache(maxsize=None)
def _run(name, packing, micro=1, mini=1, remat="none", hooks=False, missing=True):
  """One step of preset ``name`` from the initial tiny model: (params, metrics). ``hooks``: GSPO's
  sequence-level objective (examples/gspo.py) and RLOO advantages instead of the preset's."""
  config = preset(name) if not hooks else preset("grpo", clip_eps_low=0.1, clip_eps_high=0.1)
  fns = {}
  if hooks:
    fns["objective_fn"] = load_example("gspo").gspo_objective
    fns["advantages_fn"] = lambda config, r, tok, m, gid, ng, **kw: (rloo_advantages(r, gid, ng), None)
  model = models.build_model(tiny_config(LAYERS), rngs=nnx.Rngs(0), remat=remat)
  step, _, state = _make(config, packing=packing, micro=micro, mini=mini, model=model, **fns)
  state, metrics = step(state, _batch(missing=missing))
  return flat_params(state.params), {k: float(v) for k, v in metrics.items()}


@functools.lru_cache(maxsize=None)
def _initial_params():
  return flat_params(nnx.split(tiny_model(layers=LAYERS))[1])


def _update(params, init):
  return np.concatenate([(params[k] - init[k]).ravel() for k in sorted(params)])


def _assert_same_update(got, want, rel=2e-6):
  """Two updates agree to ``rel`` of the update's scale (fp32: single entries that nearly cancel differ
  in their last bits, relative to the whole update)."""
  init = _initial_params()
  u, v = _update(got, init), _update(want, init)
  assert np.abs(v).max() > 0
  assert np.abs(u - v).max() <= rel * np.abs(v).max(), np.abs(u - v).max() / np.abs(v).max()


def _assert_same_metrics(got, want):
  assert got.keys() == want.keys()
  for key in want:
    assert got[key] == pytest.approx(want[key], rel=2e-5, abs=1e-6), key


# the remat policies ride on three presets' packed steps (each a compile of its own): the packed step
# under the policy equals the unpacked one without remat, so the policy changes nothing in the step
REMAT = {"lambda_grpo": "full", "lambda_frpo": "dots", "dr_grpo": "dots_no_batch"}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(jaxgrpo.PRESETS))
def test_every_preset_packed_equals_unpacked(name):
  """M = 2 mini-batches × K = 2 micro-batches: the packed step makes the same two updates on the same
  rows as the unpacked one; loss, every metric (λ sizes and tree statistics included) and the
  parameters agree. For the presets of ``REMAT`` the packed step runs under that remat policy."""
  remat = REMAT.get(name, "none")
  packed, m_packed = _run(name, L, micro=2, mini=2, remat=remat)
  plain, m_plain = _run(name, None, micro=2, mini=2)
  _assert_same_metrics(m_packed, m_plain)
  assert m_packed["rewards_nonfinite"] == 1 and m_packed["tree/mean_process_set_size"] > 1
  # float32 rounding of a different summation order: ~1e-6 relative; CISPO's unclipped importance weights
  # and SAPO's gate amplify it to ~3e-6 (2.9e-6 measured for both); under remat as tight as without
  _assert_same_update(packed, plain, rel=2e-6 if name in REMAT else 5e-6)


def test_reference_pass_packed_equals_unpacked_and_numpy():
  """The reference pass (it does not depend on the preset) over the M·K = 4 slots: the per-completion
  log-probs of the packed layout equal the unpacked layout's and NumPy's log-softmax of the full logits."""
  batch = _batch()
  want = numpy_log_probs(tiny_model(layers=LAYERS), batch)  # independent: NumPy log-softmax of the full logits
  lp = {}
  for layout in (L, None):
    _, ref, state = _make(preset("grpo"), packing=layout, micro=2, mini=2)
    lp[layout] = np.asarray(ref(state.params, batch))
  np.testing.assert_allclose(lp[L], want, rtol=0, atol=1e-5)
  np.testing.assert_allclose(lp[L], lp[None], rtol=0, atol=1e-5)
  assert np.all(lp[L][~batch.mask] == 0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lambda_frpo", "dr_grpo"])
def test_packed_step_matches_the_handwritten_update_and_micro_batches_change_nothing(name):
  """One update on the whole batch (M = 1), against plain SGD on the loss written out by hand, with
  K = 1 and K = 4 packed micro-batches (each packed on its own)."""
  config = preset(name)
  batch = _batch(missing=False)  # the hand-written update knows no missing samples
  want, want_metrics, _ = reference_update(tiny_model(layers=LAYERS), batch, config, lr=LR, max_grad_norm=CLIP)
  one, m1 = _run(name, L, micro=1, missing=False)
  four, m4 = _run(name, L, micro=4, missing=False)
  for k in want:
    np.testing.assert_allclose(one[k], want[k], rtol=1e-5, atol=1e-7, err_msg=str(k))
  _assert_same_update(four, one)
  for key in ("loss", "grad_norm", "entropy", "approx_kl"):
    assert m1[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-7), key
  _assert_same_metrics(m4, m1)


@pytest.mark.slow
def test_hooks_work_unchanged_with_packing():
  """A sequence-level objective (GSPO, examples/gspo.py) and a custom advantage estimator (RLOO), both in
  one step, see the same [B, T] arrays packed or not."""
  packed, m_packed = _run("grpo", L, micro=2, mini=2, hooks=True)
  plain, m_plain = _run("grpo", None, micro=2, mini=2, hooks=True)
  _assert_same_metrics(m_packed, m_plain)
  _assert_same_update(packed, plain)


def test_packed_layout_of_a_batch():
  """Slots are the step's micro-batches per device shard; each slot's rows hold exactly its sequences;
  the LM head sees only completion tokens."""
  batch = _batch()
  packed = train.pack_batch(batch, row_length=L, shards=2, mini_batches=2, micro_batches=2).packed
  slots = train.batch_slots(B, shards=2, mini_batches=2, micro_batches=2)
  # row b: shard b // 8, then b mod 4 = m·K + k
  np.testing.assert_array_equal(slots, [(b // 8) * 4 + b % 4 for b in range(B)])
  np.testing.assert_array_equal(packed.slot, slots)
  rs = packed.rows_per_slot
  assert packed.tokens.shape == (8 * rs, L) and packed.head_index.shape[0] == 8
  real = np.asarray(batch.mask)
  assert np.array_equal(packed.unpack_index >= 0, real)
  for b in range(B):
    s = slots[b]
    head = packed.head_index[s]
    for t in np.flatnonzero(real[b]):
      r, c = divmod(int(head[packed.unpack_index[b, t]]), L)
      assert packed.tokens[s * rs + r, c] == batch.completions[b, t]
      assert packed.segment_ids[s * rs + r, c] > 0 and packed.positions[s * rs + r, c] == batch.prompt_mask[b].sum() + t
  # the head buffer: the slot's completion tokens, each once (so no prompt or padding column), then zeros
  for s in range(8):
    n = int(real[slots == s].sum())
    assert len(set(packed.head_index[s, :n].tolist())) == n and not packed.head_index[s, n:].any()


def test_step_packs_once_and_never_retraces():
  """A NumPy batch is packed by the step, a packed NumPy batch and a placed packed batch
  (``iteration.place``) run the same program; the reference pass reuses the batch's packing."""
  from jaxgrpo.loop import iteration

  step, ref, state = _make(preset("grpo"), packing=L, micro=2, mini=2)  # grpo's program in the preset test
  batch = _batch()._replace(ref_logp=None)
  state, m1 = step(state, batch)
  packed = step.pack(batch)
  assert packed.packed is not None and step.pack(packed) is packed
  state, m2 = step(state, packed)
  placed = iteration.place(batch, mesh=step.mesh, buckets=None, train_config=step.train_config)
  assert isinstance(placed.packed.tokens, jax.Array) and placed.packed.tokens.sharding == step.batch_sharding
  state, m3 = step(state, placed)
  assert step.traces == 1
  np.testing.assert_array_equal(np.asarray(ref(state.params, placed)), np.asarray(ref(state.params, batch)))
  # bucketing a packed batch fits its index map too
  bucketed = train.pad_to_bucket(packed, buckets=(32,))
  assert bucketed.completions.shape == (B, 32) and bucketed.packed.unpack_index.shape == (B, 32)
  assert np.array_equal(bucketed.packed.unpack_index >= 0, bucketed.mask)


def test_bad_packed_batches_fail_before_compiling():
  step, ref, state = _make(preset("grpo"), packing=L, micro=2)
  batch = _batch()._replace(ref_logp=None)
  with pytest.raises(ValueError, match=r"batch.packed does not fit this step: expected 2 slots"):
    step(state, train.pack_batch(batch, row_length=L, micro_batches=4))
  with pytest.raises(ValueError, match=r"of Rs rows of L=28 tokens"):
    step(state, train.pack_batch(batch, row_length=L + 4, micro_batches=2))
  wrong = train.pack_batch(batch, row_length=L, micro_batches=2)
  with pytest.raises(ValueError, match="does not cover exactly batch.mask"):
    step(state, wrong._replace(mask=np.zeros_like(batch.mask)))
  shuffled = wrong._replace(packed=wrong.packed._replace(slot=wrong.packed.slot[::-1].copy()))
  with pytest.raises(ValueError, match="not the step's slot of each row"):
    step(state, shuffled)
  with pytest.raises(
    ValueError, match=r"sequence \d+ has \d+ tokens \(\d prompt \+ \d+ completion\), more than row_length=20"
  ):
    train.pack_batch(batch, row_length=20)
  plain, _, _ = _make(preset("grpo"))
  with pytest.raises(ValueError, match="TrainConfig.packing is None"):
    plain(state, wrong)
  fixed, _, _ = _make(preset("grpo"), packing=L, rows=1)
  with pytest.raises(ValueError, match=r"slot 0 needs \d+ rows of 28 tokens, more than rows=1"):
    fixed(state, batch)
  assert step.traces == plain.traces == fixed.traces == 0
  with pytest.raises(ValueError, match="`packing_rows`=2 needs `packing`"):
    train.TrainConfig(packing_rows=2)
  with pytest.raises(ValueError, match="`packing` must be >= 1"):
    train.TrainConfig(packing=0)


def test_rules_default_to_the_models_own_and_must_match():
  rules = {**shd.DEFAULT_RULES, "activation_embed": "tensor"}
  model = models.build_model(tiny_config(LAYERS), rngs=nnx.Rngs(0), rules=rules)
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.sgd(0.1)
  with pytest.raises(ValueError, match=r"init_train_state: `rules` differ from the model's own rules table"):
    train.init_train_state(model, opt, mesh, rules=shd.DEFAULT_RULES)
  graphdef, _, shardings = train.init_train_state(model, opt, mesh)
  step = train.make_train_step(graphdef, opt, preset("grpo"), mesh=mesh, shardings=shardings)
  assert step.rules == rules
  with pytest.raises(ValueError, match=r"make_train_step: `rules` differ"):
    train.make_train_step(graphdef, opt, preset("grpo"), mesh=mesh, shardings=shardings, rules=shd.DEFAULT_RULES)
  with pytest.raises(ValueError, match=r"make_reference_fn: `rules` differ"):
    train.make_reference_fn(graphdef, mesh=mesh, param_shardings=shardings.params, rules=shd.DEFAULT_RULES)


# ----------------------------------------------------------------------------- random segment lengths

HP, HT, HL, HB, SLOTS, ROWS = 4, 12, 16, 8, 2, 4  # 4 sequences per slot: at most 4 rows of 16 tokens


@functools.lru_cache(maxsize=None)
def _hyp_model():
  return models.build_model(tiny_config(layers=1), rngs=nnx.Rngs(1))


@jax.jit
def _packed_value_and_grad(model, tokens, positions, segment_ids, head_index, unpack_index, w):
  def loss(model):
    args = (tokens, positions, segment_ids, head_index, unpack_index)
    lp, ent = models.packed_log_probs(model, *args, blocks=SLOTS, chunk_size=5, with_entropy=True)
    return jnp.sum(lp * w), (lp, ent)

  return jax.value_and_grad(loss, has_aux=True)(model)


@jax.jit
def _plain_value_and_grad(model, prompt_tokens, prompt_mask, completions, mask, w):
  def loss(model):
    args = (prompt_tokens, prompt_mask, completions, mask)
    lp, ent = models.completion_log_probs(model, *args, chunk_size=5, with_entropy=True)
    return jnp.sum(lp * w), (lp, ent)

  return jax.value_and_grad(loss, has_aux=True)(model)


@settings(max_examples=25, deadline=None)
@given(
  st.lists(st.integers(1, HP), min_size=HB, max_size=HB),
  st.lists(st.integers(0, HT), min_size=HB, max_size=HB),
  st.integers(0, 2**31 - 1),
)
@example([HP] * HB, [HT] * HB, 0)  # every sequence fills its row exactly: one segment per row
@example([1] * HB, [1] * HB, 1)  # four two-token segments per slot share one row
@example([HP, 1, 2, 3, 4, 1, 1, 2], [HT, 0, 5, 12, 3, 7, 15 - 1, 1], 2)  # exact fills, single and shared rows
def test_random_segment_lengths_give_the_unpacked_log_probs_and_gradients(plen, clen, seed):
  rng = np.random.default_rng(seed)
  plen, clen = np.asarray(plen), np.minimum(np.asarray(clen), HT)
  pm = np.arange(HP)[None] >= HP - plen[:, None]
  cm = np.arange(HT)[None] < clen[:, None]
  pt = np.where(pm, rng.integers(1, 128, (HB, HP)), 0).astype(np.int32)
  ct = np.where(cm, rng.integers(1, 128, (HB, HT)), 0).astype(np.int32)
  slot = np.repeat(np.arange(SLOTS), HB // SLOTS)  # contiguous: slot k is block k
  pk = packing.pack_slots(pt, pm, ct, cm, slot, num_slots=SLOTS, row_length=HL, rows=ROWS, head_length=HL)
  segments = [len({s for s in row if s}) for row in pk.segment_ids]
  full = [(row > 0).all() for row in pk.segment_ids]
  if (plen + clen == HL).any():
    assert any(f and n == 1 for f, n in zip(full, segments))  # a segment exactly filling a row
  w = jnp.asarray(np.where(cm, rng.standard_normal(cm.shape), 0), jnp.float32)
  model = _hyp_model()
  args = (pk.tokens, pk.positions, pk.segment_ids, pk.head_index, pk.unpack_index)
  (v1, (lp1, ent1)), g1 = _packed_value_and_grad(model, *map(jnp.asarray, args), w)
  (v2, (lp2, ent2)), g2 = _plain_value_and_grad(model, *map(jnp.asarray, (pt, pm, ct, cm)), w)
  np.testing.assert_allclose(np.asarray(lp1), np.asarray(lp2), rtol=0, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ent1), np.asarray(ent2), rtol=0, atol=1e-5)
  assert np.all(np.asarray(lp1)[~cm] == 0)
  # v = sum(lp * w): the log-probs' atol bounds its difference by sum|w| * atol (summation order differs)
  assert abs(float(v1) - float(v2)) <= float(jnp.abs(w).sum()) * 1e-5, (float(v1), float(v2))
  for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(g1)), nnx.to_flat_state(nnx.state(g2))):
    np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), rtol=1e-4, atol=1e-6, err_msg=str(path))
