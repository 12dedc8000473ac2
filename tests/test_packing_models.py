"""Packed rows through the models: every sequence of a packed row gives the hidden states and log-probs
it gives alone, for all four families; remat policies change nothing; bad packed calls fail clearly.

The "alone" reference is the ordinary padded forward (``attention_mask``, one sequence per row, the
path the HF parity tests in test_models.py pin to transformers) and, for a few sequences, a forward of
the sequence by itself with no padding at all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_utils import FAMILIES, tiny_hf_config
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxgrpo import models
from jaxgrpo.step import packing

TOL = 1e-5
P, T, L, B = 6, 10, 16, 6  # every sequence fits a row (P + T = L): B rows always suffice


pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")  # tests/conftest.py


def randomized(model, seed=0):
  """Weights N(0, 0.2²), biases N(0, 0.1²), norm scales 1 + N(0, 0.1²): attention far from uniform and
  position-dependent, so a wrong mask or position would show (the default init is nearly uniform)."""
  graphdef, state = nnx.split(model)
  flat = nnx.to_flat_state(state)
  keys = jax.random.split(jax.random.key(seed), len(flat))
  for key, (path, var) in zip(keys, flat):
    name = "/".join(map(str, path))
    noise = jax.random.normal(key, var.shape, jnp.float32)
    if "norm" in name or "ln_" in name:
      value = (1.0 + 0.1 * noise) if name.endswith("scale") else 0.1 * noise
    elif name.endswith("bias"):
      value = 0.1 * noise
    else:
      value = 0.2 * noise
    var.set_value(value.astype(var.dtype))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


_MODELS = {}


def tiny(family, remat=False):
  if (family, remat) not in _MODELS:
    cfg = models.config_from_hf(tiny_hf_config(family))
    _MODELS[family, remat] = randomized(models.build_model(cfg, rngs=nnx.Rngs(0), remat=remat))
  return _MODELS[family, remat]


def shift_log_probs(model, hidden, tokens):
  """``out[:, c] = log p(tokens[:, c] | hidden[:, c - 1])``, 0 in column 0 (target-aligned)."""
  lp = models.token_log_probs(model, hidden[:, :-1], tokens[:, 1:], chunk_size=None)
  return jnp.concatenate([jnp.zeros_like(lp[:, :1]), lp], axis=1)


@jax.jit
def packed_forward(model, tokens, positions, segment_ids):
  hidden, _ = model(tokens, positions, segment_ids=segment_ids)
  return hidden, shift_log_probs(model, hidden, tokens)


@jax.jit
def plain_forward(model, tokens, positions):
  return model(tokens, positions)[0]


@jax.jit
def padded_forward(model, tokens, mask):
  hidden, _ = model(tokens, models.positions_from_mask(mask), attention_mask=mask)
  return hidden, shift_log_probs(model, hidden, tokens)


def make_rollout(prompt_lens, completion_lens, vocab, seed):
  rng = np.random.default_rng(seed)
  plen, clen = np.asarray(prompt_lens), np.asarray(completion_lens)
  pm = np.arange(P)[None] >= P - plen[:, None]
  cm = np.arange(T)[None] < clen[:, None]
  pt = np.where(pm, rng.integers(1, vocab, (len(plen), P)), 0).astype(np.int32)
  ct = np.where(cm, rng.integers(1, vocab, (len(plen), T)), 0).astype(np.int32)
  return pt, pm, ct, cm


def check_packed_equals_alone(family, prompt_lens, completion_lens, seed=0):
  model = tiny(family)
  pt, pm, ct, cm = make_rollout(prompt_lens, completion_lens, model.config.vocab_size, seed)
  pk = packing.pack(pt, pm, ct, cm, row_length=L, num_rows=B)
  np.testing.assert_array_equal(np.asarray(models.positions_from_segments(jnp.asarray(pk.segment_ids))), pk.positions)
  h_pk, lp_pk = packed_forward(model, pk.tokens, pk.positions, pk.segment_ids)
  h_pk, lp_pk = np.asarray(h_pk), np.asarray(lp_pk)
  # the unpacked batch: [prompt ‖ completion], left-padded prompts, right-padded completions
  tokens, mask = np.concatenate([pt, ct], 1), np.concatenate([pm, cm], 1)
  h_ref, lp_ref = (np.asarray(x) for x in padded_forward(model, tokens, mask))
  for b in np.flatnonzero(cm.sum(1)):
    r, o, n = pk.row[b], pk.offset[b], prompt_lens[b] + completion_lens[b]
    cols = P - prompt_lens[b] + np.arange(n)  # the sequence's real columns in the unpacked row
    err = np.abs(h_pk[r, o : o + n] - h_ref[b, cols]).max()
    assert err <= TOL, f"{family}: sequence {b} hidden differs by {err}"
    assert np.abs(h_ref[b, cols]).max() > 0.1  # not a degenerate model
  lp_unpacked = np.asarray(packing.unpack(lp_pk, pk.unpack_index))  # [B, T]
  lp_expect = np.where(cm, lp_ref[:, P:], 0)
  np.testing.assert_allclose(lp_unpacked, lp_expect, rtol=0, atol=TOL, err_msg=family)
  if cm.sum() >= 4:  # log-probs far from uniform: a wrong mask or position would show
    assert np.abs(lp_expect).max() > 0.5 and np.ptp(lp_expect[cm]) > 0.5


@st.composite
def segment_lengths(draw):
  """B sequences: prompt lengths in [1, P], completion lengths in [0, T] (0: left out by the packer)."""
  plen = draw(st.lists(st.integers(1, P), min_size=B, max_size=B))
  clen = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
  return plen, clen


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=12, deadline=None)
@given(lengths=segment_lengths(), seed=st.integers(0, 2**16))
@example(lengths=([6, 6, 6, 6, 6, 6], [10, 10, 10, 10, 10, 10]), seed=0)  # every segment fills a row exactly
@example(lengths=([1, 2, 3, 1, 6, 4], [1, 3, 2, 5, 10, 0]), seed=1)  # one full row, one empty completion
@example(lengths=([6, 1, 1, 1, 1, 1], [10, 1, 1, 1, 1, 1]), seed=2)  # a single-segment row + a row of five
def test_packed_rows_equal_each_sequence_alone(family, lengths, seed):
  check_packed_equals_alone(family, *lengths, seed=seed)


@pytest.mark.parametrize("family", ["gpt2", "qwen3"])  # learned positions; RoPE + GQA + qk-norm
def test_packed_row_equals_unpadded_single_sequences(family):
  """Each sequence by itself: batch 1, exactly its own length, no mask at all."""
  model = tiny(family)
  plen, clen = [2, 3, 1], [5, 4, 9]  # 10 tokens in row 0, 7 + 7 = 14 in row 1
  pt, pm, ct, cm = make_rollout(plen, clen, model.config.vocab_size, 7)
  pk = packing.pack(pt, pm, ct, cm, row_length=L, num_rows=B)  # B rows: the program of the test above
  h_pk, _ = packed_forward(model, pk.tokens, pk.positions, pk.segment_ids)
  assert pk.row.tolist() == [1, 1, 0] and pk.segment_ids[1].max() == 2  # two sequences share row 1
  assert not pk.segment_ids[2:].any()
  for b in range(3):
    seq = np.concatenate([pt[b, P - plen[b] :], ct[b, : clen[b]]])[None]
    alone = plain_forward(model, jnp.asarray(seq), jnp.arange(seq.shape[1])[None])
    r, o = pk.row[b], pk.offset[b]
    err = np.abs(np.asarray(h_pk)[r, o : o + seq.shape[1]] - np.asarray(alone)[0]).max()
    assert err <= TOL, (family, b, err)


def test_mask_as_segment_ids_is_the_attention_mask_path():
  """One segment per row (``segment_ids = mask``) is exactly the padded forward on real tokens."""
  model = tiny("llama")
  pt, pm, ct, cm = make_rollout([2, 6, 4], [10, 3, 0], model.config.vocab_size, 3)
  tokens, mask = np.concatenate([pt, ct], 1), np.concatenate([pm, cm], 1)
  pos = models.positions_from_mask(jnp.asarray(mask))
  a, _ = model(jnp.asarray(tokens), pos, attention_mask=jnp.asarray(mask))
  b, _ = model(jnp.asarray(tokens), pos, segment_ids=jnp.asarray(mask, jnp.int32))
  np.testing.assert_array_equal(np.asarray(a)[mask], np.asarray(b)[mask])


def test_positions_from_segments():
  seg = np.array(
    [[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0], [2, 2, 1, 1, 1, 0, 3, 3]]
  )
  expect = np.array(
    [[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7], [0] * 8, [0, 1, 0, 1, 2, 0, 0, 1]],
  )
  np.testing.assert_array_equal(np.asarray(models.positions_from_segments(jnp.asarray(seg))), expect)
  with pytest.raises(ValueError, match="segment_ids must be"):
    models.positions_from_segments(jnp.zeros(4, jnp.int32))


# ----------------------------------------------------------------------------- remat policies


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_every_remat_policy_gives_the_same_values_and_gradients(family):
  pt, pm, ct, cm = make_rollout([2, 6, 4, 1, 3, 5], [10, 3, 7, 9, 1, 8], 128, 5)
  pk = packing.pack(pt, pm, ct, cm, row_length=L, num_rows=6)  # FFD: 12+4, 13, 11, 10, 9 (one spare row)
  w = jnp.asarray(np.random.default_rng(0).standard_normal(pk.tokens.shape), jnp.float32)

  def loss(state, graphdef):
    model = nnx.merge(graphdef, state)
    hidden, _ = model(jnp.asarray(pk.tokens), jnp.asarray(pk.positions), segment_ids=jnp.asarray(pk.segment_ids))
    lp = shift_log_probs(model, hidden, jnp.asarray(pk.tokens))
    return jnp.sum(jnp.where(pk.completion_mask, lp * w, 0.0)), lp

  results = {}
  for policy in models.RematPolicy:
    model = tiny(family, remat=policy.value)
    assert model.remat is policy
    graphdef, state = nnx.split(model)
    grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (value, lp), grads = grad_fn(state, graphdef)
    results[policy] = (np.asarray(lp), {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(grads)})
  lp0, g0 = results[models.RematPolicy.NONE]
  scale = max(np.abs(g).max() for g in g0.values())  # ~4 here: recomputation reorders float32 sums
  assert scale > 1e-3
  for policy, (lp, g) in results.items():
    np.testing.assert_allclose(lp, lp0, rtol=0, atol=1e-6, err_msg=str(policy))
    for k in g0:  # 1e-6 relative to the largest gradient entry (a few float32 ulps)
      np.testing.assert_allclose(g[k], g0[k], rtol=0, atol=1e-6 * scale, err_msg=f"{policy} {k}")


def test_remat_aliases_and_bad_values():
  cfg = models.config_from_hf(tiny_hf_config("gpt2"))
  build = lambda remat: nnx.eval_shape(lambda: models.build_model(cfg, rngs=nnx.Rngs(0), remat=remat))
  assert build(True).remat is models.RematPolicy.FULL
  assert build(False).remat is models.RematPolicy.NONE
  assert build("dots_no_batch").remat is models.RematPolicy.DOTS_NO_BATCH
  assert build(models.RematPolicy.DOTS).remat is models.RematPolicy.DOTS
  with pytest.raises(ValueError, match=r"remat must be one of \['none', 'full', 'dots', 'dots_no_batch'\]"):
    build("everything")
  with pytest.raises(TypeError, match="remat must be"):
    build(1)
  with pytest.raises(ValueError, match="remat must be one of"):
    models.load_hf("/nonexistent/never/read", remat="some")


def test_bad_packed_calls_raise_naming_the_argument():
  cfg = models.config_from_hf(tiny_hf_config("qwen2"))
  graphdef, state = nnx.split(nnx.eval_shape(lambda: models.build_model(cfg, rngs=nnx.Rngs(0))))
  tok = np.zeros((2, 4), np.int32)

  def call(fn):
    return jax.eval_shape(lambda st: fn(nnx.merge(graphdef, st)), state)

  with pytest.raises(ValueError, match="attention_mask or segment_ids, not both"):
    call(lambda m: m(tok, tok, attention_mask=np.ones((2, 4), bool), segment_ids=tok))
  with pytest.raises(ValueError, match="without a cache only"):
    call(lambda m: m(tok, tok, segment_ids=tok, cache=m.init_cache(2, 8)))
  with pytest.raises(ValueError, match=r"segment_ids shape \(2, 3\)"):
    call(lambda m: m(tok, tok, segment_ids=tok[:, :3]))
  with pytest.raises(TypeError, match="segment_ids must be an integer array"):
    call(lambda m: m(tok, tok, segment_ids=np.ones((2, 4), bool)))


@pytest.mark.slow
def test_bench_packing_smoke(capsys):
  """The benchmark runs the train step at tiny size, and its two layouts give the same loss and gradient."""
  import importlib.util
  import os

  path = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_packing.py")
  spec = importlib.util.spec_from_file_location("bench_packing", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  res = bench.main(["--tiny", "--policies", "none,dots_no_batch"])
  assert abs(res["losses"]["packed"] - res["losses"]["padded"]) <= 1e-6 * max(1.0, abs(res["losses"]["padded"]))
  norms = res["grad_norms"]
  assert abs(norms["packed"] - norms["padded"]) <= 1e-5 * norms["padded"], res
  assert set(res["policies"]) == {"none", "dots_no_batch"}
  assert "packed / padded train-step throughput" in capsys.readouterr().out
