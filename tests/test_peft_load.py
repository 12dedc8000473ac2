"""``lora.load_peft``: a PEFT LoRA directory written by the real ``peft`` library, loaded onto our model
of the same Hugging Face base, reproduces ``peft.PeftModel``'s logits on the same input (issue 22,
item 13); the inverse of ``save_peft`` is exact; unsupported PEFT features are refused by name."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_utils import hf_logits, jax_logits, left_padded_batch, make_tiny_hf

from jaxgrpo import models
from jaxgrpo.models import lora

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")  # tests/conftest.py


def _peft_dir(hf_dir, out, config: dict, seed: int):
  """A PEFT adapter trained-like (every A and B random, B ≠ 0) on the transformers base, saved by peft."""
  base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  model = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", **config))
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "lora_" in name:
        p.copy_(torch.randn_like(p) * (0.2 if "lora_A" in name else 0.05))
  model.save_pretrained(str(out))
  return model.eval()


CASES = {
  "qwen3-all": ("qwen3", dict(r=4, lora_alpha=8, target_modules="all-linear")),
  "llama-rslora-patterns": (
    "llama",
    dict(
      r=4,
      lora_alpha=8,
      use_rslora=True,
      target_modules=["q_proj", "v_proj", "down_proj"],
      rank_pattern={"down_proj": 2},
      alpha_pattern={"layers.1.self_attn.q_proj": 3.0},
    ),
  ),
  "qwen2-mlp": ("qwen2", dict(r=3, lora_alpha=5, target_modules=["gate_proj", "up_proj", "down_proj"])),
  "gpt2-fused": ("gpt2", dict(r=3, lora_alpha=6, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_load_peft_reproduces_peft_on_the_same_input(tmp_path, case):
  family, config = CASES[case]
  hf_dir, _ = make_tiny_hf(tmp_path / "base", family, seed=3)
  reference = _peft_dir(hf_dir, tmp_path / "adapter", config, seed=11)
  ours = lora.load_peft(models.load_hf(hf_dir), tmp_path / "adapter")
  tokens, mask = left_padded_batch(np.random.default_rng(0), 3, 10, ours.config.vocab_size, pads=[0, 2, 5])
  got = jax_logits(ours, tokens, mask)
  want = hf_logits(reference, tokens, mask)
  base = jax_logits(lora.reference_model(ours), tokens, mask)
  assert np.abs(got - base)[mask].max() > 1e-2  # the adapters matter
  err = np.abs(got - want)[mask].max()
  assert err < 1e-4, err
  print(f"{case}: load_peft vs peft, max |Δ logit| = {err:.1e}")
  saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  if case == "llama-rslora-patterns":  # per-module rank and α as peft applied them
    q1 = ours.layers[1].attn.q_lora
    assert (q1.rank, q1.scale) == (4, pytest.approx(3.0 / 2.0)) and ours.layers[0].mlp.down_lora.rank == 2
    assert saved["use_rslora"] and ours.layers[0].attn.q_lora.scale == pytest.approx(8 / 2.0)


def test_load_peft_inverts_save_peft_exactly(tmp_path):
  hf_dir, _ = make_tiny_hf(tmp_path / "base", "qwen3", seed=4)
  model = models.load_hf(hf_dir)
  lora.apply_lora(model, lora.LoRAConfig(rank=4, alpha=8, rslora=True, targets=("q", "down")), key=jax.random.key(1))
  rng = np.random.default_rng(2)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
    if path[-1] == "b":
      var.set_value(jnp.asarray(0.05 * rng.standard_normal(var.shape), jnp.float32))
  lora.save_peft(model, tmp_path / "adapter", base_model_name_or_path=str(hf_dir))
  back = lora.load_peft(models.load_hf(hf_dir), tmp_path / "adapter")
  want = dict(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
  got = dict(nnx.to_flat_state(nnx.state(back, nnx.LoRAParam)))
  assert want.keys() == got.keys()
  for k in want:
    np.testing.assert_array_equal(np.asarray(want[k].get_value()), np.asarray(got[k].get_value()))
  assert back.layers[0].attn.q_lora.scale == model.layers[0].attn.q_lora.scale


@pytest.mark.parametrize(
  "change, match",
  [
    ({"use_dora": True}, r"use_dora=True has no counterpart"),
    ({"peft_type": "IA3"}, r"peft_type='IA3'; only LORA"),
    ({"bias": "all"}, r"bias='all' has no counterpart"),
  ],
)
def test_load_peft_refuses_what_it_cannot_represent(tmp_path, change, match):
  hf_dir, _ = make_tiny_hf(tmp_path / "base", "llama", seed=5)
  _peft_dir(hf_dir, tmp_path / "adapter", dict(r=2, lora_alpha=4, target_modules=["q_proj"]), seed=1)
  path = tmp_path / "adapter" / "adapter_config.json"
  path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
  with pytest.raises(ValueError, match=match):
    lora.load_peft(models.load_hf(hf_dir), tmp_path / "adapter")


def test_load_peft_refuses_modules_that_are_not_projections(tmp_path):
  from safetensors.numpy import load_file, save_file

  hf_dir, _ = make_tiny_hf(tmp_path / "base", "llama", seed=6)
  _peft_dir(hf_dir, tmp_path / "head", dict(r=2, lora_alpha=4, target_modules=["q_proj", "lm_head"]), seed=1)
  with pytest.raises(ValueError, match=r"tensor 'base_model.model.lm_head.base_layer.weight' is not a LoRA A/B"):
    lora.load_peft(models.load_hf(hf_dir), tmp_path / "head")  # peft saved the head's own weights too
  _peft_dir(hf_dir, tmp_path / "adapter", dict(r=2, lora_alpha=4, target_modules=["q_proj"]), seed=1)
  file = tmp_path / "adapter" / "adapter_model.safetensors"
  tensors = {k.replace("layers.1.self_attn.q_proj", "layers.1.self_attn.rotary"): v for k, v in load_file(file).items()}
  save_file(tensors, file)
  with pytest.raises(ValueError, match=r"modules \['model.layers.1.self_attn.rotary'\] are not projections of this"):
    lora.load_peft(models.load_hf(hf_dir), tmp_path / "adapter")
  model = models.load_hf(hf_dir)
  lora.apply_lora(model, lora.LoRAConfig(rank=2), key=jax.random.key(0))
  with pytest.raises(ValueError, match="already has adapters"):
    lora.load_peft(model, tmp_path / "adapter")
