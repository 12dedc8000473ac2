"""Speculative decoding in the built-in sampler, exact: k drafted tokens per row verified by one target forward.

Data flow (N = B·G rows, P prompt slots, T new tokens, k drafted tokens, V vocabulary):

    prompts [B, P] --prefill--> KV cache [B, P+T-1+k] --repeat_cache(G), per-row index--> [N, ...]
    --lax.while_loop (one *verify step* per iteration)-->
        draft  d [N, k]            (prompt lookup: the last n tokens matched earlier in the row's own context;
                                    or a draft model: k decode steps of its own cache, d_i ~ q_i)
        verify logits [N, k+1, V]  (one forward of [last ‖ d] at each row's own slots and positions)
        accept / correct           (the rejection rule below: 1 .. k+1 tokens per row)
        rewind                     (each row's cache index and valid slots back to what it kept)
    --> Rollout (as ``jaxgrpo.rollout.sampling.generate``) and SpeculativeStats

**The rule (exact).** With p_i the *sampling* distribution of the target at draft position i (the filtered,
temperature-scaled softmax of ``sampling.draw_token``: suppressed ids removed, top-k then top-p) and a draft
distribution q_i that proposed d_{i+1} ~ q_i: accept d_{i+1} with probability ``min(1, p_i(d)/q_i(d))``; at the
first rejection draw the token from the residual ``norm(max(p_i − q_i, 0))`` and stop; when all k are accepted,
draw one more from p_k. Every emitted token is then distributed exactly as p (Leviathan et al. 2023, Chen et
al. 2023). A prompt-lookup draft is deterministic (q = a point mass at d): accept with probability p(d), and on
rejection draw from p with d removed, renormalised. Temperature 0: accept iff d is the argmax, else emit the
argmax — the greedy sequence.

**The recorded log-prob** of every emitted token is the target's, ``log_softmax(logits / temperature)[token]``
over the full vocabulary (as ``generate`` records), read from the verify forward's logits at the token's
position: a teacher-forced pass of the target gives the same numbers (tests/test_speculative.py, 1e-5).

One job, speculative sampling: its settings (``SpeculativeConfig``), its drafts (``ngram_draft``, a draft model),
its rule
(``accept_drafts``), its program (``generate_speculative``) and the ``auto`` switch (``SpeculativeSwitch``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import weakref
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxgrpo import _checks
from jaxgrpo import models as _models
from jaxgrpo.models import moe as _moe
from jaxgrpo.models.log_probs import Temperature
from jaxgrpo.parallel import distributed
from jaxgrpo.parallel.target import target_platform
from jaxgrpo.rollout import sampling as _sampling

__all__ = [
  "MODES",
  "SpeculativeConfig",
  "SpeculativeStats",
  "SpeculativeSwitch",
  "accept_drafts",
  "check_draft_model",
  "draft_on_mesh",
  "draft_verify_step",
  "emitted_count",
  "generate_speculative",
  "load_draft",
  "lookup_verify_step",
  "ngram_draft",
  "rewind",
  "verify_step",
  "write_run",
]

MODES = ("off", "ngram", "draft", "auto")
_LOG = logging.getLogger(__name__)
_PLACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # draft model -> {mesh: its replicated copy}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
  """Speculative decoding settings (``rollout.speculative``, ``rollout.speculative_tokens``, ``rollout.ngram``).

  Attributes:
    mode: ``off`` (plain decoding), ``ngram`` (prompt-lookup drafts, always on), ``draft`` (the draft model of
      ``draft``, always on) or ``auto`` (measure plain decoding and the speculative kind — the draft model when
      ``draft`` is set, else ngram — on the first calls, then keep the faster: :class:`SpeculativeSwitch`).
    num_draft: k >= 1, tokens drafted per verify step.
    ngram: n >= 1, the length of the suffix matched in the row's context.
    draft: the draft model's directory (a HF causal LM of the target's tokenizer, :func:`load_draft`), or None.
  """

  mode: str = "ngram"
  num_draft: int = 4
  ngram: int = 2
  draft: str | None = None

  def __post_init__(self):
    _checks.check_choice(self.mode, MODES, "rollout.speculative")
    _checks.check_python_int(self.num_draft, "rollout.speculative_tokens", minimum=1, hint="k drafted tokens")
    _checks.check_python_int(self.ngram, "rollout.speculative_ngram", minimum=1, hint="n, the suffix length matched")
    if self.mode == "draft" and self.draft is None:
      raise ValueError(
        "`rollout.speculative: draft` needs `rollout.speculative_draft`: the directory of a smaller model of the "
        "policy's tokenizer (or rollout.speculative: ngram, drafts from the context)"
      )
    if self.draft is not None and self.mode in ("off", "ngram"):
      raise ValueError(
        f"`rollout.speculative_draft` is set but `rollout.speculative: {self.mode}` never reads it: use draft or "
        "auto, or unset it"
      )


class SpeculativeStats(NamedTuple):
  """What a speculative call did: ``verify_steps int32[]`` (target forwards after the prefill), ``drafted
  int32[]`` (draft tokens proposed to rows still running), ``accepted int32[]`` (of those, accepted)."""

  verify_steps: jax.Array
  drafted: jax.Array
  accepted: jax.Array

  @property
  def acceptance(self) -> float:
    """accepted / drafted (0 when nothing was drafted)."""
    drafted = int(self.drafted)
    return int(self.accepted) / drafted if drafted else 0.0


def ngram_draft(context: jax.Array, valid: jax.Array, end: jax.Array, *, num_draft: int, ngram: int) -> jax.Array:
  """Prompt-lookup drafts: per row, the ``num_draft`` tokens that followed the latest earlier occurrence of the
  row's last ``ngram`` tokens.

  Args:
    context: ``int32[N, L]`` each row's tokens (prompt ‖ generated); valid: ``bool[N, L]`` the real ones.
    end: ``int32[N]``, one past each row's last token (its context is ``context[:end]``; end >= 1).
    num_draft: k; ngram: n (static).

  Returns:
    ``int32[N, k]``: with j the largest index < end−1 with ``context[j−n+1 .. j] == context[end−n .. end−1]`` (all
    valid), ``context[min(j+1+i, end−1)]`` for i < k; no match: the last token repeated. Any deterministic
    function of the context keeps the sample exact (:func:`accept_drafts`); this one only sets the acceptance.
  """
  n_rows, length = context.shape
  cols = jnp.arange(length, dtype=jnp.int32)[None, :]  # [1, L]
  match = (cols < end[:, None] - 1) & (cols >= ngram - 1)  # candidate match ends j
  for i in range(ngram):  # context[j - i] == context[end - 1 - i], both valid
    want = jnp.take_along_axis(context, jnp.maximum(end - 1 - i, 0)[:, None], axis=1)  # [N, 1]
    want_ok = jnp.take_along_axis(valid, jnp.maximum(end - 1 - i, 0)[:, None], axis=1) & (end - 1 - i >= 0)[:, None]
    shifted = jnp.pad(context, ((0, 0), (i, 0)), constant_values=-1)[:, :length]
    shifted_ok = jnp.pad(valid, ((0, 0), (i, 0)))[:, :length]
    match = match & (shifted == want) & shifted_ok & want_ok
  best = jnp.max(jnp.where(match, cols, -1), axis=1)  # [N], -1: none
  last = end - 1
  idx = jnp.where(best[:, None] >= 0, best[:, None] + 1 + jnp.arange(num_draft)[None, :], last[:, None])
  return jnp.take_along_axis(context, jnp.minimum(idx, last[:, None]), axis=1).astype(jnp.int32)


def lookup_verify_step(model, cache, rows, history, start_pos, draw, budget, stop, policy, suppressed, *, k, ngram):
  """One prompt-lookup verify step of per-row decoding (the partial pool's slots, a conversation turn's rows).

  Args:
    rows: ``(tokens int32[N, T], log-probs f32[N, T], lengths int32[N], done bool[N], last int32[N])``: each row's
      tokens so far, its count, whether it ended, its last token (not yet in ``cache``).
    history: ``(int32[N, H], bool[N, H])`` what precedes each row's tokens, left-padded (prompt lookup's context).
    start_pos: ``int32[N]`` the position of each row's token 0 (its cache is per row: slot = position).
    draw: ``draw(lengths) -> f32[N, k+1]`` fresh uniforms for a step emitting from ``lengths`` on.
    budget: ``int32[N]``; stop: stop ids (``emitted_count``'s ``eos_ids``); k, ngram: static.

  Returns:
    ``(cache, rows, int32[3])``: the cache rewound to what each row kept, the rows advanced by 1 .. k+1 tokens
    (0 for ended rows), and (1, drafted, accepted) over the running rows.
  """
  tokens, lengths = rows[0], rows[2]
  hist, hist_mask = history
  context = jnp.concatenate([hist, tokens], axis=1)
  valid = jnp.concatenate([hist_mask, jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]], axis=1)
  drafts = ngram_draft(context, valid, hist.shape[1] + lengths, num_draft=k, ngram=ngram)
  pos = _row_positions(model, start_pos, lengths, k)
  return _keep_verified(model, cache, rows, drafts, None, pos, draw(lengths), budget, stop, policy, suppressed)


def draft_verify_step(model, cache, draft, draft_cache, rows, start_pos, draw, budget, stop, policy, suppressed, *, k):
  """:func:`lookup_verify_step` with the draft model ``draft`` (its per-row ``draft_cache`` holding the same slots
  as ``cache``: each row's context up to, not including, its last token): k tokens d_i ~ q_i of the draft, one
  decode step each, then the target's verify step and the rule with q.

  Args: as :func:`lookup_verify_step` but ``draw(lengths) -> f32[N, 2k+1]`` (k+1 for the rule, then k for the
  draft's draws) and no history.

  Returns:
    ``(cache, draft_cache, rows, int32[3])``: both caches rewound to what each row kept.
  """
  lengths, done, last = rows[2], rows[3], rows[4]
  pos = _row_positions(model, start_pos, lengths, k)
  u = draw(lengths)
  drafts, logq, draft_cache = _draft_tokens(draft, draft_cache, last, pos, ~done, u[:, k + 1 :], policy, suppressed)
  cache, rows, step = _keep_verified(
    model, cache, rows, drafts, logq, pos, u[:, : k + 1], budget, stop, policy, suppressed
  )
  return cache, rewind(draft_cache, cache.index), rows, step


def _row_positions(model, start_pos, lengths, k):
  """``int32[N, k+1]``: the positions of ``[last ‖ k drafts]`` of rows whose token 0 sits at ``start_pos`` and that
  hold ``lengths`` tokens (clipped to the model's last position)."""
  max_pos = model.config.max_position_embeddings - 1
  return jnp.minimum(start_pos[:, None] + lengths[:, None] - 1 + jnp.arange(k + 1)[None, :], max_pos)


def _keep_verified(model, cache, rows, drafts, logq, pos, uniforms, budget, stop, policy, suppressed):
  """The verify step of ``drafts int32[N, k]`` (``logq``: their draft distributions, None for a deterministic
  draft) and its bookkeeping: each row's kept run written, its cache rewound. Returns ``(cache, rows, int32[3])``
  as :func:`lookup_verify_step`."""
  tokens, logps, lengths, done, last = rows
  t_max, k = tokens.shape[1], drafts.shape[1]
  active = ~done
  old_index = cache.index
  acc, run, run_logp, cache = verify_step(model, cache, last, drafts, pos, active, uniforms, policy, suppressed, logq)
  count, new_done = emitted_count(run, lengths, done, acc, budget, stop)
  tokens = write_run(tokens, lengths, run, count, t_max)
  logps = write_run(logps, lengths, run_logp, count, t_max)
  new_last = jnp.take_along_axis(run, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
  last = jnp.where(count > 0, new_last, last)
  step = jnp.stack([jnp.int32(1), jnp.sum(jnp.where(active, k, 0)), jnp.sum(jnp.where(active, acc, 0))])
  return rewind(cache, old_index + count), (tokens, logps, lengths + count, new_done, last), step


def _sampling_log_probs(logits, policy, suppressed):
  """``(scaled f32[..., V], sampling log-probs f32[..., V])``: the temperature-scaled logits (unscaled at
  temperature 0) whose log-softmax is the recorded log-prob, and the log of the distribution tokens are drawn
  from (suppressed ids, then top-k / top-p removed; at temperature 0 the argmax's point mass)."""
  temperature = policy.temperature
  scaled = logits if temperature == 0.0 else logits / temperature
  allowed = scaled if suppressed is None else jnp.where(suppressed, -jnp.inf, scaled)
  if temperature == 0.0:
    best = jnp.argmax(allowed, axis=-1)
    return scaled, jnp.where(jnp.arange(logits.shape[-1]) == best[..., None], 0.0, -jnp.inf)
  shape = allowed.shape
  flat = _sampling.filter_logits(allowed.reshape(-1, shape[-1]), top_k=policy.top_k, top_p=policy.top_p)
  return scaled, jax.nn.log_softmax(flat.reshape(shape), axis=-1)


def accept_drafts(logp, drafts, draft_logq, uniforms):
  """The speculative rejection rule: how many drafts each row accepts and the token that follows them.

  Args:
    logp: ``f32[N, k+1, V]`` the target's sampling log-distribution at each draft position (-inf: never drawn).
    drafts: ``int32[N, k]`` d_1..d_k.
    draft_logq: ``f32[N, k, V]`` the draft's log-distribution d_{i+1} was drawn from, or None for a
      deterministic draft (q_i a point mass at d_{i+1}).
    uniforms: ``f32[N, k+1]`` in [0, 1): k acceptance tests, then the correction draw.

  Returns:
    ``(accepted int32[N] in [0, k], next_token int32[N])``: the first ``accepted`` drafts are kept and
    ``next_token`` follows them — drawn from ``norm(max(p_j − q_j, 0))`` at the first rejection j, or from p_k
    when all k are accepted. Test: accept d_{i+1} iff ``u_i < p_i(d)/q_i(d)``, i.e. with probability min(1, p/q).
  """
  n_rows, k = drafts.shape
  lp_d = jnp.take_along_axis(logp[:, :k], drafts[..., None], axis=-1)[..., 0]  # [N, k]
  lq_d = 0.0 if draft_logq is None else jnp.take_along_axis(draft_logq, drafts[..., None], axis=-1)[..., 0]
  ok = uniforms[:, :k] < jnp.exp(jnp.minimum(lp_d - lq_d, 0.0))  # [N, k]
  accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # leading accepts
  p_j = jnp.exp(jnp.take_along_axis(logp, accepted[:, None, None], axis=1)[:, 0])  # [N, V]
  rejected = accepted < k
  at = jnp.minimum(accepted, k - 1)
  if draft_logq is None:
    d_j = jnp.take_along_axis(drafts, at[:, None], axis=1)  # [N, 1]
    q_j = (jnp.arange(p_j.shape[-1])[None, :] == d_j).astype(p_j.dtype)
  else:
    q_j = jnp.exp(jnp.take_along_axis(draft_logq, at[:, None, None], axis=1)[:, 0])
  residual = jnp.where(rejected[:, None], jnp.maximum(p_j - q_j, 0.0), p_j)
  residual_logits = jnp.where(residual > 0, jnp.log(jnp.where(residual > 0, residual, 1.0)), -jnp.inf)
  next_token = _sampling.categorical_from_uniform(uniforms[:, k], residual_logits)
  return accepted.astype(jnp.int32), next_token


def generate_speculative(
  model: nnx.Module,
  prompt_tokens,
  prompt_mask,
  sampling: _sampling.SamplingConfig,
  *,
  key,
  temperature: float = 1.0,
  speculative: SpeculativeConfig | None = None,
  draft_model: nnx.Module | None = None,
  counted=None,
) -> tuple[_sampling.Rollout, SpeculativeStats]:
  """``jaxgrpo.rollout.sampling.generate`` by speculative decoding with prompt-lookup drafts, or with ``draft_model``
  (a smaller decoder of the same tokenizer: k tokens drawn from its own sampling distribution q under the same
  temperature, top-k, top-p and suppressed ids, one decode step each, its own KV cache rewound with the target's):
  the same arguments,
  a ``Rollout`` of the same fields and distribution (exactly: see the module docstring), and the call's
  :class:`SpeculativeStats`. Rows advance by 1 .. k+1 tokens per verify step (each its own cache index and
  position); ``eos_ids`` and ``max_new_tokens`` cut a row's accepted run at the first stop token or the budget.
  ``Rollout.num_steps`` is the longest completion. With ``sampling.record_routing`` (a mixture-of-experts target)
  ``Rollout.routing`` is ``generate``'s ``[N, P + T, M, k_e]``: the prefill's routes of the prompt, then each fed
  completion token's route from the verify step that fed it — the kept inputs ``[last ‖ accepted drafts]`` only,
  the rejected drafts' routes dropped (:func:`_routed_verify_step`); a row's last token is never fed (0), as in
  ``generate``. The draft model's routes are never recorded. A target whose parameters sit on a mesh of other
  devices than the draft's (several processes: always) gets the draft replicated on that mesh
  (:func:`draft_on_mesh`). ``counted``: ``bool[B]``, the prompts whose G rows the returned ``drafted`` and
  ``accepted`` count (default every prompt): a caller's padding prompts (a collective round's,
  ``jaxgrpo.rollout.engines.collective``) are sampled but do not dilute the acceptance it logs.

  Raises:
    ValueError / TypeError (one line, before tracing): as ``generate``; a ``draft_model`` of another vocabulary
    size; ``counted`` not ``bool[B]``.
  """
  spec = speculative or SpeculativeConfig()
  if not isinstance(spec, SpeculativeConfig):
    raise TypeError(f"`speculative` must be a SpeculativeConfig; got {type(spec).__name__}")
  prompt_tokens, prompt_mask = _checks.check_prompts(prompt_tokens, prompt_mask)
  policy = _sampling.SamplingPolicy.from_config(
    sampling, temperature=temperature, vocab_size=model.config.vocab_size, where="generate_speculative"
  )
  key = _checks.check_prng_key(key)
  counted = _check_counted(counted, prompt_tokens.shape[0])
  graphdef, state = _sampling.split_sampled(
    sampling.model_to_sample(model), prompt_tokens.shape, policy, "generate_speculative"
  )
  if draft_model is not None:
    draft_model = _on_targets_devices(check_draft_model(draft_model, model, prompt_tokens.shape, policy), state)
  draft = None if draft_model is None else nnx.split(draft_model)
  with target_platform(state):
    rollout, stats = _speculative_jit(
      graphdef, state, draft and draft[0], draft and draft[1], prompt_tokens, prompt_mask, key, counted,
      policy=policy, num_draft=spec.num_draft, ngram=spec.ngram,
    )  # fmt: skip
  return rollout._replace(temperature=Temperature(policy.temperature)), stats


def _check_counted(counted, batch: int):
  """``counted`` as ``bool[B]`` (None: every prompt); ValueError in one line for another shape or dtype."""
  if counted is None:
    return jnp.ones((batch,), bool)
  if not isinstance(counted, jax.Array):
    counted = np.asarray(counted)
  if counted.shape != (batch,) or counted.dtype != np.bool_:
    raise ValueError(
      f"`counted` must be bool[{batch}] (one flag per prompt: whose rows the stats count); got "
      f"{counted.dtype}{list(counted.shape)}"
    )
  return counted


def check_draft_model(draft_model, model, prompt_shape, policy):
  """``draft_model`` once it can draft for ``model``: a ``jaxgrpo.models`` decoder with the target's vocabulary
  size (the same tokenizer; ValueError in one line otherwise) whose positions hold the prompt and the budget."""
  vocab = getattr(getattr(draft_model, "config", None), "vocab_size", None)
  if vocab != model.config.vocab_size:
    raise ValueError(
      f"the draft model's vocab_size {vocab} != the target's {model.config.vocab_size}: speculative decoding needs "
      "a draft of the same tokenizer (a smaller model of the target's family), or rollout.speculative: ngram"
    )
  # the draft's routes are never recorded (a token's route is the target's, read from the verify step)
  _sampling.split_sampled(
    draft_model, prompt_shape, dataclasses.replace(policy, record_routing=False), "the draft model"
  )
  return draft_model


def draft_on_mesh(draft, mesh):
  """The draft model ``draft`` (loaded on one device of this process, the same values on every process) with
  every parameter replicated on each device of ``mesh`` — a small model, so its draft steps need no collective —
  for a target on that mesh (one program: its arrays must share the target's devices); made once per draft and
  mesh."""
  placed = _PLACED.setdefault(draft, {})
  if mesh not in placed:
    graphdef, state = nnx.split(draft)
    sharding = NamedSharding(mesh, PartitionSpec())
    host = jax.tree.map(np.asarray, state)
    copy = jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, sharding, lambda idx, x=x: x[idx]), host)
    placed[mesh] = nnx.merge(graphdef, copy)
  return placed[mesh]


def _on_targets_devices(draft, target_state):
  """``draft``, replicated on the target's mesh (:func:`draft_on_mesh`) when the target's parameters are on a
  mesh whose devices the draft's are not."""
  sharding = next((x.sharding for x in jax.tree.leaves(target_state) if isinstance(x, jax.Array)), None)
  if not isinstance(sharding, NamedSharding):
    return draft
  held = {d for x in jax.tree.leaves(nnx.state(draft)) if isinstance(x, jax.Array) for d in x.sharding.device_set}
  return draft if held == set(sharding.device_set) else draft_on_mesh(draft, sharding.mesh)


def load_draft(path: str, vocab_size: int) -> nnx.Module:
  """The draft model of ``path`` (``models.load_hf``, float32), after one line when its ``config.json`` gives
  another vocabulary size than the target's ``vocab_size`` (read before any weight)."""
  vocab = _models.config_from_hf(path).vocab_size
  if vocab != vocab_size:
    raise ValueError(
      f"`rollout.speculative_draft` {path}: vocab_size {vocab} != the policy's {vocab_size}: the draft must share "
      "the policy's tokenizer (a smaller model of its family)"
    )
  return _models.load_hf(path)


def write_run(buffer, lengths, run, count, width):
  """``buffer [N, T, ...]`` with ``run [N, R, ...]``'s first ``count[N]`` entries written at columns
  ``lengths[N] + i`` (trailing axes, e.g. a route's ``[M, k]``, written whole)."""
  n_rows, r = run.shape[:2]
  cols = lengths[:, None] + jnp.arange(r)[None, :]
  cols = jnp.where(jnp.arange(r)[None, :] < count[:, None], cols, width)  # past the buffer: dropped
  return buffer.at[jnp.arange(n_rows)[:, None], cols].set(run, mode="drop")


def emitted_count(run, lengths, done, accepted, budget, eos_ids):
  """How many of a verify step's ``run int32[N, k+1]`` tokens each row keeps: ``accepted + 1``, cut after the
  first stop token and at the budget ``budget - lengths`` (``budget``: int or ``int32[N]``), 0 for finished rows
  (``done bool[N]``). ``eos_ids``: a static tuple of stop ids, or a per-row table ``int32[N, S]`` (-1: none).
  Returns ``(count int32[N], done bool[N])``."""
  k1 = run.shape[1]
  count = jnp.minimum(accepted + 1, budget - lengths)
  table = jnp.asarray(eos_ids, jnp.int32).reshape(1, -1) if isinstance(eos_ids, tuple) else eos_ids  # [1 | N, S]
  if table.shape[1]:
    stop = jnp.any(run[..., None] == table[:, None, :], axis=-1)  # [N, k+1]
    first = jnp.min(jnp.where(stop, jnp.arange(k1)[None, :], k1), axis=1)
    hit = first < count
    count = jnp.minimum(count, first + 1)
  else:
    hit = jnp.zeros_like(done)
  count = jnp.where(done, 0, count)
  return count, done | hit | (lengths + count >= budget)


def verify_step(model, cache, last, drafts, pos, active, uniforms, policy, suppressed, draft_logq=None):
  """One verify step of N rows: ``[last ‖ drafts]`` (``int32[N]``, ``int32[N, k]``) fed at positions ``pos
  int32[N, k+1]`` onto ``cache`` (rows not ``active`` masked), the drafts accepted by :func:`accept_drafts` with
  ``uniforms f32[N, k+1]``. Returns ``(accepted int32[N], run int32[N, k+1], run_logp f32[N, k+1], cache)``:
  ``run`` the accepted drafts then the token drawn after them (entries past ``accepted`` + 1 unused), ``run_logp``
  each one's recorded log-prob (``log_softmax(logits / temperature)`` of the target), ``cache`` with the k+1
  slots written (the caller keeps the emitted ones: :func:`rewind`)."""
  k = drafts.shape[1]
  fed = jnp.concatenate([last[:, None], drafts], axis=1)  # [N, k+1]
  hidden, cache = model(fed, pos, attention_mask=jnp.broadcast_to(active[:, None], fed.shape), cache=cache)
  logits = model.logits(hidden, out_dtype=jnp.float32)  # [N, k+1, V]
  scaled, logp = _sampling_log_probs(logits, policy, suppressed)
  acc, nxt = accept_drafts(logp, drafts, draft_logq, uniforms)
  run = jnp.where(jnp.arange(k + 1)[None, :] < acc[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), nxt[:, None])
  run_logp = jnp.take_along_axis(scaled, run[..., None], axis=-1)[..., 0] - jax.nn.logsumexp(scaled, axis=-1)
  return acc, run, run_logp, cache


def _prefill(model, prompt_tokens, prompt_mask, positions, slots, g, record=False):
  """The B prompts prefilled once into a cache of ``slots``, repeated G times with a per-row index at P:
  ``(last hidden f32[N, D] of each prompt, cache, routes)``; ``routes``: with ``record`` (a mixture of experts)
  the experts of every prompt slot, ``int32[N, P, M, k]``, else None."""
  batch, p_len = prompt_tokens.shape
  with _moe.routing_scope() as scope:
    hidden, cache = model(prompt_tokens, positions, attention_mask=prompt_mask, cache=model.init_cache(batch, slots))
  routes = jnp.repeat(scope.stacked().experts, g, axis=0) if record else None
  cache = _models.repeat_cache(cache, g)._replace(index=jnp.full((batch * g,), p_len, jnp.int32))
  return jnp.repeat(hidden[:, -1], g, axis=0), cache, routes


def _routed_verify_step(model, routes, lengths, count_of, *args):
  """:func:`verify_step` (``args``) that also records the experts of the fed ``[last ‖ drafts]`` the row keeps.

  The inputs a row keeps are ``[last ‖ the accepted drafts]``, its first ``count`` fed positions (``count_of(run,
  accepted) -> int32[N]``, :func:`emitted_count`'s): completion tokens ``lengths − 1 ..  lengths + count − 2``,
  whose routes (``int32[N, k+1, M, k_e]`` of the verify forward) are written at those columns of ``routes
  int32[N, T, M, k_e]`` — the rejected drafts' routes are dropped, as their log-probs are. ``routes`` None (no
  routing recorded): the step unchanged. Returns ``(accepted, run, run_logp, cache, count, done, routes)``."""
  if routes is None:
    acc, run, run_logp, cache = verify_step(model, *args)
    return (acc, run, run_logp, cache, *count_of(run, acc), None)
  with _moe.routing_scope() as scope:
    acc, run, run_logp, cache = verify_step(model, *args)
  count, done = count_of(run, acc)
  routes = write_run(routes, lengths - 1, scope.stacked().experts, count, routes.shape[1])
  return acc, run, run_logp, cache, count, done, routes


def rewind(cache, index):
  """``cache`` with each row's index set to ``index int32[N]`` and its slots from there on invalid."""
  return cache._replace(index=index, valid=cache.valid & (jnp.arange(cache.max_len)[None, :] < index[:, None]))


def _draft_tokens(draft, cache, last, pos, active, uniforms, policy, suppressed):
  """k tokens of the draft model per row, each drawn from its sampling distribution q (``uniforms f32[N, k]``),
  fed one decode step at a time from ``last`` at positions ``pos int32[N, k+1]``; d_k is fed too, so the draft
  cache holds ``[last ‖ d_1..d_k]`` like the target's after the verify step. Returns (drafts int32[N, k], log q
  f32[N, k, V], cache)."""
  k = uniforms.shape[1]
  tokens, logqs, token = [], [], last
  for i in range(k + 1):
    logits, cache = _sampling.decode_logits(draft, token, pos[:, i], active, cache)
    if i == k:
      break
    _, logq = _sampling_log_probs(logits, policy, suppressed)
    token = _sampling.categorical_from_uniform(uniforms[:, i], logq)
    tokens.append(token)
    logqs.append(logq)
  return jnp.stack(tokens, 1), jnp.stack(logqs, 1), cache


@functools.partial(jax.jit, static_argnums=(0, 2), static_argnames=("policy", "num_draft", "ngram"))
def _speculative_jit(
  graphdef, state, draft_graphdef, draft_state, prompt_tokens, prompt_mask, key, counted, *, policy, num_draft, ngram
):
  """``generate_speculative``'s program (``draft_graphdef`` None: prompt-lookup drafts; ``counted bool[B]``: the
  prompts whose rows the stats count)."""
  g, t_max, pad_id, k = policy.num_samples, policy.max_new_tokens, policy.pad_id, num_draft
  model = nnx.merge(graphdef, state)
  model = _models.to_loop_layers(model) if getattr(model, "scan_layers", False) else model
  batch, p_len = prompt_tokens.shape
  n_rows = batch * g
  rows = jnp.arange(n_rows)
  positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1, dtype=jnp.int32) - 1, 0)
  slots = _sampling.cache_slots(p_len, t_max, k)
  hidden, cache, prompt_routes = _prefill(model, prompt_tokens, prompt_mask, positions, slots, g, policy.record_routing)
  first_logits = model.logits(hidden, out_dtype=jnp.float32)  # [N, V]
  draft = None
  if draft_graphdef is not None:
    draft = nnx.merge(draft_graphdef, draft_state)
    draft = _models.to_loop_layers(draft) if getattr(draft, "scan_layers", False) else draft
    _, draft_cache, _ = _prefill(draft, prompt_tokens, prompt_mask, positions, slots, g)
  else:
    draft_cache = cache.index  # a placeholder carry
  prompt_len = jnp.repeat(jnp.sum(prompt_mask, axis=1, dtype=jnp.int32), g)  # [N]
  counted = jnp.repeat(counted, g)  # [N]
  ctx_prompt, ctx_prompt_ok = jnp.repeat(prompt_tokens, g, axis=0), jnp.repeat(prompt_mask, g, axis=0)
  suppressed = _sampling.suppressed_mask(policy.suppress_ids, first_logits.shape[-1])
  max_pos = model.config.max_position_embeddings - 1

  first_u = lambda: jax.random.uniform(jax.random.fold_in(key, 0), (n_rows,), jnp.float32)
  token0, logp0 = _sampling.draw_token(first_logits, first_u, policy, suppressed)
  lengths0 = jnp.zeros((n_rows,), jnp.int32)
  done0 = jnp.zeros((n_rows,), bool)
  zeros = jnp.zeros((n_rows,), jnp.int32)
  count0, done0 = emitted_count(token0[:, None], lengths0, done0, zeros, policy.max_new_tokens, policy.eos_ids)
  tokens = write_run(jnp.full((n_rows, t_max), pad_id, jnp.int32), lengths0, token0[:, None], count0, t_max)
  logps = write_run(jnp.zeros((n_rows, t_max), jnp.float32), lengths0, logp0[:, None], count0, t_max)
  zero = jnp.zeros((), jnp.int32)
  routes = None  # [N, T, M, k_e]: completion token j's experts at column j (the last token is never fed: 0)
  if prompt_routes is not None:
    routes = jnp.zeros((n_rows, t_max) + prompt_routes.shape[2:], jnp.int32)

  def cond(c):
    return ~jnp.all(c[4])

  def body(c):
    step, cache, tokens, logps, done, lengths, last, drafted, accepted_total, draft_cache, routes = c
    pos = jnp.minimum(prompt_len[:, None] + lengths[:, None] - 1 + jnp.arange(k + 1)[None, :], max_pos)
    active = ~done
    u = jax.random.uniform(jax.random.fold_in(key, step), (n_rows, 2 * k + 1), jnp.float32)
    if draft is None:
      context = jnp.concatenate([ctx_prompt, tokens], axis=1)  # [N, P+T]
      valid = jnp.concatenate([ctx_prompt_ok, jnp.arange(t_max)[None, :] < lengths[:, None]], axis=1)
      drafts, logq = ngram_draft(context, valid, p_len + lengths, num_draft=k, ngram=ngram), None  # [N, k]
    else:
      drafts, logq, draft_cache = _draft_tokens(
        draft, draft_cache, last, pos, active, u[:, k + 1 :], policy, suppressed
      )
    old_index = cache.index
    count_of = lambda run, acc: emitted_count(run, lengths, done, acc, policy.max_new_tokens, policy.eos_ids)
    acc, run, run_logp, cache, count, new_done, routes = _routed_verify_step(
      model, routes, lengths, count_of, cache, last, drafts, pos, active, u[:, : k + 1], policy, suppressed, logq
    )
    tokens = write_run(tokens, lengths, run, count, t_max)
    logps = write_run(logps, lengths, run_logp, count, t_max)
    index = old_index + count  # keep [last ‖ the count-1 accepted drafts]; the rest of the k+1 slots rewound
    cache = rewind(cache, index)
    if draft is not None:  # the draft's cache holds the same slots
      draft_cache = rewind(draft_cache, index)
    new_last = jnp.take_along_axis(run, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    last = jnp.where(count > 0, new_last, last)
    drafted = drafted + jnp.sum(jnp.where(active & counted, k, 0))
    accepted_total = accepted_total + jnp.sum(jnp.where(active & counted, acc, 0))
    lengths = lengths + count
    return step + 1, cache, tokens, logps, new_done, lengths, last, drafted, accepted_total, draft_cache, routes

  carry = (jnp.int32(1), cache, tokens, logps, done0, count0, token0, zero, zero, draft_cache, routes)
  steps, _, tokens, logps, _, lengths, _, drafted, accepted, _, routes = jax.lax.while_loop(cond, body, carry)
  if routes is not None:
    routes = jnp.concatenate([prompt_routes, routes], axis=1).astype(_moe.replay_dtype(model.config.num_experts))
  mask = jnp.arange(t_max)[None, :] < lengths[:, None]
  rollout = _sampling.Rollout(
    prompt_tokens=ctx_prompt,
    prompt_mask=ctx_prompt_ok,
    completions=jnp.where(mask, tokens, pad_id),
    mask=mask,
    log_probs=jnp.where(mask, logps, 0.0),
    group_ids=rows // g,
    num_steps=jnp.max(lengths),
    routing=routes,
  )
  return rollout, SpeculativeStats(verify_steps=steps - 1, drafted=drafted, accepted=accepted)


@dataclasses.dataclass(kw_only=True)
class SpeculativeSwitch:
  """``rollout.speculative``: samples by plain or speculative decoding, and for ``auto`` decides which by measure.

  The speculative kind is the draft model's when ``draft_model`` is given, else prompt lookup (``ngram``).
  ``auto`` times ``warmup`` + 1 calls of each (plain first, then speculative; the first ``warmup`` of each are not
  timed: they compile), as completion tokens per second of wall time, then keeps speculative decoding for every
  later call iff its tokens/s beat plain's; the decision and both numbers are logged once (logger
  ``jaxgrpo.rollout.speculative``) and kept in :attr:`measured`. ``off`` / ``ngram`` / ``draft``: always that.

  Attributes:
    config: the :class:`SpeculativeConfig`.
    draft_model: the draft model (``config.draft`` loaded, :func:`load_draft`), or None: prompt lookup.
    warmup: untimed calls of each kind before the timed one (compilation).
    measured: ``{"plain_tokens_per_s", "speculative_tokens_per_s", "acceptance", "drafter", "speculative_on"}``
      once decided.
    calls: calls so far that decoded tokens; timing: ``{kind: (tokens/s, stats)}`` of the timed calls while deciding.
    metrics: the last call's ``rollout/speculative_on`` and (speculative) ``rollout/spec_acceptance``.
  """

  config: SpeculativeConfig
  draft_model: nnx.Module | None = None
  warmup: int = 1
  measured: dict = dataclasses.field(default_factory=dict)
  calls: int = 0
  timing: dict = dataclasses.field(default_factory=dict)
  metrics: dict = dataclasses.field(default_factory=dict)

  @property
  def drafter(self) -> str:
    """``draft`` (a draft model) or ``ngram`` (prompt lookup)."""
    return "ngram" if self.draft_model is None else "draft"

  def mode_now(self) -> str:
    """``plain`` or the drafter (``ngram`` / ``draft``): what the next call runs."""
    if self.config.mode != "auto":
      return "plain" if self.config.mode == "off" else self.drafter
    if self.measured:
      return self.drafter if self.measured["speculative_on"] else "plain"
    return "plain" if self.calls <= self.warmup else self.drafter

  def sample(self, model, prompt_tokens, prompt_mask, sampling, *, key, temperature=1.0, collective=False):
    """``(Rollout, metrics)``: one call of ``generate`` or :func:`generate_speculative` (:meth:`mode_now`);
    metrics ``rollout/speculative_on`` (1.0 / 0.0) and, for a speculative call, ``rollout/spec_acceptance``.
    ``collective``: the call is one program over several processes (``BuiltinEngine.sample_rows``), its
    seconds taken as the slowest process's (one small all-gather), so every process observes the same call and
    ``auto`` decides the same everywhere (each process timing itself could choose another program)."""
    mode = self.mode_now()
    start = time.perf_counter()
    if mode == "plain":
      rollout = _sampling.generate(model, prompt_tokens, prompt_mask, sampling, key=key, temperature=temperature)
      stats = None
    else:
      rollout, stats = generate_speculative(
        model, prompt_tokens, prompt_mask, sampling, key=key, temperature=temperature, speculative=self.config,
        draft_model=self.draft_model,
      )  # fmt: skip
    jax.block_until_ready(rollout.completions)
    seconds = time.perf_counter() - start
    if collective:
      seconds = max(distributed.gather_objects(seconds))
    self.observe(mode, int(jnp.sum(rollout.mask)) / seconds, stats)
    return rollout, dict(self.metrics)

  def observe(self, mode: str, tokens_per_s: float, stats: SpeculativeStats | None) -> None:
    """One call of kind ``mode`` (``plain`` or the drafter) made at ``tokens_per_s`` with ``stats`` (None for
    plain), counted — :meth:`sample`'s, or a sampler's that decodes by :meth:`mode_now` itself (the partial
    pool's ``RowPool.run``); ``auto`` decides by it once both timed calls are in. A call that decoded nothing
    (``tokens_per_s`` 0: a pool run whose groups were complete) is not counted: ``auto`` must not compare empty
    runs."""
    self.metrics = {"rollout/speculative_on": float(mode != "plain")}
    if stats is not None:
      self.metrics["rollout/spec_acceptance"] = stats.acceptance
    if tokens_per_s <= 0.0:
      return
    self.calls += 1
    if self.config.mode == "auto" and not self.measured:
      self._observe(mode, tokens_per_s, stats)

  def _observe(self, mode, tokens_per_s, stats):
    """Record the timed call of each kind; decide once both are in."""
    if self.calls not in (self.warmup + 1, 2 * self.warmup + 2):
      return
    self.timing[mode] = (tokens_per_s, stats)
    if "plain" in self.timing and self.drafter in self.timing:
      plain, (spec, spec_stats) = self.timing["plain"][0], self.timing[self.drafter]
      self.measured = {
        "plain_tokens_per_s": plain,
        "speculative_tokens_per_s": spec,
        "acceptance": spec_stats.acceptance,
        "drafter": self.drafter,
        "speculative_on": spec > plain,
      }
      _LOG.warning(
        "rollout.speculative auto: plain %.1f tokens/s, %s %.1f tokens/s at acceptance %.3f (k=%d) -> %s",
        plain, self.drafter, spec, spec_stats.acceptance, self.config.num_draft,
        f"{self.drafter} on" if spec > plain else "plain decoding",
      )  # fmt: skip
