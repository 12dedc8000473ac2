"""Direct (notebook-style) calls of the kernels (issue 13): after a warm-up call with the same shapes,
a direct call is one cached jitted call (no tracing, no eager op); the same call inside an outer jit,
under vmap and under grad gives the same numbers. No timing here: scripts/bench_direct_calls.py
measures."""

import functools
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgrpo as jg

B, T, G = 8, 5, 4


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, 4, size=(B, T)).astype(np.int32)
  tokens[1, :3] = tokens[0, :3]
  mask = np.arange(T)[None] < rng.integers(1, T + 1, size=(B, 1))
  logp = -np.abs(rng.normal(size=(B, T))).astype(np.float32)
  return dict(
    rewards=jnp.asarray(rng.integers(0, 2, size=B).astype(np.float32)),
    group_ids=jnp.asarray(np.arange(B, dtype=np.int32) // G),
    tokens=jnp.asarray(tokens),
    mask=jnp.asarray(mask),
    logp=jnp.asarray(logp),
    old=jnp.asarray(logp + 0.05),
    ref=jnp.asarray(logp - 0.1),
    key=jax.random.key(seed),
  )


CALLS = {
  "group_advantages": lambda d: jg.group_advantages(d["rewards"], d["group_ids"], 2, scale="batch", ddof=1),
  "group_baseline": lambda d: jg.group_baseline(d["rewards"], d["group_ids"], 2),
  "rloo_advantages": lambda d: jg.rloo_advantages(d["rewards"], d["group_ids"], 2),
  "num_missing": lambda d: jg.kernels.advantages.num_missing(d["rewards"]),
  "kl_penalty": lambda d: jg.kl_penalty(d["logp"], d["ref"], "forward_k3", mask=d["mask"], max_delta=10.0),
  "future_kl": lambda d: jg.future_kl(d["old"], d["ref"], d["mask"], kind="k3"),
  "frpo_advantages": lambda d: jg.frpo_advantages(d["rewards"], d["old"], d["ref"], d["mask"], beta=0.01),
  "policy_loss": lambda d: jg.policy_loss(
    d["logp"],
    d["old"],
    d["rewards"],
    d["mask"],
    jg.GRPOHyper(beta=0.04, dual_clip=3.0, aggregation="seq-mean-token-mean"),
    kl=d["ref"],
  ),
  "policy_loss_terms": lambda d: jg.policy_loss_terms(
    d["logp"], d["old"], d["rewards"], d["mask"], jg.GRPOHyper(max_tokens=8)
  ),
  "finalize_terms": lambda d: jg.finalize_terms(jg.policy_loss_terms(d["logp"], d["old"], d["rewards"], d["mask"])),
  "rollout_advantages(lambda_frpo)": lambda d: jg.rollout_advantages(
    jg.preset("lambda_frpo"),
    d["rewards"],
    d["tokens"],
    d["mask"],
    d["group_ids"],
    2,
    old_logp=d["old"],
    ref_logp=d["ref"],
  ),
  "rollout_advantages(dr_grpo)": lambda d: jg.rollout_advantages(
    jg.preset("dr_grpo"), d["rewards"], d["tokens"], d["mask"], d["group_ids"], 2
  ),
  "filter_logits": lambda d: jg.sampling.filter_logits(d["logp"], top_k=2, top_p=0.9),
  "sample_categorical": lambda d: jg.sampling.sample_categorical(d["key"], d["logp"]),
  "objective_terms(grpo, beta)": lambda d: jg.objective_terms(
    jg.preset("grpo", beta=0.04), d["logp"], d["old"], d["rewards"], d["mask"], ref_logp=d["ref"]
  ),
  "policy_surrogate(gmpo)": lambda d: jg.policy_surrogate(d["logp"], d["old"], d["rewards"], d["mask"], loss="gmpo"),
  "importance_weights": lambda d: jg.importance_weights(
    d["old"], d["ref"], d["mask"], correction="mis", level="sequence"
  ),
  "objective_terms(gspo_token, tis, entropy)": lambda d: jg.objective_terms(
    jg.preset("gspo_token", importance_correction="tis", entropy_coef=0.01),
    d["logp"],
    d["old"],
    d["rewards"],
    d["mask"],
    behavior_logp=d["ref"],
    entropy=-d["logp"],
  ),
}


def _primitive_binds(fn) -> int:
  """How many primitives ``fn()`` applies from Python (``Primitive.bind`` calls): every eager jnp op
  and every traced op is one; a cached jitted call is none."""
  count = 0

  def profile(frame, event, arg):
    nonlocal count
    if event == "call" and frame.f_code.co_name == "bind":
      count += 1

  sys.setprofile(profile)
  try:
    out = fn()
  finally:
    sys.setprofile(None)
  jax.block_until_ready(out)
  return count


@pytest.mark.parametrize("name", CALLS)
def test_direct_call_after_warm_up_is_one_compiled_call(name):
  """After a warm-up with the same shapes, a direct call traces nothing and runs no op eagerly: only
  the checks run in Python, then one cached jitted call (on today's main: 18+ eager ops per call)."""
  call = CALLS[name]
  jax.block_until_ready(call(_batch(0)))
  fresh = _batch(1)  # new values, same shapes
  assert _primitive_binds(lambda: call(fresh)) == 0


@functools.cache
def _all_inside_one_outer_jit():
  """Every call of ``CALLS`` traced inside one outer ``jit`` (one compile for all of them, not one each)."""
  return jax.jit(lambda d: {name: call(d) for name, call in CALLS.items()})(_batch(2))


@pytest.mark.parametrize("name", CALLS)
def test_same_numbers_inside_an_outer_jit(name):
  direct = CALLS[name](_batch(2))
  jitted = _all_inside_one_outer_jit()[name]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), direct, jitted)


def test_kernels_compose_under_vmap_and_grad():
  d = _batch(3)
  rewards = jnp.stack([d["rewards"], 1.0 - d["rewards"]])
  got = jax.vmap(lambda r: jg.group_advantages(r, d["group_ids"], 2))(rewards)
  for k in range(2):
    np.testing.assert_allclose(got[k], jg.group_advantages(rewards[k], d["group_ids"], 2), rtol=1e-6)

  def loss(lp):
    return jg.finalize_terms(
      jg.objective_terms(jg.preset("grpo", beta=0.04), lp, d["old"], d["rewards"], d["mask"], ref_logp=d["ref"])
    )[0]

  g, g_jit = jax.grad(loss)(d["logp"]), jax.jit(jax.grad(loss))(d["logp"])
  np.testing.assert_allclose(g, g_jit, rtol=1e-6, atol=1e-8)
  assert np.any(np.asarray(g) != 0)


def test_rollout_advantages_derives_the_group_size_bound_from_concrete_ids():
  d = _batch(4)
  cfg = jg.preset("lambda_grpo")
  _, w = jg.rollout_advantages(cfg, d["rewards"], d["tokens"], d["mask"], d["group_ids"], 2)
  sizes = jg.process_set_sizes(d["tokens"], d["mask"], d["group_ids"], exact=True)
  np.testing.assert_allclose(w, np.where(sizes > 0, 1.0 / np.maximum(sizes, 1), 0.0), rtol=1e-6)
  _, w_bound = jg.rollout_advantages(cfg, d["rewards"], d["tokens"], d["mask"], d["group_ids"], 2, max_group_size=G)
  np.testing.assert_array_equal(w, w_bound)


def test_bench_direct_calls_smoke(capsys):
  path = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_direct_calls.py")
  spec = importlib.util.spec_from_file_location("bench_direct_calls", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  results = bench.main(["--quick"])
  assert {
    "group_advantages",
    "policy_loss",
    "rollout_advantages(lambda_grpo)",
    "objective_terms(grpo, beta=0.04)",
  } <= set(results)
  assert all(direct > 0 and jitted > 0 for direct, jitted in results.values())
  assert "in jit ms" in capsys.readouterr().out
