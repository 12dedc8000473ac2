"""Mixture of experts (jaxgrpo.models.moe): the sparse block against NumPy, grouped (ragged) dispatch ≡
one-hot, remat, routing replay through sampler → train step, router losses against transformers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hf_utils import sharp_moe_model, tiny_moe_config

from jaxgrpo import models
from jaxgrpo.kernels.config import preset
from jaxgrpo.models import lora, moe
from jaxgrpo.models.log_probs import completion_log_probs
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.parallel.target import target_platform
from jaxgrpo.rollout.sampling import SamplingConfig, generate
from jaxgrpo.step import train

pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")  # tests/conftest.py


@functools.lru_cache(maxsize=None)
def _model(family="qwen3_moe", seed=0, dtype=jnp.float32):
  """A random MoE model with O(1) router logits (routing that is far from uniform). Qwen3-MoE keeps its 3
  layers (a dense layer between two sparse ones); Qwen2-MoE, every layer sparse, gets 2 (two sparse layers
  and a layer below a router are all its tests need; each of its programs compiles faster)."""
  over = {"num_hidden_layers": 2} if family == "qwen2_moe" else {}
  return sharp_moe_model(tiny_moe_config(family, **over), seed, dtype)


def _np_swiglu(x, g, u, d):
  a = x @ g
  return (a / (1 + np.exp(-a)) * (x @ u)) @ d


def _np_block(block, x, experts=None):
  """The sparse block in NumPy (float64) from its formulas; ``experts`` [T, k] replays."""
  router = np.asarray(block.router[...], np.float64)
  gate, up, down = (np.asarray(w[...], np.float64) for w in (block.gate, block.up, block.down))
  z = x @ router
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  if experts is None:
    experts = np.argsort(-p, axis=-1, kind="stable")[:, : block.top_k]
  w = np.take_along_axis(p, experts, axis=-1)
  if block.norm_topk_prob:
    w = w / w.sum(-1, keepdims=True)
  y = np.zeros_like(x)
  for t in range(x.shape[0]):
    for j, e in enumerate(experts[t]):
      y[t] += w[t, j] * _np_swiglu(x[t], gate[e], up[e], down[e])
  if block.shared is not None:
    s = block.shared
    sg = np.asarray(block.shared_gate[...], np.float64)
    shared = _np_swiglu(x, *(np.asarray(v[...], np.float64) for v in (s.gate, s.up, s.down)))
    y += shared / (1 + np.exp(-(x @ sg)))
  return y, experts


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_block_matches_numpy_with_and_without_replay(family):
  block = _model(family).layers[0].mlp
  assert isinstance(block, moe.MoEBlock)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 5, 32))
  replay = np.stack([rng.permutation(block.num_experts)[: block.top_k] for _ in range(10)]).reshape(2, 5, -1)
  for dispatch in moe.DISPATCH:
    block.dispatch = dispatch
    run = jax.jit(lambda x, r: block(x, replay=r))  # eager op-by-op dispatch is slow on CPU
    for r in (None, replay):
      y, route = run(jnp.asarray(x, jnp.float32), None if r is None else jnp.asarray(r))
      want, experts = _np_block(block, x.reshape(10, 32), None if r is None else r.reshape(10, -1))
      np.testing.assert_allclose(np.asarray(y).reshape(10, 32), want, rtol=2e-4, atol=2e-5, err_msg=dispatch)
      np.testing.assert_array_equal(np.asarray(route.experts).reshape(10, -1), experts)
  block.dispatch = "tiled"


def _logp_and_grads(model, tokens, mask):
  def loss(m):
    lp, _ = completion_log_probs(m, tokens[:, :4], mask[:, :4], tokens[:, 4:], mask[:, 4:])
    return jnp.sum(lp), lp

  graphdef, state = nnx.split(model)
  f = jax.jit(lambda s: jax.grad(lambda s: loss(nnx.merge(graphdef, s)), has_aux=True)(s))
  grads, lp = f(state)
  return np.asarray(lp), {str(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}


def test_grouped_dispatches_equal_one_hot_and_remat_changes_nothing():
  """Values and gradients of every parameter (routers, experts, shared expert) agree between the
  tiled and ragged grouped dispatches, the one-hot baseline, and the tiled dispatch under full remat
  (tiles of 64 rows: 40 tokens × top-2 fill one partly, so padding rows are exercised)."""
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, 128, (4, 10)), jnp.int32)
  mask = jnp.asarray(np.arange(10)[None] >= np.array([0, 2, 1, 3])[:, None])
  base = _model("qwen2_moe")
  graphdef, state = nnx.split(base)
  results = {}
  variants = (
    ("tiled", "tiled", "none"),
    ("ragged", "ragged", "none"),
    ("dense", "dense", "none"),
    ("remat", "tiled", "full"),
  )
  for name, dispatch, remat in variants:
    model = nnx.merge(graphdef, state)
    moe.set_dispatch(model, dispatch)
    model.remat = models.RematPolicy.parse(remat)
    results[name] = _logp_and_grads(model, tokens, mask)
  lp0, g0 = results["tiled"]
  assert any("gate" in k and "layers" in k and np.abs(v).max() > 0 for k, v in g0.items())
  for name in ("ragged", "dense", "remat"):
    lp, g = results[name]
    np.testing.assert_allclose(lp, lp0, rtol=1e-5, atol=1e-5, err_msg=name)
    for k in g0:
      np.testing.assert_allclose(g[k], g0[k], rtol=1e-4, atol=1e-4 * np.abs(g0[k]).max(), err_msg=f"{name} {k}")


def _rollout(model, record=True, n_prompts=2, g=4, t=6):
  rng = np.random.default_rng(2)
  prompts = rng.integers(1, 128, (n_prompts, 5)).astype(np.int32)
  pmask = np.arange(5)[None] >= np.array([0, 2])[:n_prompts, None]
  sampling = SamplingConfig(num_samples=g, max_new_tokens=t, pad_id=0, record_routing=record)
  return generate(model, jnp.asarray(prompts), jnp.asarray(pmask), sampling, key=jax.random.key(0))


@nnx.jit
def _routed_log_probs(model, args, replay):
  """completion_log_probs under ``moe.routing_scope(replay=replay)``, compiled (one program with and one
  without replay, instead of hundreds of eager op compiles): the log-probs and the experts the forward used."""
  with moe.routing_scope(replay=replay) as scope:
    lp, _ = completion_log_probs(model, *args)
  return lp, scope.stacked().experts


def test_sampler_records_the_experts_a_full_forward_uses_and_replay_forces_them():
  """f32: the sampler's recorded experts (prefill + decode with the KV cache) are those a full
  forward over [prompt ‖ completion] routes to; with replay of other experts the forward uses exactly
  the replayed ones, and the recorded routing is the same sampled tokens with or without recording."""
  model = _model("qwen3_moe")
  r = _rollout(model)
  m, k = len(model.moe_layers), model.config.num_experts_per_tok
  n, p, t = r.completions.shape[0], r.prompt_tokens.shape[1], r.completions.shape[1]
  assert r.routing.shape == (n, p + t, m, k) and r.routing.dtype == jnp.uint8
  np.testing.assert_array_equal(np.asarray(_rollout(model, record=False).completions), np.asarray(r.completions))
  real = np.concatenate([np.asarray(r.prompt_mask), np.asarray(r.mask)], axis=1)
  real[:, -1] = False  # the last completion token is never fed to the sampler
  args = (r.prompt_tokens, r.prompt_mask, r.completions, r.mask)
  lp_free, free = _routed_log_probs(model, args, None)
  free = np.asarray(free)
  np.testing.assert_array_equal(free[real], np.asarray(r.routing)[real])
  lp_replay, used = _routed_log_probs(model, args, r.routing)
  np.testing.assert_array_equal(np.asarray(used), np.asarray(r.routing))
  np.testing.assert_allclose(np.asarray(lp_replay), np.asarray(lp_free), atol=1e-5)
  np.testing.assert_allclose(np.asarray(lp_replay), np.asarray(r.log_probs), atol=1e-4)
  other = (np.asarray(r.routing) + 1) % model.config.num_experts  # a different expert for every token
  lp_other, used = _routed_log_probs(model, args, jnp.asarray(other, r.routing.dtype))
  np.testing.assert_array_equal(np.asarray(used), other)
  assert np.abs(np.asarray(lp_other) - np.asarray(lp_free))[np.asarray(r.mask)].max() > 1e-3


def test_train_step_replays_the_rollout_routing():
  """The step's forward uses the batch's experts: a batch whose routing is replaced by other experts
  gives other log-probs (the ratio moves away from 1), the rollout's own routing gives ratio 1."""
  model = _model("qwen3_moe")
  r = _rollout(model)
  batch = train.Batch.from_rollout(r, np.arange(8, dtype=np.float32))
  assert batch.routing is r.routing
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.sgd(0.0)
  tc = train.TrainConfig()
  metrics = {}
  graphdef, _, sh = train.init_train_state(model, opt, mesh)
  step = train.make_train_step(graphdef, opt, preset("grpo"), mesh=mesh, shardings=sh, train_config=tc)
  for name, routing in (("own", r.routing), ("other", (np.asarray(r.routing) + 1) % 8)):
    _, state, _ = train.init_train_state(model, opt, mesh)  # a fresh state: the step donates it
    _, metrics[name] = step(state, batch._replace(routing=routing, ref_logp=np.asarray(r.log_probs)))
  assert abs(float(metrics["own"]["ratio_max"]) - 1) < 1e-4 and float(metrics["own"]["approx_kl"]) < 1e-7
  assert float(metrics["other"]["approx_kl"]) > 1e-3
  for m in range(2):
    assert 0 <= float(metrics["own"][f"moe/{m}/load_min"]) <= 1 / 8 <= float(metrics["own"][f"moe/{m}/load_max"])
  with pytest.raises(ValueError, match=r"batch.routing must be int\[B, P \+ T, M, k\]"):
    step.place_batch(batch._replace(routing=np.asarray(r.routing)[:, 1:]))


@functools.lru_cache(maxsize=None)
def _replay_batch():
  """test_prefix_sharing's batch (groups sharing prompts, completions over 3 tokens: shared completion prefixes,
  identical rows, a group with no shared prefix, an empty row) with routing to replay: the experts a free forward
  uses, each moved to the next expert — other experts than top-k everywhere, the same ones wherever two sequences
  share a prefix (the same tokens in the same context), as a sampler's record has them."""
  from test_prefix_sharing import _batch

  batch = _batch()
  model = _model("qwen3_moe")
  args = tuple(jnp.asarray(x) for x in (batch.prompt_tokens, batch.prompt_mask, batch.completions, batch.mask))
  lp_free, free = _routed_log_probs(model, args, None)
  other = jnp.asarray((np.asarray(free) + 1) % model.config.num_experts, jnp.uint8)
  lp_other, used = _routed_log_probs(model, args, other)
  np.testing.assert_array_equal(np.asarray(used), np.asarray(other))
  return batch._replace(routing=np.asarray(other)), np.asarray(lp_other), np.asarray(lp_free)


@functools.lru_cache(maxsize=None)
def _replay_step(packing, sharing="none"):
  """(parameters after one SGD step, metrics, the reference pass's log-probs) of λ-GRPO on :func:`_replay_batch`
  with its routing, packed into rows of ``packing`` tokens (None: unpacked)."""
  from helpers import flat_params
  from test_prefix_sharing import G

  batch, _, _ = _replay_batch()
  model = _model("qwen3_moe")
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.sgd(0.5)
  graphdef, state, sh = train.init_train_state(model, opt, mesh)
  tc = train.TrainConfig(group_size=G, micro_batches=2, packing=packing, prefix_sharing=sharing)
  ref = train.make_reference_fn(graphdef, mesh=mesh, param_shardings=sh.params, train_config=tc)
  ref_logp = np.asarray(ref(jax.tree.map(jnp.copy, state.params), batch))
  step = train.make_train_step(graphdef, opt, preset("lambda_grpo"), mesh=mesh, shardings=sh, train_config=tc)
  state, metrics = step(state, batch)
  return flat_params(state.params), {k: float(v) for k, v in metrics.items()}, ref_logp


@pytest.mark.parametrize("sharing", ["none", "tree"])
def test_packed_step_and_reference_replay_the_rollout_routing(sharing):
  """Routing replay composes with packing: the packed layout carries each token's recorded experts
  (``PackedSlots.routing``; with prefix sharing a shared token's one copy), so the packed reference pass gives the
  log-probs of the unpacked forward under the same replayed experts (not the free top-k routing's), and the packed
  step the unpacked step's update and metrics (router load and entropy included)."""
  batch, lp_other, lp_free = _replay_batch()
  mask = np.asarray(batch.mask)
  assert np.abs(lp_other - lp_free)[mask].max() > 1e-3  # the replayed experts change the log-probs
  packed = _replay_step(64, sharing)
  unpacked = _replay_step(None)
  np.testing.assert_allclose(packed[2][mask], lp_other[mask], atol=2e-5)
  np.testing.assert_allclose(unpacked[2][mask], lp_other[mask], atol=2e-5)
  for key in unpacked[0]:
    np.testing.assert_allclose(packed[0][key], unpacked[0][key], atol=1e-6, rtol=1e-5, err_msg=key)
  assert packed[1].keys() == unpacked[1].keys()
  for key in unpacked[1]:
    if not key.startswith("moe/"):
      assert packed[1][key] == pytest.approx(unpacked[1][key], rel=2e-5, abs=1e-6), key
  # the router's load is that of the replayed experts over the forward's tokens: every real token unpacked; packed,
  # the tokens of sequences with a completion token, each shared token once (and its branch copies) with sharing
  routing = np.asarray(batch.routing)
  real = np.concatenate([np.asarray(batch.prompt_mask), mask], axis=1)
  pk = train.pack_batch(batch, row_length=64, micro_batches=2, sharing=sharing).packed
  expected = {
    "unpacked": (unpacked[1], routing[real]),
    "packed": (
      packed[1],
      routing[real & mask.any(1)[:, None]] if sharing == "none" else pk.routing[pk.segment_ids > 0],
    ),
  }
  for name, (metrics, experts) in expected.items():
    for m in range(routing.shape[2]):
      share = np.bincount(experts[:, m].ravel(), minlength=8) / experts[:, m].size
      nz = share[share > 0]
      assert metrics[f"moe/{m}/load_min"] == pytest.approx(share.min(), abs=1e-6), (name, m)
      assert metrics[f"moe/{m}/load_max"] == pytest.approx(share.max(), abs=1e-6), (name, m)
      assert metrics[f"moe/{m}/load_entropy"] == pytest.approx(-(nz * np.log(nz)).sum(), abs=1e-5), (name, m)


def test_packing_moves_the_routing_with_its_tokens():
  """``pack_batch``: each packed column carries the routing of the rollout token it holds (every completion token's
  scored column: the experts recorded at ``(b, P + t)``), expert 0 on padding, in the routing's dtype;
  ``batch.routing`` becomes None; routing set on a batch packed without it is refused."""
  from jaxgrpo.step.batch import check_routing

  batch, _, _ = _replay_batch()
  routing = np.asarray(batch.routing)
  b, p = np.shape(batch.prompt_tokens)
  mask = np.asarray(batch.mask)
  for sharing in ("none", "prompt", "tree"):
    packed = train.pack_batch(batch, row_length=64, micro_batches=2, sharing=sharing)
    pk = packed.packed
    assert packed.routing is None and pk.routing.dtype == np.uint8
    assert pk.routing.shape == pk.tokens.shape + routing.shape[2:]
    assert not pk.routing[pk.segment_ids == 0].any()
    rows = pk.rows_per_slot
    flat = pk.routing.reshape((pk.head_index.shape[0], rows * 64) + routing.shape[2:])  # [S, Rs·L, M, k]
    for i, t in zip(*np.nonzero(mask)):
      s = pk.slot[i]
      column = pk.head_index[s, pk.unpack_index[i, t]]
      np.testing.assert_array_equal(flat[s, column], routing[i, p + t], err_msg=f"{sharing} ({i}, {t})")
  with pytest.raises(ValueError, match="already packed"):
    check_routing(train.pack_batch(batch._replace(routing=None), row_length=64)._replace(routing=routing), b, 16)


def test_record_routing_needs_a_moe_model():
  cfg = models.config_from_hf({**tiny_moe_config("qwen3_moe"), "model_type": "qwen3"})
  dense = models.build_model(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="record_routing=True needs a mixture-of-experts model"):
    _rollout(dense)


def test_load_balancing_loss_matches_transformers():
  torch = pytest.importorskip("torch")
  hf = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
  rng = np.random.default_rng(3)
  b, s, m, e, k = 3, 7, 2, 8, 2
  logits = rng.standard_normal((b, s, m, e)).astype(np.float32) * 2
  mask = np.arange(s)[None] >= np.array([0, 3, 1])[:, None]
  experts = np.argsort(-logits, axis=-1)[..., :k]
  lb_loss = jax.jit(moe.load_balancing_loss, static_argnums=2)  # one program (eager: each op compiles on its own)
  ours = lb_loss(moe.Route(jnp.asarray(logits), jnp.asarray(experts)), jnp.asarray(mask), e)
  gate_logits = tuple(torch.as_tensor(logits[:, :, i].reshape(b * s, e)) for i in range(m))
  want = hf.load_balancing_loss_func(gate_logits, e, k, torch.as_tensor(mask.astype(np.int64)))
  np.testing.assert_allclose(float(ours), float(want), rtol=1e-5)
  want_unmasked = hf.load_balancing_loss_func(gate_logits, e, k, None)
  ours_unmasked = lb_loss(moe.Route(jnp.asarray(logits), jnp.asarray(experts)), jnp.ones((b, s), bool), e)
  np.testing.assert_allclose(float(ours_unmasked), float(want_unmasked), rtol=1e-5)


def test_z_loss_and_routing_metrics_against_numpy():
  rng = np.random.default_rng(4)
  logits = rng.standard_normal((2, 5, 3, 4)) * 3
  experts = np.argsort(-logits, axis=-1)[..., :2]
  mask = np.arange(5)[None] >= np.array([0, 2])[:, None]
  route = moe.Route(jnp.asarray(logits, jnp.float32), jnp.asarray(experts))
  lse = np.log(np.exp(logits).sum(-1))
  z_loss = jax.jit(moe.router_z_loss)(route, jnp.asarray(mask))  # one program each (eager: each op on its own)
  np.testing.assert_allclose(float(z_loss), (lse**2)[mask].mean(), rtol=1e-5)
  metrics = jax.jit(lambda r, m: moe.routing_metrics(moe.routing_sums(r, m, 4)))(route, jnp.asarray(mask))
  p = np.exp(logits - lse[..., None])
  for m in range(3):
    counts = np.bincount(experts[mask][:, m].reshape(-1), minlength=4)
    share = counts / counts.sum()
    assert np.isclose(float(metrics[f"moe/{m}/load_min"]), share.min())
    assert np.isclose(float(metrics[f"moe/{m}/load_max"]), share.max())
    nz = share[share > 0]
    assert np.isclose(float(metrics[f"moe/{m}/load_entropy"]), -(nz * np.log(nz)).sum(), rtol=1e-5)
    ent = -(p * np.log(p)).sum(-1)[mask][:, m].mean()
    assert np.isclose(float(metrics[f"moe/{m}/router_entropy"]), ent, rtol=1e-5)


@pytest.mark.slow
def test_train_step_adds_the_router_losses():
  """One SGD step (lr 1, K = 2 micro-batches of equal token counts): the update with the router
  losses minus the update without them is -(c_aux·∇aux + c_z·∇z), the gradients taken directly."""
  model = _model("qwen2_moe")
  r = _rollout(model, record=False)
  batch = train.Batch.from_rollout(r, np.arange(8, dtype=np.float32))._replace(ref_logp=np.asarray(r.log_probs))
  batch = batch._replace(mask=np.ones_like(batch.mask))  # equal token counts in both micro-batches
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.sgd(1.0)
  c_aux, c_z = 0.5, 0.01
  out = {}
  for name, (a, z) in (("with", (c_aux, c_z)), ("without", (0.0, 0.0))):
    tc = train.TrainConfig(micro_batches=2, max_grad_norm=None, router_aux_loss=a, router_z_loss=z)
    graphdef, state, sh = train.init_train_state(model, opt, mesh)
    step = train.make_train_step(graphdef, opt, preset("grpo"), mesh=mesh, shardings=sh, train_config=tc)
    new, metrics = step(state, batch)
    out[name] = {str(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(new.params)}
  assert "moe/aux_loss" in metrics

  graphdef, state = nnx.split(model)
  half = lambda x: x[0::2], lambda x: x[1::2]  # micro-batch k holds rows k, k + K, ... (terms.split_micro)

  def router_loss(s):
    m = nnx.merge(graphdef, s)
    total = 0.0
    for sel in half:
      args = [jnp.asarray(sel(np.asarray(x))) for x in (batch.prompt_tokens, batch.prompt_mask)]
      args += [jnp.asarray(sel(np.asarray(x))) for x in (batch.completions, batch.mask)]
      with moe.routing_scope() as scope:
        completion_log_probs(m, *args)
      real = jnp.concatenate([args[1], args[3]], axis=1)
      route = scope.stacked()
      total += c_aux * moe.load_balancing_loss(route, real, 4) + c_z * moe.router_z_loss(route, real)
    return total / 2  # equal denominators: the mean over the two micro-batches

  grads = {str(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(jax.jit(jax.grad(router_loss))(state))}
  checked = 0
  for key, g in grads.items():
    diff = out["with"][key] - out["without"][key]
    np.testing.assert_allclose(diff, -g, rtol=2e-3, atol=2e-6, err_msg=key)
    checked += np.abs(g).max() > 1e-6
  assert checked >= 4  # routers of both sparse layers, and the layers below them


def test_lora_adapts_attention_and_shared_expert_and_refuses_routed_experts():
  model = _model("qwen2_moe")
  graphdef, state = nnx.split(model)
  copy = nnx.merge(graphdef, state)
  lora.apply_lora(copy, lora.LoRAConfig(rank=2), key=jax.random.key(0))
  paths = lora.projection_paths(copy)
  assert "layers.0.attn.q" in paths and "layers.0.mlp.shared.gate" in paths
  assert not any(
    p.startswith("layers.0.mlp.") and p.split(".")[-1] in ("gate", "up", "down") and "shared" not in p for p in paths
  )
  fresh = nnx.merge(graphdef, state)
  with pytest.raises(ValueError, match="match no projection"):
    lora.apply_lora(fresh, lora.LoRAConfig(rank=2, targets=[r"layers\.0\.mlp\.up"]), key=jax.random.key(0))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_packed_rows_equal_each_sequence_alone(family):
  """Packing (several sequences per row, segment ids) gives every sequence the hidden states and
  log-probs it gets alone: the dropless dispatch routes each token by itself (test_packing_models'
  check, on the MoE families)."""
  import test_packing_models as tpm

  cfg = models.config_from_hf(tiny_moe_config(family))
  tpm._MODELS[family, False] = tpm.randomized(models.build_model(cfg, rngs=nnx.Rngs(0)))
  tpm.check_packed_equals_alone(family, [1, 2, 3, 1, 6, 4], [1, 3, 2, 5, 10, 0], seed=1)


def test_pad_to_bucket_fits_the_routing_columns():
  b = train.Batch(
    np.zeros((2, 3), np.int32),
    np.ones((2, 3), bool),
    np.zeros((2, 5), np.int32),
    np.array([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], bool),
    np.zeros((2, 5), np.float32),
    np.zeros(2, np.int32),
    np.zeros(2, np.float32),
    routing=np.arange(2 * 8 * 1 * 2).reshape(2, 8, 1, 2) % 7 + 1,
  )
  trimmed = train.pad_to_bucket(b, (4, 32))
  assert trimmed.completions.shape == (2, 4) and trimmed.routing.shape == (2, 7, 1, 2)
  np.testing.assert_array_equal(trimmed.routing, b.routing[:, :7])
  padded = train.pad_to_bucket(b, (40,))
  assert padded.routing.shape == (2, 43, 1, 2) and not padded.routing[:, 8:].any()
  np.testing.assert_array_equal(padded.routing[:, :8], b.routing)


def test_default_dispatch_follows_the_backend_measurements():
  """Tiled on the CPU (ragged_dot expands densely there), ragged_dot on GPU and TPU (2.6x faster on one H200),
  tiled for an unknown backend; a new layer is "auto": the platform its program is traced for decides."""
  assert [moe.default_dispatch(b) for b in ("cpu", "gpu", "cuda", "tpu", "rocm", "metal")] == [
    "tiled",
    "ragged",
    "ragged",
    "ragged",
    "ragged",
    "tiled",
  ]
  model = _model()
  assert {m.dispatch for _, m in nnx.iter_graph(model) if isinstance(m, moe.MoEBlock)} == {"auto"}
  with target_platform("tpu"):
    assert moe.default_dispatch() == "ragged"  # the target's, not this CPU host's
  assert moe.default_dispatch() == moe.default_dispatch(jax.default_backend())  # no mesh, no target: the default


def test_is_moe_reads_the_models_sparse_layers_not_its_class():
  """A new MoE family's model need not subclass ``MoEModel``: it lists its sparse layers in ``moe_layers``."""

  class OtherFamilyMoE:
    moe_layers = (1, 3)

  class Dense:
    pass

  assert moe.is_moe(OtherFamilyMoE()) and moe.num_moe_layers(OtherFamilyMoE()) == 2
  assert not moe.is_moe(Dense()) and moe.num_moe_layers(Dense()) == 0
  empty = OtherFamilyMoE()
  empty.moe_layers = ()
  assert not moe.is_moe(empty)
