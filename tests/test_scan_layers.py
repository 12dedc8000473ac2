"""Layers as a scan (``scan_layers=True``): the stacked model against transformers and against the loop model.

References: transformers' logits and greedy ``generate`` of the same checkpoint (HF files per layer),
the loop model's train step (parameters after the update, full and LoRA with dropout), PEFT files
written from the loop model, Orbax restore; plus the layout itself (stacked shapes, the ``layers``
logical axis on no mesh axis) and the refusals (MoE, unstackable adapters, a sharded layer axis).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import G, flat_params, make_batch, run_child, tiny_model
from hf_utils import (
  FAMILIES,
  assert_greedy_matches_hf,
  build_hf_model,
  hf_logits,
  jax_logits,
  left_padded_batch,
  tiny_hf_config,
  tiny_moe_config,
)

from jaxgrpo import models
from jaxgrpo.kernels.config import preset
from jaxgrpo.models import lora
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.services import checkpoint as ck
from jaxgrpo.step import train

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")  # tests/conftest.py


def _stacked_flat(flat: dict) -> dict:
  """A loop model's ``{path: array}`` in the scanned layout: ``("layers", i, *rest)`` → ``("layers", *rest)[i]``."""
  out, layers = {}, {}
  for path, value in flat.items():
    if path[0] == "layers":
      layers.setdefault(("layers",) + tuple(path[2:]), {})[path[1]] = value
    else:
      out[path] = value
  for path, by_layer in layers.items():
    out[path] = np.stack([by_layer[i] for i in range(len(by_layer))])
  return out


def _assert_close_trees(got: dict, want: dict, *, rtol=1e-5, atol=1e-6):
  assert sorted(got, key=str) == sorted(want, key=str)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=atol, err_msg=str(k))


# --------------------------------------------------------------------------------------------
# forward, cache, greedy decoding and HF files, against transformers


@pytest.mark.parametrize("family", FAMILIES)
def test_scanned_model_matches_transformers_and_the_loop(tmp_path, family):
  """load_hf(scan_layers=True) assembles the stacked parameters from the per-layer HF tensors: logits
  equal transformers' and the loop model's, greedy decoding (stacked KV cache) equals HF generate, and
  save_hf writes per-layer tensors that transformers loads back to the same logits."""
  hf_model = build_hf_model(tiny_hf_config(family, tied=family in ("gpt2", "qwen3")), seed=0)
  with torch.no_grad():  # weights x4: clear top-1 margins over fp32 noise (as test_sampling)
    for p in hf_model.parameters():
      if p.ndim >= 2:
        p.mul_(4.0)
  directory = str(tmp_path / "hf")
  hf_model.save_pretrained(directory)
  loop = models.load_hf(directory)
  scan = models.load_hf(directory, scan_layers=True)
  assert scan.scan_layers and not loop.scan_layers
  L = scan.config.num_layers
  q = scan.layers.attn.q
  assert q.shape == (L,) + loop.layers[0].attn.q.shape and q.get_metadata()["out_sharding"][0] == "layers"
  tokens, mask = left_padded_batch(np.random.default_rng(0), 3, 9, scan.config.vocab_size, pads=[0, 2, 5])
  want = hf_logits(hf_model, tokens, mask)
  got = jax_logits(scan, tokens, mask)
  assert np.abs(got - want)[mask].max() < 1e-4
  assert np.abs(got - jax_logits(loop, tokens, mask))[mask].max() < 1e-5
  # log-probs of the tokens (the head kernel) against transformers' log-softmax
  # one jitted program (eager, every op of the forward would compile on its own first call)
  lp = np.asarray(jax.jit(lambda m, t, k: models.log_probs(m, t, k, chunk_size=None))(scan, tokens, mask))
  hf_lp = torch.log_softmax(torch.as_tensor(want[:, :-1]), -1).numpy()
  hf_lp = np.take_along_axis(hf_lp, tokens[:, 1:, None], -1)[..., 0]
  both = mask[:, 1:] & mask[:, :-1]
  assert np.abs(lp[:, 1:] - hf_lp)[both].max() < 1e-4
  cache = scan.init_cache(2, 16)
  assert cache.k.shape[0] == L and not isinstance(cache.k, tuple)
  assert_greedy_matches_hf(hf_model, scan, new=12, pad=0)
  # save_hf of the stacked model: per-layer HF names, and transformers reads it back
  out = tmp_path / "saved"
  models.save_hf(scan, out)
  from safetensors.numpy import load_file

  names = set(load_file(os.path.join(out, "model.safetensors")))
  assert not any(".layers." in n and n.split(".layers.")[1][0] not in "0123456789" for n in names)
  back = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
  assert np.abs(hf_logits(back, tokens, mask) - want)[mask].max() < 1e-5
  for (p1, v1), (p2, v2) in zip(
    nnx.to_flat_state(nnx.state(scan)), nnx.to_flat_state(nnx.state(models.load_hf(out, scan_layers=True)))
  ):
    assert p1 == p2
    np.testing.assert_array_equal(np.asarray(v1.get_value()), np.asarray(v2.get_value()))


def test_conversions_build_and_cache_checks():
  """build_model(scan_layers=True) holds the loop model's weights (same rngs) stacked;
  to_loop_layers / to_scan_layers are inverse; a cache of the other layout is refused."""
  cfg = models.Qwen3Config(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8
  )
  loop = models.build_model(cfg, rngs=nnx.Rngs(0))
  scan = models.build_model(cfg, rngs=nnx.Rngs(0), scan_layers=True)
  want = _stacked_flat(flat_params(nnx.state(loop)))
  _assert_close_trees(flat_params(nnx.state(scan)), want, rtol=0, atol=0)
  _assert_close_trees(flat_params(nnx.state(models.to_scan_layers(loop))), want, rtol=0, atol=0)
  again = models.to_loop_layers(scan)
  _assert_close_trees(flat_params(nnx.state(again)), flat_params(nnx.state(loop)), rtol=0, atol=0)
  assert again.layers[1].attn.q.get_metadata()["out_sharding"] == ("embed", "heads", "head_dim")
  tokens = jnp.ones((2, 3), jnp.int32)
  with pytest.raises(ValueError, match="cache.k must be one stacked"):
    scan(tokens, jnp.zeros((2, 3), jnp.int32), cache=loop.init_cache(2, 4))
  with pytest.raises(ValueError, match="cache.k must be a tuple"):
    loop(tokens, jnp.zeros((2, 3), jnp.int32), cache=scan.init_cache(2, 4))
  with pytest.raises(TypeError, match="scan_layers must be a bool"):
    models.build_model(cfg, rngs=nnx.Rngs(0), scan_layers="yes")


def test_generate_of_a_scanned_model_samples_as_the_loop_and_the_stacked_cache_decodes_alike():
  """``generate`` unstacks a scanned model once, outside its decode loop: sampled tokens, log-probs and lengths
  equal the loop model's bit for bit (temperature 1, EOS on). The stacked KV cache (the model's own decode path,
  which the multi-turn and refill samplers use) gives the loop cache's logits over a prefill and two tokens."""
  from jaxgrpo.rollout import sampling
  from jaxgrpo.rollout.sampling import SamplingConfig, generate

  cfg = models.Qwen3Config(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8
  )
  loop = models.build_model(cfg, rngs=nnx.Rngs(0))
  scan = models.build_model(cfg, rngs=nnx.Rngs(0), scan_layers=True)
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(1, 64, (3, 6)), jnp.int32)
  mask = jnp.asarray(np.arange(6)[None] >= np.array([[0], [2], [4]]))  # left padding
  sc = SamplingConfig(num_samples=2, max_new_tokens=9, eos_ids=(5,), pad_id=0)
  want = generate(loop, prompts, mask, sc, key=jax.random.key(3))
  got = generate(scan, prompts, mask, sc, key=jax.random.key(3))
  for name in ("completions", "mask", "log_probs", "num_steps"):
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)
  assert np.asarray(want.mask).sum() > 9  # tokens were sampled (not all rows ended at once)
  # the program: the loop model's loops only (the decode while_loop), no layer scan inside it
  policy = sampling.SamplingPolicy.from_config(sc, temperature=1.0, vocab_size=64)
  whiles = {
    name: sampling.lower_generate(m, prompts, mask, policy, key=jax.random.key(3)).as_text().count("stablehlo.while")
    for name, m in (("loop", loop), ("scan", scan))
  }
  assert whiles["scan"] == whiles["loop"] >= 1, whiles

  positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)

  @nnx.jit
  def decode(model):
    cache = model.init_cache(3, 8)
    hidden, cache = model(prompts, positions, attention_mask=mask, cache=cache)
    out = [model.logits(hidden[:, -1])]
    for t in range(2):
      tok = jnp.argmax(out[-1], -1).astype(jnp.int32)[:, None]
      hidden, cache = model(tok, positions[:, -1:] + 1 + t, attention_mask=jnp.ones((3, 1), bool), cache=cache)
      out.append(model.logits(hidden[:, 0]))
    return jnp.stack(out)

  np.testing.assert_allclose(np.asarray(decode(scan)), np.asarray(decode(loop)), rtol=1e-5, atol=1e-5)


def test_moe_with_dense_layers_is_refused_naming_them(tmp_path):
  """A MoE whose layers are all sparse scans (tests/test_moe_scan.py); one with a dense layer is refused by name."""
  cfg = models.config_from_hf(tiny_moe_config("qwen3_moe"))  # layer 1 dense (mlp_only_layers=[1])
  with pytest.raises(ValueError, match=r"needs every layer of a MoE model sparse \(Qwen3MoeConfig\): layers \[1\] are"):
    models.build_model(cfg, rngs=nnx.Rngs(0), scan_layers=True)


# --------------------------------------------------------------------------------------------
# the train step: scan (with remat inside the scanned body) equals the loop


def _train(model, *, trainable=nnx.Param, dropout_key=None, steps=2):
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.sgd(0.5, momentum=0.9)
  graphdef, state, shardings = train.init_train_state(model, opt, mesh, trainable=trainable)
  tc = train.TrainConfig(micro_batches=2, group_size=G, chunk_size=4)
  step = train.make_train_step(
    graphdef, opt, preset("grpo"), mesh=mesh, shardings=shardings, train_config=tc, dropout_key=dropout_key
  )
  batch = make_batch()._replace(ref_logp=None)
  for _ in range(steps):
    state, metrics = step(state, batch)
  return flat_params(state.params), metrics


@functools.lru_cache(maxsize=None)
def _loop_reference():
  """The loop model's (stacked) initial parameters, parameters after two steps, and loss: the same for
  every remat policy of the scanned model, so built once."""
  loop = models.build_model(tiny_model().config, rngs=nnx.Rngs(0))
  init = _stacked_flat(flat_params(nnx.state(loop)))
  want, m_loop = _train(loop)
  return init, _stacked_flat(want), float(m_loop["loss"])


@pytest.mark.parametrize("remat", ["none", "full"])
def test_train_step_with_scan_equals_the_loop(remat):
  """Two SGD-momentum steps of the full model: the scanned model's parameters after the update equal
  the loop model's (stacked), with and without remat inside the scanned body."""
  cfg = tiny_model().config
  scan = models.build_model(cfg, rngs=nnx.Rngs(0), scan_layers=True, remat=remat)
  init, want, loss_loop = _loop_reference()
  got, m_scan = _train(scan)
  moved = max(np.abs(want[k] - init[k]).max() for k in want)
  assert moved > 1e-3
  _assert_close_trees(got, want, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(float(m_scan["loss"]), loss_loop, rtol=1e-5)


def _with_adapters(model, dropout):
  lora.apply_lora(model, lora.LoRAConfig(rank=4, alpha=8, dropout=dropout), key=jax.random.key(1))
  return model


@pytest.mark.slow
def test_lora_with_scan_equals_the_loop_and_exports_the_same_peft(tmp_path):
  """apply_lora on a scanned model gives the loop model's adapters (stacked, same A init, same dropout
  streams): two LoRA steps with adapter dropout update them alike; reference/base/merge work on the
  stacked layout; save_peft writes the loop model's files; targets on some layers only are refused."""
  cfg = tiny_model().config
  loop = _with_adapters(models.build_model(cfg, rngs=nnx.Rngs(0)), 0.3)
  scan = _with_adapters(models.build_model(cfg, rngs=nnx.Rngs(0), scan_layers=True), 0.3)
  rng = np.random.default_rng(1)
  for path, var in nnx.to_flat_state(nnx.state(loop, nnx.LoRAParam)):  # trained-like B, same in both
    if path[-1] == "b":
      var.set_value(jnp.asarray(0.05 * rng.standard_normal(var.shape), jnp.float32))
  stacked = _stacked_flat(flat_params(nnx.state(loop, nnx.LoRAParam)))
  for path, var in nnx.to_flat_state(nnx.state(scan, nnx.LoRAParam)):
    var.set_value(jnp.asarray(stacked[path]))
  assert lora.projection_paths(scan) == lora.projection_paths(loop)
  assert lora.count_params(scan) == lora.count_params(loop)
  tokens, mask = left_padded_batch(np.random.default_rng(0), 2, 7, cfg.vocab_size, pads=[0, 3])
  for fn in (lora.reference_model, lora.base_model, lora.merge_lora):
    np.testing.assert_allclose(jax_logits(fn(scan), tokens, mask), jax_logits(fn(loop), tokens, mask), atol=2e-5)
  lora.save_peft(loop, tmp_path / "loop")
  lora.save_peft(scan, tmp_path / "scan")
  from safetensors.numpy import load_file

  a, b = (load_file(os.path.join(tmp_path, d, "adapter_model.safetensors")) for d in ("loop", "scan"))
  assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
  back = lora.load_peft(models.build_model(cfg, rngs=nnx.Rngs(0), scan_layers=True), tmp_path / "loop")
  np.testing.assert_allclose(jax_logits(back, tokens, mask), jax_logits(loop, tokens, mask), atol=2e-5)
  want, _ = _train(loop, trainable=nnx.LoRAParam, dropout_key=jax.random.key(3))
  got, _ = _train(scan, trainable=nnx.LoRAParam, dropout_key=jax.random.key(3))
  want = _stacked_flat(want)
  assert max(np.abs(want[k] - stacked[k]).max() for k in want) > 1e-3
  _assert_close_trees(got, want, rtol=1e-4, atol=1e-6)
  pos = models.positions_from_mask(jnp.asarray(mask))
  forward = jax.jit(lambda m, key: m(jnp.asarray(tokens), pos, attention_mask=jnp.asarray(mask), dropout_key=key)[0])
  dropped, plain = forward(scan, jax.random.key(3)), forward(scan, None)
  assert np.abs(np.asarray(dropped - plain)).max() > 1e-2  # the key reaches the stacked adapters' masks
  partial = models.build_model(cfg, rngs=nnx.Rngs(0), scan_layers=True)
  with pytest.raises(ValueError, match="layer 1 has 0 adapters, layer 0 has 1"):
    lora.apply_lora(partial, lora.LoRAConfig(rank=2, targets=("layers.0.attn.q",)), key=jax.random.key(0))
  assert not lora.has_adapters(partial)  # refused before anything changed


def test_qlora_with_scan_equals_the_loop():
  """Quantised base weights (nf4) with adapters stack too: same logits as the loop model's QLoRA, and the
  codes are the loop model's, stacked."""
  cfg = tiny_model().config
  qcfg = lora.LoRAConfig(rank=2, quantize="nf4", group_size=8)
  loop = models.build_model(cfg, rngs=nnx.Rngs(0))
  scan = models.build_model(cfg, rngs=nnx.Rngs(0), scan_layers=True)
  for m in (loop, scan):
    lora.apply_lora(m, qcfg, key=jax.random.key(2))
  codes = scan.layers.mlp.gate.codes
  assert codes.get_metadata()["out_sharding"][0] == "layers"
  np.testing.assert_array_equal(np.asarray(codes[...][1]), np.asarray(loop.layers[1].mlp.gate.codes[...]))
  assert lora.count_params(scan) == lora.count_params(loop)
  tokens, mask = left_padded_batch(np.random.default_rng(0), 2, 7, cfg.vocab_size, pads=[0, 3])
  np.testing.assert_allclose(jax_logits(scan, tokens, mask), jax_logits(loop, tokens, mask), atol=2e-5)


# --------------------------------------------------------------------------------------------
# sharding and checkpoints


def test_stacked_axis_takes_no_mesh_axis_and_a_rule_for_it_is_refused():
  scan = models.build_model(tiny_model().config, rngs=nnx.Rngs(0), scan_layers=True)
  mesh = shd.make_mesh("fsdp=1", devices=jax.devices()[:1])
  shardings = shd.tree_shardings(nnx.state(scan), mesh)
  assert shardings["layers"]["mlp"]["gate"].spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
  assert shardings["layers"]["attn"]["q"].spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
  with pytest.raises(ValueError, match="stacked layer axis 'layers' to mesh axes 'fsdp'"):
    shd.tree_shardings(nnx.state(scan), mesh, {**shd.DEFAULT_RULES, "layers": "fsdp"})


_MESHES = r"""
import jax, numpy as np, optax
from jax.sharding import PartitionSpec as P
from flax import nnx
from helpers import G, flat_params, make_batch, tiny_config
from jaxgrpo import models; from jaxgrpo.parallel import sharding as shd; from jaxgrpo.step import train
from jaxgrpo.kernels.config import preset

assert jax.device_count() == 8
batch = make_batch()
results = {}
for spec in ["data=1", "data=2,fsdp=2,tensor=2"]:
  mesh = shd.make_mesh(spec, devices=jax.devices()[:1] if spec == "data=1" else None)
  model = models.build_model(tiny_config(), rngs=nnx.Rngs(0), scan_layers=True, remat="full")
  opt = optax.sgd(0.5, momentum=0.9)
  graphdef, state, shardings = train.init_train_state(model, opt, mesh)
  step = train.make_train_step(graphdef, opt, preset("grpo", beta=0.04), mesh=mesh, shardings=shardings,
                               train_config=train.TrainConfig(micro_batches=2, group_size=G, chunk_size=8))
  for _ in range(2):
    state, metrics = step(state, shd.place_batch(batch, mesh))
  if spec != "data=1":
    assert state.params["layers"]["mlp"]["gate"][...].sharding.spec == P(None, "fsdp", "tensor")
    assert state.params["layers"]["attn"]["q"][...].sharding.spec == P(None, "fsdp", "tensor", None)
    assert state.opt_state[0].trace["layers"]["attn"]["o"][...].sharding.spec == P(None, "tensor", None, "fsdp")
  results[spec] = flat_params(state.params)
  print(spec, float(metrics["loss"]))
for k, v in results["data=1"].items():
  np.testing.assert_allclose(results["data=2,fsdp=2,tensor=2"][k], v, rtol=1e-5, atol=1e-7, err_msg=str(k))
print("OK")
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_scanned_train_step_on_an_8_device_mesh_equals_one_device():
  """The stacked parameters and their optimizer state are sharded with the layer axis unsharded, and
  two steps (remat inside the scan, β > 0) on a data × fsdp × tensor mesh equal one device's."""
  assert run_child(_MESHES, devices=8).strip().endswith("OK")


def test_checkpoint_of_the_stacked_layout_restores_and_a_loop_target_is_refused(tmp_path):
  """Orbax saves the stacked parameters; restore_params into a scanned model gives them back exactly;
  a loop-layout target is refused with the entries named (convert with to_scan_layers first)."""
  cfg = tiny_model().config
  scan = models.build_model(cfg, rngs=nnx.Rngs(0), scan_layers=True)
  params = nnx.state(scan)
  opt_state = optax.sgd(0.1).init(params)
  snap = ck.Snapshot(params, opt_state, jnp.asarray(1, jnp.int32), jax.random.key(0), {"epoch": 0})
  root = str(tmp_path / "ckpt")
  with ck.Checkpointer(root, log=None) as c:
    c.save(snap)
  target = models.build_model(cfg, rngs=nnx.Rngs(7), scan_layers=True)
  ck.restore_params(root, target)
  _assert_close_trees(flat_params(nnx.state(target)), flat_params(params), rtol=0, atol=0)
  with pytest.raises(ck.CheckpointError, match="does not match the model"):
    ck.restore_params(root, models.build_model(cfg, rngs=nnx.Rngs(0)))


def test_run_config_field_builds_a_scanned_policy():
  """``model.scan_layers`` in a run config reaches the built policy; a non-bool is refused by name."""
  from jaxgrpo.run import builders
  from jaxgrpo.run.specs import load_config

  cfg = load_config(None, {"model.synthetic": {}, "model.scan_layers": True})
  assert cfg.model.scan_layers is True and load_config(None, {"model.synthetic": {}}).model.scan_layers is False
  model, _ = builders.build_policy(cfg.model, seed=0)
  assert model.scan_layers and model.layers.attn.q.shape[0] == model.config.num_layers
  with pytest.raises((TypeError, ValueError), match="model.scan_layers"):
    load_config(None, {"model.synthetic": {}, "model.scan_layers": "sometimes"})
