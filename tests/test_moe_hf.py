"""Qwen3-MoE and Qwen2-MoE against transformers (the real HF classes, random weights): logits, greedy
generation token for token, save_hf → from_pretrained without warnings, load_hf round trip."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_utils import (
  MOE_FAMILIES,
  assert_greedy_matches_hf,
  build_hf_model,
  hf_logits,
  left_padded_batch,
  tiny_moe_config,
)

from jaxgrpo import models
from jaxgrpo.models import moe

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")  # tests/conftest.py


def _logits(model, tokens, mask):
  positions = models.positions_from_mask(jnp.asarray(mask))
  hidden, _ = model(jnp.asarray(tokens), positions, attention_mask=jnp.asarray(mask))
  return np.asarray(model.logits(hidden), np.float32)


# Configurations beyond the two defaults: sparse every 2nd layer, no renormalisation, attention
# biases, tied embeddings, top-1; Qwen2-MoE with renormalised top-3 and a dense layer.
VARIANTS = {
  "qwen3_moe": tiny_moe_config("qwen3_moe"),
  "qwen3_moe_step2_bias_tied": tiny_moe_config(
    "qwen3_moe",
    tied=True,
    decoder_sparse_step=2,
    mlp_only_layers=[],
    norm_topk_prob=False,
    attention_bias=True,
    num_experts=6,
    num_experts_per_tok=1,
  ),
  "qwen2_moe": tiny_moe_config("qwen2_moe"),
  "qwen2_moe_top3_dense0": tiny_moe_config(
    "qwen2_moe", num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[0]
  ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers_both_dispatches(tmp_path, variant):
  hf_model = build_hf_model(VARIANTS[variant], seed=1)
  hf_model.save_pretrained(str(tmp_path))
  model = models.load_hf(tmp_path)
  assert isinstance(model, moe.MoEModel)
  cfg = model.config
  assert model.moe_layers == tuple(
    i for i in range(cfg.num_layers) if i not in cfg.mlp_only_layers and (i + 1) % cfg.decoder_sparse_step == 0
  )
  tokens, mask = left_padded_batch(np.random.default_rng(0), 3, 10, 128, pads=[0, 4, 2])
  want = hf_logits(hf_model, tokens, mask)
  for dispatch in moe.DISPATCH:
    moe.set_dispatch(model, dispatch)
    err = np.abs(_logits(model, tokens, mask) - want)[mask].max()
    assert err < 1e-4, (dispatch, err)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_matches_transformers_generate(tmp_path, family):
  """24 greedy tokens from left-padded prompts == HF generate(do_sample=False), token for token
  (our jitted sampler with its KV cache; HF's own cache)."""
  hf_model = build_hf_model(tiny_moe_config(family), seed=0)
  with torch.no_grad():  # weights x4: clear top-1 margins (and router margins) over fp32 noise
    for p in hf_model.parameters():
      if p.ndim >= 2:
        p.mul_(4.0)
  hf_model.save_pretrained(str(tmp_path))
  model = models.load_hf(tmp_path)
  assert_greedy_matches_hf(hf_model, model, new=24, pad=0)


class _Capture(logging.Handler):
  def __init__(self):
    super().__init__(level=logging.DEBUG)
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


@pytest.mark.parametrize("variant", ["qwen3_moe", "qwen2_moe_top3_dense0"])
def test_save_hf_loads_in_transformers_and_round_trips(tmp_path, variant):
  cfg = models.config_from_hf(VARIANTS[variant])
  model = models.build_model(cfg, rngs=nnx.Rngs(3))
  rng = np.random.default_rng(3)
  for path, var in nnx.to_flat_state(nnx.state(model)):  # norms off 1, router logits of O(1)
    if "norm" in str(path):
      var.set_value(jnp.asarray(1.0 + 0.1 * rng.standard_normal(var.shape), jnp.float32))
    if path[-1] == "router":
      var.set_value(var.get_value() * 50)
  models.save_hf(model, tmp_path / "out")
  handler, logger = _Capture(), logging.getLogger("transformers")
  old = logger.level
  logger.addHandler(handler)
  logger.setLevel(logging.INFO)
  try:
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
  finally:
    logger.removeHandler(handler)
    logger.setLevel(old)
  bad = [m for m in handler.messages if any(w in m.lower() for w in ("missing", "unexpected", "newly initialized"))]
  assert not bad, bad
  assert type(hf_model).__name__ == cfg.architecture
  tokens, mask = left_padded_batch(np.random.default_rng(0), 2, 9, 128, pads=[0, 4])
  err = np.abs(_logits(model, tokens, mask) - hf_logits(hf_model, tokens, mask))[mask].max()
  assert err < 1e-4, err
  again = models.load_hf(tmp_path / "out")
  assert again.config == cfg
  for (p1, v1), (p2, v2) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(again))):
    assert p1 == p2
    np.testing.assert_array_equal(np.asarray(v1.get_value()), np.asarray(v2.get_value()))


def test_config_reads_num_local_experts_and_rejects_bad_fields():
  d = dict(tiny_moe_config("qwen3_moe"))
  d["num_local_experts"] = d.pop("num_experts")  # transformers 5 writes this name
  assert models.config_from_hf(d).num_experts == 8
  with pytest.raises(ValueError, match="num_experts_per_tok=9 exceeds num_experts=8"):
    models.config_from_hf({**tiny_moe_config("qwen3_moe"), "num_experts_per_tok": 9})
  with pytest.raises(ValueError, match=r"mlp_only_layers=\[5\]"):
    models.config_from_hf({**tiny_moe_config("qwen3_moe"), "mlp_only_layers": [5]})


def test_missing_expert_tensor_is_named(tmp_path):
  from safetensors.numpy import load_file, save_file

  hf_model = build_hf_model(tiny_moe_config("qwen3_moe"), seed=2)
  hf_model.save_pretrained(str(tmp_path))
  f = str(tmp_path / "model.safetensors")
  tensors = load_file(f)
  del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
  save_file(tensors, f, metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight.*missing"):
    models.load_hf(tmp_path)
