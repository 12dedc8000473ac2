"""Tool calls in the Qwen2.5/Qwen3 format, and an environment that runs registered Python functions.

The policy calls a tool by writing, anywhere in its turn::

    <tool_call>
    {"name": "multiply", "arguments": {"a": 12, "b": 34}}
    </tool_call>

(several calls per turn allowed). :func:`parse_tool_calls` extracts them; a call that cannot be parsed
is returned as a :class:`ToolCall` with an ``error``, so it becomes an error observation rather than an
exception. :func:`run_tool_call` runs one call against a ``{name: function}`` table and turns every
failure — unknown tool, bad JSON, arguments that do not fit the signature, a raising tool — into the
text ``"Error: ..."``. :class:`ToolEnvironment` is the ready-made environment: a turn with tool calls
gets their results as ``{"role": "tool"}`` messages; a turn without any ends the episode and is
scored by the reward function.

Schemas: a tool is a Python function with type hints and a Google-style docstring; its JSON schema
(``transformers.utils.get_json_schema``) is what the chat template renders with ``tools=``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from jaxgrpo.rollout.environments import sandbox
from jaxgrpo.rollout.environments.base import StepResult

__all__ = [
  "TOOL_CALL_START",
  "TOOL_CALL_END",
  "ToolCall",
  "ToolEnvironment",
  "parse_tool_calls",
  "python_tool",
  "run_tool_call",
  "tool_schema",
]

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|$)", re.DOTALL)
MAX_RESULT_CHARS = 4096


class ToolCall(NamedTuple):
  """One parsed call: ``name`` and ``arguments`` (a dict), or ``error`` (a message) when unparseable."""

  name: str | None
  arguments: dict | None
  error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
  """Every ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` of ``text``, in order.

  ``arguments`` may be a JSON object or a string holding one (both occur in the wild). A block that is
  not closed, not JSON, not an object, or without a string ``name`` gives a ``ToolCall`` with
  ``error`` set (and ``name`` when it could be read). Text without ``<tool_call>`` gives ``[]``.
  """
  calls = []
  for match in _CALL.finditer(text):
    body = match.group(1).strip()
    if not match.group(0).endswith(TOOL_CALL_END):
      calls.append(ToolCall(None, None, f"unterminated {TOOL_CALL_START} (no {TOOL_CALL_END})"))
      continue
    try:
      obj = json.loads(body)
    except json.JSONDecodeError as e:
      calls.append(ToolCall(None, None, f"tool call is not valid JSON ({e.msg} at char {e.pos}): {body[:200]!r}"))
      continue
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
      calls.append(ToolCall(None, None, f'tool call must be an object with a string "name"; got {body[:200]!r}'))
      continue
    args = obj.get("arguments", {})
    if isinstance(args, str):
      try:
        args = json.loads(args) if args.strip() else {}
      except json.JSONDecodeError as e:
        calls.append(ToolCall(obj["name"], None, f"arguments are not valid JSON ({e.msg}): {args[:200]!r}"))
        continue
    if not isinstance(args, dict):
      calls.append(ToolCall(obj["name"], None, f"arguments must be a JSON object; got {json.dumps(args)[:200]}"))
      continue
    calls.append(ToolCall(obj["name"], args))
  return calls


def tool_schema(fn: Callable) -> dict:
  """The JSON schema of a tool function (``transformers.utils.get_json_schema``: type hints and a
  Google-style docstring with an ``Args:`` entry per parameter). transformers is imported here, on
  first use: runs without tools do not pay its import (~0.4 s)."""
  from transformers.utils import get_json_schema

  return get_json_schema(fn)


def run_tool_call(call: ToolCall, tools: Mapping[str, Callable]) -> tuple[str, bool]:
  """``(result text, ok)`` of one call. Never raises for anything the call or the tool does: a parse
  error, an unknown tool, arguments that do not bind to the signature, or an exception inside the
  tool give ``("Error: ...", False)``. The result is ``str(return value)`` (JSON for dicts and lists),
  cut to ``MAX_RESULT_CHARS``."""
  if call.error is not None:
    return f"Error: {call.error}", False
  fn = tools.get(call.name)
  if fn is None:
    return f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(tools)) or 'none'}", False
  try:
    inspect.signature(fn).bind(**call.arguments)
  except TypeError as e:
    return f"Error: bad arguments for {call.name}: {e}", False
  try:
    out = fn(**call.arguments)
  except Exception as e:  # noqa: BLE001 — the policy sees every failure of the tool
    return f"Error: {call.name} raised {type(e).__name__}: {e}", False
  text = json.dumps(out) if isinstance(out, (dict, list)) else str(out)
  return text[:MAX_RESULT_CHARS], True


@dataclasses.dataclass
class ToolEnvironment:
  """An environment over a table of Python tools (:class:`~jaxgrpo.rollout.environments.base.Environment`).

  - ``reset(row)``: the prompt messages ``prompt_fn(row)`` (default: one user message with
    ``row["problem"]``).
  - ``step(text)``: with tool calls in ``text`` (and turns left), each call runs
    (:func:`run_tool_call`) and its result comes back as a ``{"role": "tool"}`` message; reward 0.
    Without tool calls the turn is the final answer: ``done``, reward ``reward_fn(row, text)``.
  - metrics per step: ``tool_calls``, ``tool_errors``, ``tool_s`` (seconds in the tools).

  Attributes:
    functions: the tools, each a function with type hints and a Google-style docstring (its schema).
    reward_fn: ``reward_fn(row, final_text) -> float``.
    prompt_fn: ``prompt_fn(row) -> messages``.
  """

  functions: Sequence[Callable]
  reward_fn: Callable[[Mapping[str, Any], str], float]
  prompt_fn: Callable[[Mapping[str, Any]], list[dict]] | None = None
  row: Mapping[str, Any] | None = None

  def __post_init__(self):
    self.table = {fn.__name__: fn for fn in self.functions}
    self.tools = [tool_schema(fn) for fn in self.functions]

  def reset(self, row: Mapping[str, Any]) -> list[dict]:
    self.row = row
    if self.prompt_fn is not None:
      return list(self.prompt_fn(row))
    return [{"role": "user", "content": str(row["problem"])}]

  def step(self, text: str) -> StepResult:
    calls = parse_tool_calls(text)
    if not calls:
      return StepResult((), float(self.reward_fn(self.row, text)), True, {})
    t0 = time.perf_counter()
    results = [run_tool_call(c, self.table) for c in calls]
    seconds = time.perf_counter() - t0
    messages = [{"role": "tool", "content": r} for r, _ in results]
    errors = sum(not ok for _, ok in results)
    return StepResult(messages, 0.0, False, {"tool_calls": len(calls), "tool_errors": errors, "tool_s": seconds})


def python_tool(limits: sandbox.SandboxLimits | None = None) -> Callable[[str], str]:
  """A tool ``python(code)`` that runs ``code`` in the sandbox (:func:`jaxgrpo.rollout.environments.sandbox.run_code`
  with ``limits``, default ``SandboxLimits()``) and returns what it printed, with a status line when it
  failed or was killed."""
  limits = sandbox.SandboxLimits() if limits is None else limits

  def python(code: str) -> str:
    """Runs a Python program in a sandbox and returns what it printed.

    Args:
      code: the program's source; print the results you need.
    """
    return sandbox.run_code(str(code), limits).observation()

  return python
