"""LoRA export against the references: transformers loads the merged checkpoint, and peft loads the
adapter directory onto the transformers base model, each reproducing our adapted model's logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_utils import FAMILIES, hf_logits, jax_logits, left_padded_batch, make_tiny_hf
from safetensors.numpy import load_file

from jaxgrpo import models
from jaxgrpo.models import lora

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")  # tests/conftest.py


def _adapted(directory, cfg, seed=1):
  """Our model loaded from the HF checkpoint, with adapters whose B is random (trained-like)."""
  model = models.load_hf(directory)
  lora.apply_lora(model, cfg, key=jax.random.key(seed))
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
    if path[-1] == "b":
      var.set_value(jnp.asarray(0.05 * rng.standard_normal(var.shape), jnp.float32))
  return model


def _peft_logits(hf_dir, adapter_dir, tokens, mask):
  base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
  return hf_logits(model, tokens, mask)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_merged_and_peft_exports_reproduce_the_adapted_model(tmp_path, family, tied):
  hf_dir, _ = make_tiny_hf(tmp_path / "base", family, tied=tied, seed=3)
  cfg = lora.LoRAConfig(rank=4, alpha=8, rslora=family == "qwen3", dropout=0.05)
  model = _adapted(hf_dir, cfg)
  tokens, mask = left_padded_batch(np.random.default_rng(0), 3, 10, model.config.vocab_size, pads=[0, 2, 5])
  ours = jax_logits(model, tokens, mask)
  base = jax_logits(lora.reference_model(model), tokens, mask)
  assert np.abs(ours - base)[mask].max() > 1e-2  # the adapters matter

  # (a) merged weights as a HF checkpoint
  models.save_hf(lora.merge_lora(model), tmp_path / "merged")
  merged_hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
  err = np.abs(hf_logits(merged_hf, tokens, mask) - ours)[mask].max()
  assert err < 1e-4, err

  # (b) PEFT adapter directory on the transformers base
  lora.save_peft(model, tmp_path / "adapter", base_model_name_or_path=str(hf_dir))
  err = np.abs(_peft_logits(hf_dir, tmp_path / "adapter", tokens, mask) - ours)[mask].max()
  assert err < 1e-4, err
  config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert config["r"] == 4 and config["lora_alpha"] == pytest.approx(4 * cfg.scale)
  tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
  if family != "gpt2":  # PEFT layouts: lora_A [r, in], lora_B [out, r]
    c = model.config
    q_a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    o_b = tensors["base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"]
    assert q_a.shape == (4, c.hidden_size) and o_b.shape == (c.hidden_size, 4)
    assert len(tensors) == 2 * 7 * c.num_layers
  else:  # q, k, v share c_attn: rank 3r there, declared in rank_pattern / alpha_pattern
    assert tensors["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"].shape == (12, 32)
    assert tensors["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"].shape == (96, 12)
    assert config["rank_pattern"] == {"transformer.h.0.attn.c_attn": 12, "transformer.h.1.attn.c_attn": 12}


@pytest.mark.parametrize("targets", [("q",), ("k", "v", "fc")], ids=["q-only", "kv-fc"])
def test_gpt2_fused_c_attn_with_some_of_q_k_v_adapted(tmp_path, targets):
  hf_dir, _ = make_tiny_hf(tmp_path / "base", "gpt2", seed=5)
  model = _adapted(hf_dir, lora.LoRAConfig(rank=3, alpha=5, targets=targets))
  tokens, mask = left_padded_batch(np.random.default_rng(1), 2, 9, model.config.vocab_size, pads=[0, 3])
  lora.save_peft(model, tmp_path / "adapter")
  err = np.abs(_peft_logits(hf_dir, tmp_path / "adapter", tokens, mask) - jax_logits(model, tokens, mask))[mask].max()
  assert err < 1e-4, err


def test_qlora_merged_export_matches_and_peft_export_is_adapters_only(tmp_path):
  hf_dir, _ = make_tiny_hf(tmp_path / "base", "llama", seed=7)
  model = _adapted(hf_dir, lora.LoRAConfig(rank=4, alpha=8, quantize="nf4", group_size=8))
  tokens, mask = left_padded_batch(np.random.default_rng(2), 2, 9, model.config.vocab_size, pads=[0, 3])
  ours = jax_logits(model, tokens, mask)
  with pytest.raises(ValueError, match="merge_lora"):
    models.save_hf(model, tmp_path / "never")
  models.save_hf(lora.merge_lora(model), tmp_path / "merged")  # dequantised base + adapters
  merged_hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
  assert np.abs(hf_logits(merged_hf, tokens, mask) - ours)[mask].max() < 1e-4
  # the PEFT adapters sit on the full-precision base: close to ours up to the quantisation error
  lora.save_peft(model, tmp_path / "adapter")
  peft_logits = _peft_logits(hf_dir, tmp_path / "adapter", tokens, mask)
  full_base = jax_logits(models.load_hf(hf_dir), tokens, mask)
  quant_err = np.abs(jax_logits(lora.reference_model(model), tokens, mask) - full_base)[mask].max()
  assert np.abs(peft_logits - ours)[mask].max() <= 2 * quant_err + 1e-4


def test_save_peft_refuses_models_without_active_adapters(tmp_path):
  hf_dir, _ = make_tiny_hf(tmp_path / "base", "qwen2", seed=2)
  plain = models.load_hf(hf_dir)
  with pytest.raises(ValueError, match="no adapters"):
    lora.save_peft(plain, tmp_path / "a")
  lora.apply_lora(plain, lora.LoRAConfig(rank=2, alpha=2), key=jax.random.key(0))
  with pytest.raises(ValueError, match="disabled"):
    lora.save_peft(lora.reference_model(plain), tmp_path / "b")


_MESH_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import AxisType, PartitionSpec as P
    from jaxgrpo import models
    from jaxgrpo.models import lora
    directory = sys.argv[1]
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    cfg = lora.LoRAConfig(rank=4, alpha=8, quantize="int4", group_size=8)
    sharded, plain = models.load_hf(directory, mesh=mesh), models.load_hf(directory)
    for m in (sharded, plain):
        lora.apply_lora(m, cfg, key=jax.random.key(0))
        for path, v in nnx.to_flat_state(nnx.state(m, nnx.LoRAParam)):
            if path[-1] == "b":
                v.set_value(v.get_value() + 0.05)
    attn = sharded.layers[0].attn
    spec = lambda v: v.get_value().sharding.spec
    assert spec(attn.q_lora.a) == P("fsdp", None), spec(attn.q_lora.a)
    assert spec(attn.k_lora.b) == P(None, "tensor", None), spec(attn.k_lora.b)
    assert spec(attn.o_lora.b) == P(None, "fsdp"), spec(attn.o_lora.b)
    assert spec(attn.q.codes) == P("fsdp", "tensor", None), spec(attn.q.codes)
    assert spec(sharded.layers[0].mlp.down.scales) == P("tensor", "fsdp"), spec(sharded.layers[0].mlp.down.scales)
    for (p, v), (_, w) in zip(nnx.to_flat_state(nnx.state(sharded)), nnx.to_flat_state(nnx.state(plain))):
        np.testing.assert_array_equal(np.asarray(v.get_value()), np.asarray(w.get_value()), err_msg=str(p))
    tok = jnp.asarray(np.arange(12).reshape(2, 6) % 128, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    f = jax.jit(lambda m, t, p: m.logits(m(t, p)[0]))
    np.testing.assert_allclose(np.asarray(f(sharded, tok, pos)), np.asarray(f(plain, tok, pos)), atol=1e-5)
    merged = lora.merge_lora(sharded)
    assert spec(merged.layers[0].attn.q) == P("fsdp", "tensor", None), spec(merged.layers[0].attn.q)
    np.testing.assert_allclose(np.asarray(f(merged, tok, pos)), np.asarray(f(plain, tok, pos)), atol=1e-5)
    unquantised = models.load_hf(directory, mesh=mesh)
    lora.apply_lora(unquantised, lora.LoRAConfig(rank=2, alpha=2), key=jax.random.key(0))
    merged = lora.merge_lora(unquantised)
    assert spec(merged.layers[1].mlp.gate) == P("fsdp", "tensor"), spec(merged.layers[1].mlp.gate)
    print("OK")
""")


@pytest.mark.subprocess
def test_adapters_and_quantised_weights_are_placed_on_the_mesh(tmp_path):
  hf_dir, _ = make_tiny_hf(tmp_path, "qwen3", seed=4)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}
  out = subprocess.run(
    [sys.executable, "-c", _MESH_SCRIPT, hf_dir], capture_output=True, text=True, env=env, timeout=300
  )
  assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
