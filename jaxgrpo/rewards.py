"""Verifiable rewards for math: answer extraction, verification with a hard timeout, combination.

A reward function is a plain callable::

    fn(prompts: list[str], completions: list[str], **columns) -> list[float]

where ``columns`` holds every dataset column for the same rows (e.g. ``answer=[...]``). Functions
are combined with weights by :class:`RewardSet`, which logs each one separately.

Error contract (one rule for every reward function, :class:`MathAccuracy` included):

- A reward function reports a sample it cannot score by raising. :class:`RewardSet` decides what
  happens: ``on_error="raise"`` (default) stops the run with a :class:`RewardError` that shows the
  offending sample (prompt, completion, columns, the error); ``on_error="zero"`` scores that sample
  0 for that function and counts it (``"<name>/errors"``). Non-finite values are errors too.
- A function that scores a batch but fails on some samples raises :class:`SampleErrors` *after*
  scoring the rest (the good scores are kept, the failed samples named). :class:`MathAccuracy`
  does this for a verifier exception and for a missing ground truth (None, NaN, empty).
- A verifier *timeout* is not an error: the sample scores 0 and is counted (``"<name>/timeouts"``)
  whatever ``on_error`` says. It is a property of the completion (sympy spends minutes on
  ``\\boxed{2^{10^{10}}}``); stopping the run over it would let one completion end training.
- Used on its own (evaluation), ``MathAccuracy(on_error="zero")`` scores verifier errors 0 and
  counts them itself (``verifier_errors``, ``missing_answers``).

Math accuracy (:class:`MathAccuracy`) takes the *last* outermost ``\\boxed{...}`` of the completion
(:func:`extract_boxed`: one linear pass over at most the last :data:`BOXED_SEARCH_CHARS`
characters), maps common Unicode look-alikes to ASCII (:func:`normalize_unicode`) and compares it
with the ground truth using ``math-verify`` when installed (the ``math`` extra; its own
signal-based timeouts are switched off) or the built-in normaliser (:func:`answers_match`:
integers, decimals, fractions, ``\\frac``/``\\dfrac``, simple LaTeX). Verification runs in a
separate worker process (:class:`TimeoutPool`): one that hangs is killed after ``timeout_s``, scored
0 and counted. The worker exits when its parent dies, however the parent dies.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import itertools
import logging
import math
import multiprocessing
import os
import pickle
import re
import signal
import sys
import threading
import time
from fractions import Fraction
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jaxgrpo import _checks

__all__ = [
  "BOXED_SEARCH_CHARS",
  "extract_boxed",
  "normalize_unicode",
  "normalize_answer",
  "parse_number",
  "answers_match",
  "math_verify_available",
  "math_verify_match",
  "TimeoutPool",
  "CountingReward",
  "MathAccuracy",
  "format_reward",
  "RewardSet",
  "RewardError",
  "SampleErrors",
  "RewardResult",
  "group_is_informative",
  "overlong_penalty",
]


# ----------------------------------------------------------------------------- extraction
#: :func:`extract_boxed` looks at most at the last this many characters of a completion (about
#: 25k tokens; the answer box is at the end). Longer completions are cut from the front first.
BOXED_SEARCH_CHARS = 100_000

_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_BARE = re.compile(r"[^\s$]+")
_BRACE = re.compile(r"[{}]")


def _brace_partners(text: str) -> dict[int, int]:
  """``{i: j}`` for every ``{`` at i closed by the ``}`` at j (one stack pass; a ``}`` with no
  open brace is ignored). Equal to scanning forward from i until the depth returns to 0."""
  stack: list[int] = []
  partner: dict[int, int] = {}
  for m in _BRACE.finditer(text):
    i = m.start()
    if text[i] == "{":
      stack.append(i)
    elif stack:
      partner[stack.pop()] = i
  return partner


def _unwrap(text: str, a: int, b: int, partner: dict[int, int]) -> tuple[int, int]:
  """While ``text[a:b]`` is exactly one complete box (up to surrounding whitespace), step into it."""
  while True:
    s, e = a, b
    while s < e and text[s].isspace():
      s += 1
    while e > s and text[e - 1].isspace():
      e -= 1
    m = _BOX.match(text, s, e)
    if m is None or m.end() >= e or text[m.end()] != "{" or partner.get(m.end()) != e - 1:
      return a, b
    a, b = m.end() + 1, e - 1


def extract_boxed(text: str, *, max_chars: int | None = BOXED_SEARCH_CHARS) -> str | None:
  """Content of the last outermost ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces
  balanced; a box whose whole content is exactly one other box is unwrapped. None when there is no
  complete box.

  ``"\\boxed{\\frac{1}{2}}"`` → ``"\\frac{1}{2}"``; ``"\\boxed{\\boxed{7}}"`` → ``"7"``;
  ``"\\boxed 5"`` → ``"5"`` (the brace-less form, up to whitespace or ``$``).

  Time is linear in the length: braces are matched in one stack pass, then each ``\\boxed`` is
  looked at once (the former forward scan per box was quadratic in runs of unclosed boxes).
  Only the last ``max_chars`` characters are searched (None: all); a box cut by that limit is not
  seen, though a complete box inside it may be.
  """
  if not isinstance(text, str):
    raise TypeError(f"`text` must be a str; got {type(text).__name__}")
  if max_chars is not None and len(text) > max_chars:
    text = text[len(text) - max_chars :]
  partner = _brace_partners(text)
  best, pos = None, 0
  for m in _BOX.finditer(text):
    if m.start() < pos:  # inside the box already taken: not outermost
      continue
    i = m.end()
    if i < len(text) and text[i] == "{":
      j = partner.get(i)
      if j is not None:
        best, pos = (i + 1, j), j + 1
    elif m.group(0).endswith(" ") and i < len(text):
      tail = _BARE.match(text, i)
      if tail:
        best = (i, tail.end())
  if best is None:
    return None
  a, b = _unwrap(text, *best, partner)
  return text[a:b]


# ----------------------------------------------------------------------------- built-in normaliser
#: Unicode look-alikes that models and datasets write in answers → their ASCII form: minus signs
#: and dashes used as minus (U+2212, U+2010-U+2013, U+FE63, U+FF0D), full-width digits and
#: ``+ . , / ( ) =`` (U+FF0B...U+FF1D), and non-breaking/thin/ideographic spaces. The em dash is
#: left alone (punctuation, not a sign); letters and superscripts are not touched.
_UNICODE_TABLE = str.maketrans(
  {
    **{c: "-" for c in "\u2212\u2010\u2011\u2012\u2013\ufe63\uff0d"},
    **{chr(0xFF10 + d): str(d) for d in range(10)},
    **dict(zip("\uff0b\uff0e\uff0c\uff0f\uff08\uff09\uff1d", "+.,/()=")),
    **{c: " " for c in "\u00a0\u2009\u202f\u3000"},
  }
)


def normalize_unicode(s: str) -> str:
  """Maps the Unicode look-alikes of :data:`_UNICODE_TABLE` to ASCII: ``"−5"`` (U+2212) →
  ``"-5"``, ``"–3"`` (en dash) → ``"-3"``, ``"１２"`` (full width) → ``"12"``."""
  return s.translate(_UNICODE_TABLE)


_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\[dt]?frac(\d)(\d)")


def normalize_answer(s: str) -> str:
  """A canonical string for simple answers: Unicode look-alikes → ASCII (:func:`normalize_unicode`);
  strips ``$``, spaces, ``\\left``/``\\right``, ``\\!``, ``\\text{}`` wrappers, degrees and percent
  signs, a leading ``x =``, trailing dots, thousands separators; ``\\dfrac``/``\\tfrac`` →
  ``\\frac``; ``\\frac12`` → ``\\frac{1}{2}``."""
  s = normalize_unicode(str(s)).strip()
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


def _check_gold(gold) -> None:
  if gold is None:
    raise ValueError("`gold` is None: a row without a ground truth must never be compared (it would match 'None')")


def answers_match(pred: str | None, gold: str) -> bool:
  """Built-in verifier: equal numbers (exactly, after parsing decimals and fractions) or equal
  normalised strings. A missing prediction (None) never matches; a missing ``gold`` raises."""
  _check_gold(gold)
  if pred is None:
    return False
  a, b = parse_number(pred), parse_number(gold)
  if a is not None and b is not None:
    return a == b
  return normalize_answer(pred) == normalize_answer(gold) != ""


def math_verify_available() -> bool:
  """True when the ``math-verify`` package (the ``math`` extra) can be imported."""
  try:
    import math_verify  # noqa: F401

    return True
  except ImportError:
    return False


class _DropTimeoutDisabledNotice(logging.Filter):
  """math-verify logs "Timeout is disabled ... you must provide the logic for timeout interruption
  yourself" once per process; :class:`TimeoutPool` is that logic, so the notice is noise."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Timeout is disabled")


_NOTICE_FILTER = _DropTimeoutDisabledNotice()


def math_verify_match(pred: str | None, gold: str) -> bool:
  """``math_verify.verify(parse(gold), parse(pred))`` on boxed strings (the ``math`` extra).

  math-verify's own timeouts (``signal.alarm``, 5 s by default, firing before ours and returning
  False uncounted) are switched off: the limit is :class:`TimeoutPool`'s, which kills the worker.
  Errors are raised (``raise_on_error=True``), not turned into False: the pair of parsed forms
  (math-verify parses each side to a sympy object and its string) that matches wins; when none
  matches and one comparison raised, that exception is raised. A math-verify timeout, should one
  still fire, is raised as :class:`TimeoutError`.
  """
  _check_gold(gold)
  if pred is None:
    return False
  try:
    import math_verify
    from math_verify.errors import TimeoutException
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("math-verify is not installed: pip install 'jaxgrpo[math]'") from e
  for name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(name).addFilter(_NOTICE_FILTER)  # idempotent
  error = None
  try:
    golds = math_verify.parse(f"$\\boxed{{{gold}}}$", parsing_timeout=None, raise_on_error=True)
    preds = math_verify.parse(f"$\\boxed{{{pred}}}$", parsing_timeout=None, raise_on_error=True)
    for g, p in itertools.product(golds, preds):
      try:
        if math_verify.verify(g, p, timeout_seconds=None, raise_on_error=True):
          return True
      except Exception as e:
        if error is None:
          error = e
  except TimeoutException as e:
    raise TimeoutError(f"math-verify timed out: {e}") from None
  if error is not None:
    raise error
  return False


# ----------------------------------------------------------------------------- hard timeouts
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _watch_parent(parent_pid: int) -> None:
  while os.getppid() == parent_pid:
    time.sleep(0.5)
  os._exit(1)


def _die_with_parent(parent_pid: int) -> None:
  """Makes this worker exit when the process that started it dies (SIGKILL, SIGTERM, a crash).

  On Linux the kernel sends SIGKILL (``PR_SET_PDEATHSIG``), which works even while a verifier holds
  the GIL inside C code; a thread that polls the parent id covers other platforms. Ctrl-C (SIGINT
  to the whole process group) is left to the parent, which stops the worker itself."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  if os.getppid() != parent_pid:  # the parent died before the line above
    os._exit(1)
  threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="watch-parent").start()


def _call(fn: Callable, args: tuple) -> tuple[str, Any]:
  try:
    return ("ok", fn(*args))
  except TimeoutError as e:  # the verifier's own limit: a timeout, not an error
    return ("timeout", f"{e}")
  except Exception as e:  # reported to the parent, which decides
    return ("error", f"{type(e).__name__}: {e}")


def _worker_main(conn, parent_pid: int) -> None:
  """The verifier process: ``("fn", pickled (fn, warmup))`` loads a function (importing its module)
  and answers after the warm-up call; ``("items", [args, ...])`` answers one result per item;
  None or a closed pipe ends it."""
  _die_with_parent(parent_pid)
  fn = None
  try:
    conn.send(("ready", None))
    while (msg := conn.recv()) is not None:
      kind, payload = msg
      if kind == "fn":
        try:
          fn, warmup = pickle.loads(payload)
        except Exception as e:
          conn.send(("error", f"cannot load the function here: {type(e).__name__}: {e}"))
          continue
        conn.send(("ok", None) if warmup is None else _call(fn, warmup))
      else:
        for args in payload:
          conn.send(_call(fn, args))
  except (EOFError, OSError):  # the parent closed the pipe (or died): nothing left to do
    return


class TimeoutPool:
  """Runs a function over items in one worker process and *kills* it when an item takes longer
  than ``timeout_s`` (a thread cannot be stopped; a process can). The worker is started with the
  ``spawn`` method (safe after JAX has started threads) and restarted after a kill.

  ``map(fn, items)`` → one ``(status, value)`` per item, status ``"ok"``, ``"error"`` (the message
  as value; also when the worker dies on an item, e.g. killed by the OOM killer) or ``"timeout"``
  (killed at the limit, or ``fn`` raised :class:`TimeoutError`). ``fn`` must be importable by name
  (a module-level function); anything else is a TypeError.

  Start-up, importing ``fn``'s module and one ``fn(*warmup)`` call (when ``warmup`` is given; e.g.
  math-verify imports sympy on its first call) run under ``startup_timeout_s``, so they do not eat
  into the first item's ``timeout_s``; a failure there is a RuntimeError.

  The worker exits with its parent: SIGKILL/SIGTERM of the trainer leaves no verifier behind (on
  Linux through ``PR_SET_PDEATHSIG``, which fires when the *thread* that started the worker ends:
  use a pool from a long-lived thread). It ignores SIGINT; :meth:`close` (also run at exit) stops it.
  """

  def __init__(self, timeout_s: float, *, startup_timeout_s: float = 120.0, warmup: tuple | None = None):
    for name, value in (("timeout_s", timeout_s), ("startup_timeout_s", startup_timeout_s)):
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a number of seconds; got {type(value).__name__}")
      if not 0 < value < math.inf:
        raise ValueError(f"`{name}` must be > 0 and finite; got {value}")
    self.timeout_s, self.startup_timeout_s = float(timeout_s), float(startup_timeout_s)
    self.warmup = None if warmup is None else tuple(warmup)
    self._proc = self._conn = self._loaded = None

  def _start(self):
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker_main, args=(child, os.getpid()), daemon=True, name="jaxgrpo-verifier")
    proc.start()
    child.close()
    self._proc, self._conn = proc, parent
    atexit.register(self.close)
    self._reply_within(self.startup_timeout_s, "starting")

  def _reply_within(self, seconds: float, doing: str) -> tuple[str, Any]:
    """The worker's next reply while ``doing`` something that must not fail (start-up, loading)."""
    try:
      reply = self._conn.recv() if self._conn.poll(seconds) else ("error", f"no answer within {seconds} s")
    except (EOFError, OSError):
      self._proc.join(timeout=5)
      reply = ("error", f"it exited (code {self._proc.exitcode}; see its error above)")
    if reply[0] not in ("ok", "ready"):
      self._kill()
      raise RuntimeError(f"verifier worker failed while {doing}: {reply[1]}")
    return reply

  def _load(self, fn: Callable) -> None:
    try:
      blob = pickle.dumps((fn, self.warmup))
    except Exception as e:
      raise TypeError(f"`fn` must be a module-level function (it is sent to a worker process); {fn!r}: {e}") from None
    self._conn.send(("fn", blob))
    self._reply_within(self.startup_timeout_s, f"loading {getattr(fn, '__qualname__', fn)!r} and its warm-up call")
    self._loaded = fn

  def _kill(self):
    if self._proc is not None:
      self._proc.kill()
      self._proc.join()
      self._conn.close()
    self._proc = self._conn = self._loaded = None

  def map(self, fn: Callable, items: Sequence[tuple]) -> list[tuple[str, Any]]:
    """``fn(*item)`` for each item in the worker → ``[(status, value)]`` in order (see the class)."""
    results: list[tuple[str, Any]] = []
    pending = list(items)
    while pending:
      if self._proc is None or not self._proc.is_alive():
        self._kill()
        self._start()
      try:
        if self._loaded is not fn:
          self._load(fn)
        self._conn.send(("items", pending))
      except (BrokenPipeError, ConnectionError):  # died between calls: start a fresh one
        self._kill()
        continue
      done = 0
      while done < len(pending):
        if not self._conn.poll(self.timeout_s):
          self._kill()
          results.append(("timeout", None))
          done += 1
          break
        try:
          results.append(self._conn.recv())
          done += 1
        except (EOFError, OSError):
          self._proc.join(timeout=5)
          code = self._proc.exitcode
          self._kill()
          results.append(("error", f"the verifier worker died on this item (exit code {code})"))
          done += 1
          break
      pending = pending[done:]
    return results

  def close(self):
    """Stops the worker (politely, then by force); a later :meth:`map` starts a new one."""
    atexit.unregister(self.close)
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
    if n:
      self._counters[key] = self._counters.get(key, 0) + n

  def pop_counters(self) -> dict[str, int]:
    """The counters since the last call (``{name: count}``, zero counts left out), then resets them."""
    out, self._counters = self._counters, {}
    return out


class RewardError(RuntimeError):
  """A reward function raised or returned a bad value; the message shows the offending sample."""


class SampleErrors(RewardError):
  """A reward function scored a batch but could not score some samples.

  Attributes:
    values: one float per sample of the batch, 0.0 where it failed.
    errors: ``{sample index: message}`` for the failed samples.

  :class:`RewardSet` turns it into a :class:`RewardError` showing the first failed sample
  (``on_error="raise"``) or keeps ``values`` and counts the failures (``on_error="zero"``).
  """

  def __init__(self, values: Sequence[float], errors: Mapping[int, str]):
    self.values = [float(v) for v in values]
    self.errors = dict(errors)
    if not self.errors or not all(0 <= i < len(self.values) for i in self.errors):
      raise ValueError(f"`errors` must name at least one sample in [0, {len(self.values)}); got {sorted(self.errors)}")
    first = min(self.errors)
    super().__init__(
      f"{len(self.errors)} of {len(self.values)} samples failed; first, sample {first}: {self.errors[first]}"
    )


def _missing(gold: Any) -> bool:
  return gold is None or (isinstance(gold, float) and math.isnan(gold)) or (isinstance(gold, str) and not gold.strip())


def _short(x: Any, limit: int = 200) -> str:
  s = repr(x)
  return s if len(s) <= limit else s[:limit] + f"... ({len(s)} chars)"


class MathAccuracy(CountingReward):
  """1.0 when the last ``\\boxed{}`` of a completion equals the ground truth, else 0.0.

  Args:
    backend: ``"auto"`` (math-verify when installed, else built-in), ``"math_verify"``, ``"builtin"``,
      or a module-level callable ``(pred: str | None, gold: str) -> bool`` (raise
      :class:`TimeoutError` to report a timeout of its own).
    timeout_s: per-sample limit; verification runs in a worker process that is killed at the limit
      (the sample scores 0, counted as ``timeouts``). None: verify in this process, no limit.
    answer_column: the column holding the ground truth.
    on_error: what a verifier exception or a missing ground truth (None, NaN, empty) does:
      ``"raise"`` (default): the batch is scored, then :class:`SampleErrors` names the failed
      samples (a :class:`RewardSet` applies its own ``on_error`` to them); ``"zero"``: they score
      0 and are counted (``verifier_errors``, ``missing_answers``).

  Prediction and ground truth go through :func:`normalize_unicode` before either backend sees them.
  Counters: ``timeouts`` (always), and under ``on_error="zero"`` ``verifier_errors`` and
  ``missing_answers``.
  """

  __name__ = "accuracy"

  def __init__(
    self,
    *,
    backend: str | Callable = "auto",
    timeout_s: float | None = 10.0,
    answer_column: str = "answer",
    on_error: str = "raise",
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
    if on_error not in ("raise", "zero"):
      raise ValueError(f"`on_error` must be 'raise' or 'zero'; got {on_error!r}")
    self.answer_column, self.on_error = answer_column, on_error
    # the warm-up imports the backend (sympy: seconds) before the first sample's clock starts
    self._pool = TimeoutPool(timeout_s, warmup=("1", "1")) if timeout_s is not None else None
    if self._pool is not None:
      try:
        pickle.dumps(self.verify)
      except Exception as e:
        raise TypeError(
          f"`backend` must be a module-level function when `timeout_s` is set (it runs in a worker "
          f"process); {backend!r} cannot be sent there: {e}"
        ) from None

  def _verify_here(self, items: list[tuple[str, str]]) -> list[tuple[str, Any]]:
    outs = []
    for a in items:
      try:
        outs.append(("ok", self.verify(*a)))
      except TimeoutError as e:
        outs.append(("timeout", f"{e}"))
      except Exception as e:
        outs.append(("error", f"{type(e).__name__}: {e}"))
    return outs

  def __call__(self, prompts, completions, **columns) -> list[float]:
    if self.answer_column not in columns:
      raise ValueError(f"MathAccuracy needs the column {self.answer_column!r}; got columns {sorted(columns)}")
    golds = columns[self.answer_column]
    if len(golds) != len(completions):
      raise ValueError(f"{len(completions)} completions but {len(golds)} values in column {self.answer_column!r}")
    scores = [0.0] * len(completions)
    errors: dict[int, str] = {}
    todo, items, missing = [], [], 0
    for i, (c, g) in enumerate(zip(completions, golds)):
      if _missing(g):
        errors[i] = f"no ground truth ({self.answer_column}={g!r}); such rows must be dropped when loading"
        missing += 1
        continue
      pred = extract_boxed(c)
      if pred is not None:  # no box: 0 without a call
        todo.append(i)
        items.append((normalize_unicode(pred), normalize_unicode(str(g))))
    outs = self._verify_here(items) if self._pool is None else self._pool.map(self.verify, items)
    for i, (pred_gold, (status, value)) in zip(todo, zip(items, outs)):
      if status == "ok":
        scores[i] = 1.0 if value else 0.0
      elif status == "timeout":
        self._count("timeouts")
      else:
        errors[i] = f"verifier error {value} (prediction {_short(pred_gold[0])}, ground truth {_short(pred_gold[1])})"
    if errors and self.on_error == "raise":
      raise SampleErrors(scores, errors)
    if errors:
      self._count("missing_answers", missing)
      self._count("verifier_errors", len(errors) - missing)
    return scores

  def close(self):
    """Stops the verifier worker (a later call starts a new one)."""
    if self._pool is not None:
      self._pool.close()


def format_reward(prompts, completions, **columns) -> list[float]:
  """1.0 when the completion contains a complete, non-empty ``\\boxed{...}``, else 0.0."""
  return [1.0 if (b := extract_boxed(c)) is not None and b.strip() else 0.0 for c in completions]


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
    on_error: ``"raise"`` (default): an exception (or :class:`SampleErrors`) or a
      non-finite/missing value stops the run with the offending sample (prompt, completion,
      columns) in a :class:`RewardError`; ``"zero"``: such samples score 0 for that function and
      are counted (``"<name>/errors"``). See the module docstring for timeouts.
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

  def _one_by_one(self, name, fn, prompts, completions, columns) -> tuple[list[float], dict[int, str]]:
    """After a batch call raised: each sample alone, to find (and show) the ones that fail."""
    vals, failed = [], {}
    for i in range(len(completions)):
      try:
        v = [float(x) for x in fn([prompts[i]], [completions[i]], **{k: [c[i]] for k, c in columns.items()})]
        if len(v) != 1:
          raise ValueError(f"returned {v!r} for one sample")
        vals.append(v[0])
      except Exception as e:
        why = e.errors[0] if isinstance(e, SampleErrors) and 0 in e.errors else f"{type(e).__name__}: {e}"
        if self.on_error == "raise":
          self._fail(name, i, prompts, completions, columns, why)
        vals.append(0.0)
        failed[i] = why
    return vals, failed

  def _one(self, name, fn, prompts, completions, columns, counters):
    n = len(completions)
    try:
      vals, failed = [float(v) for v in fn(prompts, completions, **columns)], {}
    except SampleErrors as e:
      vals, failed = e.values, dict(e.errors)
    except RewardError:
      raise
    except Exception:
      vals, failed = self._one_by_one(name, fn, prompts, completions, columns)
      if not failed:  # failed only as a batch: cannot attribute it to one sample
        raise
    if len(vals) != n:
      raise RewardError(f"reward function {name!r} returned {len(vals)} values for {n} completions")
    for i, v in enumerate(vals):
      if not math.isfinite(v) and i not in failed:
        failed[i] = f"non-finite reward {v}"
    if failed:
      if self.on_error == "raise":
        i = min(failed)
        more = f" ({len(failed)} of {n} samples failed)" if len(failed) > 1 else ""
        self._fail(name, i, prompts, completions, columns, failed[i] + more)
      counters[f"{name}/errors"] = counters.get(f"{name}/errors", 0) + len(failed)
      vals = [0.0 if i in failed else v for i, v in enumerate(vals)]
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
      try:
        vals = self._one(name, fn, list(prompts), list(completions), columns, counters)
      finally:
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


def overlong_penalty(lengths, max_length: int, cache_length: int, *, penalty_factor: float = 1.0) -> np.ndarray:
  """DAPO's soft overlong punishment of completion lengths (Yu et al., arXiv:2503.14476, eq. 13).

  With ``L_max = max_length``, ``L_cache = cache_length`` and the completion length ``|y|``::

      R(|y|) = 0                                   |y| <= L_max − L_cache
               ((L_max − L_cache) − |y|) / L_cache   L_max − L_cache < |y| <= L_max
               −1                                  |y| > L_max

  times ``penalty_factor`` (verl's ``overlong_buffer.penalty_factor``): a linear penalty over the last
  ``L_cache`` tokens before the budget, reaching −1 at ``L_max``. Add it to the task reward before
  the advantages, e.g. ``rewards + overlong_penalty(rollout.mask.sum(1), max_new_tokens, 512)``
  (a sampler capped at ``L_max`` never exceeds it: a truncated completion gets −1). Host side, NumPy.

  Args:
    lengths: ``int[N]`` completion lengths in tokens (e.g. ``mask.sum(1)``), any integer array-like.
    max_length: ``L_max`` >= 1, the completion budget.
    cache_length: ``L_cache`` in ``[0, L_max]``, the soft zone (0: no soft zone, −1 only beyond L_max).
    penalty_factor: finite scale >= 0 of the penalty (DAPO: 1).

  Returns:
    ``f32[N]`` penalties in ``[−penalty_factor, 0]``.
  """
  max_length = _checks.check_python_int(max_length, "max_length", minimum=1, hint="L_max, the completion budget")
  cache_length = _checks.check_python_int(cache_length, "cache_length", minimum=0, hint="L_cache, the soft zone")
  if cache_length > max_length:
    raise ValueError(f"`cache_length` must be <= max_length ({max_length}); got {cache_length}")
  factor = _checks.check_python_float(penalty_factor, "penalty_factor", at_least=0.0, hint="scale of the penalty")
  lengths = np.asarray(lengths)
  if lengths.ndim != 1:
    raise ValueError(f"`lengths` must be int[N] (one length per completion); got shape {lengths.shape}")
  if lengths.size and not np.issubdtype(lengths.dtype, np.integer):
    raise TypeError(f"`lengths` must hold integer token counts; got dtype {lengths.dtype}")
  if lengths.size and lengths.min() < 0:
    raise ValueError(f"`lengths` must be >= 0; got {lengths.min()}")
  start = max_length - cache_length
  soft = (start - lengths.astype(np.float64)) / max(cache_length, 1)
  out = np.where(lengths <= start, 0.0, np.where(lengths <= max_length, soft, -1.0))
  return (factor * out).astype(np.float32)
