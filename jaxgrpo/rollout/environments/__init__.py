"""Environments and tools for multi-turn rollouts (host side, beside ``jaxgrpo.loop.iteration``).

- ``base``: the protocol — :class:`Environment` (``tools``, ``reset(row)``, ``step(text)``) and
  :class:`StepResult` (messages, reward, done, metrics).
- ``tools``: Qwen2.5/Qwen3 tool calls (``<tool_call>{"name", "arguments"}</tool_call>``) parsed and run
  against Python functions, failures as error observations; :class:`ToolEnvironment`; :func:`python_tool`.
- ``chat``: :class:`ChatFormat`, the token accounting (prompt and observation ids from the chat template).
- ``rollout``: :func:`sample_multiturn`, the batched multi-turn rollout, and :class:`MultiTurnConfig`.
- ``sandbox``: run untrusted Python in a bounded, separate process (the code-execution tool).

See docs/multiturn.md.
"""

from jaxgrpo.rollout.environments import sandbox
from jaxgrpo.rollout.environments.base import Environment, StepResult
from jaxgrpo.rollout.environments.chat import ChatFormat
from jaxgrpo.rollout.environments.rollout import (
  EnvironmentFailed,
  EnvironmentTimeout,
  MultiTurnConfig,
  MultiTurnRollout,
  RolloutInterrupted,
  rollout_metrics,
  sample_multiturn,
)
from jaxgrpo.rollout.environments.tools import (
  ToolCall,
  ToolEnvironment,
  parse_tool_calls,
  python_tool,
  run_tool_call,
  tool_schema,
)

__all__ = [
  "ChatFormat",
  "Environment",
  "EnvironmentFailed",
  "EnvironmentTimeout",
  "MultiTurnConfig",
  "MultiTurnRollout",
  "RolloutInterrupted",
  "StepResult",
  "ToolCall",
  "ToolEnvironment",
  "parse_tool_calls",
  "python_tool",
  "rollout_metrics",
  "run_tool_call",
  "sample_multiturn",
  "sandbox",
  "tool_schema",
]
