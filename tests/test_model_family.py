"""A model family is one registry entry: a family defined in this file alone (Mistral without a sliding window: the
Llama decoder under its own ``model_type``) loads from, exports to and adapts against transformers' own
``MistralForCausalLM`` and peft, through ``config_from_hf``, ``build_model``, ``load_hf`` / ``save_hf`` and the LoRA
sites, with no file of the library naming it; and ``register_family`` refuses a bad entry in one line."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_utils import build_hf_model, hf_logits, jax_logits, left_padded_batch

from jaxgrpo import models
from jaxgrpo.models import hf, lora, registry
from jaxgrpo.models.attention import Attention
from jaxgrpo.models.llama import SwiGLU

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")  # tests/conftest.py


# ------------------------------------------------------------------------------------------------
# The family: one config class and one registry entry.


@dataclasses.dataclass(frozen=True, kw_only=True)
class MistralConfig(models.LlamaConfig):
  """Mistral (``MistralForCausalLM``) without a sliding window: the Llama decoder, its own ``model_type``."""

  model_type: ClassVar[str] = "mistral"
  architecture: ClassVar[str] = "MistralForCausalLM"

  @classmethod
  def from_hf(cls, d: dict):
    window = d.get("sliding_window")
    if window is not None and window < d.get("max_position_embeddings", 2048):
      raise ValueError(f"sliding_window={window} is not supported (None, or at least max_position_embeddings)")
    return super().from_hf({k: v for k, v in d.items() if k != "sliding_window"})

  def to_hf(self) -> dict:
    return {**super().to_hf(), "sliding_window": None}


MISTRAL = models.Family(
  config=MistralConfig,
  model=models.LlamaModel,
  hf_names=hf.llama_entries,
  lora_modules=(Attention, SwiGLU),
  vllm=True,
  reward_model=True,
)


@pytest.fixture
def mistral():
  models.register_family(MISTRAL)
  yield MISTRAL
  registry.unregister_family(MistralConfig)


TINY = dict(
  model_type="mistral",
  vocab_size=128,
  hidden_size=32,
  intermediate_size=64,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,  # != D / H
  max_position_embeddings=64,
  rms_norm_eps=1e-6,
  rope_theta=10000.0,
  sliding_window=None,
  tie_word_embeddings=False,
)


def test_a_family_registered_from_a_test_file_loads_and_exports_against_transformers(tmp_path, mistral):
  reference = build_hf_model(TINY, seed=5)  # transformers' MistralForCausalLM, every weight random
  assert type(reference).__name__ == "MistralForCausalLM"
  reference.save_pretrained(tmp_path / "hf")

  model = models.load_hf(tmp_path / "hf")
  assert type(model.config) is MistralConfig and type(model) is models.LlamaModel
  assert models.family_of(model.config) is mistral
  tokens, mask = left_padded_batch(np.random.default_rng(0), 3, 12, 128, pads=[0, 3, 7])
  want = hf_logits(reference, tokens, mask)
  err = np.abs(jax_logits(model, tokens, mask) - want)[mask].max()
  assert err < 1e-4, err

  models.save_hf(model, tmp_path / "out")  # back: transformers reads our export as its own Mistral
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
  assert type(back).__name__ == "MistralForCausalLM" and back.config.sliding_window is None
  err = np.abs(hf_logits(back, tokens, mask) - want)[mask].max()
  assert err < 1e-4, err
  for (name, ours), (_, theirs) in zip(back.state_dict().items(), reference.state_dict().items()):
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy(), err_msg=name)


def test_a_registered_family_builds_scans_and_carries_lora_adapters_peft_reads(tmp_path, mistral):
  cfg = models.config_from_hf(TINY)
  loop = models.build_model(cfg, rngs=nnx.Rngs(0))
  scan = models.build_model(cfg, rngs=nnx.Rngs(0), scan_layers=True)
  tokens, mask = left_padded_batch(np.random.default_rng(1), 2, 9, 128, pads=[0, 4])
  np.testing.assert_allclose(jax_logits(scan, tokens, mask), jax_logits(loop, tokens, mask), rtol=1e-5, atol=1e-5)

  # the family's lora_modules: every attention and MLP projection of every layer is a site
  want = [
    f"layers.{i}.{m}.{x}" for i in range(2) for m, xs in (("attn", "qkvo"), ("mlp", ("gate", "up", "down"))) for x in xs
  ]
  assert sorted(lora.projection_paths(loop)) == sorted(want)
  models.save_hf(loop, tmp_path / "base")
  lora.apply_lora(loop, lora.LoRAConfig(rank=2, alpha=4), key=jax.random.key(2))
  rng = np.random.default_rng(2)
  for path, var in nnx.to_flat_state(nnx.state(loop, nnx.LoRAParam)):
    if path[-1] == "b":
      var.set_value(jnp.asarray(0.05 * rng.standard_normal(var.shape), jnp.float32))
  ours = jax_logits(loop, tokens, mask)
  assert np.abs(ours - jax_logits(lora.reference_model(loop), tokens, mask))[mask].max() > 1e-2  # adapters matter
  lora.save_peft(loop, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
  base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
  theirs = hf_logits(peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval(), tokens, mask)
  err = np.abs(ours - theirs)[mask].max()
  assert err < 1e-4, err


def test_a_registered_family_with_reward_model_support_scores_as_transformers_classifier(tmp_path, mistral):
  from jaxgrpo.rewards.reward_model import load_reward_model

  config = transformers.AutoConfig.for_model(**TINY, pad_token_id=3, num_labels=2)
  torch.manual_seed(4)
  reference = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
  assert type(reference).__name__ == "MistralForSequenceClassification"
  with torch.no_grad():
    for name, p in reference.named_parameters():
      p.copy_(torch.randn_like(p) * (0.1 if "norm" in name else 0.05) + (1.0 if "norm" in name else 0.0))
    reference.score.weight.mul_(20.0)  # scores of order 1
  reference.save_pretrained(tmp_path / "rm")
  rm = load_reward_model(tmp_path / "rm")
  tokens = np.random.default_rng(3).integers(4, 128, (3, 10))
  tokens[1, 7:] = tokens[2, :4] = 3  # right and left padding (transformers reads the last non-pad token)
  mask = tokens != 3
  with torch.no_grad():
    want = reference(input_ids=torch.as_tensor(tokens), attention_mask=torch.as_tensor(mask).long()).logits.numpy()
  assert np.abs(want).max() > 0.1
  np.testing.assert_allclose(rm.score(tokens, mask), want, atol=1e-4, rtol=0)


def test_an_unregistered_family_is_refused_by_name():
  with pytest.raises(ValueError, match=r"Unsupported model_type='mistral'; supported: \[.*'qwen3'"):
    models.config_from_hf(TINY)
  cfg = MistralConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, intermediate_size=8)
  assert models.family_of(cfg).config is models.LlamaConfig  # a subclass belongs to its nearest registered base


def test_register_family_refuses_a_bad_entry_in_one_line(mistral):
  class Other(MistralConfig):
    pass

  with pytest.raises(ValueError, match=r"model_type='mistral' of Other is already the family of MistralConfig"):
    models.register_family(dataclasses.replace(MISTRAL, config=Other))
  with pytest.raises(TypeError, match=r"Family.lora_modules must be a tuple of module classes with a PROJECTIONS"):
    models.register_family(dataclasses.replace(MISTRAL, lora_modules=(nnx.Module,)))
  with pytest.raises(TypeError, match=r"Family.config=dict lacks \['model_type \(a str\)', 'from_hf', 'to_hf'\]"):
    models.register_family(dataclasses.replace(MISTRAL, config=dict))
  with pytest.raises(TypeError, match=r"cfg must be a model config of a registered family \(GPT2Config, .*\); got"):
    models.build_model(object(), rngs=nnx.Rngs(0))
