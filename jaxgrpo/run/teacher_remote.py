"""A distillation teacher outside the train mesh: on another machine — the server that scores rows with this
library's own teacher pass (:class:`TeacherScorer`, :func:`make_server`; ``scripts/teacher_server.py`` is its
command line) and the run's connection to one (``objective.distill.teacher: http://host:port``) — or in vLLM
(``vllm:<local teacher>``: ``jaxgrpo.rollout.engines.vllm_teacher``). :func:`connect` builds either.

The protocol and the client's failure behaviour are ``jaxgrpo.step.teacher_remote``'s docstring. The server
loads a local teacher (``jaxgrpo.run.teacher.load_teacher``: ``synthetic:...``, an HF directory, a run
directory), places it on its own devices (all of them, on the ``fsdp`` axis unless ``mesh`` says otherwise) and
answers ``/score`` with the reference pass of :func:`jaxgrpo.step.train.make_reference_fn` — chunked, float32,
top-k taken chunk by chunk on the devices that hold the parameters — the program the in-process teacher
(``jaxgrpo.step.feed.make_teacher``) runs, so the numbers are the in-process teacher's (tests/test_teacher_remote.py:
within 1e-6). One request is scored at a time (a lock); ``/info`` answers meanwhile. A request whose fields are
missing, of the wrong shapes or dtypes, or holds a token id outside ``[0, V)`` gets a 400 with one line.
"""

from __future__ import annotations

import http.server
import json
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout.engines import vllm_teacher
from jaxgrpo.run.specs import TrainerConfig
from jaxgrpo.run.teacher import check_tokenizers, load_teacher, tokenizer_fingerprint
from jaxgrpo.step.batch import Batch
from jaxgrpo.step.feed import check_teacher_vocab
from jaxgrpo.step.state import TrainConfig
from jaxgrpo.step.teacher_remote import (
  PROTOCOL,
  HostTeacher,
  RemoteTeacher,
  TeacherUnavailable,
  decode_array,
  encode_array,
)
from jaxgrpo.step.train import make_reference_fn

__all__ = ["TeacherScorer", "connect", "make_server"]


class TeacherScorer:
  """A teacher model on this host's devices and its scoring of protocol requests.

  Args:
    teacher: what :func:`jaxgrpo.run.teacher.load_teacher` loads (``synthetic:<h>x<l>``, HF dir, run dir).
    seed: a synthetic teacher's initialisation seed (a run's in-process synthetic teacher uses ``run.seed + 1``).
    dtype, param_dtype: the synthetic and HF forms' dtypes.
    chunk_size: positions per chunk of the float32 logits (``TrainConfig.chunk_size``).
    mesh: the server's mesh spec (``jaxgrpo.parallel.sharding.make_mesh``; None: every device on ``fsdp``).
  """

  def __init__(self, teacher: str, *, seed: int = 1, dtype="float32", param_dtype="float32", chunk_size=256, mesh=None):
    model, tokenizer = load_teacher(teacher, seed=seed, dtype=dtype, param_dtype=param_dtype)
    self.teacher, self.chunk_size = teacher, chunk_size
    self.vocab_size = int(model.config.vocab_size)
    self.fingerprint = tokenizer_fingerprint(tokenizer)
    self.mesh = shd.make_mesh(mesh)
    self.graphdef, params = nnx.split(model)
    self.shardings = shd.tree_shardings(params, self.mesh, model.rules)
    self.params = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=self.shardings)(params)
    self.rows = shd.batch_shards(self.mesh, model.rules)  # a request's rows are padded to a multiple of this
    self.n_params = sum(x.size for x in jax.tree.leaves(params))
    self._fns: dict = {}
    self._lock = threading.Lock()

  def info(self) -> dict:
    """The ``/info`` answer."""
    return {
      "protocol": PROTOCOL,
      "vocab_size": self.vocab_size,
      "tokenizer_fingerprint": self.fingerprint,
      "teacher": self.teacher,
      "parameters": int(self.n_params),
    }

  def _fn(self, temperature: float, top_k: int | None):
    key = (temperature, top_k)
    if key not in self._fns:
      tc = TrainConfig(temperature=temperature, chunk_size=self.chunk_size)
      self._fns[key] = make_reference_fn(
        self.graphdef, mesh=self.mesh, param_shardings=self.shardings, train_config=tc, top_k=top_k
      )
    return self._fns[key]

  def score(self, request: dict) -> dict:
    """The ``/score`` answer of a decoded JSON request (ValueError in one line for a bad one)."""
    rows = _request_rows(request, self.vocab_size)
    temperature, top_k = _request_options(request)
    b, t = rows["completions"].shape
    pad = -b % self.rows
    rows = {n: np.concatenate([x, np.repeat(x[:1], pad, 0)]) if pad else x for n, x in rows.items()}
    batch = Batch(
      rows["prompt_tokens"],
      rows["prompt_mask"],
      rows["completions"],
      rows["mask"],
      np.zeros((b + pad, t), np.float32),
      np.zeros(b + pad, np.int32),
      None,
    )
    with self._lock:
      out = jax.device_get(self._fn(temperature, top_k)(self.params, batch))
    if top_k is None:
      return {"logp": encode_array(np.asarray(out)[:b])}
    logp, ids, topk = (np.asarray(x)[:b] for x in out)
    return {"logp": encode_array(logp), "topk_ids": encode_array(ids), "topk_logp": encode_array(topk)}


def _request_rows(request: dict, vocab: int) -> dict:
  """The four row arrays of a ``/score`` request, checked (ValueError in one line naming the field)."""
  if not isinstance(request, dict):
    raise ValueError("the body must be a JSON object with prompt_tokens, prompt_mask, completions, mask")
  rows = {}
  for name, kind in (("prompt_tokens", "int32"), ("prompt_mask", "bool"), ("completions", "int32"), ("mask", "bool")):
    if name not in request:
      raise ValueError(f"`{name}` is missing: a /score request carries prompt_tokens, prompt_mask, completions, mask")
    x = decode_array(request[name], name)
    if str(x.dtype) != kind or x.ndim != 2:
      raise ValueError(f"`{name}` must be {kind}[B, {'P' if 'prompt' in name else 'T'}]; got {x.dtype}{list(x.shape)}")
    rows[name] = x
  b, p = rows["prompt_tokens"].shape
  if rows["prompt_mask"].shape != (b, p) or rows["mask"].shape != rows["completions"].shape:
    raise ValueError("`prompt_mask` must have prompt_tokens' shape and `mask` completions' shape")
  if rows["completions"].shape[0] != b or b == 0 or p == 0:
    raise ValueError(
      f"prompt_tokens has {b} rows × {p} slots, completions {rows['completions'].shape[0]} rows: "
      "the same B >= 1 rows and P >= 1 are needed"
    )
  for name in ("prompt_tokens", "completions"):
    bad = (rows[name] < 0) | (rows[name] >= vocab)
    if bad.any():
      raise ValueError(f"`{name}` holds id {int(rows[name][bad][0])} outside the teacher's vocabulary [0, {vocab})")
  return rows


def _request_options(request: dict) -> tuple[float, int | None]:
  temperature, top_k = request.get("temperature", 1.0), request.get("top_k")
  if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
    raise ValueError(f"`temperature` must be a number > 0; got {temperature!r}")
  if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
    raise ValueError(f"`top_k` must be an integer >= 1 or null; got {top_k!r}")
  return float(temperature), top_k


def make_server(scorer: TeacherScorer, host: str = "127.0.0.1", port: int = 0) -> http.server.ThreadingHTTPServer:
  """An HTTP server (not yet serving: call ``serve_forever``) answering ``GET /info`` and ``POST /score`` with
  ``scorer``; ``port`` 0 picks a free one (``server.server_address``)."""

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _send(self, code: int, body: dict):
      data = json.dumps(body).encode()
      self.send_response(code)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)

    def do_GET(self):
      if self.path.rstrip("/") != "/info":
        return self._send(404, {"error": f"no {self.path}: GET /info or POST /score"})
      self._send(200, scorer.info())

    def do_POST(self):
      if self.path.rstrip("/") != "/score":
        return self._send(404, {"error": f"no {self.path}: GET /info or POST /score"})
      try:
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        answer = scorer.score(request)
      except ValueError as e:
        return self._send(400, {"error": str(e).splitlines()[0] if str(e) else type(e).__name__})
      self._send(200, answer)

    def log_message(self, *args):  # one line per request would flood a run's output
      pass

  return http.server.ThreadingHTTPServer((host, port), Handler)


def connect(
  cfg: TrainerConfig,
  policy_tokenizer,
  *,
  student_vocab: int,
  train_config: TrainConfig,
  log: Callable[[str], None] | None = None,
):
  """The run's teacher outside the train mesh (``cfg.objective.distill.teacher``: an ``http(s)://`` URL or
  ``vllm:<local teacher>``), scoring at the step's temperature with the top-k of a top-k form (``distill.top_k``).

  A server is checked at start: it answers ``/info`` (else ValueError, one line), its vocabulary size is
  ``student_vocab`` and its tokenizer fingerprint the policy's (one line each): a
  :class:`~jaxgrpo.step.teacher_remote.RemoteTeacher`. A vLLM teacher is loaded here
  (``jaxgrpo.run.teacher.load_teacher``, its tokenizer checked like an in-process teacher's), its weights pushed
  into vLLM: a :class:`~jaxgrpo.step.teacher_remote.HostTeacher` of
  :class:`~jaxgrpo.rollout.engines.vllm_teacher.VLLMTeacher` (temperature 1 only)."""
  d = cfg.objective.distill
  if jax.process_count() > 1:
    raise ValueError(
      f"`objective.distill.teacher`={d.teacher!r}: a teacher outside the train mesh runs with a single process "
      "(the rows would be gathered from every host); use an in-process teacher on several processes"
    )
  top_k = None if d.sampled else d.top_k
  if d.teacher.startswith("vllm:"):
    return _vllm_teacher(cfg, policy_tokenizer, student_vocab, train_config, top_k, log)
  teacher = RemoteTeacher(d.teacher, top_k=top_k, temperature=train_config.temperature)
  try:
    info = teacher.check(student_vocab, tokenizer_fingerprint(policy_tokenizer))
  except TeacherUnavailable as e:  # at start: a wrong URL or a server not started, a bad input (exit 2 in the CLI)
    raise ValueError(f"`objective.distill.teacher`: {e}") from None
  if log is not None:
    n = info.get("parameters")
    n = f"{n:,}" if isinstance(n, int) else "?"
    log(
      f"teacher: {d.teacher} (remote: {info.get('teacher')}, {n} parameters), distill kind={d.kind} weight={d.weight}"
    )
  return teacher


def _vllm_teacher(cfg, policy_tokenizer, student_vocab, train_config, top_k, log):
  d = cfg.objective.distill
  vllm_teacher.check_engine_temperature(train_config.temperature)  # before anything loads
  model, tokenizer = load_teacher(
    d.teacher[5:], seed=cfg.run.seed + 1, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype
  )
  check_tokenizers(policy_tokenizer, tokenizer, d.teacher)
  check_teacher_vocab(student_vocab, model.config.vocab_size)
  engine = vllm_teacher.VLLMTeacher(model, top_k=top_k, temperature=train_config.temperature)
  if log is not None:
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    log(f"teacher: {d.teacher} (vLLM prompt_logprobs, {n:,} parameters), distill kind={d.kind} weight={d.weight}")
  return HostTeacher(engine.scores, top_k)
