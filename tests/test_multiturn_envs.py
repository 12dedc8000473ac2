"""Multi-turn rollouts with mixed environments and engines: each group's prompt rendered with its own
environment's tools (checked against the tokenizer's own ``apply_chat_template``), the turn end at
``</tool_call>`` following ``env.tools``, the text without special tokens on request, turns sent to an engine
as token ids with its log-probs kept, ``multiturn_iteration(engine=)`` recomputing ``old_logp``, and NaN
environment rewards left out of the logged reward statistics."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_chat_policy

from jaxgrpo.loop.episodes import env_rollout_batch
from jaxgrpo.loop.iteration import SamplingConfig
from jaxgrpo.models import build_model, log_probs
from jaxgrpo.rollout.engines import BuiltinEngine, Generation, finish_reasons
from jaxgrpo.rollout.environments import MultiTurnConfig, StepResult, sample_multiturn
from jaxgrpo.rollout.sampling import Rollout
from jaxgrpo.tasks import arithmetic

LOOKUP = {
  "type": "function",
  "function": {
    "name": "lookup",
    "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
  },
}


class TwoTurns:
  """Two policy turns; records the text of each; optional tools and ``skip_special_tokens``."""

  def __init__(self, tools=(), skip=None, reward=1.0):
    self.tools, self.texts, self.k, self.reward = tools, [], 0, reward
    if skip is not None:
      self.skip_special_tokens = skip

  def reset(self, row):
    self.k = 0
    return [{"role": "user", "content": row["q"]}]

  def step(self, text):
    self.k += 1
    self.texts.append(text)
    if self.k >= 2:
      return StepResult((), self.reward, True, {})
    return StepResult([{"role": "tool", "content": "seen"}], 0.0, False, {})


class ScriptEngine:
  """A user's engine: every row emits ``script`` up to and including its first stop id (or the budget), with
  log-prob ``LP`` per token; records the prompt ids it was sent."""

  name = "script"
  LP = -0.25

  def __init__(self, script):
    self.script, self.sent, self.pushes = list(script), [], 0

  def push_weights(self, model):
    self.pushes += 1

  def release_memory(self):
    pass

  def reacquire_memory(self):
    pass

  def close(self):
    pass

  def generate(self, prompt_tokens, prompt_mask, sampling, *, key, temperature=1.0):
    num_samples, max_new_tokens, eos_ids, pad_id = (
      sampling.num_samples,
      sampling.max_new_tokens,
      sampling.eos_ids,
      sampling.pad_id,
    )
    p, pm = np.asarray(prompt_tokens), np.asarray(prompt_mask)
    self.sent.append([p[i][pm[i]].tolist() for i in range(len(p))])
    n = len(p) * num_samples
    ids = self.script[:max_new_tokens]
    for j, t in enumerate(ids):
      if t in eos_ids:
        ids = ids[: j + 1]
        break
    comp = np.full((n, max_new_tokens), pad_id, np.int32)
    mask = np.zeros((n, max_new_tokens), bool)
    comp[:, : len(ids)], mask[:, : len(ids)] = ids, True
    lp = np.where(mask, self.LP, 0.0).astype(np.float32)
    gids = np.repeat(np.arange(len(p), dtype=np.int32), num_samples)
    r = Rollout(np.repeat(p, num_samples, 0), np.repeat(pm, num_samples, 0), comp, mask, lp, gids, None)
    return Generation(r, finish_reasons(comp, mask, eos_ids))


@pytest.fixture(scope="module")
def setup():
  return tiny_chat_policy()


def _template_ids(tok, messages, tools):
  text = tok.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
  return tok(text, add_special_tokens=False)["input_ids"]


def test_groups_keep_their_tools_their_turn_ends_and_their_text(setup):
  tok, model, sampling, eos = setup
  tc_end = tok.convert_tokens_to_ids("</tool_call>")
  assert isinstance(tc_end, int) and tc_end != tok.unk_token_id  # one token: the stop rule applies
  hi, there = tok("hi", add_special_tokens=False)["input_ids"], tok(" there", add_special_tokens=False)["input_ids"]
  script = hi + [tc_end] + there + [eos]
  rows = [{"q": "with a tool", "tools": [LOOKUP]}, {"q": "no tool", "tools": ()}, {"q": "plain", "tools": ()}]
  envs = []

  def make_env(row):
    envs.append(TwoTurns(tools=row["tools"], skip=True if row["q"] == "plain" else None))
    return envs[-1]

  engine = ScriptEngine(script)
  cfg = MultiTurnConfig(max_turns=2, max_tokens=96, turn_tokens=16)
  out = sample_multiturn(model, rows, make_env, tok, sampling, cfg, key=jax.random.key(0), engine=engine)
  for i, row in enumerate(r for r in rows for _ in range(2)):
    msgs = [{"role": "user", "content": row["q"]}]
    assert out.prompt_tokens[i][out.prompt_mask[i]].tolist() == _template_ids(tok, msgs, row["tools"])
    ids, pm = out.completions[i][out.mask[i]], out.policy_mask[i][out.mask[i]]
    first = ids[: int(np.argmin(pm))].tolist()  # the first policy turn
    # a turn ends at </tool_call> only where the environment has tools
    assert first == (hi + [tc_end] if row["tools"] else script), (i, first)
    # the text: special tokens kept by default, dropped when the environment asks
    skip = row["q"] == "plain"
    assert envs[i].texts[0] == tok.decode(first, skip_special_tokens=skip)
    if skip:
      assert "<|" not in envs[i].texts[0]
    elif not row["tools"]:
      assert envs[i].texts[0].endswith("<|im_end|>")
    # the engine's log-probs on the policy tokens, 0 on the observation
    np.testing.assert_array_equal(out.log_probs[i][out.mask[i]], np.where(pm, ScriptEngine.LP, 0.0))
  assert "lookup" in tok.decode(out.prompt_tokens[0][out.prompt_mask[0]].tolist())
  assert "lookup" not in tok.decode(out.prompt_tokens[2][out.prompt_mask[2]].tolist())
  # token in: the second turn sent each running row's prompt ‖ trajectory ids, exactly as kept
  second = [ids for call in engine.sent[-2:] for ids in call]
  for i in range(len(envs)):
    k = int(out.mask[i].sum())
    turn2 = int(np.flatnonzero(~out.policy_mask[i][:k])[-1]) + 1  # after the last observation token
    want = out.prompt_tokens[i][out.prompt_mask[i]].tolist() + out.completions[i][:turn2].tolist()
    assert want in second


def test_the_builtin_engine_samples_the_same_turns_as_the_default_path(setup):
  tok, model, sampling, _ = setup
  rows = [{"q": "a", "tools": ()}, {"q": "b", "tools": [LOOKUP]}]
  cfg = MultiTurnConfig(max_turns=2, max_tokens=64, turn_tokens=12)

  def make_env(row):
    return TwoTurns(tools=row["tools"])

  # the engine re-prefills every turn, as the built-in sampler without its cache does: bit for bit
  ref = sample_multiturn(model, rows, make_env, tok, sampling, cfg, key=jax.random.key(3), kv_cache=False)
  cached = sample_multiturn(model, rows, make_env, tok, sampling, cfg, key=jax.random.key(3))
  np.testing.assert_array_equal(cached.completions, ref.completions)
  np.testing.assert_allclose(cached.log_probs, ref.log_probs, atol=1e-5)  # the KV cache kept: f32 rounding
  engine = BuiltinEngine()
  engine.push_weights(model)
  got = sample_multiturn(model, rows, make_env, tok, sampling, cfg, key=jax.random.key(3), engine=engine)
  np.testing.assert_array_equal(got.completions, ref.completions)
  np.testing.assert_array_equal(got.policy_mask, ref.policy_mask)
  np.testing.assert_array_equal(got.log_probs, ref.log_probs)
  # and they are the policy's: one teacher-forced pass over prompt ‖ trajectory
  tokens = np.concatenate([got.prompt_tokens, got.completions], 1)
  attn = np.concatenate([got.prompt_mask, got.mask], 1)
  lp = np.asarray(log_probs(model, tokens, attn, chunk_size=None))[:, got.prompt_tokens.shape[1] :]
  np.testing.assert_allclose(np.where(got.policy_mask, lp, 0), got.log_probs, atol=2e-4)


def test_nan_environment_rewards_are_left_out_of_the_reward_statistics(setup):
  """Also: multi-turn sampling needs no ``max_new_tokens`` (the env config bounds the tokens), single-turn
  sampling refuses a SamplingConfig without one in one line."""
  from jaxgrpo.loop.iteration import sample

  tok, model, full, _ = setup
  sampling = SamplingConfig(num_samples=2, eos_ids=full.eos_ids, pad_id=full.pad_id)  # no max_new_tokens
  with pytest.raises(ValueError, match=r"sample: `SamplingConfig.max_new_tokens` is None; single-turn"):
    sample(model, np.ones((1, 3), np.int32), np.ones((1, 3), bool), sampling, key=jax.random.key(0))
  rows = [{"q": "x", "r": float("nan")}, {"q": "y", "r": 1.0}, {"q": "z", "r": 3.0}]
  examples = [types.SimpleNamespace(prompt=r["q"], answer="", columns={"q": r["q"], "r": r["r"]}) for r in rows]
  cfg = MultiTurnConfig(max_turns=2, max_tokens=48, turn_tokens=8)
  batch, metrics, _ = env_rollout_batch(
    model, examples, lambda row: TwoTurns(reward=row["r"]), tok, sampling, cfg, key=jax.random.key(1)
  )
  finite = np.array([1.0, 1.0, 3.0, 3.0])  # two trajectories of each finite row
  assert metrics["reward_mean"] == pytest.approx(finite.mean()) and metrics["reward_std"] == pytest.approx(finite.std())
  assert np.isnan(np.asarray(batch.rewards)[:2]).all()  # the missing samples stay missing for the step


def test_multiturn_iteration_with_a_users_engine_recomputes_old_logp_over_policy_tokens(setup):
  """The user's engine samples what the built-in sampler does but reports log-probs OFFSET nats off:
  ``multiturn_iteration(engine=)`` pushes the policy, keeps the engine's log-probs as ``behavior_logp``, recomputes
  ``old_logp`` with the policy, so the update equals the default path's; the mismatch k3 is over the policy tokens
  only (the observation tokens, which no engine sampled, would pull it far from k3 at r = e^−OFFSET)."""
  import optax
  from test_engines import K3_OFFSET, OffsetEngine

  from jaxgrpo import preset
  from jaxgrpo.loop import iteration
  from jaxgrpo.parallel import sharding as shd
  from jaxgrpo.step import train

  tok, _, sampling, _ = setup
  cfg = arithmetic.tiny_model_config(len(tok), hidden_size=32, num_layers=1, max_position_embeddings=512)
  mesh, opt = shd.make_mesh("data=1", devices=jax.devices()[:1]), optax.adam(1e-2)
  graphdef, state, shardings = train.init_train_state(build_model(cfg, rngs=nnx.Rngs(5)), opt, mesh)
  _, state2, _ = train.init_train_state(build_model(cfg, rngs=nnx.Rngs(5)), opt, mesh)
  tc = train.TrainConfig(micro_batches=1, group_size=2, chunk_size=4)
  step = train.make_train_step(graphdef, opt, preset("grpo"), mesh=mesh, shardings=shardings, train_config=tc)
  rows = [{"q": "a", "tools": (), "r": 1.0}, {"q": "b", "tools": (), "r": 0.0}]

  def make_env(row):  # reward depends on the sampled text, so advantages are not all 0
    env = TwoTurns(tools=row["tools"])
    env.step = lambda text, env=env, base=env.step: base(text)._replace(reward=float(len(text) % 3))
    return env

  common = dict(
    rows=rows,
    key=jax.random.key(7),
    make_env=make_env,
    tokenizer=tok,
    sampling=sampling,
    env_config=MultiTurnConfig(max_turns=2, max_tokens=48, turn_tokens=8),
    buckets=None,
  )
  engine = OffsetEngine()
  out = iteration.multiturn_iteration(step, state, engine=engine, **common)
  want = iteration.multiturn_iteration(step, state2, **common)
  assert engine.pushes == 1 and want.metrics["grad_norm"] > 0
  np.testing.assert_array_equal(out.rollout.completions, want.rollout.completions)
  pm = want.rollout.policy_mask
  np.testing.assert_allclose(out.rollout.log_probs[pm], want.rollout.log_probs[pm] + 0.5, atol=1e-6)
  assert out.metrics["engine/mismatch_k3"] == pytest.approx(K3_OFFSET, rel=1e-4)
  # the recomputed old_logp is a teacher-forced pass of the (pre-update) policy over prompt ‖ trajectory:
  # the mismatch metrics against the engine's log-probs, in NumPy from that pass, on policy tokens only
  r = out.rollout
  tokens, attn = np.concatenate([r.prompt_tokens, r.completions], 1), np.concatenate([r.prompt_mask, r.mask], 1)
  teacher = np.asarray(log_probs(build_model(cfg, rngs=nnx.Rngs(5)), tokens, attn, chunk_size=None), np.float64)
  diff = teacher[:, r.prompt_tokens.shape[1] :][pm] - r.log_probs[pm]  # log π_old − log μ
  np.testing.assert_allclose(out.metrics["engine/mismatch_k3"], np.mean(np.exp(diff) - diff - 1), rtol=1e-3)
  np.testing.assert_allclose(out.metrics["engine/logp_abs_diff_max"], np.abs(diff).max(), rtol=1e-3)
  for k, v in want.metrics.items():
    if k in ("loss", "grad_norm", "kl", "clip_fraction"):
      assert out.metrics[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
