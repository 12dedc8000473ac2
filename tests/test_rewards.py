"""jaxgrpo.rewards.reward_set: the reward table (fractions, LaTeX, nested boxes, no box, wrong answers), the
format reward, a hanging verifier cut by the timeout, failing reward functions stopping the run with
the sample shown (or scoring 0 and being counted), weighted combination, dynamic-sampling groups."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reward_verifiers import dying_verifier, hanging_verifier, slow_first_verifier  # the workers import them by name

from jaxgrpo.rewards import reward_set as R


@pytest.mark.parametrize(
  "text, boxed",
  [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{2}", "2"),  # the last one
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),  # nested braces
    ("\\boxed{\\boxed{7}}", "7"),  # box in a box: unwrapped
    ("\\boxed{a \\boxed{1} b} \\boxed{\\frac{2}{3}}", "\\frac{2}{3}"),  # last outermost
    ("$\\boxed {x^{2}}$", "x^{2}"),
    ("\\boxed 5 done", "5"),
    ("no box here 42", None),
    ("\\boxed{unclosed {", None),
    ("\\fbox{3}", "3"),
  ],
)
def test_extract_boxed(text, boxed):
  assert R.extract_boxed(text) == boxed


# (completion, ground truth, expected reward) — computed by hand
TABLE = [
  ("The answer is \\boxed{42}.", "42", 1.0),
  ("\\boxed{42.0}", "42", 1.0),
  ("\\boxed{1,000}", "1000", 1.0),
  ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
  ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
  ("\\boxed{6/8}", "\\frac34", 1.0),
  ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
  ("\\boxed{2\\frac{1}{2}}", "5/2", 1.0),
  ("\\boxed{\\text{5}}", "5", 1.0),
  ("\\boxed{x = 3}", "3", 1.0),
  ("\\boxed{90^\\circ}", "90", 1.0),
  ("\\boxed{\\left(1, 2\\right)}", "(1,2)", 1.0),
  ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
  ("\\boxed{\\boxed{7}}", "7", 1.0),  # nested boxes
  ("\\boxed{1} ... final \\boxed{2}", "2", 1.0),
  ("\\boxed{2} ... final \\boxed{1}", "2", 0.0),
  ("The answer is 42.", "42", 0.0),  # no box
  ("\\boxed{41}", "42", 0.0),
  ("\\boxed{\\frac{1}{3}}", "0.33", 0.0),
  ("\\boxed{}", "0", 0.0),
  ("\\boxed{\\sqrt{3}}", "\\sqrt{2}", 0.0),
]


def test_reward_table_builtin_in_process():
  acc = R.MathAccuracy(backend="builtin", timeout_s=None)
  comps = [c for c, _, _ in TABLE]
  got = acc(["p"] * len(TABLE), comps, answer=[g for _, g, _ in TABLE])
  assert got == [e for _, _, e in TABLE]
  assert R.format_reward(None, comps) == [0.0 if R.extract_boxed(c) in (None, "") else 1.0 for c in comps]
  assert R.format_reward(None, ["\\boxed{}", "\\boxed{3}", "3"]) == [0.0, 1.0, 0.0]


def test_reward_table_through_the_worker_process():
  acc = R.MathAccuracy(backend="builtin", timeout_s=30.0)
  try:
    got = acc(["p"] * len(TABLE), [c for c, _, _ in TABLE], answer=[g for _, g, _ in TABLE])
  finally:
    acc.close()
  assert got == [e for _, _, e in TABLE]
  assert acc.pop_counters() == {}


@pytest.mark.subprocess
def test_hanging_verifier_is_killed_and_counted():
  acc = R.MathAccuracy(backend=hanging_verifier, timeout_s=1.0, on_error="zero")
  try:
    acc(["p"], ["\\boxed{1}"], answer=["1"])  # start the worker (not timed)
    t0 = time.perf_counter()
    got = acc(["p"] * 4, ["\\boxed{1}", "\\boxed{hang}", "\\boxed{3}", "\\boxed{boom}"], answer=["1", "1", "3", "3"])
    elapsed = time.perf_counter() - t0
    # the items after the hang are still verified (by a fresh worker)
    assert got == [1.0, 0.0, 1.0, 0.0]
    assert acc.pop_counters() == {"timeouts": 1, "verifier_errors": 1}
    assert elapsed < 60
    assert acc(["p"], ["\\boxed{2}"], answer=["2"]) == [1.0]
  finally:
    acc.close()


def test_timeout_pool_kills_the_process():
  pool = R.TimeoutPool(0.5)
  try:
    out = pool.map(hanging_verifier, [("a", "a"), ("hang", "x")])
    assert out == [("ok", True), ("timeout", None)]
    assert pool._proc is None  # killed, restarted on demand
  finally:
    pool.close()


def test_failing_reward_function_stops_the_run_with_the_sample():
  def picky(prompts, completions, answer, **_):
    return [1.0 / (len(c) - 3) for c in completions]  # ZeroDivisionError on a 3-char completion

  rs = R.RewardSet([picky])
  with pytest.raises(R.RewardError) as e:
    rs(["q0", "q1", "q2"], ["long one", "abc", "xy z1"], {"answer": ["a0", "a1", "a2"]})
  msg = str(e.value)
  assert "'picky'" in msg and "sample 1" in msg and "'q1'" in msg and "'abc'" in msg and "a1" in msg
  assert "ZeroDivisionError" in msg

  zero = R.RewardSet([picky], on_error="zero")
  res = zero(["q0", "q1", "q2"], ["long one", "abc", "xy z1"], {"answer": ["a0", "a1", "a2"]})
  np.testing.assert_allclose(res.per_fn["picky"], [0.2, 0.0, 0.5])
  assert res.counters == {"picky/errors": 1}


def test_non_finite_or_wrong_length_rewards_are_errors():
  nan = R.RewardSet([lambda p, c, **_: [1.0, math.nan]])
  with pytest.raises(R.RewardError, match="sample 1"):
    nan(["a", "b"], ["x", "y"])
  short = R.RewardSet([lambda p, c, **_: [1.0]])
  with pytest.raises(R.RewardError, match="1 values for 2"):
    short(["a", "b"], ["x", "y"])
  with pytest.raises(ValueError, match="on_error"):
    R.RewardSet([R.format_reward], on_error="ignore")


def test_weighted_combination_logs_each_function():
  acc = R.MathAccuracy(backend="builtin", timeout_s=None)
  rs = R.RewardSet({"accuracy": (acc, 1.0), "format": (R.format_reward, 0.5)})
  res = rs(["p"] * 3, ["\\boxed{4}", "\\boxed{5}", "4"], {"answer": ["4", "4", "4"]})
  np.testing.assert_allclose(res.per_fn["accuracy"], [1, 0, 0])
  np.testing.assert_allclose(res.per_fn["format"], [1, 1, 0])
  np.testing.assert_allclose(res.total, [1.5, 0.5, 0.0])
  with pytest.raises(ValueError, match="rows"):
    rs(["p"], ["a", "b"], {"answer": ["4", "4"]})


def test_group_is_informative():
  r = [1, 1, 0, 1, 0.5, 0.5, 2]
  g = [0, 0, 1, 1, 2, 2, 3]
  np.testing.assert_array_equal(R.group_is_informative(r, g, 5), [False, True, False, False, False])


# ----------------------------------------------------------------------------- extraction: linear, bounded
def reference_boxed(text: str) -> str | None:
  """The definition, written the slow obvious way (quadratic; small inputs only): the last box not
  inside an earlier complete box, its braces matched by a forward depth scan; while the content is
  exactly one complete box (up to surrounding whitespace), it is replaced by that box's content."""

  def close(s, i):  # index of the brace closing the one at s[i], or None
    depth = 0
    for j in range(i, len(s)):
      depth += {"{": 1, "}": -1}.get(s[j], 0)
      if depth == 0:
        return j
    return None

  best, pos = None, 0
  for m in re.finditer(r"\\(?:boxed|fbox)\s*", text):
    if m.start() < pos:
      continue
    i = m.end()
    if i < len(text) and text[i] == "{":
      j = close(text, i)
      if j is not None:
        best, pos = text[i + 1 : j], j + 1
    elif m.group(0).endswith(" ") and i < len(text) and (t := re.match(r"[^\s$]+", text[i:])):
      best = t.group(0)
  while best is not None:
    t = best.strip()
    m = re.match(r"\\(?:boxed|fbox)\s*\{", t)
    if m is None or close(t, m.end() - 1) != len(t) - 1:
      break
    best = t[m.end() : -1]
  return best


@settings(max_examples=300, deadline=None)
@given(
  st.lists(st.sampled_from(["\\boxed", "\\fbox", "\\boxed ", "{", "}", "{", "}", " ", "7", "x", "$"]), max_size=30)
)
def test_extract_boxed_matches_the_slow_definition(parts):
  text = "".join(parts)
  assert R.extract_boxed(text) == reference_boxed(text)


def test_extract_boxed_unwraps_only_a_single_inner_box():
  assert R.extract_boxed("\\boxed{ \\boxed{ \\fbox{5} } }") == "5"
  assert R.extract_boxed("\\boxed{\\boxed{1} + \\boxed{2}}") == "\\boxed{1} + \\boxed{2}"
  k = 50_000  # deep nesting: was a RecursionError
  assert R.extract_boxed("\\boxed{" * k + "5" + "}" * k) == "5"


ADVERSARIAL = {
  "unclosed boxes": lambda n: "\\boxed{" * (n // 7),
  "unclosed then closed": lambda n: "\\boxed{" * (n // 14) + "}" * (n // 14),
  "brace-less boxes": lambda n: "\\boxed " * (n // 7),
  "open braces then a box": lambda n: "{" * (n - 9) + "\\boxed{1}",
}


class _Budget:
  """Raises TimeoutError in the main thread after ``seconds`` (SIGALRM interrupts Python loops)."""

  def __init__(self, seconds):
    self.seconds = seconds

  def __enter__(self):
    def handler(signum, frame):
      raise TimeoutError(f"over the {self.seconds} s budget")

    self.old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(self.seconds)

  def __exit__(self, *exc):
    signal.alarm(0)
    signal.signal(signal.SIGALRM, self.old)


def _best_time(fn, repeats=3):
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t0)
  return best


@pytest.mark.parametrize("kind", list(ADVERSARIAL))
def test_extract_boxed_is_linear_on_adversarial_input(kind):
  make = ADVERSARIAL[kind]
  small, large = make(125_000), make(2_000_000)
  with _Budget(60):  # the former code: 47 s on 80 kB, hours on 1 MB
    t_small, t_large = math.inf, math.inf
    for _ in range(5):  # interleaved, best of 5: a busy machine slows single calls, not the best of each
      t_small = min(t_small, _best_time(lambda: R.extract_boxed(small, max_chars=None), repeats=1))
      t_large = min(t_large, _best_time(lambda: R.extract_boxed(large, max_chars=None), repeats=1))
    R.extract_boxed(large)  # the default bound
  # 16x the input: linear is 16x, quadratic 256x; the margin absorbs a loaded machine
  assert t_large <= 48 * t_small + 0.1, (t_small, t_large)


def test_extract_boxed_searches_only_the_tail():
  pad = "x" * R.BOXED_SEARCH_CHARS
  assert R.extract_boxed("\\boxed{7}" + pad) is None  # beyond the bound
  assert R.extract_boxed("\\boxed{7}" + pad, max_chars=None) == "7"
  assert R.extract_boxed(pad + "\\boxed{7}") == "7"
  with pytest.raises(TypeError, match="text"):
    R.extract_boxed(None)


def test_math_accuracy_on_a_1mb_completion_within_the_timeout():
  acc = R.MathAccuracy(backend="builtin", timeout_s=None)
  evil = "\\boxed{" * (1_000_000 // 7)
  with _Budget(30):
    assert acc(["p", "p"], [evil, evil + "\\boxed{4}"], answer=["4", "4"]) == [0.0, 1.0]
    assert R.format_reward(None, [evil]) == [0.0]


# ----------------------------------------------------------------------------- unicode look-alikes
@pytest.mark.parametrize(
  "pred, gold",
  [
    ("\u22125", "-5"),  # minus sign
    ("\u20135", "-5"),  # en dash used as minus
    ("\uff11\uff12", "12"),  # full-width digits
    ("\uff0d\uff13\uff0e\uff15", "-3.5"),  # full-width minus, digit, point
    ("\\frac{\u22121}{2}", "-0.5"),
  ],
)
@pytest.mark.parametrize("backend", ["builtin", "math_verify"])
def test_unicode_lookalikes_match_their_ascii(pred, gold, backend):
  acc = R.MathAccuracy(backend=backend, timeout_s=None)
  assert acc(["p", "p"], [f"\\boxed{{{pred}}}", f"\\boxed{{{gold}}}"], answer=[gold, pred]) == [1.0, 1.0]


def test_normalize_unicode_is_a_small_fixed_table():
  assert R.normalize_unicode("\u2212\u2010\u2011\u2012\u2013\ufe63\uff0d") == "-------"
  assert R.normalize_unicode("\uff10\uff19\uff0b\uff0f\uff08\uff09\uff1d") == "09+/()="
  assert (
    R.normalize_unicode("a\u2014b x\u00b2 \u03c0") == "a\u2014b x\u00b2 \u03c0"
  )  # em dash, superscripts, letters kept
  assert R.answers_match("\u221242", "-42") and not R.answers_match("\u201442", "-42")
  assert R.normalize_unicode("1\u00a0000\u2009\u202f\u3000") == "1 000   "
  assert R.answers_match("1\u00a0000", "1000")  # the built-in normaliser drops spaces


# ----------------------------------------------------------------------------- missing ground truth
def test_missing_ground_truth_is_never_compared():
  comps = ["\\boxed{None}", "\\boxed{nan}", "\\boxed{}", "\\boxed{4}"]
  golds = [None, math.nan, " ", "4"]
  for backend in ("builtin", "math_verify"):
    acc = R.MathAccuracy(backend=backend, timeout_s=None)
    with pytest.raises(R.SampleErrors) as e:
      acc(["p"] * 4, comps, answer=golds)
    assert sorted(e.value.errors) == [0, 1, 2] and e.value.values == [0.0, 0.0, 0.0, 1.0]
    assert "no ground truth (answer=None)" in e.value.errors[0]
    zero = R.MathAccuracy(backend=backend, timeout_s=None, on_error="zero")
    assert zero(["p"] * 4, comps, answer=golds) == [0.0, 0.0, 0.0, 1.0]
    assert zero.pop_counters() == {"missing_answers": 3}
  with pytest.raises(ValueError, match="gold"):
    R.answers_match("None", None)
  with pytest.raises(ValueError, match="gold"):
    R.math_verify_match("None", None)


def test_reward_set_shows_the_sample_without_ground_truth():
  rs = R.RewardSet({"accuracy": R.MathAccuracy(backend="builtin", timeout_s=None)})
  with pytest.raises(R.RewardError) as e:
    rs(["q0", "q1"], ["\\boxed{1}", "\\boxed{None}"], {"answer": ["1", None]})
  msg = str(e.value)
  assert "'accuracy' failed on sample 1" in msg and "no ground truth" in msg and "'q1'" in msg
  zero = R.RewardSet({"accuracy": R.MathAccuracy(backend="builtin", timeout_s=None)}, on_error="zero")
  res = zero(["q0", "q1"], ["\\boxed{1}", "\\boxed{None}"], {"answer": ["1", None]})
  np.testing.assert_array_equal(res.per_fn["accuracy"], [1.0, 0.0])
  assert res.counters == {"accuracy/errors": 1}


# ----------------------------------------------------------------------------- the real math-verify backend
MATH_VERIFY_CASES = [  # (prediction, ground truth, equal?) — by hand
  ("0.5", "\\frac{1}{2}", True),
  ("\\dfrac{3}{4}", "0.75", True),
  ("\\tfrac{3}{4}", "\\frac34", True),
  ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2", True),
  ("2\\pi", "\\pi \\cdot 2", True),
  ("x = 3", "3", True),
  ("[1, 2)", "[1,2)", True),
  ("(1, 2]", "\\left(1,2\\right]", True),
  ("(-\\infty, 3]", "(-\\infty,3]", True),
  ("\\{1, 2\\}", "\\{2, 1\\}", True),
  ("1, 2", "2, 1", True),
  ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True),
  ("10\\%", "10", True),
  ("\\frac{1}{3}", "0.33", False),
  ("[1, 2]", "(1, 2)", False),
  ("\\{1, 2\\}", "\\{1, 3\\}", False),
  ("\\sqrt{3}", "\\sqrt{2}", False),
  ("-5", "5", False),
  ("", "0", False),
]


@pytest.mark.parametrize("pred, gold, equal", MATH_VERIFY_CASES)
def test_math_verify_backend(pred, gold, equal):
  assert R.math_verify_match(pred, gold) is equal


def test_plain_integers_are_compared_as_math_verify_compares_them():
  """Two plain integers skip math-verify (no sympy import, no parse): the verdict must be math-verify's own,
  computed here by the package itself on the boxed strings."""
  import random

  import math_verify

  def reference(pred, gold):
    golds = math_verify.parse(f"$\\boxed{{{gold}}}$", parsing_timeout=None)
    preds = math_verify.parse(f"$\\boxed{{{pred}}}$", parsing_timeout=None)
    return any(math_verify.verify(g, p, timeout_seconds=None) for g in golds for p in preds)

  rng = random.Random(0)
  pairs = [("0", "0"), ("-0", "0"), ("007", "7"), ("+5", "5"), (" 12 ", "12"), ("-5", "5"), ("10", "100")]
  pairs += [("123456789012345678901234567890", "123456789012345678901234567890")]
  for _ in range(100):
    a = rng.randint(-(10**6), 10**6)
    pairs.append((str(a), str(a if rng.random() < 0.5 else a + rng.choice([-1, 1, 10]))))
  assert [R.math_verify_match(p, g) for p, g in pairs] == [reference(p, g) for p, g in pairs]


@pytest.mark.subprocess
def test_math_verify_and_builtin_agree_on_the_table_through_the_worker():
  comps, golds = [c for c, _, _ in TABLE], [g for _, g, _ in TABLE]
  acc = R.MathAccuracy(backend="math_verify", timeout_s=120.0)
  try:
    got = acc(["p"] * len(TABLE), comps, answer=golds)
  finally:
    acc.close()
  assert got == [e for _, _, e in TABLE]
  assert got == R.MathAccuracy(backend="builtin", timeout_s=None)(["p"] * len(TABLE), comps, answer=golds)
  assert acc.pop_counters() == {}


def test_math_verify_own_timeouts_are_off(monkeypatch):
  """math-verify 0.9 arms signal.alarm(5) around parse and verify and returns False when it fires
  (uncounted, and before our limit); the only limit must be the worker's."""
  alarms = []
  real_alarm = signal.alarm
  monkeypatch.setattr(signal, "alarm", lambda s: alarms.append(s) or real_alarm(s))
  assert R.math_verify_match("\\frac{1}{2}", "0.5")
  assert [s for s in alarms if s] == []


def test_math_verify_errors_and_timeouts_are_reported(monkeypatch):
  import math_verify
  from math_verify.errors import TimeoutException

  def broken(*a, **k):
    raise RuntimeError("sympy exploded")

  monkeypatch.setattr(math_verify, "verify", broken)
  with pytest.raises(RuntimeError, match="sympy exploded"):
    R.math_verify_match("1.5", "1.5")
  acc = R.MathAccuracy(backend="math_verify", timeout_s=None)
  with pytest.raises(R.SampleErrors, match="sympy exploded"):
    acc(["p"], ["\\boxed{1.5}"], answer=["1.5"])
  rs = R.RewardSet({"accuracy": acc})
  with pytest.raises(R.RewardError, match=r"sample 0: verifier error RuntimeError: sympy exploded"):
    rs(["p"], ["\\boxed{1.5}"], {"answer": ["1.5"]})
  zero = R.MathAccuracy(backend="math_verify", timeout_s=None, on_error="zero")
  assert zero(["p"], ["\\boxed{1.5}"], answer=["1.5"]) == [0.0]
  assert zero.pop_counters() == {"verifier_errors": 1}

  def slow(*a, **k):
    raise TimeoutException("Operation timed out!")

  monkeypatch.setattr(math_verify, "verify", slow)
  with pytest.raises(TimeoutError):
    R.math_verify_match("1.5", "1.5")
  res = R.RewardSet({"accuracy": acc})(["p"], ["\\boxed{1.5}"], {"answer": ["1.5"]})  # a timeout never raises
  assert res.per_fn["accuracy"].tolist() == [0.0] and res.counters == {"accuracy/timeouts": 1}


# ----------------------------------------------------------------------------- error contract in a RewardSet
@pytest.mark.subprocess
def test_verifier_errors_follow_the_reward_set_policy_through_the_worker():
  comps = ["\\boxed{1}", "\\boxed{boom}", "\\boxed{hang}", "\\boxed{2}"]
  cols = {"answer": ["1", "1", "1", "2"]}
  acc = R.MathAccuracy(backend=hanging_verifier, timeout_s=1.0)
  try:
    with pytest.raises(R.RewardError) as e:
      R.RewardSet({"accuracy": acc})(["q0", "q1", "q2", "q3"], comps, cols)
    msg = str(e.value)
    assert "sample 1" in msg and "ZeroDivisionError: verifier bug" in msg and "'q1'" in msg
    res = R.RewardSet({"accuracy": acc}, on_error="zero")(["q"] * 4, comps, cols)
    np.testing.assert_array_equal(res.per_fn["accuracy"], [1, 0, 0, 1])
    assert res.counters == {"accuracy/errors": 1, "accuracy/timeouts": 1}
  finally:
    acc.close()


def test_local_backend_with_a_timeout_is_refused_early():
  with pytest.raises(TypeError, match="module-level"):
    R.MathAccuracy(backend=lambda p, g: True, timeout_s=5.0)
  with pytest.raises(ValueError, match="on_error"):
    R.MathAccuracy(backend="builtin", on_error="ignore")
  with pytest.raises(ValueError, match="timeout_s"):
    R.TimeoutPool(float("nan"))


# ----------------------------------------------------------------------------- the worker process
def test_a_worker_that_dies_on_an_item_is_an_error_and_replaced():
  pool = R.TimeoutPool(60.0)
  try:
    out = pool.map(dying_verifier, [("a", "a"), ("die", "x"), ("b", "c")])
    assert out[0] == ("ok", True) and out[2] == ("ok", False)
    assert out[1][0] == "error" and "exit code 3" in out[1][1]
  finally:
    pool.close()


def test_start_up_and_warm_up_do_not_count_against_the_first_item():
  cold = R.TimeoutPool(1.0)
  warm = R.TimeoutPool(1.0, warmup=("w", "w"))
  try:
    assert cold.map(slow_first_verifier, [("a", "a")]) == [("timeout", None)]
    assert warm.map(slow_first_verifier, [("a", "a"), ("b", "c")]) == [("ok", True), ("ok", False)]
    broken = R.TimeoutPool(5.0, warmup=("boom", "x"))
    with pytest.raises(RuntimeError, match="loading.*ZeroDivisionError: verifier bug"):
      broken.map(hanging_verifier, [("a", "a")])
    assert broken._proc is None
  finally:
    cold.close()
    warm.close()


def test_worker_ignores_ctrl_c():
  pool = R.TimeoutPool(60.0)
  try:
    pool.map(dying_verifier, [("a", "a")])
    os.kill(pool._proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
    time.sleep(0.5)
    assert pool._proc.poll() is None
    assert pool.map(dying_verifier, [("b", "b")]) == [("ok", True)]
  finally:
    pool.close()


PARENT_SCRIPT = """
import sys, time
from jaxgrpo.rewards import reward_set as R

def spin(x):
  while x == "hang":
    pass
  return x

if __name__ == "__main__":
  pool = R.TimeoutPool(3600.0)
  pool.map(spin, [("ok",)])
  print(pool._proc.pid, flush=True)
  pool.map(spin, [("hang",)])  # busy in the worker until the parent is killed
"""


def _gone(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie no one reaps is dead
  except FileNotFoundError:
    return True


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_worker_exits_when_its_parent_is_killed(tmp_path, sig):
  script = tmp_path / "parent.py"
  script.write_text(PARENT_SCRIPT)
  parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
  try:
    worker = int(parent.stdout.readline())
    time.sleep(1.0)  # let the worker start spinning
    assert not _gone(worker)
    parent.send_signal(sig)
    parent.wait(timeout=60)
    deadline = time.monotonic() + 30
    while not _gone(worker) and time.monotonic() < deadline:
      time.sleep(0.2)
    assert _gone(worker), f"verifier worker {worker} outlived its parent"
  finally:
    parent.kill()
    if "worker" in locals() and not _gone(worker):
      os.kill(worker, signal.SIGKILL)


LEAN_PARENT_SCRIPT = """
import sys
import jax, flax  # a training script's imports
from jaxgrpo.rewards import reward_set as R
import reward_verifiers as V

def here(x):
  return x + "!"

if __name__ == "__main__":
  pool = R.TimeoutPool(60.0)
  print(pool.map(V.loaded_modules, [("jax,flax,jaxgrpo.kernels.advantages,reward_verifiers",)]))
  print(pool.map(here, [("main",)]))  # a function of the main script: found there, as spawn would
  pool.close()
"""


@pytest.mark.subprocess
def test_worker_imports_only_the_function_module_not_the_parents_main(tmp_path):
  script = tmp_path / "parent.py"
  script.write_text(LEAN_PARENT_SCRIPT)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
  r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
  assert r.returncode == 0, r.stderr[-3000:]
  lean, main_fn = r.stdout.splitlines()
  assert lean == "[('ok', ['reward_verifiers'])]"  # neither JAX nor Flax nor the package's kernels
  assert main_fn == "[('ok', 'main!')]"
