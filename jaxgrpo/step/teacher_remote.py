"""A distillation teacher served over HTTP (``objective.distill.teacher: http://host:port``): the client side.

The teacher runs elsewhere (another machine, other accelerators: ``scripts/teacher_server.py``, which serves a
model with this library's own chunked float32 teacher pass, ``jaxgrpo.run.teacher_remote``); the learner sends
it the token ids of each row and receives the teacher's log-prob of every given token and, for a top-k
distillation form, its top-k (ids, log-probs) at each position: only the top-k leave the server.

The protocol (JSON both ways; an array is ``{"dtype": "int32" | "bool" | "float32", "shape": [...], "data":
base64 of its little-endian bytes, row-major}``, exact for float32)::

    GET  /info   -> {"protocol": 1, "vocab_size": V, "tokenizer_fingerprint": "sha256:...", "teacher": str}
    POST /score  {"prompt_tokens": int32[B, P], "prompt_mask": bool[B, P],      # left-padded prompts
                  "completions": int32[B, T], "mask": bool[B, T],             # the scored positions
                  "temperature": float, "top_k": int | null}
             -> {"logp": float32[B, T], "topk_ids": int32[B, T, k], "topk_logp": float32[B, T, k]}   # top-k
                                                                     only with top_k

``logp[i, t]`` is ``log π_t(completions[i, t] | prompt_i, completions[i, :t])`` at ``temperature`` (the
logits divided by it), the numbers of :class:`jaxgrpo.step.feed.Teacher` for the same weights; positions
outside ``mask`` carry no meaning. A 4xx answer's body is ``{"error": one line}``.

Failures (:class:`RemoteTeacher`): a connection refused or reset, a request longer than ``timeout_s``, a 5xx,
408 or 429 answer, or a body that is not JSON are retried ``retries`` times after ``backoff_s · 2^attempt``
seconds; then :class:`TeacherUnavailable` (one line naming the URL, the attempts and the last error). Nothing
is filled in with a made-up number: a batch the teacher did not score is not trained, and the run stops (its
last checkpoint resumes once the server is back). Another 4xx (the request was refused: its one-line reason
is passed on) and a response of the wrong fields, shapes, dtypes or non-finite log-probs at scored positions
raise :class:`TeacherProtocolError` at once. At connection (:meth:`RemoteTeacher.check`) the server's
vocabulary size and tokenizer fingerprint are compared with the policy's, one line each.

Standard library only (``urllib.request``), one request per call of the teacher; single process (the batch's
rows are gathered to this host).
"""

from __future__ import annotations

import base64
import json
import socket
import time
import urllib.error
import urllib.request
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from jaxgrpo.step.batch import Batch

__all__ = [
  "PROTOCOL",
  "HostTeacher",
  "RemoteTeacher",
  "TeacherProtocolError",
  "TeacherUnavailable",
  "decode_array",
  "encode_array",
  "fill_teacher_fields",
  "is_remote_teacher",
]

PROTOCOL = 1
_DTYPES = {"int32": np.int32, "bool": np.bool_, "float32": np.float32}
_RETRY_STATUS = (408, 429)


class TeacherUnavailable(RuntimeError):
  """The teacher server did not answer (connection error, timeout, 5xx) after every attempt."""


class TeacherProtocolError(ValueError):
  """The teacher server refused the request (4xx) or answered outside the protocol (fields, shapes, dtypes)."""


def is_remote_teacher(teacher: str | None) -> bool:
  """Whether ``objective.distill.teacher`` names a teacher server (``http://`` or ``https://``)."""
  return isinstance(teacher, str) and teacher.startswith(("http://", "https://"))


def is_served_teacher(teacher: str | None) -> bool:
  """Whether ``objective.distill.teacher`` is served outside the run's JAX devices: a teacher server
  (:func:`is_remote_teacher`) or vLLM (``vllm:...``); nothing of it is resident on the train devices."""
  return is_remote_teacher(teacher) or (isinstance(teacher, str) and teacher.startswith("vllm:"))


def encode_array(x) -> dict:
  """``x`` (int32, bool or float32 after conversion by kind) as the protocol's ``{"dtype", "shape", "data"}``."""
  x = np.asarray(x)
  kind = "bool" if x.dtype == np.bool_ else "float32" if np.issubdtype(x.dtype, np.floating) else "int32"
  x = np.ascontiguousarray(x, dtype=np.dtype(_DTYPES[kind]).newbyteorder("<"))
  return {"dtype": kind, "shape": list(x.shape), "data": base64.b64encode(x.tobytes()).decode("ascii")}


def decode_array(obj: Any, name: str) -> np.ndarray:
  """The array of a protocol ``{"dtype", "shape", "data"}`` object (ValueError in one line naming ``name``)."""
  if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"} or obj["dtype"] not in _DTYPES:
    raise ValueError(f"`{name}` must be {{'dtype': one of {sorted(_DTYPES)}, 'shape': [...], 'data': base64}}")
  shape = obj["shape"]
  if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
    raise ValueError(f"`{name}`: shape must be a list of sizes >= 0; got {shape!r}")
  dtype = np.dtype(_DTYPES[obj["dtype"]]).newbyteorder("<")
  try:
    raw = base64.b64decode(obj["data"], validate=True)
  except (TypeError, ValueError) as e:
    raise ValueError(f"`{name}`: data is not base64 ({e})") from None
  if len(raw) != dtype.itemsize * int(np.prod(shape)):
    raise ValueError(f"`{name}`: {len(raw)} bytes of data for shape {shape} {obj['dtype']}")
  return np.frombuffer(raw, dtype).reshape(shape).astype(_DTYPES[obj["dtype"]])


class RemoteTeacher:
  """The teacher of a distillation term served over HTTP (module docstring): a drop-in for
  :class:`jaxgrpo.step.feed.Teacher` in the learner.

  ``teacher(batch)`` returns ``batch`` with ``teacher_logp`` ``f32[B, T]`` and, with ``top_k`` = k,
  ``teacher_topk_ids`` ``int32[B, T, k]`` and ``teacher_topk_logp`` ``f32[B, T, k]`` filled in, placed like
  ``batch.mask`` (a placed batch's sharding; a NumPy batch gets NumPy arrays).

  Args:
    url: the server's base URL (``http://host:port``; ``/info`` and ``/score`` are appended).
    top_k: k for a top-k distillation form, None for the sampled-token form.
    temperature: the temperature the log-probs refer to (the step's ``TrainConfig.temperature``).
    timeout_s: the limit of one request (connect + answer).
    retries: further attempts after a failed one; ``backoff_s``: the wait before retry a is ``backoff_s·2^a``.
  """

  def __init__(
    self,
    url: str,
    *,
    top_k: int | None = None,
    temperature: float = 1.0,
    timeout_s: float = 120.0,
    retries: int = 3,
    backoff_s: float = 1.0,
  ):
    if not is_remote_teacher(url):
      raise ValueError(f"RemoteTeacher url={url!r}: give the server's `http://host:port` (scripts/teacher_server.py)")
    self.url, self.top_k, self.temperature = url.rstrip("/"), top_k, float(temperature)
    self.timeout_s, self.retries, self.backoff_s = float(timeout_s), int(retries), float(backoff_s)
    self.requests = 0

  def _request(self, path: str, body: dict | None) -> dict:
    """The JSON answer of one GET (``body`` None) or POST, retried as the module docstring says."""
    data = None if body is None else json.dumps(body).encode()
    last = ""
    for attempt in range(self.retries + 1):
      if attempt:
        time.sleep(self.backoff_s * 2 ** (attempt - 1))
      req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
      self.requests += 1
      try:
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
          raw = resp.read()
      except urllib.error.HTTPError as e:
        why = _error_line(e)
        if e.code < 500 and e.code not in _RETRY_STATUS:
          raise TeacherProtocolError(
            f"remote teacher {self.url}{path} refused the request: HTTP {e.code}: {why}"
          ) from None
        last = f"HTTP {e.code}: {why}"
        continue
      except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError, OSError) as e:
        last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        continue
      try:
        return json.loads(raw)
      except ValueError:
        last = f"a body that is not JSON ({len(raw)} bytes)"
    raise TeacherUnavailable(
      f"remote teacher {self.url}{path}: no answer after {self.retries + 1} attempts (timeout_s={self.timeout_s}, "
      f"retries={self.retries}; last: {last}); start or restart scripts/teacher_server.py there — the run stops "
      "here and resumes from its last checkpoint"
    )

  def info(self) -> dict:
    """The server's ``/info`` (protocol, vocabulary size, tokenizer fingerprint, what it serves)."""
    info = self._request("/info", None)
    if not isinstance(info, dict) or not {"protocol", "vocab_size", "tokenizer_fingerprint"} <= set(info):
      raise TeacherProtocolError(f"remote teacher {self.url}/info: not a teacher server's answer: {str(info)[:200]}")
    return info

  def check(self, student_vocab: int, fingerprint: str | None) -> dict:
    """The server's ``/info`` after checking, one line each, its protocol, that its vocabulary size is
    ``student_vocab`` and (unless None) that its tokenizer fingerprint is ``fingerprint``."""
    info = self.info()
    if info["protocol"] != PROTOCOL:
      raise TeacherProtocolError(
        f"remote teacher {self.url}: protocol {info['protocol']!r}, this client speaks {PROTOCOL}: run the server "
        "of this library's version"
      )
    if int(info["vocab_size"]) != int(student_vocab):
      raise ValueError(
        f"remote teacher {self.url}: vocab_size={info['vocab_size']} but the policy's is {student_vocab}: the "
        "teacher must share the policy's tokenizer (it scores the policy's token ids)"
      )
    if fingerprint is not None and info["tokenizer_fingerprint"] != fingerprint:
      raise ValueError(
        f"remote teacher {self.url}: tokenizer fingerprint {info['tokenizer_fingerprint']} but the policy's is "
        f"{fingerprint}: the same vocabulary size, other token strings; serve a teacher of the policy's tokenizer"
      )
    return info

  def scores(self, prompt_tokens, prompt_mask, completions, mask):
    """``(logp f32[B, T], ids int32[B, T, k] | None, topk_logp f32[B, T, k] | None)`` of host rows, checked."""
    b, t = np.shape(completions)
    body = {
      "prompt_tokens": encode_array(np.asarray(prompt_tokens, np.int32)),
      "prompt_mask": encode_array(np.asarray(prompt_mask, bool)),
      "completions": encode_array(np.asarray(completions, np.int32)),
      "mask": encode_array(np.asarray(mask, bool)),
      "temperature": self.temperature,
      "top_k": self.top_k,
    }
    out = self._request("/score", body)
    want = {"logp": ("float32", (b, t))}
    if self.top_k is not None:
      want.update(topk_ids=("int32", (b, t, self.top_k)), topk_logp=("float32", (b, t, self.top_k)))
    got = {}
    for name, (dtype, shape) in want.items():
      try:
        got[name] = decode_array(out.get(name) if isinstance(out, dict) else None, name)
      except ValueError as e:
        raise TeacherProtocolError(f"remote teacher {self.url}/score answered outside the protocol: {e}") from None
      if str(got[name].dtype) != dtype or got[name].shape != shape:
        raise TeacherProtocolError(
          f"remote teacher {self.url}/score: `{name}` is {got[name].dtype}{list(got[name].shape)}, expected "
          f"{dtype}{list(shape)} for the {b} rows × {t} positions sent"
        )
    scored = np.asarray(mask, bool)
    if not np.isfinite(got["logp"][scored]).all():
      raise TeacherProtocolError(f"remote teacher {self.url}/score: non-finite `logp` at scored positions")
    return got["logp"], got.get("topk_ids"), got.get("topk_logp")

  def log_probs(self, batch: Batch):
    """``f32[B, T]`` the teacher's log-probs of ``batch``'s completions."""
    return self(batch).teacher_logp

  def __call__(self, batch: Batch) -> Batch:
    return fill_teacher_fields(batch, self.scores)


class HostTeacher(NamedTuple):
  """A teacher that scores host rows (an engine's: ``jaxgrpo.rollout.engines.vllm_teacher.VLLMTeacher``), as a
  drop-in for :class:`jaxgrpo.step.feed.Teacher`: ``scores(prompt_tokens, prompt_mask, completions, mask) ->
  (logp f32[B, T], ids int32[B, T, k] | None, topk_logp f32[B, T, k] | None)``, ``top_k`` its k or None."""

  scores: Callable
  top_k: int | None = None

  def log_probs(self, batch: Batch):
    """``f32[B, T]`` the teacher's log-probs of ``batch``'s completions."""
    return self(batch).teacher_logp

  def __call__(self, batch: Batch) -> Batch:
    return fill_teacher_fields(batch, self.scores)


def fill_teacher_fields(batch: Batch, scores: Callable) -> Batch:
  """``batch`` with ``teacher_logp`` (and the top-k fields when ``scores`` returns them) from ``scores`` of its
  rows gathered to this host, placed like ``batch.mask`` (NumPy for a NumPy batch). Single process only."""
  if jax.process_count() > 1:
    raise ValueError(
      "a teacher served outside the train mesh (a server or an engine) runs in a single process: the batch's rows "
      "would have to be gathered from every host; use an in-process teacher on several processes"
    )
  host = [
    np.asarray(jax.device_get(getattr(batch, n))) for n in ("prompt_tokens", "prompt_mask", "completions", "mask")
  ]
  logp, ids, topk = scores(*host)
  sharding = getattr(batch.mask, "sharding", None)
  place = (lambda x: x) if sharding is None else (lambda x: jax.device_put(x, sharding))
  if ids is None:
    return batch._replace(teacher_logp=place(logp))
  return batch._replace(teacher_logp=place(logp), teacher_topk_ids=place(ids), teacher_topk_logp=place(topk))


def _error_line(e: urllib.error.HTTPError) -> str:
  """The one-line reason of an HTTP error answer (its JSON ``error``, else the status text)."""
  try:
    body = json.loads(e.read() or b"{}")
  except (ValueError, OSError):
    body = {}
  return str(body.get("error") if isinstance(body, dict) and body.get("error") else e.reason)
