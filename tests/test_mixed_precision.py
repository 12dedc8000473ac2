"""Mixed precision on the CPU (``jaxgrpo.models.layers.dense``): bf16 operands run as a native bf16 × bf16 →
float32 dot, forward and backward, against a NumPy reference of the bf16-rounded operands (``cpu_bf16_dots
("native")``, the default where AMX is granted), or as float32 products of the same operands (``"float32"``, the
default without AMX: scripts/no_amx.py's test checks the choice); float32 operands keep the plain float32 dot; the
attention einsums that XLA:CPU cannot run in bf16 × bf16 → f32 (they keep the float32 upcast) still run in a
mixed-precision model's cached prefill, decode and gradient, with either kind of dense product."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgrpo import models
from jaxgrpo.models.backend import cpu_bf16_dots, cpu_kv_cache
from jaxgrpo.models.layers import dense, forward_mode_autodiff
from jaxgrpo.models.log_probs import completion_log_probs

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's dot lowering")


@pytest.fixture
def native():
  with cpu_bf16_dots("native"):  # whatever this CPU's default
    yield


BF16_ULP = 2.0**-8  # relative spacing of bfloat16 (8 significand bits)


def _bf16(a):
  """``a`` rounded to bfloat16, back in float64 (the operand values the dot really multiplies)."""
  return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)


def _dot_operand_types(fn, *args) -> list[str]:
  """The ``(lhs, rhs) -> out`` element types of every dot_general in ``fn``'s lowered StableHLO."""
  text = jax.jit(fn).lower(*args).as_text()
  out = []
  for line in text.splitlines():
    if "stablehlo.dot_general" in line:
      out.append(line.rsplit(":", 1)[1].strip())
  return out


@pytest.mark.parametrize("transpose_w", [False, True])
def test_bf16_dense_is_a_native_f32_accumulated_dot_forward_and_backward(native, transpose_w):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 5, 24))
  w = rng.normal(size=(40, 24) if transpose_w else (24, 40))
  c = rng.normal(size=(3, 5, 40))  # the cotangent of the float32 output
  xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
  w_cf = _bf16(w).T if transpose_w else _bf16(w)  # [C, O]

  def f(x, w):
    return dense(x, w, transpose_w=transpose_w, preferred_element_type=jnp.float32)

  y = f(xb, wb)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y), _bf16(x) @ w_cf, rtol=1e-5, atol=1e-5)  # f32 accumulation of exact products
  (dx, dw) = jax.grad(lambda x, w: jnp.sum(f(x, w) * jnp.asarray(c, jnp.float32)), argnums=(0, 1))(xb, wb)
  assert dx.dtype == dw.dtype == jnp.bfloat16
  cb = _bf16(c)  # the backward multiplies the cotangent rounded to bf16
  want_dx = cb @ w_cf.T
  want_dw = np.einsum("tc,to->co", _bf16(x).reshape(-1, 24), cb.reshape(-1, 40))
  want_dw = want_dw.T if transpose_w else want_dw
  for got, want in ((dx, want_dx), (dw, want_dw)):  # one bf16 rounding of the float32 result
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=BF16_ULP, atol=BF16_ULP * np.abs(want).max())
  # no upcast: every dot of the forward and of the gradient takes bf16 operands and returns float32
  sigs = _dot_operand_types(jax.value_and_grad(lambda x, w: jnp.sum(f(x, w)), argnums=(0, 1)), xb, wb)
  assert len(sigs) == 3, sigs
  assert all(s.count("bf16>") == 2 and s.endswith("xf32>") for s in sigs), sigs


def test_bf16_projection_rounds_the_f32_accumulation_and_f32_operands_keep_the_plain_dot(native):
  rng = np.random.default_rng(1)
  x, w = rng.normal(size=(7, 32)), rng.normal(size=(32, 16))
  y = dense(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16))  # a projection: bf16 out
  assert y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y, np.float64), _bf16(np.asarray(_bf16(x) @ _bf16(w), np.float32)))
  x32, w32 = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)  # float32: the same ops as before
  np.testing.assert_array_equal(np.asarray(dense(x32, w32)), np.asarray(jax.jit(jnp.dot)(x32, w32)))
  sigs = _dot_operand_types(lambda a, b: dense(a, b), x32, w32)
  assert len(sigs) == 1 and "bf16" not in sigs[0], sigs
  with forward_mode_autodiff():  # a custom_vjp has no forward mode: the upcast path there
    _, t = jax.jvp(
      lambda a: dense(a, jnp.asarray(w, jnp.bfloat16)),
      (jnp.asarray(x, jnp.bfloat16),),
      (jnp.ones((7, 32), jnp.bfloat16),),
    )
  np.testing.assert_allclose(np.asarray(t, np.float64), np.ones((7, 32)) @ _bf16(w), rtol=BF16_ULP)


@pytest.mark.parametrize("transpose_w", [False, True])
def test_float32_products_of_bf16_operands_forward_and_backward(transpose_w):
  """``cpu_bf16_dots("float32")`` (the default without AMX): every dot of the forward and the gradient takes
  float32 operands; the values are the native path's (exact products, float32 sums, one rounding to bf16)."""
  rng = np.random.default_rng(3)
  x = rng.normal(size=(3, 5, 24))
  w = rng.normal(size=(40, 24) if transpose_w else (24, 40))
  c = rng.normal(size=(3, 5, 40))
  xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
  w_cf = _bf16(w).T if transpose_w else _bf16(w)
  with cpu_bf16_dots("float32"):

    def f(x, w, out=jnp.float32):
      return dense(x, w, transpose_w=transpose_w, preferred_element_type=out)

    y, proj = f(xb, wb), f(xb, wb, None)
    assert y.dtype == jnp.float32 and proj.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y), _bf16(x) @ w_cf, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(proj, np.float64), _bf16(x) @ w_cf, rtol=BF16_ULP, atol=1e-5)
    (dx, dw) = jax.grad(lambda x, w: jnp.sum(f(x, w) * jnp.asarray(c, jnp.float32)), argnums=(0, 1))(xb, wb)
    assert dx.dtype == dw.dtype == jnp.bfloat16
    want_dx = c @ w_cf.T  # the float32 cotangent: not rounded to bf16 on this path
    want_dw = np.einsum("tc,to->co", _bf16(x).reshape(-1, 24), c.reshape(-1, 40))
    want_dw = want_dw.T if transpose_w else want_dw
    for got, want in ((dx, want_dx), (dw, want_dw)):
      np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=BF16_ULP, atol=BF16_ULP * np.abs(want).max())
    sigs = _dot_operand_types(jax.value_and_grad(lambda x, w: jnp.sum(f(x, w)), argnums=(0, 1)), xb, wb)
    assert len(sigs) == 3 and not any("bf16" in s for s in sigs), sigs
  with pytest.raises(ValueError, match=r"mode must be one of \('auto', 'native', 'float32'\); got 'fp32'"):
    with cpu_bf16_dots("fp32"):
      pass


def _tiny_qwen3(num_layers: int) -> models.Qwen3Config:
  """A tiny tied Qwen3 (V 64, D 32, 4 query / 2 kv heads of 8) for the model-level tests."""
  return models.Qwen3Config(
    vocab_size=64,
    hidden_size=32,
    num_layers=num_layers,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    tie_word_embeddings=True,
    max_position_embeddings=64,
  )


@pytest.mark.parametrize("mode", ["native", "float32"])
def test_mixed_precision_model_runs_cached_prefill_decode_and_gradient(mode):
  """bf16 compute over float32 parameters: the batched attention einsums (kept upcast) and the native dense dots
  run together in the cached prefill (keys laid out [B, N, K, T]), a decode step and the log-prob gradient."""
  cfg = _tiny_qwen3(num_layers=1)
  f32 = models.build_model(cfg, rngs=nnx.Rngs(0))
  mixed = models.build_model(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.float32)
  tokens = jnp.asarray(np.random.default_rng(2).integers(1, 64, (2, 12)), jnp.int32)
  mask = jnp.ones((2, 12), bool)

  def prefill_then_decode(model):
    cache = model.init_cache(2, 16)
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
    h, cache = model(tokens[:, :11], pos[:, :11], attention_mask=mask[:, :11], cache=cache)
    h2, _ = model(tokens[:, 11:], pos[:, 11:], attention_mask=mask[:, 11:], cache=cache)
    return model.logits(jnp.concatenate([h, h2], axis=1), out_dtype=jnp.float32)

  with cpu_bf16_dots(mode):
    got, want = jax.jit(prefill_then_decode)(mixed), jax.jit(prefill_then_decode)(f32)
  assert np.abs(np.asarray(got) - np.asarray(want)).max() < 0.05 * np.abs(np.asarray(want)).max()

  def loss(model):
    lp, _ = completion_log_probs(model, tokens[:, :4], mask[:, :4], tokens[:, 4:], mask[:, 4:])
    return jnp.sum(lp)

  with cpu_bf16_dots(mode):
    g_mixed = nnx.grad(loss)(mixed)
    g_f32 = nnx.grad(loss)(f32)
  a, b = g_mixed["embed_tokens"][...], g_f32["embed_tokens"][...]
  assert a.dtype == jnp.float32  # the gradient of float32 parameters
  assert np.abs(np.asarray(a) - np.asarray(b)).max() < 0.05 * np.abs(np.asarray(b)).max()


@pytest.mark.parametrize("mode", ["native", "float32"])
def test_bf16_kv_cache_holds_bf16_values_in_float32_and_samples_as_a_bf16_cache(mode):
  """On the CPU a bf16 model's KV cache is float32 (``backend.kv_cache_dtype``: XLA:CPU would otherwise write a
  float32 copy of the whole cache at every decode step): it holds exactly the bf16-rounded keys and values, and
  the sampler draws the same tokens with the same log-probs as from a bf16 cache (``cpu_kv_cache("compute")``, the
  cache of before, half the bytes)."""
  from jaxgrpo.rollout import sampling

  cfg = _tiny_qwen3(num_layers=2)
  mixed = models.build_model(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.float32)
  assert models.build_model(cfg, rngs=nnx.Rngs(0)).init_cache(2, 16).k[0].dtype == jnp.float32
  prompts = jnp.asarray(np.random.default_rng(3).integers(1, 64, (2, 6)), jnp.int32)
  pmask = jnp.ones(prompts.shape, bool)
  cfg_s = sampling.SamplingConfig(num_samples=3, max_new_tokens=10, top_p=1.0, top_k=0, pad_id=0)

  def run(cache_mode="float32"):
    with cpu_bf16_dots(mode), cpu_kv_cache(cache_mode):
      cache = mixed.init_cache(2, 16)
      pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
      _, cache = jax.jit(lambda m, c: m(prompts, pos, attention_mask=pmask, cache=c))(mixed, cache)
      r = sampling.generate(mixed, prompts, pmask, cfg_s, key=jax.random.key(5))
    return cache, r

  cache, r = run()
  assert cache.k[0].dtype == cache.v[1].dtype == jnp.float32
  for x in (*cache.k, *cache.v):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32)))
  jax.clear_caches()  # the programs are traced again, under the other cache mode
  cache_b, r_b = run("compute")
  assert cache_b.k[0].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(r.completions), np.asarray(r_b.completions))
  np.testing.assert_allclose(np.asarray(r.log_probs), np.asarray(r_b.log_probs), rtol=0, atol=1e-6)
  jax.clear_caches()


def test_cpu_kv_cache_refuses_an_unknown_mode_and_leaves_float32_models_alone():
  with pytest.raises(ValueError, match=r"cpu_kv_cache: mode must be one of \('float32', 'compute'\); got 'bf16'"):
    with cpu_kv_cache("bf16"):
      pass
  from jaxgrpo.models.backend import kv_cache_dtype

  with cpu_kv_cache("compute"):
    assert kv_cache_dtype(jnp.bfloat16) == jnp.bfloat16 and kv_cache_dtype(jnp.float32) == jnp.float32
  assert kv_cache_dtype(jnp.bfloat16) == jnp.float32 and kv_cache_dtype(jnp.float32) == jnp.float32


def test_the_run_says_when_bf16_is_slower_than_float32_here():
  """A run with ``model.dtype: bfloat16`` on CPU devices logs one line when its products run as float32 products
  (no AMX: ``cpu_bf16_dots`` "float32", the "auto" choice there), saying float32, the default, is faster there
  (BENCHMARKS.md run L: the bf16 rollout 4% slower on the AMD EPYC); nothing with native bf16 products or float32."""
  from jaxgrpo.parallel import sharding as shd
  from jaxgrpo.run import assemble
  from jaxgrpo.run.specs import load_config

  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  bf16, fp32 = load_config(None, {"model.dtype": "bfloat16"}), load_config(None, {})
  with cpu_bf16_dots("float32"):
    line = assemble.precision_line(bf16, mesh)
    assert line.startswith("precision: model.dtype bfloat16 on a CPU without AMX") and "float32, the default" in line
    assert assemble.precision_line(fp32, mesh) is None
  with cpu_bf16_dots("native"):
    assert assemble.precision_line(bf16, mesh) is None
