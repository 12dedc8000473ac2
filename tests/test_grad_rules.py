"""The hand-written gradients (custom VJPs) equal autodiff of plain references.

- ``jaxgrpo.models.log_probs.head_log_probs`` (the LM head's log-prob / entropy kernel, used by
  ``chunked_log_probs`` for every ``CausalLM``): log-probs, entropies and gradients w.r.t. the hidden
  states and the head weight equal (i) autodiff of full ``[B, T, V]`` logits written here with
  ``jax.nn.log_softmax`` and (ii) the previous path (the chunk under ``jax.checkpoint``), at V = 32000,
  D = 256, tied and untied, temperature ≠ 1, with and without the entropy's gradient, float32 and
  bfloat16 compute, chunk sizes that do and do not divide T;
- the attention softmax and SwiGLU rules: the same forward values bit for bit, gradients equal to
  autodiff of ``jax.nn.softmax`` / ``jax.nn.silu(g) * u``;
- ``forward_mode=True`` (plain autodiff instead of the three custom VJPs): ``jax.jvp`` and
  ``jax.linearize`` through ``log_probs`` / ``completion_log_probs``.

``scripts/bench_head.py`` (smoke-tested here) shows what they save.
"""

from __future__ import annotations

import functools
import importlib
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgrpo.models import Qwen3Config, build_model
from jaxgrpo.models.log_probs import chunked_log_probs, head_log_probs

_log_probs = importlib.import_module("jaxgrpo.models.log_probs")
_attention = importlib.import_module("jaxgrpo.models.attention")
_llama = importlib.import_module("jaxgrpo.models.llama")

V, D, B, T = 32000, 256, 2, 12


@functools.cache
def _model(tied: bool, dtype):
  """A 1-layer Qwen3 with V = 32000, D = 256 (float32 parameters, ``dtype`` compute), its parameters
  drawn with NumPy (no compiled initialiser: only the head is used here)."""
  cfg = Qwen3Config(
    vocab_size=V,
    hidden_size=D,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    intermediate_size=32,
    tie_word_embeddings=tied,
  )
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0), dtype=dtype)))
  rng = np.random.default_rng(11)
  state = jax.tree.map(lambda a: jnp.asarray(0.05 * rng.standard_normal(a.shape, np.float32), a.dtype), abstract)
  return nnx.merge(graphdef, state)


def _reference(w, h, tgt, c_logp, c_ent, *, tied, dtype, temperature, entropy_grad):
  """Full float32 logits of the head's rounded operands, autodiff through ``jax.nn.log_softmax``."""
  h = h.astype(dtype).astype(jnp.float32)
  w = w.astype(dtype).astype(jnp.float32)
  z = jnp.einsum("btd,vd->btv" if tied else "btd,dv->btv", h, w, precision="highest") / temperature
  logp_all = jax.nn.log_softmax(z, axis=-1)
  logp = jnp.take_along_axis(logp_all, tgt[..., None], axis=-1)[..., 0]
  ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  ent_term = ent if entropy_grad else jax.lax.stop_gradient(ent)
  return jnp.sum(c_logp * logp) + jnp.sum(c_ent * ent_term), (logp, ent)


def _library(graphdef, name, state, h, tgt, c_logp, c_ent, *, temperature, chunk_size, entropy_grad, keep=False):
  """Loss, (logp, entropy) and gradients w.r.t. (head weight ``state[name]``, hidden) through
  ``chunked_log_probs`` (traced: call inside ``jax.jit``); ``keep``: its ``keep_logits``."""

  def loss(st, h):
    logp, ent = chunked_log_probs(
      nnx.merge(graphdef, st),
      h,
      tgt,
      temperature=temperature,
      chunk_size=chunk_size,
      with_entropy=True,
      entropy_grad=entropy_grad,
      keep_logits=keep,
    )
    return jnp.sum(c_logp * logp) + jnp.sum(c_ent * ent), (logp, ent)

  (value, aux), (d_state, dh) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, h)
  return value, aux, (d_state[name][...], dh)


def _rel_err(actual, expected):
  """``max |actual − expected| / max |expected|`` in float32."""
  actual, expected = actual.astype(jnp.float32), expected.astype(jnp.float32)
  return jnp.max(jnp.abs(actual - expected)) / jnp.maximum(jnp.max(jnp.abs(expected)), 1e-30)


def _close(actual, expected, rtol, what):
  err = float(_rel_err(jnp.asarray(actual), jnp.asarray(expected)))
  assert err <= rtol, f"{what}: max |Δ| / max |ref| = {err:.2e} > {rtol:.0e}"


CASES = [  # tied, dtype, temperature, entropy_grad, chunk_size (T = 12)
  (True, jnp.float32, 0.7, True, 5),  # 5 does not divide 12: a padded last chunk
  # without entropy_grad the random entropy cotangent must add nothing (the reference stops its gradient)
  (False, jnp.float32, 1.3, False, 4),
  (True, jnp.bfloat16, 1.3, False, 5),
  (False, jnp.bfloat16, 0.7, True, 4),
]


@pytest.mark.parametrize("tied,dtype,temperature,entropy_grad,chunk_size", CASES)
def test_head_log_probs_equal_full_logits_autodiff_and_the_checkpoint_path(
  tied, dtype, temperature, entropy_grad, chunk_size
):
  model = _model(tied, dtype)
  graphdef, state = nnx.split(model)
  name = "embed_tokens" if tied else "lm_head"  # only the head reads it here
  rng = np.random.default_rng(7)
  h = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32).astype(dtype)
  tgt = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
  c_logp = jnp.asarray(rng.standard_normal((B, T)), jnp.float32)
  c_ent = jnp.asarray(rng.standard_normal((B, T)), jnp.float32)
  kw = dict(temperature=temperature, chunk_size=chunk_size, entropy_grad=entropy_grad)
  ref_kw = dict(tied=tied, dtype=dtype, temperature=temperature, entropy_grad=entropy_grad)

  @jax.jit  # the three programs in one compile; their differences reduced to scalars here
  def errors(state, h, tgt, c_logp, c_ent):
    value, (logp, ent), (dw, dh) = _library(graphdef, name, state, h, tgt, c_logp, c_ent, **kw)
    with mock.patch.object(_log_probs, "_uses_head_kernel", lambda m: False):  # the previous path
      _, (logp_old, ent_old), (dw_old, dh_old) = _library(graphdef, name, state, h, tgt, c_logp, c_ent, **kw)
      _, (logp_ck, ent_ck), (dw_ck, dh_ck) = _library(graphdef, name, state, h, tgt, c_logp, c_ent, keep=True, **kw)
    _, (logp_k, ent_k), (dw_k, dh_k) = _library(graphdef, name, state, h, tgt, c_logp, c_ent, keep=True, **kw)
    ref = jax.value_and_grad(functools.partial(_reference, **ref_kw), argnums=(0, 1), has_aux=True)
    (_, (logp_ref, ent_ref)), (dw_ref, dh_ref) = ref(state[name][...], h, tgt, c_logp, c_ent)
    assert dh.dtype == dh_old.dtype == dh_k.dtype == h.dtype and dw.dtype == dw_old.dtype == jnp.float32
    kept = {  # keep_logits: the forward's logits instead of the recompute, in the kernel and in plain autodiff
      f"{what} ({path}, logits kept)": _rel_err(x, ref)
      for path, (lp, en, dw_x, dh_x) in (
        ("kernel", (logp_k, ent_k, dw_k, dh_k)),
        ("autodiff", (logp_ck, ent_ck, dw_ck, dh_ck)),
      )
      for what, x, ref in (
        ("logp vs full logits", lp, logp_ref),
        ("entropy vs full logits", en, ent_ref),
        ("d hidden vs full-logits autodiff", dh_x, dh_ref),
        ("d head weight vs full-logits autodiff", dw_x, dw_ref),
      )
    }
    return value, kept | {
      "logp vs checkpoint path": _rel_err(logp, logp_old),
      "entropy vs checkpoint path": _rel_err(ent, ent_old),
      "logp vs full logits": _rel_err(logp, logp_ref),
      "entropy vs full logits": _rel_err(ent, ent_ref),
      "d hidden vs full-logits autodiff": _rel_err(dh, dh_ref),
      "d head weight vs full-logits autodiff": _rel_err(dw, dw_ref),
      "d hidden vs checkpoint path": _rel_err(dh, dh_old),
      "d head weight vs checkpoint path": _rel_err(dw, dw_old),
    }

  value, errs = errors(state, h, tgt, c_logp, c_ent)
  assert np.isfinite(float(value))
  # forward: the same operations as before; float32 gradients within summation-order rounding;
  # bfloat16 ones within the rounding of the head's cotangents to bfloat16 (both paths round alike)
  for what, err in errs.items():
    rtol = 1e-6 if what.startswith(("logp", "entropy")) else 1e-5 if dtype == jnp.float32 else 1e-2
    assert float(err) <= rtol, f"{what}: max |Δ| / max |ref| = {float(err):.2e} > {rtol:.0e}"


@pytest.mark.parametrize("chunk_size", [4, 5])
def test_kept_logits_skip_the_recompute_matmul(chunk_size):
  """``keep_logits`` (``TrainConfig.head_logits: keep``): the compiled gradient of the chunked head has one head
  matmul less, ``2·B·C·V·D`` FLOPs (XLA's count of the chunk loop's body, which it counts once), and the kept
  float32 logits are the price. (Unchunked, XLA already merges the recompute with the forward's identical product.)"""
  model = _model(True, jnp.float32)
  graphdef, state = nnx.split(model)
  rng = np.random.default_rng(3)
  h = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
  tgt = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
  c = jnp.asarray(rng.standard_normal((B, T)), jnp.float32)

  def flops(keep):
    kw = dict(temperature=1.0, chunk_size=chunk_size, entropy_grad=False, keep=keep)
    fn = jax.jit(lambda st, h: _library(graphdef, "embed_tokens", st, h, tgt, c, 0 * c, **kw)[2])
    analysis = fn.lower(state, h).compile().cost_analysis()
    return (analysis[0] if isinstance(analysis, list) else analysis)["flops"]

  saved = flops(False) - flops(True)
  assert saved == pytest.approx(2 * B * chunk_size * V * D, rel=1e-3), saved


def test_train_config_head_logits_is_checked():
  from jaxgrpo.step.train import TrainConfig

  assert TrainConfig().head_logits == "recompute" and TrainConfig(head_logits="keep").head_logits == "keep"
  with pytest.raises(ValueError, match="`head_logits` must be one of 'recompute', 'keep'; got 'store'"):
    TrainConfig(head_logits="store")


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_head_matmul_grads_are_products_in_the_compute_dtype_accumulated_in_float32(tied, dtype):
  """The head kernel's backward products on an accelerator (``log_probs._head_matmul_grads``): the logits'
  float32 cotangent rounded to the compute dtype, times the weight / the hidden states, summed in float32 —
  against NumPy float64 of the same rounded operands (∂h = g·w, ∂w = gᵀ·h tied; ∂h = g·wᵀ, ∂w = hᵀ·g untied)."""
  rng = np.random.default_rng(3)
  shape_w = (24, 16) if tied else (16, 24)  # [V, D] tied, [D, V] untied
  w = jnp.asarray(rng.standard_normal(shape_w), jnp.float32).astype(dtype)
  h = jnp.asarray(rng.standard_normal((2, 5, 16)), jnp.float32).astype(dtype)
  g = jnp.asarray(rng.standard_normal((2, 5, 24)), jnp.float32)
  dw, dh = jax.jit(lambda w, h, g: _log_probs._head_matmul_grads(w, h, g, tied=tied, dtype=dtype))(w, h, g)
  assert dw.dtype == w.dtype and dh.dtype == h.dtype
  g64 = np.asarray(g.astype(dtype), np.float64).reshape(10, 24)
  w64, h64 = np.asarray(w, np.float64), np.asarray(h, np.float64).reshape(10, 16)
  v_by_d = w64 if tied else w64.T
  dh_ref = (g64 @ v_by_d).reshape(2, 5, 16)
  dw_ref = g64.T @ h64 if tied else h64.T @ g64
  rtol = 1e-6 if dtype == jnp.float32 else 2**-8  # the float32 sum rounded once to bfloat16
  _close(dh, dh_ref, rtol, "d hidden")
  _close(dw, dw_ref, rtol, "d head weight")


def test_head_log_probs_rejects_bad_input():
  w, h, tgt = jnp.zeros((16, 4)), jnp.zeros((2, 3, 4)), jnp.zeros((2, 3), jnp.int32)
  kw = dict(tied=True, dtype=jnp.float32)
  with pytest.raises(ValueError, match="`w` must be"):
    head_log_probs(jnp.zeros((16,)), h, tgt, **kw)
  with pytest.raises(ValueError, match=r"`hidden` must be \[B, C, 4\]"):
    head_log_probs(w, jnp.zeros((2, 3, 5)), tgt, **kw)
  with pytest.raises(ValueError, match="`targets` shape"):
    head_log_probs(w, h, tgt[:, :2], **kw)
  with pytest.raises(TypeError, match="integer"):
    head_log_probs(w, h, tgt.astype(jnp.float32), **kw)
  with pytest.raises(ValueError, match="temperature"):
    head_log_probs(w, h, tgt, temperature=0.0, **kw)
  with pytest.raises(ValueError, match="entropy_grad"):
    head_log_probs(w, h, tgt, entropy_grad=True, **kw)


def test_attention_softmax_rule():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 2, 3, 5, 7)).astype(np.float32) * 3
  x[0, 0, 0, 1] = -1e30  # a fully masked (padding) query row: uniform, as jax.nn.softmax gives
  x[1, 1, 2, 3, 4:] = -1e30
  x = jnp.asarray(x)
  g = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  np.testing.assert_array_equal(np.asarray(_attention._attention_softmax(x)), np.asarray(jax.nn.softmax(x, axis=-1)))
  got = jax.grad(lambda x: jnp.sum(g * _attention._attention_softmax(x)))(x)
  want = jax.grad(lambda x: jnp.sum(g * jax.nn.softmax(x, axis=-1)))(x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
def test_swiglu_rule(dtype, tol):
  rng = np.random.default_rng(1)
  g, u, ct = (jnp.asarray(rng.standard_normal((3, 5, 64)) * 4, jnp.float32).astype(dtype) for _ in range(3))
  np.testing.assert_array_equal(np.asarray(_llama.swiglu(g, u), np.float32), np.asarray(jax.nn.silu(g) * u, np.float32))
  got = jax.grad(lambda g, u: jnp.sum((ct * _llama.swiglu(g, u)).astype(jnp.float32)), argnums=(0, 1))(g, u)
  want = jax.grad(lambda g, u: jnp.sum((ct * (jax.nn.silu(g) * u)).astype(jnp.float32)), argnums=(0, 1))(g, u)
  for a, b, what in zip(got, want, ("d gate", "d up")):
    assert a.dtype == b.dtype
    _close(a, b, tol, what)


def test_bench_head_smoke(capsys):
  path = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_head.py")
  spec = importlib.util.spec_from_file_location("bench_head", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  args = "--head-only --vocab 256 --hidden 32 --batch 4 --length 6 --micro-batches 2 --chunk-size 4 --rounds 1"
  res = bench.main(args.split())
  out = capsys.readouterr().out
  assert "| +head |" in out and "ratio" in out
  assert set(res) == {"head", "head_times"} and set(res["head"]) == set(res["head_times"]) == {"autodiff", "+head"}
  assert all(s["flops"] > 0 and s["bytes"] > 0 for s in res["head"].values())


# ----------------------------------------------------------------------------- forward mode (issue 23.6)


def _tree_vdot(a, b):
  return sum(
    jnp.vdot(x.astype(jnp.float32), y.astype(jnp.float32)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


@pytest.mark.slow  # ~15 s per case on an idle 2-core CPU (one compile of jvp, linearize, vjp and 2 forwards)
@pytest.mark.parametrize("which", ["log_probs", "completion_log_probs"])
def test_forward_mode_jvp_and_linearize_through_the_log_probs(which):
  """``forward_mode=True``: the same log-probs; ``jax.jvp`` and ``jax.linearize`` work (the default's
  custom VJPs refuse forward mode) and give the directional derivative ``J·t`` of the log-probs in a
  random parameter direction ``t``: equal to central finite differences, and ``c·(J·t)`` equal to
  ``(Jᵀc)·t`` from reverse mode through the hand-written gradients (an independent path)."""
  from helpers import tiny_model

  from jaxgrpo.models import completion_log_probs, log_probs

  graphdef, params, rest = nnx.split(tiny_model(layers=1), nnx.Param, ...)
  rng = np.random.default_rng(5)
  tokens = jnp.asarray(rng.integers(0, 128, (3, 9)), jnp.int32)
  mask = jnp.asarray(np.arange(9)[None, :] >= np.array([[0], [3], [1]]))  # left padding

  def f(p, forward_mode=True):
    model = nnx.merge(graphdef, p, rest)
    if which == "log_probs":
      return log_probs(model, tokens, mask, temperature=0.8, chunk_size=3, forward_mode=forward_mode)
    logp, _ = completion_log_probs(
      model,
      tokens[:, :4],
      mask[:, :4],
      tokens[:, 4:],
      mask[:, 4:] | True,
      temperature=0.8,
      chunk_size=2,
      forward_mode=forward_mode,
    )
    return logp

  # a direction on the parameters' own scale (their init std is 0.02): central differences stay linear
  t = jax.tree.map(lambda x: jnp.asarray(0.02 * rng.standard_normal(x.shape), x.dtype), params)
  c = jnp.asarray(
    rng.standard_normal(jax.eval_shape(lambda p: f(p, False), params).shape), jnp.float32
  )  # no eager forward

  @jax.jit
  def run(p, t, c):
    value, jt = jax.jvp(f, (p,), (t,))
    lin_value, f_jvp = jax.linearize(f, p)
    default, vjp = jax.vjp(lambda p: f(p, False), p)
    eps = 1e-2
    plus = f(jax.tree.map(lambda x, d: x + eps * d, p, t))
    minus = f(jax.tree.map(lambda x, d: x - eps * d, p, t))
    return (
      value,
      jt,
      lin_value,
      f_jvp(t),
      f_jvp(jax.tree.map(lambda d: 2 * d, t)),
      default,
      vjp(c)[0],
      (plus - minus) / (2 * eps),
    )

  value, jt, lin_value, lin_jt, lin_2jt, default, jtc, fd = run(params, t, c)
  np.testing.assert_allclose(value, default, rtol=1e-6, atol=1e-6)  # the same log-probs
  np.testing.assert_array_equal(lin_value, value)
  np.testing.assert_allclose(lin_jt, jt, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(lin_2jt, 2 * jt, rtol=1e-6, atol=1e-6)  # linear in the tangent
  assert float(jnp.max(jnp.abs(jt))) > 1e-2  # a real direction, not a zero tangent
  _close(fd, jt, 3e-3, "jvp vs central finite differences")
  got, want = float(jnp.vdot(c, jt)), float(_tree_vdot(jtc, t))
  assert got == pytest.approx(want, rel=1e-4), "c·(J·t) vs (Jᵀc)·t through the hand-written gradients"
  with pytest.raises(TypeError, match="forward-mode autodiff"):  # why the flag exists (refused while tracing)
    jax.jit(lambda p, t: jax.jvp(lambda p: f(p, False), (p,), (t,)))(params, t)
  with pytest.raises(TypeError, match="`forward_mode` must be a bool"):
    log_probs(nnx.merge(graphdef, params, rest), tokens, mask, forward_mode=1)
