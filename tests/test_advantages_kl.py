import chex
import core_refs as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxgrpo as jg

SETTINGS = settings(max_examples=40, deadline=None)
group_adv = jax.jit(jg.group_advantages, static_argnums=2, static_argnames=("scale", "ddof", "eps"))
rloo = jax.jit(jg.rloo_advantages, static_argnums=2)
future = jax.jit(jg.future_kl, static_argnames="kind")


@SETTINGS
@given(
  ref.groups(), st.sampled_from(["group", "batch", "none"]), st.sampled_from([0, 1]), st.sampled_from([1e-6, 1e-4, 0.0])
)
def test_group_advantages_match_bruteforce(data, scale, ddof, eps):
  _, _, gid, rewards, ng = data
  mean, denom = ref.group_stats(rewards.astype(np.float64), gid, ddof=ddof, eps=eps, scale=scale)
  want = (rewards - mean) / denom
  got = group_adv(rewards, gid, ng, scale=scale, ddof=ddof, eps=eps)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  assert np.all(np.isfinite(got))


@SETTINGS
@given(ref.groups())
def test_rloo_matches_bruteforce(data):
  _, _, gid, rewards, ng = data
  want = np.zeros(len(rewards))
  for i in range(len(rewards)):
    others = [rewards[j] for j in range(len(rewards)) if gid[j] == gid[i] and j != i]
    want[i] = rewards[i] - np.mean(others) if others else 0.0
  np.testing.assert_allclose(rloo(rewards, gid, ng), want, rtol=1e-5, atol=1e-6)


class HandComputed(chex.TestCase):
  """Hand-computed values, each kernel called directly and inside an outer ``jax.jit`` (chex variants:
  then every array input — β and ``max_delta`` included — is traced, and value checks are skipped)."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_grpo_hand_computed(self):
    f = self.variant(jg.group_advantages, static_argnums=2, static_argnames=("scale", "ddof", "eps"))
    r, gid = jnp.array([1.0, 0.0, 3.0]), jnp.array([0, 0, 1])
    # group 0: rewards 1, 0 -> mean .5, population std .5 -> +-1 ; group 1 singleton -> 0
    np.testing.assert_allclose(f(r, gid, 2, eps=0.0), [1.0, -1.0, 0.0])
    want = [0.5 / np.sqrt(0.5), -0.5 / np.sqrt(0.5), 0.0]  # sample std sqrt(.5)
    np.testing.assert_allclose(f(r, gid, 2, ddof=1, eps=0.0), want, rtol=1e-6)
    np.testing.assert_allclose(f(r, gid, 2, scale="none"), [0.5, -0.5, 0.0])
    rloo = self.variant(jg.rloo_advantages, static_argnums=2)
    np.testing.assert_allclose(rloo(r, gid, 2), [1.0, -1.0, 0.0])

  @chex.variants(with_jit=True, without_jit=True)
  def test_frpo_advantages_hand_computed_and_no_gradient(self):
    old = jnp.array([[-1.0, -2.0, -0.5, 0.0]])
    ref_ = jnp.array([[-1.5, -1.0, -0.5, 0.0]])
    mask = jnp.array([[True, True, True, False]])
    f = self.variant(lambda a, o, beta: jg.frpo_advantages(a, o, ref_, mask, beta=beta))
    # δ = .5, -1, 0 ; reversed cumsum: -.5, -1, 0 ; Â = a - β reg
    for beta in (0.1, jnp.float32(0.1)):  # static and traced β
      np.testing.assert_allclose(f(jnp.array([1.0]), old, beta), [[1.05, 1.1, 1.0, 0.0]], rtol=1e-6)
    g = jax.grad(lambda o: jnp.sum(f(jnp.array([1.0]), o, 0.1)))(old)
    np.testing.assert_array_equal(g, 0.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_kl_with_a_traced_max_delta(self):
    # k3 = e^-δ + δ - 1 inside the clamp, whatever its (traced) bound
    f = self.variant(lambda d, md: jg.kl_penalty(d, jnp.zeros_like(d), "k3", max_delta=md))
    d = jnp.array([[25.0, 0.5]])
    want = [[np.exp(-25) + 24, np.exp(-0.5) - 0.5]]
    np.testing.assert_allclose(f(d, jnp.float32(30.0)), want, rtol=1e-6)
    np.testing.assert_allclose(f(d, jnp.float32(40.0)), want, rtol=1e-6)
    lp, rlp, mask = jnp.array([[-0.3]]), jnp.array([[-1.1]]), jnp.array([[True]])
    single = self.variant(lambda lp, rlp: jg.future_kl(lp, rlp, mask, kind="k1"))
    chex.assert_trees_all_close(single(lp, rlp), jg.kl_penalty(lp, rlp, "k1"))  # one token: per-token KL


@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_zero_variance_and_singleton_groups_give_zero_and_finite_grads(ddof, eps):
  r = jnp.array([2.0, 2.0, 2.0, 5.0])
  gid = jnp.array([0, 0, 0, 1])
  adv = jg.group_advantages(r, gid, 2, ddof=ddof, eps=eps)
  np.testing.assert_array_equal(adv, 0.0)
  g = jax.grad(
    lambda r: jnp.sum(
      jg.group_advantages(r, gid, 2, ddof=ddof, eps=eps) ** 2 + jg.group_advantages(r, gid, 2, ddof=ddof, eps=eps)
    )
  )(r)
  assert np.all(np.isfinite(g))
  np.testing.assert_array_equal(jg.rloo_advantages(r, gid, 2), 0.0)


@pytest.mark.parametrize(
  "call, match",
  [
    (lambda: jg.group_advantages(jnp.zeros((2, 2)), jnp.zeros(2, jnp.int32), 1), "rewards"),
    (lambda: jg.group_advantages(jnp.zeros(3), jnp.zeros(2, jnp.int32), 1), "group_ids"),
    (lambda: jg.group_advantages(jnp.zeros(2), jnp.array([0, 3]), 2), "group_ids"),
    (lambda: jg.group_advantages(jnp.zeros(2), jnp.zeros(2), 1), "group_ids"),
    (lambda: jg.group_advantages(jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), 1), "rewards"),
    (lambda: jg.group_advantages(jnp.zeros(2), jnp.zeros(2, jnp.int32), 1, scale="std"), "scale"),
    (lambda: jg.group_advantages(jnp.zeros(2), jnp.zeros(2, jnp.int32), 0), "num_groups"),
  ],
)
def test_advantage_bad_inputs(call, match):
  with pytest.raises((ValueError, TypeError), match=match):
    call()


# ----------------------------------------------------------------------------- KL


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "forward_k3"])
def test_kl_penalty_matches_formula(kind):
  rng = np.random.default_rng(1)
  lp, rlp = rng.normal(size=(2, 3, 5)).astype(np.float32) - 1.0
  np.testing.assert_allclose(jg.kl_penalty(lp, rlp, kind), ref.kl(lp, rlp, kind), rtol=1e-5, atol=1e-6)


def test_k3_is_nonnegative_clamped_and_gradient_ignores_reference():
  lp = jnp.array([[0.0, -200.0, -1.0]])
  rlp = jnp.array([[-200.0, 0.0, -1.0]])
  k3 = jg.kl_penalty(lp, rlp, "k3")
  assert np.all(np.isfinite(k3)) and np.all(k3 >= 0)
  assert float(k3[0, 2]) == 0.0
  g_ref = jax.grad(lambda r: jnp.sum(jg.kl_penalty(lp, r, "k3")))(rlp)
  np.testing.assert_array_equal(g_ref, 0.0)


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.sampled_from(["k1", "k3", "forward_k3"]))
def test_future_kl_matches_bruteforce(seed, kind):
  rng = np.random.default_rng(seed)
  lp, rlp = (rng.normal(size=(2, 4, 6)) * 0.7 - 1).astype(np.float32)
  mask = np.arange(6)[None, :] < rng.integers(0, 7, size=(4, 1))
  want, mag = ref.future_kl(lp, rlp, mask, kind), ref.future_kl_magnitude(lp, rlp, mask, kind)  # own and later
  ref.assert_close_to_sum(future(lp, rlp, mask, kind=kind), want, mag, rtol=1e-4, atol=1e-5, what=kind)  # terms cancel


@pytest.mark.parametrize(
  "call, match",
  [
    (lambda: jg.kl_penalty(jnp.zeros((2, 3)), jnp.zeros((2, 3)), "k4"), "kind"),
    (lambda: jg.kl_penalty(jnp.zeros((2, 3)), jnp.zeros((2, 4))), "ref_logp"),
    (lambda: jg.kl_penalty(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3))), "logp"),
    (lambda: jg.future_kl(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones((2, 3))), "mask"),
    (lambda: jg.future_kl(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones((2, 3), bool), kind="k2"), "kind"),
    (
      lambda: jg.frpo_advantages(jnp.zeros(3), jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones((2, 3), bool), beta=0.1),
      "advantages",
    ),
    (
      lambda: jg.frpo_advantages(jnp.zeros(2), jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones((2, 3), bool), beta=-1.0),
      "beta",
    ),
  ],
)
def test_kl_bad_inputs(call, match):
  with pytest.raises((ValueError, TypeError), match=match):
    call()
