"""The multi-turn rollout with a real (tiny, random) policy and scripted environments: ragged turn
counts, token accounting against the chat template, the token budget, log-probs equal to one
teacher-forced pass over the whole conversation, and environments that fail."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import tiny_chat_policy

from jaxgrpo.models import log_probs
from jaxgrpo.rollout.environments import MultiTurnConfig, StepResult, rollout_metrics, sample_multiturn
from jaxgrpo.rollout.environments.chat import ChatFormat


class Scripted:
  """Ends after ``row["turns"]`` policy turns; each observation says which turn it answers; the
  reward is the number of turns. Raises on the turn ``row.get("raise_at")``."""

  tools = ()

  def reset(self, row):
    self.row, self.k, self.texts = row, 0, []
    return [{"role": "user", "content": f"go {row['turns']}"}]

  def step(self, text):
    self.k += 1
    self.texts.append(text)
    if self.row.get("raise_at") == self.k:
      raise RuntimeError("environment bug")
    if self.k >= self.row["turns"]:
      return StepResult((), float(self.k), True, {"tool_calls": 0})
    return StepResult([{"role": "tool", "content": f"obs {self.k}"}], 0.0, False, {"tool_calls": 1})


@pytest.fixture(scope="module")
def setup():
  tok, model, sampling, _ = tiny_chat_policy()
  return tok, model, sampling


def test_ragged_turns_token_accounting_and_log_probs(setup):
  tok, model, sampling = setup
  rows = [{"turns": 1}, {"turns": 3}]
  envs = []

  def make_env(row):
    envs.append(Scripted())
    return envs[-1]

  cfg = MultiTurnConfig(max_turns=4, max_tokens=120, turn_tokens=12)
  out = sample_multiturn(model, rows, make_env, tok, sampling, cfg, key=jax.random.key(0))
  n = len(rows) * 2
  assert out.completions.shape == (n, 120) and out.group_ids.tolist() == [0, 0, 1, 1]
  np.testing.assert_array_equal(out.turns, [1, 1, 3, 3])
  np.testing.assert_array_equal(out.rewards, [1, 1, 3, 3])
  np.testing.assert_array_equal(out.metrics["tool_calls"], [0, 0, 2, 2])
  assert not (out.policy_mask & ~out.mask).any()
  fmt = ChatFormat(tok)
  for i in range(n):
    ids, pm = out.completions[i][out.mask[i]], out.policy_mask[i][out.mask[i]]
    # policy runs and observation runs alternate, turn first, turn last
    runs = np.flatnonzero(np.diff(pm.astype(int))) + 1
    spans = np.split(np.arange(len(ids)), runs)
    assert [bool(pm[s[0]]) for s in spans] == [k % 2 == 0 for k in range(2 * out.turns[i] - 1)]
    for k, s in enumerate(spans):
      if k % 2 == 0:  # a policy turn: at most turn_tokens, ends at the stop ids or at the cap
        assert len(s) <= 12
        assert envs[i].texts[k // 2] == tok.decode(ids[s].tolist(), skip_special_tokens=False)
      else:  # the observation: exactly the template's text for this environment message
        turn = ids[spans[k - 1]].tolist()
        want = fmt.observation_ids([{"role": "tool", "content": f"obs {(k + 1) // 2}"}], turn)
        assert ids[s].tolist() == want
    # the prompt is the template's rendering of the reset messages
    p = out.prompt_tokens[i][out.prompt_mask[i]].tolist()
    assert p == fmt.prompt_ids([{"role": "user", "content": f"go {rows[i // 2]['turns']}"}])
  # the sampler's log-probs == one teacher-forced pass over prompt ‖ interleaved trajectory
  tokens = np.concatenate([out.prompt_tokens, out.completions], 1)
  attn = np.concatenate([out.prompt_mask, out.mask], 1)
  lp = np.asarray(log_probs(model, tokens, attn, chunk_size=None))[:, out.prompt_tokens.shape[1] :]
  np.testing.assert_allclose(np.where(out.policy_mask, lp, 0), out.log_probs, atol=2e-4)
  assert (out.log_probs[out.mask & ~out.policy_mask] == 0).all()
  m = rollout_metrics(out)
  assert m["env/turns"] == 2.0 and m["env/tool_calls"] == 1.0 and m["env/policy_tokens"] > 0


def test_token_budget_and_turn_limit_and_failing_environment(setup):
  tok, model, sampling = setup
  rows = [{"turns": 9}, {"turns": 9, "raise_at": 2}]
  cfg = MultiTurnConfig(max_turns=3, max_tokens=40, turn_tokens=12)
  out = sample_multiturn(model, rows, lambda row: Scripted(), tok, sampling, cfg, key=jax.random.key(1))
  assert out.mask.sum(1).max() <= 40
  assert (out.turns <= 3).all()
  np.testing.assert_array_equal(out.turns[2:], [2, 2])  # the environment raised at its second step
  np.testing.assert_array_equal(out.metrics["env_errors"], [0, 0, 1, 1])
  np.testing.assert_array_equal(out.rewards[2:], [0, 0])
  # every trajectory of the first row ended by the budget or the turn limit, never past them
  assert all(out.turns[i] == 3 or out.metrics["truncated"][i] == 1 for i in range(2))


def test_bad_config():
  with pytest.raises(ValueError, match="env.max_turns"):
    MultiTurnConfig(max_turns=0)
  with pytest.raises(ValueError, match="env.turn_tokens"):
    MultiTurnConfig(max_tokens=8, turn_tokens=9)


@pytest.mark.slow
def test_bench_multiturn_smoke():
  """scripts/bench_multiturn.py runs (tiny sizes) and times all four variants."""
  import importlib.util
  import os

  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_multiturn.py")
  spec = importlib.util.spec_from_file_location("bench_multiturn", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  med = mod.main(
    ["--rows", "2", "--turns", "2", "--turn-tokens", "3", "--hidden", "16", "--layers", "1", "--repeats", "1"]
  )
  assert len(med) == 4 and all(t > 0 for t in med)
