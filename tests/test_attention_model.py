"""The model's attention choice (``build_model(attention=...)``, ``model.attention`` of a run spec,
``jaxgrpo.models.attention.set_attention``; docs/models.md "Attention implementations"): ``blockwise`` gives the
log-probs and gradients of ``dense`` on every real token — ragged left-padded rows, packed rows, grouped and plain
heads, the sampler's prefill into its KV cache — while its gradient program holds no ``[S, S]`` scores; ``auto``
is dense on short rows; a platform's kernel asked on another platform, or an unknown name, is refused in one line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgrpo.models import GPT2Config, Qwen3Config, build_model, positions_from_segments, set_attention
from jaxgrpo.models.attention import AUTO_MIN_LENGTH, IMPLEMENTATIONS, resolve_implementation
from jaxgrpo.models.log_probs import log_probs, token_log_probs
from jaxgrpo.rollout.sampling import SamplingConfig, generate
from jaxgrpo.step.packing import pack

V = 64
CONFIGS = {
  "qwen3-gqa": Qwen3Config(
    vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64
  ),
  "gpt2-mha": GPT2Config(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=128),
}


def _pair(cfg):
  """The same weights (same seed) with dense and with blockwise attention."""
  return [build_model(cfg, rngs=nnx.Rngs(0), attention=a) for a in ("dense", "blockwise")]


def _ragged(batch: int, length: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, V, size=(batch, length))
  real = rng.integers(2, length + 1, size=batch)
  real[0] = length  # one full row
  mask = np.arange(length)[None, :] >= (length - real)[:, None]  # left-padded
  return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask)


def _value_and_grad(model, fn):
  """``fn``'s value and gradient in one jitted program (eager, every op would compile on its own first call)."""
  graphdef, params = nnx.split(model)
  return jax.jit(jax.value_and_grad(lambda p: fn(nnx.merge(graphdef, p)), has_aux=True))(params)


def _assert_close_tree(a, b, atol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=atol)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_blockwise_log_probs_and_gradients_equal_dense_on_ragged_left_padded_rows(name):
  tokens, mask = _ragged(3, 40)
  weights = jnp.asarray(np.random.default_rng(1).normal(size=tokens.shape), jnp.float32)

  def loss(model):
    lp = log_probs(model, tokens, mask)  # 0 where the token or the one before it is padding
    return jnp.sum(lp * weights), lp

  (l_dense, lp_dense), g_dense = _value_and_grad(_pair(CONFIGS[name])[0], loss)
  (l_block, lp_block), g_block = _value_and_grad(_pair(CONFIGS[name])[1], loss)
  np.testing.assert_allclose(np.asarray(lp_block), np.asarray(lp_dense), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(float(l_block), float(l_dense), rtol=1e-5)
  _assert_close_tree(g_block, g_dense, atol=1e-5)


def test_blockwise_equals_dense_on_packed_rows_with_their_segment_ids():
  rng = np.random.default_rng(2)
  B, P, T = 5, 6, 9
  prompt_mask = np.arange(P)[None] >= rng.integers(0, P - 1, size=B)[:, None]
  completion_mask = np.arange(T)[None] < rng.integers(1, T + 1, size=B)[:, None]
  packed = pack(rng.integers(1, V, (B, P)), prompt_mask, rng.integers(1, V, (B, T)), completion_mask, row_length=32)
  assert (packed.segment_ids.max(axis=1) >= 2).any()  # at least one row holds two sequences
  tokens, seg = jnp.asarray(packed.tokens, jnp.int32), jnp.asarray(packed.segment_ids, jnp.int32)
  positions = positions_from_segments(seg)
  same_next = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)  # the next token is of the same sequence

  def loss(model):
    hidden, _ = model(tokens, positions, segment_ids=seg)
    lp = jnp.where(same_next, token_log_probs(model, hidden[:, :-1], tokens[:, 1:]), 0.0)
    return jnp.sum(lp), lp

  dense, block = _pair(CONFIGS["qwen3-gqa"])
  (_, lp_dense), g_dense = _value_and_grad(dense, loss)
  (_, lp_block), g_block = _value_and_grad(block, loss)
  np.testing.assert_allclose(np.asarray(lp_block), np.asarray(lp_dense), rtol=1e-5, atol=1e-5)
  _assert_close_tree(g_block, g_dense, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_generate_with_a_blockwise_prefill_gives_the_tokens_and_log_probs_of_dense(name):
  tokens, mask = _ragged(2, 12, seed=3)
  sampling = SamplingConfig(num_samples=2, max_new_tokens=6, pad_id=0)
  outs = [generate(m, tokens, mask, sampling, key=jax.random.key(7)) for m in _pair(CONFIGS[name])]
  np.testing.assert_array_equal(np.asarray(outs[1].completions), np.asarray(outs[0].completions))
  np.testing.assert_allclose(np.asarray(outs[1].log_probs), np.asarray(outs[0].log_probs), rtol=1e-5, atol=1e-5)


def test_blockwise_gradient_holds_no_square_scores():
  """The compiled gradient's temporaries at 2048 tokens: dense holds the float32 scores (4 heads × 2048² × 4 B =
  64 MiB a layer, at least once), blockwise a small fraction of that."""
  S = 2048
  cfg = Qwen3Config(
    vocab_size=V, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=4, head_dim=8, intermediate_size=64,
    max_position_embeddings=S,
  )  # fmt: skip
  tokens = jnp.ones((1, S), jnp.int32)

  def temp_bytes(model):
    graphdef, params = nnx.split(model)
    grad = jax.jit(jax.grad(lambda p: jnp.sum(log_probs(nnx.merge(graphdef, p), tokens))))
    return grad.lower(params).compile().memory_analysis().temp_size_in_bytes

  dense, block = (temp_bytes(m) for m in _pair(cfg))
  scores = 4 * S * S * 4
  assert dense >= scores, (dense, scores)
  assert block < scores / 8, (block, scores)


def test_auto_is_dense_on_short_rows_and_the_platform_kernel_on_long_ones():
  short, long = AUTO_MIN_LENGTH - 1, AUTO_MIN_LENGTH
  assert [resolve_implementation("auto", short, p) for p in ("cpu", "gpu", "tpu")] == ["dense"] * 3
  assert [resolve_implementation("auto", long, p) for p in ("cpu", "gpu", "tpu")] == ["blockwise", "cudnn", "splash"]
  assert resolve_implementation("blockwise", 8, "cpu") == "blockwise"
  assert resolve_implementation("dense", 10**6, "tpu") == "dense"
  tokens, mask = _ragged(2, 16)
  auto, dense = (build_model(CONFIGS["qwen3-gqa"], rngs=nnx.Rngs(0), attention=a) for a in ("auto", "dense"))
  text = [jax.jit(lambda m: log_probs(m, tokens, mask)).lower(m).as_text() for m in (auto, dense)]
  assert text[0] == text[1]  # the same program: the pinned CPU hashes (tests/test_target_platform.py) hold


def test_a_platform_kernel_on_another_platform_and_an_unknown_name_are_refused_in_one_line():
  from jaxgrpo.run.spec_schema import ModelSpec
  from jaxgrpo.run.task_specs import SyntheticModel

  with pytest.raises(ValueError, match=r"^model attention='splash' is a TPU kernel but the program targets 'cpu'"):
    resolve_implementation("splash", 4096, "cpu")
  with pytest.raises(ValueError, match=r"attention='cudnn' is a GPU kernel but the program targets 'tpu'"):
    resolve_implementation("cudnn", 4096, "tpu")
  model = set_attention(build_model(CONFIGS["qwen3-gqa"], rngs=nnx.Rngs(0)), "splash")
  with pytest.raises(ValueError, match="TPU kernel") as e:
    log_probs(model, *_ragged(1, 8))
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match=r"`attention` must be one of 'auto', 'dense', 'blockwise'"):
    build_model(CONFIGS["qwen3-gqa"], rngs=nnx.Rngs(0), attention="flash")
  with pytest.raises(ValueError, match=r"^`model.attention` must be one of auto, dense, blockwise, splash, cudnn"):
    ModelSpec(synthetic=SyntheticModel(), attention="flash")
  assert IMPLEMENTATIONS == ("auto", "dense", "blockwise", "splash", "cudnn")


def test_forward_mode_autodiff_runs_through_a_blockwise_model():
  """A custom VJP has no forward mode: under ``forward_mode=True`` the model takes the dense path."""
  tokens, mask = _ragged(2, 12)
  dense, block = _pair(CONFIGS["qwen3-gqa"])
  graphdef, params = nnx.split(block)
  tangent = jax.tree.map(jnp.ones_like, params)
  f = lambda p: log_probs(nnx.merge(graphdef, p), tokens, mask, forward_mode=True)
  _, jvp_block = jax.jit(lambda p, t: jax.jvp(f, (p,), (t,)))(params, tangent)
  graphdef_d, params_d = nnx.split(dense)
  f_dense = lambda p: log_probs(nnx.merge(graphdef_d, p), tokens, mask, forward_mode=True)
  _, jvp_dense = jax.jit(lambda p, t: jax.jvp(f_dense, (p,), (t,)))(params_d, tangent)
  np.testing.assert_allclose(np.asarray(jvp_block), np.asarray(jvp_dense), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("per_row", [False, True])
def test_a_second_prefill_into_a_filled_cache_attends_from_the_cache_index(per_row):
  """Two chunks into one cache (the conversation sampler's turns): the second chunk's queries start at slot
  ``cache.index`` (a shared index, or one per row with right-padded chunks) and see the first chunk's keys."""
  rng = np.random.default_rng(4)
  B, S1, S2 = 2, 7, 10  # S2 · G > 8: the prefill path, not the decode one
  first, second = (jnp.asarray(rng.integers(1, V, (B, s)), jnp.int32) for s in (S1, S2))
  m1 = jnp.ones((B, S1), bool)
  m2 = jnp.asarray(np.arange(S2)[None] < np.array([[S2], [S2 - 3]]), bool) if per_row else jnp.ones((B, S2), bool)
  outs = []

  @jax.jit  # one program per model (eager, every op would compile on its own first call)
  def two_chunks(model):
    cache = model.init_cache(B, 24, per_row=per_row)
    _, cache = model(first, jnp.broadcast_to(jnp.arange(S1), (B, S1)), attention_mask=m1, cache=cache)
    hidden, _ = model(second, S1 + jnp.broadcast_to(jnp.arange(S2), (B, S2)), attention_mask=m2, cache=cache)
    return jnp.where(m2[..., None], hidden, 0)

  for model in _pair(CONFIGS["qwen3-gqa"]):
    outs.append(np.asarray(two_chunks(model)))
  np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_blockwise_model_loaded_from_transformers_gives_its_logits_and_greedy_tokens(tmp_path, family):
  """Against transformers' PyTorch model (the independent reference): logits on the real tokens of left-padded rows
  and greedy ``generate`` (its prefill blockwise into the KV cache)."""
  pytest.importorskip("torch")
  from hf_utils import (
    assert_greedy_matches_hf,
    build_hf_model,
    hf_logits,
    jax_logits,
    left_padded_batch,
    tiny_hf_config,
  )

  from jaxgrpo.models import load_hf

  hf_model = build_hf_model(tiny_hf_config(family), seed=1)
  hf_model.save_pretrained(str(tmp_path))
  model = load_hf(tmp_path, attention="blockwise")
  tokens, mask = left_padded_batch(np.random.default_rng(0), 3, 24, 128, pads=[0, 5, 11])
  err = np.abs(jax_logits(model, tokens, mask) - hf_logits(hf_model, tokens, mask))[mask].max()
  assert err < 1e-4, err
  assert_greedy_matches_hf(hf_model, model, new=5, pad=0)


@pytest.mark.parametrize("layout", [dict(scan_layers=True), dict(remat="full")], ids=["scan_layers", "remat"])
def test_blockwise_under_a_scanned_stack_or_remat_equals_dense(layout):
  tokens, mask = _ragged(2, 20, seed=5)
  grads = []
  for attention in ("dense", "blockwise"):
    model = build_model(CONFIGS["qwen3-gqa"], rngs=nnx.Rngs(0), attention=attention, **layout)
    grads.append(_value_and_grad(model, lambda m: (jnp.sum(log_probs(m, tokens, mask)), None)))
  np.testing.assert_allclose(float(grads[1][0][0]), float(grads[0][0][0]), rtol=1e-5)
  _assert_close_tree(grads[1][1], grads[0][1], atol=1e-5)
