"""Hyper-parameters as traced inputs of the train step: one compiled step serves two β values, two ε
values and a β schedule (``traces == 1``), each equal to a step compiled with that number as a
constant; a hyper-parameter pytree that does not fit the config is refused before anything runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import G, flat_params, make_batch, sgd_state, sgd_step

import jaxgrpo as jg

# β > 0 switches the KL term on (structure); the dual clip is on, so its c is an input too
CONFIG = jg.preset("grpo", beta=0.04, dual_clip=3.0)


_step, _state = sgd_step, sgd_state


def _run(step, opt, batch, hypers):
  """Chained steps from the initial state: ``(losses, final flat params)``."""
  state, losses = _state(opt), []
  for h in hypers:
    state, m = step(state, batch) if h is None else step(state, batch, h)
    losses.append(float(m["loss"]))
  return losses, flat_params(state.params)


def _assert_same(got, want):
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-8)
  for k in want[1]:
    np.testing.assert_allclose(got[1][k], want[1][k], rtol=1e-6, atol=1e-7, err_msg=str(k))


@pytest.mark.slow
def test_one_compiled_step_serves_two_betas_two_epsilons_and_a_schedule():
  batch = make_batch()
  traced, opt = _step(CONFIG)
  cases = [dict(beta=0.02), dict(beta=0.3), dict(clip_eps_low=0.05, clip_eps_high=0.05), dict(dual_clip=1.5)]
  results, statics = {}, {}
  for kw in cases:
    got = _run(traced, opt, batch, [CONFIG.hyper(**kw)])
    statics[str(kw)], _ = _step(CONFIG.replace(**kw))  # the number as a compile-time constant
    want = _run(statics[str(kw)], opt, batch, [None])
    _assert_same(got, want)
    results[str(kw)] = got[0][0]
  assert traced.traces == 1, "one program for every value"
  assert len(set(results.values())) == len(cases)  # each number changed the loss

  # a β warm-up schedule of the step, inside the program: β = 0.02·(s+1) at step s
  schedule = lambda s: CONFIG.hyper(beta=0.02 * (s.astype(jnp.float32) + 1.0))
  scheduled, _ = _step(CONFIG, hyper_schedule=schedule)
  got = _run(scheduled, opt, batch, [None, None, None])
  want = _run(traced, opt, batch, [CONFIG.hyper(beta=b) for b in (0.02, 0.04, 0.06)])
  _assert_same(got, want)
  assert scheduled.traces == 1 and traced.traces == 1
  # the schedule's value at step s == the static config's β: the same loss as the constant program
  static = statics[str(dict(beta=0.02))]
  np.testing.assert_allclose(got[0][0], _run(static, opt, batch, [None])[0][0], rtol=1e-6)


def test_hyper_metrics_and_no_retrace_between_values():
  batch = make_batch()
  step, opt = _step(CONFIG)
  state = _state(opt)
  state, m = step(state, batch, CONFIG.hyper(beta=0.1))
  state, m2 = step(state, batch, CONFIG.hyper(beta=0.2, clip_eps_high=0.28))
  assert step.traces == 1
  assert float(m["hyper/beta"]) == pytest.approx(0.1) and float(m2["hyper/beta"]) == pytest.approx(0.2)
  assert float(m2["hyper/clip_eps_high"]) == pytest.approx(0.28) and float(m2["hyper/dual_clip"]) == 3.0


def test_a_hyper_that_does_not_fit_the_config_is_refused():
  with pytest.raises(ValueError, match="hyper.beta"):
    jg.preset("grpo").hyper(beta=0.1)  # β = 0 in the config: no KL term in its program
  with pytest.raises(ValueError, match="entropy_coef"):
    jg.preset("grpo").hyper(entropy_coef=0.01)
  with pytest.raises(ValueError, match="hyper.beta"):
    CONFIG.hyper(beta=-0.1)
  with pytest.raises(ValueError, match="clip_eps_low"):
    CONFIG.hyper(clip_eps_low=float("nan"))
  with pytest.raises(ValueError, match="dual_clip"):
    CONFIG.hyper(dual_clip=None)
  with pytest.raises(ValueError, match="dual_clip"):
    CONFIG.check_hyper(jg.preset("grpo", beta=0.04).hyper())
  with pytest.raises(TypeError, match="unknown hyper-parameter"):
    CONFIG.hyper(eps=0.2)
  with pytest.raises(TypeError, match="GRPOHyper"):
    CONFIG.check_hyper({"beta": 0.1})
  # zero where the config's term is off is fine; the values come back as f32[]
  h = jg.preset("grpo").hyper(beta=0.0, clip_eps_high=0.28)
  assert h.beta.dtype == jnp.float32 and h.beta.shape == () and h.dual_clip is None
  step, _ = _step(CONFIG)
  with pytest.raises(TypeError, match="GRPOHyper"):
    step.check_hyper((0.1,))
  with pytest.raises(TypeError, match="GRPOHyper"):
    _step(CONFIG, hyper_schedule=lambda s: {"beta": s})
  with pytest.raises(ValueError, match="hyper.beta"):
    _step(CONFIG, hyper_schedule=lambda s: CONFIG.hyper(beta=-1.0 + 0.0 * s))
  # grpo_iteration checks its hyper before the rollout (nothing sampled or compiled)
  step, opt = _step(CONFIG)
  prompts, pmask = np.ones((2, 3), np.int32), np.ones((2, 3), bool)
  with pytest.raises(ValueError, match="dual_clip"):
    jg.grpo_iteration(
      step,
      _state(opt),
      prompts,
      pmask,
      key=jax.random.key(0),
      reward_fn=lambda p, c: [0.0] * len(c),
      sampling=jg.SamplingConfig(num_samples=G, max_new_tokens=4),
      reference=jg.make_reference(step, _state(opt)),
      hyper=jg.preset("grpo", beta=0.04).hyper(),
    )
  assert step.traces == 0


def test_one_carrier_describes_the_configs_loss_and_refuses_another():
  """GRPOHyper is the loss's carrier and the step's (issue 34.4): config.hyper() carries the config's loss,
  aggregation and max_tokens, and a GRPOHyper built for another loss is refused, naming the field."""
  cfg = jg.preset("cispo")
  h = cfg.hyper(clip_eps_high=jnp.float32(4.0))
  assert (h.loss, h.aggregation, h.max_tokens) == (cfg.loss, cfg.aggregation, cfg.max_tokens)
  assert float(h.clip_eps_high) == 4.0 and float(h.importance_cap) == cfg.importance_cap
  with pytest.raises(ValueError, match="hyper.loss"):
    cfg.check_hyper(jg.GRPOHyper(clip_eps_high=jnp.float32(4.0)))  # the default loss is "ppo"
