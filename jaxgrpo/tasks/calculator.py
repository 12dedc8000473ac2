"""The calculator task: multi-digit multiplication that a tiny model can only solve with a tool.

"What is 37 * 52?" — the policy calls ``multiply`` in the Qwen2.5/Qwen3 tool-call format, reads the
result in the tool role, and boxes it::

    <|im_start|>assistant
    <tool_call>
    {"name": "multiply", "arguments": {"a": 37, "b": 52}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    1924
    </tool_response><|im_end|>
    <|im_start|>assistant
    \\boxed{1924}<|im_end|>

- :func:`build_tokenizer`: a word/character-level tokenizer with the Qwen special tokens and
  :data:`CHAT_TEMPLATE`, a Qwen2.5-style template written for this task (tools rendered as JSON
  schemas in the system turn, ``tool`` messages as ``<tool_response>`` blocks in a user turn).
- :func:`multiply`: the tool; :func:`make_env`: a :class:`~jaxgrpo.rollout.environments.tools.ToolEnvironment`
  per row, reward 1 for the right boxed product.
- :func:`calculator_split`: training and held-out problems over disjoint operand pairs.
- :class:`RetryEnvironment` (:func:`make_retry_env`): a tool-free multi-turn environment for any
  ``{problem, answer}`` row — a wrong answer gets one more try (``scripts/configs/demo_env.yaml``).
- :func:`demonstration`: the token ids and policy mask of a worked conversation (optionally noisy,
  or answered without the tool), for the supervised warm-up.
"""

from __future__ import annotations

import json
import re
from typing import Mapping

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers import models as tk_models
from transformers import PreTrainedTokenizerFast

from jaxgrpo.data import INSTRUCTION, build_messages
from jaxgrpo.rewards.reward_set import extract_boxed
from jaxgrpo.rollout.environments.base import StepResult
from jaxgrpo.rollout.environments.chat import ChatFormat
from jaxgrpo.rollout.environments.tools import ToolEnvironment, tool_schema
from jaxgrpo.tasks.arithmetic import sft_sequences

__all__ = [
  "CHAT_TEMPLATE",
  "SPECIAL_TOKENS",
  "build_tokenizer",
  "boxed_reward",
  "calculator_split",
  "demonstration",
  "make_env",
  "make_env_without_tool",
  "make_retry_env",
  "RetryEnvironment",
  "multiply",
  "warm_up",
]

SPECIAL_TOKENS = (
  "<|endoftext|>",
  "<|im_start|>",
  "<|im_end|>",
  "<tool_call>",
  "</tool_call>",
  "<tool_response>",
  "</tool_response>",
)
# A Qwen2.5-style template (same wire format), written for this task.
CHAT_TEMPLATE = (
  "{%- if tools %}{{ '<|im_start|>system\\n' }}"
  "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
  "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}"
  "{{ 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
  "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
  "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
  "<tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}"
  '{{ \'{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
  "{%- elif messages[0]['role'] == 'system' %}{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
  "{%- endif %}"
  "{%- for m in messages %}"
  "{%- if m['role'] == 'system' %}"
  "{%- elif m['role'] == 'tool' %}"
  "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
  "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
  "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
  "{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
  "{%- endif %}"
  "{%- endfor %}"
  "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_WORD = r"\\[A-Za-z]+|[A-Za-z_']+|\d|\s|[^\sA-Za-z\d]"


def multiply(a: int, b: int) -> int:
  """Multiplies two integers.

  Args:
    a: the first factor.
    b: the second factor.
  """
  return int(a) * int(b)


def _system_text() -> str:
  fmt = ChatFormat(_bare_tokenizer(()), tools=[tool_schema(multiply)])
  return fmt._render([{"role": "user", "content": "What is"}], generation_prompt=True)


def _bare_tokenizer(words) -> PreTrainedTokenizerFast:
  vocab_list = list(SPECIAL_TOKENS) + [chr(c) for c in range(32, 127)] + ["\n"]
  vocab_list += sorted(w for w in set(words) if w not in vocab_list)
  vocab_list += [f"<|reserved_{i}|>" for i in range(-len(vocab_list) % 64)]
  vocab = {w: i for i, w in enumerate(vocab_list)}
  tok = Tokenizer(tk_models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
  known = sorted((w for w in set(words) if len(w) > 1), key=lambda w: (-len(w), w))
  pattern = "|".join([re.escape(w) + r"(?![A-Za-z_])" for w in known] + [r"[\s\S]"])
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens(list(SPECIAL_TOKENS))
  fast = PreTrainedTokenizerFast(
    tokenizer_object=tok,
    pad_token="<|endoftext|>",
    unk_token="<|endoftext|>",
    eos_token="<|im_end|>",
    additional_special_tokens=list(SPECIAL_TOKENS[1:]),
  )
  fast.chat_template = CHAT_TEMPLATE
  return fast


def build_tokenizer() -> PreTrainedTokenizerFast:
  """The task's tokenizer: Qwen special tokens (``<|im_end|>`` is EOS, ``<|endoftext|>`` padding),
  every printable ASCII character, the words of the tool prompt as single tokens (``"arguments"``,
  ``"multiply"``, ``\\boxed``…), and each long fixed line of the tool prompt (the prose, the schema) as
  one token, so the tiny demo's prompts stay short; digits are single characters."""
  text = _system_text()
  special = "|".join(re.escape(t) for t in SPECIAL_TOKENS)
  pieces = [p for line in text.split("\n") for p in re.split(special, line)]
  phrases = [p for p in pieces if len(p) > 40]  # the prose and schema lines: one token each
  phrases += ['{"name": "multiply", "arguments": {"a": ', ', "b": ', "}}"]  # the call's fixed parts
  return _bare_tokenizer(re.findall(_WORD, text + ' "name" "arguments" What is \\boxed') + phrases)


def calculator_split(
  train_size: int, eval_size: int, *, seed: int, low: int = 10, high: int = 99
) -> tuple[list[dict], list[dict]]:
  """``(train rows, held-out rows)`` of ``{"problem": "What is a * b?", "answer": str(a*b), "a", "b"}``
  with operands in ``[low, high]``; the held-out pairs never occur in training."""
  space = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
  if eval_size >= len(space):
    raise ValueError(f"`eval_size`={eval_size} leaves no training problems out of {len(space)}")
  order = np.random.default_rng([seed, 3]).permutation(len(space))
  row = lambda i: {"problem": f"What is {space[i][0]} * {space[i][1]}?", "answer": str(space[i][0] * space[i][1])}
  held = [row(int(i)) for i in order[:eval_size]]
  rest = order[eval_size:]
  rng = np.random.default_rng([seed, 4])
  return [row(int(i)) for i in rng.choice(rest, size=train_size, replace=True)], held


def boxed_reward(row: Mapping, text: str) -> float:
  """1.0 when the last ``\\boxed{}`` of ``text`` is the row's answer, else 0.0."""
  boxed = extract_boxed(text)
  return float(boxed is not None and boxed.strip() == str(row["answer"]))


def make_env(row: Mapping | None = None) -> ToolEnvironment:
  """A fresh environment for one trajectory: the ``multiply`` tool, reward :func:`boxed_reward`."""
  return ToolEnvironment([multiply], boxed_reward)


def make_env_without_tool(row: Mapping | None = None) -> ToolEnvironment:
  """The no-tool baseline's environment: no tools (the prompt has no tool section; a call is an
  "unknown tool" error), reward :func:`boxed_reward` of the first answer."""
  return ToolEnvironment([], boxed_reward)


class RetryEnvironment:
  """A tool-free multi-turn environment for any ``{problem, answer}`` row (e.g. the arithmetic task):
  a wrong or missing boxed answer gets ``"Wrong. Try again."`` and another turn, up to ``retries``;
  the reward is ``decay**k`` for a right answer at retry k (1 at the first turn), else 0.
  Metric: ``retries``.

  The prompt is the single-turn prompt: the problem with ``instruction`` appended
  (``jaxgrpo.data.build_messages``; default the ``\\boxed{}`` instruction of ``data.instruction``, which the
  arithmetic warm-up's prompts carry). Without it the warmed-up demo policy answers the bare question
  with noise (held-out reward 0.020 instead of 0.213 at step 0) and RL has almost no signal to learn from.
  """

  tools = ()

  def __init__(self, retries: int = 1, decay: float = 0.5, instruction: str | None = INSTRUCTION):
    self.retries, self.decay, self.instruction = retries, decay, instruction

  def reset(self, row: Mapping) -> list[dict]:
    self.row, self.turn = row, 0
    return build_messages(str(row["problem"]), self.instruction)

  def step(self, text: str) -> StepResult:
    right = boxed_reward(self.row, text) == 1.0
    self.turn += 1
    if right or self.turn > self.retries:
      return StepResult((), float(right) * self.decay ** (self.turn - 1), True)
    return StepResult([{"role": "user", "content": "Wrong. Try again."}], 0.0, False, {"retries": 1.0})


def make_retry_env(row: Mapping | None = None) -> RetryEnvironment:
  """``RetryEnvironment()``: one retry, reward 0.5 for a right second answer (``env.factory:
  jaxgrpo.tasks.calculator:make_retry_env``; ``scripts/configs/demo_env.yaml``)."""
  return RetryEnvironment()


def _operands(problem: str) -> tuple[int, int]:
  a, b = re.findall(r"\d+", problem)
  return int(a), int(b)


def demonstration(tokenizer, row: Mapping, *, noise: str | None = None, rng=None) -> tuple[list[int], list[bool]]:
  """A worked conversation for the warm-up: ``(ids, policy_mask)`` of prompt + call + tool response +
  boxed answer, the mask True on the policy's tokens: its call up to ``</tool_call>`` (where the rollout
  stops a turn; the observation closes it with ``<|im_end|>``) and its answer up to ``<|im_end|>``.

  ``noise``: None (a correct demonstration); ``"direct"`` (no tools in the prompt, the right product
  boxed at once: the no-tool baseline's warm-up); ``"operand"`` (the call copies one operand with a digit
  off by one — the tool then returns a wrong product, which is boxed); ``"guess"`` (no tool call: a
  product with a wrong digit boxed directly).
  """
  env = make_env(row)
  fmt = ChatFormat(tokenizer, tools=env.tools)
  ids = fmt.prompt_ids(env.reset(row))
  policy = [False] * len(ids)
  a, b = _operands(row["problem"])
  rng = rng or np.random.default_rng(0)
  if noise == "direct":  # the no-tool baseline's demonstration: the right product, no tool
    fmt = ChatFormat(tokenizer)
    ids = fmt.prompt_ids(make_env_without_tool(row).reset(row))
    turn = fmt.encode(f"\\boxed{{{row['answer']}}}<|im_end|>")
    return ids + turn, [False] * len(ids) + [True] * len(turn)
  if noise == "guess":
    wrong = int(row["answer"]) + int(rng.choice([-10, -1, 1, 10]))
    turn = fmt.encode(f"\\boxed{{{wrong}}}<|im_end|>")
    return ids + turn, policy + [True] * len(turn)
  if noise == "operand":
    a = a + int(rng.choice([-1, 1]))
  call = json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}})
  turn1 = fmt.encode(f"<tool_call>\n{call}\n</tool_call>")  # the rollout stops at </tool_call>
  obs = fmt.observation_ids([{"role": "tool", "content": str(a * b)}], turn1)
  turn2 = fmt.encode(f"\\boxed{{{a * b}}}<|im_end|>")
  ids = ids + turn1 + obs + turn2
  policy = policy + [True] * len(turn1) + [False] * len(obs) + [True] * len(turn2)
  return ids, policy


def warm_up(
  model,
  tokenizer,
  rows,
  *,
  steps: int,
  guess: float = 0.0,
  operand: float = 0.0,
  without_tool: bool = False,
  batch_size: int = 32,
  learning_rate: float = 3e-3,
  seed: int = 0,
  log=print,
  progress: bool = False,
) -> list[float]:
  """Supervised warm-up on demonstrations (:func:`demonstration`): a fraction ``guess`` answers without
  the tool (a wrong product), a fraction ``operand`` miscopies an operand into the call, the rest are
  correct; ``without_tool``: every demonstration is ``"direct"`` (the no-tool baseline). The loss covers
  the policy's tokens only. Returns the loss every 50 steps. ``progress``: a bar with an ETA instead of
  the ``log`` lines (``arithmetic.sft_sequences``)."""
  rng = np.random.default_rng([seed, 5])
  seqs, masks = [], []
  for row in rows:
    u = rng.random()
    noise = "direct" if without_tool else "guess" if u < guess else "operand" if u < guess + operand else None
    ids, pm = demonstration(tokenizer, row, noise=noise, rng=rng)
    seqs.append(ids)
    masks.append(pm)
  width = max(len(x) for x in seqs)
  tokens = np.full((len(seqs), width), tokenizer.pad_token_id, np.int32)
  attn, loss_mask = np.zeros((len(seqs), width), bool), np.zeros((len(seqs), width), bool)
  for i, (ids, pm) in enumerate(zip(seqs, masks)):
    tokens[i, : len(ids)], attn[i, : len(ids)], loss_mask[i, : len(ids)] = ids, True, pm
  return sft_sequences(
    model,
    tokens,
    attn,
    loss_mask,
    steps=steps,
    batch_size=batch_size,
    learning_rate=learning_rate,
    seed=seed,
    log_every=max(1, steps // 4),
    log=log,
    progress=progress,
  )
