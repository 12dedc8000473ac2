"""The environment protocol: what a multi-turn rollout (``jaxgrpo.rollout.environments.rollout.sample_multiturn``) calls.

One environment instance serves one trajectory. The rollout calls, for each trajectory::

    env = make_env(row)                 # a factory: one fresh environment per trajectory
    messages = env.reset(row)           # the prompt as chat messages (rendered with tools=env.tools)
    while not done:
      text = <the policy's turn>        # decoded from the sampled tokens (the tokens themselves are kept)
      result = env.step(text)           # StepResult(messages, reward, done, metrics)
      <result.messages are rendered in the chat template's tool role and appended as context>

- ``reset(row)`` returns the prompt messages (``[{"role": "user", "content": ...}]``, a system message
  optional); ``env.tools`` (a sequence of JSON schemas or Python functions with Google-style
  docstrings, possibly empty) is passed to the tokenizer's chat template as ``tools=``.
- ``step(text)`` receives the decoded text of the policy's latest turn only — it must not try to
  re-tokenise it: the rollout keeps the sampled token ids exactly. It returns the messages to append
  (usually ``{"role": "tool", "content": ...}``; empty when ``done``), a reward for this step, whether the
  episode ended, and optional float metrics (summed over the trajectory).
- The trajectory's reward is the sum of its step rewards (an outcome reward: give it on the last step).
- The rollout ends a trajectory itself when it runs out of turns (``max_turns``) or tokens
  (``max_tokens``): the environment is not stepped again and the rewards so far stand. An exception
  raised by ``step`` ends the trajectory — that step adds no reward, the rewards of the earlier steps
  stand — and counts in the ``env_errors`` metric; it never stops the run.
- ``skip_special_tokens`` (optional attribute, default False): when True, ``step`` receives the turn
  decoded without special tokens (``tokenizer.decode(ids, skip_special_tokens=True)``: no ``<|im_end|>``,
  no reserved tokens around the text an environment parses); the sampled ids are kept either way.
- A turn ends at EOS, and also at ``</tool_call>`` when the environment has tools (``env.tools`` not
  empty; ``env.stop_at_tool_call`` in the run config overrides this for every environment).

Nothing here imports JAX: environments are plain host-side Python.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Protocol, Sequence, runtime_checkable

__all__ = ["Environment", "StepResult"]


class StepResult(NamedTuple):
  """What :meth:`Environment.step` returns.

  Attributes:
    messages: chat messages to append after the policy's turn (``{"role": "tool", "content": str}``
      for tool results; any role the chat template renders). Empty when ``done``.
    reward: this step's reward (float); the trajectory's reward is the sum over its steps.
    done: the episode ended (no further policy turn).
    metrics: optional ``{name: float}`` summed over the trajectory's steps (e.g. ``tool_calls``,
      ``tool_errors``, ``tool_s``).
  """

  messages: Sequence[Mapping[str, Any]] = ()
  reward: float = 0.0
  done: bool = False
  metrics: Mapping[str, float] = {}


@runtime_checkable
class Environment(Protocol):
  """A multi-turn environment (see the module docstring for the call order).

  Attributes:
    tools: the tool schemas shown in the prompt (chat template ``tools=``), or ``()``.
  """

  tools: Sequence[Any]

  def reset(self, row: Mapping[str, Any]) -> list[dict]:
    """The prompt messages of a dataset row; called once, before the first step."""
    ...

  def step(self, text: str) -> StepResult:
    """One policy turn (its decoded text; without special tokens when the environment sets
    ``skip_special_tokens = True``) -> observation messages, reward, done, metrics."""
    ...
