"""Slot refill (`jaxgrpo.rollout.refill.generate_refill`, issue 36 item 1): more rows than slots, rows of ragged
lengths (EOS ids, per-row budgets, left-padded prompts of different lengths) end at different steps and their
slots take the next rows; every row must equal the static sampler's (`sampling.generate`, the reference:
one batch of all N rows) for the same key — ids exactly, log-probs to 1e-5 — whatever slot and boundary it ran
in."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from hf_utils import tiny_hf_config, tiny_moe_config
from test_packing_models import randomized

from jaxgrpo import models
from jaxgrpo.rollout.refill import generate_refill
from jaxgrpo.rollout.sampling import SamplingConfig, generate

pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")  # tests/conftest.py


def _prompts(batch, width, lengths, seed=0):
  rng = np.random.default_rng(seed)
  mask = np.arange(width)[None] >= (width - np.asarray(lengths))[:, None]  # left-padded
  return np.where(mask, rng.integers(1, 128, (batch, width)), 0).astype(np.int32), mask


def _check_rows(out, ref, lengths):
  """``out`` equals ``ref`` (a static ``generate``) on the first ``lengths[r]`` tokens of each row r, padding after."""
  t = ref.completions.shape[1]
  mask = np.arange(t)[None] < np.asarray(lengths)[:, None]
  np.testing.assert_array_equal(np.asarray(out.mask), mask)
  np.testing.assert_array_equal(np.asarray(out.completions), np.where(mask, np.asarray(ref.completions), 0))
  np.testing.assert_allclose(np.asarray(out.log_probs), np.where(mask, np.asarray(ref.log_probs), 0), atol=1e-5)
  assert int(out.num_steps) == max(lengths)
  np.testing.assert_array_equal(np.asarray(out.group_ids), np.asarray(ref.group_ids))
  np.testing.assert_array_equal(np.asarray(out.prompt_tokens), np.asarray(ref.prompt_tokens))


def test_refill_equals_static_sampler_dense():
  """15 rows (5 prompts of 1..6 real tokens x 3 samples) through 4 slots, a boundary every 3 steps: EOS ids end
  rows after 3 to 12 tokens; then the same with per-row budgets (row r = generate's row r cut at its budget). A
  sampler that drew with the slot's index, or the step of the boundary instead of the row's own step, or
  prefilled a newcomer at the wrong positions, would change ids."""
  model = randomized(models.build_model(models.config_from_hf(tiny_hf_config("qwen3")), rngs=nnx.Rngs(0)))
  tokens, mask = _prompts(5, 6, [6, 1, 3, 4, 2])
  sampling = SamplingConfig(num_samples=3, max_new_tokens=12, eos_ids=(5, 9, 17, 33, 40, 41, 42, 60))
  key = jax.random.key(3)
  ref = generate(model, tokens, mask, sampling, key=key)
  lengths = np.asarray(ref.mask.sum(1))
  assert len(set(lengths.tolist())) >= 5 and lengths.min() < 6 and lengths.max() == 12  # ragged, some run out
  info = {}
  out = generate_refill(model, tokens, mask, sampling, key=key, num_slots=4, refill_every=3, info=info)
  _check_rows(out, ref, lengths)
  assert info["boundaries"] >= 4 and info["slot_steps_used"] == lengths.sum() - 15  # slots were refilled
  budgets = np.random.default_rng(1).integers(1, 13, 15)
  out = generate_refill(model, tokens, mask, sampling, key=key, num_slots=4, refill_every=3, budgets=budgets)
  _check_rows(out, ref, np.minimum(lengths, budgets))


def test_refill_scan_layers_greedy():
  """A scanned layer stack (one stacked [L, ...] cache, whose prompt rows are padded to the slot cache's length
  on their own axes) and greedy decoding (no uniforms): 8 rows in 3 slots equal generate's."""
  model = randomized(models.build_model(models.config_from_hf(tiny_hf_config("qwen3")), rngs=nnx.Rngs(1)))
  model = models.to_scan_layers(model)
  tokens, mask = _prompts(4, 5, [5, 2, 1, 3], seed=2)
  sampling = SamplingConfig(num_samples=2, max_new_tokens=7, eos_ids=tuple(range(5, 128, 6)))
  key = jax.random.key(0)
  ref = generate(model, tokens, mask, sampling, key=key, temperature=0.0)
  lengths = np.asarray(ref.mask.sum(1))
  out = generate_refill(model, tokens, mask, sampling, key=key, temperature=0.0, num_slots=3, refill_every=2)
  _check_rows(out, ref, lengths)


def test_refill_moe_and_errors():
  """A mixture-of-experts policy (Qwen3-MoE, dropless) through 2 slots, a boundary every 2 steps, raw uint32
  key, top-k filtering: rows equal generate's. Bad slot counts, boundaries and budgets are refused, named."""
  model = randomized(models.build_model(models.config_from_hf(tiny_moe_config("qwen3_moe")), rngs=nnx.Rngs(0)))
  tokens, mask = _prompts(3, 4, [4, 1, 2], seed=1)
  sampling = SamplingConfig(num_samples=2, max_new_tokens=6, top_k=20, eos_ids=(5, 9, 17, 33, 40, 41, 42, 60))
  key = jax.random.PRNGKey(7)
  ref = generate(model, tokens, mask, sampling, key=key)
  lengths = np.asarray(ref.mask.sum(1))
  assert len(set(lengths.tolist())) >= 2
  out = generate_refill(model, tokens, mask, sampling, key=key, num_slots=2, refill_every=2)
  _check_rows(out, ref, lengths)

  call = lambda **kw: generate_refill(
    model, tokens, mask, sampling, key=key, **{"num_slots": 2, "refill_every": 2, **kw}
  )
  with pytest.raises(ValueError, match=r"`num_slots` must be >= 1 \(S, rows decoded at once\); got 0"):
    call(num_slots=0)
  with pytest.raises(TypeError, match=r"`num_slots` must be a Python int"):
    call(num_slots=2.0)
  with pytest.raises(ValueError, match=r"`refill_every` must be >= 1 \(K, decode steps between refill"):
    call(refill_every=0)
  with pytest.raises(TypeError, match=r"`refill_every` must be a Python int"):
    call(refill_every=True)
  with pytest.raises(ValueError, match=r"`budgets` must be int\[N\] with N = B·G = 6; got int64\[5\]"):
    call(budgets=np.ones(5, np.int64))
  with pytest.raises(ValueError, match=r"`budgets` entries must be in \[1, max_new_tokens = 6\]; got min 0"):
    call(budgets=np.zeros(6, np.int32))
  with pytest.raises(ValueError, match="record_routing"):
    generate_refill(
      model,
      tokens,
      mask,
      SamplingConfig(num_samples=2, max_new_tokens=6, record_routing=True),
      key=key,
      num_slots=2,
      refill_every=2,
    )
