"""On-policy distillation kernels (jaxgrpo.kernels.distill) against NumPy written from the formulas.

References in float64: the sampled-token advantage ``clip(log π_t − log π_s)`` on the distilled positions;
the top-k divergences from renormalised log-probs (forward ``Σ p_t log(p_t/p_s)``, reverse
``Σ p_s log(p_s/p_t)``, GKD's ``β·KL(p_t‖m) + (1−β)·KL(p_s‖m)``, ``m = β p_t + (1−β) p_s``); gradients
w.r.t. the student's *full* logits by central finite differences of the NumPy reference.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrpo.kernels import distill

B, T, V, K = 2, 4, 7, 4


def _lse(x):
  mx = x.max(-1, keepdims=True)
  return mx + np.log(np.exp(x - mx).sum(-1, keepdims=True))


def ref_divergence(z, lt, kind, beta=0.5):
  """Per-token divergence over the top-k, ``z``/``lt`` ``[..., k]``, both renormalised over the k ids."""
  log_s, log_t = z - _lse(z), lt - _lse(lt)
  p_s, p_t = np.exp(log_s), np.exp(log_t)
  if kind == "forward_kl":
    return (p_t * (log_t - log_s)).sum(-1)
  if kind == "reverse_kl":
    return (p_s * (log_s - log_t)).sum(-1)
  m = beta * p_t + (1 - beta) * p_s
  kl = lambda p, log_p: np.where(p > 0, p * (log_p - np.log(np.where(m > 0, m, 1.0))), 0.0).sum(-1)  # 0·log 0 = 0
  return beta * kl(p_t, log_t) + (1 - beta) * kl(p_s, log_s)


def ref_loss(logits, ids, lt, where, kind, beta=0.5):
  """Token mean over ``where`` of the divergence of the student's logits gathered at ``ids``."""
  z = np.take_along_axis(logits, ids, axis=-1)
  per = np.where(where, ref_divergence(z, lt, kind, beta), 0.0)
  return per.sum() / max(where.sum(), 1)


def fd_grad(f, x, eps=1e-6):
  g = np.zeros_like(x)
  for i in np.ndindex(x.shape):
    hi, lo = x.copy(), x.copy()
    hi[i] += eps
    lo[i] -= eps
    g[i] = (f(hi) - f(lo)) / (2 * eps)
  return g


def topk_inputs(seed=0, scale=2.0):
  """Student logits ``f32[B, T, V]``, the teacher's top-k ids of its own logits and their log-probs
  (full-vocabulary log-softmax, so they do not sum to 1 over the k: the kernel must renormalise),
  a ragged completion mask and a policy mask with an observation token."""
  rng = np.random.default_rng(seed)
  logits = (scale * rng.standard_normal((B, T, V))).astype(np.float32)
  teacher = scale * rng.standard_normal((B, T, V))
  ids = np.argsort(-teacher, axis=-1)[..., :K].astype(np.int32)
  lt = np.take_along_axis(teacher - _lse(teacher), ids, axis=-1).astype(np.float32)
  mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)
  policy = mask.copy()
  policy[1, 1] = False  # an observation token
  return logits, ids, lt, mask, policy


def _loss(kind, beta, ids, lt, mask, policy):
  def f(logits):
    z = distill.gather_topk(logits, jnp.asarray(ids))
    return distill.topk_distill_loss(z, jnp.asarray(lt), mask, kind=kind, beta=beta, policy_mask=policy)

  return f


# ----------------------------------------------------------------------------- the sampled-token advantage


@pytest.mark.parametrize("clip", [None, 0.5])
def test_reverse_kl_advantages_match_numpy(clip):
  rng = np.random.default_rng(1)
  s = (-3 * rng.random((B, T))).astype(np.float32)
  t = (-3 * rng.random((B, T))).astype(np.float32)
  _, _, _, mask, policy = topk_inputs()
  s[~mask] = np.nan  # padding and observation slots hold garbage: it must not leak
  t[~policy] = -np.inf
  want = np.where(mask & policy, -(s.astype(np.float64) - t), 0.0)
  if clip is not None:
    want = np.clip(want, -clip, clip)
    assert (np.abs(np.where(mask & policy, -(s - t), 0)) > clip).any()  # the clip is exercised
  got = distill.reverse_kl_advantages(s, t, mask, policy_mask=policy, clip=clip)
  assert got.dtype == jnp.float32 and got.shape == (B, T)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)


def test_reverse_kl_advantages_sign_and_no_gradient():
  """The teacher likes the sampled token more than the student: positive advantage; no gradient flows."""
  mask = np.ones((1, 2), bool)
  s, t = np.array([[-2.0, -0.5]], np.float32), np.array([[-0.5, -2.0]], np.float32)
  np.testing.assert_allclose(np.asarray(distill.reverse_kl_advantages(s, t, mask)), [[1.5, -1.5]])
  g = jax.grad(lambda x: distill.reverse_kl_advantages(x, t, mask).sum())(jnp.asarray(s))
  np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_combine_advantages():
  rng = np.random.default_rng(2)
  d = rng.standard_normal((B, T)).astype(np.float32)
  rl = rng.standard_normal(B).astype(np.float32)
  rl_t = rng.standard_normal((B, T)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(distill.combine_advantages(rl, d, 0.3)), rl[:, None] + 0.3 * d, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(distill.combine_advantages(rl_t, d, 2.0)), rl_t + 2.0 * d, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(distill.combine_advantages(None, d, 0.5)), 0.5 * d, rtol=1e-6)
  traced = jax.jit(lambda w: distill.combine_advantages(rl, d, w))(jnp.float32(0.3))
  np.testing.assert_allclose(np.asarray(traced), rl[:, None] + 0.3 * d, rtol=1e-6)
  with pytest.raises(ValueError, match="rl_advantages"):
    distill.combine_advantages(rl[:1], d, 1.0)


# ----------------------------------------------------------------------------- the top-k divergences


@pytest.mark.parametrize("kind, beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.1)])
def test_topk_divergence_values_and_gradients_match_numpy(kind, beta):
  logits, ids, lt, mask, policy = topk_inputs()
  where = mask & policy
  z = np.take_along_axis(logits, ids, axis=-1)
  per = distill.topk_divergence(z, lt, mask, kind=kind, beta=beta, policy_mask=policy)
  want = np.where(where, ref_divergence(z.astype(np.float64), lt.astype(np.float64), kind, beta), 0.0)
  assert per.dtype == jnp.float32 and per.shape == (B, T)
  assert (want[where] > 1e-4).all()  # the inputs are far enough apart to tell the forms apart
  np.testing.assert_allclose(np.asarray(per), want, rtol=1e-5, atol=1e-6)

  f = _loss(kind, beta, ids, lt, mask, policy)
  value, grad = jax.value_and_grad(f)(jnp.asarray(logits))
  ref = lambda x: ref_loss(x, ids, lt.astype(np.float64), where, kind, beta)
  x64 = logits.astype(np.float64)
  assert float(value) == pytest.approx(ref(x64), rel=1e-5)
  want_grad = fd_grad(ref, x64)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-5)
  # the gradient reaches only the top-k ids of the distilled positions
  outside = np.ones_like(want_grad, bool)
  np.put_along_axis(outside, ids, False, axis=-1)
  outside |= ~where[..., None]
  np.testing.assert_array_equal(np.asarray(grad)[outside], 0.0)


def test_forward_and_reverse_gradients_match_the_analytic_forms():
  """d/dz KL(p_t‖p_s) = p_s − p_t; d/dz KL(p_s‖p_t) = p_s·(r − Σ p_s r), r = log p_s − log p_t (per token,
  over the k ids; the loss is the token mean, so divide by the number of distilled positions)."""
  logits, ids, lt, mask, policy = topk_inputs(seed=3)
  where = mask & policy
  z = np.take_along_axis(logits.astype(np.float64), ids, axis=-1)
  log_s, log_t = z - _lse(z), lt - _lse(lt.astype(np.float64))
  p_s, p_t, r = np.exp(log_s), np.exp(log_t), log_s - log_t
  analytic = {
    "forward_kl": p_s - p_t,
    "reverse_kl": p_s * (r - (p_s * r).sum(-1, keepdims=True)),
  }
  for kind, dz in analytic.items():
    grad = np.asarray(jax.grad(_loss(kind, 0.5, ids, lt, mask, policy))(jnp.asarray(logits)))
    got = np.take_along_axis(grad, ids, axis=-1)
    want = np.where(where[..., None], dz, 0.0) / where.sum()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=kind)


def test_jsd_limits_are_forward_and_reverse_kl():
  """GKD's convention (teacher = P, student = Q): β = 0 is KL(p_t‖p_s), β = 1 is KL(p_s‖p_t), and these are
  the limits of JSD(β)/β as β → 0 and of JSD(β)/(1−β) as β → 1 (so the ends continue the interior)."""
  logits, ids, lt, mask, _ = topk_inputs(seed=4)
  z = np.take_along_axis(logits, ids, axis=-1)
  div = lambda kind, beta=0.5: np.asarray(distill.topk_divergence(z, lt, mask, kind=kind, beta=beta))
  fwd, rev = div("forward_kl"), div("reverse_kl")
  assert not np.allclose(fwd[mask], rev[mask], rtol=1e-2)  # the two directions differ on these inputs
  np.testing.assert_allclose(div("jsd", 0.0), fwd, rtol=1e-6)
  np.testing.assert_allclose(div("jsd", 1.0), rev, rtol=1e-6)
  # the limits, in float64 from the formula (float32 cancels in KL(p_s‖m) at small β)
  z64, lt64, eps = z.astype(np.float64), lt.astype(np.float64), 1e-6
  np.testing.assert_allclose(ref_divergence(z64, lt64, "jsd", eps)[mask] / eps, fwd[mask], rtol=1e-4)
  np.testing.assert_allclose(ref_divergence(z64, lt64, "jsd", 1 - eps)[mask] / eps, rev[mask], rtol=1e-4)


@pytest.mark.parametrize("kind, beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)])
def test_identical_teacher_and_student_give_zero(kind, beta):
  """Same distribution over the k ids (the teacher's log-probs are the student's logits shifted by a
  constant: renormalisation removes it): loss 0, gradient 0."""
  logits, ids, _, mask, policy = topk_inputs(seed=5)
  z = np.take_along_axis(logits, ids, axis=-1)
  lt = (z - 3.7).astype(np.float32)
  per = distill.topk_divergence(z, lt, mask, kind=kind, beta=beta, policy_mask=policy)
  np.testing.assert_allclose(np.asarray(per), 0.0, atol=1e-6)
  grad = jax.grad(_loss(kind, beta, ids, lt, mask, policy))(jnp.asarray(logits))
  np.testing.assert_allclose(np.asarray(grad), 0.0, atol=1e-6)


@pytest.mark.parametrize("kind, beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.5)])
def test_large_logits_stay_finite(kind, beta):
  """Logits of ±1e4 and a teacher that puts ~0 mass (log-prob −1e4) on some of its top-k: finite, correct."""
  logits, ids, lt, mask, policy = topk_inputs(seed=6, scale=1e4)
  lt = lt.copy()
  lt[..., -1] = -1e4
  where = mask & policy
  value, grad = jax.value_and_grad(_loss(kind, beta, ids, lt, mask, policy))(jnp.asarray(logits))
  assert np.isfinite(float(value)) and np.isfinite(np.asarray(grad)).all()
  want = ref_loss(logits.astype(np.float64), ids, lt.astype(np.float64), where, kind, beta)
  assert float(value) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_masks_exclude_padding_and_observation_tokens(kind):
  """Garbage (NaN, ±inf) at padding and observation positions changes nothing and gets gradient 0; the loss
  is the mean over the distilled positions only; nothing distilled gives 0 with a finite gradient."""
  logits, ids, lt, mask, policy = topk_inputs(seed=7)
  where = mask & policy
  dirty, dirty_lt = logits.copy(), lt.copy()
  dirty[~where] = np.nan
  dirty_lt[~mask] = -np.inf
  dirty_lt[1, 1] = np.inf
  clean = jax.value_and_grad(_loss(kind, 0.5, ids, lt, mask, policy))(jnp.asarray(logits))
  value, grad = jax.value_and_grad(_loss(kind, 0.5, ids, dirty_lt, mask, policy))(jnp.asarray(dirty))
  assert float(value) == pytest.approx(float(clean[0]), rel=1e-6)
  np.testing.assert_allclose(np.asarray(grad)[where], np.asarray(clean[1])[where], rtol=1e-6, atol=1e-8)
  np.testing.assert_array_equal(np.asarray(grad)[~where], 0.0)
  # the mean runs over the distilled positions: the observation token is out of the denominator
  z = np.take_along_axis(logits.astype(np.float64), ids, axis=-1)
  per = ref_divergence(z, lt.astype(np.float64), kind)
  assert float(value) == pytest.approx(per[where].mean(), rel=1e-5)
  assert per[where].mean() != pytest.approx(per[mask].mean(), rel=1e-3)
  nothing = np.zeros_like(mask)
  v0, g0 = jax.value_and_grad(_loss(kind, 0.5, ids, lt, nothing, None))(jnp.asarray(dirty))
  assert float(v0) == 0.0 and np.isfinite(np.asarray(g0)).all()


def test_bad_inputs_are_refused_in_one_line():
  logits, ids, lt, mask, _ = topk_inputs()
  z = np.take_along_axis(logits, ids, axis=-1)
  with pytest.raises(ValueError, match="`kind` must be one of"):
    distill.topk_divergence(z, lt, mask, kind="kl")
  with pytest.raises(ValueError, match="`beta` must be <= 1.0"):
    distill.topk_divergence(z, lt, mask, kind="jsd", beta=1.5)
  with pytest.raises(ValueError, match="teacher_topk_logp"):
    distill.topk_divergence(z, lt[..., :2], mask, kind="jsd")
  with pytest.raises(ValueError, match="`mask` must have shape"):
    distill.topk_divergence(z, lt, mask[:, :2], kind="jsd")
  with pytest.raises(ValueError, match="`clip` must be > 0.0"):
    distill.reverse_kl_advantages(lt[..., 0], lt[..., 1], mask, clip=0.0)
  with pytest.raises(ValueError, match="topk_ids"):
    distill.gather_topk(logits, ids[:1])


# ----------------------------------------------------------------------------- through the train step


@pytest.mark.parametrize(
  "name, overrides, weight",
  [
    ("grpo", {}, 0.5),  # RL + w·distill
    pytest.param("lambda_grpo", {}, 2.0, marks=pytest.mark.slow),  # with λ-GRPO's 1/|λ| token weights
    ("frpo", {"beta": 0.5}, 0.5),  # FRPO's per-token advantage (its cost to go over the policy's tokens)
    (None, {}, 1.0),  # distillation alone: no rewards read
  ],
)
def test_train_step_with_distillation_advantages(name, overrides, weight):
  """``Batch.advantages = combine_advantages(rollout_advantages(...), reverse_kl_advantages(...), w)``: the
  advantage equals NumPy's ``a_RL + w·(log π_t − log π_s)`` on the policy's tokens, and one step of
  ``make_train_step`` equals the hand-written SGD update of the clipped surrogate with that advantage over
  the policy's tokens (observation tokens out of the loss and out of the distillation term)."""
  import optax
  from helpers import G, make_batch, ref_advantages, ref_lambda_sizes, tiny_model

  from jaxgrpo.kernels.config import preset
  from jaxgrpo.kernels.objective import rollout_advantages
  from jaxgrpo.parallel import sharding as shd
  from jaxgrpo.step import train

  config = preset(name or "grpo", **overrides)
  batch = make_batch(11)
  mask = np.asarray(batch.mask)
  policy = mask.copy()
  policy[:, [2, 5]] = False  # observation tokens
  rng = np.random.default_rng(12)
  teacher = np.where(mask, np.asarray(batch.old_logp) + 0.5 * rng.standard_normal(mask.shape), 0).astype(np.float32)
  old = np.asarray(batch.old_logp, np.float64)
  want = weight * np.where(policy, teacher - old, 0.0)
  weights = None
  distill_adv = distill.reverse_kl_advantages(batch.old_logp, teacher, mask, policy_mask=policy)
  if name is None:
    adv = distill.combine_advantages(None, distill_adv, weight)
    batch = batch._replace(rewards=None)
  else:
    # FRPO: the reference is the rollout policy on observation tokens (δ = 0 there), as the step does
    ref = np.where(policy, np.asarray(batch.ref_logp), np.asarray(batch.old_logp)).astype(np.float32)
    rl_want = ref_advantages(config, batch._replace(ref_logp=ref))
    want = (rl_want[:, None] if rl_want.ndim == 1 else rl_want) + want
    rl, weights = rollout_advantages(
      config,
      batch.rewards,
      batch.completions,
      mask,
      batch.group_ids,
      len(set(batch.group_ids.tolist())),
      old_logp=batch.old_logp,
      ref_logp=ref,
    )
    adv = distill.combine_advantages(rl, distill_adv, weight)
    if config.process_weights:
      sizes = ref_lambda_sizes(np.asarray(batch.completions), mask, np.asarray(batch.group_ids))
      np.testing.assert_allclose(np.asarray(weights), np.where(sizes > 0, 1.0 / np.maximum(sizes, 1), 0.0), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(adv)[mask], want[mask], rtol=1e-5, atol=1e-6)

  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.sgd(0.5)
  graphdef, state, shardings = train.init_train_state(tiny_model(layers=1), opt, mesh)
  tc = train.TrainConfig(max_grad_norm=1e30, group_size=G, chunk_size=8)
  step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc)
  fed = batch._replace(advantages=adv, token_weights=weights, policy_mask=policy)
  if not step.reads_ref_logp:
    fed = fed._replace(ref_logp=None)
  state, metrics = step(state, fed)
  _assert_hand_update(state, metrics, batch, config, want, weights, policy)


@pytest.mark.parametrize("kind, beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)])
def test_a_teacher_with_fewer_than_k_ids(kind, beta):
  """A −inf teacher log-prob (an engine that returned fewer than k ids) takes the id out of the set for both
  models: the divergence equals NumPy's over the remaining ids, those ids get no gradient; a position with
  no finite id gives 0 (finite gradient); a NaN teacher log-prob stays visible (NaN), never hidden."""
  logits, ids, lt, mask, policy = topk_inputs(seed=8)
  lt = lt.copy()
  lt[0, 0, 2:] = -np.inf  # two ids left
  lt[1, 3, 1] = -np.inf  # three ids left
  lt[1, 2, :] = -np.inf  # none left
  f = _loss(kind, beta, ids, lt, mask, None)
  value, grad = jax.value_and_grad(f)(jnp.asarray(logits))
  z = np.take_along_axis(logits.astype(np.float64), ids, axis=-1)
  want = np.zeros((B, T))
  for b, t in zip(*np.nonzero(mask)):
    keep = np.isfinite(lt[b, t])
    if keep.any():
      want[b, t] = ref_divergence(z[b, t, keep], lt[b, t, keep].astype(np.float64), kind, beta)
  per = distill.topk_divergence(z.astype(np.float32), lt, mask, kind=kind, beta=beta)
  np.testing.assert_allclose(np.asarray(per), want, rtol=1e-5, atol=1e-6)
  assert float(value) == pytest.approx(want[mask].sum() / mask.sum(), rel=1e-5)
  g = np.asarray(grad)
  assert np.isfinite(g).all()
  assert np.all(g[0, 0, ids[0, 0, 2:]] == 0) and np.all(g[1, 3, ids[1, 3, 1]] == 0) and np.all(g[1, 2] == 0)
  assert np.any(g[0, 0, ids[0, 0, :2]] != 0)
  lt[0, 1, 0] = np.nan
  assert np.isnan(float(_loss(kind, beta, ids, lt, mask, None)(jnp.asarray(logits))))


# ----------------------------------------------------------------------------- the teacher and the step's own term


def _assert_hand_update(state, metrics, batch, config, advantages, weights, policy, lr=0.5):
  """The step's parameters and loss equal helpers.reference_update's hand-written SGD step (the clipped surrogate
  with ``advantages`` over the ``policy`` tokens, λ ``weights`` or None)."""
  from helpers import flat_params, reference_update, tiny_model

  want_params, want_metrics, _ = reference_update(
    tiny_model(layers=1),
    batch,
    config,
    lr=lr,
    max_grad_norm=1e30,
    advantages=advantages,
    token_weights=weights,
    loss_mask=policy,
  )
  got = flat_params(state.params)
  for k in want_params:
    np.testing.assert_allclose(got[k], want_params[k], rtol=2e-5, atol=1e-7, err_msg=str(k))
  assert float(metrics["loss"]) == pytest.approx(want_metrics["loss"], rel=1e-5, abs=1e-7)


def _rl_reference(config, batch, policy):
  """NumPy's RL advantage ``f32[B, T]`` (the reference taken as the rollout policy on observation tokens, as the
  step does) and λ-GRPO's ``1/|λ|`` weights (None for the other presets)."""
  from helpers import ref_advantages, ref_lambda_sizes

  mask = np.asarray(batch.mask)
  ref = np.where(policy, np.asarray(batch.ref_logp), np.asarray(batch.old_logp)).astype(np.float32)
  rl = ref_advantages(config, batch._replace(ref_logp=ref))
  rl = np.broadcast_to(rl[:, None], mask.shape) if rl.ndim == 1 else rl
  weights = None
  if config.process_weights:
    sizes = ref_lambda_sizes(np.asarray(batch.completions), mask, np.asarray(batch.group_ids))
    weights = np.where(sizes > 0, 1.0 / np.maximum(sizes, 1), 0.0).astype(np.float32)
  return rl, weights


def _teacher_logp_numpy(teacher, batch):
  """The teacher's log-prob of each completion token from its full logits (``log_softmax``), float64."""
  import jax.numpy as jnp

  p = batch.prompt_tokens.shape[1]
  tokens = jnp.concatenate([batch.prompt_tokens, batch.completions], axis=1)
  attn = jnp.concatenate([batch.prompt_mask, batch.mask], axis=1)
  hidden, _ = teacher(tokens, jnp.maximum(jnp.cumsum(attn, 1) - 1, 0), attention_mask=attn)
  logits = np.asarray(teacher.logits(hidden[:, p - 1 : -1], out_dtype=jnp.float32), np.float64)
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  lp = np.take_along_axis(logits, np.asarray(batch.completions)[..., None], -1)[..., 0] - logz
  return np.where(np.asarray(batch.mask), lp, 0.0)


@pytest.mark.parametrize(
  "name, overrides, weight, clip",
  [
    ("grpo", {}, 0.5, None),  # RL + w·distill, the step adds the term itself
    pytest.param("lambda_grpo", {}, 2.0, 0.3, marks=pytest.mark.slow),  # λ-GRPO's 1/|λ| weights, a clip
    ("frpo", {"beta": 0.5}, 0.5, 0.3),  # FRPO's per-token advantage
    (None, {}, 1.0, None),  # distillation alone: rewards None
  ],
)
def test_train_step_with_a_teacher(name, overrides, weight, clip):
  """``GRPOConfig.distill`` and a teacher (``feed.make_teacher``: another size, the same vocabulary): the
  teacher's pass equals NumPy's ``log_softmax`` of its full logits at the sampled tokens; one step equals the
  hand-written SGD update with the NumPy advantage ``a_RL + w·clip(log π_t − log π_s)`` on the policy's tokens
  (observation tokens out); ``distill/weight`` and ``distill/reverse_kl`` (the mean of ``log π_s − log π_t`` over
  the distilled tokens) are logged."""
  import optax
  from helpers import (
    G,
    make_batch,
    tiny_config,
    tiny_model,
  )

  from jaxgrpo.kernels.config import preset
  from jaxgrpo.models import build_model
  from jaxgrpo.parallel import sharding as shd
  from jaxgrpo.step import feed, train

  d = distill.DistillConfig(weight=weight, clip=clip)
  config = preset(name or "grpo", distill=d, **overrides)
  batch = make_batch(21)
  mask = np.asarray(batch.mask)
  policy = mask.copy()
  policy[:, [2, 5]] = False  # observation tokens
  batch = batch._replace(policy_mask=policy)
  from flax import nnx

  teacher = build_model(dataclasses.replace(tiny_config(3), hidden_size=48, intermediate_size=96), rngs=nnx.Rngs(7))
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.sgd(0.5)
  graphdef, state, shardings = train.init_train_state(tiny_model(layers=1), opt, mesh)
  tc = train.TrainConfig(max_grad_norm=1e30, group_size=G, chunk_size=8)
  step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc)
  with pytest.raises(ValueError, match="batch.teacher_logp is None"):
    step.check_batch(batch)
  taught = feed.make_teacher(step, teacher, student_vocab=128)(batch)
  assert taught.packed is None  # the step packs it (or not) itself
  want_t = _teacher_logp_numpy(teacher, batch)
  np.testing.assert_allclose(np.asarray(taught.teacher_logp)[mask], want_t[mask], rtol=1e-5, atol=1e-5)

  old = np.asarray(batch.old_logp, np.float64)
  own = np.where(policy, np.asarray(taught.teacher_logp, np.float64) - old, 0.0)
  want = weight * (own if clip is None else np.clip(own, -clip, clip))
  weights = None
  if name is None:
    taught = taught._replace(rewards=None)
  else:
    rl, weights = _rl_reference(config, batch, policy)
    want = rl + want
  if not step.reads_ref_logp:
    taught = taught._replace(ref_logp=None)
  state, metrics = step(state, taught)
  _assert_hand_update(state, metrics, batch, config, want, weights, policy)
  assert float(metrics["distill/weight"]) == pytest.approx(weight)
  kl = np.sum(np.where(policy, old - np.asarray(taught.teacher_logp, np.float64), 0.0)) / policy.sum()
  assert float(metrics["distill/reverse_kl"]) == pytest.approx(kl, rel=1e-5, abs=1e-6)


def test_distill_config_and_teacher_are_checked_in_one_line():
  """A bad kind/β/k/weight/clip, a teacher of another vocabulary, a top-k kind in the step: one line each."""
  import optax
  from helpers import make_batch, tiny_config, tiny_model

  from jaxgrpo.kernels.config import preset
  from jaxgrpo.models import build_model
  from jaxgrpo.parallel import sharding as shd
  from jaxgrpo.step import feed, train

  for kw, match in [
    ({"kind": "kl"}, "distill.kind"),
    ({"beta": 1.5}, r"`distill.beta` must be <= 1.0"),
    ({"top_k": 0}, "distill.top_k"),
    ({"weight": -1.0}, r"`distill.weight` must be >= 0.0"),
    ({"clip": 0.0}, r"`distill.clip` must be > 0.0"),
  ]:
    with pytest.raises(ValueError, match=match):
      distill.DistillConfig(**kw)
  with pytest.raises(ValueError, match="teacher's vocab_size=64 but the policy's is 128"):
    from flax import nnx

    feed.make_teacher(
      None, build_model(dataclasses.replace(tiny_config(1), vocab_size=64), rngs=nnx.Rngs(0)), student_vocab=128
    )
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.sgd(0.1)
  graphdef, state, shardings = train.init_train_state(tiny_model(layers=1), opt, mesh)
  batch = make_batch(0)
  ids = np.zeros(batch.mask.shape + (4,), np.int32)
  for agg, fields, match in [
    ("token-mean", {"teacher_logp": batch.old_logp}, "needs batch.teacher_topk_ids"),
    ("token-mean", {"teacher_topk_ids": ids, "teacher_topk_logp": ids[..., :3] * 1.0}, "must have one shape"),
  ]:
    config = preset("grpo", aggregation=agg, distill=distill.DistillConfig(kind="jsd"))
    step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings)
    with pytest.raises(ValueError, match=match):
      step.check_batch(batch._replace(**fields))
  with pytest.raises(ValueError, match="batch.teacher_topk_ids must be int32\\[B, T, k\\]"):
    step.check_batch(batch._replace(teacher_topk_ids=ids[..., 0], teacher_topk_logp=ids * 1.0))


def _full_log_softmax(model, batch):
  """``f32[B, T, V]`` the model's full next-token log-probs at the completion positions (the whole head)."""
  import jax.numpy as jnp

  p = batch.prompt_tokens.shape[1]
  tokens = jnp.concatenate([jnp.asarray(batch.prompt_tokens), jnp.asarray(batch.completions)], axis=1)
  attn = jnp.concatenate([jnp.asarray(batch.prompt_mask), jnp.asarray(batch.mask)], axis=1)
  hidden, _ = model(tokens, jnp.maximum(jnp.cumsum(attn, 1) - 1, 0), attention_mask=attn)
  return jax.nn.log_softmax(model.logits(hidden[:, p - 1 : -1], out_dtype=jnp.float32), -1)


def _hand_divergence(lp_student, ids, teacher_topk, where, kind, beta, aggregation="token-mean"):
  """The divergence between the renormalised top-k distributions on ``where``, written from the formulas (jnp,
  so that ``jax.grad`` differentiates the formula itself), aggregated by hand: ``token-mean`` and
  ``seq-mean-token-sum-norm`` give the sum ``Σ D`` (the caller divides), ``seq-mean-token-mean`` the mean over
  the rows with a distilled token of each row's mean ``Σ_t D / n_i``."""
  import jax.numpy as jnp

  zs = jnp.take_along_axis(lp_student, ids, -1)
  ls = zs - jax.nn.logsumexp(zs, -1, keepdims=True)
  lt = teacher_topk - jax.nn.logsumexp(teacher_topk, -1, keepdims=True)
  ps, pt = jnp.exp(ls), jnp.exp(lt)
  if kind == "forward_kl":
    per = jnp.sum(pt * (lt - ls), -1)
  elif kind == "reverse_kl":
    per = jnp.sum(ps * (ls - lt), -1)
  else:
    m = beta * pt + (1 - beta) * ps
    per = beta * jnp.sum(pt * (lt - jnp.log(m)), -1) + (1 - beta) * jnp.sum(ps * (ls - jnp.log(m)), -1)
  per = jnp.where(where, per, 0.0)
  if aggregation != "seq-mean-token-mean":
    return jnp.sum(per)
  n = where.sum(1)
  return jnp.mean(jnp.stack([jnp.sum(per[i]) / n[i] for i in range(len(n)) if n[i] > 0]))


@pytest.mark.parametrize(
  "name, kind, beta, weight, aggregation, packing",
  [
    (None, "forward_kl", 0.5, 1.0, "token-mean", None),  # the top-k term alone (rewards None)
    ("grpo", "reverse_kl", 0.5, 0.5, "token-mean", None),  # GRPO + the term
    pytest.param("lambda_grpo", "jsd", 0.3, 2.0, "token-mean", None, marks=pytest.mark.slow),
    ("frpo", "jsd", 0.5, 0.5, "token-mean", None),
    (None, "reverse_kl", 0.5, 1.0, "seq-mean-token-mean", None),  # the term alone, each row's mean, then the rows'
    ("grpo", "forward_kl", 0.5, 0.5, "seq-mean-token-mean", None),
    ("grpo", "jsd", 0.3, 2.0, "seq-mean-token-sum-norm", None),  # Dr.GRPO's Σ D / (B·max_tokens)
    ("grpo", "reverse_kl", 0.5, 0.5, "token-mean", 64),  # packed: the head rows' log-probs at the ids
    (None, "jsd", 0.3, 1.0, "seq-mean-token-mean", 64),
    ("grpo", "forward_kl", 0.5, 1.0, "token-mean", (64, "tree")),  # packed prefix trees (the group's prompt once)
  ],
)
def test_topk_forms_through_the_step(name, kind, beta, weight, aggregation, packing):
  """A top-k form (``distill.kind`` forward/reverse KL, JSD(β)): the teacher's top-k pass equals NumPy's top-k of
  its full log-softmax; one step equals ``θ − lr·(∇L_RL + w·∇ mean_t D)`` — ``L_RL`` the hand-written update of
  helpers.reference_update, ``D`` the divergence between the renormalised top-k distributions written from its
  formula on the student's *full* logits — over the policy's tokens (observations out), aggregated like the
  policy term (``mean_t D`` over the tokens, ``mean_i mean_t D`` over the rows, or ``Σ D / (B·max_tokens)``);
  the loss and ``distill/topk_divergence`` (a token mean whatever the aggregation) equal the hand computation.
  Packed (``packing``): the teacher's and the student's top-k from the packed forward's head rows; the step also
  equals the unpacked step (1e-5)."""
  import optax
  from flax import nnx
  from helpers import (
    G,
    flat_params,
    make_batch,
    reference_update,
    tiny_config,
    tiny_model,
  )

  from jaxgrpo.kernels.config import preset
  from jaxgrpo.models import build_model
  from jaxgrpo.parallel import sharding as shd
  from jaxgrpo.step import feed, train

  k, lr = 5, 0.5
  overrides = {"beta": 0.5} if name == "frpo" else {}
  overrides["aggregation"] = aggregation
  config = preset(
    name or "grpo", distill=distill.DistillConfig(weight=weight, kind=kind, beta=beta, top_k=k), **overrides
  )
  batch = make_batch(31)
  mask = np.asarray(batch.mask)
  policy = mask.copy()
  policy[:, [1, 6]] = False
  batch = batch._replace(policy_mask=policy)
  teacher = build_model(dataclasses.replace(tiny_config(2), hidden_size=40, intermediate_size=80), rngs=nnx.Rngs(9))
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.sgd(lr)
  graphdef, state, shardings = train.init_train_state(tiny_model(layers=1), opt, mesh)
  packing, sharing = packing if isinstance(packing, tuple) else (packing, "none")
  tc = train.TrainConfig(
    max_grad_norm=1e30, group_size=G, chunk_size=5, micro_batches=2, packing=packing, prefix_sharing=sharing
  )
  step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc)
  with pytest.raises(ValueError, match="needs batch.teacher_topk_ids"):
    step.check_batch(batch)
  taught = feed.make_teacher(step, teacher, student_vocab=128)(batch)
  assert taught.packed is None  # the step packs it (or not) itself
  full_t = np.asarray(_full_log_softmax(teacher, batch), np.float64)
  want_ids = np.argsort(-full_t, -1, kind="stable")[..., :k]
  np.testing.assert_array_equal(np.asarray(taught.teacher_topk_ids)[mask], want_ids[mask])
  want_top = np.take_along_axis(full_t, want_ids, -1)
  np.testing.assert_allclose(np.asarray(taught.teacher_topk_logp)[mask], want_top[mask], rtol=1e-5, atol=1e-5)

  ids, top = jnp.asarray(taught.teacher_topk_ids), jnp.asarray(taught.teacher_topk_logp)
  student = tiny_model(layers=1)
  sgraph, sparams = nnx.split(student)
  n = policy.sum()
  norm = {"token-mean": n, "seq-mean-token-mean": 1.0, "seq-mean-token-sum-norm": mask.size}[aggregation]
  hand = lambda prm, agg: _hand_divergence(
    _full_log_softmax(nnx.merge(sgraph, prm), batch), ids, top, policy, kind, beta, agg
  )
  div, g_div = jax.value_and_grad(lambda prm: hand(prm, aggregation) / norm)(sparams)
  token_mean = hand(sparams, "token-mean") / n
  weights = None
  if name is None:
    taught, want_adv = taught._replace(rewards=None), np.zeros(mask.shape, np.float32)
  else:
    want_adv, weights = _rl_reference(config, batch, policy)
  if not step.reads_ref_logp:
    taught = taught._replace(ref_logp=None)
  state, metrics = step(state, taught)
  rl_params, rl_metrics, _ = reference_update(
    tiny_model(layers=1),
    batch,
    config,
    lr=lr,
    max_grad_norm=1e30,
    advantages=want_adv,
    token_weights=weights,
    loss_mask=policy,
  )
  g_flat = flat_params(g_div)
  got = flat_params(state.params)
  for key in rl_params:
    np.testing.assert_allclose(
      got[key], rl_params[key] - lr * weight * g_flat[key], rtol=2e-5, atol=2e-7, err_msg=str(key)
    )
  assert float(metrics["distill/topk_divergence"]) == pytest.approx(float(token_mean), rel=1e-5, abs=1e-7)
  if packing is not None:  # the same step unpacked, from the same initial parameters and teacher's fields
    tc = dataclasses.replace(tc, packing=None, prefix_sharing="none")
    graphdef, plain, shardings = train.init_train_state(tiny_model(layers=1), opt, mesh)
    plain, plain_metrics = train.make_train_step(
      graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc
    )(plain, taught)
    for key, value in flat_params(plain.params).items():
      np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-7, err_msg=str(key))
    for key in ("loss", "distill/topk_divergence"):
      assert float(metrics[key]) == pytest.approx(float(plain_metrics[key]), rel=1e-5, abs=1e-7)
  assert float(metrics["loss"]) == pytest.approx(rl_metrics["loss"] + weight * float(div), rel=1e-5, abs=1e-7)
