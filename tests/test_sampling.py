"""Tests for jaxgrpo.rollout.sampling: HF-parity of greedy decoding, log-prob consistency with the train-side
recomputation, filtering against a NumPy reference, sampling statistics, early stop, argument errors.

Every reference is independent of the sampler: transformers' `generate` (torch), NumPy, or the
model's full (cache-free) forward through `jaxgrpo.models.log_probs`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_utils import FAMILIES, assert_greedy_matches_hf, build_hf_model, tiny_hf_config

from jaxgrpo import models
from jaxgrpo.models.backend import cpu_bf16_dots
from jaxgrpo.rollout import sampling
from jaxgrpo.rollout.sampling import (
  Rollout,
  SamplingConfig,
  SamplingPolicy,
  cache_slots,
  filter_logits,
  generate,
  sample_categorical,
)

VOCAB = 97
PAD = 0


def _scaled(model: nnx.Module, scale: float) -> nnx.Module:
  """Multiplies every weight matrix (ndim >= 2) by `scale`: larger, well-separated logits."""
  graphdef, state = nnx.split(model)
  state = jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, state)
  return nnx.merge(graphdef, state)


def _qwen3_config(vocab: int = VOCAB) -> models.Qwen3Config:
  return models.Qwen3Config(
    vocab_size=vocab,
    hidden_size=32,
    num_layers=1,  # one layer: the sampler's checks do not depend on depth (the HF parity runs 2 layers)
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    tie_word_embeddings=True,
    max_position_embeddings=128,
  )


def _qwen3(seed: int = 0, vocab: int = VOCAB) -> nnx.Module:
  return _scaled(models.build_model(_qwen3_config(vocab), rngs=nnx.Rngs(seed)), 5.0)


@pytest.fixture(scope="module")
def qwen3():
  return _qwen3()


@pytest.fixture(scope="module")
def gpt2():
  cfg = models.GPT2Config(vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=4, max_position_embeddings=128)
  return _scaled(models.build_model(cfg, rngs=nnx.Rngs(1)), 5.0)


def _prompts(batch: int = 3, length: int = 6, seed: int = 0):
  """Left-padded prompts: row b has `length - b` real tokens (ids 1..VOCAB-1), pad 0 on the left."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, VOCAB, size=(batch, length)).astype(np.int32)
  n_real = np.maximum(length - np.arange(batch), 1)
  mask = np.arange(length)[None, :] >= (length - n_real)[:, None]
  tokens = np.where(mask, tokens, PAD).astype(np.int32)
  return jnp.asarray(tokens), jnp.asarray(mask)


def _generate(model, tokens, mask, *, key=None, temperature=1.0, **fields):
  """``generate`` with ``SamplingConfig(**fields)`` (defaults G = 2, T = 8, no EOS, pad 0) and key 0."""
  sampling = SamplingConfig(**{"num_samples": 2, "max_new_tokens": 8, "pad_id": PAD, **fields})
  return generate(model, tokens, mask, sampling, key=jax.random.key(0) if key is None else key, temperature=temperature)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _jit_log_probs(graphdef, state, tokens, mask, temperature):
  return models.log_probs(nnx.merge(graphdef, state), tokens, mask, temperature=temperature)


@functools.partial(jax.jit, static_argnums=(0,))
def _jit_logits(graphdef, state, tokens, mask):
  """float32 [B, S, V] logits of a full, cache-free forward (positions from the mask)."""
  model = nnx.merge(graphdef, state)
  hidden, _ = model(tokens, models.positions_from_mask(mask), attention_mask=mask)
  return model.logits(hidden, out_dtype=jnp.float32)


def _recomputed_log_probs(model, r: Rollout, temperature: float) -> np.ndarray:
  """log_probs of the completion tokens from a full, cache-free forward of prompt + completion."""
  full = jnp.concatenate([r.prompt_tokens, r.completions], axis=1)
  full_mask = jnp.concatenate([r.prompt_mask, r.mask], axis=1)
  lp = _jit_log_probs(*nnx.split(model), full, full_mask, temperature)
  return np.asarray(lp[:, r.prompt_tokens.shape[1] :])


# ------------------------------------------------------------------------------------------------
# Greedy parity with transformers


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_generate(family, tmp_path):
  """32 greedy tokens from left-padded prompts == HF generate(do_sample=False), token for token."""
  torch = pytest.importorskip("torch")
  hf_model = build_hf_model(tiny_hf_config(family, tied=family in ("gpt2", "qwen3")), seed=0)
  with torch.no_grad():  # weights x4: logit std ~1, so top-1/top-2 margins are >> fp32 noise
    for p in hf_model.parameters():
      if p.ndim >= 2:
        p.mul_(4.0)
  hf_model.save_pretrained(str(tmp_path))
  model = models.load_hf(str(tmp_path))

  r = assert_greedy_matches_hf(hf_model, model, new=32, pad=PAD)
  assert bool(r.mask.all())


# ------------------------------------------------------------------------------------------------
# Filtering


def _np_filter(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
  """Row-by-row NumPy reference of top-k then top-p filtering (float64 probabilities)."""
  out = np.array(logits, np.float64)
  for row in out:
    if 0 < top_k < row.size:
      kth = np.sort(row)[::-1][top_k - 1]
      row[row < kth] = -np.inf
    if top_p < 1.0:
      order = np.argsort(-row, kind="stable")
      p = np.exp(row[order] - row[order[0]])
      p /= p.sum()
      kept, mass = [], 0.0
      for idx, pi in zip(order, p):
        if mass >= top_p:
          break
        kept.append(idx)
        mass += pi
      threshold = row[kept].min()
      row[row < threshold] = -np.inf
  return out


@pytest.mark.parametrize(
  "top_k, top_p", [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.5), (0, 0.9), (7, 0.8), (0, 1e-6), (VOCAB + 3, 0.95)]
)
def test_filter_logits_matches_numpy(top_k, top_p):
  rng = np.random.default_rng(top_k * 100 + int(top_p * 1000))
  logits = rng.normal(size=(6, VOCAB)).astype(np.float32) * 3
  got = np.asarray(filter_logits(jnp.asarray(logits), top_k=top_k, top_p=top_p))
  want = _np_filter(logits, top_k, top_p)
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  np.testing.assert_array_equal(got[np.isfinite(got)], logits[np.isfinite(want)])


def test_filter_logits_keeps_ties_and_argmax():
  logits = jnp.array([[1.0, 3.0, 3.0, 0.0, 2.0]])
  # top_k=1 keeps both tied maxima; a tiny top_p keeps the maxima only.
  np.testing.assert_array_equal(np.isfinite(filter_logits(logits, top_k=1)), [[0, 1, 1, 0, 0]])
  np.testing.assert_array_equal(np.isfinite(filter_logits(logits, top_p=1e-9)), [[0, 1, 1, 0, 0]])
  # top_p=1 and top_k=0 change nothing.
  np.testing.assert_array_equal(filter_logits(logits), logits)


@pytest.mark.parametrize("vocab", [1, 2, 97, pytest.param(300, marks=pytest.mark.slow)])
def test_sample_categorical_frequencies(vocab):
  """Empirical frequencies == softmax(logits) (5 binomial sd), never a -inf entry; rows with
  sparse support (scattered and contiguous -inf), a peaked row and a one-hot row."""
  rng = np.random.default_rng(vocab)
  dists = rng.normal(size=(4, vocab)) * 2
  if vocab > 2:
    dists[0, rng.random(vocab) < 0.7] = -np.inf  # scattered holes
    dists[0, 0] = 0.0
    dists[1, : vocab // 2] = -np.inf  # a contiguous run of empty blocks
    dists[2] *= 4  # peaked
    dists[3, :] = -np.inf
    dists[3, vocab - 1] = 1.0  # one-hot on the last (padded-block) entry
  n = 20000
  logits = jnp.asarray(np.repeat(dists, n, axis=0), jnp.float32)
  draws = np.asarray(sample_categorical(jax.random.key(0), logits)).reshape(4, n)
  assert draws.dtype == np.int32
  for row, d in zip(dists, draws):
    q = np.exp(row - row.max())
    q /= q.sum()
    counts = np.bincount(d, minlength=vocab)
    assert counts[q == 0].sum() == 0
    assert np.all(np.abs(counts / n - q) <= 5 * np.sqrt(q * (1 - q) / n) + 2 / n)


def _untruncated_policy(vocab, suppress_ids, temperature):
  config = SamplingConfig(num_samples=1, max_new_tokens=1, pad_id=PAD, suppress_ids=suppress_ids)
  return SamplingPolicy.from_config(config, temperature=temperature, vocab_size=vocab)


@pytest.mark.parametrize("vocab", [97, 100])
def test_untruncated_draw_matches_numpy_with_suppressed_ids(vocab):
  """GRPO's draw (no top-k/top-p; block sums straight from the logits, the normaliser from the same pass plus the
  suppressed ids' own terms): frequencies == softmax over the ids not suppressed (5 binomial sd), a suppressed id
  never drawn even where its logit dominates by 120 nats, and the log-prob == NumPy's float64
  log_softmax(logits / T)[token] over the full vocabulary. 97: a padded last block; 100: blocks that divide V."""
  suppress = (0, 5, vocab - 1)
  policy = _untruncated_policy(vocab, suppress, temperature=0.7)
  rng = np.random.default_rng(vocab)
  dists = rng.normal(size=(3, vocab)) * 2
  dists[1, 5] = 120.0  # a suppressed id far above the rest: the normaliser is its term, the draw ignores it
  dists[2, 10:] = -np.inf  # sparse support
  n = 20000
  logits = jnp.asarray(np.repeat(dists, n, axis=0), jnp.float32)
  u = jax.random.uniform(jax.random.key(1), (logits.shape[0],), jnp.float32)
  draw = jax.jit(lambda x, u: sampling.draw_token(x, lambda: u, policy, sampling.suppressed_mask(suppress, vocab)))
  token, logp = (np.asarray(a) for a in draw(logits, u))
  scaled = np.asarray(logits, np.float64) / 0.7
  top = scaled.max(axis=1, keepdims=True)
  want = scaled - (top + np.log(np.exp(scaled - top).sum(axis=1, keepdims=True)))
  np.testing.assert_allclose(logp, np.take_along_axis(want, token[:, None].astype(int), 1)[:, 0], atol=1e-5, rtol=0)
  for row, d in zip(dists, token.reshape(3, n)):
    q = np.exp(row / 0.7 - np.max(np.delete(row, suppress)) / 0.7)
    q[list(suppress)] = 0.0
    q /= q.sum()
    counts = np.bincount(d, minlength=vocab)
    assert counts[q == 0].sum() == 0
    assert np.all(np.abs(counts / n - q) <= 5 * np.sqrt(q * (1 - q) / n) + 2 / n)


def test_the_decode_loop_writes_no_vocabulary_sized_temporaries():
  """A decode step of GRPO's draw writes one ``[N, V]`` array, the head's logits: the block sums, the row maximum,
  the normaliser and the suppressed pad id are reduced or gathered from it, never a masked copy, the probabilities
  or a second pass for the logsumexp (three more ``[N, V]`` writes per step before; issue 51 item 4). Counted on
  the compiled program: the top-level fusions whose result is ``f32[N, V]`` (or its block view) — the head in the
  loop and the first logits repeated over the G samples, once."""
  vocab, rows = 100, 12  # 3 prompts x G 4; blocks of 10 divide V (no padded copy)
  model = _qwen3(vocab=vocab)
  tokens, mask = _prompts(batch=3)
  policy = _untruncated_policy(vocab, None, temperature=1.0)
  policy = dataclasses.replace(policy, num_samples=4, max_new_tokens=10)
  text = sampling.lower_generate(model, tokens, mask, policy, key=jax.random.key(0)).compile().as_text()
  big = re.findall(rf"%(\S+) = f32\[{rows},(?:{vocab}|10,10)\]\S* fusion\(", text)
  assert len(big) <= 2, f"[N, V] arrays written: {big}"


def _mixed_qwen3() -> nnx.Module:
  """A bf16 model over float32 parameters (the mixed-precision sampler's case), tied embedding."""
  return models.build_model(_qwen3_config(), rngs=nnx.Rngs(2), dtype=jnp.bfloat16, param_dtype=jnp.float32)


def _called_computations(text: str, root: str) -> str:
  """The HLO text of computation ``root`` and of every computation it calls (fusions, nested loops, ...)."""
  bodies = dict(re.findall(r"^(?:ENTRY )?%(\S+) [^\n]*\{\n(.*?)^\}", text, flags=re.M | re.S))
  seen, todo = set(), [root]
  while todo:
    name = todo.pop()
    if name not in seen and name in bodies:
      seen.add(name)
      todo += re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", bodies[name])
  return "\n".join(bodies[n] for n in seen)


def test_the_mixed_precision_decode_loop_rounds_no_weight():
  """In a bf16 model over float32 parameters, the compiled decode loops (every while body and everything it calls)
  convert no array of a weight's size, with either bf16 product: XLA:CPU hoists the layers' rounding of each
  weight to bf16 (and, for float32 products, back) out of the loop and does it once per call (issue 51 item 4
  suspected it ran at every token; BENCHMARKS.md "Peers", run K continued). A guard on the compiler's loop-invariant code motion:
  it holds on jax 0.10.2 with or without remat and scanned layers, and fails if an upgrade stops hoisting. Counted
  over the element counts of the 2-D and larger parameters (the activations' [12, ...] counts differ)."""
  model = _mixed_qwen3()
  sizes = {math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model)) if x.ndim >= 2}
  tokens, mask = _prompts(batch=3)
  policy = sampling.SamplingPolicy.from_config(
    SamplingConfig(num_samples=4, max_new_tokens=10, pad_id=PAD), temperature=1.0, vocab_size=VOCAB
  )
  for mode in ("float32", "native"):
    jax.clear_caches()  # the switch is read at trace time, not part of jit's cache key
    with cpu_bf16_dots(mode):
      text = sampling.lower_generate(model, tokens, mask, policy, key=jax.random.key(0)).compile().as_text()
    loop = "\n".join(_called_computations(text, body) for body in re.findall(r"while\([^\n]*body=%([\w.\-]+)", text))
    converts = re.findall(r"= (?:f32|bf16)\[([\d,]*)\]\S* convert\(", loop)
    weights = [s for s in converts if s and math.prod(int(d) for d in s.split(",")) in sizes]
    assert not weights, f"cpu_bf16_dots({mode!r}): the decode loop converts weight-sized arrays {weights}"


# ------------------------------------------------------------------------------------------------
# Sampled rollouts. Compiles are the cost here, so tests share a few static configurations:
# "sampled" (temperature 1, G=4, T=10) without and with EOS, and "greedy" (temperature 0).

SAMPLED = dict(num_samples=4, max_new_tokens=10, temperature=1.0)
GREEDY = dict(num_samples=2, max_new_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def sampled(qwen3):
  """(prompts, mask, rollout without EOS, rollout with EOS, its eos ids), same key."""
  tokens, mask = _prompts(batch=3)
  free = _generate(qwen3, tokens, mask, key=jax.random.key(3), **SAMPLED)
  # EOS ids: the tokens at column 2 of every row, so every row stops within 3 tokens.
  eos = tuple(sorted(set(np.asarray(free.completions[:, 2]).tolist())))
  stopped = _generate(qwen3, tokens, mask, key=jax.random.key(3), eos_ids=eos, **SAMPLED)
  return tokens, mask, free, stopped, eos


def test_rollout_shapes_and_groups(sampled):
  tokens, mask, r, _, _ = sampled
  assert r.completions.shape == (12, 10) and r.completions.dtype == jnp.int32
  assert r.mask.shape == (12, 10) and r.mask.dtype == jnp.bool_
  assert r.log_probs.shape == (12, 10) and r.log_probs.dtype == jnp.float32
  np.testing.assert_array_equal(r.group_ids, np.repeat(np.arange(3), 4))
  np.testing.assert_array_equal(r.prompt_tokens, np.repeat(np.asarray(tokens), 4, axis=0))
  np.testing.assert_array_equal(r.prompt_mask, np.repeat(np.asarray(mask), 4, axis=0))
  assert bool(r.mask.all()) and int(r.num_steps) == 10  # no EOS: every row has all 10 tokens
  assert not (np.asarray(r.completions) == PAD).any()  # the pad id is suppressed by default


def test_log_probs_equal_model_recomputation_sampled(qwen3, sampled):
  """Returned log-probs == models.log_probs on [prompt, completion] (rows with and without EOS)."""
  for r in sampled[2:4]:
    want = np.where(np.asarray(r.mask), _recomputed_log_probs(qwen3, r, 1.0), 0.0)
    np.testing.assert_allclose(np.asarray(r.log_probs), want, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(r.log_probs)[np.asarray(r.mask)] < 0)


@pytest.mark.parametrize(
  "family, temperature, top_k, top_p",
  [
    ("qwen3", 0.7, 5, 0.9),
    pytest.param("qwen3", 0.0, 0, 1.0, marks=pytest.mark.slow),
    pytest.param("gpt2", 0.7, 5, 0.9, marks=pytest.mark.slow),
  ],
)
def test_log_probs_equal_model_recomputation(family, temperature, top_k, top_p, request):
  """Also with temperature != 1, top-k/top-p filtering (full-softmax log-probs), greedy, GPT-2."""
  model = request.getfixturevalue(family)
  tokens, mask = _prompts(batch=3)
  r = _generate(
    model,
    tokens,
    mask,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    eos_ids=(3, 5, 7, 11, 13),
    num_samples=3,
    max_new_tokens=10,
  )
  want = _recomputed_log_probs(model, r, temperature if temperature > 0 else 1.0)
  np.testing.assert_allclose(np.asarray(r.log_probs), np.where(np.asarray(r.mask), want, 0.0), rtol=1e-5, atol=1e-5)


def test_eos_truncates_the_no_eos_rollout_and_stops_early(sampled):
  """With the same key, EOS only truncates: row = no-EOS row up to and including its first EOS,
  then pad / mask False / log-prob 0; the loop runs max(lengths) < T steps."""
  _, _, free, r, eos = sampled
  comp = np.asarray(free.completions)
  lengths = np.isin(comp, eos).argmax(1) + 1
  assert (lengths <= 3).all()
  want_mask = np.arange(10)[None] < lengths[:, None]
  np.testing.assert_array_equal(r.mask, want_mask)
  np.testing.assert_array_equal(r.completions, np.where(want_mask, comp, PAD))
  np.testing.assert_allclose(r.log_probs, np.where(want_mask, np.asarray(free.log_probs), 0.0), rtol=1e-6, atol=1e-6)
  assert int(r.num_steps) == lengths.max() < 10


def test_deterministic_given_key_and_keys_differ(qwen3, sampled):
  tokens, mask, a, _, _ = sampled
  b = _generate(qwen3, tokens, mask, key=jax.random.key(3), **SAMPLED)
  c = _generate(qwen3, tokens, mask, key=jax.random.key(4), **SAMPLED)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  assert (np.asarray(a.completions) != np.asarray(c.completions)).any()
  # Samples of the same prompt differ from each other (shared prefill, independent draws).
  s = np.asarray(a.completions).reshape(3, 4, -1)
  assert (s != s[:, :1]).any(axis=(1, 2)).all()


def test_greedy_is_argmax_of_full_forward(qwen3):
  """temperature 0: token t = argmax of the cache-free forward over prompt + tokens_<t, over the ids
  not suppressed (by default every id but the pad id); the G samples of a prompt are identical;
  top_k=1 at any temperature gives the same tokens."""
  tokens, mask = _prompts(batch=3)
  r = _generate(qwen3, tokens, mask, **GREEDY)
  full = np.concatenate([np.asarray(r.prompt_tokens), np.asarray(r.completions)], axis=1)
  full_mask = np.concatenate([np.asarray(r.prompt_mask), np.ones(r.completions.shape, bool)], 1)
  logits = np.array(_jit_logits(*nnx.split(qwen3), jnp.asarray(full), jnp.asarray(full_mask)))
  P = tokens.shape[1]
  logits[..., PAD] = -np.inf
  np.testing.assert_array_equal(np.asarray(r.completions), logits[:, P - 1 : -1].argmax(-1))
  c = np.asarray(r.completions).reshape(3, 2, -1)
  assert (c == c[:, :1]).all()
  top1 = _generate(
    qwen3, tokens, mask, **{**GREEDY, "temperature": 1.3}, top_k=1, key=jax.random.PRNGKey(5)
  )  # also: a raw uint32[2] key works
  np.testing.assert_array_equal(top1.completions, r.completions)


def test_all_rows_finish_at_first_token(qwen3):
  tokens, mask = _prompts(batch=3)
  greedy = _generate(qwen3, tokens, mask, **GREEDY)
  first = tuple(sorted(set(np.asarray(greedy.completions[:, 0]).tolist())))
  r = _generate(qwen3, tokens, mask, **GREEDY, eos_ids=first)
  assert int(r.num_steps) == 1
  np.testing.assert_array_equal(r.mask, np.arange(8)[None].repeat(6, 0) < 1)
  np.testing.assert_array_equal(np.asarray(r.completions)[:, 1:], PAD)
  np.testing.assert_array_equal(r.completions[:, 0], greedy.completions[:, 0])


# ------------------------------------------------------------------------------------------------
# Sampling statistics (first token: its distribution is known exactly from the model)


def _first_token_probs(model, tokens, mask, temperature):
  """softmax(logits / temperature) of the first completion token, from a cache-free forward."""
  logits = np.asarray(_jit_logits(*nnx.split(model), tokens, mask)[:, -1], np.float64)
  z = logits / temperature
  p = np.exp(z - z.max(-1, keepdims=True))
  return logits, p / p.sum(-1, keepdims=True)


@pytest.mark.parametrize(
  "top_k, top_p, suppress",
  [(0, 1.0, None), (0, 1.0, "top3"), pytest.param(6, 0.7, "top3", marks=pytest.mark.slow)],
)
def test_first_token_frequencies_match_filtered_softmax(qwen3, top_k, top_p, suppress):
  """Draws follow softmax over the ids left after suppression (default: the pad id; "top3": the
  three most likely ids), then top-k/top-p; log-probs stay those of the full softmax."""
  tokens, mask = _prompts(batch=1)
  temperature, n = 1.5, 4000
  logits, p = _first_token_probs(qwen3, tokens, mask, temperature)
  ids = (PAD,) if suppress is None else tuple(int(i) for i in np.argsort(-logits[0])[:3])
  kw = {} if suppress is None else {"suppress_ids": ids}
  r = _generate(
    qwen3, tokens, mask, num_samples=n, max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, **kw
  )
  assert r.completions.shape == (n, 1) and int(r.num_steps) == 1 and bool(r.mask.all())
  restricted = logits / temperature
  restricted[:, list(ids)] = -np.inf
  keep = np.isfinite(_np_filter(restricted, top_k, top_p))[0]
  assert 1 < keep.sum() < VOCAB - len(ids) if top_k else keep.sum() == VOCAB - len(ids)
  q = np.where(keep, p[0], 0.0)
  q /= q.sum()
  counts = np.bincount(np.asarray(r.completions[:, 0]), minlength=VOCAB)
  assert counts[~keep].sum() == 0, "sampled a filtered-out token"
  # Each frequency within 5 binomial standard deviations (plus a floor for tiny q).
  sd = np.sqrt(q * (1 - q) / n)
  assert np.all(np.abs(counts / n - q) <= 5 * sd + 2 / n)
  # Log-probs are under the unfiltered temperature-scaled softmax.
  np.testing.assert_allclose(
    np.asarray(r.log_probs[:, 0]), np.log(p[0])[np.asarray(r.completions[:, 0])], rtol=1e-5, atol=1e-5
  )


# ------------------------------------------------------------------------------------------------
# Argument errors


@pytest.mark.parametrize(
  "kw, error, match",
  [
    (dict(num_samples=0), ValueError, "num_samples"),
    (dict(num_samples=2.0), ValueError, "num_samples"),  # SamplingConfig: an int >= 1
    (dict(num_samples=True), ValueError, "num_samples"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    (dict(temperature=-0.1), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(temperature="1.0"), TypeError, "temperature"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_k=-1), ValueError, "top_k"),
    (dict(top_k=2.5), TypeError, "top_k"),
    (dict(eos_ids=(VOCAB,)), ValueError, "eos_ids"),
    (dict(eos_ids=("a",)), TypeError, "eos_ids"),
    (dict(eos_ids="a"), TypeError, "eos_ids"),
    (dict(pad_id=-1), ValueError, "pad_id"),
    (dict(suppress_ids=(VOCAB,)), ValueError, "suppress_ids"),
    (dict(suppress_ids=(1.0,)), TypeError, "suppress_ids"),
    (dict(suppress_ids=(3,), eos_ids=(3, 4)), ValueError, "suppress_ids"),
    (dict(suppress_ids=tuple(range(VOCAB))), ValueError, "whole vocabulary"),
    (dict(key=jnp.zeros((3,), jnp.uint32)), ValueError, "key"),
    (dict(key=jnp.zeros((2,), jnp.float32)), TypeError, "key"),
    (dict(key=jax.random.split(jax.random.key(0), 2)), ValueError, "key"),
    (dict(max_new_tokens=200), ValueError, "max_position_embeddings"),
  ],
)
def test_bad_arguments_raise_naming_them(qwen3, kw, error, match):
  tokens, mask = _prompts(batch=2)
  with pytest.raises(error, match=match):
    _generate(qwen3, tokens, mask, **kw)


def test_generate_takes_one_sampling_config(qwen3):
  """issue 34 item 5: ``generate(model, prompt_tokens, prompt_mask, sampling, *, key, temperature=1.0)``; a
  non-SamplingConfig is refused naming ``sampling``, the retired keyword form by Python, a None budget naming the
  field."""
  tokens, mask = _prompts(batch=2)
  key = jax.random.key(0)
  with pytest.raises(
    TypeError, match=r"^generate: `sampling` must be a jaxgrpo\.rollout\.sampling\.SamplingConfig .*got dict$"
  ):
    generate(qwen3, tokens, mask, {"num_samples": 2, "max_new_tokens": 4}, key=key)
  with pytest.raises(TypeError, match="unexpected keyword argument 'num_samples'"):  # the retired keyword form
    generate(qwen3, tokens, mask, num_samples=2, max_new_tokens=4, pad_id=PAD, key=key)
  with pytest.raises(ValueError, match=r"^generate: `SamplingConfig\.max_new_tokens` is None"):
    generate(qwen3, tokens, mask, SamplingConfig(num_samples=2), key=key)


@pytest.mark.parametrize(
  "tokens, mask, error, match",
  [
    (np.ones((4,), np.int32), np.ones((4,), bool), ValueError, "prompt_tokens"),
    (np.ones((2, 4), np.float32), np.ones((2, 4), bool), TypeError, "prompt_tokens"),
    (np.ones((2, 4), np.int32), np.ones((2, 3), bool), ValueError, "prompt_mask"),
    (np.ones((2, 4), np.int32), np.ones((2, 4), np.int32), TypeError, "prompt_mask"),
    (np.ones((2, 0), np.int32), np.ones((2, 0), bool), ValueError, "non-empty"),
    (np.ones((2, 4), np.int32), np.array([[1, 1, 1, 1], [1, 1, 1, 0]], bool), ValueError, "left-padded"),
    (np.ones((2, 4), np.int32), np.array([[1, 1, 1, 1], [0, 1, 0, 1]], bool), ValueError, "left-padded"),
  ],
)
def test_bad_prompts_raise_naming_them(qwen3, tokens, mask, error, match):
  with pytest.raises(error, match=match):
    _generate(qwen3, jnp.asarray(tokens), jnp.asarray(mask))


# ------------------------------------------------------------------------------------------------
# Suppressed ids (by default the pad id, unless it is also an EOS id)


def test_greedy_never_emits_the_pad_id_by_default(qwen3):
  """The pad id chosen as the id greedy decoding emits most: by default it is never a real token
  (greedy takes the best other id, as a full forward with that id removed says), its log-probs are
  still those of the full softmax; with ``suppress_ids=()`` it is emitted again; as an EOS id it is
  not suppressed."""
  tokens, mask = _prompts(batch=3)
  free = _generate(qwen3, tokens, mask, **GREEDY, suppress_ids=())
  counts = np.bincount(np.asarray(free.completions).ravel(), minlength=VOCAB)
  pad = int(counts.argmax())
  r = _generate(qwen3, tokens, mask, **{**GREEDY, "pad_id": pad})
  comp = np.asarray(r.completions)
  assert not (comp == pad).any() and bool(r.mask.all())
  full = np.concatenate([np.asarray(r.prompt_tokens), comp], axis=1)
  full_mask = np.concatenate([np.asarray(r.prompt_mask), np.ones(comp.shape, bool)], 1)
  logits = np.array(_jit_logits(*nnx.split(qwen3), jnp.asarray(full), jnp.asarray(full_mask)))
  P = tokens.shape[1]
  logits[..., pad] = -np.inf
  np.testing.assert_array_equal(comp, logits[:, P - 1 : -1].argmax(-1))
  want = _recomputed_log_probs(qwen3, r, 1.0)
  np.testing.assert_allclose(np.asarray(r.log_probs), want, rtol=1e-5, atol=1e-5)
  as_eos = _generate(qwen3, tokens, mask, **{**GREEDY, "pad_id": pad}, eos_ids=(pad,))
  np.testing.assert_array_equal(as_eos.completions[:, 0], free.completions[:, 0])


# ------------------------------------------------------------------------------------------------
# Composition under an outer jit, and the benchmark script


@pytest.mark.slow
def test_generate_under_outer_jit_equals_eager(qwen3):
  tokens, mask = _prompts(batch=3)
  eager = _generate(qwen3, tokens, mask, key=jax.random.key(3), **SAMPLED)
  jitted = jax.jit(lambda t, m, k: _generate(qwen3, t, m, key=k, **SAMPLED))(tokens, mask, jax.random.key(3))
  for name in Rollout._fields:  # weights become constants of the outer jit: log-prob rounding
    if getattr(eager, name) is None:  # routing: recorded for a mixture of experts only
      assert getattr(jitted, name) is None, name
      continue
    np.testing.assert_allclose(getattr(eager, name), getattr(jitted, name), rtol=1e-6)


@pytest.mark.slow
def test_bfloat16_model_gives_float32_log_probs_matching_recomputation():
  cfg = models.Qwen3Config(
    vocab_size=VOCAB,
    hidden_size=32,
    num_layers=1,  # one layer: the sampler's checks do not depend on depth (the HF parity runs 2 layers)
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    tie_word_embeddings=True,
    max_position_embeddings=128,
  )
  model = _scaled(models.build_model(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16), 5.0)
  tokens, mask = _prompts(batch=3)
  r = _generate(model, tokens, mask, eos_ids=(3, 5), **SAMPLED)
  assert r.log_probs.dtype == jnp.float32
  want = np.where(np.asarray(r.mask), _recomputed_log_probs(model, r, 1.0), 0.0)
  np.testing.assert_allclose(np.asarray(r.log_probs), want, atol=2e-2)


@pytest.mark.slow
def test_bench_sampler_smoke(capsys):
  path = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_sampler.py")
  spec = importlib.util.spec_from_file_location("bench_sampler", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  res = bench.main(
    [
      "--prompts",
      "2",
      "--samples",
      "2",
      "--new-tokens",
      "4",
      "--prompt-len",
      "4",
      "--repeats",
      "1",
      "--vocab",
      "256",
      "--hidden",
      "64",
      "--layers",
      "1",
      "--heads",
      "2",
      "--kv-heads",
      "1",
      "--head-dim",
      "32",
      "--intermediate",
      "128",
    ]
  )
  assert res["tokens"] == 16 and res["ours_tps"] > 0 and res["hf_tps"] > 0
  assert "ratio (ours / transformers)" in capsys.readouterr().out


def test_the_samplers_caches_hold_prompt_and_budget_less_the_last_token_plus_the_drafts():
  """``cache_slots``: P + T - 1 (+ k drafts); ``generate``'s program allocates exactly that many slots: its values
  ``[N, kv heads, P + T - 1, head_dim]``."""
  assert cache_slots(5, 8) == 12 and cache_slots(5, 8, 3) == 15 and cache_slots(1, 1) == 1
  cfg = models.Qwen3Config(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                           intermediate_size=32)  # fmt: skip
  prompts = jnp.ones((1, 5), jnp.int32)
  policy = SamplingPolicy.from_config(SamplingConfig(num_samples=2, max_new_tokens=8), temperature=1.0, vocab_size=32)
  text = sampling.lower_generate(models.build_model(cfg, rngs=nnx.Rngs(0)), prompts, prompts > 0, policy,
                                 key=jax.random.key(0)).as_text()  # fmt: skip
  # the values' layout [N, kv heads, slots, head_dim]: the cache's slots, and the S = 1 new token's of each step
  slots = {int(m) for m in re.findall(r"tensor<2x1x(\d+)x8xf32>", text)}
  assert max(slots) == cache_slots(5, 8), slots
