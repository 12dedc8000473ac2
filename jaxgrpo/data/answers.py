"""Math answers: the boxed answer of a completion and whether it equals the ground truth.

:func:`extract_boxed` takes the *last* outermost ``\\boxed{...}`` (or ``\\fbox``) of a completion
in one linear pass over at most the last :data:`BOXED_SEARCH_CHARS` characters;
:func:`normalize_unicode` maps common Unicode look-alikes to ASCII. Two verifiers of
``(pred, gold) -> bool``: :func:`answers_match`, the built-in normaliser (integers, decimals,
fractions, ``\\frac``/``\\dfrac``, simple LaTeX; :func:`normalize_answer`, :func:`parse_number`),
and :func:`math_verify_match`, ``math-verify`` (the ``math`` extra) with its own signal-based
timeouts switched off (the hard limit is ``jaxgrpo.services.timeout_pool.TimeoutPool``'s). Host side, pure
Python; re-exported by ``jaxgrpo.rewards.reward_set``, whose ``MathAccuracy`` runs them.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import re
from fractions import Fraction

__all__ = [
  "BOXED_SEARCH_CHARS",
  "extract_boxed",
  "normalize_unicode",
  "normalize_answer",
  "parse_number",
  "answers_match",
  "math_verify_available",
  "math_verify_match",
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
  """True when the ``math-verify`` package (the ``math`` extra) is installed. Found, not imported: the import
  (sympy, ~0.4 s) happens where it is used, which for ``MathAccuracy`` is its verifier worker process."""
  return importlib.util.find_spec("math_verify") is not None


class _DropTimeoutDisabledNotice(logging.Filter):
  """math-verify logs "Timeout is disabled ... you must provide the logic for timeout interruption
  yourself" once per process; ``jaxgrpo.services.timeout_pool.TimeoutPool`` is that logic, so the notice is noise."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Timeout is disabled")


_NOTICE_FILTER = _DropTimeoutDisabledNotice()


#: a plain integer (optional sign, digits, surrounding spaces): compared by value without math-verify
_PLAIN_INT = re.compile(r"\s*[-+]?\d+\s*\Z")


def math_verify_match(pred: str | None, gold: str) -> bool:
  """``math_verify.verify(parse(gold), parse(pred))`` on boxed strings (the ``math`` extra); two plain integers
  (``-12``, ``007``) are compared by value directly, which is math-verify's verdict on them (tested against it).

  math-verify's own timeouts (``signal.alarm``, 5 s by default, firing before ours and returning
  False uncounted) are switched off: the limit is ``TimeoutPool``'s (``jaxgrpo.services.timeout_pool``), which kills the worker.
  Errors are raised (``raise_on_error=True``), not turned into False: the pair of parsed forms
  (math-verify parses each side to a sympy object and its string) that matches wins; when none
  matches and one comparison raised, that exception is raised. A math-verify timeout, should one
  still fire, is raised as :class:`TimeoutError`.
  """
  _check_gold(gold)
  if pred is None:
    return False
  if _PLAIN_INT.match(pred) and _PLAIN_INT.match(gold):  # math-verify's verdict on two integers: their equality
    return int(pred) == int(gold)  # without sympy (its import ~0.4 s, each call ~1 ms); tests/test_rewards.py
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
