"""Verifiable rewards: reward functions, their error contract, and their weighted combination.

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
- A function whose ``nan_is_missing`` attribute is True (the learned and remote rewards of
  ``jaxgrpo.rewards``: a judge's unparsable verdict, a reward service that failed) returns NaN for a
  sample it could not score: a *missing sample*, not an error. :class:`RewardSet` keeps it NaN in
  ``per_fn`` and ``total`` (the row gets advantage 0 and stays out of the loss, as ``loop.collect.score``
  documents) and counts it (``"<name>/missing"``) whatever ``on_error`` says; never a silent 0. A ±inf
  from such a function is the same missing sample (NaN, counted in ``"<name>/missing"`` and
  ``"<name>/nonfinite"``): one rule for every non-finite learned, judged or remote score, on every path.
- A verifier *timeout* is not an error: the sample scores 0 and is counted (``"<name>/timeouts"``)
  whatever ``on_error`` says. It is a property of the completion (sympy spends minutes on
  ``\\boxed{2^{10^{10}}}``); stopping the run over it would let one completion end training.
- Used on its own (evaluation), ``MathAccuracy(on_error="zero")`` scores verifier errors 0 and
  counts them itself (``verifier_errors``, ``missing_answers``).

Math accuracy (:class:`MathAccuracy`) extracts the last boxed answer and compares it with the ground
truth (``jaxgrpo.data.answers``: ``math-verify`` when installed, else the built-in normaliser) in a
separate worker process (``jaxgrpo.services.timeout_pool.TimeoutPool``): one that hangs is killed after
``timeout_s``, scored 0 and counted. The names of both modules are re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jaxgrpo import _checks
from jaxgrpo.data.answers import (
  BOXED_SEARCH_CHARS,
  answers_match,
  extract_boxed,
  math_verify_available,
  math_verify_match,
  normalize_answer,
  normalize_unicode,
  parse_number,
)
from jaxgrpo.services.timeout_pool import TimeoutPool

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
  "finite_reward_stats",
]


def finite_reward_stats(rewards) -> dict[str, float]:
  """``{"reward_mean", "reward_std"}`` of the finite entries of ``rewards`` (``f32[N]``; NaN when none).

  A non-finite reward (NaN/±inf) is a missing sample (advantage 0, counted in ``rewards_nonfinite``), not
  a number to average: the logged statistics describe the rows that were scored, and a batch without a
  finite reward has none to describe (NaN, not a mean reward of 0).
  """
  r = np.asarray(rewards).reshape(-1)
  finite = r[np.isfinite(r)]
  if not finite.size:
    return {"reward_mean": float("nan"), "reward_std": float("nan")}
  return {"reward_mean": float(finite.mean()), "reward_std": float(finite.std())}


#: the column with each row's prompt as chat messages, before the policy's chat template (the trainer's rows),
#: passed only to reward functions with ``wants_prompt_messages = True`` (a reward model, a judge: they render
#: the conversation with their own template; ``prompts`` are the texts the policy's template made)
PROMPT_MESSAGES = "prompt_messages"


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
      are counted (``"<name>/errors"``). See the module docstring for timeouts and for the NaN of a
      function with ``nan_is_missing = True`` (a missing sample, ``"<name>/missing"``).
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
    missing, infinite = 0, 0
    for i, v in enumerate(vals):
      if not math.isfinite(v) and i not in failed and getattr(fn, "nan_is_missing", False) is True:
        missing += 1  # a missing sample by the function's own account (NaN, or ±inf): kept NaN, counted
        infinite += not math.isnan(v)
        vals[i] = math.nan
      elif not math.isfinite(v) and i not in failed:
        failed[i] = f"non-finite reward {v}"
    for key, count in (("missing", missing), ("nonfinite", infinite)):
      if count:
        counters[f"{name}/{key}"] = counters.get(f"{name}/{key}", 0) + count
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
    plain = {k: v for k, v in columns.items() if k != PROMPT_MESSAGES}
    for name, fn, w in self.fns:
      cols = columns if getattr(fn, "wants_prompt_messages", False) else plain  # the functions that ask for it
      try:
        vals = self._one(name, fn, list(prompts), list(completions), cols, counters)
      finally:
        if isinstance(fn, CountingReward):
          for k, v in fn.pop_counters().items():
            counters[f"{name}/{k}"] = counters.get(f"{name}/{k}", 0) + v
      per_fn[name] = vals
      total += w * vals
    return RewardResult(total=total, per_fn=per_fn, counters=counters)


def group_is_informative(rewards, group_ids, num_groups: int) -> np.ndarray:
  """DAPO dynamic sampling: ``bool[num_groups]``, True where a group's rewards are not all equal
  (groups with no members are False; a group holding a NaN reward is False). ``rewards``: ``f[N]``;
  ``group_ids``: ``int[N]`` in ``[0, num_groups)``. Host side, NumPy."""
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
