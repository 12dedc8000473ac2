"""LoRA / QLoRA on the model ports: exactness at init, reference, merge, dropout, targets, axes,
adapter-only training, budget, fingerprint, sampler (references: NumPy and the plain base model)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxgrpo import models
from jaxgrpo.models import lora, quant
from jaxgrpo.models.layers import LoRA, QuantizedWeight
from jaxgrpo.parallel.sharding import make_mesh, tree_shardings
from jaxgrpo.rollout import sampling

pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")  # tests/conftest.py


def _tiny_cfg(family: str, tied: bool = False, layers: int = 1):
  """Width 64; one layer where the number of layers does not matter (every projection kind is in it, and
  compiling a second layer is most of a tiny test's time), two where a check tells the layers apart."""
  if family == "gpt2":
    return models.GPT2Config(
      vocab_size=96,
      hidden_size=64,
      num_layers=layers,
      num_heads=4,
      max_position_embeddings=64,
      tie_word_embeddings=tied,
    )
  kw = dict(
    vocab_size=96,
    hidden_size=64,
    num_layers=layers,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    max_position_embeddings=64,
    tie_word_embeddings=tied,
  )
  return {
    "llama": lambda: models.LlamaConfig(**kw),
    "qwen2": lambda: models.Qwen2Config(**kw),
    "qwen3": lambda: models.Qwen3Config(**kw, head_dim=32),
  }[family]()


def _realistic_cfg(family: str):
  """Widths of real small models (GPT-2 small; Qwen2.5-0.5B / Qwen3-0.6B-like), one layer (every projection
  of the width is in it), small vocab."""
  if family == "gpt2":
    return models.GPT2Config(vocab_size=512, hidden_size=768, num_layers=1, num_heads=12, max_position_embeddings=64)
  kw = dict(vocab_size=512, num_layers=1, max_position_embeddings=64)
  return {
    "llama": lambda: models.LlamaConfig(**kw, hidden_size=1024, num_heads=16, num_kv_heads=8, intermediate_size=2816),
    "qwen2": lambda: models.Qwen2Config(**kw, hidden_size=896, num_heads=14, num_kv_heads=2, intermediate_size=4864),
    "qwen3": lambda: models.Qwen3Config(
      **kw, hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=3072
    ),
  }[family]()


def _randomise_small_params(model, seed=0):
  """Norm scales and biases away from 1/0 so that a dropped term changes the outputs."""
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(nnx.state(model)):
    if "norm" in str(path) or "bias" in str(path):
      var.set_value(jnp.asarray(1.0 * (path[-1] == "scale") + 0.1 * rng.standard_normal(var.shape), var.dtype))


def _randomise_b(model, seed=1, std=0.05):
  """Trained-like adapters: B ~ N(0, std²) instead of 0."""
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
    if path[-1] == "b":
      var.set_value(jnp.asarray(std * rng.standard_normal(var.shape), var.get_value().dtype))


def _batch(vocab, batch=2, length=12, seed=0):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, vocab, (batch, length)), jnp.int32)
  mask = jnp.asarray(np.arange(length)[None, :] >= np.array([0, 3])[:batch, None])
  return tokens, mask


@functools.partial(jax.jit, static_argnums=0)
def _logits_jit(graphdef, state, tokens, mask, key=None):
  model = nnx.merge(graphdef, state)
  hidden, _ = model(tokens, models.positions_from_mask(mask), attention_mask=mask, dropout_key=key)
  return model.logits(hidden, out_dtype=jnp.float32)


def _logits(model, tokens, mask, key=None):
  graphdef, state = nnx.split(model)
  return np.asarray(_logits_jit(graphdef, state, tokens, mask, key))


def _model(family, tied=False, seed=0, layers=1, **kw):
  model = models.build_model(_tiny_cfg(family, tied, layers), rngs=nnx.Rngs(seed), **kw)
  _randomise_small_params(model, seed)
  return model


# --------------------------------------------------------------------------------------------
# Exactness at init and the reference


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "qwen3"])
def test_zero_b_first_forward_is_bit_identical_at_realistic_width(family):
  model = models.build_model(_realistic_cfg(family), rngs=nnx.Rngs(0))
  _randomise_small_params(model)
  tokens, mask = _batch(512, length=16)
  base = _logits(model, tokens, mask)
  lora.apply_lora(model, lora.LoRAConfig(rank=16, alpha=32, dropout=0.1), key=jax.random.key(0))
  assert all(s.adapter() is not None for s in lora.adapter_sites(model))
  np.testing.assert_array_equal(_logits(model, tokens, mask), base)
  # dropout on the adapter input only: with B = 0 a dropout key changes nothing either
  np.testing.assert_array_equal(_logits(model, tokens, mask, jax.random.key(5)), base)


def test_zero_b_bit_identical_in_bfloat16():
  model = _model("qwen3", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  tokens, mask = _batch(96)
  base = _logits(model, tokens, mask)
  lora.apply_lora(model, lora.LoRAConfig(rank=8, alpha=16), key=jax.random.key(0))  # f32 adapters
  assert model.layers[0].attn.q_lora.a.get_value().dtype == jnp.float32
  np.testing.assert_array_equal(_logits(model, tokens, mask), base)


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_reference_model_is_the_base_and_copies_no_weight(family):
  model = _model(family)
  tokens, mask = _batch(96)
  base = _logits(model, tokens, mask)
  lora.apply_lora(model, lora.LoRAConfig(rank=4, alpha=8), key=jax.random.key(0))
  _randomise_b(model)
  assert np.abs(_logits(model, tokens, mask) - base).max() > 1e-2  # the adapters do something
  ref = lora.reference_model(model)
  np.testing.assert_array_equal(_logits(ref, tokens, mask), base)
  # same arrays (no copy); only the static graph differs; the policy keeps its adapters on
  for (_, v), (_, w) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(ref))):
    assert v.get_value() is w.get_value()
  assert model.layers[0].attn.q_lora.enabled and not ref.layers[0].attn.q_lora.enabled
  # the jitted form: the reference graphdef with the *policy's* state
  ref_graphdef = nnx.graphdef(ref)
  np.testing.assert_array_equal(np.asarray(_logits_jit(ref_graphdef, nnx.state(model), tokens, mask)), base)
  with pytest.raises(ValueError, match="no adapters"):
    lora.reference_model(_model(family))


# --------------------------------------------------------------------------------------------
# The adapter math and merge, against NumPy


def test_merged_weights_equal_numpy_w_plus_scale_a_b_and_forward_matches():
  model = _model("llama")
  cfg = lora.LoRAConfig(rank=4, alpha=12, rslora=True)
  lora.apply_lora(model, cfg, key=jax.random.key(0))
  _randomise_b(model)
  merged = lora.merge_lora(model)
  assert cfg.scale == 12 / 2.0
  for s, m in zip(lora.adapter_sites(model), lora.adapter_sites(merged)):
    ad = s.adapter()
    w = np.asarray(s.weight().get_value(), np.float64)
    a = np.asarray(ad.a.get_value(), np.float64).reshape(-1, 4)
    b = np.asarray(ad.b.get_value(), np.float64).reshape(4, -1)
    expected = w + ad.scale * (a @ b).reshape(w.shape)
    np.testing.assert_allclose(np.asarray(m.weight().get_value()), expected, rtol=1e-6, atol=1e-7)
    assert m.adapter() is None
  assert not nnx.state(merged, nnx.LoRAParam)  # a plain model
  tokens, mask = _batch(96)
  np.testing.assert_allclose(_logits(merged, tokens, mask), _logits(model, tokens, mask), atol=2e-5, rtol=1e-5)
  # the input model still has its adapters
  assert model.layers[0].attn.q_lora is not None


def test_scale_and_init_follow_peft():
  assert lora.LoRAConfig(rank=16, alpha=32).scale == 2.0
  assert lora.LoRAConfig(rank=16, alpha=32, rslora=True).scale == 8.0
  model = _model("qwen3", layers=2)
  lora.apply_lora(model, lora.LoRAConfig(rank=8, alpha=8), key=jax.random.key(0))
  q = model.layers[0].attn.q_lora  # A [D, r]: kaiming_uniform(a=√5) bound 1/√D
  a = np.asarray(q.a.get_value())
  assert a.shape == (64, 8) and np.abs(a).max() <= 1 / math.sqrt(64) and np.abs(a).max() > 0.9 / math.sqrt(64)
  o = model.layers[0].attn.o_lora  # A [H, K, r]: fan_in = H·K
  assert np.abs(np.asarray(o.a.get_value())).max() <= 1 / math.sqrt(4 * 32)
  np.testing.assert_array_equal(np.asarray(q.b.get_value()), 0.0)
  g = _model("qwen3")
  lora.apply_lora(g, lora.LoRAConfig(rank=8, alpha=8, init="gaussian"), key=jax.random.key(0))
  std = np.concatenate([np.asarray(s.adapter().a.get_value()).ravel() for s in lora.adapter_sites(g)]).std()
  assert abs(std - 1 / 8) < 0.01
  # a different key gives different A; the same key the same A
  h = _model("qwen3", layers=2)
  lora.apply_lora(h, lora.LoRAConfig(rank=8, alpha=8), key=jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(h.layers[1].mlp.up_lora.a.get_value()), model.layers[1].mlp.up_lora.a[...])


def test_dropout_is_inverted_on_the_adapter_input_and_deterministic():
  d = 64
  eye = jnp.eye(d)
  ad = LoRA(eye, eye, a_axes=("embed", None), b_axes=(None, "embed"), scale=1.0, dropout=0.25, stream=3)
  x = jnp.asarray(np.random.default_rng(0).uniform(1, 2, (256, d)), jnp.float32)
  key = jax.random.key(7)
  y = np.asarray(ad(x, dtype=jnp.float32, dropout_key=key))  # = dropout(x) since A = B = I
  kept = y != 0
  assert abs(kept.mean() - 0.75) < 0.02
  np.testing.assert_allclose(y[kept], np.asarray(x)[kept] / 0.75, rtol=1e-6)
  np.testing.assert_array_equal(y, np.asarray(ad(x, dtype=jnp.float32, dropout_key=key)))  # same key, same mask
  expected_mask = np.asarray(jax.random.bernoulli(jax.random.fold_in(key, 3), 0.75, x.shape))
  np.testing.assert_array_equal(kept, expected_mask)  # the documented stream
  np.testing.assert_array_equal(np.asarray(ad(x, dtype=jnp.float32)), np.asarray(x))  # no key: no dropout


def test_dropout_masks_differ_per_adapter_and_per_key_in_a_model():
  model = _model("qwen3")
  lora.apply_lora(model, lora.LoRAConfig(rank=4, alpha=8, dropout=0.5), key=jax.random.key(0))
  _randomise_b(model)
  streams = [s.adapter().stream for s in lora.adapter_sites(model)]
  assert streams == list(range(len(streams)))
  tokens, mask = _batch(96)
  k1, k2 = jax.random.key(1), jax.random.key(2)
  a, b, c = (_logits(model, tokens, mask, k) for k in (k1, k1, k2))
  np.testing.assert_array_equal(a, b)
  assert np.abs(a - c).max() > 1e-3
  assert np.abs(a - _logits(model, tokens, mask)).max() > 1e-3


def test_per_row_dropout_keys_make_masks_independent_of_the_batch_split():
  model = _model("llama")
  lora.apply_lora(model, lora.LoRAConfig(rank=4, alpha=8, dropout=0.5), key=jax.random.key(0))
  _randomise_b(model, std=0.2)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 96, (4, 10)), jnp.int32)
  mask = jnp.ones((4, 10), bool)
  keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(11), jnp.arange(4))  # one per global row
  whole = _logits(model, tokens, mask, keys)
  halves = np.concatenate([_logits(model, tokens[i : i + 2], mask[i : i + 2], keys[i : i + 2]) for i in (0, 2)])
  np.testing.assert_allclose(whole, halves, rtol=1e-5, atol=1e-5)
  assert np.abs(whole - _logits(model, tokens, mask)).max() > 1e-3  # dropout is on
  raw = jax.random.key_data(keys)  # raw uint32 [B, 2] keys are accepted too
  np.testing.assert_array_equal(_logits(model, tokens, mask, raw), whole)
  # traced only (the checks refuse at trace time; eager, the ops before them would each compile)
  hidden = lambda key: jax.eval_shape(lambda k: model(tokens, models.positions_from_mask(mask), dropout_key=k), key)
  with pytest.raises(ValueError, match=r"one per row \(shape \(4,\)\)"):
    hidden(keys[:3])
  with pytest.raises(TypeError, match="PRNG key"):
    hidden(jnp.zeros((4,), jnp.float32))


# --------------------------------------------------------------------------------------------
# Targets and logical axes


@pytest.mark.parametrize(
  "family,expected",
  [("gpt2", ["q", "k", "v", "o", "fc", "proj"]), ("llama", ["q", "k", "v", "o", "gate", "up", "down"])],
)
def test_default_targets_are_all_attention_and_mlp_projections(family, expected):
  model = _model(family, layers=2)
  lora.apply_lora(model, lora.LoRAConfig(rank=2, alpha=2), key=jax.random.key(0))
  adapted = [s.name for s in lora.adapter_sites(model) if s.adapter() is not None]
  assert adapted == expected * 2


def test_target_patterns_select_by_name_or_path_and_unknown_targets_raise():
  model = _model("llama", layers=2)
  lora.apply_lora(
    model, lora.LoRAConfig(rank=2, alpha=2, targets=("q|v", r"layers\.1\.mlp\.down")), key=jax.random.key(0)
  )
  adapted = [s.dotted for s in lora.adapter_sites(model) if s.adapter() is not None]
  assert adapted == ["layers.0.attn.q", "layers.0.attn.v", "layers.1.attn.q", "layers.1.attn.v", "layers.1.mlp.down"]
  with pytest.raises(ValueError, match="already has adapters"):
    lora.apply_lora(model, lora.LoRAConfig(rank=2, alpha=2), key=jax.random.key(0))
  with pytest.raises(ValueError, match=r"\['c_attn'\] match no projection"):
    lora.apply_lora(_model("llama"), lora.LoRAConfig(rank=2, alpha=2, targets=["q", "c_attn"]), key=jax.random.key(0))
  for bad, exc, match in [
    (dict(rank=0), ValueError, "rank"),
    (dict(alpha=-1.0), ValueError, "alpha"),
    (dict(dropout=1.0), ValueError, "dropout"),
    (dict(targets=["("]), ValueError, "regular expression"),
    (dict(init="orthogonal"), ValueError, "init"),
    (dict(param_dtype="int8"), TypeError, "float dtype"),
    (dict(quantize="fp4"), ValueError, "quantize"),
  ]:
    with pytest.raises(exc, match=match):
      lora.LoRAConfig(**bad)
  with pytest.raises(TypeError, match="CausalLM"):
    lora.apply_lora(object(), lora.LoRAConfig(), key=jax.random.key(0))


def test_adapters_and_quantised_weights_carry_the_weights_logical_axes():
  model = _model("qwen3")
  lora.apply_lora(model, lora.LoRAConfig(rank=4, alpha=8, quantize="nf4", group_size=16), key=jax.random.key(0))
  attn = model.layers[0].attn
  md = lambda v: tuple(v.get_metadata()["out_sharding"])
  assert md(attn.q_lora.a) == ("embed", None) and md(attn.q_lora.b) == (None, "heads", "head_dim")
  assert md(attn.k_lora.b) == (None, "kv_heads", "head_dim")
  assert md(attn.o_lora.a) == ("heads", "head_dim", None) and md(attn.o_lora.b) == (None, "embed")
  assert md(model.layers[0].mlp.down_lora.a) == ("mlp", None)
  assert isinstance(attn.q, QuantizedWeight)
  assert md(attn.q.codes) == md(attn.q.scales) == ("embed", "heads", "head_dim")
  # every array has axes, so the repo's placement code shards the whole state (1-device mesh here)
  shardings = tree_shardings(nnx.state(model), make_mesh("data=1,fsdp=1,tensor=1"))
  assert len(jax.tree.leaves(shardings)) == len(jax.tree.leaves(nnx.state(model)))
  # the filters separate trainable adapters from frozen (quantised) base weights
  _, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
  assert all(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(adapters))
  assert not any(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(rest))


# --------------------------------------------------------------------------------------------
# QLoRA


@pytest.mark.parametrize("kind", quant.QUANT_KINDS)
def test_qlora_forward_equals_the_dequantised_base_model_exactly(kind):
  model = _model("qwen2")
  tokens, mask = _batch(96)
  full = _logits(model, tokens, mask)
  lora.apply_lora(model, lora.LoRAConfig(rank=4, alpha=8, quantize=kind, group_size=16), key=jax.random.key(0))
  # a plain model whose projection weights are the dequantised ones (NumPy-side copy)
  plain = _model("qwen2")
  for s, p in zip(lora.adapter_sites(model), lora.adapter_sites(plain)):
    p.weight().set_value(jnp.asarray(np.asarray(s.weight().dequantize(jnp.float32))))
  dequant_base = _logits(plain, tokens, mask)
  np.testing.assert_array_equal(_logits(model, tokens, mask), dequant_base)  # B = 0
  np.testing.assert_array_equal(_logits(lora.reference_model(model), tokens, mask), dequant_base)
  rel = np.abs(dequant_base - full).max() / np.abs(full).max()
  assert rel < {"int8": 0.03, "int4": 0.25, "nf4": 0.25}[kind], rel
  _randomise_b(model)
  merged = lora.merge_lora(model)  # dequantised + adapter, in the embedding's dtype
  assert not any(isinstance(s.weight(), QuantizedWeight) for s in lora.adapter_sites(merged))
  np.testing.assert_allclose(_logits(merged, tokens, mask), _logits(model, tokens, mask), atol=2e-5, rtol=1e-5)
  counts = lora.count_params(model)
  assert counts.base == lora.count_params(plain).base
  assert counts.base_bytes < lora.count_params(plain).base_bytes


def test_quantize_errors_are_clear():
  model = _model("gpt2")
  lora.quantize_model(model, "int8")
  with pytest.raises(ValueError, match="already quantised"):
    lora.quantize_model(model, "int8")
  with pytest.raises(ValueError, match="not divisible by group_size=48"):
    lora.quantize_model(_model("gpt2"), "nf4", group_size=48)
  with pytest.raises(ValueError, match="merge_lora"):
    models.save_hf(model, "/tmp/never-written")


# --------------------------------------------------------------------------------------------
# Training the adapters only (the minimal step phase 2 will move into jaxgrpo.step.train)


def test_adapter_only_steps_leave_the_base_bit_identical_and_adam_state_is_adapter_sized():
  model = _model("qwen3")
  lora.apply_lora(model, lora.LoRAConfig(rank=4, alpha=8, dropout=0.1), key=jax.random.key(0))
  graphdef, adapters, base = nnx.split(model, nnx.LoRAParam, ...)
  base_before = jax.tree.map(np.asarray, base)
  opt = optax.adam(1e-2)
  opt_state = opt.init(adapters)
  tokens, mask = _batch(96)

  @jax.jit
  def step(adapters, opt_state, base, key):
    def loss(adapters):
      m = nnx.merge(graphdef, adapters, base)
      hidden, _ = m(tokens, models.positions_from_mask(mask), attention_mask=mask, dropout_key=key)
      return -jnp.mean(jax.nn.log_softmax(m.logits(hidden, out_dtype=jnp.float32))[..., 0])

    value, grads = jax.value_and_grad(loss)(adapters)
    updates, opt_state = opt.update(grads, opt_state, adapters)
    return optax.apply_updates(adapters, updates), opt_state, value

  losses = []
  for i in range(3):
    adapters, opt_state, value = step(adapters, opt_state, base, jax.random.key(i))
    losses.append(float(value))
  assert losses[-1] < losses[0]
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), base_before, base)
  n_adapter = sum(x.size for x in jax.tree.leaves(adapters))
  n_opt = sum(x.size for x in jax.tree.leaves(opt_state) if x.ndim > 0)
  assert n_opt == 2 * n_adapter == 2 * lora.count_params(model).adapter


def test_adapter_gradients_with_remat_equal_those_without():
  """Gradients w.r.t. the adapters only, base weights a separate jit argument, with dropout: per-layer
  rematerialisation changes nothing (``nnx.remat`` used to fail on this mix of trace levels)."""
  tokens, mask = _batch(96)
  grads = {}
  for remat in (False, True):
    model = _model("qwen3", layers=2, remat=remat)  # two layers: each remat'd layer must use its own weights
    lora.apply_lora(model, lora.LoRAConfig(rank=4, alpha=8, dropout=0.2), key=jax.random.key(0))
    _randomise_b(model)
    graphdef, adapters, base = nnx.split(model, nnx.LoRAParam, ...)

    def loss(adapters, base, graphdef=graphdef):
      m = nnx.merge(graphdef, adapters, base)
      hidden, _ = m(tokens, models.positions_from_mask(mask), attention_mask=mask, dropout_key=jax.random.key(9))
      return jnp.sum(m.logits(hidden, out_dtype=jnp.float32) ** 2)

    grads[remat] = jax.jit(jax.grad(loss))(adapters, base)
  leaves = jax.tree.leaves(grads[False])
  assert all(np.abs(np.asarray(g)).max() > 0 for g in leaves)
  for a, b in zip(leaves, jax.tree.leaves(grads[True])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_count_params_and_adam_bytes_match_the_formula():
  cfg = _tiny_cfg("qwen3", layers=2)
  model = models.build_model(cfg, rngs=nnx.Rngs(0))
  plain = lora.count_params(model)
  r = 8
  lora.apply_lora(model, lora.LoRAConfig(rank=r, alpha=8), key=jax.random.key(0))
  D, H, N, K, F, L = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, 2
  per_layer = r * ((D + H * K) + 2 * (D + N * K) + (H * K + D) + 2 * (D + F) + (F + D))
  counts = lora.count_params(model)
  assert counts == (plain.base, L * per_layer, plain.base_bytes, 4 * L * per_layer)
  adam = lora.adam_state_bytes(model)
  assert adam.full == 2 * 4 * plain.base and adam.lora == 2 * 4 * L * per_layer
  assert adam.ratio == adam.lora / adam.full


def test_base_fingerprint_identifies_base_weights_only():
  a, b = _model("llama", layers=2), _model("llama", layers=2)
  assert lora.base_fingerprint(a) == lora.base_fingerprint(b)
  before = lora.base_fingerprint(a)
  lora.apply_lora(a, lora.LoRAConfig(rank=2, alpha=2), key=jax.random.key(0))
  assert lora.base_fingerprint(a) == before  # adapters are not part of the identity
  _randomise_b(a)
  assert lora.base_fingerprint(a) == before
  w = b.layers[1].mlp.down
  w.set_value(w.get_value().at[3, 5].add(1e-6))  # one element, one ulp-ish
  assert lora.base_fingerprint(b) != before
  c = _model("llama", layers=2)
  c.layers[0].attn.q.set_value(jnp.swapaxes(c.layers[0].attn.q.get_value(), 1, 1)[:, ::-1])  # permuted heads
  assert lora.base_fingerprint(c) != before


# --------------------------------------------------------------------------------------------
# Sampling


def test_generate_runs_on_adapted_and_merged_models():
  model = _model("llama")
  lora.apply_lora(model, lora.LoRAConfig(rank=4, alpha=8, dropout=0.2), key=jax.random.key(0))
  _randomise_b(model, std=0.2)
  prompts, pmask = _batch(96, length=5)
  cfg = sampling.SamplingConfig(num_samples=2, max_new_tokens=6, pad_id=0)
  kw = dict(key=jax.random.key(3), temperature=1.0)
  adapted = sampling.generate(model, prompts, pmask, cfg, **kw)
  merged = sampling.generate(lora.merge_lora(model), prompts, pmask, cfg, **kw)
  np.testing.assert_allclose(np.asarray(adapted.log_probs), np.asarray(merged.log_probs), atol=1e-4)
  np.testing.assert_array_equal(np.asarray(adapted.completions), np.asarray(merged.completions))
  # SamplingConfig(merge_lora=True): generate merges the adapted model itself, the same program and numbers
  by_field = sampling.generate(model, prompts, pmask, dataclasses.replace(cfg, merge_lora=True), **kw)
  for name in ("completions", "mask", "log_probs"):
    np.testing.assert_array_equal(np.asarray(getattr(by_field, name)), np.asarray(getattr(merged, name)), name)
  # the reference model samples exactly what the base model samples (no dropout at sampling time)
  base = _model("llama")
  ref = sampling.generate(lora.reference_model(model), prompts, pmask, cfg, **kw)
  np.testing.assert_array_equal(
    np.asarray(ref.log_probs), np.asarray(sampling.generate(base, prompts, pmask, cfg, **kw).log_probs)
  )


@pytest.mark.slow
def test_bench_lora_smoke(capsys):
  import importlib.util
  import os

  path = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_lora.py")
  spec = importlib.util.spec_from_file_location("bench_lora", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  res = bench.main(["--tiny", "--layers", "1", "--in-process", "--steps", "1"])
  assert set(res) == {"full", "lora", "qlora"}
  assert res["full"]["adapter_params"] == 0 and res["lora"]["adapter_params"] > 0
  assert res["lora"]["opt_state_bytes"] < res["full"]["opt_state_bytes"]
  # the library's step and reference: a reference copy for full fine-tuning only, a smaller compiled step
  assert res["full"]["reference_copy_bytes"] == res["full"]["param_bytes"] and res["lora"]["reference_copy_bytes"] == 0
  assert res["lora"]["step_footprint_bytes"] < res["full"]["step_footprint_bytes"]
  assert res["qlora"]["param_bytes"] < res["lora"]["param_bytes"]
  assert res["lora"]["decode_merged_tokens_per_s"] > 0 and res["qlora"]["merge_s"] >= 0
  assert "opt state" in capsys.readouterr().out


def test_token_dropout_keys_fold_each_rows_key_with_the_tokens_position():
  """``token_dropout_keys``: token (n, s) gets ``fold_in(row_keys[rows[n, s]], positions[n, s])``, one fold at a
  time in Python here; without ``rows`` row n's key; raw ``uint32[B, 2]`` keys are wrapped."""
  from jaxgrpo.models.log_probs import token_dropout_keys

  row_keys = jax.random.split(jax.random.key(3), 4)
  positions = np.array([[0, 1, 2], [5, 0, 1]], np.int32)
  rows = np.array([[3, 3, 0], [1, 2, 2]], np.int32)
  data = lambda k: np.asarray(jax.random.key_data(k))
  got = data(token_dropout_keys(row_keys, jnp.asarray(positions), jnp.asarray(rows)))
  for n in range(2):
    for s in range(3):
      want = data(jax.random.fold_in(row_keys[rows[n, s]], int(positions[n, s])))
      np.testing.assert_array_equal(got[n, s], want, err_msg=f"({n}, {s})")
  by_row = data(token_dropout_keys(jax.random.key_data(row_keys[:2]), jnp.asarray(positions)))
  np.testing.assert_array_equal(by_row[1, 0], data(jax.random.fold_in(row_keys[1], 5)))
