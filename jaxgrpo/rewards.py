"""Verifiable rewards for math: answer extraction, verification with a hard timeout, combination.

A reward function is a plain callable::

    fn(prompts: list[str], completions: list[str], **columns) -> list[float]

where ``columns`` holds every dataset column for the same rows (e.g. ``answer=[...]``). Functions
are combined with weights by :class:`RewardSet`, which logs each one separately and never turns an
error into a silent 0: an exception stops the run with the offending sample shown
(``on_error="raise"``, default) or, if configured (``on_error="zero"``), scores that sample 0 and
counts it in the metrics.

Math accuracy (:class:`MathAccuracy`) takes the *last* ``\\boxed{...}`` of the completion (nested
braces allowed) and compares it with the ground truth using ``math-verify`` when installed (the
``math`` extra) or the built-in normaliser (:func:`answers_match`: integers, decimals, fractions,
``\\frac``/``\\dfrac``, simple LaTeX). Verification runs in a separate worker process
(:class:`TimeoutPool`): one that hangs is killed after ``timeout_s``, scored 0 and counted.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import multiprocessing
import re
from fractions import Fraction
from typing import Any, Callable, Mapping, Sequence

import numpy as np

__all__ = [
  "extract_boxed",
  "normalize_answer",
  "parse_number",
  "answers_match",
  "math_verify_available",
  "math_verify_match",
  "TimeoutPool",
  "MathAccuracy",
  "format_reward",
  "RewardSet",
  "RewardError",
  "RewardResult",
  "group_is_informative",
]


# ----------------------------------------------------------------------------- extraction
def extract_boxed(text: str) -> str | None:
  """Content of the last outermost ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces
  balanced; a box whose whole content is another box is unwrapped. None when there is no complete box.

  ``"\\boxed{\\frac{1}{2}}"`` → ``"\\frac{1}{2}"``; ``"\\boxed{\\boxed{7}}"`` → ``"7"``;
  ``"\\boxed 5"`` → ``"5"`` (the brace-less form, up to whitespace or ``$``).
  """
  best, pos = None, 0
  pattern = re.compile(r"\\(?:boxed|fbox)\s*")
  while (m := pattern.search(text, pos)) is not None:
    i, pos = m.end(), m.end()
    if i < len(text) and text[i] == "{":
      depth, j = 0, i
      while j < len(text):
        if text[j] == "{":
          depth += 1
        elif text[j] == "}":
          depth -= 1
          if depth == 0:
            break
        j += 1
      if depth == 0 and j < len(text):
        best, pos = text[i + 1 : j], j + 1
    elif m.group(0).endswith(" ") and i < len(text):
      tail = re.match(r"[^\s$]+", text[i:])
      if tail:
        best = tail.group(0)
  if best is not None and (inner := re.fullmatch(r"\s*\\(?:boxed|fbox)\s*\{.*\}\s*", best, re.S)):
    unwrapped = extract_boxed(inner.group(0))
    if unwrapped is not None:
      best = unwrapped
  return best


# ----------------------------------------------------------------------------- built-in normaliser
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\[dt]?frac(\d)(\d)")


def normalize_answer(s: str) -> str:
  """A canonical string for simple answers: strips ``$``, spaces, ``\\left``/``\\right``, ``\\!``,
  ``\\text{}`` wrappers, degrees and percent signs, a leading ``x =``, trailing dots, thousands
  separators; ``\\dfrac``/``\\tfrac`` → ``\\frac``; ``\\frac12`` → ``\\frac{1}{2}``."""
  s = str(s).strip()
  s = s.replace("$", "").replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", "")
  s = s.replace("\\left", "").replace("\\right", "").replace("\\displaystyle", "")
  s = _TEXT.sub(r"\1", s)
  s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\%", "").replace("%", "")
  s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
  s = re.sub(r"\s+", "", s)
  s = re.sub(r"^[a-zA-Z]\s*=", "", s)
  if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
    s = s.replace(",", "")
  s = s.rstrip(".")
  if len(s) >= 2 and s[0] == "{" and s[-1] == "}":
    s = s[1:-1]
  return s


def parse_number(s: str) -> Fraction | None:
  """Exact value of a normalised numeric answer: ``"12"``, ``"-0.5"``, ``"3/4"``, ``"\\frac{3}{4}"``,
  ``"-\\frac{1}{2}"``, ``"2\\frac{1}{2}"`` (mixed number); None when not a plain number."""
  s = normalize_answer(s)
  num = r"-?\d+(?:\.\d+)?"
  if re.fullmatch(num, s):
    return Fraction(s)
  m = re.fullmatch(rf"({num})/({num})", s)
  if m:
    den = Fraction(m.group(2))
    return Fraction(m.group(1)) / den if den else None
  m = re.fullmatch(r"(-?)(\d*)\\frac\{(" + num + r")\}\{(" + num + r")\}", s)
  if m:
    den = Fraction(m.group(4))
    if not den:
      return None
    value = Fraction(m.group(3)) / den + (int(m.group(2)) if m.group(2) else 0)
    return -value if m.group(1) else value
  return None


def answers_match(pred: str | None, gold: str) -> bool:
  """Built-in verifier: equal numbers (exactly, after parsing decimals and fractions) or equal
  normalised strings. A missing prediction (None) never matches."""
  if pred is None:
    return False
  a, b = parse_number(pred), parse_number(gold)
  if a is not None and b is not None:
    return a == b
  return normalize_answer(pred) == normalize_answer(gold) != ""


def math_verify_available() -> bool:
  try:
    import math_verify  # noqa: F401

    return True
  except ImportError:
    return False


def math_verify_match(pred: str | None, gold: str) -> bool:
  """``math_verify.verify(parse(gold), parse(pred))`` on boxed strings (the ``math`` extra)."""
  if pred is None:
    return False
  try:
    from math_verify import parse, verify
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("math-verify is not installed: pip install 'jaxgrpo[math]'") from e
  return bool(verify(parse(f"$\\boxed{{{gold}}}$"), parse(f"$\\boxed{{{pred}}}$")))


# ----------------------------------------------------------------------------- hard timeouts
def _worker_main(conn) -> None:
  conn.send(("ready", None))
  while True:
    msg = conn.recv()
    if msg is None:
      return
    fn, items = msg
    for args in items:
      try:
        out = ("ok", fn(*args))
      except Exception as e:  # reported to the parent, which decides
        out = ("error", f"{type(e).__name__}: {e}")
      conn.send(out)


class TimeoutPool:
  """Runs a function over items in one worker process and *kills* it when an item takes longer
  than ``timeout_s`` (a thread cannot be stopped; a process can). The worker is started with the
  ``spawn`` method (safe after JAX has started threads) and restarted after a kill.

  ``map(fn, items)`` → one ``(status, value)`` per item, status ``"ok"``, ``"error"`` (the message
  as value) or ``"timeout"``. ``fn`` must be importable by name (a module-level function).
  """

  def __init__(self, timeout_s: float, *, startup_timeout_s: float = 120.0):
    if not timeout_s > 0:
      raise ValueError(f"`timeout_s` must be > 0; got {timeout_s}")
    self.timeout_s, self.startup_timeout_s = float(timeout_s), float(startup_timeout_s)
    self._proc = self._conn = None
    atexit.register(self.close)

  def _start(self):
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker_main, args=(child,), daemon=True)
    proc.start()
    child.close()
    if not parent.poll(self.startup_timeout_s):
      proc.kill()
      raise RuntimeError(f"verifier worker did not start within {self.startup_timeout_s} s")
    parent.recv()
    self._proc, self._conn = proc, parent

  def _kill(self):
    if self._proc is not None:
      self._proc.kill()
      self._proc.join()
      self._conn.close()
    self._proc = self._conn = None

  def map(self, fn: Callable, items: Sequence[tuple]) -> list[tuple[str, Any]]:
    results: list[tuple[str, Any]] = []
    pending = list(items)
    while pending:
      if self._proc is None or not self._proc.is_alive():
        self._start()
      self._conn.send((fn, pending))
      for k in range(len(pending)):
        if self._conn.poll(self.timeout_s):
          results.append(self._conn.recv())
        else:
          self._kill()
          results.append(("timeout", None))
          pending = pending[k + 1 :]
          break
      else:
        pending = []
    return results

  def close(self):
    if self._proc is not None and self._proc.is_alive():
      try:
        self._conn.send(None)
        self._proc.join(timeout=2)
      except (BrokenPipeError, OSError):
        pass
    self._kill()


# ----------------------------------------------------------------------------- reward functions
class CountingReward:
  """Base of reward functions that keep counters (timeouts, verifier errors) for the metrics;
  ``pop_counters()`` returns and resets them."""

  def __init__(self):
    self._counters: dict[str, int] = {}

  def _count(self, key: str, n: int = 1):
    self._counters[key] = self._counters.get(key, 0) + n

  def pop_counters(self) -> dict[str, int]:
    out, self._counters = self._counters, {}
    return out


class MathAccuracy(CountingReward):
  """1.0 when the last ``\\boxed{}`` of a completion equals the ground truth, else 0.0.

  Args:
    backend: ``"auto"`` (math-verify when installed, else built-in), ``"math_verify"``, ``"builtin"``,
      or a module-level callable ``(pred: str | None, gold: str) -> bool``.
    timeout_s: per-sample limit; verification runs in a worker process that is killed at the limit
      (the sample scores 0, counted as ``timeouts``). None: verify in this process, no limit.
    answer_column: the column holding the ground truth.

  Counters: ``timeouts``, ``verifier_errors`` (an exception inside the verifier: scored 0, counted).
  """

  __name__ = "accuracy"

  def __init__(
    self, *, backend: str | Callable = "auto", timeout_s: float | None = 10.0, answer_column: str = "answer"
  ):
    super().__init__()
    if callable(backend):
      self.verify = backend
    elif backend == "auto":
      self.verify = math_verify_match if math_verify_available() else answers_match
    elif backend == "math_verify":
      if not math_verify_available():
        raise ImportError("`backend`='math_verify' needs math-verify: pip install 'jaxgrpo[math]'")
      self.verify = math_verify_match
    elif backend == "builtin":
      self.verify = answers_match
    else:
      raise ValueError(f"`backend` must be 'auto', 'math_verify', 'builtin' or a callable; got {backend!r}")
    self.answer_column = answer_column
    self._pool = TimeoutPool(timeout_s) if timeout_s is not None else None

  def __call__(self, prompts, completions, **columns) -> list[float]:
    if self.answer_column not in columns:
      raise ValueError(f"MathAccuracy needs the column {self.answer_column!r}; got columns {sorted(columns)}")
    golds = columns[self.answer_column]
    items = [(extract_boxed(c), str(g)) for c, g in zip(completions, golds)]
    if self._pool is None:
      outs = []
      for a in items:
        try:
          outs.append(("ok", self.verify(*a)))
        except Exception as e:
          outs.append(("error", f"{type(e).__name__}: {e}"))
    else:
      todo = [i for i, a in enumerate(items) if a[0] is not None]  # no box: 0 without a call
      res = self._pool.map(self.verify, [items[i] for i in todo])
      outs = [("ok", False)] * len(items)
      for i, r in zip(todo, res):
        outs[i] = r
    scores = []
    for status, value in outs:
      if status == "timeout":
        self._count("timeouts")
      elif status == "error":
        self._count("verifier_errors")
      scores.append(1.0 if status == "ok" and value else 0.0)
    return scores

  def close(self):
    if self._pool is not None:
      self._pool.close()


def format_reward(prompts, completions, **columns) -> list[float]:
  """1.0 when the completion contains a complete, non-empty ``\\boxed{...}``, else 0.0."""
  return [1.0 if (b := extract_boxed(c)) is not None and b.strip() else 0.0 for c in completions]


class RewardError(RuntimeError):
  """A reward function raised or returned a bad value; the message shows the offending sample."""


@dataclasses.dataclass
class RewardResult:
  """``total`` f32[B] (weighted sum), ``per_fn`` name → f32[B] (unweighted), ``counters``
  (errors scored 0, timeouts, ...) summed over the functions, keyed ``"<name>/<counter>"``."""

  total: np.ndarray
  per_fn: dict[str, np.ndarray]
  counters: dict[str, int]


def _show(x: Any, limit: int = 400) -> str:
  s = repr(x)
  return s if len(s) <= limit else s[:limit] + f"... ({len(s)} chars)"


class RewardSet:
  """Weighted sum of reward functions, each logged separately.

  Args:
    fns: callables, ``(callable, weight)`` pairs or ``{"name": (callable, weight)}``; names default
      to ``fn.__name__``.
    on_error: ``"raise"`` (default): an exception or a non-finite/missing value stops the run with
      the offending sample (prompt, completion, columns) in a :class:`RewardError`; ``"zero"``: such
      samples score 0 for that function and are counted (``"<name>/errors"``).
  """

  def __init__(self, fns, *, on_error: str = "raise"):
    if on_error not in ("raise", "zero"):
      raise ValueError(f"`on_error` must be 'raise' or 'zero'; got {on_error!r}")
    items = (
      list(fns.items())
      if isinstance(fns, Mapping)
      else [(getattr(f[0] if isinstance(f, tuple) else f, "__name__", f"reward{i}"), f) for i, f in enumerate(fns)]
    )
    self.fns: list[tuple[str, Callable, float]] = []
    for name, f in items:
      fn, w = f if isinstance(f, tuple) else (f, 1.0)
      if not callable(fn):
        raise TypeError(f"`fns`: reward {name!r} is not callable: {fn!r}")
      if name in [n for n, _, _ in self.fns]:
        raise ValueError(f"`fns`: two reward functions named {name!r}; pass a dict with distinct names")
      self.fns.append((name, fn, float(w)))
    if not self.fns:
      raise ValueError("`fns` must hold at least one reward function")
    self.on_error = on_error

  def _fail(self, name, i, prompts, completions, columns, why):
    sample = {k: v[i] for k, v in columns.items()}
    raise RewardError(
      f"reward function {name!r} failed on sample {i}: {why}\n  prompt: {_show(prompts[i])}\n"
      f"  completion: {_show(completions[i])}\n  columns: {_show(sample)}"
    )

  def _one(self, name, fn, prompts, completions, columns, counters):
    n = len(completions)
    try:
      out = fn(prompts, completions, **columns)
      vals = [float(v) for v in out]
      if len(vals) != n:
        raise RewardError(f"reward function {name!r} returned {len(vals)} values for {n} completions")
      bad = [i for i, v in enumerate(vals) if not math.isfinite(v)]
    except RewardError:
      raise
    except Exception:
      # find the offending samples one by one
      vals, bad = [], []
      for i in range(n):
        try:
          v = [float(x) for x in fn([prompts[i]], [completions[i]], **{k: [c[i]] for k, c in columns.items()})]
          if len(v) != 1 or not math.isfinite(v[0]):
            raise ValueError(f"returned {v!r}")
          vals.append(v[0])
        except Exception as e:
          if self.on_error == "raise":
            self._fail(name, i, prompts, completions, columns, f"{type(e).__name__}: {e}")
          vals.append(0.0)
          bad.append(i)
      if not bad:  # failed only as a batch: cannot attribute it to one sample
        raise
      counters[f"{name}/errors"] = counters.get(f"{name}/errors", 0) + len(bad)
      return np.asarray(vals, np.float32)
    if bad:
      if self.on_error == "raise":
        self._fail(name, bad[0], prompts, completions, columns, f"non-finite reward {vals[bad[0]]}")
      counters[f"{name}/errors"] = counters.get(f"{name}/errors", 0) + len(bad)
      vals = [0.0 if i in set(bad) else v for i, v in enumerate(vals)]
    return np.asarray(vals, np.float32)

  def __call__(
    self, prompts: Sequence[str], completions: Sequence[str], columns: Mapping[str, Sequence] | None = None
  ) -> RewardResult:
    columns = dict(columns or {})
    n = len(completions)
    if len(prompts) != n or any(len(v) != n for v in columns.values()):
      raise ValueError(
        f"`prompts`, `completions` and every column need {n} rows; got prompts "
        f"{len(prompts)}, columns {{{', '.join(f'{k}: {len(v)}' for k, v in columns.items())}}}"
      )
    counters: dict[str, int] = {}
    per_fn, total = {}, np.zeros(n, np.float32)
    for name, fn, w in self.fns:
      vals = self._one(name, fn, list(prompts), list(completions), columns, counters)
      if isinstance(fn, CountingReward):
        for k, v in fn.pop_counters().items():
          counters[f"{name}/{k}"] = counters.get(f"{name}/{k}", 0) + v
      per_fn[name] = vals
      total += w * vals
    return RewardResult(total=total, per_fn=per_fn, counters=counters)


def group_is_informative(rewards, group_ids, num_groups: int) -> np.ndarray:
  """DAPO dynamic sampling: ``bool[num_groups]``, True where a group's rewards are not all equal
  (groups with no members are False)."""
  rewards, group_ids = np.asarray(rewards, np.float64), np.asarray(group_ids)
  lo = np.full(num_groups, np.inf)
  hi = np.full(num_groups, -np.inf)
  np.minimum.at(lo, group_ids, rewards)
  np.maximum.at(hi, group_ids, rewards)
  return hi > lo
