"""Partial rollouts: rows kept in flight across weight updates, each token tagged with the version that sampled it.

A :class:`RowPool` decodes rows in a fixed number of slots (as ``jaxgrpo.rollout.refill``) and is *kept between
batches*: a batch takes the first complete groups (every one of its G rows ended), and the rows still running stay
in their slots for the next batch, which continues them with whatever version was published in between. So a long
row no longer holds the batch back; it finishes in a later one.

Data flow (S slots, T new tokens, P prompt width, K decode steps per boundary)::

    rounds of prompt indices (the data iterator's) --> queue of rows (G per prompt, a key each)
    per boundary, two jitted programs (:func:`_admit_jit`, :func:`_decode_jit`):
      admit R rows into slots: prefill each row's context ``prompt ‖ completion[:t]`` (t = 0 for a new row)
      with the *current* weights into its slot of the S-row per-row KV cache, draw its token t from the
      context's last hidden state; then up to K decode steps over the S slots
    the host reads the slots' tokens, log-probs and counts, tags the new tokens with the version, frees the
    slots of ended rows
    a version change: every running row is admitted again (its context re-prefilled with the new weights)

**Re-prefilled, not kept KV.** At a version change the KV of a running row is recomputed under the new weights
(one prefill of its context per running row and update). Every token t is then sampled from exactly
``π_v(· | prompt, completion[:t])`` of one version v, so its recorded log-prob is that policy's log-prob of it
(what a teacher-forced pass under version v recomputes) and the per-token version is a true statement. Keeping
the old KV would save the prefill, but a token would then be drawn from a mixture (old keys/values, new
queries) that no version's teacher-forced pass reproduces.

A token's uniform is ``uniform(fold_in(row key, t))``: a row's tokens depend on its key and on the versions
it ran under, not on its slot or boundary. A pool is one process's: with several processes each runs its own
(``jaxgrpo.loop.partial.schedule``).

**Speculative decoding** (``rollout.speculative``, a ``SpeculativeSwitch``): a boundary's K steps are then verify
steps (:func:`_spec_decode_jit`, ``jaxgrpo.rollout.speculative.verify_step``): k drafts per slot — prompt lookup,
or the switch's draft model, whose per-slot KV cache sits beside the target's and gets every admitted row's
context too (:func:`_draft_admit_jit`) — verified by one forward at the slot's own positions, 1 .. k+1 tokens kept
per slot and step, each token's log-prob the target's under the boundary's version — a version still changes only
between boundaries, and a running row is re-prefilled as above, so every token's version and log-prob stay exact.

One job at ~680 lines: the row pool — its bookkeeping (groups, queue, slots, staleness deadlines) and its three
jitted programs (admit, decode, verify steps).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgrpo import models as _models
from jaxgrpo.data import pad_left
from jaxgrpo.parallel.target import target_platform
from jaxgrpo.rollout import conversation as _conversation
from jaxgrpo.rollout import refill as _refill
from jaxgrpo.rollout import sampling as _sampling
from jaxgrpo.rollout import speculative as _speculative
from jaxgrpo.rollout.sampling import SamplingConfig

__all__ = ["RowPool", "PoolRow", "PoolGroup", "DataExhausted"]


class DataExhausted(RuntimeError):
  """:meth:`RowPool.run` needs more groups than the data has left: ``draw()`` returned no prompts (the end of the
  data) and every row drawn is done. ``complete`` groups are complete (``pool.take(complete)`` returns them),
  ``need`` were asked for."""

  def __init__(self, message: str, complete: int, need: int):
    super().__init__(message)
    self.complete, self.need = complete, need


@dataclasses.dataclass
class PoolRow:
  """One row: its prompt, key, budget and what it has sampled so far (host copies).

  Attributes:
    tokens, logp: ``int32[T]``, ``f32[T]`` the completion so far (pad / 0 after ``t``).
    versions: ``int64[T]`` the version that sampled each token (-1 after ``t``).
  """

  prompt: int
  group: int
  key: np.ndarray
  budget: int
  tokens: np.ndarray
  logp: np.ndarray
  versions: np.ndarray
  t: int = 0
  done: bool = False

  def span(self) -> tuple[int, int]:
    """(oldest, newest) version of the sampled tokens."""
    v = self.versions[: self.t]
    return int(v.min()), int(v.max())


@dataclasses.dataclass
class PoolGroup:
  """The G rows of one prompt; ``seq`` its place in drawing order, ``started`` the version its first row
  entered a slot with (None: queued)."""

  seq: int
  prompt: int
  rows: list
  started: int | None = None

  @property
  def complete(self) -> bool:
    return all(r.done for r in self.rows)

  def oldest(self) -> int | None:
    """The oldest version of any sampled token (None: nothing sampled yet)."""
    started = [r.span()[0] for r in self.rows if r.t]
    return min(started) if started else None


class RowPool:
  """S decode slots whose rows survive between batches (see the module docstring).

  One job, the slots' life cycle, in over 300 lines: admit rows into free slots, decode them in fixed-length
  rounds, take out the finished ones and carry the unfinished across weight updates.

  Args:
    sampling: the run's ``SamplingConfig`` (G, T = ``max_new_tokens``, EOS, filtering, pad).
    temperature: the sampling temperature.
    prompt_len: P, the prompt width (left-padded prompts of at most P tokens).
    num_slots: S >= 1, rows decoded at once (the KV cache holds S rows of P + T - 1 positions).
    refill_every: K >= 1, decode steps between boundaries.
    refill: a slot freed by an ended row takes the next queued row at the next boundary (slot refill); False:
      new rows enter only when no slot is running (a static batch whose unfinished rows carry over).
    budget_of: None, or ``budget_of(prompt, sample) -> int in [1, T]``, a row's token budget (benchmarks).
    speculative: None, or a :class:`~jaxgrpo.rollout.speculative.SpeculativeSwitch` (``rollout.speculative``):
      each boundary's K steps are then *verify steps* (:func:`_spec_decode_jit`: k drafts per slot from the row's
      own ``prompt ‖ completion`` by prompt lookup, or by the switch's ``draft_model`` from its per-slot cache,
      accepted by the rejection rule, 1 .. k+1 tokens per slot and step), every kept token's log-prob the
      target's under the boundary's version; ``auto`` times one
      :meth:`run` of each kind (the switch's rule) and keeps the faster. :attr:`sample_metrics` holds the last
      run's ``rollout/speculative_on`` and ``rollout/spec_acceptance``, :attr:`spec_counts` its
      ``(speculated, drafted, accepted)`` (several processes' pools combine them: ``jaxgrpo.loop.partial.schedule``).
  """

  speculative: _speculative.SpeculativeSwitch | None = None  # the subclasses' pools do not speculate
  _draft = None  # (graphdef, state) of the switch's draft model, set by _prepare; None: prompt lookup or no switch

  def __init__(
    self,
    *,
    sampling: SamplingConfig,
    temperature: float,
    prompt_len: int,
    num_slots: int,
    refill_every: int,
    refill: bool = True,
    budget_of=None,
    speculative: _speculative.SpeculativeSwitch | None = None,
  ):
    self.sampling, self.temperature = sampling, float(temperature)
    self.g = sampling.num_samples
    self.t_max = sampling.require_max_new_tokens("RowPool")
    self.prompt_len, self.slots, self.every, self.refill = prompt_len, num_slots, refill_every, refill
    self.budget_of = budget_of
    self.speculative = speculative
    self.max_len = _sampling.cache_slots(
      prompt_len, self.t_max, 0 if speculative is None else speculative.config.num_draft
    )
    self._policy = None  # the SamplingPolicy, resolved against the model's vocabulary at the first run
    self.reset()

  def reset(self) -> None:
    """Empties the pool (slots, queue, groups); the device state is rebuilt at the next :meth:`run`."""
    self._slot_rows: list[PoolRow | None] = [None] * self.slots
    self._queue: collections.deque[PoolRow] = collections.deque()
    self.groups: dict[int, PoolGroup] = {}  # drawn, neither taken nor dropped, by seq
    self._seq = 0
    self._version = None
    self._carry = None
    self._stop = np.zeros(self.slots, bool)
    self._sampled_total = 0  # tokens sampled by this pool's rows (auto's tokens per second)
    self._spec_counts = None  # [verify steps, drafted, accepted] of this run's boundaries; None: plain decoding
    self._draft_cache = None  # the draft model's per-slot KV cache (beside the carry's), built on first use
    self._draft_synced = False  # the draft cache holds every running row (its last run drafted with the model)
    self.sample_metrics: dict[str, float] = {}
    self.spec_counts: tuple[bool, int, int] | None = None  # the last run's (speculated, drafted, accepted)
    self._exhausted = False  # draw() returned no prompts in this run()

  # ------------------------------------------------------------------ bookkeeping
  def add_round(self, prompts, key) -> None:
    """Queues G rows of each prompt of ``prompts`` (a drawing round), row j's key ``fold_in(key, j)``."""
    prompts = [int(p) for p in prompts]
    if not prompts:
      return
    n = len(prompts) * self.g
    keys = np.asarray(jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(key, i)))(jnp.arange(n)))
    for b, p in enumerate(prompts):
      rows = []
      for s in range(self.g):
        budget = self.t_max if self.budget_of is None else int(self.budget_of(p, s))
        if not 1 <= budget <= self.t_max:
          raise ValueError(f"`budget_of({p}, {s})` must be in [1, max_new_tokens = {self.t_max}]; got {budget}")
        rows.append(
          PoolRow(
            prompt=p,
            group=self._seq,
            key=keys[b * self.g + s],
            budget=budget,
            tokens=np.full(self.t_max, self.sampling.pad_id, np.int32),
            logp=np.zeros(self.t_max, np.float32),
            versions=np.full(self.t_max, -1, np.int64),
          )
        )
      self.groups[self._seq] = PoolGroup(self._seq, p, rows)
      self._queue.extend(rows)
      self._seq += 1

  @property
  def next_seq(self) -> int:
    """The ``seq`` the next queued group gets (its place in this pool's drawing order)."""
    return self._seq

  def complete(self) -> list[PoolGroup]:
    """The complete groups, in drawing order."""
    return [g for _, g in sorted(self.groups.items()) if g.complete]

  def take(self, n: int) -> list[PoolGroup]:
    """Removes and returns ``n`` complete groups: the oldest first (by their oldest token, then drawing order:
    the groups that can wait least), returned in drawing order."""
    out = sorted(sorted(self.complete(), key=lambda g: (g.oldest(), g.seq))[:n], key=lambda g: g.seq)
    for grp in out:
      del self.groups[grp.seq]
    return out

  def drop_older(self, oldest_allowed: int) -> list[PoolGroup]:
    """Removes the groups with a token older than version ``oldest_allowed`` (they can no longer be trained
    within the staleness bound): their running rows stop, their queued rows leave the queue. Returns them."""
    dropped = [g for _, g in sorted(self.groups.items()) if (g.oldest() is not None and g.oldest() < oldest_allowed)]
    gone = {id(r) for g in dropped for r in g.rows}
    for s, row in enumerate(self._slot_rows):
      if row is not None and id(row) in gone:
        self._slot_rows[s], self._stop[s] = None, True
    self._queue = collections.deque(r for r in self._queue if id(r) not in gone)
    for grp in dropped:
      del self.groups[grp.seq]
    return dropped

  def untrained(self) -> list[int]:
    """The prompts drawn and neither taken nor dropped, in drawing order (one entry per group)."""
    return [g.prompt for _, g in sorted(self.groups.items())]

  def running(self) -> int:
    """Rows in the slots now."""
    return sum(r is not None for r in self._slot_rows)

  # ------------------------------------------------------------------ decoding
  def overdue(self, keep_from: int | None) -> set[int]:
    """The incomplete groups holding a token older than version ``keep_from`` (None: none)."""
    if keep_from is None:
      return set()
    return {q for q, g in self.groups.items() if not g.complete and g.oldest() is not None and g.oldest() < keep_from}

  def may_start(self, version: int, batch: int, max_staleness: int, need: int) -> bool:
    """Whether a new group may start now (version ``version``, producing batch ``batch`` of ``need`` groups)
    and still be trained within ``max_staleness``: a group started with version u must be trained by batch
    ``u + 1 + k`` (its deadline). The new group's deadline is the latest, so (earliest deadline first) every
    deadline stays met iff the started groups, plus it, fit the ``need`` groups of each batch from ``batch``
    to that deadline (the earlier deadlines were met before)."""
    started = sum(g.started is not None for g in self.groups.values())
    return started + 1 <= need * (version + 1 + max_staleness - batch + 1)

  def _next_rows(self, free: list[int], finishing: set[int] | None, draw, key, rounds: list, may_start) -> list[int]:
    """Fills the free slots from the queue (drawing a round when it is empty); ``finishing``: only rows of
    those groups, nothing drawn; ``may_start()``: whether the next queued group may start (else nothing more
    enters). Returns the slots filled."""
    filled = []
    for s in free:
      if finishing is not None:
        row = next((r for r in self._queue if r.group in finishing), None)
        if row is None:
          break
        self._queue.remove(row)
      else:
        if not self._queue and self._exhausted:
          break
        if not self._queue:
          prompts = list(draw())
          if not prompts:  # the end of the data: the rows drawn so far finish, nothing more starts
            self._exhausted = True
            break
          self.add_round(prompts, jax.random.fold_in(key, len(rounds)))
          rounds.append(None)
        if self.groups[self._queue[0].group].started is None and not may_start():
          break
        row = self._queue.popleft()
      self._slot_rows[s] = row
      filled.append(s)
      if self.groups[row.group].started is None:
        self.groups[row.group].started = self._version
    return filled

  def run(
    self,
    model,
    version: int,
    key,
    *,
    need: int,
    draw,
    prompt_tokens,
    batch: int | None = None,
    max_staleness: int | None = None,
    on_dispatched=None,
  ) -> dict:
    """Decodes until ``need`` groups are complete, with ``model`` (version ``version``; a running row started
    under another version is re-prefilled first). With ``batch`` (m, the batch produced) and ``max_staleness``
    (k): an incomplete group holding a token older than m - k is finished now (it could not wait for batch
    m + 1), and a new group starts only if :meth:`may_start` (every started group can still be trained
    within k). ``draw()`` returns the next round of prompt indices when the queue is empty (queued with a
    key from ``key``); an empty round is the end of the data: nothing more is drawn in this call, the rows
    already drawn finish, and when they leave fewer than ``need`` complete groups :class:`DataExhausted` says so
    (the complete groups stay in the pool). ``prompt_tokens[i]``: prompt i's token ids. ``on_dispatched()``:
    after the first boundary's programs are dispatched. Returns ``{"boundaries", "reprefilled",
    "finishing_boundaries"}``."""
    decoder = self._prepare(model, version, key)
    info = {"boundaries": 0, "reprefilled": 0, "finishing_boundaries": 0}
    rounds: list = []
    self._exhausted = False
    spec_start = self._start_spec()
    self._spec_loop(decoder, info, rounds, version, key, need, draw, prompt_tokens, batch, max_staleness, on_dispatched)
    self._finish_spec(spec_start)
    return info

  def _start_spec(self):
    """Before a :meth:`run`: which kind decodes it (the switch's ``mode_now``; None without a switch), its
    counters zeroed, the clock and the tokens so far."""
    if self.speculative is None:
      return None
    mode = self.speculative.mode_now()
    self._spec_counts = None if mode == "plain" else [0, 0, 0]
    if self._draft is not None:  # plain runs leave the draft cache behind: its running rows are re-prefilled
      if mode != "plain" and not self._draft_synced:
        self._version = None
      self._draft_synced = mode != "plain"
    return time.perf_counter(), self._tokens_sampled()

  def _finish_spec(self, start) -> None:
    """After a :meth:`run`: the switch observes it (``auto``: tokens per second of the run, one call of its
    rule), and :attr:`sample_metrics` says what ran."""
    if start is None:
      return
    t0, tokens0 = start
    seconds, tokens = self._sampler_seconds(t0), self._tokens_sampled() - tokens0
    counts = self._spec_counts
    stats = None if counts is None else _speculative.SpeculativeStats(*(np.int32(c) for c in counts))
    self.speculative.observe(
      "plain" if counts is None else self.speculative.drafter, tokens / max(seconds, 1e-9), stats
    )
    self.sample_metrics = dict(self.speculative.metrics)
    self.spec_counts = (False, 0, 0) if counts is None else (True, int(counts[1]), int(counts[2]))

  def _sampler_seconds(self, t0: float) -> float:
    """Seconds this run spent sampling (here the whole :meth:`run` since ``t0``)."""
    return time.perf_counter() - t0

  def _tokens_sampled(self) -> int:
    """Tokens sampled so far by the rows this pool holds or handed out (a running count)."""
    return self._sampled_total

  def _spec_loop(
    self, decoder, info, rounds, version, key, need, draw, prompt_tokens, batch, max_staleness, on_dispatched
  ):
    """:meth:`run`'s loop (see there)."""
    while True:
      short = len(self.complete()) < need
      overdue = self.overdue(None if max_staleness is None else batch - max_staleness)
      if not short and not overdue:
        break
      # rows started under another version: their contexts re-prefilled with these weights first
      readmit = [] if version == self._version else self._readmitted()
      self._version = version
      info["reprefilled"] += len(readmit)
      info["finishing_boundaries"] += not short
      free = [s for s, r in enumerate(self._slot_rows) if r is None]
      admit = list(readmit)
      if self.refill or len(free) == self.slots:
        may_start = lambda: max_staleness is None or self.may_start(version, batch, max_staleness, need)
        admit += self._next_rows(free, None if short else overdue, draw, key, rounds, may_start)
      if self.running() == 0 and self._exhausted:
        done = len(self.complete())
        raise DataExhausted(
          f"{type(self).__name__}.run: draw() returned no prompts (the end of the data) and every row drawn is "
          f"done: {done} of the {need} groups asked for are complete; take them with pool.take({done}), or draw "
          "from data that does not run out (a PromptIterator starts another epoch)",
          done,
          need,
        )
      if self.running() == 0:
        raise RuntimeError(
          f"{type(self).__name__}: {len(self.complete())} of {need} groups complete and nothing left to decode"
        )
      self._boundary(decoder, sorted(admit), version, prompt_tokens)
      info["boundaries"] += 1
      if info["boundaries"] == 1 and on_dispatched is not None:
        on_dispatched()

  def _slot_prompts(self, prompt_tokens):
    """``(int32[S, P], bool[S, P])``: each slot's row's prompt, left-padded to P (empty slots: none), so that
    ``prompt ‖ completion`` is contiguous for prompt lookup."""
    rows = [[] if r is None else list(prompt_tokens[r.prompt]) for r in self._slot_rows]
    return pad_left(rows, self.prompt_len, self.sampling.pad_id)

  def _readmitted(self) -> list[int]:
    """The slots whose rows are re-prefilled when the version changes (here every running row: its KV cache
    was computed with the old weights); :meth:`run` counts them as ``reprefilled``."""
    return [s for s, r in enumerate(self._slot_rows) if r is not None]

  def _prepare(self, model, version: int, key):
    """What :meth:`_boundary` decodes with in this :meth:`run` (here ``(graphdef, state)`` of ``model``; the
    device carry built on first use). ``jaxgrpo.loop.partial.engine.EnginePool`` decodes with an engine."""
    graphdef, state = nnx.split(self.sampling.model_to_sample(model))
    if self._policy is None:
      self._policy = _sampling.SamplingPolicy.from_config(
        self.sampling, temperature=self.temperature, vocab_size=model.config.vocab_size, where=type(self).__name__
      )
    if self._carry is None:
      with target_platform(state):  # the program of the devices that hold the model (docs/models.md, "Target platform")
        self._carry = _init_jit(graphdef, state, num_slots=self.slots, max_len=self.max_len, policy=self._policy)
    self._prepare_draft(model)
    return graphdef, state

  def _prepare_draft(self, model) -> None:
    """The switch's draft model split once (checked against ``model``: its vocabulary and positions) and its
    per-slot cache built on first use (``max_len`` slots, as the target's)."""
    draft = None if self.speculative is None else self.speculative.draft_model
    if draft is None:
      return
    if self._draft is None:
      _speculative.check_draft_model(draft, model, (1, self.prompt_len), self._policy)
      self._draft = nnx.split(draft)
    if self._draft_cache is None:
      with target_platform(self._draft[1]):
        self._draft_cache = _empty_cache_jit(*self._draft, num_slots=self.slots, max_len=self.max_len)

  def _boundary(self, decoder, admit: list[int], version: int, prompt_tokens) -> None:
    """Two jitted programs: the rows of slots ``admit`` (re)admitted with their contexts (one program per
    admitted-row count and context width bucket), then K decode steps (one program); the host copies updated."""
    graphdef, state = decoder
    r = min(self.slots, max(8, 1 << max(0, len(admit) - 1).bit_length()))  # 8, 16, ...: few compiled programs
    rows = [self._slot_rows[s] for s in admit]
    lens = [len(prompt_tokens[row.prompt]) + row.t for row in rows]
    width = _conversation.bucket_width(max(lens, default=1), self.max_len)
    ctx = np.full((r, width), self.sampling.pad_id, np.int32)
    ctx_mask = np.zeros((r, width), bool)
    plen, start_t, budgets = np.zeros(r, np.int32), np.zeros(r, np.int32), np.ones(r, np.int32)
    row_tok = np.full((r, self.t_max), self.sampling.pad_id, np.int32)
    row_lp = np.zeros((r, self.t_max), np.float32)
    keys = np.zeros((r, 2), np.uint32)
    slots = np.full(r, self.slots, np.int32)
    for i, (s, row) in enumerate(zip(admit, rows)):
      p = list(prompt_tokens[row.prompt])
      ctx[i, : lens[i]] = p + row.tokens[: row.t].tolist()  # real tokens first: token k at position k
      ctx_mask[i, : lens[i]] = True
      plen[i], start_t[i], budgets[i], keys[i], slots[i] = len(p), row.t, row.budget, row.key, s
      row_tok[i], row_lp[i] = row.tokens, row.logp
    with target_platform(state):  # the program of the devices that hold the model (docs/models.md, "Target platform")
      self._carry = _admit_jit(
        graphdef,
        state,
        self._carry,
        self._stop,
        ctx,
        ctx_mask,
        plen,
        start_t,
        row_tok,
        row_lp,
        slots,
        keys,
        budgets,
        policy=self._policy,
      )
      drafting = self._spec_counts is not None and self._draft is not None
      if drafting:  # the same contexts into the same slots of the draft model's cache
        self._draft_cache = _draft_admit_jit(*self._draft, self._draft_cache, ctx, ctx_mask, slots)
      if self._spec_counts is None:
        self._carry, _ = _decode_jit(graphdef, state, self._carry, refill_every=self.every, policy=self._policy)
      else:
        cfg = self.speculative.config
        draft_graphdef, draft_state = self._draft if drafting else (None, None)
        self._carry, self._draft_cache, counts = _spec_decode_jit(
          graphdef, state, self._carry, *self._slot_prompts(prompt_tokens), draft_state, self._draft_cache,
          draft_graphdef=draft_graphdef, refill_every=self.every, policy=self._policy, num_draft=cfg.num_draft,
          ngram=cfg.ngram,
        )  # fmt: skip
        self._spec_counts = [a + int(b) for a, b in zip(self._spec_counts, jax.device_get(counts))]
    self._stop = np.zeros(self.slots, bool)
    t, done, tok, lp = (np.asarray(x) for x in jax.device_get(tuple(self._carry[i] for i in (1, 4, 7, 8))))
    for s, row in enumerate(self._slot_rows):
      if row is None:
        continue
      new = int(t[s])
      self._sampled_total += new - row.t
      row.tokens[:new], row.logp[:new] = tok[s, :new], lp[s, :new]
      row.versions[row.t : new] = version
      row.t = new
      if done[s]:
        row.done, self._slot_rows[s] = True, None


@functools.partial(
  jax.jit,
  static_argnums=(0,),
  static_argnames=("draft_graphdef", "refill_every", "policy", "num_draft", "ngram"),
  donate_argnums=(2, 6),
)
def _spec_decode_jit(
  graphdef, state, carry, slot_prompt, slot_prompt_mask, draft_state, draft_cache, *, draft_graphdef, refill_every,
  policy, num_draft, ngram,
):  # fmt: skip
  """Up to ``refill_every`` *verify steps* over the S slots: per running slot, k = ``num_draft`` drafts — by prompt
  lookup from ``slot_prompt ‖ completion`` (``int32[S, P]`` left-padded, its mask;
  ``jaxgrpo.rollout.speculative.lookup_verify_step``), or with ``draft_graphdef`` not None by the draft model
  (``draft_state``, its per-slot ``draft_cache`` holding each slot's context like the carry's cache;
  ``draft_verify_step``) — fed after the slot's last token at its own positions, accepted by the rejection rule
  with the uniforms ``uniform(fold_in(row key, t), (k+1,))`` (``(2k+1,)`` with a draft model: k more for its
  draws; t: the first token the step emits — each t starts at most one step, so every step's uniforms are
  fresh); the kept run (cut at EOS and the slot's budget) written at the slot's next columns and its caches
  rewound to it. Returns (carry, draft_cache, ``int32[3]``: verify steps, drafted, accepted)."""
  model = nnx.merge(graphdef, state)
  draft = None if draft_graphdef is None else nnx.merge(draft_graphdef, draft_state)
  cache, s_t, s_start, s_last, s_done, s_budget, s_key, out_tok, out_lp = carry
  suppressed = _sampling.suppressed_mask(policy.suppress_ids, model.config.vocab_size)
  width = num_draft + 1 if draft is None else 2 * num_draft + 1
  one = lambda key, t: jax.random.uniform(jax.random.fold_in(jax.random.wrap_key_data(key), t), (width,))
  draw = lambda t: jax.vmap(one)(s_key, t)
  history = (slot_prompt, slot_prompt_mask)

  def body(c):
    i, cache, draft_cache, rows, counts = c
    args = (s_start, draw, s_budget, policy.eos_ids, policy, suppressed)
    if draft is None:
      cache, rows, step = _speculative.lookup_verify_step(model, cache, rows, history, *args, k=num_draft, ngram=ngram)
    else:
      cache, draft_cache, rows, step = _speculative.draft_verify_step(
        model, cache, draft, draft_cache, rows, *args, k=num_draft
      )
    return i + 1, cache, draft_cache, rows, counts + step

  rows = (out_tok, out_lp, s_t, s_done, s_last)
  cond = lambda c: (c[0] < refill_every) & ~jnp.all(c[3][3])
  init = (jnp.int32(0), cache, draft_cache, rows, jnp.zeros((3,), jnp.int32))
  _, cache, draft_cache, rows, counts = jax.lax.while_loop(cond, body, init)
  out_tok, out_lp, s_t, s_done, s_last = rows
  return (cache, s_t, s_start, s_last, s_done, s_budget, s_key, out_tok, out_lp), draft_cache, counts


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("num_slots", "max_len"))
def _empty_cache_jit(graphdef, state, *, num_slots, max_len):
  """An empty per-slot KV cache of the model ``(graphdef, state)`` (the draft model's, beside the carry's)."""
  return nnx.merge(graphdef, state).init_cache(num_slots, max_len, per_row=True)


def _prefill_slots(model, cache, ctx, ctx_mask, slots):
  """The contexts ``ctx int32[R, W]`` (real tokens first, ``ctx_mask``) prefilled and put into the rows ``slots
  int32[R]`` of the per-slot ``cache`` (slot S: padding, dropped). Returns (hidden f32[R, W, D], cache)."""
  r, width = ctx.shape
  positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None], (r, width))
  hidden, sub = model(ctx, positions, attention_mask=ctx_mask, cache=model.init_cache(r, width, per_row=True))
  return hidden, _models.put_cache_rows(cache, slots, _refill.pad_slots(sub, cache.max_len))


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _draft_admit_jit(graphdef, state, cache, ctx, ctx_mask, slots):
  """:func:`_admit_jit`'s contexts prefilled into the same slots of the draft model's cache (nothing drawn: the
  draft's cache holds what the target's holds). Returns the cache."""
  return _prefill_slots(nnx.merge(graphdef, state), cache, ctx, ctx_mask, slots)[1]


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("num_slots", "max_len", "policy"))
def _init_jit(graphdef, state, *, num_slots, max_len, policy):
  """The empty carry: (cache, slot t, slot prompt length, slot last token, slot done, slot budget, slot key,
  slot tokens, slot log-probs)."""
  model = nnx.merge(graphdef, state)
  s, max_new_tokens, pad_id = num_slots, policy.max_new_tokens, policy.pad_id
  return (
    model.init_cache(s, max_len, per_row=True),
    jnp.zeros((s,), jnp.int32),  # t: tokens the slot's row has sampled
    jnp.zeros((s,), jnp.int32),  # the row's real prompt length (position of its completion token 0)
    jnp.zeros((s,), jnp.int32),  # last sampled token (fed next)
    jnp.ones((s,), bool),  # done (or free)
    jnp.zeros((s,), jnp.int32),  # the row's budget
    jnp.zeros((s, 2), jnp.uint32),  # the row's key data
    jnp.full((s, max_new_tokens), pad_id, jnp.int32),
    jnp.zeros((s, max_new_tokens), jnp.float32),
  )


def _uniforms(keys, t):
  """``f32[S]``: ``uniform(fold_in(key_s, t_s))`` of each slot (a row's own stream, whatever its slot)."""
  one = lambda k, i: jax.random.uniform(jax.random.fold_in(jax.random.wrap_key_data(k), i), (), jnp.float32)
  return jax.vmap(one)(keys, t)


def _drawer(model, policy):
  """``draw(logits, keys, t) -> (token, log-prob)`` under ``policy``, each slot's uniform from its own key and
  step."""
  suppressed = _sampling.suppressed_mask(policy.suppress_ids, model.config.vocab_size)

  def draw(logits, keys, t):
    u = lambda: _uniforms(keys, t)
    return _sampling.draw_token(logits, u, policy, suppressed)

  return draw


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("policy",), donate_argnums=(2,))
def _admit_jit(
  graphdef,
  state,
  carry,
  stop,
  ctx,
  ctx_mask,
  plen,
  start_t,
  row_tok,
  row_lp,
  slots,
  keys,
  budgets,
  *,
  policy,
):
  """Slots ``stop`` halt; R rows enter ``slots int32[R]`` (padding: slot S): their contexts ``ctx int32[R, W]``
  (real tokens first) prefilled into their cache rows, their completion so far (``row_tok``, ``row_lp``)
  copied, token ``start_t`` drawn from the context's last hidden state under ``policy`` (a ``SamplingPolicy``).
  Returns the carry."""
  model = nnx.merge(graphdef, state)
  draw = _drawer(model, policy)
  cache, s_t, s_start, s_last, s_done, s_budget, s_key, out_tok, out_lp = carry
  s_done = s_done | stop
  r = ctx.shape[0]
  hidden, cache = _prefill_slots(model, cache, ctx, ctx_mask, slots)
  last = jnp.maximum(jnp.sum(ctx_mask, axis=1, dtype=jnp.int32) - 1, 0)
  hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
  token, logp = draw(model.logits(hidden, out_dtype=jnp.float32), keys, start_t)
  at = jnp.arange(r)
  put = lambda x, y: x.at[slots].set(y, mode="drop")
  out_tok = put(out_tok, row_tok.at[at, start_t].set(token))
  out_lp = put(out_lp, row_lp.at[at, start_t].set(logp))
  s_t, s_start, s_last, s_key = put(s_t, start_t + 1), put(s_start, plen), put(s_last, token), put(s_key, keys)
  s_done, s_budget = (
    put(s_done, _sampling.is_eos(token, policy.eos_ids) | (start_t + 1 >= budgets)),
    put(s_budget, budgets),
  )
  return cache, s_t, s_start, s_last, s_done, s_budget, s_key, out_tok, out_lp


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("refill_every", "policy"), donate_argnums=(2,))
def _decode_jit(graphdef, state, carry, *, refill_every, policy):
  """Up to ``refill_every`` decode steps over the S slots (a ``lax.while_loop`` that exits once no slot
  runs), drawn under ``policy`` (a ``SamplingPolicy``). Returns (carry, decode steps)."""
  model = nnx.merge(graphdef, state)
  draw = _drawer(model, policy)
  max_new_tokens, eos_ids = policy.max_new_tokens, policy.eos_ids
  cache, s_t, s_start, s_last, s_done, s_budget, s_key, out_tok, out_lp = carry
  num_slots = s_t.shape[0]

  def cond(c):
    return (c[0] < refill_every) & ~jnp.all(c[4])

  def body(c):
    k, cache, s_t, s_last, s_done, out_tok, out_lp = c
    active, logits, cache = _refill.slot_logits(model, cache, s_start, s_t, s_last, s_done)
    token, logp = draw(logits, s_key, s_t)
    at = jnp.where(active, jnp.arange(num_slots), num_slots)  # finished slots write nowhere
    col = jnp.minimum(s_t, max_new_tokens - 1)
    out_tok = out_tok.at[at, col].set(token, mode="drop")
    out_lp = out_lp.at[at, col].set(logp, mode="drop")
    s_t, s_last, s_done = _refill.advance_slots(active, token, s_t, s_last, s_done, s_budget, eos_ids)
    return k + 1, cache, s_t, s_last, s_done, out_tok, out_lp

  k, cache, s_t, s_last, s_done, out_tok, out_lp = jax.lax.while_loop(
    cond, body, (jnp.int32(0), cache, s_t, s_last, s_done, out_tok, out_lp)
  )
  return (cache, s_t, s_start, s_last, s_done, s_budget, s_key, out_tok, out_lp), k
