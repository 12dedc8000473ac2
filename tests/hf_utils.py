"""Tiny random Hugging Face models for tests (transformers + CPU torch; no downloads).

``tiny_hf_config(family, tied=...)`` gives a config dict; ``make_tiny_hf(tmp_path, family, ...)``
builds the torch model with random weights (biases and norm scales randomised too, so that a
wrong mapping cannot hide behind zeros/ones), saves it with ``save_pretrained`` and returns
``(directory, torch_model)``. ``hf_logits(model, tokens, mask)`` runs it on a left-padded batch
with HF-consistent position ids.
"""

from __future__ import annotations

import numpy as np
import pytest

FAMILIES = ("gpt2", "llama", "qwen2", "qwen3")


def tiny_hf_config(family: str, *, tied: bool = False, vocab_size: int = 128) -> dict:
  """A 2-layer, width-32 (or 64) config dict of ``family`` (``model_type`` set)."""
  if family == "gpt2":
    return dict(
      model_type="gpt2",
      vocab_size=vocab_size,
      n_embd=32,
      n_layer=2,
      n_head=4,
      n_positions=64,
      tie_word_embeddings=tied,
      resid_pdrop=0.0,
      embd_pdrop=0.0,
      attn_pdrop=0.0,
      bos_token_id=0,
      eos_token_id=0,
    )
  common = dict(
    vocab_size=vocab_size,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=tied,
    rms_norm_eps=1e-6,
  )
  if family == "llama":
    return dict(
      model_type="llama",
      **common,
      rope_theta=500000.0,
      rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
      ),
    )
  if family == "qwen2":
    return dict(model_type="qwen2", **common, rope_theta=1000000.0)
  if family == "qwen3":
    return dict(model_type="qwen3", **common, head_dim=16, rope_theta=1000000.0)  # head_dim != D/H
  raise ValueError(f"unknown family {family!r}")


MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")


def tiny_moe_config(family: str, *, tied: bool = False, vocab_size: int = 128, **overrides) -> dict:
  """A 3-layer, width-32 mixture-of-experts config dict: Qwen3-MoE (8 experts, top-2, renormalised,
  layer 1 dense via ``mlp_only_layers``) or Qwen2-MoE (4 experts, top-2, shared expert of width 40)."""
  common = dict(
    vocab_size=vocab_size,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=tied,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    moe_intermediate_size=24,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
  )
  if family == "qwen3_moe":
    cfg = dict(model_type="qwen3_moe", **common, head_dim=16, num_experts=8, norm_topk_prob=True, mlp_only_layers=[1])
  elif family == "qwen2_moe":
    cfg = dict(
      model_type="qwen2_moe", **common, num_experts=4, norm_topk_prob=False, shared_expert_intermediate_size=40
    )
  else:
    raise ValueError(f"unknown MoE family {family!r}")
  return {**cfg, **overrides}


def sharp_moe_model(config: dict, seed: int = 0, dtype=None):
  """``build_model`` of the MoE config dict with O(1) router logits (routers x50, experts x5): routing far from
  uniform, so top-k choices have clear margins over float32 noise."""
  import jax.numpy as jnp
  from flax import nnx

  from jaxgrpo import models

  model = models.build_model(models.config_from_hf(config), rngs=nnx.Rngs(seed), dtype=dtype or jnp.float32)
  for path, var in nnx.to_flat_state(nnx.state(model)):
    if path[-1] == "router":
      var.set_value(var.get_value() * 50)
    elif path[-1] in ("gate", "up", "down", "shared_gate"):
      var.set_value(var.get_value() * 5)
  return model


def build_hf_model(config: dict, seed: int = 0):
  """The transformers CausalLM of ``config`` (float32, eval mode) with every weight randomised."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  cfg = transformers.AutoConfig.for_model(**config)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("bias") or "norm" in name or "ln_" in name:
        p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
      else:
        p.copy_(torch.randn_like(p) * 0.05)
  return model


def make_tiny_hf(directory, family: str, *, tied: bool = False, seed: int = 0):
  """Build, randomise and ``save_pretrained`` a tiny model into ``directory``; returns (dir, model)."""
  model = build_hf_model(tiny_hf_config(family, tied=tied), seed=seed)
  model.save_pretrained(str(directory))
  return str(directory), model


def left_padded_batch(rng: np.random.Generator, batch: int, length: int, vocab: int, pads=None):
  """tokens int32 [B, T] and bool mask [B, T] with ``pads[b]`` leading padding tokens per row."""
  tokens = rng.integers(0, vocab, size=(batch, length)).astype(np.int32)
  if pads is None:
    pads = rng.integers(0, length // 2, size=batch)
  mask = np.arange(length)[None, :] >= np.asarray(pads)[:, None]
  return tokens, mask


def hf_logits(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """float32 [B, T, V] logits of the HF model with position ids ``clip(cumsum(mask)-1, 0)``."""
  import torch

  positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
  with torch.no_grad():
    out = model(
      input_ids=torch.as_tensor(tokens, dtype=torch.long),
      attention_mask=torch.as_tensor(mask.astype(np.int64)),
      position_ids=torch.as_tensor(positions, dtype=torch.long),
    )
  return out.logits.float().numpy()


def assert_greedy_matches_hf(hf_model, model, *, new: int, pad: int):
  """Greedy ``jaxgrpo.rollout.sampling.generate`` of ``model`` (2 samples per prompt) equals transformers' greedy
  ``generate`` of ``hf_model`` for ``new`` tokens on 3 left-padded prompts of 8 tokens (pads 0, 3, 6);
  refuses near-tied logits (the comparison would not be meaningful). Returns the jaxgrpo rollout."""
  import jax
  import jax.numpy as jnp
  import torch

  from jaxgrpo.rollout.sampling import SamplingConfig, generate

  rng = np.random.default_rng(0)
  batch, prompt_len = 3, 8
  mask = np.arange(prompt_len)[None, :] >= np.array([0, 3, 6])[:, None]
  tokens = np.where(mask, rng.integers(1, 128, size=(batch, prompt_len)), pad).astype(np.int32)
  with torch.no_grad():
    out = hf_model.generate(
      input_ids=torch.as_tensor(tokens, dtype=torch.long),
      attention_mask=torch.as_tensor(mask.astype(np.int64)),
      do_sample=False,
      max_new_tokens=new,
      min_new_tokens=new,
      eos_token_id=None,
      pad_token_id=pad,
      output_scores=True,
      return_dict_in_generate=True,
    )
  want = out.sequences[:, prompt_len:].numpy()
  scores = np.sort(torch.stack(out.scores, 1).numpy(), axis=-1)
  assert (scores[..., -1] - scores[..., -2]).min() > 1e-3, "near-tied logits: test not meaningful"
  sampling = SamplingConfig(num_samples=2, max_new_tokens=new, pad_id=pad, suppress_ids=())  # HF suppresses nothing
  r = generate(model, jnp.asarray(tokens), jnp.asarray(mask), sampling, key=jax.random.key(0), temperature=0.0)
  np.testing.assert_array_equal(np.asarray(r.completions), np.repeat(want, 2, axis=0))
  return r


def jax_logits(model, tokens, mask) -> np.ndarray:
  """``f32[B, T, V]`` logits of a jaxgrpo ``model`` on a left-padded batch (positions from the mask, as
  :func:`hf_logits` gives them to transformers)."""
  import jax.numpy as jnp
  from helpers import ref_logits

  from jaxgrpo import models

  mask = jnp.asarray(mask)
  return np.asarray(ref_logits(model, jnp.asarray(tokens), models.positions_from_mask(mask), mask))
