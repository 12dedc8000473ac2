import chex
import core_refs as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxgrpo as jg

SETTINGS = settings(max_examples=30, deadline=None)
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


class HandComputed(chex.TestCase):
  """Hand-computed losses, the kernel called directly and inside an outer ``jax.jit`` (chex variants:
  the :class:`GRPOHyper` numbers then traced)."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_aggregations_hand_computed(self):
    # ratio 1 and advantage -l make the per-token loss exactly l
    l = np.array([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], bool)
    lp = jnp.zeros((3, 3))
    loss = self.variant(lambda a, hyper: jg.policy_loss(lp, lp, a, mask, hyper))
    want = {"token-mean": 6 / 3, "seq-mean-token-mean": (1.5 + 3) / 2, "seq-mean-token-sum-norm": 6 / (3 * 3)}
    for agg, w in want.items():
      value, metrics = loss(jnp.asarray(-l), jg.GRPOHyper(aggregation=agg))
      assert float(value) == pytest.approx(w), agg
      assert float(metrics["tokens"]) == 3 and float(metrics["sequences"]) == 2
    value, _ = loss(jnp.asarray(-l), jg.GRPOHyper(aggregation="seq-mean-token-sum-norm", max_tokens=4))
    assert float(value) == pytest.approx(6 / 12)

  @chex.variants(with_jit=True, without_jit=True)
  def test_clip_range_and_dual_clip_as_traced_numbers(self):
    """One token at ratio ρ with advantage A: ``−min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A)``, ``−max(·, cA)``."""
    loss = self.variant(
      lambda ratio, adv, hyper: jg.policy_loss(
        jnp.log(ratio)[None, None], jnp.zeros((1, 1)), adv[None], jnp.ones((1, 1), bool), hyper
      )[0]
    )
    f32 = jnp.float32
    cases = [  # (ratio, A, hyper, want)
      (1.25, 1.0, jg.GRPOHyper(clip_eps_high=f32(0.28)), -1.25),
      (1.35, 1.0, jg.GRPOHyper(clip_eps_high=f32(0.28)), -1.28),
      (1.35, 1.0, jg.GRPOHyper(clip_eps_high=f32(0.1)), -1.1),
      (0.5, -1.0, jg.GRPOHyper(clip_eps_low=f32(0.3)), 0.7),
      (5.0, -1.0, jg.GRPOHyper(dual_clip=f32(3.0)), 3.0),
      (5.0, -1.0, jg.GRPOHyper(dual_clip=f32(6.0)), 5.0),
    ]
    for ratio, adv, hyper, want in cases:
      assert float(loss(f32(ratio), f32(adv), hyper)) == pytest.approx(want, rel=1e-6), (ratio, adv, hyper)


def _one_token_loss(ratio, adv, **kw):
  logp = jnp.log(jnp.array([[ratio]], jnp.float32))
  old = jnp.zeros((1, 1))
  hyper = jg.GRPOHyper(**kw)
  f = lambda lp: jg.policy_loss(lp, old, jnp.array([adv], jnp.float32), jnp.ones((1, 1), bool), hyper)[0]
  return (
    float(f(logp)),
    float(jax.grad(f)(logp)[0, 0]),
    jg.policy_loss(logp, old, jnp.array([adv], jnp.float32), jnp.ones((1, 1), bool), hyper)[1],
  )


@pytest.mark.parametrize(
  "ratio, adv, want_loss, clipped, which",
  [
    (1.1, 1.0, -1.1, False, None),  # inside the range, positive A: gradient flows
    (1.5, 1.0, -1.2, True, "high"),  # above 1+ε with A>0: clipped, no gradient
    (0.5, 1.0, -0.5, False, None),  # below 1-ε with A>0: min picks the unclipped term
    (0.9, -1.0, 0.9, False, None),  # inside the range, negative A
    (0.5, -1.0, 0.8, True, "low"),  # below 1-ε with A<0: clipped
    (1.5, -1.0, 1.5, False, None),  # above 1+ε with A<0: unclipped (corrective gradient kept)
  ],
)
def test_clipping_both_signs(ratio, adv, want_loss, clipped, which):
  loss, grad, metrics = _one_token_loss(ratio, adv)
  assert loss == pytest.approx(want_loss, rel=1e-6)
  if clipped:
    assert grad == 0.0
    assert float(metrics[f"clip_frac_{which}"]) == 1.0
  else:
    assert grad == pytest.approx(-adv * ratio, rel=1e-5)  # d(-ρA)/dlogp = -ρA
    assert float(metrics["clip_frac_low"]) == float(metrics["clip_frac_high"]) == 0.0


def test_asymmetric_clip_and_dual_clip():
  loss, grad, _ = _one_token_loss(1.25, 1.0, clip_eps_high=0.28)
  assert loss == pytest.approx(-1.25) and grad != 0.0
  loss, grad, _ = _one_token_loss(1.35, 1.0, clip_eps_high=0.28)
  assert loss == pytest.approx(-1.28) and grad == 0.0
  loss, grad, m = _one_token_loss(5.0, -1.0, dual_clip=3.0)
  assert loss == pytest.approx(3.0) and grad == 0.0 and float(m["clip_frac_dual"]) == 1.0
  loss, grad, m = _one_token_loss(2.0, -1.0, dual_clip=3.0)
  assert loss == pytest.approx(2.0) and grad != 0.0 and float(m["clip_frac_dual"]) == 0.0


@pytest.mark.parametrize("agg", AGGS)
def test_all_padding_gives_finite_loss_and_grads(agg):
  lp = jnp.full((2, 3), -1.0)
  mask = jnp.zeros((2, 3), bool)
  f = lambda lp: jg.policy_loss(
    lp, lp - 0.1, jnp.array([1.0, -1.0]), mask, jg.GRPOHyper(aggregation=agg, beta=0.1), kl=jg.kl_penalty(lp, lp + 0.3)
  )[0]
  assert float(f(lp)) == 0.0
  g = jax.grad(f)(lp)
  assert np.all(np.isfinite(g)) and np.all(g == 0)
  _, metrics = jg.policy_loss(lp, lp, jnp.zeros(2), mask, jg.GRPOHyper(aggregation=agg))
  assert all(np.isfinite(float(v)) for k, v in metrics.items() if not k.endswith(("_max", "_min")))


def _random_batch(seed, b=6, t=5):
  rng = np.random.default_rng(seed)
  lp = rng.normal(size=(b, t)).astype(np.float32) * 0.3 - 1
  old = lp + rng.normal(size=(b, t)).astype(np.float32) * 0.3
  refl = lp + rng.normal(size=(b, t)).astype(np.float32) * 0.3
  adv = rng.normal(size=(b, t)).astype(np.float32)
  mask = np.arange(t)[None] < rng.integers(0, t + 1, size=(b, 1))
  w = rng.uniform(0.1, 1, size=(b, t)).astype(np.float32)
  return lp, old, refl, adv, mask, w


@SETTINGS
@given(st.integers(0, 10**6), st.sampled_from(AGGS), st.integers(1, 5), st.booleans())
def test_two_micro_batches_equal_the_full_batch(seed, agg, split, per_token_adv):
  lp, old, refl, adv, mask, w = _random_batch(seed)
  if not per_token_adv:
    adv = adv[:, 0]
  hyper = jg.GRPOHyper(aggregation=agg, beta=0.04, dual_clip=3.0, clip_eps_high=0.28, max_tokens=5)

  def terms(sl):
    return jg.policy_loss_terms(
      lp[sl], old[sl], adv[sl], mask[sl], hyper, token_weights=w[sl], kl=jg.kl_penalty(lp[sl], refl[sl])
    )

  full_loss, full_m = jg.finalize_terms(terms(slice(None)))
  loss, m = jg.finalize_terms(jg.combine_terms(terms(slice(0, split)), terms(slice(split, None))))
  # the two sum the same terms in another order: a tolerance relative to Σ|terms| (a bound on each token's
  # |loss|: the ratio at most max(ρ, dual clip 3), plus β·k3), not to the loss, which may cancel to ~0
  rho = np.maximum(np.exp(lp.astype(np.float64) - old), 3.0)
  a = np.abs(adv if adv.ndim == 2 else adv[:, None])
  per_token = (rho * a + 0.04 * np.abs(ref.kl(lp, refl, "k3"))) * w
  mag = np.sum(ref.aggregation_coefficients(mask, agg, max_tokens=5) * per_token)
  ref.assert_close_to_sum(loss, full_loss, mag, rtol=1e-5, atol=1e-7, what=agg)
  chex.assert_trees_all_close(m, full_m, rtol=1e-5, atol=1e-6)


def test_token_weights_multiply_policy_and_kl_terms_denominator_unchanged():
  lp, old, refl, adv, mask, w = _random_batch(3)
  mask[:] = True
  kl = np.asarray(jg.kl_penalty(lp, refl))
  ratio = np.exp(lp - old)
  a = adv
  s = np.minimum(ratio * a, np.clip(ratio, 0.8, 1.2) * a)
  want = np.sum(w * (-s + 0.1 * kl)) / mask.sum()
  got, _ = jg.policy_loss(lp, old, adv, mask, jg.GRPOHyper(beta=0.1), token_weights=w, kl=kl)
  np.testing.assert_allclose(got, want, rtol=1e-5)


# ------------------------------------------------------------- the λ-GRPO theorem


def _prefix_ids(tokens, mask, gid):
  """Unique id per (group, prefix) node at each position; -1 on padding."""
  v = ref.valid_prefix(mask)
  ids, table = np.full(tokens.shape, -1), {}
  for i in range(tokens.shape[0]):
    for t in range(tokens.shape[1]):
      if v[i, t]:
        ids[i, t] = table.setdefault((gid[i], tuple(tokens[i, : t + 1])), len(table))
  return ids, len(table)


@settings(max_examples=25, deadline=None)
@given(ref.groups(max_b=8, max_t=6, vocab=2, max_groups=3), st.integers(0, 10**6), st.sampled_from([0.0, 0.04]))
def test_theorem_grpo_is_a_prm_and_lambda_grpo_counts_each_step_once(data, seed, beta):
  tokens, mask, gid, rewards, ng = data
  ids, n_nodes = _prefix_ids(tokens, mask, gid)
  if n_nodes == 0:
    return
  rng = np.random.default_rng(seed)
  theta0 = rng.normal(size=n_nodes).astype(np.float32) * 0.5 - 1.0
  ref_theta = theta0 + rng.normal(size=n_nodes).astype(np.float32) * 0.3
  idx = jnp.asarray(np.maximum(ids, 0))
  real = ids >= 0
  n_tok = real.sum()

  # independent NumPy step advantages A(i,t) per node
  mean, denom = ref.group_stats(rewards.astype(np.float64), gid)
  r_proc = ref.process_rewards(rewards.astype(np.float64), tokens, mask, gid)
  a_step = np.where(real, (r_proc - mean[:, None]) / denom[:, None], 0.0).astype(np.float32)
  node_adv = np.zeros(n_nodes)
  node_adv[ids[real]] = a_step[real]

  def logp_of(theta):
    return jnp.where(real, theta[idx], 0.0)

  def loss_with(adv, weights=None):
    def f(theta):
      lp = logp_of(theta)
      kl = jg.kl_penalty(lp, logp_of(jnp.asarray(ref_theta)), "k3")
      return jg.policy_loss(
        lp, jax.lax.stop_gradient(lp), adv, jnp.asarray(mask), jg.GRPOHyper(beta=beta), token_weights=weights, kl=kl
      )[0]

    return f

  a = jg.group_advantages(rewards, gid, ng)
  grpo = loss_with(a)
  prm = loss_with(jnp.asarray(a_step))
  # tolerances relative to the magnitudes summed (advantages sum to ~0 over a group: the losses cancel),
  # per token |a_i| + |A(i,t)| + β·|k3| and its derivative's bound; per node for the gradients
  d = theta0 - ref_theta
  d_u = np.exp(-d) + d - 1
  tok = np.where(real, np.abs(np.asarray(jg.group_advantages(rewards, gid, ng)))[:, None] + np.abs(a_step), 0.0)
  mag_value = (tok.sum() + beta * d_u[ids[real]].sum()) / n_tok
  mag_grad = np.zeros(n_nodes)
  np.add.at(mag_grad, ids[real], (tok[real] + beta * np.abs(1 - np.exp(-d[ids[real]]))) / n_tok)

  def close(got, want, mag, what):
    ref.assert_close_to_sum(got, want, mag, rtol=1e-4, atol=1e-6, what=what)

  # GRPO == the PRM loss with token advantages A(i,t), value and gradient
  close(grpo(theta0), prm(theta0), mag_value, "GRPO == PRM value")
  close(jax.grad(grpo)(theta0), jax.grad(prm)(theta0), mag_grad, "GRPO == PRM gradient")

  # λ-GRPO == the PRM loss with each step (node) counted once: -1/N Σ_u (ρ_u A_u - β D_u)
  sizes = jg.process_set_sizes(tokens, mask, gid)
  lam = loss_with(a, jnp.where(sizes > 0, 1.0 / jnp.maximum(sizes, 1), 0.0))
  want_value = -(node_adv - beta * d_u).sum() / n_tok
  want_grad = -(node_adv - beta * (1 - np.exp(-d))) / n_tok
  close(lam(theta0), want_value, mag_value, "λ-GRPO value")
  close(jax.grad(lam)(theta0), want_grad, mag_grad, "λ-GRPO gradient")


def test_lambda_grpo_with_all_sizes_one_is_grpo():
  # distinct first tokens: every |λ| = 1
  tokens, mask, gid = ref.from_strings(["ABC", "BCA", "CAB", "DD"], group_ids=[0, 0, 0, 1])
  cfg_g, cfg_l = jg.preset("grpo"), jg.preset("lambda_grpo")
  rewards = jnp.array([1.0, 0.0, 0.5, 1.0])
  rng = np.random.default_rng(0)
  lp = jnp.asarray(rng.normal(size=tokens.shape).astype(np.float32))
  old = lp - 0.05

  def loss(cfg, lp):
    adv, w = jg.rollout_advantages(cfg, rewards, tokens, mask, gid, 2)
    return jg.finalize_terms(jg.objective_terms(cfg, lp, old, adv, mask, token_weights=w))[0]

  np.testing.assert_allclose(loss(cfg_l, lp), loss(cfg_g, lp), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(lambda x: loss(cfg_l, x))(lp), jax.grad(lambda x: loss(cfg_g, x))(lp), rtol=1e-6)


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(logp=jnp.zeros((2,))), "logp"),
    (dict(old_logp=jnp.zeros((2, 4))), "old_logp"),
    (dict(advantages=jnp.zeros((3,))), "advantages"),
    (dict(advantages=jnp.zeros((2, 3, 1))), "advantages"),
    (dict(mask=jnp.ones((2, 3))), "mask"),
    (dict(mask=jnp.ones((2, 2), bool)), "mask"),
    (dict(aggregation="mean"), "aggregation"),
    (dict(dual_clip=0.5), "dual_clip"),
    (dict(token_weights=jnp.ones((2, 2))), "token_weights"),
    (dict(kl=jnp.ones((3, 3))), "kl"),
    (dict(clip_eps_low=-0.1), "clip"),
  ],
)
def test_policy_loss_bad_inputs(kw, match):
  args = dict(logp=jnp.zeros((2, 3)), old_logp=jnp.zeros((2, 3)), advantages=jnp.zeros(2), mask=jnp.ones((2, 3), bool))
  args.update(kw)
  hyper = {k: args.pop(k) for k in ("aggregation", "dual_clip", "clip_eps_low") if k in args}
  with pytest.raises((ValueError, TypeError), match=match):
    arrays = [args.pop(k) for k in ("logp", "old_logp", "advantages", "mask")]
    jg.policy_loss(*arrays, jg.GRPOHyper(**hyper), **args)


# ------------------------------------------------------------- numbers as traced inputs


def test_traced_numbers_equal_static_ones_under_one_program_and_vmap():
  """β, ε, c, τ± and the entropy coefficient as f32[] arrays: the loss of Python floats (static), one
  compiled program for every value, and a vmap over a grid equals the loop of static calls."""
  lp, old, refl, adv, mask, w = _random_batch(7)
  kl = jg.kl_penalty(lp, refl)
  ent = np.abs(lp)
  grid = dict(beta=[0.0, 0.5], clip_eps_high=[0.1, 0.4], dual_clip=[1.05, 1.5])
  for name, values in grid.items():
    base = dict(beta=0.04, clip_eps_high=0.2, dual_clip=3.0, entropy_coef=0.01)
    static = [
      jg.policy_loss(lp, old, adv, mask, jg.GRPOHyper(**{**base, name: v}), kl=kl, entropy=ent)[0] for v in values
    ]

    def loss(v, name=name, base=base):
      return jg.policy_loss(lp, old, adv, mask, jg.GRPOHyper(**{**base, name: v}), kl=kl, entropy=ent)[0]

    swept = jax.vmap(loss)(jnp.asarray(values, jnp.float32))
    np.testing.assert_allclose(swept, static, rtol=1e-6, err_msg=name)
    before = jg.kernels.losses._policy_loss._cache_size()
    one_by_one = [loss(jnp.float32(v)) for v in values]
    np.testing.assert_allclose(one_by_one, static, rtol=1e-6, err_msg=name)
    assert jg.kernels.losses._policy_loss._cache_size() == before + 1, "one program for every traced value"
    assert len(set(np.asarray(static).tolist())) == len(values), name  # the number matters here
  # a traced β still checks its range when concrete, and a traced β needs the kl input
  with pytest.raises(ValueError, match="beta"):
    jg.GRPOHyper(beta=jnp.float32(-0.1))
  with pytest.raises(ValueError, match="kl"):
    jg.policy_loss(lp, old, adv, mask, jg.GRPOHyper(beta=jnp.float32(0.1)))
  jg.policy_loss(lp, old, adv, mask, jg.GRPOHyper(beta=jnp.float32(0.0)))  # a concrete 0 needs none


def test_a_loss_hyper_is_a_pytree_with_static_structure():
  h = jg.GRPOHyper(loss="cispo", beta=jnp.float32(0.1), clip_eps_low=1.0)
  leaves, treedef = jax.tree.flatten(h)
  assert len(leaves) == 1 and float(leaves[0]) == pytest.approx(0.1)  # only the array is a leaf
  back = jax.tree.unflatten(treedef, leaves)
  assert (back.loss, back.clip_eps_low, back.aggregation) == ("cispo", 1.0, "token-mean")
  with pytest.raises(ValueError, match="scalar"):
    lp, old, _, adv, mask, _ = _random_batch(1)
    jg.policy_loss(lp, old, adv, mask, jg.GRPOHyper(clip_eps_low=jnp.zeros(2)))
