"""Remote rewards: a reward service behind an HTTP endpoint, called with bounded concurrency, timeouts, retries and
a deadline, whose failures are missing samples (NaN, counted) rather than stopped runs or silent zeros.

The protocol (one POST per batch of rows, JSON both ways)::

    request   {"prompts": [str, ...], "completions": [str, ...], "metadata": {column: [value, ...], ...}}
    response  {"scores": [float | null, ...]}        # one entry per row of the request, in order

A ``null`` score is a row the service could not score (missing, counted ``null_scores``); so is a non-finite one
(``Infinity``, ``-Infinity``, ``NaN`` or an overflowing ``1e999``, which Python's ``json`` reads as ±inf/NaN: missing,
counted ``nonfinite_scores``, never passed on as a number). Every other
departure from the protocol — a non-2xx status, a body that is not JSON or not an object with ``scores``, a list
of the wrong length, a body cut short, a connection error, a request that takes longer than ``timeout_s`` — is a
failed attempt: counted by kind (``http_errors``, ``bad_responses``, ``timeouts``, ``connection_errors``) and
retried after an exponential backoff (``backoff_s · 2^attempt``, at most ``backoff_max_s``, jittered) up to
``retries`` times (a 4xx other than 408/429 is not retried: the request itself is wrong). A batch that fails
every attempt leaves its rows NaN (``failed_rows``). The whole call ends by ``deadline_s``: each attempt's
timeout and each backoff are cut to the time left, and rows still unscored then are NaN (``deadline_rows``), so a
training step never waits on the service longer than that; an attempt still in flight at the deadline (a slow body
arriving) counts as a request and a timeout.

Standard library only (``urllib.request`` in a ``concurrent.futures`` thread pool).
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import math
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Mapping, Sequence

import numpy as np

from jaxgrpo import _checks
from jaxgrpo.rewards.reward_set import CountingReward

__all__ = ["RemoteReward"]

_RETRYABLE_4XX = (408, 429)


def _jsonable(x: Any):
  """``json.dumps``' fallback: NumPy scalars and arrays as Python values, anything else as its ``str``."""
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  return str(x)


class _Attempt(Exception):
  """One failed attempt: ``kind`` is the counter, ``retry`` whether another attempt may help."""

  def __init__(self, kind: str, why: str, retry: bool = True):
    super().__init__(why)
    self.kind, self.retry = kind, retry


class _Tally:
  """The counter increments of one batch's attempts, readable (once, ``close``) while its thread still runs: an
  attempt in flight when the call reads it was cut by the deadline and counts as a ``timeouts``; what the thread
  does afterwards is not counted."""

  def __init__(self):
    self._lock = threading.Lock()
    self.events: dict[str, int] = {}
    self._in_flight = self._closed = False

  def _add(self, kind: str):
    self.events[kind] = self.events.get(kind, 0) + 1

  def start(self, retry: bool) -> bool:
    """An attempt begins (False: the call has already read the tally; make none)."""
    with self._lock:
      if self._closed:
        return False
      if retry:
        self._add("retries")
      self._add("requests")
      self._in_flight = True
      return True

  def end(self, kind: str | None):
    """The attempt ended: failed (``kind``, the counter) or succeeded (None)."""
    with self._lock:
      if not self._closed:
        self._in_flight = False
        if kind is not None:
          self._add(kind)

  def close(self) -> dict[str, int]:
    with self._lock:
      self._closed = True
      if self._in_flight:
        self._add("timeouts")
        self._in_flight = False
      return dict(self.events)


class RemoteReward(CountingReward):
  """A reward function ``(prompts, completions, **columns) -> list[float]`` served over HTTP (module docstring).

  Args:
    url: the endpoint (``http://`` or ``https://``), POSTed one JSON batch per request.
    batch_size: rows per request.
    max_concurrency: requests in flight at once (a thread each).
    timeout_s: the limit of one request (connect + response), cut to the time left before the deadline.
    retries: further attempts after a failed one (0: none).
    backoff_s, backoff_max_s: the wait before retry k is ``min(backoff_s · 2^k, backoff_max_s)`` times a jitter
      in ``[0.5, 1]``, cut to the time left.
    deadline_s: the longest a call takes; rows unscored then are NaN (``deadline_rows``).
    metadata_columns: the dataset columns sent as ``metadata`` (None: every column).
    headers: extra HTTP headers (e.g. ``{"Authorization": "Bearer ..."}``).
    name: the reward's name in a ``RewardSet``.

  Counters (``pop_counters``): ``requests``, ``retries``, ``http_errors``, ``bad_responses``, ``timeouts``,
  ``connection_errors`` (failed attempts, by kind), ``failed_rows``, ``deadline_rows``, ``null_scores`` (rows
  left NaN, by cause).
  """

  nan_is_missing = True  # RewardSet keeps a NaN as a missing sample (jaxgrpo.rewards.reward_set)

  def __init__(
    self,
    url: str,
    *,
    batch_size: int = 32,
    max_concurrency: int = 4,
    timeout_s: float = 30.0,
    retries: int = 2,
    backoff_s: float = 0.5,
    backoff_max_s: float = 8.0,
    deadline_s: float = 120.0,
    metadata_columns: Sequence[str] | None = None,
    headers: Mapping[str, str] | None = None,
    name: str = "remote",
  ):
    super().__init__()
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
      raise ValueError(f"`url` must be an http:// or https:// URL; got {url!r}")
    self.url = url
    self.batch_size = _checks.check_python_int(batch_size, "batch_size", minimum=1, hint="rows per request")
    self.max_concurrency = _checks.check_python_int(max_concurrency, "max_concurrency", minimum=1)
    self.timeout_s = _checks.check_python_float(timeout_s, "timeout_s", above=0.0, hint="seconds per request")
    self.retries = _checks.check_python_int(retries, "retries", minimum=0)
    self.backoff_s = _checks.check_python_float(backoff_s, "backoff_s", at_least=0.0)
    self.backoff_max_s = _checks.check_python_float(backoff_max_s, "backoff_max_s", at_least=0.0)
    self.deadline_s = _checks.check_python_float(deadline_s, "deadline_s", above=0.0, hint="seconds per call")
    self.metadata_columns = None if metadata_columns is None else list(metadata_columns)
    self.headers = {"Content-Type": "application/json", **dict(headers or {})}
    self.__name__ = name
    self._rng = random.Random(0)
    self.last_errors: list[str] = []  # the last failure of each batch that failed in the last call

  # ------------------------------------------------------------------ one request
  def _post(self, body: bytes, n: int, timeout: float) -> list[float | None]:
    """The ``n`` scores of one request (None for a null; non-finite values as read), or ``_Attempt`` naming what
    went wrong."""
    request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
    try:
      with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read()
    except urllib.error.HTTPError as e:
      retry = e.code >= 500 or e.code in _RETRYABLE_4XX
      raise _Attempt("http_errors", f"HTTP {e.code} {e.reason}", retry) from None
    except (TimeoutError, socket.timeout) as e:
      raise _Attempt("timeouts", f"no response within {timeout:.3g} s ({e})") from None
    except urllib.error.URLError as e:
      if isinstance(e.reason, (TimeoutError, socket.timeout)):
        raise _Attempt("timeouts", f"no response within {timeout:.3g} s ({e.reason})") from None
      raise _Attempt("connection_errors", f"{e.reason}") from None
    except http.client.IncompleteRead as e:
      raise _Attempt("bad_responses", f"body cut short ({len(e.partial)} bytes read)") from None
    except (http.client.HTTPException, ConnectionError, OSError) as e:
      raise _Attempt("connection_errors", f"{type(e).__name__}: {e}") from None
    try:
      data = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
      raise _Attempt("bad_responses", f"not JSON ({e}): {raw[:120]!r}") from None
    scores = data.get("scores") if isinstance(data, dict) else None
    if not isinstance(scores, list):
      raise _Attempt("bad_responses", f"not an object with a 'scores' list: {raw[:120]!r}")
    if len(scores) != n:
      raise _Attempt("bad_responses", f"{len(scores)} scores for {n} rows")
    out = []
    for s in scores:
      if s is None:
        out.append(None)
      elif isinstance(s, (int, float)) and not isinstance(s, bool):
        out.append(float(s))
      else:
        raise _Attempt("bad_responses", f"a score is {s!r}, not a number or null")
    return out

  def _batch(self, body: bytes, n: int, deadline: float, tally: _Tally) -> tuple[list[float | None] | None, str]:
    """Attempts until one succeeds, a non-retryable failure, ``retries`` are spent or the deadline passes:
    ``(scores or None, the last failure)``; the counter increments go to ``tally`` as they happen."""
    why = ""
    for attempt in range(self.retries + 1):
      left = deadline - time.monotonic()
      if left <= 0 or not tally.start(retry=attempt > 0):
        break
      try:
        scores = self._post(body, n, min(self.timeout_s, left))
        tally.end(None)
        return scores, ""
      except _Attempt as e:
        tally.end(e.kind)
        why = f"{e.kind}: {e}"
        if not e.retry:
          break
      if attempt < self.retries:
        wait = min(self.backoff_s * 2**attempt, self.backoff_max_s) * self._rng.uniform(0.5, 1.0)
        time.sleep(max(0.0, min(wait, deadline - time.monotonic())))
    return None, why

  # ------------------------------------------------------------------ the reward function
  def __call__(self, prompts: Sequence[Any], completions: Sequence[str], **columns) -> list[float]:
    deadline = time.monotonic() + self.deadline_s
    n = len(completions)
    if len(prompts) != n:
      raise ValueError(f"`prompts` ({len(prompts)}) and `completions` ({n}) must have one entry per row")
    names = list(columns) if self.metadata_columns is None else self.metadata_columns
    missing = [c for c in names if c not in columns]
    if missing:
      raise ValueError(f"`metadata_columns` {missing} are not among the columns {sorted(columns)}")
    out = [math.nan] * n
    self.last_errors = []
    if not n:
      return out
    chunks = [range(s, min(s + self.batch_size, n)) for s in range(0, n, self.batch_size)]
    pool = concurrent.futures.ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="remote-reward")
    try:
      futures, tallies = {}, {}
      for rows in chunks:
        payload = {
          "prompts": [prompts[i] for i in rows],
          "completions": [completions[i] for i in rows],
          "metadata": {c: [columns[c][i] for i in rows] for c in names},
        }
        body = json.dumps(payload, default=_jsonable).encode()
        tally = _Tally()
        future = pool.submit(self._batch, body, len(rows), deadline, tally)
        futures[future], tallies[future] = rows, tally
      done, _ = concurrent.futures.wait(futures, timeout=max(0.0, deadline - time.monotonic()))
      for future, rows in futures.items():
        for k, v in tallies[future].close().items():  # an attempt still in flight: cut by the deadline
          self._count(k, v)
        if future not in done:
          self._count("deadline_rows", len(rows))
          continue
        scores, why = future.result()
        if scores is None:
          self._count("deadline_rows" if not why else "failed_rows", len(rows))
          if why:
            self.last_errors.append(why)
          continue
        for i, s in zip(rows, scores):
          out[i] = s if s is not None and math.isfinite(s) else math.nan
        self._count("null_scores", sum(s is None for s in scores))
        self._count("nonfinite_scores", sum(s is not None and not math.isfinite(s) for s in scores))
    finally:
      pool.shutdown(wait=False, cancel_futures=True)  # a request still running ends by its own (cut) timeout
    return out
