"""Full-size configs: parameter counts via jax.eval_shape equal transformers' (meta device)."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from flax import nnx

from jaxgrpo import models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Transcribed from the public config.json files of the named checkpoints.
FULL_CONFIGS = {
  "Qwen2.5-1.5B": dict(
    model_type="qwen2",
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
    use_sliding_window=False,
    bos_token_id=151643,
    eos_token_id=151643,
  ),
  "Llama-3.2-1B": dict(
    model_type="llama",
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    bos_token_id=128000,
    eos_token_id=128001,
    rope_scaling=dict(
      factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0, original_max_position_embeddings=8192, rope_type="llama3"
    ),
  ),
  "Qwen3-1.7B": dict(
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
    bos_token_id=151643,
    eos_token_id=151645,
  ),
  "Qwen3-4B": dict(
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
    bos_token_id=151643,
    eos_token_id=151645,
  ),
  "gpt2": dict(
    model_type="gpt2",
    vocab_size=50257,
    n_embd=768,
    n_layer=12,
    n_head=12,
    n_positions=1024,
    activation_function="gelu_new",
    layer_norm_epsilon=1e-5,
    bos_token_id=50256,
    eos_token_id=50256,
  ),
}

# Published sizes (rounded), a sanity check on the transcription.
APPROX_BILLIONS = {"Qwen2.5-1.5B": 1.54, "Llama-3.2-1B": 1.24, "Qwen3-1.7B": 1.72, "Qwen3-4B": 4.02, "gpt2": 0.124}


def _hf_count(config: dict) -> int:
  cfg = transformers.AutoConfig.for_model(**config)
  with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(cfg)
  return sum(p.numel() for p in model.parameters())  # shared (tied) tensors counted once


def _our_count(config: dict) -> int:
  cfg = models.config_from_hf(config)
  abstract = nnx.eval_shape(lambda: models.build_model(cfg, rngs=nnx.Rngs(0)))
  return sum(math.prod(v.shape) for _, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize("name", list(FULL_CONFIGS))
def test_full_size_param_count_matches_transformers(name):
  ours = _our_count(FULL_CONFIGS[name])
  assert ours == _hf_count(FULL_CONFIGS[name])
  assert abs(ours / 1e9 - APPROX_BILLIONS[name]) / APPROX_BILLIONS[name] < 0.02, ours


@pytest.mark.parametrize("name", list(FULL_CONFIGS))
def test_full_size_config_round_trips_through_hf_dict(name):
  cfg = models.config_from_hf(FULL_CONFIGS[name])
  assert models.config_from_hf(cfg.to_hf()) == cfg
  hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
  assert hf_cfg.vocab_size == cfg.vocab_size


def test_llama3_rope_frequencies_match_transformers():
  """Independent reference: transformers' own llama3 rope initialisation."""
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  config = FULL_CONFIGS["Llama-3.2-1B"]
  hf_cfg = transformers.AutoConfig.for_model(**config)
  inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
  ours = models.config_from_hf(config).rope_inv_freq()
  np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6)


def test_config_validation_errors():
  with pytest.raises(ValueError, match="num_heads"):
    models.LlamaConfig(
      vocab_size=8, hidden_size=8, num_layers=1, num_heads=3, num_kv_heads=2, head_dim=4, intermediate_size=8
    )
  with pytest.raises(ValueError, match="vocab_size"):
    models.GPT2Config(vocab_size=0, hidden_size=8, num_layers=1, num_heads=2)
  with pytest.raises(ValueError, match="rope_type='yarn'"):
    models.config_from_hf({**FULL_CONFIGS["Qwen3-4B"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
  with pytest.raises(TypeError, match="cfg"):
    models.build_model({"model_type": "gpt2"}, rngs=nnx.Rngs(0))


def test_bad_call_arguments_raise_naming_them():
  cfg = models.GPT2Config(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, max_position_embeddings=8)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: models.build_model(cfg, rngs=nnx.Rngs(0))))

  def call(fn):
    return jax.eval_shape(lambda st: fn(nnx.merge(graphdef, st)), state)

  with pytest.raises(ValueError, match="tokens"):
    call(lambda m: m(np.zeros(4, np.int32), np.zeros(4, np.int32)))
  with pytest.raises(TypeError, match="tokens"):
    call(lambda m: m(np.zeros((2, 4), np.float32), np.zeros((2, 4), np.int32)))
  with pytest.raises(ValueError, match="positions"):
    call(lambda m: m(np.zeros((2, 4), np.int32), np.zeros((2, 3), np.int32)))
  with pytest.raises(ValueError, match="attention_mask"):
    call(lambda m: m(np.zeros((2, 4), np.int32), np.zeros((2, 4), np.int32), attention_mask=np.ones((2, 3), bool)))
  with pytest.raises(ValueError, match="cache batch"):
    call(lambda m: m(np.zeros((2, 4), np.int32), np.zeros((2, 4), np.int32), cache=m.init_cache(3, 8)))
  with pytest.raises(ValueError, match="do not fit"):
    call(lambda m: m(np.zeros((2, 4), np.int32), np.zeros((2, 4), np.int32), cache=m.init_cache(2, 3)))
  with pytest.raises(ValueError, match="chunk_size"):
    call(lambda m: models.log_probs(m, np.zeros((2, 4), np.int32), chunk_size=0))
  with pytest.raises(ValueError, match="temperature"):
    call(lambda m: models.log_probs(m, np.zeros((2, 4), np.int32), temperature=0.0))
  with pytest.raises(ValueError, match="max_len"):
    call(lambda m: m.init_cache(2, 0))
  with pytest.raises(ValueError, match="n must"):
    models.repeat_cache(models.KVCache(k=(), v=(), valid=np.ones((1, 2), bool), index=np.int32(0)), 0)


def test_dense_matches_numpy_and_names_the_mismatch():
  """``dense`` flattens token dims into one 2-D matmul; compare with a float64 NumPy tensordot."""
  import jax.numpy as jnp

  from jaxgrpo.models.layers import dense

  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 3, 4, 5)).astype(np.float32)
  w = rng.normal(size=(4, 5, 6)).astype(np.float32)  # contract the last two dims of x
  want = np.tensordot(x.astype(np.float64), w.astype(np.float64), axes=2)
  np.testing.assert_allclose(np.asarray(dense(jnp.asarray(x), jnp.asarray(w), contract=2)), want, rtol=1e-5, atol=1e-5)
  wt = rng.normal(size=(7, 5)).astype(np.float32)  # [O, C]: the tied-embedding head
  want_t = np.einsum("abcd,od->abco", x.astype(np.float64), wt.astype(np.float64))
  got_t = dense(jnp.asarray(x), jnp.asarray(wt), transpose_w=True)
  np.testing.assert_allclose(np.asarray(got_t), want_t, rtol=1e-5, atol=1e-5)
  got_bf16 = dense(
    jnp.asarray(x, jnp.bfloat16), jnp.asarray(wt, jnp.bfloat16), transpose_w=True, preferred_element_type=jnp.float32
  )
  assert got_bf16.dtype == jnp.float32 and got_bf16.shape == (2, 3, 4, 7)
  with pytest.raises(ValueError, match=r"dense: x's last 1 dims \(5,\) do not match w's contracted dims \(4,\)"):
    dense(jnp.asarray(x), jnp.asarray(w))
  with pytest.raises(
    ValueError, match=r"dense: contract must be an int in \[1, min\(x.ndim, w.ndim\)\] = \[1, 3\]; got 4"
  ):
    dense(jnp.asarray(x), jnp.asarray(w), contract=4)


def test_bench_projections_smoke_and_decode_attention_agrees(capsys):
  """The benchmark's two decode attentions (batched einsum vs multiply-and-reduce) agree."""
  import importlib.util
  import os

  path = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_projections.py")
  spec = importlib.util.spec_from_file_location("bench_projections", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  res = bench.main(
    [
      "--rows",
      "2",
      "--tokens",
      "8",
      "--hidden",
      "16",
      "--intermediate",
      "32",
      "--decode-rows",
      "4",
      "--slots",
      "8",
      "--repeats",
      "1",
    ]
  )
  assert res["decode_err"] < 1e-5 and min(res["mlp"]) > 0
  assert "baseline / jaxgrpo" in capsys.readouterr().out
