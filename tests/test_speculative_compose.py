"""Speculative decoding composed with partial rollouts (issue 51.3): the partial pool's verify steps
(``jaxgrpo.loop.partial.pool._spec_decode_jit``).

References are independent of the code under test: a teacher-forced, cache-free forward of each version's
parameters (``models.log_probs.completion_log_probs``) for every recorded log-prob, and the target's exact joint
distribution of the first tokens (enumerated by teacher forcing, NumPy) for the sampled sequences (chi-square).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import ref_completion_log_probs, ref_log_probs
from test_speculative import _chi_square_p, _exact_joint, _model

from jaxgrpo.data import pad_left
from jaxgrpo.loop.partial.pool import RowPool
from jaxgrpo.rollout.sampling import SamplingConfig
from jaxgrpo.rollout.speculative import SpeculativeConfig, SpeculativeSwitch

pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")  # tests/conftest.py


def _switch(mode="ngram", k=3, n=1, draft=None):
  """A speculative switch: prompt lookup (``ngram``), or with ``draft`` (a model) that draft model (mode
  ``ngram`` becomes ``draft``)."""
  if draft is None:
    return SpeculativeSwitch(config=SpeculativeConfig(mode=mode, num_draft=k, ngram=n))
  mode = "draft" if mode == "ngram" else mode
  return SpeculativeSwitch(config=SpeculativeConfig(mode=mode, num_draft=k, draft="in memory"), draft_model=draft)


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_pool_verify_steps_record_each_tokens_version_log_prob(drafter):
  """The row pool with verify steps — prompt lookup, or a draft model (version 0's parameters, which do not
  change: its per-slot cache re-prefilled with each readmitted row) — three versions (three peaked random
  models whose greedy-like loops prompt lookup drafts well), k = 3, one group per batch: a long row crosses both
  updates (re-prefilled under each new version) while drafts are accepted; every recorded log-prob equals the
  teacher-forced one of the version the row records for that token (2e-5), and differs from the other
  versions' (the test can fail)."""
  policies = [_model(61, 5.0, seed=v) for v in range(3)]
  prompts = [[5, 6, 7, 5, 6, 7, 5][: 2 + i % 6] for i in range(8)]
  sampling = SamplingConfig(num_samples=2, max_new_tokens=24, pad_id=0)
  switch = _switch(draft=policies[0] if drafter == "model" else None)
  pool = RowPool(
    sampling=sampling, temperature=0.2, prompt_len=7, num_slots=4, refill_every=2, speculative=switch,
    budget_of=lambda p, s: 24 if (p, s) == (0, 0) else 2,
  )  # fmt: skip
  order = iter(range(8))
  taken, infos, metrics = [], [], []
  for batch in (1, 2, 3):
    v = batch - 1
    infos.append(
      pool.run(
        policies[v],
        v,
        jax.random.key(batch),
        need=1,
        draw=lambda: [next(order)],
        prompt_tokens=prompts,
        batch=batch,
        max_staleness=2,
      )  # fmt: skip
    )
    metrics.append(dict(pool.sample_metrics))
    taken.append(pool.take(1)[0])
  assert all(m["rollout/speculative_on"] == 1.0 for m in metrics)
  assert max(m["rollout/spec_acceptance"] for m in metrics) > 0.2  # drafts were accepted (several tokens a step)
  long = next(r for g in taken for r in g.rows if r.budget == 24)
  assert long.t == 24 and set(long.versions[:24].tolist()) == {0, 1, 2}
  rows = [r for g in taken for r in g.rows]
  for row in rows:
    tok, mask = pad_left([prompts[row.prompt]], 7, 0)
    comp, cmask = row.tokens[None], (np.arange(24) < row.t)[None]
    for v, policy in enumerate(policies):
      sel = row.versions == v
      if not sel.any():
        continue
      lp = ref_completion_log_probs(policy, tok, mask, comp, cmask, temperature=0.2)
      np.testing.assert_allclose(np.asarray(lp)[0][sel], row.logp[sel], atol=2e-5, err_msg=f"version {v}")
      if row is long:
        others = (row.versions >= 0) & (row.versions != v)
        assert np.abs(np.asarray(lp)[0] - row.logp)[others].min() > 1e-4


@pytest.mark.parametrize("top_k,drafter", [(0, "ngram"), (4, "ngram"), (0, "model"), (4, "model")])
def test_pool_sequences_follow_the_target_distribution(top_k, drafter):
  """Many rows of one prompt through the pool's verify steps (k = 2, the slots refilled as rows end), prompt
  lookup or a draft model (another random model of the vocabulary, its cache refilled with the slots): the joint
  distribution of their 3 tokens equals the target's exact one (chi-square, p > 1e-4), with drafts accepted and
  rejected."""
  model = _model(7, 2.0, seed=2)
  prompt = [3, 4, 5, 3, 4, 5, 3]
  length, g = 3, 4000
  draft = _model(7, 2.0, seed=5) if drafter == "model" else None
  pool = RowPool(
    sampling=SamplingConfig(num_samples=g, max_new_tokens=length, top_k=top_k, pad_id=0), temperature=0.8,
    prompt_len=len(prompt), num_slots=1024, refill_every=2, speculative=_switch(k=2, draft=draft),
  )  # fmt: skip
  drawn = iter([[0]])
  pool.run(model, 0, jax.random.key(11), need=1, draw=lambda: next(drawn, []), prompt_tokens=[prompt])
  assert 0.05 < pool.sample_metrics["rollout/spec_acceptance"] < 0.95  # both branches of the rule ran
  (group,) = pool.take(1)
  seqs = np.stack([r.tokens for r in group.rows])
  assert (np.asarray([r.t for r in group.rows]) == length).all()
  counts = np.bincount(np.ravel_multi_index(seqs.T, (7,) * length), minlength=7**length)
  assert _chi_square_p(counts, _exact_joint(model, np.asarray(prompt), length, 0.8, top_k)) > 1e-4


@pytest.mark.parametrize("drafter", ["ngram", "itself"])
def test_pool_auto_times_one_run_of_each_kind_and_logs(caplog, drafter):
  """``auto`` on the pool: one untimed and one timed run of each kind (plain first), then the faster kept; the
  logged numbers are those the decision compares, and the metrics say which kind ran. With the target as its own
  draft model (greedy): every draft is accepted — the draft's cache holds each slot's context, rows that ran
  plain steps in flight included (odd prompts' rows are long: re-prefilled when the kind turns to drafting)."""
  model = _model(61, 5.0)
  prompts = [[5, 6, 7, 5, 6, 7, 5]] * 12
  switch = _switch(mode="auto", draft=model if drafter == "itself" else None)
  pool = RowPool(
    sampling=SamplingConfig(num_samples=2, max_new_tokens=10, pad_id=0), temperature=0.0, prompt_len=7,
    num_slots=4, refill_every=4, speculative=switch, budget_of=lambda p, s: 10 if p % 2 else 2,
  )  # fmt: skip
  order = iter(range(12))
  kinds, running, decided = [], [], None
  with caplog.at_level("WARNING", logger="jaxgrpo.rollout.speculative"):
    for i in range(8):  # until one run after the decision (a run that decodes nothing is not one of auto's calls)
      kinds.append(switch.mode_now())
      running.append(pool.running())
      info = pool.run(model, 0, jax.random.key(i), need=1, draw=lambda: [next(order)], prompt_tokens=prompts)
      assert pool.sample_metrics["rollout/speculative_on"] == float(kinds[-1] == switch.drafter)
      if drafter == "itself" and kinds[-1] == "draft" and info["boundaries"]:
        assert pool.sample_metrics["rollout/spec_acceptance"] == 1.0, pool.sample_metrics
      pool.take(1)
      if decided is not None:
        break
      decided = i if switch.measured else None
  m = switch.measured
  d = switch.drafter
  assert decided is not None and switch.calls >= 4
  assert kinds[:4] == ["plain", "plain", d, d] and running[2] > 0  # the first drafting run: rows in flight
  assert set(kinds[2 : decided + 1]) == {d} and kinds[decided + 1] == (d if m["speculative_on"] else "plain")
  (line,) = [r.getMessage() for r in caplog.records if "rollout.speculative auto" in r.getMessage()]
  assert f"plain {m['plain_tokens_per_s']:.1f} tokens/s" in line and f"{m['speculative_tokens_per_s']:.1f}" in line


def _train_observed(tr, steps):
  """``steps`` steps of the partial-rollout trainer ``tr``: (the produced batches, the step records,
  ``logp(version, batch)``: teacher-forced log-probs under each version's parameters)."""
  from test_partial_rollouts import log_probs_under

  versions = {0: jax.tree.map(np.asarray, tr.state.train.params)}
  seen, recs = [], []
  tr.rollouts.observe = seen.append
  try:
    for step in range(1, steps + 1):
      recs.append(tr.train_step())
      versions[step] = jax.tree.map(np.asarray, tr.state.train.params)
  finally:
    tr.rollouts.close()
  return seen, recs, log_probs_under(tr, versions)


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_a_partial_run_speculates(tmp_path, drafter):
  """``rollout.speculative: ngram`` — and ``draft`` with a draft model directory (``rollout.speculative_draft``)
  — with ``rollout.partial`` (each refused before): the trainer's row pool decodes by verify steps (metrics
  ``rollout/speculative_on`` 1 and the acceptance), and every trained token's behaviour log-prob is the
  teacher-forced log-prob of the version it records."""
  from test_async_rollout import REWARDS
  from test_partial_rollouts import PARTIAL
  from test_trainer import tiny

  from jaxgrpo import models
  from jaxgrpo.run import builders
  from jaxgrpo.run.trainer import Trainer

  over = {
    "run.out": str(tmp_path), "run.steps": 3, "rollout.max_staleness": 2, "rollout.partial": PARTIAL,
    "rollout.speculative": "ngram", "rollout.speculative_tokens": 3, "objective.importance_correction": "tis",
    "optim.learning_rate": 3e-2,
  }  # fmt: skip
  if drafter == "draft":  # a smaller model of the policy's vocabulary, saved as a HF directory
    vocab = builders.model_config(tiny(**over).model).vocab_size
    small = models.Qwen3Config(vocab_size=vocab, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    models.save_hf(models.build_model(small, rngs=nnx.Rngs(7)), tmp_path / "draft")
    over.update({"rollout.speculative": "draft", "rollout.speculative_draft": str(tmp_path / "draft")})
  tr = Trainer(tiny(**over), reward_fns=REWARDS, log=None)
  pipe = tr.rollouts
  assert type(pipe.pool) is RowPool and pipe.pool.speculative is tr.engine.switch
  assert (tr.engine.switch.draft_model is None) == (drafter == "ngram")
  seen, recs, logp_under = _train_observed(tr, 3)
  for b, rec in zip(seen, recs):
    assert rec["rollout/speculative_on"] == 1.0 and 0.0 <= rec["rollout/spec_acceptance"] <= 1.0, rec
    mask, mu, tv = np.asarray(b.batch.mask), np.asarray(b.batch.old_logp), b.token_versions
    for v in np.unique(tv[mask]):
      sel = mask & (tv == v)
      assert np.abs(logp_under(int(v), b.batch) - mu)[sel].max() < 2e-5, (b.index, v)


# ---------------------------------------------------------------- multi-turn (the conversation sampler)


def _chat_policy(scale=4.0):
  """The multi-turn tests' chat tokenizer and 1-layer policy, its matrices scaled (peaked: drafts get accepted)."""
  from helpers import tiny_chat_policy

  tok, model, sampling, _ = tiny_chat_policy()
  graphdef, state = nnx.split(model)
  model = nnx.merge(graphdef, jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, state))
  return tok, model, SamplingConfig(num_samples=2, eos_ids=sampling.eos_ids, pad_id=sampling.pad_id)


def _multiturn(model, tok, sampling, *, temperature, kv_cache=True, switch=None, key=3, engine=None):
  from test_kv_multiturn import TOOL, Scripted

  from jaxgrpo.rollout.environments import MultiTurnConfig, sample_multiturn

  rows = [{"turns": 2}, {"turns": 3, "tag": "tool"}, {"turns": 3}]
  make_env = lambda row: Scripted((TOOL,) if row.get("tag") else ())
  cfg = MultiTurnConfig(max_turns=3, max_tokens=60, turn_tokens=14)
  return sample_multiturn(
    model, rows, make_env, tok, sampling, cfg, key=jax.random.key(key), temperature=temperature,
    kv_cache=kv_cache, speculative=switch, engine=engine,
  )  # fmt: skip


@pytest.mark.parametrize("kv_cache,drafter", [(True, "ngram"), (False, "ngram"), (True, "draft"), (False, "draft")])
def test_multiturn_speculative_log_probs_are_teacher_forced(kv_cache, drafter):
  """``sample_multiturn`` with a speculative switch — the cached sampler's verify steps (prompt lookup, or a draft
  model whose cache is kept across turns beside the policy's), and the re-prefill path's ``generate_speculative``
  per turn — over ragged turns, observations and two stop sets: drafts are accepted, every policy token's recorded
  log-prob equals the uncached forward's over the final ``prompt ‖ trajectory`` (2e-5), observation tokens carry
  0; at temperature 0 the trajectories are plain greedy decoding's, token for token."""
  tok, model, sampling = _chat_policy()
  switch = _switch(k=3, n=1)
  if drafter == "draft":
    switch = SpeculativeSwitch(
      config=SpeculativeConfig(mode="draft", num_draft=3, draft="unused"), draft_model=_chat_policy(scale=3.0)[1]
    )
  out = _multiturn(model, tok, sampling, temperature=0.3, kv_cache=kv_cache, switch=switch)
  assert switch.metrics["rollout/speculative_on"] == 1.0 and switch.metrics["rollout/spec_acceptance"] > 0.1
  assert (out.turns > 1).sum() >= 2 and (out.mask & ~out.policy_mask).any()
  tokens = np.concatenate([out.prompt_tokens, out.completions], 1)
  attn = np.concatenate([out.prompt_mask, out.mask], 1)
  lp = np.asarray(ref_log_probs(model, tokens, attn, temperature=0.3))[:, out.prompt_tokens.shape[1] :]
  np.testing.assert_allclose(out.log_probs, np.where(out.policy_mask, lp, 0.0), atol=2e-5)
  greedy = [_multiturn(model, tok, sampling, temperature=0.0, kv_cache=kv_cache, switch=s) for s in (None, switch)]
  for name in ("completions", "mask", "policy_mask", "turns"):
    np.testing.assert_array_equal(getattr(greedy[1], name), getattr(greedy[0], name), err_msg=name)
  np.testing.assert_allclose(greedy[1].log_probs, greedy[0].log_probs, atol=2e-5)


@pytest.mark.parametrize("top_k,drafter", [(0, "ngram"), (4, "ngram"), (0, "model"), (4, "model")])
def test_conversation_turn_sequences_follow_the_target_distribution(top_k, drafter):
  """Many conversations of one prompt through the cached sampler: a first turn of one token, an appended
  observation, then a second turn of 3 tokens by verify steps (k = 2, drafts from the whole conversation by
  prompt lookup, or by a draft model — another random model of the vocabulary — from its own cache kept across
  the turns). Among the rows whose first token is the commonest (one context), the joint distribution of the
  second turn equals the target's exact one given that context (chi-square, p > 1e-4), with drafts accepted and
  rejected."""
  from jaxgrpo.rollout.conversation import ConversationSampler

  model = _model(7, 2.0, seed=2)
  prompt, g, length = [3, 4, 5, 3, 4, 5, 3], 4000, 3
  sampling = SamplingConfig(num_samples=g, top_k=top_k, pad_id=0)
  spec = SpeculativeConfig(num_draft=2, ngram=1)
  draft = None
  if drafter == "model":
    spec, draft = SpeculativeConfig(mode="draft", num_draft=2, draft="in memory"), _model(7, 2.0, seed=5)
  conv = ConversationSampler(
    model, [prompt] * g, sampling, max_len=20, temperature=0.8, speculative=spec, draft_model=draft
  )
  first = conv.turn([(jax.random.key(1), list(range(g)))], max_new_tokens=1)
  second = conv.turn(
    [(jax.random.key(2), list(range(g)))], max_new_tokens=length, appended={i: [4, 5] for i in range(g)}
  )
  drafted, accepted = conv.stats[1:]
  assert 0.05 < accepted / drafted < 0.95  # both branches of the rule ran
  by_first = {}
  for i in range(g):
    by_first.setdefault(int(first[i][0][0]), []).append(second[i][0])
  t0, rows = max(by_first.items(), key=lambda kv: len(kv[1]))  # the commonest first token: one context
  seqs = np.stack(rows)
  assert seqs.shape == (len(rows), length) and len(rows) > 500
  counts = np.bincount(np.ravel_multi_index(seqs.T, (7,) * length), minlength=7**length)
  context = np.asarray(prompt + [t0, 4, 5])
  assert _chi_square_p(counts, _exact_joint(model, context, length, 0.8, top_k)) > 1e-4


def _draft_switch(draft, k=3):
  return SpeculativeSwitch(config=SpeculativeConfig(mode="draft", num_draft=k, draft="in memory"), draft_model=draft)


@nnx.jit
def _fresh_prefill(model, ids):
  """``model``'s per-row KV cache after one cache-free prefill of ``ids`` ``int32[1, L]`` (positions 0 .. L-1,
  every token real) into a fresh cache of L slots; jitted (one program per L)."""
  held = ids.shape[1]
  fresh = model.init_cache(1, held, per_row=True)
  return model(ids, jnp.arange(held)[None], attention_mask=jnp.ones((1, held), bool), cache=fresh)[1]


def test_conversation_draft_model_cache_is_kept_across_turns():
  """The cached sampler with a draft model (a flatter copy of the policy: drafts accepted and rejected) over turns
  of every row and of subsets (padding rows), appended observations, budgets and stop ids: every recorded
  log-prob equals the uncached forward's over the conversation so far (1e-5); after the turns the draft's cache
  holds exactly each conversation but its last token — index, valid slots, and keys and values equal to a fresh
  cache-free prefill of the draft over it (1e-5): the observations were fed to it and the rejected drafts' slots
  discarded."""
  from jaxgrpo.rollout.conversation import ConversationSampler

  model, draft = _model(61, 5.0, seed=0), _model(61, 3.0, seed=0)
  prompts = [[5, 6, 7, 5]] * 2 + [[9, 10]] * 2 + [[3]] * 2
  sampling = SamplingConfig(num_samples=2, pad_id=0)
  spec = SpeculativeConfig(mode="draft", num_draft=3, draft="in memory")
  conv = ConversationSampler(
    model, prompts, sampling, max_len=60, temperature=0.7, speculative=spec, draft_model=draft
  )  # fmt: skip
  convs = {i: list(p) for i, p in enumerate(prompts)}
  sampled = {i: [] for i in convs}  # (start, log-probs) of each turn

  def turn(key, rows, appended=None, budgets=None, stop_ids=None):
    for i, ids in (appended or {}).items():
      convs[i] += ids
    out = conv.turn([(jax.random.key(key), rows)], max_new_tokens=8, appended=appended, budgets=budgets,
                    stop_ids=stop_ids)  # fmt: skip
    for i, (ids, lps) in out.items():
      sampled[i].append((len(convs[i]), lps))
      convs[i] += ids.tolist()

  turn(0, [0, 1, 2, 3, 4, 5], budgets={1: 3}, stop_ids={4: (7,)})
  turn(1, [3, 0, 5], appended={0: [9, 10, 11], 3: [12]})  # 3 of 6 rows: 4 decode rows, one padding
  turn(2, [1, 4, 2], appended={1: [13, 14]})
  turn(3, [0, 3, 5, 2], appended={5: [15]}, budgets={2: 2})
  drafted, accepted = conv.stats[1:]
  assert 0.1 < accepted / drafted < 0.95, conv.stats  # both branches of the rule ran
  width = max(len(c) for c in convs.values())
  tokens, mask = np.zeros((len(convs), width), np.int32), np.zeros((len(convs), width), bool)
  for i, ids in convs.items():  # right-padded: real token k of each row at position k
    tokens[i, : len(ids)], mask[i, : len(ids)] = ids, True
  lp = np.asarray(ref_log_probs(model, tokens, mask, temperature=0.7))
  for i in convs:
    for start, lps in sampled[i]:
      np.testing.assert_allclose(lps, lp[i, start : start + len(lps)], atol=1e-5, err_msg=f"row {i}")
  cache = jax.tree.map(np.asarray, conv.draft_cache)  # host copies: indexing them compiles nothing
  for i, ids in convs.items():
    held = len(ids) - 1  # the last sampled token is not fed yet
    assert conv.length(i) == len(ids) and int(cache.index[i]) == held
    assert np.asarray(cache.valid[i, :held]).all() and not np.asarray(cache.valid[i, held:]).any()
    fresh = jax.tree.map(np.asarray, _fresh_prefill(draft, jnp.asarray([ids[:-1]])))
    for got, want in zip(cache.k + cache.v, fresh.k + fresh.v):
      got = np.asarray(got[i])
      got = got[..., :held] if got.shape[-1] == cache.max_len else got[:, :held]  # keys [N, K, T], values [N, T, K]
      np.testing.assert_allclose(got, np.asarray(want[0]), atol=1e-5, err_msg=f"row {i}")


def test_multiturn_with_a_draft_model_keeps_its_cache_and_self_drafting_accepts_all(monkeypatch):
  """``sample_multiturn`` with a draft model takes the cached path (the re-prefill sampler is made to fail: no turn
  re-prefills; the old code re-prefilled every turn with ``generate_speculative``); with the policy as its own
  draft at temperature 0 every draft is accepted over all the turns and the trajectories and log-probs are plain
  greedy decoding's (that the draft's cache follows each conversation is checked slot by slot in
  ``test_conversation_draft_model_cache_is_kept_across_turns``)."""
  from jaxgrpo.rollout.environments import rollout as multiturn

  tok, model, sampling = _chat_policy()
  plain = _multiturn(model, tok, sampling, temperature=0.0)

  def refused(*args, **kwargs):
    raise AssertionError("a turn was re-prefilled with generate_speculative")

  monkeypatch.setattr(multiturn, "generate_speculative", refused)
  switch = _draft_switch(model)
  out = _multiturn(model, tok, sampling, temperature=0.0, switch=switch)
  assert switch.metrics["rollout/speculative_on"] == 1.0 and switch.metrics["rollout/spec_acceptance"] == 1.0
  assert (out.turns > 1).sum() >= 2 and (out.mask & ~out.policy_mask).any()
  for name in ("completions", "mask", "policy_mask", "turns"):
    np.testing.assert_array_equal(getattr(out, name), getattr(plain, name), err_msg=name)
  np.testing.assert_allclose(out.log_probs, plain.log_probs, atol=1e-5)


def test_conversation_draft_model_refused_in_one_line():
  """A draft model the cached sampler cannot use is refused before any prefill, one line naming the fix: without
  ``speculative``, of another vocabulary, of fewer positions than the conversations."""
  from jaxgrpo.rollout.conversation import ConversationSampler

  model, sampling = _model(61, 5.0), SamplingConfig(num_samples=2, pad_id=0)
  spec = SpeculativeConfig(mode="draft", num_draft=3, draft="in memory")
  prompts = [[5, 6]] * 2
  with pytest.raises(ValueError, match=r"`draft_model` is given but `speculative` is None"):
    ConversationSampler(model, prompts, sampling, max_len=20, draft_model=_model(61, 1.0))
  with pytest.raises(ValueError, match=r"vocab_size 7 != the target's 61"):
    ConversationSampler(model, prompts, sampling, max_len=20, speculative=spec, draft_model=_model(7, 1.0))
  from jaxgrpo import models

  longer = models.build_model(dataclasses.replace(model.config, max_position_embeddings=256), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"max_position_embeddings 128 < max_len 129"):
    ConversationSampler(longer, prompts, sampling, max_len=129, speculative=spec, draft_model=_model(61, 1.0))


def test_multiturn_auto_measures_the_sampler_and_logs(caplog):
  """``auto`` through ``sample_multiturn``: each rollout is one call of the switch (plain twice, then prompt
  lookup twice), then the faster kept; the logged numbers are those compared."""
  tok, model, sampling = _chat_policy()
  switch = _switch(mode="auto")
  kinds = []
  with caplog.at_level("WARNING", logger="jaxgrpo.rollout.speculative"):
    for i in range(5):
      kinds.append(switch.mode_now())
      _multiturn(model, tok, sampling, temperature=0.0, switch=switch, key=i)
      assert switch.metrics["rollout/speculative_on"] == float(kinds[-1] == "ngram")
  m = switch.measured
  assert kinds[:4] == ["plain", "plain", "ngram", "ngram"] and kinds[4] == ("ngram" if m["speculative_on"] else "plain")
  (line,) = [r.getMessage() for r in caplog.records if "rollout.speculative auto" in r.getMessage()]
  assert f"plain {m['plain_tokens_per_s']:.1f} tokens/s" in line and f"{m['speculative_tokens_per_s']:.1f}" in line


def test_collective_rounds_speculate_with_the_target_log_probs():
  """The collective turn rounds (``CollectiveSampler``, what several processes' multi-turn runs sample with; here
  one process) with a prompt-lookup switch: every round is a ``generate_speculative`` program (drafts accepted,
  the rounds' counts summed), ``finish`` makes the rollout one call of the switch, every policy token's recorded
  log-prob equals the uncached forward's (2e-5), and at temperature 0 the trajectories are plain rounds' greedy
  ones, token for token. (Two real processes: tests/test_compose_multihost.py.)"""
  from jaxgrpo.parallel.sharding import make_mesh
  from jaxgrpo.rollout.engines.collective import CollectiveSampler

  tok, model, sampling = _chat_policy()
  mesh = make_mesh("data=1", devices=jax.devices()[:1])

  def rollout(switch, temperature):
    engine = CollectiveSampler(model, mesh, key=jax.random.key(5), switch=switch)
    out = _multiturn(model, tok, sampling, temperature=temperature, engine=engine)
    engine.finish(int(out.policy_mask.sum()))
    return out, engine

  switch = _switch(k=3, n=1)
  out, engine = rollout(switch, 0.3)
  assert engine.mode == "ngram" and engine.rounds >= 3 and engine.stats[0] > 0 and switch.calls == 1
  assert switch.metrics == {"rollout/speculative_on": 1.0, "rollout/spec_acceptance": engine.stats[2] / engine.stats[1]}
  assert switch.metrics["rollout/spec_acceptance"] > 0.1 and (out.mask & ~out.policy_mask).any()
  tokens = np.concatenate([out.prompt_tokens, out.completions], 1)
  attn = np.concatenate([out.prompt_mask, out.mask], 1)
  lp = np.asarray(ref_log_probs(model, tokens, attn, temperature=0.3))[:, out.prompt_tokens.shape[1] :]
  np.testing.assert_allclose(out.log_probs, np.where(out.policy_mask, lp, 0.0), atol=2e-5)
  greedy = [rollout(s, 0.0)[0] for s in (None, _switch(k=3, n=1))]
  for name in ("completions", "mask", "policy_mask", "turns"):
    np.testing.assert_array_equal(getattr(greedy[1], name), getattr(greedy[0], name), err_msg=name)


def test_an_env_run_speculates(tmp_path):
  """``rollout.speculative: ngram`` with an ``env`` section (refused before): every step's turns are decoded by
  verify steps (``rollout/speculative_on`` 1, the acceptance logged), the log-probs are the policy's (no
  ``engine/*`` recomputation) and the run trains."""
  from test_trainer import tiny
  from test_trainer_env import ENV

  from jaxgrpo.run.trainer import Trainer

  tr = Trainer(tiny(**{**ENV, "run.out": str(tmp_path), "rollout.speculative": "ngram"}), log=None)
  try:
    recs = [tr.train_step() for _ in range(2)]
  finally:
    tr.close()
  for r in recs:
    assert r["rollout/speculative_on"] == 1.0 and 0.0 <= r["rollout/spec_acceptance"] <= 1.0, r
    assert "engine/mismatch_k3" not in r and np.isfinite(r["loss"]), r


def test_env_runs_speculate_on_several_processes_and_engines_are_refused():
  """Multi-turn speculation on several processes passes the run's checks (it was refused as not built; the
  collective turn rounds speculate: tests/test_compose_multihost.py runs it on two processes), with prompt lookup,
  a draft model, ``auto`` and partial rollouts; what stays refused, in one line, is another engine (it decodes by
  itself: physical)."""
  from test_trainer import tiny
  from test_trainer_env import ENV

  from jaxgrpo.run.composition import check_composition

  for over in (
    {"rollout.speculative": "ngram"},
    {"rollout.speculative": "draft", "rollout.speculative_draft": "a/draft"},
    {
      "rollout.speculative": "auto",
      "rollout.max_staleness": 1,
      "rollout.partial": {"enabled": True},
      "objective.importance_correction": "tis",
    },
  ):
    cfg = tiny(**ENV, **over)
    check_composition(cfg, process_count=2)  # returns: nothing refused
    assert cfg.rollout.speculative == over["rollout.speculative"]
  engine = {**ENV, "rollout.speculative": "ngram", "rollout.engine": "test_engines:make_offset_engine"}
  with pytest.raises(ValueError, match=r"`rollout.engine: test_engines:make_offset_engine` decodes by itself"):
    tiny(**engine)


def test_a_partial_env_run_speculates_and_each_token_is_its_versions(tmp_path):
  """``rollout.speculative: ngram`` with ``env`` and ``rollout.partial`` (the episode pool: each turn by
  ``generate_speculative`` under the boundary's version): every step speculates (metrics), trajectories cross
  versions, and every policy token's behaviour log-prob equals the teacher-forced one of the version it records."""
  from test_trainer import tiny

  from jaxgrpo.run.trainer import Trainer

  cfg = tiny(**{
    "env.factory": "test_partial_rollouts:make_countdown", "env.max_turns": 3, "env.max_tokens": 48,
    "env.turn_tokens": 6, "run.out": str(tmp_path), "rollout.max_staleness": 2,
    "rollout.partial": {"enabled": True, "slots": 12}, "objective.importance_correction": "tis",
    "optim.learning_rate": 3e-2, "rollout.speculative": "ngram", "rollout.speculative_tokens": 3,
  })  # fmt: skip
  tr = Trainer(cfg, log=None)
  pipe = tr.rollouts
  assert type(pipe.pool).__name__ == "EpisodePool" and pipe.pool.speculative is tr.engine.switch
  seen, recs, logp_under = _train_observed(tr, 3)
  crossing = 0
  for b, rec in zip(seen, recs):
    assert rec["rollout/speculative_on"] == 1.0 and 0.0 <= rec["rollout/spec_acceptance"] <= 1.0, rec
    pol, mu, tv = np.asarray(b.batch.policy_mask), np.asarray(b.batch.old_logp), b.token_versions
    crossing += sum(int(row[m].max() > row[m].min()) for row, m in zip(tv, pol) if m.any())
    for v in np.unique(tv[pol]):
      sel = pol & (tv == v)
      assert np.abs(logp_under(int(v), b.batch) - mu)[sel].max() < 2e-5, (b.index, v)
  assert crossing > 0
