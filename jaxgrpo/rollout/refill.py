"""Slot refill (continuous batching) for the built-in sampler: a fixed number of decode slots, and a row that
ends frees its slot for the next queued sample at the next refill boundary.

Data flow (B prompts, G samples per prompt, N = B·G rows, P prompt tokens, T new tokens, S slots, K decode
steps per boundary):

    prompts [B, P] --prefill once (one jitted program)--> prompt cache [B, W] (per-row, right-aligned) and the
      last prompt token's hidden state [B, D]
    queue: rows 0..N-1 in order (row b·G + g is sample g of prompt b)
    per boundary, one jitted program:
      admit the R newcomers (the queued rows taken into the free slots, R rounded up to a power of two):
      copy their prompt's cache row into their slot of the S-row per-row KV cache (``models.put_cache_rows``)
      and draw their token 0 from the prompt's hidden state;
      then up to K decode steps over the S slots in a ``lax.while_loop`` (exits early when no slot is running)
    the host reads the slots' done flags (S booleans) and picks the next newcomers
    --> Rollout(completions [N, T], mask, log_probs, ...) as ``sampling.generate`` returns it.

The outer loop is Python over boundaries (one device-to-host read of S flags per boundary), never per token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgrpo import _checks
from jaxgrpo import models as _models
from jaxgrpo.models.log_probs import Temperature
from jaxgrpo.parallel.target import target_platform
from jaxgrpo.rollout import conversation as _conversation
from jaxgrpo.rollout import sampling as _sampling
from jaxgrpo.rollout.sampling import Rollout, SamplingConfig

__all__ = ["generate_refill"]


def generate_refill(
  model: nnx.Module,
  prompt_tokens: jax.Array,
  prompt_mask: jax.Array,
  sampling: SamplingConfig,
  *,
  key: jax.Array,
  temperature: float = 1.0,
  num_slots: int,
  refill_every: int,
  budgets=None,
  info: dict | None = None,
) -> Rollout:
  """:func:`jaxgrpo.rollout.sampling.generate` with slot refill: N = B·G rows decoded in ``num_slots`` slots.

  A row runs in one slot from its prefill to its end (one of ``eos_ids``, ``max_new_tokens`` or its entry of
  ``budgets``); at the next boundary (every ``refill_every`` decode steps, or as soon as no slot is running)
  its slot takes the next row of the queue (rows in order 0..N-1): the newcomer's prompt, prefilled once per
  prompt at the start (one chunk per prompt, real token k at slot and position k), is copied into its slot of
  a per-row KV cache (``model.init_cache(S, P + T - 1, per_row=True)``), and it decodes with the others. A
  long row no longer holds S - 1 finished rows idle, as in a static batch.

  **Same rollout as** ``generate`` for the same key, row by row: token t of row r is drawn with uniform
  ``r`` of ``jax.random.uniform(fold_in(key, t), (N,))`` — exactly the uniform ``generate`` uses for that
  row and step — whatever slot and boundary it runs in (the [T, N] uniforms are drawn once per call: T·N·4
  bytes). The logits are computed over other batch shapes (S slots instead of N rows, a per-row cache),
  so they agree to float32 rounding; the token ids are identical unless a uniform falls within that rounding
  of a CDF boundary. With ``budgets``, row r is ``generate``'s row r cut after ``budgets[r]`` tokens.

  Memory: the S-row cache, the B prompts' cache of W <= P slots (W: the longest prompt rounded up to a power
  of two), the [T, N] uniforms and the [N, T] outputs.

  Args:
    model, prompt_tokens (``int32[B, P]``, left-padded), prompt_mask (``bool[B, P]``), sampling, key,
      temperature: as for ``generate`` (``sampling.max_new_tokens`` = T required; ``record_routing`` is refused).
    num_slots: S >= 1, rows decoded at once (the KV cache holds S rows); S > N uses N.
    refill_every: K >= 1, decode steps between refill boundaries (static: one compiled decode loop). A small
      K refills sooner (fewer idle slot-steps) but runs more boundaries (a host round trip and a copy of the
      newcomers' prompt rows each).
    budgets: None, or ``int[N]`` with entries in ``[1, T]``: row r stops after ``budgets[r]`` tokens (its
      mask covers them) unless it samples an EOS first.
    info: None, or a dict that receives ``boundaries`` (jitted programs run), ``decode_steps`` (decode
      steps over the S slots, all boundaries) and ``slot_steps_used`` (real tokens decoded after token 0).

  Returns:
    A :class:`jaxgrpo.rollout.sampling.Rollout` with N rows, as ``generate`` returns it (``routing`` None;
    ``num_steps`` = the longest row's length).

  Raises:
    TypeError / ValueError: as ``generate``; ``num_slots`` or ``refill_every`` not an int >= 1, ``budgets``
      of the wrong shape or outside ``[1, T]``, ``record_routing=True``.
  """
  prompt_tokens, prompt_mask = _checks.check_prompts(prompt_tokens, prompt_mask)
  policy = _sampling.SamplingPolicy.from_config(
    sampling, temperature=temperature, vocab_size=model.config.vocab_size, where="generate_refill"
  )
  slots = _checks.check_python_int(num_slots, "num_slots", minimum=1, hint="S, rows decoded at once")
  every = _checks.check_python_int(
    refill_every, "refill_every", minimum=1, hint="K, decode steps between refill boundaries"
  )
  key = _checks.check_prng_key(key)
  if policy.record_routing:
    raise ValueError("generate_refill: `record_routing=True` is not supported (use generate for routing replay)")
  graphdef, state = _sampling.split_sampled(
    sampling.model_to_sample(model), prompt_tokens.shape, policy, "generate_refill"
  )
  g, t_max, pad_id = policy.num_samples, policy.max_new_tokens, policy.pad_id
  batch, prompt_len = prompt_tokens.shape
  n = batch * g
  if budgets is None:
    row_budget = np.full(n, t_max, np.int32)
  else:
    row_budget = np.asarray(budgets)
    if row_budget.shape != (n,) or not np.issubdtype(row_budget.dtype, np.integer):
      raise ValueError(f"`budgets` must be int[N] with N = B·G = {n}; got {row_budget.dtype}{list(row_budget.shape)}")
    if row_budget.min() < 1 or row_budget.max() > t_max:
      raise ValueError(
        f"`budgets` entries must be in [1, max_new_tokens = {t_max}]; got min {row_budget.min()}, "
        f"max {row_budget.max()}"
      )
    row_budget = row_budget.astype(np.int32)
  slots = min(slots, n)
  max_len = _sampling.cache_slots(prompt_len, t_max)

  host_tokens, host_mask = (np.asarray(x) for x in jax.device_get((prompt_tokens, prompt_mask)))
  real = host_mask.sum(axis=1)  # real prompt tokens of each prompt
  width = _conversation.bucket_width(int(real.max()), max_len)
  chunk = np.full((batch, width), pad_id, np.int32)
  chunk_mask = np.zeros((batch, width), bool)
  for b in range(batch):  # right-aligned: real prompt token k at slot and position k
    chunk[b, : real[b]] = host_tokens[b, prompt_len - real[b] :]
    chunk_mask[b, : real[b]] = True
  with target_platform(state):  # the program of the devices that hold the model (docs/models.md, "Target platform")
    prompt_cache, prompt_hidden = _prefill_jit(graphdef, state, chunk, chunk_mask)
    table = _uniform_table(key, num_rows=n, max_new_tokens=t_max) if policy.temperature > 0 else jnp.zeros((1, 1))
    carry = _init_jit(graphdef, state, jnp.asarray(row_budget), num_slots=slots, max_len=max_len, policy=policy)
    done = np.ones(slots, bool)  # host copy of each slot's "free" flag (finished or never used)
    queued, boundaries, decode_steps = 0, 0, 0
    while True:
      free = np.flatnonzero(done)
      take = min(len(free), n - queued)
      if take == 0 and done.all():
        break
      # R newcomers (a power of two <= S; padding rows: row N, slot S, nothing written). A boundary without
      # newcomers runs the same program with one padding row (one compiled program fewer).
      r = min(slots, 1 << max(0, take - 1).bit_length())
      new_rows = np.full(r, n, np.int32)
      new_slots = np.full(r, slots, np.int32)
      new_rows[:take] = np.arange(queued, queued + take)
      new_slots[:take] = free[:take]
      queued += take
      carry, steps = _boundary_jit(
        graphdef,
        state,
        carry,
        prompt_cache,
        prompt_hidden,
        table,
        new_rows,
        new_slots,
        refill_every=every,
        policy=policy,
      )
      done, steps = jax.device_get((carry[5], steps))  # the one host read per boundary: S flags and a count
      done = np.asarray(done)
      boundaries += 1
      decode_steps += int(steps)
  out_tokens, out_logps, lengths = carry[-3:]
  if info is not None:
    info.update(
      boundaries=boundaries,
      decode_steps=decode_steps,
      slot_steps_used=int(jnp.sum(jnp.maximum(lengths - 1, 0))),
    )
  mask = jnp.arange(t_max, dtype=jnp.int32)[None, :] < lengths[:, None]
  return Rollout(
    prompt_tokens=jnp.repeat(prompt_tokens, g, axis=0),
    prompt_mask=jnp.repeat(prompt_mask, g, axis=0),
    completions=out_tokens,
    mask=mask,
    log_probs=out_logps,
    group_ids=jnp.repeat(jnp.arange(batch, dtype=jnp.int32), g),
    num_steps=jnp.max(lengths),
    routing=None,
    temperature=Temperature(policy.temperature),
  )


@functools.partial(jax.jit, static_argnames=("num_rows", "max_new_tokens"))
def _uniform_table(key, *, num_rows, max_new_tokens):
  """``f32[T, N]``: row t is ``jax.random.uniform(fold_in(key, t), (N,))``, the uniforms of step t in ``generate``."""
  steps = jnp.arange(max_new_tokens, dtype=jnp.int32)
  return jax.lax.map(lambda t: jax.random.uniform(jax.random.fold_in(key, t), (num_rows,), jnp.float32), steps)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("num_slots", "max_len", "policy"))
def _init_jit(graphdef, state, row_budget, *, num_slots, max_len, policy):
  """The empty carry: (cache, slot row, slot token index, slot start position, slot last token, slot done,
  slot budget, row budgets, out tokens, out log-probs, out lengths) for the ``N = row_budget.shape[0]`` rows."""
  model = nnx.merge(graphdef, state)
  s, num_rows, max_new_tokens, pad_id = num_slots, row_budget.shape[0], policy.max_new_tokens, policy.pad_id
  return (
    model.init_cache(s, max_len, per_row=True),
    jnp.full((s,), -1, jnp.int32),  # global row in the slot (-1: never used)
    jnp.zeros((s,), jnp.int32),  # t: tokens the row has sampled
    jnp.zeros((s,), jnp.int32),  # position of the row's completion token 0 (its real prompt length)
    jnp.zeros((s,), jnp.int32),  # last sampled token (fed next)
    jnp.ones((s,), bool),  # done (or free)
    jnp.zeros((s,), jnp.int32),  # the row's budget
    row_budget,
    jnp.full((num_rows, max_new_tokens), pad_id, jnp.int32),
    jnp.zeros((num_rows, max_new_tokens), jnp.float32),
    jnp.zeros((num_rows,), jnp.int32),
  )


@functools.partial(jax.jit, static_argnums=(0,))
def _prefill_jit(graphdef, state, chunk, chunk_mask):
  """The B prompts, right-aligned in ``chunk int32[B, W]``, into a per-row cache of W slots (real token k at
  slot and position k), and the final hidden state of each prompt's last real token ``[B, D]``."""
  model = nnx.merge(graphdef, state)
  batch, width = chunk.shape
  cache = model.init_cache(batch, width, per_row=True)
  positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None], (batch, width))
  hidden, cache = model(chunk, positions, attention_mask=chunk_mask, cache=cache)
  last = jnp.maximum(jnp.sum(chunk_mask, axis=1, dtype=jnp.int32) - 1, 0)
  return cache, jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]


def slot_logits(model, cache, s_start, s_t, s_last, s_done):
  """One decode step over the S slots: each running slot feeds its token t-1 at position start + t - 1
  (finished slots masked out). Returns (active ``bool[S]``, the logits of token t ``f32[S, V]``, the cache)."""
  active = ~s_done
  logits, cache = _sampling.decode_logits(model, s_last, jnp.maximum(s_start + s_t - 1, 0), active, cache)
  return active, logits, cache


def advance_slots(active, token, s_t, s_last, s_done, s_budget, eos_ids):
  """The running slots past their drawn ``token``: a slot ends at an EOS id or its budget. Returns
  (``s_t``, ``s_last``, ``s_done``)."""
  s_done = s_done | (active & (_sampling.is_eos(token, eos_ids) | (s_t + 1 >= s_budget)))
  return s_t + active.astype(jnp.int32), jnp.where(active, token, s_last), s_done


def pad_slots(cache, max_len: int):
  """A per-row cache of W slots as one of ``max_len >= W`` slots (the extra slots empty)."""
  extra = max_len - cache.max_len
  pad = lambda x, axis: jnp.pad(x, [(0, extra if a == x.ndim + axis else 0) for a in range(x.ndim)])
  k = tuple(pad(x, -1) for x in cache.k) if isinstance(cache.k, tuple) else pad(cache.k, -1)  # [.., N, K, T]
  v = tuple(pad(x, -2) for x in cache.v) if isinstance(cache.v, tuple) else pad(cache.v, -2)  # [.., N, T, K]
  return cache._replace(k=k, v=v, valid=pad(cache.valid, -1))


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("refill_every", "policy"), donate_argnums=(2,))
def _boundary_jit(graphdef, state, carry, prompt_cache, prompt_hidden, table, rows, slots, *, refill_every, policy):
  """One refill boundary: the newcomers ``rows int32[R]`` enter ``slots int32[R]`` (padding: row N, slot S) —
  their prompts' cache rows copied from ``prompt_cache`` into their slots, their token 0 drawn from
  ``prompt_hidden`` — then up to ``refill_every`` decode steps over the S slots, drawn under ``policy`` (a
  ``SamplingPolicy``). Returns (carry, decode steps)."""
  model = nnx.merge(graphdef, state)
  cache, s_row, s_t, s_start, s_last, s_done, s_budget, row_budget, out_tok, out_lp, out_len = carry
  num_rows = out_tok.shape[0]
  suppressed = _sampling.suppressed_mask(policy.suppress_ids, model.config.vocab_size)
  eos_ids = policy.eos_ids

  def draw(logits, t, rows):
    u = lambda: table[jnp.minimum(t, table.shape[0] - 1), jnp.clip(rows, 0, table.shape[1] - 1)]
    return _sampling.draw_token(logits, u, policy, suppressed)

  # The newcomers: their prompt's cache rows into their slots (the slot's old row, valid slots and index
  # replaced), their token 0 from the prompt's last hidden state.
  prompts = rows // policy.num_samples  # padding rows: prompt B, out of range (an empty row, dropped)
  sub = _models.take_cache_rows(prompt_cache, prompts)
  cache = _models.put_cache_rows(cache, slots, pad_slots(sub, cache.max_len))
  hidden = jnp.take(prompt_hidden, prompts, axis=0, mode="fill", fill_value=0)
  token, logp = draw(model.logits(hidden, out_dtype=jnp.float32), jnp.zeros(rows.shape, jnp.int32), rows)
  budget = jnp.take(row_budget, rows, mode="fill", fill_value=1)
  out_tok = out_tok.at[rows, 0].set(token, mode="drop")
  out_lp = out_lp.at[rows, 0].set(logp, mode="drop")
  out_len = out_len.at[rows].set(1, mode="drop")
  put = lambda x, y: x.at[slots].set(y, mode="drop")
  s_row, s_t, s_start, s_last = put(s_row, rows), put(s_t, 1), put(s_start, sub.index), put(s_last, token)
  s_done, s_budget = put(s_done, _sampling.is_eos(token, eos_ids) | (budget <= 1)), put(s_budget, budget)

  def cond(c):
    k, _, _, _, s_done, *_ = c
    return (k < refill_every) & ~jnp.all(s_done)

  def body(c):
    k, cache, s_t, s_last, s_done, out_tok, out_lp, out_len = c
    active, logits, cache = slot_logits(model, cache, s_start, s_t, s_last, s_done)
    token, logp = draw(logits, s_t, s_row)
    at = jnp.where(active, s_row, num_rows)  # finished slots write nowhere
    out_tok = out_tok.at[at, s_t].set(token, mode="drop")
    out_lp = out_lp.at[at, s_t].set(logp, mode="drop")
    out_len = out_len.at[at].set(s_t + 1, mode="drop")
    s_t, s_last, s_done = advance_slots(active, token, s_t, s_last, s_done, s_budget, eos_ids)
    return k + 1, cache, s_t, s_last, s_done, out_tok, out_lp, out_len

  k, cache, s_t, s_last, s_done, out_tok, out_lp, out_len = jax.lax.while_loop(
    cond, body, (jnp.int32(0), cache, s_t, s_last, s_done, out_tok, out_lp, out_len)
  )
  carry = (cache, s_row, s_t, s_start, s_last, s_done, s_budget, row_budget, out_tok, out_lp, out_len)
  return carry, k
