"""The run config's ``env:`` section: which environment a multi-turn run trains in, and its bounds.

.. code-block:: yaml

    env:
      factory: jaxgrpo.tasks.calculator:make_env   # module:callable, make_env(row) -> Environment
      max_turns: 3
      max_tokens: 64          # trajectory tokens after the prompt (policy + observations)
      turn_tokens: 32         # per policy turn (null: max_tokens)
      stop_at_tool_call: null # null (default): at </tool_call> when the environment has tools
      step_timeout: 30        # seconds per env.reset / env.step call (null: unbounded)
      fail_fast: false        # true: re-raise the first environment exception (debugging)

With this section the trainer samples with :func:`jaxgrpo.environments.sample_multiturn` (one
environment per trajectory, ``factory(row)``; the row is the dataset example as a dict: ``prompt``,
``problem`` — the prompt when it is a string —, ``answer`` and every other column), rewards are the
environments' (the ``reward`` section is not used for training), and evaluation is mean@k of the
environment reward on the held-out set.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxgrpo import _checks
from jaxgrpo.environments.rollout import MultiTurnConfig

__all__ = ["EnvSpec", "load_factory"]


def load_factory(path: str) -> Callable[[Any], Any]:
  """The callable named by ``"package.module:attribute"`` (imported); ValueError naming ``env.factory``."""
  return _checks.load_callable(path, "env.factory")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvSpec:
  """The ``env:`` section (see the module docstring).

  Attributes:
    factory: ``"package.module:callable"``, ``callable(row) -> Environment`` (one per trajectory).
    max_turns, max_tokens, turn_tokens, stop_at_tool_call, step_timeout, fail_fast: :class:`~jaxgrpo.environments.MultiTurnConfig`.
  """

  factory: str
  max_turns: int = 4
  max_tokens: int = 256
  turn_tokens: int | None = None
  stop_at_tool_call: bool | None = None
  step_timeout: float | None = 30.0
  fail_fast: bool = False

  def __post_init__(self):
    self.multiturn_config()  # the bounds' own errors, at construction

  def multiturn_config(self) -> MultiTurnConfig:
    return MultiTurnConfig(
      max_turns=self.max_turns,
      max_tokens=self.max_tokens,
      turn_tokens=self.turn_tokens,
      stop_at_tool_call=self.stop_at_tool_call,
      step_timeout=self.step_timeout,
      fail_fast=self.fail_fast,
    )

  def make_env(self) -> Callable[[Any], Any]:
    """The factory, imported."""
    return load_factory(self.factory)
