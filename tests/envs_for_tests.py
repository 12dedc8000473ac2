"""Environments shared by tests and by children in other venvs (no pytest import: the vLLM venv has none)."""

from __future__ import annotations

from jaxgrpo.rewards.reward_set import extract_boxed
from jaxgrpo.rollout.environments import StepResult


class SecondChance:
  """Answer "What is a + b?"; a wrong (or missing) boxed answer gets one retry: reward 1 at the first
  turn, 0.5 at the second, plus a small shaping term, 0.1 × the share of digits in the last turn's text (an
  untrained policy is never right: without it every advantage is 0 and no step changes the parameters)."""

  tools = ()

  def reset(self, row):
    self.row, self.turn = row, 0
    return [{"role": "user", "content": row["problem"]}]

  def step(self, text):
    self.turn += 1
    right = extract_boxed(text) == self.row["answer"]
    if right or self.turn == 2:
      digits = sum(c.isdigit() for c in text) / max(len(text), 1)
      return StepResult((), (1.0 if self.turn == 1 else 0.5) * right + 0.1 * digits, True)
    return StepResult([{"role": "user", "content": "Wrong. Try again."}], 0.0, False, {"retries": 1.0})


def make_env(row):
  """``env.factory: envs_for_tests:make_env``."""
  return SecondChance()
