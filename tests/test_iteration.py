"""jaxgrpo.loop.iteration: the reward-function interface, batch placement, the reference, and
``grpo_iteration`` == the same iteration composed by hand from the lower layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import flat_params, tiny_model

from jaxgrpo.kernels.config import preset
from jaxgrpo.loop import iteration
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout.sampling import Rollout, generate
from jaxgrpo.step import train

G, T = 4, 6


def _fake_rollout():
  """Two prompts × two samples, ragged prompts and completions (NumPy)."""
  prompt_tokens = np.array([[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9]], np.int32)
  prompt_mask = np.array([[0, 1, 1]] * 2 + [[1, 1, 1]] * 2, bool)
  completions = np.array([[1, 2, 0], [3, 0, 0], [4, 4, 4], [0, 0, 0]], np.int32)
  mask = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]], bool)
  return Rollout(prompt_tokens, prompt_mask, completions, mask, np.zeros((4, 3), np.float32), np.array([0, 0, 1, 1]), 3)


def test_score_passes_rows_ids_or_text_and_per_prompt_columns():
  rollout = _fake_rollout()
  seen = {}

  def on_ids(prompts, completions):
    seen["ids"] = (prompts, completions)
    return [len(c) for c in completions]

  np.testing.assert_array_equal(iteration.score(on_ids, rollout), [2, 1, 3, 0])
  assert seen["ids"] == ([[5, 6], [5, 6], [7, 8, 9], [7, 8, 9]], [[1, 2], [3], [4, 4, 4], []])

  def on_text(prompts, completions, answer):
    seen["text"] = (prompts, completions, answer)
    return [1.0 if c == a else None for c, a in zip(completions, answer)]

  decode = lambda ids: "".join("abcdefghij"[i] for i in ids)
  got = iteration.score(on_text, rollout, decode=decode, prompts=["P0", "P1"], columns={"answer": ["bc", "eee"]})
  assert seen["text"] == (["P0", "P0", "P1", "P1"], ["bc", "d", "eee", ""], ["bc", "bc", "eee", "eee"])
  np.testing.assert_array_equal(got, np.array([1.0, np.nan, 1.0, np.nan], np.float32))  # None: a missing sample
  assert got.dtype == np.float32

  with pytest.raises(ValueError, match=r"one reward per rollout row \(4\); got shape \(3,\)"):
    iteration.score(lambda p, c: [0.0] * 3, rollout)
  with pytest.raises(TypeError, match="must return 4 numbers"):
    iteration.score(lambda p, c: ["good"] * 4, rollout)
  with pytest.raises(ValueError, match=r"`columns\['answer'\]` has 1 entries, but the rollout has 2 prompts"):
    iteration.score(on_text, rollout, columns={"answer": ["x"]})


def test_place_pads_to_a_bucket_and_places_rows_over_the_mesh():
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  rollout = _fake_rollout()
  batch = iteration.make_batch(rollout, [1.0, 0.0, 1.0, 0.0], mesh=mesh, buckets=(2, 4))
  assert batch.completions.shape == (4, 4) and batch.old_logp.shape == (4, 4)
  assert batch.mask.sharding == shd.batch_sharding(mesh) and batch.rewards.dtype == jnp.float32
  same = iteration.make_batch(rollout, [1.0, 0.0, 1.0, 0.0], mesh=mesh, buckets=None, process_local=True)
  assert same.completions.shape == (4, 3)
  weighted = iteration.make_batch(
    rollout, np.zeros(4), mesh=mesh, advantages=np.ones((4, 3)), token_weights=np.ones((4, 3)), buckets=(4,)
  )
  assert weighted.advantages.shape == weighted.token_weights.shape == (4, 4)


def _step(config, model, micro=2):
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.adam(1e-2)
  graphdef, state, shardings = train.init_train_state(model, opt, mesh)
  tc = train.TrainConfig(micro_batches=micro, group_size=G, chunk_size=4)
  return train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc), state


def test_iteration_checks_what_would_fail_after_the_rollout():
  step, state = _step(preset("grpo", beta=0.04), tiny_model())
  prompts, pmask = np.ones((2, 3), np.int32), np.ones((2, 3), bool)
  sampling = iteration.SamplingConfig(num_samples=G, max_new_tokens=T)
  common = dict(key=jax.random.key(0), reward_fn=lambda p, c: [0.0] * len(c))
  with pytest.raises(ValueError, match="needs reference log-probs"):
    iteration.grpo_iteration(step, state, prompts, pmask, sampling=sampling, **common)
  reference = iteration.make_reference(step, state.params)
  with pytest.raises(ValueError, match="num_samples=8 exceeds the step's TrainConfig.group_size=4"):
    iteration.grpo_iteration(
      step, state, prompts, pmask, sampling=iteration.SamplingConfig(num_samples=8, max_new_tokens=T),
      reference=reference, **common,
    )  # fmt: skip
  with pytest.raises(ValueError, match="batch size 3 is not divisible"):
    iteration.grpo_iteration(
      step, state, prompts[:1], pmask[:1], sampling=iteration.SamplingConfig(num_samples=3, max_new_tokens=T),
      reference=reference, **common,
    )  # fmt: skip
  with pytest.raises(ValueError, match="`num_samples` must be an int >= 1"):
    iteration.SamplingConfig(num_samples=0, max_new_tokens=T)
  assert step.traces == 0


@pytest.mark.slow
def test_grpo_iteration_is_the_hand_composed_iteration():
  """Same key, same rewards, same reference, same step: identical parameters and metrics; the
  reference parameters survive the donation of the policy's."""
  config = preset("grpo", beta=0.04)
  step, state = _step(config, tiny_model(seed=2))
  _, state2, _ = train.init_train_state(tiny_model(seed=2), optax.adam(1e-2), step.mesh)
  reference = iteration.make_reference(step, state.params)
  prompts = np.array([[3, 4, 5], [0, 6, 7]], np.int32)
  pmask = prompts > 0
  sampling = iteration.SamplingConfig(num_samples=G, max_new_tokens=T, eos_ids=(1,))

  def even(prompts, completions, bonus):
    return [sum(t % 2 == 0 for t in c) / max(len(c), 1) + b for c, b in zip(completions, bonus)]

  key = jax.random.key(3)
  out = iteration.grpo_iteration(
    step, state, prompts, pmask, key=key, reward_fn=even, sampling=sampling, reference=reference,
    columns={"bonus": [0.0, 0.5]}, buckets=None,
  )  # fmt: skip

  # by hand, from the lower layers
  rollout = generate(nnx.merge(step.graphdef, state2.params), prompts, pmask, sampling, key=key)
  comps, mask = np.asarray(rollout.completions), np.asarray(rollout.mask)
  rewards = np.array(
    [even(None, [c[m].tolist()], [0.0 if i < G else 0.5])[0] for i, (c, m) in enumerate(zip(comps, mask))], np.float32
  )
  ref_params = jax.tree.map(jnp.copy, state2.params)
  ref_fn = train.make_reference_fn(
    step.graphdef, mesh=step.mesh, param_shardings=step.shardings.params, train_config=step.train_config
  )
  batch = train.Batch.from_rollout(rollout, rewards)
  batch = batch._replace(ref_logp=ref_fn(ref_params, batch))
  state2, metrics = step(state2, batch)

  np.testing.assert_array_equal(out.rewards, rewards)
  np.testing.assert_array_equal(np.asarray(out.rollout.completions), comps)
  got, want = flat_params(out.state.params), flat_params(state2.params)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))
  for k, v in metrics.items():
    assert out.metrics[k] == float(v), k
  assert out.metrics["reward_mean"] == pytest.approx(rewards.mean())
  assert out.metrics["kl"] == 0.0 and out.metrics["rewards_nonfinite"] == 0
  for phase in ("rollout_s", "reward_s", "reference_s", "update_s", "iteration_s"):
    assert out.metrics[phase] >= 0
  assert int(out.state.step) == 1 and step.traces == 1
  # the next iteration: the policy moved away from the (copied, never donated) reference
  out2 = iteration.grpo_iteration(
    step, out.state, prompts, pmask, key=jax.random.key(4), reward_fn=even, sampling=sampling, reference=reference,
    columns={"bonus": [0.0, 0.5]}, buckets=None,
  )  # fmt: skip
  assert out2.metrics["kl"] > 0 and int(out2.state.step) == 2
  with pytest.raises(ValueError, match="state was consumed by an earlier call"):  # before sampling
    iteration.grpo_iteration(
      step, out.state, prompts, pmask, key=key, reward_fn=even, sampling=sampling, reference=reference
    )
  assert iteration.policy_model(step.graphdef, out2.state).config.vocab_size == 128
