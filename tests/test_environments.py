"""The environment protocol, tool-call parsing and running, and the chat-template token accounting,
with a real locally built tokenizer whose template renders tools in the Qwen2.5 format."""

from __future__ import annotations

import json

import pytest

from jaxgrpo.rollout.environments import Environment, StepResult, ToolEnvironment, parse_tool_calls, run_tool_call
from jaxgrpo.rollout.environments.chat import ChatFormat
from jaxgrpo.rollout.environments.sandbox import SandboxLimits
from jaxgrpo.rollout.environments.tools import ToolCall, python_tool
from jaxgrpo.tasks import calculator


@pytest.fixture(scope="module")
def tok():
  return calculator.build_tokenizer()


def add(a: int, b: int) -> int:
  """Adds.

  Args:
    a: first.
    b: second.
  """
  return a + b


def boom(x: str) -> str:
  """Always fails.

  Args:
    x: anything.
  """
  raise RuntimeError("tool exploded")


def test_parse_tool_calls_good_and_bad():
  text = (
    'think <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> and '
    '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
    "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
    '<tool_call>{"name": "add", "arguments": [1]}</tool_call><tool_call>{"name": "add"'
  )
  calls = parse_tool_calls(text)
  assert calls[0] == ToolCall("add", {"a": 1, "b": 2}) and calls[1] == ToolCall("add", {"a": 3, "b": 4})
  assert "not valid JSON" in calls[2].error
  assert 'string "name"' in calls[3].error
  assert calls[4].name == "add" and "JSON object" in calls[4].error
  assert "unterminated" in calls[5].error
  assert parse_tool_calls("no calls here") == []


def test_run_tool_call_never_raises():
  table = {"add": add, "boom": boom}
  assert run_tool_call(ToolCall("add", {"a": 2, "b": 5}), table) == ("7", True)
  out = [
    run_tool_call(ToolCall("nope", {}), table),
    run_tool_call(ToolCall("add", {"a": 1}), table),
    run_tool_call(ToolCall("add", {"a": 1, "c": 2}), table),
    run_tool_call(ToolCall("boom", {"x": "y"}), table),
    run_tool_call(ToolCall(None, None, "bad"), table),
  ]
  assert all(not ok and text.startswith("Error: ") for text, ok in out)
  assert "unknown tool 'nope'" in out[0][0] and "RuntimeError: tool exploded" in out[3][0]


def test_tool_environment_steps():
  env = ToolEnvironment([add, boom], lambda row, text: float("\\boxed{3}" in text))
  assert isinstance(env, Environment)
  assert [t["function"]["name"] for t in env.tools] == ["add", "boom"]
  assert env.reset({"problem": "1+2?"}) == [{"role": "user", "content": "1+2?"}]
  r = env.step(
    '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><tool_call>{"name": "boom", '
    '"arguments": {"x": "1"}}</tool_call><tool_call>oops</tool_call>'
  )
  assert [m["role"] for m in r.messages] == ["tool"] * 3 and r.messages[0]["content"] == "3"
  assert (r.reward, r.done, r.metrics["tool_calls"], r.metrics["tool_errors"]) == (0.0, False, 3, 2)
  assert env.step("so \\boxed{3}") == StepResult((), 1.0, True, {})


def test_python_tool_runs_in_the_sandbox():
  run = python_tool(SandboxLimits(wall_s=3.0, cpu_s=1))
  env = ToolEnvironment([run], lambda row, text: 0.0)
  assert env.tools[0]["function"]["name"] == "python"
  env.reset({"problem": "x"})
  code = json.dumps({"name": "python", "arguments": {"code": "print(2**10)"}})
  r = env.step(f"<tool_call>{code}</tool_call>")
  assert r.messages[0]["content"] == "1024" and r.metrics["tool_errors"] == 0
  loop = json.dumps({"name": "python", "arguments": {"code": "while True: pass"}})
  r = env.step(f"<tool_call>{loop}</tool_call>")
  assert "killed" in r.messages[0]["content"]


def test_prompt_and_observation_tokens_follow_the_template(tok):
  env = calculator.make_env()
  fmt = ChatFormat(tok, tools=env.tools)
  msgs = [{"role": "user", "content": "What is 12 * 34?"}]
  full = tok.apply_chat_template(msgs, tools=env.tools, tokenize=False, add_generation_prompt=True)
  assert fmt.prompt_ids(msgs) == tok(full, add_special_tokens=False)["input_ids"]
  assert full.startswith("<|im_start|>system\n# Tools") and '"name": "multiply"' in full
  # the policy's turn, kept as ids; the observation closes nothing it already closed
  turn = fmt.encode('<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call><|im_end|>')
  obs = [{"role": "tool", "content": "408"}]
  ids = fmt.observation_ids(obs, turn)
  assert (
    tok.decode(ids) == "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
  )
  # a turn stopped at </tool_call> (before <|im_end|>): the observation closes the assistant turn first
  ids2 = fmt.observation_ids(obs, turn[:-1])
  assert tok.decode(ids2) == "<|im_end|>" + tok.decode(ids)
  # the whole conversation equals the template's rendering of the same messages
  convo = msgs + [{"role": "assistant", "content": tok.decode(turn[:-1])}] + obs
  want = tok.apply_chat_template(convo, tools=env.tools, tokenize=False, add_generation_prompt=True)
  assert tok.decode(fmt.prompt_ids(msgs) + turn + ids) == want
  # two tool messages share one user turn (Qwen2.5)
  two = tok.decode(fmt.observation_ids(obs + [{"role": "tool", "content": "9"}], turn))
  assert two.count("<|im_start|>user") == 1 and two.count("<tool_response>") == 2


def test_chat_format_needs_a_template(tok):
  bare = calculator._bare_tokenizer(())
  bare.chat_template = None
  with pytest.raises(ValueError, match="chat_template"):
    ChatFormat(bare)


def test_calculator_demonstration_matches_the_template(tok):
  row = {"problem": "What is 12 * 34?", "answer": "408"}
  ids, pm = calculator.demonstration(tok, row)
  env = calculator.make_env()
  convo = [
    {"role": "user", "content": row["problem"]},
    {
      "role": "assistant",
      "content": '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>',
    },
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "\\boxed{408}"},
  ]
  want = tok.apply_chat_template(convo, tools=env.tools, tokenize=False)
  assert tok.decode(ids) == want.rstrip("\n")
  policy = tok.decode([i for i, m in zip(ids, pm) if m])
  assert (
    policy == '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>\\boxed{408}<|im_end|>'
  )
  assert calculator.boxed_reward(row, tok.decode(ids)) == 1.0
  # the noisy kinds: a guess without the tool, a miscopied operand, the no-tool baseline's direct answer
  import numpy as np

  rng = np.random.default_rng(0)
  guess = tok.decode(calculator.demonstration(tok, row, noise="guess", rng=rng)[0])
  assert "<tool_call>" not in guess.split("assistant")[-1] and calculator.boxed_reward(row, guess) == 0.0
  miscopy = tok.decode(calculator.demonstration(tok, row, noise="operand", rng=rng)[0])
  assert ('"a": 11' in miscopy or '"a": 13' in miscopy) and calculator.boxed_reward(row, miscopy) == 0.0
  direct = tok.decode(calculator.demonstration(tok, row, noise="direct")[0])
  assert "# Tools" not in direct and calculator.boxed_reward(row, direct) == 1.0
