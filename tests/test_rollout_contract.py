"""What a rollout must carry to be trained on, checked before anything trains on it (issue 47, items 3 and 4):

- its sampling temperature travels with it (``Rollout.temperature`` → ``Batch.temperature``), and a step (or a
  reference pass) at another temperature refuses it in one line — before, ``examples/custom_iteration.py``'s
  pattern with ``TrainConfig(temperature=0.7)`` and ``jaxgrpo.sample``'s default 1.0 ran its "on-policy" first
  update at ratios 0.84–1.29 without a word;
- an engine's ``Generation`` is checked in ``grpo_iteration`` (rows = prompts × G, group ids, shapes, prefix
  masks, finite log-probs on real tokens, the temperature it reports), one line naming the engine — before, an
  engine returning 7 rows of 8 trained without error.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from helpers import tiny_model

from jaxgrpo.kernels.config import preset
from jaxgrpo.loop import iteration
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout.engines import Generation, finish_reasons
from jaxgrpo.rollout.sampling import SamplingConfig, generate
from jaxgrpo.step import train
from jaxgrpo.step.feed import make_batch, make_reference

PROMPTS = np.array([[3, 4, 5], [0, 6, 7]], np.int32)
SAMPLING = SamplingConfig(num_samples=4, max_new_tokens=6, eos_ids=(1,))


def _step(temperature: float, beta: float = 0.0):
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.adam(1e-2)
  graphdef, state, shardings = train.init_train_state(tiny_model(seed=2), opt, mesh)
  tc = train.TrainConfig(group_size=4, chunk_size=4, temperature=temperature)
  config = preset("grpo", beta=beta)
  return train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc), state


def _rewards(n: int) -> np.ndarray:
  return (np.arange(n) % 3).astype(np.float32)  # unequal inside each group: real advantages


def test_a_batch_sampled_at_another_temperature_is_refused_before_the_update():
  step, state = _step(temperature=0.7, beta=0.04)
  reference = make_reference(step, state)
  policy = iteration.policy_model(step.graphdef, state)
  key = jax.random.key(0)
  rollout = iteration.sample(policy, PROMPTS, PROMPTS > 0, SAMPLING, key=key)  # the default temperature, 1.0
  assert rollout.temperature == 1.0
  batch = make_batch(rollout, _rewards(8), mesh=step.mesh, buckets=None)
  assert batch.temperature == 1.0  # carried from the rollout, through bucketing and placement
  want = (
    "the batch (batch.temperature, from its Rollout) was sampled at temperature 1.0, but the train step's "
    "TrainConfig.temperature is 0.7"
  )
  for call in (lambda: reference(batch), lambda: step(state, batch)):
    with pytest.raises(ValueError) as e:
      call()
    assert str(e.value).startswith(want) and "temperature=step.train_config.temperature" in str(e.value)
    assert "\n" not in str(e.value)
  # nothing was donated by the refusal; the same prompts sampled at the step's temperature train on-policy:
  # the first update's ratio is exp(logp − old_logp) = 1 up to float32 rounding (before the fix at 1.0: 0.84–1.29)
  rollout = iteration.sample(policy, PROMPTS, PROMPTS > 0, SAMPLING, key=key, temperature=0.7)
  batch = reference(make_batch(rollout, _rewards(8), mesh=step.mesh, buckets=None))
  state, metrics = step(state, batch)
  assert abs(float(metrics["ratio_min"]) - 1) < 1e-5 and abs(float(metrics["ratio_max"]) - 1) < 1e-5
  # greedy rollouts report temperature-1 log-probs (sampling.generate): a step at 1.0 takes them, one at 0.7 not
  greedy = iteration.sample(iteration.policy_model(step.graphdef, state), PROMPTS, PROMPTS > 0, SAMPLING, key=key,
                            temperature=0.0)  # fmt: skip
  with pytest.raises(ValueError, match=r"sampled at temperature 0.0 \(greedy: log-probs at temperature 1\)"):
    step.check_batch(train.Batch.from_rollout(greedy, _rewards(8), ref_logp=greedy.log_probs))
  step1, _ = _step(temperature=1.0)
  step1.check_batch(train.Batch.from_rollout(greedy, _rewards(8)))
  # a batch built by hand carries no temperature: not checked (as before)
  step.check_batch(train.Batch.from_rollout(greedy._replace(temperature=None), _rewards(8), ref_logp=greedy.log_probs))


class UserEngine:
  """A user's engine on the public protocol: the jitted sampler on the pushed model, then ``corrupt`` applied to
  its ``Generation`` (the faults a real engine can have); ``fixed_temperature`` makes it ignore the temperature it
  is given, as an engine started with its own sampling settings does."""

  logprobs_are_policy = False

  def __init__(self, corrupt=None, fixed_temperature=None, name="user"):
    self.corrupt, self.fixed_temperature, self.name, self.model = corrupt, fixed_temperature, name, None

  def push_weights(self, model):
    self.model = model

  def release_memory(self):
    pass

  def reacquire_memory(self):
    pass

  def close(self):
    pass

  def generate(self, prompt_tokens, prompt_mask, sampling, *, key, temperature=1.0):
    t = temperature if self.fixed_temperature is None else self.fixed_temperature
    r = jax.device_get(generate(self.model, prompt_tokens, prompt_mask, sampling, key=key, temperature=t))
    gen = Generation(r, finish_reasons(r.completions, r.mask, sampling.eos_ids))
    return gen if self.corrupt is None else self.corrupt(gen)


def _rows(gen, n):
  r = gen.rollout
  cut = r._replace(**{f: getattr(r, f)[:n] for f in ("prompt_tokens", "prompt_mask", "completions", "mask")})
  cut = cut._replace(log_probs=r.log_probs[:n], group_ids=r.group_ids[:n])
  return gen._replace(rollout=cut, finish_reasons=gen.finish_reasons[:n])


def _set(field, fn):
  return lambda gen: gen._replace(rollout=gen.rollout._replace(**{field: fn(np.array(getattr(gen.rollout, field)))}))


def _hole(mask):
  mask[2, 0] = False  # row 2: a padding slot before real tokens
  mask[2, 1] = True
  return mask


def _nan_on_a_real_token(logp):
  logp[5, 0] = np.nan
  return logp


CORRUPTIONS = {
  "7 rows of 8": (lambda g: _rows(g, 7), "completions of shape (7, 6): 7 rows, not 8"),
  "group ids": (
    _set("group_ids", lambda x: np.zeros_like(x)),
    "group_ids [0, 0, 0, 0, 0, 0, 0, 0] (shape (8,)), not b",
  ),
  "a hole in a mask": (_set("mask", _hole), "a mask that is not a prefix of row 2"),
  "a NaN log-prob": (_set("log_probs", _nan_on_a_real_token), "a non-finite log-prob nan on the real token [5, 0]"),
  "an int mask": (_set("mask", lambda m: m.astype(np.int32)), "mask of shape (8, 6) and dtype int32, not bool[8, 6]"),
  "too many columns": (
    _set("log_probs", lambda x: np.pad(x, ((0, 0), (0, 1)))),
    "log_probs of shape (8, 7) and dtype float32, not float[8, 6]",
  ),
  "finish reasons": (lambda g: g._replace(finish_reasons=g.finish_reasons[:3]), "3 finish_reasons for 8 rows"),
  "not a Generation": (lambda g: g.rollout, "a Rollout, not a jaxgrpo.rollout.engines.Generation"),
}


@pytest.mark.parametrize("fault", list(CORRUPTIONS))
def test_an_engines_generation_is_checked_in_one_line_before_training(fault):
  corrupt, want = CORRUPTIONS[fault]
  step, state = _step(temperature=1.0)
  engine = UserEngine(corrupt, name="mine")
  with pytest.raises((ValueError, TypeError)) as e:
    iteration.grpo_iteration(
      step, state, PROMPTS, PROMPTS > 0, key=jax.random.key(0), reward_fn=lambda p, c: _rewards(len(c)),
      sampling=SAMPLING, engine=engine, buckets=None,
    )  # fmt: skip
  msg = str(e.value)
  assert msg.startswith("engine 'mine' (UserEngine).generate returned ") and want in msg, msg
  assert "2 prompts × 4 = 8 rows" in msg and "\n" not in msg
  assert not jax.tree.leaves(state.params)[0].is_deleted()  # refused before the update consumed the state


def test_an_engine_at_another_temperature_is_refused_and_an_honest_one_trains():
  step, state = _step(temperature=0.7)
  common = dict(key=jax.random.key(0), reward_fn=lambda p, c: _rewards(len(c)), sampling=SAMPLING, buckets=None)
  with pytest.raises(ValueError) as e:
    iteration.grpo_iteration(step, state, PROMPTS, PROMPTS > 0, engine=UserEngine(fixed_temperature=1.0), **common)
  msg = str(e.value)
  assert msg.startswith(
    "engine 'user' (UserEngine): its rollout (Generation.rollout.temperature) was sampled at temperature 1.0, but "
    "the train step's TrainConfig.temperature is 0.7"
  ), msg
  assert "generate(..., temperature=0.7)" in msg and "\n" not in msg
  # the same engine honouring the temperature: trains, its log-probs equal to the policy's (no mismatch)
  out = iteration.grpo_iteration(step, state, PROMPTS, PROMPTS > 0, engine=UserEngine(), **common)
  assert out.rollout.temperature == 0.7 and out.metrics["engine/logp_abs_diff_max"] < 1e-5
  # an engine whose Rollout says nothing of its temperature gets the one it was asked for
  silent = UserEngine(corrupt=lambda g: g._replace(rollout=g.rollout._replace(temperature=None)))
  out = iteration.grpo_iteration(step, out.state, PROMPTS, PROMPTS > 0, engine=silent, **common)
  assert out.rollout.temperature == 0.7


def test_a_row_pool_whose_draw_runs_out_ends_in_one_clear_line():
  """``RowPool.run(draw=...)`` with ``draw()`` returning ``[]`` (no more prompts): the rows already drawn finish;
  enough complete groups return normally, too few raise :class:`DataExhausted` naming how many are complete (they
  stay in the pool). Before: ``IndexError: deque index out of range``."""
  from jaxgrpo.loop.partial.pool import DataExhausted, RowPool

  model = tiny_model(seed=2)
  sampling = SamplingConfig(num_samples=2, max_new_tokens=4, eos_ids=(1,), pad_id=0)
  prompts = [[3, 4, 5], [6, 7], [8, 9, 10]]
  pool = RowPool(sampling=sampling, temperature=1.0, prompt_len=4, num_slots=4, refill_every=2)
  rounds = iter([[0], [1]])
  draw = lambda: next(rounds, [])  # two prompts, then the end of the data
  pool.run(model, 0, jax.random.key(0), need=2, draw=draw, prompt_tokens=prompts)  # enough: a normal return
  assert [g.prompt for g in pool.take(2)] == [0, 1]
  with pytest.raises(DataExhausted) as e:
    pool.run(model, 0, jax.random.key(1), need=1, draw=draw, prompt_tokens=prompts)
  assert str(e.value).startswith("RowPool.run: draw() returned no prompts (the end of the data)")
  assert "0 of the 1 groups asked for are complete" in str(e.value) and "\n" not in str(e.value)
  rounds = iter([[2]])
  with pytest.raises(DataExhausted, match=r"1 of the 2 groups asked for are complete; take them with pool.take\(1\)"):
    pool.run(model, 0, jax.random.key(2), need=2, draw=lambda: next(rounds, []), prompt_tokens=prompts)
  assert [g.prompt for g in pool.take(1)] == [2] and pool.untrained() == []
