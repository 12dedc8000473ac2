"""A generative judge: an LLM asked, through any inference engine, to grade each completion.

For every row the judge fills a prompt template (a rubric, the question, the answer, and a reference answer
when a column holds one), renders it with the judge tokenizer's chat template (or as plain text), left-pads the
batch and calls ``engine.generate`` **once** for all rows of the call (greedy by default); each reply is turned
into a score by :func:`parse_judgment`. A reply that gives no score is a *missing sample*: NaN (the trainer gives
it advantage 0 and keeps it out of the loss; ``RewardSet`` counts it as ``"<name>/missing"``) and counted by the
judge as ``unparsable`` (or ``out_of_range``, ``too_long``) — never a silent 0.

The engine is anything with the :class:`jaxgrpo.rollout.engines.base.Engine` ``generate`` signature: the built-in
sampler on a judge model (``BuiltinEngine(load_hf(path))``), vLLM, or a user's engine.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from jaxgrpo import _checks
from jaxgrpo.data.answers import extract_boxed, parse_number
from jaxgrpo.rewards.reward_set import PROMPT_MESSAGES, CountingReward
from jaxgrpo.rollout.engines.base import check_engine
from jaxgrpo.rollout.sampling import SamplingConfig

__all__ = ["DEFAULT_RUBRIC", "DEFAULT_TEMPLATE", "REFERENCE_TEMPLATE", "VERDICTS", "JudgeReward", "parse_judgment"]

DEFAULT_RUBRIC = (
  "You are grading an answer to a question. Reply with one word: yes if the answer is correct and complete, "
  "no otherwise."
)
#: The placeholders: ``{rubric}``, ``{question}``, ``{answer}``, and ``{reference}`` (the ``reference_column``).
#: The default without a ``reference_column``.
DEFAULT_TEMPLATE = "{rubric}\n\nQuestion: {question}\n\nAnswer: {answer}\n\nIs the answer correct?"
#: The default with a ``reference_column``: the judge is shown the reference answer.
REFERENCE_TEMPLATE = (
  "{rubric}\n\nQuestion: {question}\n\nReference answer: {reference}\n\nAnswer: {answer}\n\nIs the answer correct?"
)

#: Verdict words (case-insensitive, whole words) and their scores.
VERDICTS: Mapping[str, float] = {
  **dict.fromkeys(("yes", "correct", "true", "right", "pass", "accept", "accepted", "good", "valid"), 1.0),
  **dict.fromkeys(("no", "incorrect", "false", "wrong", "fail", "reject", "rejected", "bad", "invalid"), 0.0),
}

_LABEL = re.compile(
  r"\b(?:score|rating|grade|verdict|judg(?:e)?ment|final answer)\s*(?:is|:|=)?\s*([^\s,;]+(?:\s*/\s*\d+)?)",
  re.IGNORECASE,
)
_ANSWER_IS = re.compile(r"\banswer is\s+([A-Za-z]+)\b", re.IGNORECASE)  # "the answer is correct": a verdict only
_FIRST_WORD = re.compile(r"^\W*([A-Za-z]+)\b")


def _value(text: str, verdicts: Mapping[str, float]) -> float | None:
  """A number (``7``, ``-0.5``, ``3/4``, ``\\frac{3}{4}``, ``8/10`` = 0.8) or a verdict word; None otherwise."""
  t = text.strip().strip(".!*`'\"").strip()
  if not t:
    return None
  word = t.lower()
  if word in verdicts:
    return float(verdicts[word])
  m = re.fullmatch(r"(-?\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)", t)  # "8 / 10" as well as "8/10"
  if m:
    den = Fraction(m.group(2))
    return float(Fraction(m.group(1)) / den) if den else None
  v = parse_number(t)
  return None if v is None else float(v)


def parse_judgment(text: str, *, verdicts: Mapping[str, float] = VERDICTS) -> float | None:
  """The score a judge's reply gives, or None when it gives none. Tried in order, the first that applies:

  1. the last ``\\boxed{...}``: its content must be a number or a verdict word (else None: a box is an
     explicit answer, never skipped over);
  2. the last labelled value — ``score:``, ``rating:``, ``grade:``, ``verdict:``, ``judgment:`` or
     ``final answer:`` followed by a number or a verdict word (``Score: 8/10`` → 0.8), else the last
     ``answer is <verdict word>`` (``"The answer is correct."`` → 1; ``"the answer is 9"`` is no score);
  3. the whole reply is one number or one verdict word (``" 7."``, ``"Yes"``);
  4. the reply's first word is a verdict word (``"No, the sum is 9."`` → 0).

  Numbers are returned as they are (``7`` → 7.0; rescale with ``JudgeReward(scale=...)``); verdict words by
  ``verdicts`` (default :data:`VERDICTS`: yes/correct/... → 1, no/incorrect/... → 0). Anything else (a
  number somewhere in a sentence, "maybe", an empty reply) is None — counted, never guessed.
  """
  if not isinstance(text, str):
    raise TypeError(f"`text` must be a str (the judge's reply); got {type(text).__name__}")
  verdicts = {k.lower(): float(v) for k, v in verdicts.items()}
  boxed = extract_boxed(text)
  if boxed is not None:
    return _value(boxed, verdicts)
  for candidate in reversed(_LABEL.findall(text)):
    v = _value(candidate, verdicts)
    if v is not None:
      return v
  for word in reversed(_ANSWER_IS.findall(text)):
    if word.lower() in verdicts:
      return float(verdicts[word.lower()])
  v = _value(text, verdicts)
  if v is not None:
    return v
  m = _FIRST_WORD.match(text)
  if m and m.group(1).lower() in verdicts:
    return float(verdicts[m.group(1).lower()])
  return None


class JudgeReward(CountingReward):
  """A reward function ``(prompts, completions, **columns) -> list[float]`` graded by a generative judge.

  Args:
    engine: an ``Engine`` (``jaxgrpo.rollout.engines``) holding the judge model; called once per call with all
      rows (``num_samples=1``).
    tokenizer: the judge model's tokenizer (renders and decodes).
    template: the judge prompt (placeholders ``{rubric}``, ``{question}``, ``{answer}``, ``{reference}``; a literal
      brace is doubled, ``{{"score": 1}}``). None: :data:`REFERENCE_TEMPLATE` with a ``reference_column``, else
      :data:`DEFAULT_TEMPLATE`.
    rubric: the grading instructions (:data:`DEFAULT_RUBRIC`).
    reference_column: the dataset column filling ``{reference}`` (e.g. ``"answer"``); None: not used. A template
      that names one uses ``{reference}`` and the other way round (either mismatch is refused: a reference the
      judge never sees is a silent no-op).
    parser: reply → score or None (default :func:`parse_judgment`).
    scale: ``(lo, hi)``: a parsed number x becomes ``(x - lo) / (hi - lo)``; one outside ``[lo, hi]`` is
      missing (counted ``out_of_range``). None: scores as parsed.
    chat: render with the tokenizer's chat template (a user message, generation prompt added); False: the
      filled template as plain text.
    max_new_tokens: the reply budget. temperature: 0 (greedy, the default) or > 0 (sampled; ``seed`` starts the
      key, which advances every call).
    max_prompt_tokens: longer judge prompts are not sent (missing, counted ``too_long``).
    pad_multiple: prompts are left-padded to a multiple of this (few shapes compile).
    name: the reward's name in a ``RewardSet``.

  Counters (``pop_counters``): ``unparsable``, ``out_of_range``, ``too_long``.
  """

  nan_is_missing = True  # RewardSet keeps a NaN as a missing sample (jaxgrpo.rewards.reward_set)

  #: given the ``prompt_messages`` column (``rewards.reward_set.PROMPT_MESSAGES``): each prompt before the policy's template
  wants_prompt_messages = True

  def __init__(
    self,
    engine,
    tokenizer,
    *,
    template: str | None = None,
    rubric: str = DEFAULT_RUBRIC,
    reference_column: str | None = None,
    parser: Callable[[str], float | None] = parse_judgment,
    scale: tuple[float, float] | None = None,
    chat: bool = True,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    max_prompt_tokens: int = 2048,
    pad_multiple: int = 64,
    name: str = "judge",
  ):
    super().__init__()
    check_engine(engine, "`engine`")
    if template is None:
      template = DEFAULT_TEMPLATE if reference_column is None else REFERENCE_TEMPLATE
    _check_template(template, reference_column)
    if not callable(parser):
      raise TypeError(f"`parser` must be a callable (reply: str) -> float | None; got {parser!r}")
    if scale is not None:
      lo, hi = (_checks.check_python_float(v, f"scale[{i}]") for i, v in enumerate(scale))
      if hi <= lo:
        raise ValueError(f"`scale` must be (lo, hi) with lo < hi; got {scale!r}")
      scale = (lo, hi)
    if chat and not getattr(tokenizer, "chat_template", None):
      raise ValueError("`chat`=True needs a tokenizer with a chat template; pass chat=False for plain text")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if pad is None:
      raise ValueError("the judge tokenizer has neither a pad nor an EOS token")
    self.engine, self.tokenizer = engine, tokenizer
    self.template, self.rubric, self.reference_column = template, rubric, reference_column
    self.parser, self.scale, self.chat = parser, scale, bool(chat)
    self.temperature = _checks.check_python_float(temperature, "temperature", at_least=0.0)
    self.max_prompt_tokens = _checks.check_python_int(max_prompt_tokens, "max_prompt_tokens", minimum=1)
    self.pad_multiple = _checks.check_python_int(pad_multiple, "pad_multiple", minimum=1)
    self.sampling = SamplingConfig(
      num_samples=1,
      max_new_tokens=_checks.check_python_int(max_new_tokens, "max_new_tokens", minimum=1),
      eos_ids=() if eos is None else (int(eos),),
      pad_id=int(pad),
    )
    self._key = jax.random.key(_checks.check_python_int(seed, "seed"))
    self.__name__ = name
    self.last_replies: list[str] = []  # the judge's replies of the last call (for logs and debugging)

  def render(self, prompt: Any, completion: str, reference: Any = None) -> str:
    """The judge's prompt text for one row."""
    question = prompt if isinstance(prompt, str) else _last_user(prompt)
    text = self.template.format(
      rubric=self.rubric, question=question, answer=completion, reference="" if reference is None else reference
    )
    if not self.chat:
      return text
    return self.tokenizer.apply_chat_template(
      [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )

  def _score(self, reply: str) -> float:
    v = self.parser(reply)
    if v is None or not math.isfinite(float(v)):
      self._count("unparsable")
      return math.nan
    v = float(v)
    if self.scale is not None:
      lo, hi = self.scale
      if not lo <= v <= hi:
        self._count("out_of_range")
        return math.nan
      v = (v - lo) / (hi - lo)
    return v

  def __call__(self, prompts: Sequence[Any], completions: Sequence[str], **columns) -> list[float]:
    n = len(completions)
    if len(prompts) != n:
      raise ValueError(f"`prompts` ({len(prompts)}) and `completions` ({n}) must have one entry per row")
    refs = [None] * n
    if self.reference_column is not None:
      if self.reference_column not in columns:
        raise ValueError(f"the judge needs the column {self.reference_column!r}; got columns {sorted(columns)}")
      refs = list(columns[self.reference_column])
    prompts = columns.get(PROMPT_MESSAGES) or prompts  # the trainer's rows: the question before the policy's template
    special = self.tokenizer.bos_token is not None and not self.chat
    ids = [
      list(self.tokenizer(self.render(p, c, r), add_special_tokens=special)["input_ids"])
      for p, c, r in zip(prompts, completions, refs)
    ]
    sent = [i for i, x in enumerate(ids) if 0 < len(x) <= self.max_prompt_tokens]
    self._count("too_long", n - len(sent))
    out = [math.nan] * n
    self.last_replies = [""] * n
    if not sent:
      return out
    width = -(-max(len(ids[i]) for i in sent) // self.pad_multiple) * self.pad_multiple
    tokens = np.full((len(sent), width), self.sampling.pad_id, np.int32)
    mask = np.zeros((len(sent), width), bool)
    for j, i in enumerate(sent):
      tokens[j, width - len(ids[i]) :], mask[j, width - len(ids[i]) :] = ids[i], True
    self._key, key = jax.random.split(self._key)
    gen = self.engine.generate(tokens, mask, self.sampling, key=key, temperature=self.temperature)
    comps, cmask = np.asarray(gen.rollout.completions), np.asarray(gen.rollout.mask, bool)
    if comps.shape[0] != len(sent):
      raise RuntimeError(f"engine {getattr(self.engine, 'name', '?')!r} returned {comps.shape[0]} rows for {len(sent)}")
    replies = self.tokenizer.batch_decode([c[m].tolist() for c, m in zip(comps, cmask)], skip_special_tokens=True)
    for j, i in enumerate(sent):
      self.last_replies[i] = replies[j]
      out[i] = self._score(replies[j])
    return out


def _check_template(template: Any, reference_column: str | None) -> None:
  """One line for a template that cannot be filled, or whose ``{reference}`` and ``reference_column`` disagree."""
  if not isinstance(template, str) or "{answer}" not in template:
    raise ValueError(f"`template` must be a str with an {{answer}} placeholder; got {template!r:.200}")
  try:
    template.format(rubric="", question="", answer="", reference="")
  except (KeyError, IndexError, ValueError) as e:
    raise ValueError(
      f"`template` may use only {{rubric}}, {{question}}, {{answer}}, {{reference}}; got {e!r} in {template!r:.200}. "
      'A literal brace (JSON such as {"score": 1}) must be doubled: {{"score": 1}}'
    ) from None
  if "{reference}" in template and reference_column is None:
    raise ValueError("`template` uses {reference}: name the column that holds it with `reference_column`")
  if reference_column is not None and "{reference}" not in template:
    raise ValueError(
      f"`reference_column`={reference_column!r} but `template` has no {{reference}} placeholder, so the judge would "
      f"never see the reference; put {{reference}} in the template, or leave `template` out (the default "
      f"REFERENCE_TEMPLATE shows it), or drop `reference_column`; got {template!r:.200}"
    )


def _last_user(messages) -> str:
  """The content of the last user message of a chat prompt (a list of ``{"role", "content"}``)."""
  users = [m.get("content", "") for m in messages if isinstance(m, Mapping) and m.get("role") == "user"]
  if not users:
    raise ValueError(f"a chat prompt needs a user message to judge; got {messages!r:.200}")
  return str(users[-1])
