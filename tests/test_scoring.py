"""Issue 49 item 2: the one scorer's bookkeeping (``jaxgrpo.loop.scoring``: the rollout metrics of a batch,
the gathers, the dynamic-sampling test) that the synchronous source, the bounded-staleness producer and the
partial pools share, and the one log-prob recomputation (``collect.recompute_old_logp``) of the learner and the
engine path, each against NumPy from its definition. That every schedule reports the same numbers through
them: tests/test_async_rollout.py (k = 0 is the synchronous loop bit for bit), tests/test_partial_rollouts.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxgrpo.loop import collect, scoring
from jaxgrpo.step.batch import Batch


def test_batch_metrics_from_the_definition():
  """reward_mean/std over the finite rewards (population std), reward/<fn> the finite mean of each function,
  completion_length the mean length, then the extra metrics, reward_counters/<k> in sorted order, env/*."""
  rng = np.random.default_rng(0)
  rewards = rng.normal(size=12).astype(np.float32)
  rewards[[2, 7]] = [np.nan, np.inf]  # missing samples: not numbers to average
  acc = rng.integers(0, 2, 12).astype(np.float32)
  fmt = rng.normal(size=12).astype(np.float32)
  fmt[5] = np.nan
  lengths = rng.integers(1, 9, 12).astype(np.int32)
  counters = {"zeta/timeouts": 2, "accuracy/errors": 1}
  got = scoring.batch_metrics(
    rewards,
    {"accuracy": acc, "format": fmt},
    lengths,
    counters,
    extra={"dynamic_sampling/rounds": 2},
    env={"env/turns": 1.5},
  )
  finite = rewards[np.isfinite(rewards)].astype(np.float64)
  want = {
    "reward_mean": finite.mean(),
    "reward_std": np.sqrt(((finite - finite.mean()) ** 2).mean()),
    "reward/accuracy": acc.astype(np.float64).mean(),
    "reward/format": fmt[np.isfinite(fmt)].astype(np.float64).mean(),
    "completion_length": lengths.mean(),
    "dynamic_sampling/rounds": 2,
    "reward_counters/accuracy/errors": 1,
    "reward_counters/zeta/timeouts": 2,
    "env/turns": 1.5,
  }
  assert list(got) == list(want)
  for k, v in want.items():
    assert abs(got[k] - v) <= 1e-6 * max(1.0, abs(v)), (k, got[k], v)
  none = scoring.batch_metrics(np.full(4, np.nan, np.float32), {}, np.ones(4), {})
  assert np.isnan(none["reward_mean"]) and np.isnan(none["reward_std"]) and none["completion_length"] == 1.0


def test_informative_groups_and_one_process_gathers():
  """A group (G consecutive rows) is informative when its rewards are not all equal; in one
  process the gathers return what they are given (rewards as float32, counters as they are)."""
  r = np.array([1, 1, 1, 0, 1, 0, 2, 2, 5, 5, 3, 3], np.float32)
  got = scoring.informative(r, 2)
  want = [len(set(r[i : i + 2].tolist())) > 1 for i in range(0, 12, 2)]
  assert got.tolist() == want == [False, True, True, False, False, False]
  total, per_fn, lengths, counters = scoring.gather_scores(
    r.astype(np.float64), {"a": r}, np.arange(12), {"x": 3}, mesh=None
  )
  assert total.dtype == np.float32 and np.array_equal(total, r)
  assert np.array_equal(per_fn["a"], r) and lengths.tolist() == list(range(12)) and counters == {"x": 3}


def _batch(rng, b=3, t=5):
  mask = np.arange(t)[None] < rng.integers(1, t + 1, b)[:, None]
  logp = -rng.random((b, t)).astype(np.float32)
  return Batch(
    prompt_tokens=np.ones((b, 2), np.int32),
    prompt_mask=np.ones((b, 2), bool),
    completions=np.ones((b, t), np.int32),
    mask=mask,
    old_logp=logp,
    group_ids=np.zeros(b, np.int32),
    rewards=np.zeros(b, np.float32),
  )


def test_one_log_prob_recomputation_for_the_learner_and_the_engine_path():
  """``recompute_old_logp``: old_logp := logp_fn(params, batch) (π_old), behavior_logp := the sampler's μ, and
  the mismatch k3 = mean over sampled tokens of r − log r − 1 (r = π_old/μ) with max |log π_old − log μ|;
  ``engine_old_logp`` is the same recomputation read from ``behavior_logp``."""
  rng = np.random.default_rng(1)
  batch = _batch(rng)
  shift = rng.normal(size=batch.old_logp.shape).astype(np.float32) * 0.3
  logp_fn = lambda params, b: jnp.asarray(b.old_logp) + params  # noqa: E731 - the policy's log-probs, stood in for
  out, (k3, diff) = collect.recompute_old_logp(logp_fn, shift, batch)
  mu = batch.old_logp.astype(np.float64)
  old = mu + shift
  np.testing.assert_allclose(np.asarray(out.old_logp), old, rtol=0, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(out.behavior_logp), batch.old_logp)
  d = (old - mu)[batch.mask]
  np.testing.assert_allclose(float(k3), np.mean(np.exp(d) - d - 1), rtol=1e-4)
  np.testing.assert_allclose(float(diff), np.abs(d).max(), rtol=1e-5)
  engine_batch = batch._replace(old_logp=np.zeros_like(batch.old_logp), behavior_logp=batch.old_logp)
  out2, metrics = collect.engine_old_logp(logp_fn, shift, engine_batch)
  np.testing.assert_allclose(np.asarray(out2.old_logp), old, rtol=0, atol=1e-6)
  assert metrics == {"engine/mismatch_k3": float(k3), "engine/logp_abs_diff_max": float(diff)}
