"""Math prompt sets: loading, column mappings, chat templating, a resumable shuffled iterator.
One job: a run's prompts, from a file or hub id to the left-padded token rows the sampler takes.

Data flow::

    load_math_dataset(source, mapping) -> list[MathExample]          (hub id, jsonl, parquet, saved dir)
    encode_prompts(tokenizer, examples, max_prompt_tokens) -> EncodedPrompts   (chat template, drops long)
    PromptIterator(num_prompts, batch_size, seed) -> next() indices  (state() / restore() for resume)
    host_slice(indices, process_index, process_count)               (multi-host: each host its part)
    pad_left(token_lists, length, pad_id) -> (int32[B, P], bool[B, P])   (the sampler's layout)

A :class:`MathExample` keeps the prompt (a string or a chat message list), the ground-truth answer
as a string, and every other column of the row (passed to reward functions as keyword arguments).

Rows whose answer is missing, null, NaN or empty are skipped with one warning naming them (or, with
``missing_answers="raise"``, refused): they would otherwise become the ground truth ``"None"``.
A file that cannot be read (missing, empty, malformed, not a dataset) is a ValueError naming it
(and the line, for JSON lines), never a library traceback.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from jaxgrpo import _checks

if TYPE_CHECKING:  # annotations only: datasets and pyarrow are imported where a dataset is loaded
  import datasets

__all__ = [
  "INSTRUCTION",
  "ColumnMapping",
  "MAPPINGS",
  "MathExample",
  "EncodedPrompts",
  "PromptIterator",
  "load_math_dataset",
  "examples_from_rows",
  "detect_mapping",
  "build_messages",
  "encode_prompts",
  "host_slice",
  "pad_left",
  "gsm8k_final_answer",
  "FILE_TYPES",
]

#: The papers' instruction, appended to the user's question.
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def gsm8k_final_answer(answer: str) -> str:
  """The number after ``####`` in a GSM8K solution (commas removed): ``"... #### 1,200"`` → ``"1200"``."""
  if "####" not in answer:
    raise ValueError(f"GSM8K answer has no '####' marker: {answer[-80:]!r}")
  return answer.rsplit("####", 1)[1].strip().replace(",", "")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ColumnMapping:
  """Where a dataset keeps the prompt and the ground-truth answer.

  Attributes:
    prompt: column of the question: a string, or a chat message list (``[{"role", "content"}]``).
      Dotted names reach into nested dicts (``"reward_model.ground_truth"``).
    answer: column of the ground truth (dotted names allowed).
    answer_fn: turns the raw answer into the string the verifier compares against (e.g. GSM8K's
      ``#### n``); None keeps ``str(raw)``.
  """

  prompt: str
  answer: str
  answer_fn: Callable[[Any], str] | None = None

  def columns(self) -> tuple[str, str]:
    return (self.prompt, self.answer)


#: Built-in mappings for the sets the papers used and users expect.
MAPPINGS: dict[str, ColumnMapping] = {
  "openrs": ColumnMapping(prompt="problem", answer="answer"),  # knoveleng/open-rs
  "math500": ColumnMapping(prompt="problem", answer="answer"),  # HuggingFaceH4/MATH-500
  "dapo": ColumnMapping(prompt="prompt", answer="reward_model.ground_truth"),  # DAPO-Math-17k
  "gsm8k": ColumnMapping(prompt="question", answer="answer", answer_fn=gsm8k_final_answer),  # openai/gsm8k
}


@dataclasses.dataclass(frozen=True)
class MathExample:
  """One prompt: ``prompt`` (str or chat messages), ``answer`` (ground truth string), ``columns``
  (all other columns of the row; passed to reward functions by name)."""

  prompt: str | list[dict]
  answer: str
  columns: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _get(row: Mapping[str, Any], dotted: str):
  value: Any = row
  for part in dotted.split("."):
    if not isinstance(value, Mapping) or part not in value:
      raise KeyError(dotted)
    value = value[part]
  return value


def _has(row: Mapping[str, Any], dotted: str) -> bool:
  try:
    _get(row, dotted)
    return True
  except KeyError:
    return False


def _column_names(row: Mapping[str, Any], prefix: str = "") -> list[str]:
  names = []
  for k, v in row.items():
    names.append(prefix + k)
    if isinstance(v, Mapping):
      names.extend(_column_names(v, prefix + k + "."))
  return names


def detect_mapping(row: Mapping[str, Any]) -> ColumnMapping:
  """The built-in mapping whose columns the row has (dapo, gsm8k, then problem/answer sets)."""
  for name in ("dapo", "gsm8k", "openrs"):
    m = MAPPINGS[name]
    if all(_has(row, c) for c in m.columns()):
      return m
  raise ValueError(
    f"`mapping`: cannot recognise the dataset; columns found: {sorted(_column_names(row))}; "
    f"expected one of {{{', '.join(f'{k}: {list(v.columns())}' for k, v in MAPPINGS.items())}}}. "
    "Pass mapping={'prompt': <column>, 'answer': <column>}"
  )


def _resolve_mapping(mapping, first_row: Mapping[str, Any]) -> ColumnMapping:
  if mapping is None or mapping == "auto":
    return detect_mapping(first_row)
  if isinstance(mapping, ColumnMapping):
    return mapping
  if isinstance(mapping, str):
    if mapping not in MAPPINGS:
      raise ValueError(
        f"`mapping` must be one of {sorted(MAPPINGS)}, 'auto', a dict or a ColumnMapping; got {mapping!r}"
      )
    return MAPPINGS[mapping]
  if isinstance(mapping, Mapping):
    unknown = set(mapping) - {"prompt", "answer"}
    if unknown or "prompt" not in mapping or "answer" not in mapping:
      raise ValueError(f"`mapping` dict needs exactly the keys 'prompt' and 'answer'; got {sorted(mapping)}")
    return ColumnMapping(prompt=mapping["prompt"], answer=mapping["answer"])
  raise TypeError(f"`mapping` must be None, 'auto', a name, a dict or a ColumnMapping; got {type(mapping).__name__}")


def _missing_answer(raw: Any) -> bool:
  return raw is None or (isinstance(raw, float) and math.isnan(raw)) or (isinstance(raw, str) and not raw.strip())


def _row_list(indices: Sequence[int], limit: int = 10) -> str:
  shown = ", ".join(str(i) for i in indices[:limit])
  return shown + (f", ... ({len(indices)} in all)" if len(indices) > limit else "")


def examples_from_rows(
  rows: Sequence[Mapping[str, Any]], mapping=None, *, missing_answers: str = "skip"
) -> list[MathExample]:
  """Rows (dicts) → examples under ``mapping`` (None/"auto": detect; a name in ``MAPPINGS``; a
  ``{"prompt": col, "answer": col}`` dict; a ``ColumnMapping``).

  A row whose answer is absent, None, NaN or empty (also after ``answer_fn``) has no ground truth:
  ``missing_answers="skip"`` (default) leaves it out with one ``UserWarning`` giving the count and
  the row numbers (0-based); ``"raise"`` raises ValueError naming them. Either way such a row never
  reaches a verifier (where ``str(None)`` would match ``\\boxed{None}``).

  Raises ValueError listing the columns found and expected when a mapped column is missing from
  every row, or when no row has an answer.
  """
  return _examples(rows, mapping, missing_answers, "`rows`")


def _examples(rows, mapping, missing_answers: str, where: str) -> list[MathExample]:
  if missing_answers not in ("skip", "raise"):
    raise ValueError(f"`missing_answers` must be 'skip' or 'raise'; got {missing_answers!r}")
  if len(rows) == 0:
    raise ValueError(f"{where}: the dataset is empty")
  m = _resolve_mapping(mapping, rows[0])
  missing = [c for c in m.columns() if not any(_has(r, c) for r in rows)]
  if missing:
    raise ValueError(
      f"`mapping`: column(s) {missing} not in {where}; columns found: "
      f"{sorted(_column_names(rows[0]))}; expected: prompt={m.prompt!r}, answer={m.answer!r}"
    )
  out, skipped = [], []
  for i, row in enumerate(rows):
    try:
      prompt = _get(row, m.prompt)
    except KeyError as e:
      raise ValueError(
        f"{where} row {i}: column {e.args[0]!r} missing; columns found: {sorted(_column_names(row))}"
      ) from None
    if not isinstance(prompt, (str, list)):
      raise ValueError(
        f"{where} row {i}: prompt column {m.prompt!r} must be a string or a chat message list; "
        f"got {type(prompt).__name__}"
      )
    raw = _get(row, m.answer) if _has(row, m.answer) else None
    try:
      answer = None if _missing_answer(raw) else (m.answer_fn(raw) if m.answer_fn is not None else str(raw))
    except ValueError as e:
      raise ValueError(f"{where} row {i}: {e}") from None
    if _missing_answer(answer):
      skipped.append(i)
      continue
    out.append(MathExample(prompt=prompt, answer=answer, columns=dict(row)))
  if skipped:
    what = (
      f"{len(skipped)} of {len(rows)} rows of {where} have no answer in column {m.answer!r} "
      f"(absent, null, NaN or empty): rows {_row_list(skipped)}"
    )
    if missing_answers == "raise" or not out:
      raise ValueError(what)
    warnings.warn(f"skipped {what}", stacklevel=3)
  return out


#: Local file types :func:`load_math_dataset` reads, by extension.
FILE_TYPES = ("jsonl", "json", "parquet", "csv")
_SAVED_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")


def _read_json_lines(path: str, lines) -> list[dict]:
  rows = []
  for lineno, raw in lines:
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise ValueError(f"`source`: {path} line {lineno}: not UTF-8 ({e.reason} at byte {e.start})") from None
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"`source`: {path} line {lineno}: malformed JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(row, dict):
      raise ValueError(f"`source`: {path} line {lineno}: a row must be a JSON object; got {type(row).__name__}")
    rows.append(row)
  return rows


def _read_json(path: str) -> list[dict]:
  """A ``.json`` file: an array of row objects, or JSON lines (one object per line)."""
  with open(path, "rb") as f:
    data = f.read()
  try:
    value = json.loads(data)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    if isinstance(e, json.JSONDecodeError) and data.lstrip()[:1] == b"[":
      raise ValueError(f"`source`: {path}: malformed JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    return _read_json_lines(path, enumerate(data.splitlines(), 1))  # names the first bad line
  rows = value if isinstance(value, list) else [value]
  bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
  if bad is not None:
    raise ValueError(f"`source`: {path}: item {bad} is a {type(rows[bad]).__name__}; rows must be JSON objects")
  return rows


def _read_arrow(path: str, ext: str) -> list[dict]:
  import pyarrow  # here, not at the top: runs without data files do not pay the import (also datasets' below)
  import pyarrow.csv
  import pyarrow.parquet

  read = pyarrow.parquet.read_table if ext == "parquet" else pyarrow.csv.read_csv
  try:
    return read(path).to_pylist()
  except (pyarrow.ArrowException, OSError) as e:
    raise ValueError(f"`source`: cannot read {path}: {e}") from None


def _read_file(path: str) -> list[dict]:
  ext = path.rsplit(".", 1)[-1].lower() if "." in os.path.basename(path) else ""
  if ext not in FILE_TYPES:
    raise ValueError(f"`source`: unsupported file type {ext!r} ({path}); use one of {', '.join(FILE_TYPES)}")
  if os.path.getsize(path) == 0:
    raise ValueError(f"`source`: {path} is empty (0 bytes)")
  if ext == "jsonl":
    with open(path, "rb") as f:
      return _read_json_lines(path, enumerate(f, 1))
  if ext == "json":
    return _read_json(path)
  return _read_arrow(path, ext)


def looks_local(source: str) -> bool:
  """A path, not a hub id: ``jaxgrpo._checks.names_local_path`` (starts with ``/``, ``.`` or ``~``, has more than
  one ``/``, or its first part is a local directory), or a name ending in a known file extension."""
  return _checks.names_local_path(source) or source.lower().endswith(tuple("." + e for e in FILE_TYPES))


def _library_call(what: str, fn, *args, **kwargs):
  """``fn(*args, **kwargs)`` with any error turned into one ValueError naming ``what``."""
  try:
    return fn(*args, **kwargs)
  except Exception as e:
    raise ValueError(f"`source`: cannot load {what}: {type(e).__name__}: {e}") from None


def _load_dir(path: str, split: str) -> datasets.Dataset:
  import datasets

  if any(os.path.exists(os.path.join(path, f)) for f in _SAVED_MARKERS):
    ds = _library_call(f"the saved dataset {path}", datasets.load_from_disk, path)
    if isinstance(ds, datasets.DatasetDict):
      if split not in ds:
        raise ValueError(f"`split`: {split!r} not in the saved dataset {path}; splits: {list(ds)}")
      ds = ds[split]
    return ds
  data_files = [
    os.path.join(root, f)
    for root, _, files in os.walk(path)
    for f in files
    if f.rsplit(".", 1)[-1].lower() in FILE_TYPES and not f.startswith(".")
  ]
  if not data_files:
    found = sorted(os.listdir(path))
    raise ValueError(
      f"`source`: {path} is a directory but neither a saved dataset (save_to_disk writes one of "
      f"{', '.join(_SAVED_MARKERS)}) nor a directory of data files ({', '.join(FILE_TYPES)}); "
      f"it holds: {found[:10] if found else 'nothing'}"
    )
  return _library_call(f"the data files in {path}", datasets.load_dataset, path, split=split)


def _load_rows(source: str, split: str, name: str | None, limit: int | None) -> list[dict]:
  """Rows of a local jsonl/json/parquet/csv file, a ``save_to_disk`` directory, a directory of
  data files, or a hub dataset; every failure a ValueError naming the source."""
  path = os.path.expanduser(os.fspath(source))
  if os.path.isfile(path):
    rows = _read_file(path)
    rows = rows if limit is None else rows[:limit]
  else:
    if os.path.isdir(path):
      ds = _load_dir(path, split)
    elif looks_local(path):
      raise ValueError(f"`source`: no such file or directory: {path}")
    else:  # a hub id (name: its config, e.g. "main")
      import datasets

      ds = _library_call(f"{path!r} from the Hugging Face hub", datasets.load_dataset, path, name, split=split)
    if limit is not None:
      ds = ds.select(range(min(limit, len(ds))))
    rows = ds.to_list()
  if not rows:
    raise ValueError(f"`source`: {path} has no rows")
  return rows


def load_math_dataset(
  source: str,
  *,
  split: str = "train",
  mapping=None,
  limit: int | None = None,
  name: str | None = None,
  missing_answers: str = "skip",
) -> list[MathExample]:
  """Loads a math prompt set.

  Args:
    source: a hub id (``"knoveleng/open-rs"``, ``"BytedTsinghua-SIA/DAPO-Math-17k"``,
      ``"openai/gsm8k"`` with ``name="main"``, ``"HuggingFaceH4/MATH-500"``)
      or a local path: ``.jsonl``/``.json``/``.parquet``/``.csv`` file, a ``save_to_disk`` directory,
      or a directory of data files.
    split: split of a hub dataset or ``DatasetDict`` (local files are one split).
    mapping: None/"auto" (detect a built-in layout), a name in :data:`MAPPINGS`, a
      ``{"prompt": col, "answer": col}`` dict, or a :class:`ColumnMapping`.
    limit: keep the first ``limit`` rows (None: all), before rows without an answer are skipped.
    name: the hub dataset's configuration (``"main"`` for ``openai/gsm8k``).
    missing_answers: ``"skip"`` rows without an answer with one warning, or ``"raise"`` (see
      :func:`examples_from_rows`).

  Raises ValueError naming the file (and the line of a malformed JSON line) when the source is
  missing, empty, unreadable or not a dataset; a path that does not exist is never sent to the hub.
  """
  if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
    raise ValueError(f"`limit` must be None or an int >= 1; got {limit!r}")
  rows = _load_rows(source, split, name, limit)
  return _examples(rows, mapping, missing_answers, os.fspath(source))


def build_messages(prompt: str | list[dict], instruction: str | None = INSTRUCTION) -> list[dict]:
  """Chat messages for a prompt: a string becomes one user turn; ``instruction`` (None: none) is
  appended to the last user turn, separated by a blank line, unless that turn already contains it."""
  if isinstance(prompt, str):
    messages = [{"role": "user", "content": prompt}]
  else:
    messages = [dict(m) for m in prompt]
    if not messages or not all("role" in m and "content" in m for m in messages):
      raise ValueError(f"`prompt`: a chat prompt must be a non-empty list of {{role, content}} dicts; got {prompt!r}")
  if instruction:
    for m in reversed(messages):
      if m["role"] == "user":
        if instruction not in m["content"]:
          m["content"] = f"{m['content']}\n\n{instruction}" if m["content"] else instruction
        break
    else:
      messages.append({"role": "user", "content": instruction})
  return messages


@dataclasses.dataclass(frozen=True)
class EncodedPrompts:
  """Templated prompts: ``tokens[i]`` (list of ids) and ``texts[i]`` for ``examples[kept[i]]``, rendered from the
  chat ``messages[i]`` (instruction included; what a reward model with its own template should render);
  ``num_dropped`` prompts were longer than the limit."""

  tokens: list[list[int]]
  texts: list[str]
  kept: list[int]
  num_dropped: int
  messages: list[list[dict]] | None = None


def encode_prompts(
  tokenizer,
  examples: Sequence[MathExample],
  *,
  max_prompt_tokens: int,
  instruction: str | None = INSTRUCTION,
  chat_template: bool = True,
) -> EncodedPrompts:
  """Applies the tokenizer's chat template (with the generation prompt) and tokenizes.

  Prompts longer than ``max_prompt_tokens`` are dropped — never truncated — with one warning giving
  the count. Raises ValueError when every prompt is dropped.
  """
  if max_prompt_tokens < 1:
    raise ValueError(f"`max_prompt_tokens` must be >= 1; got {max_prompt_tokens}")
  tokens, texts, kept, conversations = [], [], [], []
  for i, ex in enumerate(examples):
    messages = build_messages(ex.prompt, instruction)
    if chat_template:
      text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
      text = "\n\n".join(m["content"] for m in messages)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > max_prompt_tokens:
      continue
    tokens.append(list(ids))
    texts.append(text)
    kept.append(i)
    conversations.append(messages)
  dropped = len(examples) - len(kept)
  if dropped:
    warnings.warn(
      f"dropped {dropped} of {len(examples)} prompts longer than max_prompt_tokens="
      f"{max_prompt_tokens} (never truncated)",
      stacklevel=2,
    )
  if not kept:
    raise ValueError(f"every prompt is longer than max_prompt_tokens={max_prompt_tokens}")
  return EncodedPrompts(tokens=tokens, texts=texts, kept=kept, num_dropped=dropped, messages=conversations)


def pad_left(token_lists: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads to a fixed ``length`` (static shapes: one compilation) → ``(int32[B, P], bool[B, P])``."""
  too_long = [len(t) for t in token_lists if len(t) > length]
  if too_long:
    raise ValueError(f"`length`={length} is shorter than a prompt of {max(too_long)} tokens")
  tokens = np.full((len(token_lists), length), pad_id, np.int32)
  mask = np.zeros((len(token_lists), length), bool)
  for i, t in enumerate(token_lists):
    if len(t):
      tokens[i, length - len(t) :] = t
      mask[i, length - len(t) :] = True
  return tokens, mask


class PromptIterator:
  """Deterministic epochs of shuffled prompt indices; its position is part of the trainer state.

  Epoch e is ``np.random.default_rng([seed, e]).permutation(num_prompts)``; ``next(n)`` returns the
  next n indices, crossing epoch boundaries. ``state()`` → ``{"epoch", "offset", "seed",
  "num_prompts"}`` (JSON-able); ``restore(state)`` continues exactly where that state was.
  """

  def __init__(self, num_prompts: int, *, seed: int = 0, shuffle: bool = True):
    if num_prompts < 1:
      raise ValueError(f"`num_prompts` must be >= 1; got {num_prompts}")
    self.num_prompts, self.seed, self.shuffle = int(num_prompts), int(seed), bool(shuffle)
    self.epoch, self.offset = 0, 0
    self._order = self._permutation(0)

  def _permutation(self, epoch: int) -> np.ndarray:
    if not self.shuffle:
      return np.arange(self.num_prompts)
    return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)

  def next(self, n: int) -> np.ndarray:
    """The next ``n`` prompt indices (int64[n])."""
    out = []
    while n > 0:
      take = min(n, self.num_prompts - self.offset)
      out.append(self._order[self.offset : self.offset + take])
      self.offset += take
      n -= take
      if self.offset == self.num_prompts:
        self.epoch, self.offset = self.epoch + 1, 0
        self._order = self._permutation(self.epoch)
    return np.concatenate(out) if out else np.zeros(0, np.int64)

  def state(self) -> dict:
    return {
      "epoch": self.epoch,
      "offset": self.offset,
      "seed": self.seed,
      "num_prompts": self.num_prompts,
      "shuffle": self.shuffle,
    }

  def restore(self, state: Mapping[str, Any]) -> "PromptIterator":
    if state["num_prompts"] != self.num_prompts or state["seed"] != self.seed:
      raise ValueError(
        f"`state` is for {state['num_prompts']} prompts / seed {state['seed']}; this "
        f"iterator has {self.num_prompts} / {self.seed}"
      )
    self.shuffle = bool(state.get("shuffle", True))
    self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
    self._order = self._permutation(self.epoch)
    return self


def host_slice(items: Sequence | np.ndarray, process_index: int, process_count: int):
  """The contiguous part of a global batch that host ``process_index`` of ``process_count`` handles.

  Every host draws the same global batch from the same iterator state; host p keeps rows
  ``[p·n/count, (p+1)·n/count)``. The global batch size must divide evenly.
  """
  n = len(items)
  if not 0 <= process_index < process_count:
    raise ValueError(f"`process_index` must be in [0, {process_count}); got {process_index}")
  if n % process_count:
    raise ValueError(f"global batch of {n} prompts does not divide over {process_count} hosts")
  per = n // process_count
  return items[process_index * per : (process_index + 1) * per]


def write_jsonl(path: str, rows: Sequence[Mapping[str, Any]]) -> None:
  """Writes rows as JSON lines (fixtures, exported sets)."""
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
