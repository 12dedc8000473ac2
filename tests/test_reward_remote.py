"""Remote rewards (jaxgrpo.rewards.remote) against a real HTTP server on 127.0.0.1 (``http.server`` in a thread),
with faults injected by the path: slow responses, 500s, malformed JSON, a wrong-length list, a body cut short,
null scores, a flaky server that recovers; plus the concurrency bound and the total deadline."""

from __future__ import annotations

import http.server
import json
import math
import sys
import threading
import time

import numpy as np
import pytest

from jaxgrpo.rewards.remote import RemoteReward
from jaxgrpo.rewards.reward_set import RewardError, RewardSet


def expected(completion: str, answer) -> float:
  """The service's rule (computed here independently): 1 when the completion ends with the answer, plus
  a length bonus of len/100."""
  return float(completion.endswith(str(answer))) + len(completion) / 100


class Handler(http.server.BaseHTTPRequestHandler):
  def log_message(self, *args):  # keep the test output clean
    pass

  def _leave(self):
    """This request stops counting as in flight: before its reply is written, since the client may send its next
    request the moment the reply arrives (counting until after the write saw one request more than the client
    ever had outstanding)."""
    if self._counted:
      self._counted = False
      with self.server.lock:
        self.server.in_flight -= 1

  def _reply(self, code: int, body: bytes, length: int | None = None):
    self._leave()
    self.send_response(code)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(body) if length is None else length))
    self.end_headers()
    self.wfile.write(body)

  def do_POST(self):
    srv = self.server
    payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    with srv.lock:
      srv.requests.append((self.path, payload))
      srv.in_flight += 1
      srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
      calls = srv.calls[self.path] = srv.calls.get(self.path, 0) + 1
    self._counted = True
    try:
      comps, answers = payload["completions"], payload["metadata"].get("answer", [""] * len(payload["completions"]))
      scores = [expected(c, a) for c, a in zip(comps, answers)]
      path = self.path
      if path == "/flaky" and calls <= 2:
        path = "/fail"
      if path in ("/ok", "/flaky"):
        time.sleep(0.05)  # long enough for requests to overlap; under load, up to 2 s until a second one arrives
        for _ in range(40 if srv.await_overlap else 0):
          if srv.max_in_flight >= 2:
            break
          time.sleep(0.05)
        self._reply(200, json.dumps({"scores": scores}).encode())
      elif path == "/slow":
        time.sleep(3.0)
        self._reply(200, json.dumps({"scores": scores}).encode())
      elif path == "/fail":
        self._reply(500, b'{"error": "boom"}')
      elif path == "/bad_request":
        self._reply(400, b'{"error": "bad"}')
      elif path == "/malformed":
        self._reply(200, b'{"scores": [1.0, 2.0')
      elif path == "/wrong_length":
        self._reply(200, json.dumps({"scores": scores[:-1]}).encode())
      elif path == "/cut":  # promises more bytes than it sends, then closes the connection
        self._reply(200, json.dumps({"scores": scores}).encode()[:10], length=500)
        self.close_connection = True
      elif path == "/infinite":  # what json.dumps(float("inf")) writes, and a literal that overflows a double
        self._reply(200, b'{"scores": [Infinity, -Infinity, 1e999, 0.5, NaN]}')
      elif path == "/trickle":  # headers at once, then the body one byte every 0.2 s (each read within the timeout)
        body = json.dumps({"scores": scores}).encode()
        self._leave()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        for i in range(len(body)):
          self.wfile.write(body[i : i + 1])
          self.wfile.flush()
          time.sleep(0.2)
      elif path == "/nulls":  # the service could not score the odd rows
        self._reply(200, json.dumps({"scores": [s if i % 2 == 0 else None for i, s in enumerate(scores)]}).encode())
    finally:
      self._leave()


class Server(http.server.ThreadingHTTPServer):
  daemon_threads = True

  def handle_error(self, request, client_address):
    """Quiet when the client gave up first (a timed-out or abandoned request): that is the test's point."""
    if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
      super().handle_error(request, client_address)


@pytest.fixture()
def server():
  srv = Server(("127.0.0.1", 0), Handler)
  srv.lock, srv.requests, srv.calls, srv.in_flight, srv.max_in_flight = threading.Lock(), [], {}, 0, 0
  srv.await_overlap = False
  thread = threading.Thread(target=srv.serve_forever, daemon=True)
  thread.start()
  srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
  yield srv
  srv.shutdown()
  srv.server_close()


ROWS = 10
PROMPTS = [f"What is {i} + {i}?" for i in range(ROWS)]
COMPLETIONS = [f"{i}+{i}={2 * i + (i % 3 == 0)}" for i in range(ROWS)]
ANSWERS = [str(2 * i) for i in range(ROWS)]
WANT = [expected(c, a) for c, a in zip(COMPLETIONS, ANSWERS)]


def test_scores_batched_concurrent_and_bounded(server):
  server.await_overlap = True
  fn = RemoteReward(server.url + "/ok", batch_size=3, max_concurrency=2, backoff_s=0.01)
  got = fn(PROMPTS, COMPLETIONS, answer=ANSWERS, level=[np.int64(i) for i in range(ROWS)])
  np.testing.assert_allclose(got, WANT, rtol=0, atol=1e-12)
  assert len(server.requests) == 4  # 3 + 3 + 3 + 1 rows
  sent = [p for _, p in server.requests]
  assert sorted(len(p["prompts"]) for p in sent) == [1, 3, 3, 3]
  assert sorted(q for p in sent for q in p["prompts"]) == sorted(PROMPTS)
  for p in sent:  # each request's rows travel together: prompt i with completion i and answer i
    assert [PROMPTS.index(q) for q in p["prompts"]] == [COMPLETIONS.index(c) for c in p["completions"]]
    assert p["metadata"]["answer"] == [ANSWERS[PROMPTS.index(q)] for q in p["prompts"]]
  assert all(set(p["metadata"]) == {"answer", "level"} for p in sent)  # NumPy values sent as JSON numbers
  assert {v for p in sent for v in p["metadata"]["level"]} == set(range(ROWS))
  assert server.max_in_flight == 2  # overlapped, never more than the bound
  assert fn.pop_counters() == {"requests": 4}


def test_a_flaky_server_is_retried_with_backoff(server):
  fn = RemoteReward(server.url + "/flaky", batch_size=ROWS, retries=2, backoff_s=0.05)
  t0 = time.monotonic()
  got = fn(PROMPTS, COMPLETIONS, answer=ANSWERS)
  waited = time.monotonic() - t0
  np.testing.assert_allclose(got, WANT, rtol=0, atol=1e-12)
  assert fn.pop_counters() == {"requests": 3, "retries": 2, "http_errors": 2}
  assert waited >= 0.5 * (0.05 + 0.1)  # two backoffs (jitter >= 0.5)


@pytest.mark.parametrize(
  "path,kind",
  [
    ("/fail", "http_errors"),
    ("/malformed", "bad_responses"),
    ("/wrong_length", "bad_responses"),
    ("/cut", "bad_responses"),
  ],
)
def test_failures_are_missing_samples_and_counted(server, path, kind):
  fn = RemoteReward(server.url + path, batch_size=4, retries=1, backoff_s=0.01, metadata_columns=["answer"])
  got = fn(PROMPTS, COMPLETIONS, answer=ANSWERS, other=[object()] * ROWS)
  assert all(math.isnan(x) for x in got)
  assert fn.pop_counters() == {"requests": 6, "retries": 3, kind: 6, "failed_rows": ROWS}
  assert len(fn.last_errors) == 3 and all(e.startswith(kind) for e in fn.last_errors)
  assert server.calls[path] == 6
  assert all(set(p["metadata"]) == {"answer"} for _, p in server.requests)


def test_client_errors_are_not_retried_and_nulls_are_missing(server):
  fn = RemoteReward(server.url + "/bad_request", batch_size=ROWS, retries=3, backoff_s=0.01)
  assert all(math.isnan(x) for x in fn(PROMPTS, COMPLETIONS))
  assert fn.pop_counters() == {"requests": 1, "http_errors": 1, "failed_rows": ROWS}
  fn = RemoteReward(server.url + "/nulls", batch_size=4)
  got = fn(PROMPTS, COMPLETIONS, answer=ANSWERS)
  for i in range(ROWS):  # rows 1, 3 of each batch of 4 are null: NaN; the others scored
    assert math.isnan(got[i]) if (i % 4) % 2 else got[i] == pytest.approx(WANT[i])
  assert fn.pop_counters() == {"requests": 3, "null_scores": 5}


def test_a_slow_server_times_out_and_the_deadline_bounds_the_call(server):
  fn = RemoteReward(server.url + "/slow", batch_size=5, timeout_s=0.3, retries=1, backoff_s=0.01)
  t0 = time.monotonic()
  got = fn(PROMPTS, COMPLETIONS)
  assert time.monotonic() - t0 < 1.5  # 2 attempts of 0.3 s, both batches in parallel
  assert all(math.isnan(x) for x in got)
  assert fn.pop_counters() == {"requests": 4, "retries": 2, "timeouts": 4, "failed_rows": ROWS}
  # the deadline cuts the per-request timeout (10 s) and abandons what is left: the call returns in time
  fn = RemoteReward(server.url + "/slow", batch_size=2, max_concurrency=2, timeout_s=10.0, deadline_s=0.5)
  t0 = time.monotonic()
  got = fn(PROMPTS, COMPLETIONS)
  assert time.monotonic() - t0 < 1.0
  assert all(math.isnan(x) for x in got)
  c = fn.pop_counters()
  assert c.get("failed_rows", 0) + c.get("deadline_rows", 0) == ROWS and c["deadline_rows"] >= 6, c


def test_missing_rows_stay_nan_in_a_reward_set(server):
  fn = RemoteReward(server.url + "/nulls", batch_size=ROWS, name="service")
  res = RewardSet([(fn, 0.5)], on_error="raise")(PROMPTS, COMPLETIONS, {"answer": ANSWERS})
  odd = np.arange(ROWS) % 2 == 1
  assert np.isnan(res.total[odd]).all() and np.isnan(res.per_fn["service"][odd]).all()
  np.testing.assert_allclose(res.total[~odd], 0.5 * np.asarray(WANT)[~odd], rtol=1e-6)
  assert res.counters == {"service/requests": 1, "service/null_scores": 5, "service/missing": 5}


def test_infinite_scores_are_missing_samples_on_every_path(server):
  """``Infinity``/``-Infinity``/``1e999``/``NaN`` in a reply are missing samples (NaN, counted ``nonfinite_scores``)
  the same way alone, in a RewardSet that raises and in one that zeroes errors: before, they came back as ±inf,
  a RewardSet raised, and ``on_error="zero"`` scored them 0 (real advantages, nothing counted missing)."""
  fn = RemoteReward(server.url + "/infinite", batch_size=5, name="service")
  got = fn(PROMPTS[:5], COMPLETIONS[:5])
  assert [math.isnan(x) for x in got] == [True, True, True, False, True] and got[3] == 0.5
  assert fn.pop_counters() == {"requests": 1, "nonfinite_scores": 4}
  for on_error in ("raise", "zero"):
    res = RewardSet([(fn, 2.0)], on_error=on_error)(PROMPTS[:5], COMPLETIONS[:5])
    want = np.array([np.nan, np.nan, np.nan, 1.0, np.nan], np.float32)
    np.testing.assert_array_equal(res.total, want)
    assert res.counters == {"service/requests": 1, "service/nonfinite_scores": 4, "service/missing": 4}


def test_an_infinite_score_of_a_nan_is_missing_function_is_missing_in_a_reward_set():
  """The rule holds for any learned reward (``nan_is_missing``): ±inf is missing (NaN, counted), never an error
  or a 0; a plain verifiable function's inf stays an error."""

  class Learned:
    nan_is_missing = True
    __name__ = "learned"

    def __call__(self, prompts, completions, **columns):
      return [math.inf, -math.inf, math.nan, 0.25]

  for on_error in ("raise", "zero"):
    res = RewardSet([Learned()], on_error=on_error)(["p"] * 4, ["c"] * 4)
    assert np.isnan(res.total[:3]).all() and res.total[3] == 0.25
    assert res.counters == {"learned/missing": 3, "learned/nonfinite": 2}
  with pytest.raises(RewardError, match="non-finite reward inf"):
    RewardSet([lambda p, c: [math.inf]])(["p"], ["c"])


def test_an_attempt_cut_by_the_deadline_is_a_request_and_a_timeout(server):
  """A body still arriving at the deadline (each byte within the socket timeout): the call returns at the deadline
  and counts the attempt (before: ``deadline_rows`` only, no request, no timeout)."""
  fn = RemoteReward(server.url + "/trickle", batch_size=ROWS, retries=2, timeout_s=5.0, deadline_s=0.6)
  t0 = time.monotonic()
  got = fn(PROMPTS, COMPLETIONS)
  assert time.monotonic() - t0 < 1.5
  assert all(math.isnan(x) for x in got)
  assert fn.pop_counters() == {"requests": 1, "timeouts": 1, "deadline_rows": ROWS}


def test_arguments_are_checked():
  with pytest.raises(ValueError, match="`url` must be an http"):
    RemoteReward("ftp://x")
  with pytest.raises(ValueError, match="`max_concurrency` must be >= 1"):
    RemoteReward("http://127.0.0.1:1", max_concurrency=0)
  with pytest.raises(ValueError, match="`deadline_s` must be > 0"):
    RemoteReward("http://127.0.0.1:1", deadline_s=0)
  with pytest.raises(ValueError, match="metadata_columns"):
    RemoteReward("http://127.0.0.1:1", metadata_columns=["answer"])(["p"], ["c"])
