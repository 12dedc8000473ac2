"""The multi-turn sampler with one KV cache kept across turns (:class:`ConversationSampler`): a module of its own
beside :func:`jaxgrpo.rollout.sampling.generate`, whose token draws it shares (``draw_token``: the same uniforms per row
and position, so the same keys give the same ids as re-prefilling each turn with ``generate``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgrpo import _checks
from jaxgrpo import models as _models
from jaxgrpo.data import pad_left
from jaxgrpo.parallel.target import target_platform
from jaxgrpo.rollout import speculative as _speculative
from jaxgrpo.rollout.sampling import SamplingPolicy, decode_logits, draw_token, suppressed_mask, write_token

__all__ = ["ConversationSampler"]


def bucket_width(n: int, cap: int) -> int:
  """A chunk width >= n from few values (powers of two, at least 8), at most ``cap`` (the cache size)."""
  return min(cap, max(8, 1 << max(0, (n - 1).bit_length())))


def split_draft(draft_model, model, speculative, max_len: int, policy: SamplingPolicy):
  """``nnx.split(draft_model)`` once it can draft the conversations of ``model`` (None: None): ``speculative``
  set, the policy's vocabulary (``speculative.check_draft_model``) and ``max_len`` positions (ValueError in one
  line each)."""
  if draft_model is None:
    return None
  if speculative is None:
    raise ValueError(
      "ConversationSampler: `draft_model` is given but `speculative` is None; pass "
      "speculative=SpeculativeConfig(num_draft=k) to draft with it, or drop draft_model"
    )
  limit = getattr(getattr(draft_model, "config", None), "max_position_embeddings", None)
  if limit is not None and limit < max_len:
    raise ValueError(
      f"ConversationSampler: the draft model's max_position_embeddings {limit} < max_len {max_len}: its cache "
      "holds the whole conversation; use a draft of at least max_len positions or lower env.max_tokens"
    )
  one = dataclasses.replace(policy, max_new_tokens=1, record_routing=False)
  return nnx.split(_speculative.check_draft_model(draft_model, model, (1, 1), one))


class ConversationSampler:
  """Samples N conversations turn by turn with **one KV cache kept across turns** (the multi-turn rollout's
  sampler, ``jaxgrpo.rollout.environments.sample_multiturn``).

  Conversation i is ``prompts[i] ‖ turn₁ ‖ appended₁ ‖ turn₂ ‖ …``. The cache is a per-row cache of
  ``max_len`` slots (``model.init_cache(..., per_row=True)``: row i's tokens fill its slots without holes,
  token k of the conversation at slot k and position k). The constructor prefills each group's prompt once
  (all of it but its last token; the G rows of a group share it, ``repeat_cache``); each :meth:`turn` is one
  jitted program per row batch: a chunked prefill of the tokens not yet in the cache — the last token of the
  row's previous turn (or of its prompt) followed by the tokens appended since (an environment's
  observation) — right-padded to a bucketed width, at each row's own slots and positions, then a
  ``lax.while_loop`` decode of the turn from the logits of the chunk's last real token, as :func:`generate`
  does after its prefill. A turn runs over the rows taking it only (their cache rows gathered, their count
  rounded up to a power of two with empty padding rows, and written back: ``models.take_cache_rows`` /
  ``put_cache_rows``), or over all N rows, masked, when that is no smaller; the other rows' cache is unchanged.
  The last sampled token of a turn is fed by the next turn's chunk.

  Same tokens and log-probs as :func:`generate` on the whole conversation so far (``prompt ‖ …`` left-padded)
  up to float32 rounding, for the same keys: the uniforms of a batch ``(key, rows)`` of :meth:`turn` are
  those ``generate`` draws for a batch of exactly those rows in that order (with
  ``jax_threefry_partitionable``, the default, the first n uniforms of a draw of any size are the same).

  Args:
    model: the policy (any ``jaxgrpo.models`` family, dense or MoE; the adapted model with LoRA).
    prompts: N token-id lists (each >= 1 token); rows ``b·G .. b·G+G-1`` share one prompt.
    sampling: a :class:`SamplingConfig` (``num_samples`` = G, ``top_k``, ``top_p``, ``pad_id``,
      ``suppress_ids``; ``max_new_tokens``, ``eos_ids``, ``merge_lora`` and ``record_routing`` are not read:
      :meth:`turn` takes its budgets and stop ids, and nothing is merged or recorded).
    max_len: cache slots, the longest conversation (prompt and every turn and appended token) minus one
      (the last sampled token is never fed); at most ``max_position_embeddings``.
    temperature: as for :func:`generate`.
    suppress_eos: the stop ids the default ``suppress_ids`` is computed against (``SamplingConfig.suppress_ids``
      None: the pad id unless it is one of them).
    speculative: None, or a ``jaxgrpo.rollout.speculative.SpeculativeConfig``: after each turn's first token the
      decode is by *verify steps* (``speculative.verify_step``): k drafts per row — by prompt lookup from the
      row's whole conversation so far, or by ``draft_model`` — verified at its own slots and positions, 1 .. k+1
      tokens kept per step (cut at the row's stop ids and budget), each recorded log-prob the target's; drafting
      stops at the turn's end, appended tokens are never drafted. The cache holds k slots more. :attr:`stats`
      counts (verify steps, drafted, accepted) over the turns.
    draft_model: None (prompt lookup), or the draft model (a ``jaxgrpo.models`` decoder of the policy's
      vocabulary, ``speculative.load_draft``; needs ``speculative``): its own per-row KV cache is kept beside the
      policy's for the whole conversation — the same slots and positions: prefilled with the prompt heads, fed
      each turn's chunk (the pending token and the appended observation) as the policy's is, advanced by the
      k draft decode steps of each verify step (``speculative.draft_verify_step``: d_i ~ q_i, the rule with q)
      and rewound with the policy's to what each row kept. So no turn re-prefills the conversation.
  """

  def __init__(
    self,
    model,
    prompts,
    sampling,
    *,
    max_len: int,
    temperature: float = 1.0,
    suppress_eos=(),
    speculative=None,
    draft_model=None,
  ):
    vocab = model.config.vocab_size
    # the turns' policy: max_new_tokens is each turn's own, the default suppressed ids resolved against the stop ids
    self.policy = SamplingPolicy.from_config(
      sampling, temperature=temperature, vocab_size=vocab, stop_ids=suppress_eos, where="ConversationSampler"
    )
    g, self.pad_id = self.policy.num_samples, self.policy.pad_id
    max_len = _checks.check_python_int(max_len, "max_len", minimum=1, hint="cache slots")
    prompts = [list(p) for p in prompts]
    if not prompts or len(prompts) % g:
      raise ValueError(f"`prompts` must be B·G >= 1 token-id lists with G = num_samples = {g}; got {len(prompts)}")
    for i, p in enumerate(prompts):
      if not p:
        raise ValueError(f"`prompts[{i}]` is empty: every conversation needs at least one prompt token")
      if p != prompts[(i // g) * g]:
        raise ValueError(f"`prompts[{i}]` differs from its group's first prompt (rows b·G..b·G+G-1 share one)")
      _checks.check_token_ids(tuple(p), f"prompts[{i}]", vocab)
    limit = model.config.max_position_embeddings
    longest = max(len(p) for p in prompts)
    if not longest <= max_len <= limit:
      raise ValueError(
        f"`max_len` must be in [longest prompt = {longest}, max_position_embeddings = {limit}]; got {max_len}"
      )
    self.max_len, self.num_rows, self.vocab_size = max_len, len(prompts), vocab
    self._draft = split_draft(draft_model, model, speculative, max_len, self.policy)  # (graphdef, state) or None
    self.speculative = speculative
    self.stats = np.zeros(3, np.int64)  # verify steps, drafted, accepted
    self._history = [list(p) for p in prompts]  # every token of each conversation (prompt lookup's context)
    extra = 0 if speculative is None else speculative.num_draft  # a verify step writes k slots past the last kept
    self._graphdef, self._state = nnx.split(model)
    heads = [p[:-1] for p in prompts[::g]]
    width = bucket_width(max(1, max(len(h) for h in heads)), max_len)
    tokens = np.full((len(heads), width), self.pad_id, np.int32)
    mask = np.zeros((len(heads), width), bool)
    for b, h in enumerate(heads):
      tokens[b, : len(h)], mask[b, : len(h)] = h, True
    with target_platform(
      self._state
    ):  # the program of the devices that hold the model (docs/models.md, "Target platform")
      self._cache = _conversation_prefill_jit(
        self._graphdef, self._state, tokens, mask, num_samples=g, max_len=max_len + extra
      )
      # the draft model's cache: the same slots as the policy's (None without a draft model)
      self._draft_cache = None
      if self._draft is not None:
        self._draft_cache = _conversation_prefill_jit(
          *self._draft, tokens, mask, num_samples=g, max_len=max_len + extra
        )
    self._pending = [p[-1] for p in prompts]  # the token of each row not yet in the cache
    self._length = [len(p) for p in prompts]  # tokens of each conversation (its pending token included)

  @property
  def draft_cache(self):
    """The draft model's per-row ``KVCache`` (None without a draft model): row i holds conversation i but its
    last token at slots (and positions) ``0 .. length(i) - 2``, as the policy's cache does."""
    return self._draft_cache

  def length(self, row: int) -> int:
    """Tokens in conversation ``row`` so far (prompt, turns and appended tokens)."""
    return self._length[row]

  def turn(self, batches, *, max_new_tokens: int, appended=None, budgets=None, stop_ids=None):
    """One turn of the rows of ``batches``: append their ``appended`` tokens, then sample until a stop id,
    the row's budget or ``max_new_tokens``.

    Args:
      batches: ``[(key, rows), ...]``: row ``rows[j]`` samples with the uniforms ``generate(..., key=key)`` gives
        row j of a batch of ``len(rows)`` (token t: ``fold_in(key, t)``). Each row at most once over the batches.
      max_new_tokens: T, the static decode length of this turn (a compiled program per value).
      appended: ``{row: ids}``, context tokens placed after the row's last turn (an observation), or None.
      budgets: ``{row: int in [1, T]}``: tokens the row may sample this turn (default T).
      stop_ids: ``{row: tuple of ids}``: a sampled stop id ends the row's turn (kept in it); default none.

    Returns:
      ``{row: (tokens int32[L], log_probs f32[L])}`` for the rows of ``batches`` (NumPy), L >= 1; log-probs as
      :func:`generate` reports them.
    """
    t_new = _checks.check_python_int(max_new_tokens, "max_new_tokens", minimum=1, hint="T")
    n, appended, budgets, stop_ids = self.num_rows, appended or {}, budgets or {}, stop_ids or {}
    keys, key_index, draw_index, active = [], np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, bool)
    for k, (key, rows) in enumerate(batches):
      keys.append(_checks.check_prng_key(key, f"batches[{k}] key"))
      for j, i in enumerate(rows):
        if not 0 <= i < n or active[i]:
          raise ValueError(f"batches[{k}] row {i}: rows must be in [0, {n}) and appear once over the batches")
        active[i], key_index[i], draw_index[i] = True, k, j
    if not keys:
      return {}
    if len({jnp.asarray(k).dtype for k in keys}) > 1:
      raise TypeError("`batches` keys must be all typed (jax.random.key) or all raw uint32[2] keys")
    rows = np.flatnonzero(active).tolist()
    if not rows:
      return {}
    idle = sorted(set(appended) - set(rows))
    if idle:
      raise ValueError(f"`appended` has tokens for rows {idle} that take no turn in `batches`")
    for i, ids in appended.items():
      _checks.check_token_ids(tuple(ids), f"appended[{i}]", self.vocab_size)
    budget = np.zeros(n, np.int32)
    feeds = {}
    for i in rows:
      b = budgets.get(i, t_new)
      if not isinstance(b, (int, np.integer)) or not 1 <= b <= t_new:
        raise ValueError(f"budgets[{i}] must be an int in [1, max_new_tokens = {t_new}]; got {b!r}")
      budget[i] = b
      feeds[i] = [self._pending[i], *appended.get(i, ())]
      if self._length[i] + len(feeds[i]) - 1 + b - 1 > self.max_len:
        raise ValueError(
          f"row {i}: {self._length[i]} tokens + {len(feeds[i]) - 1} appended + a turn of {b} exceed the cache "
          f"(max_len = {self.max_len} slots holds conversations of max_len + 1 tokens)"
        )
    # The decode runs over the rows taking a turn only, their count rounded up to a power of two (padding rows
    # out of range: empty, budget 0, dropped on the way back), or over all N rows when that is no smaller.
    r = 1 << max(0, (len(rows) - 1).bit_length())
    order = list(range(n)) if r >= n else rows + [n] * (r - len(rows))  # decode row -> cache row
    width = bucket_width(max(len(f) for f in feeds.values()), self.max_len)
    feed = np.full((len(order), width), self.pad_id, np.int32)
    feed_mask = np.zeros((len(order), width), bool)
    feed_pos = np.zeros(len(order), np.int32)
    stops = [tuple(stop_ids.get(i, ())) for i in rows]
    s_width = max(1, max(len(s) for s in stops))
    stop_table = np.full((len(order), 1 << (s_width - 1).bit_length()), -1, np.int32)
    slot = {i: j for j, i in enumerate(order) if i in feeds}
    for i, j in slot.items():
      f = feeds[i]
      feed[j, : len(f)], feed_mask[j, : len(f)] = f, True
      feed_pos[j] = self._length[i] - 1
      stop_table[j, : len(stop_ids.get(i, ()))] = stop_ids.get(i, ())
    pick = np.asarray([min(i, n - 1) for i in order])  # per-row inputs of the padding rows: any, unused
    budget = np.where(np.asarray(order) < n, budget[pick], 0).astype(np.int32)
    spec = self.speculative
    history = None
    if spec is not None and self._draft is None:  # each decode row's conversation so far (prompt lookup's context)
      ctx = [self._history[i] + list(appended.get(i, ())) if i in feeds else [] for i in order]
      history = pad_left(ctx, bucket_width(max(len(c) for c in ctx), self.max_len + 1), self.pad_id)
    draft_graphdef, draft_state = self._draft or (None, None)
    with target_platform(
      self._state
    ):  # the program of the devices that hold the model (docs/models.md, "Target platform")
      (self._cache, self._draft_cache), tokens, logps, lengths, counts = _conversation_turn_jit(
        self._graphdef,
        self._state,
        (self._cache, self._draft_cache),
        None if r >= n else np.asarray(order, np.int32),
        feed,
        feed_mask,
        feed_pos,
        budget,
        stop_table,
        jnp.stack(keys),
        key_index[pick],
        draw_index[pick],
        history,
        draft_state,
        draft_graphdef=draft_graphdef,
        policy=dataclasses.replace(self.policy, max_new_tokens=t_new),
        num_draft=0 if spec is None else spec.num_draft,
        ngram=0 if spec is None else spec.ngram,
      )
    tokens, logps, lengths, counts = jax.device_get((tokens, logps, lengths, counts))
    self.stats += np.asarray(counts, np.int64)
    out = {}
    for i in rows:
      j = slot[i]
      m = int(lengths[j])
      out[i] = (np.asarray(tokens[j, :m]), np.asarray(logps[j, :m]))
      self._length[i] += len(feeds[i]) - 1 + m
      self._pending[i] = int(tokens[j, m - 1])
      self._history[i] += list(appended.get(i, ())) + out[i][0].tolist()
    return out


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("num_samples", "max_len"))
def _conversation_prefill_jit(graphdef, state, tokens, mask, *, num_samples, max_len):
  """The per-row cache of ``ConversationSampler``: B right-padded prompt heads at slots and positions 0..,
  repeated G times."""
  model = nnx.merge(graphdef, state)
  batch, width = tokens.shape
  cache = model.init_cache(batch, max_len, per_row=True)
  positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None], (batch, width))
  _, cache = model(tokens, positions, attention_mask=mask, cache=cache)
  return _models.repeat_cache(cache, num_samples)


@functools.partial(
  jax.jit, static_argnums=(0,), static_argnames=("draft_graphdef", "policy", "num_draft", "ngram"), donate_argnums=(2,)
)
def _conversation_turn_jit(
  graphdef,
  state,
  full_caches,
  rows,
  feed,
  feed_mask,
  feed_pos,
  budget,
  stop_table,
  keys,
  key_index,
  draw_index,
  history=None,
  draft_state=None,
  *,
  draft_graphdef=None,
  policy,
  num_draft=0,
  ngram=0,
):
  """One turn of ``ConversationSampler`` over R rows of the per-row caches ``full_caches`` (the policy's, and the
  draft model's or None; ``rows int32[R]``, their cache rows; out of range: padding; None: all N): the chunk
  ``feed [R, W]`` (right-padded, row i from position ``feed_pos[i]``) onto the cache(s), then the decode loop
  of ``_generate_jit`` with per-row budgets and stop ids, rows with ``budget == 0`` done from the start;
  ``policy`` (a ``SamplingPolicy``) with the turn's ``max_new_tokens``. ``num_draft`` k > 0: after token 0,
  verify steps instead (:func:`_spec_turn`): prompt-lookup drafts from ``history (int32[R, H], bool[R, H])``
  (each row's conversation so far, left-padded), or with ``draft_graphdef`` the draft model's (``draft_state``).
  Returns ((policy cache, draft cache or None), tokens, log-probs, lengths, ``int32[3]`` verify steps, drafted,
  accepted)."""
  model = nnx.merge(graphdef, state)
  draft = None if draft_graphdef is None else nnx.merge(draft_graphdef, draft_state)
  max_new_tokens, pad_id = policy.max_new_tokens, policy.pad_id
  take = lambda full: full if full is None or rows is None else _models.take_cache_rows(full, rows)
  cache, draft_cache = (take(c) for c in full_caches)
  n_rows, width = feed.shape
  positions = feed_pos[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
  hidden, cache = model(feed, positions, attention_mask=feed_mask, cache=cache)
  if draft is not None:  # the same chunk at the same slots: the draft's cache holds what the policy's holds
    _, draft_cache = draft(feed, positions, attention_mask=feed_mask, cache=draft_cache)
  n_feed = jnp.sum(feed_mask, axis=1, dtype=jnp.int32)
  last = jnp.maximum(n_feed - 1, 0)
  first_logits = model.logits(jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0], out_dtype=jnp.float32)
  start_pos = feed_pos + n_feed  # position of token 0 of the turn
  suppressed = suppressed_mask(policy.suppress_ids, first_logits.shape[-1])

  def put(caches):
    if rows is None:
      return caches
    return tuple(c if c is None else _models.put_cache_rows(f, rows, c) for f, c in zip(full_caches, caches))

  def uniforms(t):
    per_key = [jax.random.uniform(jax.random.fold_in(keys[k], t), (n_rows,), jnp.float32) for k in range(len(keys))]
    return jnp.stack(per_key)[key_index, draw_index]

  def record(t, logits, carry):
    token, logp = draw_token(logits, lambda: uniforms(t), policy, suppressed)
    tokens, logps, lengths, token = write_token(t, token, logp, carry, pad_id)
    done = carry[3] | jnp.any(token[:, None] == stop_table, axis=-1) | (lengths >= budget)
    return tokens, logps, lengths, done, token

  buffers = (
    jnp.full((n_rows, max_new_tokens), pad_id, jnp.int32),
    jnp.zeros((n_rows, max_new_tokens), jnp.float32),
    jnp.zeros((n_rows,), jnp.int32),
    budget <= 0,
  )
  *buffers, last_token = record(0, first_logits, buffers)
  if num_draft:
    row_keys = jax.vmap(jax.random.fold_in)(keys[key_index], draw_index)  # each row's own stream
    args = (model, (cache, draft, draft_cache), last_token, tuple(buffers), start_pos, history, stop_table, budget)
    caches, tokens, logps, lengths, counts = _spec_turn(*args, row_keys, policy, suppressed, num_draft, ngram)
    return put(caches), tokens, logps, lengths, counts

  def cond(loop_carry):
    t, _, _, buffers = loop_carry
    return (t < max_new_tokens) & ~jnp.all(buffers[3])

  def body(loop_carry):
    t, cache, last_token, buffers = loop_carry
    done = buffers[3]
    logits, cache = decode_logits(model, last_token, start_pos + t - 1, ~done, cache)
    *buffers, last_token = record(t, logits, buffers)
    return t + 1, cache, last_token, tuple(buffers)

  _, cache, _, (tokens, logps, lengths, _) = jax.lax.while_loop(
    cond, body, (jnp.int32(1), cache, last_token, tuple(buffers))
  )
  return put((cache, draft_cache)), tokens, logps, lengths, jnp.zeros((3,), jnp.int32)


def _spec_turn(
  model, caches, last, buffers, start_pos, history, stop_table, budget, row_keys, policy, suppressed, k, n
):
  """A turn's tokens 1.. by verify steps until every row is done: k drafts per running row — prompt lookup
  (``jaxgrpo.rollout.speculative.lookup_verify_step``, suffix length n) from ``history ‖ turn so far``, or, with
  ``caches = (cache, draft, draft_cache)`` holding a draft model, k decode steps of the draft from its own cache
  (``draft_verify_step``) — fed after its last token at its own positions ``start_pos + length - 1 ..``,
  accepted with the uniforms ``uniform(fold_in(row_keys, length), (k+1,))`` (``(2k+1,)`` with a draft model: k
  more for its draws; each length starts at most one step: fresh uniforms), the kept run cut at the row's stop
  ids (``stop_table``) and ``budget``, the cache(s) rewound to it. Returns ((cache, draft cache or None), tokens,
  log-probs, lengths, ``int32[3]`` verify steps, drafted, accepted)."""
  cache, draft, draft_cache = caches
  width = k + 1 if draft is None else 2 * k + 1
  draw = lambda t: jax.vmap(lambda key, i: jax.random.uniform(jax.random.fold_in(key, i), (width,)))(row_keys, t)
  args = (start_pos, draw, budget, stop_table, policy, suppressed)

  def body(c):
    (cache, draft_cache), rows, counts = c
    if draft is None:
      cache, rows, step = _speculative.lookup_verify_step(model, cache, rows, history, *args, k=k, ngram=n)
    else:
      cache, draft_cache, rows, step = _speculative.draft_verify_step(
        model, cache, draft, draft_cache, rows, *args, k=k
      )
    return (cache, draft_cache), rows, counts + step

  carry = ((cache, draft_cache), (*buffers, last), jnp.zeros((3,), jnp.int32))
  caches, (tokens, logps, lengths, _, _), counts = jax.lax.while_loop(lambda c: ~jnp.all(c[1][3]), body, carry)
  return caches, tokens, logps, lengths, counts
