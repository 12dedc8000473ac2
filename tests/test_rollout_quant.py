"""Quantised rollout weights (``SamplingConfig.quantize``, ``models.lora.rollout_weights``): the sampler's recorded
log-probs are the dequantised model's (μ), its codes are made from the current parameters (LoRA merged) at every
push, the learner recomputes π_old and reports the mismatch, and the refusals come in one line.

Every reference is independent of the code under test: NumPy's per-channel int8 quantisation of the weights, and a
teacher-forced, cache-free forward (``models.log_probs``) of a plain model holding NumPy-dequantised weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import ref_log_probs, tiny_model
from hf_utils import tiny_moe_config

from jaxgrpo import models
from jaxgrpo.kernels.config import preset
from jaxgrpo.loop import iteration
from jaxgrpo.models import lora, quant
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout.sampling import SamplingConfig, generate
from jaxgrpo.run.spec_schema import RolloutSpec
from jaxgrpo.step import train

G, T = 3, 8
PROMPTS = np.array([[0, 5, 6, 7], [9, 10, 11, 12]], np.int32)


def _scaled(model, scale=4.0):
  """Every matrix (ndim >= 2) times ``scale``: sharper logits, so quantisation moves the log-probs visibly."""
  for _, var in nnx.to_flat_state(nnx.state(model)):
    if var.get_value().ndim >= 2:
      var.set_value(var.get_value() * scale)
  return model


def _moe():
  cfg = models.config_from_hf(tiny_moe_config("qwen2_moe", num_hidden_layers=2))
  return _scaled(models.build_model(cfg, rngs=nnx.Rngs(0)))


def _lora_model():
  model = _scaled(tiny_model(seed=1, layers=2))
  lora.apply_lora(model, lora.LoRAConfig(rank=2, alpha=4), key=jax.random.key(0))
  for k, s in enumerate(lora.adapter_sites(model)):  # B != 0: the merged weight differs from the base
    b = s.adapter().b
    b.set_value(0.3 * jax.random.normal(jax.random.key(100 + k), b.get_value().shape, jnp.float32))
  return model


def _np_int8(w: np.ndarray, contract: int) -> tuple[np.ndarray, np.ndarray]:
  """Per-output-channel symmetric int8 in NumPy (float64): ``s = max_c |w| / 127``, ``q = round(w / s)``."""
  w = w.astype(np.float64)
  s = np.abs(w).max(axis=tuple(range(contract)), keepdims=True) / 127.0
  q = np.clip(np.round(np.where(s > 0, w / np.where(s > 0, s, 1), 0)), -127, 127)
  return q, s


def _np_merged(site) -> np.ndarray:
  """A projection's float weight with its adapter merged (``w + scale·A·B``), in NumPy."""
  w = np.asarray(site.weight().get_value(), np.float64)
  ad = site.adapter()
  if ad is not None:
    a, b = np.asarray(ad.a.get_value(), np.float64), np.asarray(ad.b.get_value(), np.float64)
    w = w + ad.scale * np.tensordot(a, b, axes=1)
  return w


def _sampler_weights_match_numpy(model, sampled):
  """Every projection of ``sampled`` (the sampler's model) is int8, and its codes are NumPy's quantisation of the
  current merged weight of ``model`` (a code may differ by one where ``w / s`` lies within an ulp of a rounding
  boundary: XLA:CPU's division is not IEEE-exact). Returns the number of projections checked."""
  sites, qsites = lora.adapter_sites(model), lora.adapter_sites(sampled)
  assert len(sites) == len(qsites) > 0
  for s, q in zip(sites, qsites):
    qw = q.weight()
    assert isinstance(qw, models.layers.QuantizedWeight) and qw.kind == "int8", s.dotted
    assert q.adapter() is None, s.dotted
    codes, scales = np.asarray(qw.codes.get_value()), np.asarray(qw.scales.get_value())
    assert codes.dtype == np.int8
    ref_q, ref_s = _np_int8(_np_merged(s), s.contract)
    np.testing.assert_allclose(scales, ref_s, rtol=1e-6, err_msg=s.dotted)
    diff = np.abs(codes.astype(np.int64) - ref_q)
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3, (s.dotted, diff.max(), (diff > 0).mean())
  return len(sites)


def _expert_stacks(model):
  """``(module, name)`` of every routed-expert stack of a mixture of experts (none for a dense model)."""
  return [(m, n) for _, m in nnx.iter_modules(model) if hasattr(m, "num_experts") for n in ("gate", "up", "down")]


def _experts_match_numpy(model, sampled) -> int:
  """The sampler's expert stacks are int8 codes of NumPy's per-expert quantisation (contracting axis 1)."""
  pairs = list(zip(_expert_stacks(model), _expert_stacks(sampled)))
  for (m, name), (q, _) in pairs:
    qw = getattr(q, name)
    assert isinstance(qw, models.layers.QuantizedWeight), name
    w = np.asarray(getattr(m, name).get_value())
    ref = [_np_int8(w[e], 1) for e in range(w.shape[0])]
    np.testing.assert_allclose(np.asarray(qw.scales.get_value()), np.stack([r[1] for r in ref]), rtol=1e-6)
    diff = np.abs(np.asarray(qw.codes.get_value()).astype(np.int64) - np.stack([r[0] for r in ref]))
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3, name
  return len(pairs)


def _dequantised_plain(model, sampled):
  """A plain copy of ``model`` (adapters removed) whose projections hold the sampler's codes × scales (NumPy)."""
  plain = lora.base_model(model) if lora.has_adapters(model) else nnx.merge(*nnx.split(model))
  plain = nnx.merge(*nnx.split(plain))
  plain_sites = lora.adapter_sites(plain)
  for p, q in zip(plain_sites, lora.adapter_sites(sampled)):
    qw = q.weight()
    w_hat = np.asarray(qw.codes.get_value()).astype(np.float32) * np.asarray(qw.scales.get_value())
    p.set(weight=nnx.Param(jnp.asarray(w_hat), out_sharding=tuple(qw.axes), eager_sharding=False))
  for (p, name), (q, _) in zip(_expert_stacks(plain), _expert_stacks(sampled)):
    qw = getattr(q, name)
    w_hat = np.asarray(qw.codes.get_value()).astype(np.float32) * np.asarray(qw.scales.get_value())
    getattr(p, name).set_value(jnp.asarray(w_hat))
  return plain


def _teacher_forced(model, rollout) -> np.ndarray:
  """log-probs of the completion tokens from one cache-free forward of ``prompt ‖ completion``."""
  p = rollout.prompt_tokens.shape[1]
  tokens = jnp.concatenate([rollout.prompt_tokens, rollout.completions], axis=1)
  mask = jnp.concatenate([rollout.prompt_mask, rollout.mask], axis=1)
  lp = ref_log_probs(model, tokens, mask, temperature=float(rollout.temperature))
  return np.where(np.asarray(rollout.mask), np.asarray(lp)[:, p:], 0.0)


@pytest.mark.parametrize("kind", ["dense", "lora", "moe"])
def test_quantised_sampler_records_the_dequantised_models_log_probs(kind):
  """μ is right: every recorded log-prob equals a teacher-forced pass of the NumPy-dequantised model (1e-5), and
  differs from the full-precision model's (so the test fails if the quantised weights were not used); LoRA is
  merged before quantising; a mixture of experts has its experts quantised too."""
  model = {"dense": lambda: _scaled(tiny_model(seed=0)), "lora": _lora_model, "moe": _moe}[kind]()
  sampling = SamplingConfig(num_samples=G, max_new_tokens=T, quantize="int8")
  rollout = generate(model, PROMPTS, PROMPTS > 0, sampling, key=jax.random.key(7))
  sampled = sampling.model_to_sample(model)  # what generate samples from (the same call)
  n = _sampler_weights_match_numpy(model, sampled)
  if kind == "moe":  # the routed experts' stacks [E, D_in, D_out] are quantised too, per expert and channel
    assert _experts_match_numpy(model, sampled) == 6, n
  mask = np.asarray(rollout.mask)
  assert mask.sum() > G  # real tokens to compare
  want = _teacher_forced(_dequantised_plain(model, sampled), rollout)
  np.testing.assert_allclose(np.asarray(rollout.log_probs), want, rtol=1e-5, atol=1e-5)
  full = lora.merge_lora(model) if kind == "lora" else model
  gap = np.abs(_teacher_forced(full, rollout) - np.asarray(rollout.log_probs))[mask]
  assert gap.max() > 1e-3, gap.max()


def _step(model):
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.adam(5e-2)
  graphdef, state, shardings = train.init_train_state(model, opt, mesh)
  tc = train.TrainConfig(micro_batches=1, group_size=G, chunk_size=4)
  return train.make_train_step(graphdef, opt, preset("grpo"), mesh=mesh, shardings=shardings, train_config=tc), state


def test_each_push_quantises_the_current_parameters_and_the_learner_reports_the_mismatch():
  """Two iterations with ``quantize='int8'``: the second rollout's log-probs are those of the quantised *updated*
  parameters (not of the initial ones), and the learner recomputes π_old (``engine/mismatch_k3`` equals NumPy's
  k3 between the full-precision and the sampler's log-probs)."""
  step, state = _step(_scaled(tiny_model(seed=3)))
  sampling = SamplingConfig(num_samples=G, max_new_tokens=T, quantize="int8")
  initial = nnx.merge(step.graphdef, jax.tree.map(jnp.copy, state.params))

  def odd(prompts, completions):
    return [sum(t % 2 for t in c) / max(len(c), 1) for c in completions]

  run = lambda st, k: iteration.grpo_iteration(
    step, st, PROMPTS, PROMPTS > 0, key=jax.random.key(k), reward_fn=odd, sampling=sampling, buckets=None
  )
  out = run(state, 1)
  assert "engine/mismatch_k3" in out.metrics  # the learner recomputed old_logp
  updated = nnx.merge(step.graphdef, jax.tree.map(jnp.copy, out.state.params))
  out2 = run(out.state, 2)
  rollout = out2.rollout
  mask = np.asarray(rollout.mask)

  sampled_now = SamplingConfig(num_samples=G, quantize="int8").model_to_sample(updated)
  _sampler_weights_match_numpy(updated, sampled_now)
  got = np.asarray(rollout.log_probs)
  np.testing.assert_allclose(got, _teacher_forced(_dequantised_plain(updated, sampled_now), rollout), atol=1e-5)
  stale = _teacher_forced(_dequantised_plain(initial, sampling.model_to_sample(initial)), rollout)
  assert np.abs(stale - got)[mask].max() > 1e-3  # the codes changed with the update

  old = _teacher_forced(updated, rollout)  # π_old: the full-precision policy that the update starts from
  delta = (old - got)[mask].astype(np.float64)
  k3 = np.mean(np.exp(delta) - delta - 1.0)
  assert k3 > 0
  assert out2.metrics["engine/mismatch_k3"] == pytest.approx(k3, rel=1e-3, abs=1e-7)
  assert out2.metrics["engine/logp_abs_diff_max"] == pytest.approx(np.abs(delta).max(), rel=1e-3, abs=1e-6)


def test_refusals_in_one_line():
  with pytest.raises(ValueError, match=r"`quantize` must be None or one of \('int8', 'fp8'\).*'int4'"):
    SamplingConfig(num_samples=2, quantize="int4")
  model = tiny_model(seed=0, layers=1)
  with pytest.raises(ValueError, match="quantize='fp8': the model is on the CPU.*use quantize='int8'"):
    generate(
      model,
      PROMPTS,
      PROMPTS > 0,
      SamplingConfig(num_samples=1, max_new_tokens=2, quantize="fp8"),
      key=jax.random.key(0),
    )
  with pytest.raises(ValueError, match="rollout_weights: kind must be one of"):
    lora.rollout_weights(model, "nf4")
  with pytest.raises(ValueError, match="`rollout.quantize`='int8' quantises the built-in sampler's weights.*vllm"):
    RolloutSpec(quantize="int8", engine="vllm")
  with pytest.raises(ValueError, match="`rollout.quantize` must be 'none', 'int8' or 'fp8'; got 'int4'"):
    RolloutSpec(quantize="int4")
  from test_trainer import tiny

  with pytest.warns(UserWarning, match="`rollout.quantize`='int8' without `objective.importance_correction`"):
    tiny(**{"rollout.quantize": "int8"})


@pytest.mark.parametrize("kv_cache", [True, False])
def test_multiturn_rollout_samples_the_quantised_policy(kv_cache):
  """``sample_multiturn`` with ``quantize='int8'`` (the KV-cached conversation sampler and the re-prefill path):
  every policy token's recorded log-prob equals a teacher-forced pass of the NumPy-dequantised model over the final
  ``prompt ‖ trajectory`` (1e-5), observation tokens carry 0, and the full-precision model's log-probs differ (the
  quantised weights were used: the cached sampler ignored ``quantize`` before)."""
  from helpers import tiny_chat_policy
  from test_kv_multiturn import Scripted

  from jaxgrpo.rollout.environments import MultiTurnConfig, sample_multiturn

  tok, model, base, _ = tiny_chat_policy()
  model = _scaled(model)
  sampling = SamplingConfig(num_samples=2, eos_ids=base.eos_ids, pad_id=base.pad_id, quantize="int8")
  cfg = MultiTurnConfig(max_turns=3, max_tokens=48, turn_tokens=10)
  rows = [{"turns": 2}, {"turns": 3}]
  out = sample_multiturn(
    model, rows, lambda r: Scripted(), tok, sampling, cfg, key=jax.random.key(5), kv_cache=kv_cache
  )
  assert (out.turns > 1).any() and (out.mask & ~out.policy_mask).any()  # observations between turns
  tokens = np.concatenate([out.prompt_tokens, out.completions], 1)
  attn = np.concatenate([out.prompt_mask, out.mask], 1)
  p = out.prompt_tokens.shape[1]
  teacher = lambda m: np.asarray(ref_log_probs(m, tokens, attn))[:, p:]
  want = teacher(_dequantised_plain(model, sampling.model_to_sample(model)))
  np.testing.assert_allclose(out.log_probs, np.where(out.policy_mask, want, 0.0), rtol=1e-5, atol=1e-5)
  assert (out.log_probs[~out.policy_mask] == 0).all()
  gap = np.abs(teacher(model) - out.log_probs)[out.policy_mask]
  assert gap.max() > 1e-3, gap.max()


def test_an_env_run_with_quantised_rollouts_trains(tmp_path):
  """``rollout.quantize: int8`` with an ``env`` section (refused before): the trainer's multi-turn rollouts sample
  the quantised policy, the learner recomputes ``old_logp`` over the policy tokens (a positive, finite
  ``engine/mismatch_k3``) and TIS sees the gap; the parameters move."""
  from test_trainer import tiny
  from test_trainer_env import ENV

  from jaxgrpo.run.trainer import Trainer

  cfg = tiny(**{
    "rollout.quantize": "int8", "objective.importance_correction": "tis", "run.out": str(tmp_path), **ENV,
  })  # fmt: skip
  tr = Trainer(cfg, log=None)
  assert not tr.source.logprobs_are_policy
  try:
    before = jax.tree.map(np.asarray, tr.state.train.params)
    metrics = [tr.train_step() for _ in range(2)]
    after = jax.tree.map(np.asarray, tr.state.train.params)
  finally:
    tr.close()
  for m in metrics:
    assert 0 < m["engine/mismatch_k3"] < 1e-1 and np.isfinite(m["engine/logp_abs_diff_max"]), m
    assert m["mismatch_kl"] > 0 and np.isfinite(m["loss"]), m
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), before, after))
  assert max(moved) > 0


def test_fp8_codes_are_e4m3_of_the_scaled_weight_within_the_bound():
  """``quant.quantize(kind="fp8")`` against ml_dtypes' float8_e4m3fn rounding of ``w / s``, ``s = max_c |w| / 448``;
  the error stays within ``max_abs_error("fp8") · s`` (and relative 2⁻⁴ above the subnormals)."""
  import ml_dtypes

  rng = np.random.default_rng(0)
  w = (0.02 * rng.standard_normal((256, 8, 16)) * rng.uniform(0.2, 3.0, size=(8, 16))).astype(np.float32)
  codes, scales = quant.quantize(jnp.asarray(w), kind="fp8", contract=1)
  assert codes.dtype == jnp.float8_e4m3fn and scales.shape == (1, 8, 16)
  s = np.abs(w.astype(np.float64)).max(axis=0, keepdims=True) / 448.0
  np.testing.assert_allclose(np.asarray(scales), s, rtol=1e-6)
  ref = (w / np.asarray(scales)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  got = np.asarray(codes).astype(np.float32)
  assert (got != ref).mean() < 1e-3  # ties only (w / s within an ulp of a rounding boundary)
  w_hat = np.asarray(quant.dequantize(codes, scales, kind="fp8", contract=1))
  err = np.abs(w - w_hat)
  assert np.all(err <= quant.max_abs_error("fp8") * np.asarray(scales) + 4 * np.spacing(np.abs(w)))
  # relative 2⁻⁴ (3 mantissa bits) for normal codes; half the subnormal step 2⁻⁹ below the smallest normal 2⁻⁶
  assert np.all(err <= 2.0**-4 * np.abs(w) + 2.0**-10 * np.asarray(scales) + 4 * np.spacing(np.abs(w)))


@pytest.mark.parametrize("schedule", ["sync-lora", "partial-moe"])
def test_the_trainer_samples_quantised_and_corrects_with_tis(tmp_path, schedule):
  """``rollout.quantize: int8`` through the trainer — synchronous with a LoRA policy, and partial rollouts (slot
  refill, async) with a mixture of experts: the learner recomputes ``old_logp`` and logs a positive, finite
  ``engine/mismatch_k3``, and the step's TIS sees the same gap (``mismatch_kl`` > 0, ratios π_old/μ ≠ 1)."""
  from test_async_rollout import REWARDS
  from test_partial_rollouts import MOE, PARTIAL
  from test_trainer import tiny

  from jaxgrpo.run.trainer import Trainer

  changes = {
    "run.out": str(tmp_path / schedule),
    "rollout.quantize": "int8",
    "objective.importance_correction": "tis",
    "optim.learning_rate": 3e-2,
  }
  if schedule == "sync-lora":
    changes["lora"] = {"rank": 4, "alpha": 8.0}
  else:
    changes.update({
      "model.synthetic": MOE, "rollout.routing_replay": "none", "rollout.max_staleness": 2, "rollout.partial": PARTIAL,
    })  # fmt: skip
  tr = Trainer(tiny(**changes), reward_fns=REWARDS, log=None)
  assert tr.source.sampling.quantize == "int8" and not tr.source.logprobs_are_policy
  try:
    metrics = [tr.train_step() for _ in range(2)]
  finally:
    tr.close()
  for m in metrics:
    assert 0 < m["engine/mismatch_k3"] < 1e-1 and np.isfinite(m["engine/logp_abs_diff_max"]), m
    assert m["mismatch_kl"] > 0 and np.isfinite(m["is_weight_mean"]) and m["is_ratio_mean"] != 1.0, m


_ON_A_MESH = r"""
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
from jax.sharding import PartitionSpec as P
from hf_utils import tiny_moe_config
from jaxgrpo import models
from jaxgrpo.loop.iteration import policy_model
from jaxgrpo.models import lora
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout.sampling import SamplingConfig, generate
from jaxgrpo.step import train

cfg = models.config_from_hf(tiny_moe_config("qwen2_moe", num_hidden_layers=2))
model = models.build_model(cfg, rngs=nnx.Rngs(0))
for _, var in nnx.to_flat_state(nnx.state(model)):
  if var.get_value().ndim >= 2:
    var.set_value(var.get_value() * 4)
host = jax.tree.map(np.asarray, nnx.state(model))
mesh = shd.make_mesh("fsdp=2,tensor=2")
graphdef, state, _ = train.init_train_state(model, optax.sgd(0.1), mesh)
policy = policy_model(graphdef, state)
sampling = SamplingConfig(num_samples=2, max_new_tokens=6, quantize="int8")
sampled = sampling.model_to_sample(policy)
checked = 0
modules = dict(nnx.iter_modules(policy))
for path, q in nnx.iter_modules(sampled):
  w = modules.get(path)
  for name in ("q", "k", "v", "o", "gate", "up", "down"):
    qw = getattr(q, name, None)
    if not isinstance(qw, models.layers.QuantizedWeight):
      continue
    spec = getattr(w, name).get_value().sharding.spec
    codes, scales = qw.codes.get_value(), qw.scales.get_value()
    assert codes.sharding.spec == spec, (path, name, codes.sharding.spec, spec)
    k = getattr(qw, "batch", 0) + qw.contract
    want = P(*(tuple(spec[: k - qw.contract]) + (None,) * qw.contract + tuple(spec[k:])))
    assert tuple(scales.sharding.spec) == tuple(want) + (None,) * (len(scales.shape) - len(want)), (path, name)
    checked += 1
assert checked == 2 * (4 + 3 + 3), checked  # per layer: attention, shared expert, routed expert stacks
prompts = np.array([[0, 5, 6, 7], [9, 10, 11, 12]], np.int32)
on_mesh = generate(policy, prompts, prompts > 0, sampling, key=jax.random.key(3))
single = models.build_model(cfg, rngs=nnx.Rngs(0))
nnx.update(single, jax.tree.map(jnp.asarray, host))
one = generate(single, prompts, prompts > 0, sampling, key=jax.random.key(3))
np.testing.assert_array_equal(np.asarray(on_mesh.completions), np.asarray(one.completions))
np.testing.assert_allclose(np.asarray(on_mesh.log_probs), np.asarray(one.log_probs), atol=1e-5)
print("OK", checked)
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_on_a_mesh_codes_and_scales_keep_the_weights_sharding_4_devices():
  """A mixture of experts on ``fsdp=2, tensor=2`` (4 virtual CPU devices, child process): every code array has its
  weight's sharding, its scales the same without the contracted dims, and the sampler on the mesh draws the
  single-device int8 sampler's tokens and log-probs."""
  from helpers import run_child

  assert run_child(_ON_A_MESH, devices=4, timeout=900).strip().splitlines()[-1].startswith("OK")
