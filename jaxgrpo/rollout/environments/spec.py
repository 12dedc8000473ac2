"""The run config's ``env:`` section: which environment a multi-turn run trains in, and its bounds.

.. code-block:: yaml

    env:
      factory: jaxgrpo.tasks.calculator:make_env   # module:callable, make_env(row) -> Environment
      max_turns: 3
      max_tokens: 64          # trajectory tokens after the prompt (policy + observations)
      turn_tokens: 32         # per policy turn (null: max_tokens)
      stop_at_tool_call: null # null (default): at </tool_call> when the environment has tools
      step_timeout: 30        # seconds per env.reset / env.step call (null: unbounded); a turn's calls run
                              # concurrently, so a turn waits at most step_timeout x ceil(calls / workers)
      workers: 32             # environment calls at once (threads, timed-out ones included)
      fail_fast: false        # true: re-raise the first environment exception (debugging)
      episodes: null          # N: train on N episodes from seeds (no dataset; reset builds the prompt)
      eval_episodes: null     # M: evaluate on M held-out episodes (with episodes)

With this section the trainer samples with :func:`jaxgrpo.rollout.environments.sample_multiturn` (one
environment per trajectory, ``factory(row)``; the row is the dataset example as a dict: ``prompt``,
``problem`` — the prompt when it is a string —, ``answer`` and every other column), rewards are the
environments' (the ``reward`` section is not used for training), and evaluation is mean@k of the
environment reward on the held-out set.

**Episodes instead of a dataset** (``episodes: N``): an environment that makes its own episodes (a game, a
generated puzzle) needs no ``data``/``eval`` dataset. Training row ``i`` (``0 <= i < N``) is
``{"seed": i, "episode": i, "split": "train"}``; with ``eval_episodes: M`` held-out row ``j`` is
``{"seed": EVAL_SEED_OFFSET + j, "episode": j, "split": "eval"}`` (seeds disjoint from the training ones).
``reset(row)`` builds the prompt from the seed; ``run.seed`` shuffles the order as for a dataset.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxgrpo import _checks
from jaxgrpo.rollout.environments.rollout import MultiTurnConfig

__all__ = ["EVAL_SEED_OFFSET", "EnvSpec", "episode_rows", "load_factory"]

#: The seed of held-out episode ``j`` is ``EVAL_SEED_OFFSET + j``; training seeds are ``0 .. episodes - 1``.
EVAL_SEED_OFFSET = 1_000_000_000


def episode_rows(n: int, split: str) -> list[dict]:
  """The rows of ``n`` generated episodes: ``{"seed", "episode", "split"}``, seeds ``0..n-1`` for
  ``split="train"`` and ``EVAL_SEED_OFFSET + j`` for ``"eval"``."""
  if split not in ("train", "eval"):
    raise ValueError(f"split must be 'train' or 'eval'; got {split!r}")
  offset = 0 if split == "train" else EVAL_SEED_OFFSET
  return [{"seed": offset + i, "episode": i, "split": split} for i in range(n)]


def load_factory(path: str) -> Callable[[Any], Any]:
  """The callable named by ``"package.module:attribute"`` (imported); ValueError naming ``env.factory``."""
  return _checks.load_callable(path, "env.factory")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvSpec:
  """The ``env:`` section (see the module docstring).

  Attributes:
    factory: ``"package.module:callable"``, ``callable(row) -> Environment`` (one per trajectory).
    episodes: N training episodes from seeds instead of a dataset (None: the ``data`` section's rows).
    eval_episodes: M held-out episodes (needs ``episodes``; None: no held-out set of episodes).
    max_turns, max_tokens, turn_tokens, stop_at_tool_call, step_timeout, workers, fail_fast:
      :class:`~jaxgrpo.rollout.environments.MultiTurnConfig`.

  The factory is imported and checked callable at construction (when the config loads, before anything heavy).
  """

  factory: str
  episodes: int | None = None
  eval_episodes: int | None = None
  max_turns: int = 4
  max_tokens: int = 256
  turn_tokens: int | None = None
  stop_at_tool_call: bool | None = None
  step_timeout: float | None = 30.0
  workers: int = 32
  fail_fast: bool = False

  def __post_init__(self):
    self.multiturn_config()  # the bounds' own errors, at construction
    for name in ("episodes", "eval_episodes"):
      v = getattr(self, name)
      if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= EVAL_SEED_OFFSET):
        raise ValueError(f"`env.{name}` must be an int in [1, {EVAL_SEED_OFFSET}] or null; got {v!r}")
    if self.eval_episodes is not None and self.episodes is None:
      raise ValueError(
        f"`env.eval_episodes`={self.eval_episodes} needs `env.episodes` (a dataset run's held-out set is "
        "`eval.dataset`); set `env.episodes` or unset `env.eval_episodes`"
      )
    self.make_env()  # a mistyped factory is refused when the config loads, not after the warm-up

  def multiturn_config(self) -> MultiTurnConfig:
    return MultiTurnConfig(
      max_turns=self.max_turns,
      max_tokens=self.max_tokens,
      turn_tokens=self.turn_tokens,
      stop_at_tool_call=self.stop_at_tool_call,
      step_timeout=self.step_timeout,
      workers=self.workers,
      fail_fast=self.fail_fast,
    )

  def make_env(self) -> Callable[[Any], Any]:
    """The factory, imported."""
    return load_factory(self.factory)
