"""Tests for jaxgrpo.rollout.speculative: the recorded log-probs against a teacher-forced (cache-free) forward of
the target, the rejection rule's distribution against the exact one (NumPy, chi-square; a wrong rule fails the
same bound), the whole sampler's distribution of the first tokens against the target's exact joint (enumerated
by teacher forcing), greedy decoding identical to ``generate``, stop tokens, budgets and ragged rows.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import nnx
from helpers import ref_logits
from hf_utils import tiny_moe_config

from jaxgrpo import models
from jaxgrpo.models import moe
from jaxgrpo.models.log_probs import completion_log_probs
from jaxgrpo.rollout.sampling import SamplingConfig, generate
from jaxgrpo.rollout.speculative import (
  SpeculativeConfig,
  SpeculativeStats,
  SpeculativeSwitch,
  accept_drafts,
  generate_speculative,
  ngram_draft,
)

PAD = 0


def _model(vocab: int, scale: float, seed: int = 0) -> nnx.Module:
  cfg = models.Qwen3Config(
    vocab_size=vocab, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    intermediate_size=64, tie_word_embeddings=True, max_position_embeddings=128,
  )  # fmt: skip
  graphdef, state = nnx.split(models.build_model(cfg, rngs=nnx.Rngs(seed)))
  return nnx.merge(graphdef, jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, state))


@pytest.fixture(scope="module")
def peaked():
  """Large, well-separated logits: greedy-like loops that prompt lookup drafts well."""
  return _model(61, 5.0)


def _prompts():
  tokens = np.array([[0, 0, 0, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10, 11, 9, 10], [0, 0, 0, 0, 0, 0, 3, 4]], np.int32)
  return jnp.asarray(tokens), jnp.asarray(tokens > 0)


def _teacher_forced(model, rollout, temperature):
  """log_softmax(logits / temperature)[token] of every completion token from one cache-free forward over
  [prompt ‖ completion] (jitted, ``helpers.ref_logits``; NumPy after the forward): f32[N, T]."""
  tokens = np.concatenate([np.asarray(rollout.prompt_tokens), np.asarray(rollout.completions)], 1)
  mask = np.concatenate([np.asarray(rollout.prompt_mask), np.asarray(rollout.mask)], 1)
  positions = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
  logits = ref_logits(model, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))
  logits = np.asarray(logits, np.float64) / (temperature or 1.0)
  logp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True))
  logp -= logits.max(-1, keepdims=True)
  p_len, t_len = rollout.prompt_tokens.shape[1], rollout.completions.shape[1]
  out = np.take_along_axis(logp[:, p_len - 1 : p_len - 1 + t_len], tokens[:, p_len:, None], -1)[..., 0]
  return np.where(np.asarray(rollout.mask), out, 0.0)


@pytest.mark.parametrize("drafter", ["ngram", "model"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 0.9), (0.0, 0, 1.0)])
def test_log_probs_equal_teacher_forced_pass(peaked, temperature, top_k, top_p, drafter):
  prompts, mask = _prompts()
  sampling = SamplingConfig(num_samples=4, max_new_tokens=14, top_k=top_k, top_p=top_p, eos_ids=(1,), pad_id=PAD)
  rollout, stats = generate_speculative(
    peaked, prompts, mask, sampling, key=jax.random.key(3), temperature=temperature,
    speculative=SpeculativeConfig(num_draft=3, ngram=1),
    draft_model=_model(61, 5.0, seed=4) if drafter == "model" else None,
  )  # fmt: skip
  assert int(stats.accepted) > 0  # accepted drafts are among the checked tokens
  np.testing.assert_allclose(np.asarray(rollout.log_probs), _teacher_forced(peaked, rollout, temperature), atol=1e-5)


@pytest.mark.parametrize(
  "eos_ids,budget,k,drafter",
  [((), 13, 4, "ngram"), ((30,), 16, 3, "ngram"), ((7, 11), 9, 2, "ngram"), ((30,), 16, 3, "model"),
   ((7, 11), 9, 2, "itself")],
)  # fmt: skip
def test_greedy_is_plain_greedy_decoding(peaked, eos_ids, budget, k, drafter):
  """Temperature 0: the same tokens, masks and log-probs as ``generate``, stop tokens and budgets included; with
  prompt lookup, another model as the draft, or the target as its own draft (every draft accepted)."""
  prompts, mask = _prompts()
  sampling = SamplingConfig(num_samples=2, max_new_tokens=budget, eos_ids=eos_ids, pad_id=PAD)
  plain = generate(peaked, prompts, mask, sampling, key=jax.random.key(0), temperature=0.0)
  draft = {"ngram": None, "model": _model(61, 5.0, seed=4), "itself": peaked}[drafter]
  spec, stats = generate_speculative(
    peaked, prompts, mask, sampling, key=jax.random.key(0), temperature=0.0,
    speculative=SpeculativeConfig(num_draft=k, ngram=1), draft_model=draft,
  )  # fmt: skip
  if drafter == "itself":
    assert int(stats.accepted) == int(stats.drafted) > 0
  np.testing.assert_array_equal(np.asarray(spec.completions), np.asarray(plain.completions))
  np.testing.assert_array_equal(np.asarray(spec.mask), np.asarray(plain.mask))
  np.testing.assert_allclose(np.asarray(spec.log_probs), np.asarray(plain.log_probs), atol=1e-5)
  assert int(spec.num_steps) == int(np.asarray(plain.mask).sum(1).max())
  if drafter != "model":  # drafts were accepted: fewer target forwards than tokens
    assert int(stats.verify_steps) < budget - 1


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_stats_count_only_the_counted_prompts(peaked, drafter):
  """``counted``: the drafted and accepted tokens are those of the counted prompts' rows, each prompt's equal to a
  call on that prompt alone (greedy: a row's tokens and drafts do not depend on the other rows), so a caller's
  padding prompts (a collective round's) leave the acceptance as the real rows' own."""
  prompts, mask = _prompts()
  sampling = SamplingConfig(num_samples=2, max_new_tokens=12, pad_id=PAD)
  spec = SpeculativeConfig(num_draft=3, ngram=1)
  draft = _model(61, 5.0, seed=4) if drafter == "model" else None
  run = lambda p, m, **kw: generate_speculative(
    peaked, p, m, sampling, key=jax.random.key(0), temperature=0.0, speculative=spec, draft_model=draft, **kw
  )[1]
  alone = [run(prompts[i : i + 1], mask[i : i + 1]) for i in range(3)]
  assert all(int(s.drafted) > 0 for s in alone) and sum(int(s.accepted) for s in alone) > 0
  for counted in ([True, True, True], [True, False, True], [False, True, False]):
    got = run(prompts, mask, counted=np.array(counted))
    want = [sum(int(getattr(s, f)) for s, c in zip(alone, counted) if c) for f in ("drafted", "accepted")]
    assert [int(got.drafted), int(got.accepted)] == want, (counted, got, want)
  assert tuple(map(int, run(prompts, mask))) == tuple(map(int, run(prompts, mask, counted=np.ones(3, bool))))
  assert tuple(map(int, run(prompts, mask, counted=[True, False, True]))) == tuple(
    map(int, run(prompts, mask, counted=np.array([True, False, True])))
  )  # a list is read as an array
  for bad in (np.ones(2, bool), np.ones(3, np.int32), [1, 0, 1]):
    with pytest.raises(ValueError, match=r"`counted` must be bool\[3\] \(one flag per prompt"):
      run(prompts, mask, counted=bad)


def test_stop_tokens_budget_and_ragged_rows(peaked):
  """Sampled rows: every row ends at its first stop token (kept, masked in) or at T, padding after it; rows of
  different prompt lengths finish at different lengths."""
  prompts, mask = _prompts()
  eos, budget = (30, 7), 11
  sampling = SamplingConfig(num_samples=8, max_new_tokens=budget, eos_ids=eos, pad_id=PAD)
  rollout, _ = generate_speculative(
    peaked, prompts, mask, sampling, key=jax.random.key(5), temperature=1.0,
    speculative=SpeculativeConfig(num_draft=4, ngram=2),
  )  # fmt: skip
  tokens, m = np.asarray(rollout.completions), np.asarray(rollout.mask)
  lengths = m.sum(1)
  assert len(set(lengths.tolist())) > 1 and lengths.max() <= budget
  for row, n in zip(tokens, lengths):
    real = row[:n].tolist()
    stops = [i for i, t in enumerate(real) if t in eos]
    assert stops == [] and n == budget or stops == [n - 1], (real, n)
    assert (row[n:] == PAD).all() and PAD not in real
  np.testing.assert_array_equal(m, np.arange(budget)[None] < lengths[:, None])
  assert (np.asarray(rollout.log_probs)[~m] == 0).all()


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
  """The chi-square goodness-of-fit p-value of ``counts`` against ``probs`` (cells expecting < 5 pooled)."""
  n = counts.sum()
  expected = probs * n
  big = expected >= 5
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  keep = exp > 0
  return float(scipy.stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def _wrong_rule(logp, drafts, uniforms):
  """A plausible mistake: on rejection, draw from p itself instead of p with the draft removed."""
  k = drafts.shape[1]
  p = jnp.exp(logp)
  ok = uniforms[:, :k] < jnp.take_along_axis(p[:, :k], drafts[..., None], -1)[..., 0]
  acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), 1), 1)
  p_j = jnp.take_along_axis(p, acc[:, None, None], 1)[:, 0]
  nxt = jnp.sum(jnp.cumsum(p_j, -1) < uniforms[:, k:], -1)
  return acc, nxt


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_rule_first_token_is_exactly_p(with_q):
  """The first emitted token (d_1 if accepted, else the correction) is distributed as p_0, for a deterministic
  draft (q a point mass) and for a draft distribution q (d_1 ~ q); the wrong rule fails the same test."""
  rng = np.random.default_rng(0)
  n, k, vocab = 40000, 2, 7
  p = rng.dirichlet(np.ones(vocab), size=k + 1).astype(np.float32)  # the same p for every row
  q = rng.dirichlet(np.ones(vocab), size=k).astype(np.float32)
  logp = jnp.log(jnp.broadcast_to(jnp.asarray(p), (n, k + 1, vocab)))
  if with_q:
    drafts = jnp.asarray(np.stack([rng.choice(vocab, n, p=q[i] / q[i].sum()) for i in range(k)], 1), jnp.int32)
    logq = jnp.log(jnp.broadcast_to(jnp.asarray(q), (n, k, vocab)))
  else:
    drafts, logq = jnp.full((n, k), int(np.argsort(p[0])[-2]), jnp.int32), None  # a likely, not the likeliest, id
  uniforms = jax.random.uniform(jax.random.key(1), (n, k + 1))
  acc, nxt = accept_drafts(logp, drafts, logq, uniforms)
  first = np.where(np.asarray(acc) > 0, np.asarray(drafts[:, 0]), np.asarray(nxt))
  target = p[0].astype(np.float64) / p[0].sum()
  assert _chi_square_p(np.bincount(first, minlength=vocab), target) > 1e-4
  if not with_q:
    acc_w, nxt_w = _wrong_rule(logp, drafts, uniforms)
    wrong = np.where(np.asarray(acc_w) > 0, np.asarray(drafts[:, 0]), np.asarray(nxt_w))
    assert _chi_square_p(np.bincount(wrong, minlength=vocab), target) < 1e-4


def _exact_joint(model, prompt, length, temperature, top_k):
  """The target's exact probability of every sequence of ``length`` tokens after ``prompt`` under
  temperature and top-k (NumPy from one cache-free forward of every sequence, ``helpers.ref_logits``): f64[V**length]."""
  vocab = model.config.vocab_size
  seqs = np.array(list(itertools.product(range(vocab), repeat=length)), np.int32)
  tokens = np.concatenate([np.repeat(prompt[None], len(seqs), 0), seqs], 1)
  positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  logits = ref_logits(model, jnp.asarray(tokens), jnp.asarray(positions), jnp.ones(tokens.shape, bool))
  logits = np.asarray(logits, np.float64) / temperature
  logits[..., PAD] = -np.inf  # the default suppressed id
  if top_k:
    kth = np.sort(logits, -1)[..., -top_k][..., None]
    logits = np.where(logits >= kth, logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  p_len = len(prompt)
  steps = [probs[np.arange(len(seqs)), p_len - 1 + t, seqs[:, t]] for t in range(length)]
  return np.prod(steps, 0)


@pytest.mark.parametrize("top_k,drafter", [(0, "ngram"), (4, "ngram"), (0, "model"), (4, "model")])
def test_sampled_sequences_follow_the_target_distribution(top_k, drafter):
  """The joint distribution of the first 3 tokens of many speculative samples equals the target's (chi-square,
  p > 1e-4), with drafts accepted and rejected along the way: prompt lookup, and a draft model of its own
  distribution q (another random model of the same vocabulary)."""
  model = _model(7, 2.0, seed=2)
  prompt = np.array([3, 4, 5, 3, 4, 5, 3], np.int32)
  length, temperature, g = 3, 0.8, 6000
  sampling = SamplingConfig(num_samples=g, max_new_tokens=length, top_k=top_k, pad_id=PAD)
  rollout, stats = generate_speculative(
    model, jnp.asarray(prompt[None]), jnp.ones((1, len(prompt)), bool), sampling, key=jax.random.key(11),
    temperature=temperature, speculative=SpeculativeConfig(num_draft=2, ngram=1),
    draft_model=_model(7, 2.0, seed=5) if drafter == "model" else None,
  )  # fmt: skip
  assert 0.05 < stats.acceptance < 0.95  # both branches of the rule ran
  codes = np.ravel_multi_index(np.asarray(rollout.completions).T, (7,) * length)
  counts = np.bincount(codes, minlength=7**length)
  assert _chi_square_p(counts, _exact_joint(model, prompt, length, temperature, top_k)) > 1e-4


def test_ngram_draft_matches_numpy():
  rng = np.random.default_rng(0)
  context = rng.integers(1, 4, size=(16, 12)).astype(np.int32)
  valid = np.ones_like(context, bool)
  valid[:4, :3] = False
  end = rng.integers(2, 13, size=16).astype(np.int32)
  got = np.asarray(ngram_draft(jnp.asarray(context), jnp.asarray(valid), jnp.asarray(end), num_draft=3, ngram=2))
  for r in range(16):
    e = end[r]
    suffix = context[r, e - 2 : e].tolist()
    js = [j for j in range(1, e - 1) if context[r, j - 1 : j + 1].tolist() == suffix and valid[r, j - 1 : j + 1].all()]
    if not (valid[r, e - 2 : e].all() and js):
      want = [context[r, e - 1]] * 3
    else:
      want = [context[r, min(js[-1] + 1 + i, e - 1)] for i in range(3)]
    assert got[r].tolist() == want, r


def test_auto_measures_and_logs(peaked, caplog):
  """``auto``: one untimed and one timed call of each kind, then the faster kept; the logged numbers are the
  numbers the decision compares."""
  prompts, mask = _prompts()
  sampling = SamplingConfig(num_samples=2, max_new_tokens=12, pad_id=PAD)
  switch = SpeculativeSwitch(config=SpeculativeConfig(mode="auto", num_draft=3, ngram=1))
  kinds = []
  with caplog.at_level("WARNING", logger="jaxgrpo.rollout.speculative"):
    for i in range(5):
      kinds.append(switch.mode_now())
      _, metrics = switch.sample(peaked, prompts, mask, sampling, key=jax.random.key(i), temperature=0.0)
      assert metrics["rollout/speculative_on"] == float(kinds[-1] == "ngram")
  m = switch.measured
  assert kinds[:4] == ["plain", "plain", "ngram", "ngram"]
  assert kinds[4] == ("ngram" if m["speculative_tokens_per_s"] > m["plain_tokens_per_s"] else "plain")
  (line,) = [r.getMessage() for r in caplog.records if "rollout.speculative auto" in r.getMessage()]
  assert (
    f"plain {m['plain_tokens_per_s']:.1f} tokens/s" in line and f"ngram {m['speculative_tokens_per_s']:.1f}" in line
  )


def test_auto_does_not_decide_on_calls_that_decoded_nothing():
  """A sampler run that decoded no token (a partial pool whose groups were already complete) is not one of
  ``auto``'s calls: before, two empty runs were timed and it logged "plain 0.0 tokens/s, ngram 0.0 tokens/s"."""
  switch = SpeculativeSwitch(config=SpeculativeConfig(mode="auto", num_draft=3, ngram=1))
  stats = SpeculativeStats(*(np.int32(c) for c in (0, 0, 0)))
  for _ in range(4):
    switch.observe(switch.mode_now(), 0.0, None if switch.mode_now() == "plain" else stats)
  assert switch.calls == 0 and not switch.measured and switch.mode_now() == "plain"
  for kind, rate in (("plain", 100.0), ("plain", 100.0), ("ngram", 50.0), ("ngram", 150.0)):
    assert switch.mode_now() == kind
    switch.observe(kind, rate, None if kind == "plain" else SpeculativeStats(*(np.int32(c) for c in (8, 6, 2))))
  assert switch.measured["plain_tokens_per_s"] == 100.0 and switch.measured["speculative_tokens_per_s"] == 150.0
  assert switch.mode_now() == "ngram"


def test_refuses_routing_and_bad_settings(peaked):
  prompts, mask = _prompts()
  with pytest.raises(ValueError, match="rollout.speculative"):
    SpeculativeConfig(mode="eagle")
  with pytest.raises(ValueError, match="rollout.speculative_tokens"):
    SpeculativeConfig(num_draft=0)
  with pytest.raises(
    ValueError, match=r"the draft model's vocab_size 62 != the target's 61: speculative decoding needs"
  ):
    generate_speculative(
      peaked, prompts, mask, SamplingConfig(num_samples=1, max_new_tokens=4), key=jax.random.key(0),
      draft_model=_model(62, 1.0),
    )  # fmt: skip
  with pytest.raises(ValueError, match="record_routing=True needs a mixture-of-experts model"):
    generate_speculative(
      peaked, prompts, mask, SamplingConfig(num_samples=1, max_new_tokens=4, record_routing=True), key=jax.random.key(0)
    )


def _moe_model(seed: int = 0, logit_scale: float = 1.0) -> nnx.Module:
  """A random Qwen3-MoE (3 layers, 8 experts, top-2, vocabulary 128) with its router's weights x50 (routes far
  from ties) and its final norm's scale times ``logit_scale`` (-1: the argmax is the original's argmin — a draft
  every greedy verify step rejects at once; its routes are the original's)."""
  model = models.build_model(models.config_from_hf(tiny_moe_config("qwen3_moe")), rngs=nnx.Rngs(seed))
  for path, var in nnx.to_flat_state(nnx.state(model)):
    scale = 50.0 if path[-1] == "router" else logit_scale if path[0] == "final_norm" else 1.0
    if scale != 1.0:
      var.set_value(var.get_value() * scale)
  return model


@nnx.jit
def _teacher_forced_routes(model, args, replay):
  """One cache-free forward of ``model`` over [prompt ‖ completion] (``args``: prompt tokens, prompt mask,
  completions, mask; ``replay``: None, or the experts to use): (the completions' log-probs f32[N, T], the experts
  every position routed to int32[N, P+T, M, k])."""
  with moe.routing_scope(replay=replay) as scope:
    lp, _ = completion_log_probs(model, *args)
  return lp, scope.stacked().experts


@pytest.mark.parametrize(
  "k,drafter,temperature",
  [(2, "itself", 0.0), (3, "inverse", 0.0), (4, "other", 1.0), (1, "ngram", 1.0)],
)  # fmt: skip
def test_recorded_routes_equal_a_teacher_forced_pass(k, drafter, temperature):
  """Routing replay with speculative decoding, on a mixture of experts: every fed token's recorded experts (the
  prompt's from the prefill, a completion token's from the verify step that fed it — rejected drafts' dropped)
  are those a teacher-forced, cache-free forward of the target routes it to; replaying them gives the recorded
  log-probs (1e-5). Draft lengths 1-4: the target as its own greedy draft (every draft accepted), its
  logit-negated copy (every verify step rejects the first draft), another random MoE (some accepted, some
  rejected) and prompt lookup, both sampled at temperature 1."""
  model = _moe_model()
  draft = {"itself": model, "inverse": _moe_model(logit_scale=-1.0), "other": _moe_model(seed=1)}
  draft = draft.get(drafter)
  rng = np.random.default_rng(2)
  prompts = jnp.asarray(rng.integers(2, 128, (2, 6)).astype(np.int32))
  mask = jnp.asarray(np.arange(6)[None] >= np.array([0, 3])[:, None])
  sampling = SamplingConfig(num_samples=3, max_new_tokens=12, eos_ids=(1,), pad_id=PAD, record_routing=True)
  rollout, stats = generate_speculative(
    model, prompts, mask, sampling, key=jax.random.key(4), temperature=temperature,
    speculative=SpeculativeConfig(num_draft=k, ngram=1), draft_model=draft,
  )  # fmt: skip
  accepted, drafted = int(stats.accepted), int(stats.drafted)
  want = {"itself": accepted == drafted, "inverse": accepted == 0, "other": 0 < accepted < drafted}
  assert want.get(drafter, True), stats
  n, p_len, t_len = rollout.completions.shape[0], rollout.prompt_tokens.shape[1], rollout.completions.shape[1]
  m, k_e = len(model.moe_layers), model.config.num_experts_per_tok
  assert rollout.routing.shape == (n, p_len + t_len, m, k_e) and rollout.routing.dtype == jnp.uint8
  lengths = np.asarray(rollout.mask).sum(1)
  fed = np.concatenate([np.asarray(rollout.prompt_mask), np.arange(t_len)[None] < lengths[:, None] - 1], axis=1)
  args = (rollout.prompt_tokens, rollout.prompt_mask, rollout.completions, rollout.mask)
  lp_free, free = _teacher_forced_routes(model, args, None)
  np.testing.assert_array_equal(np.asarray(rollout.routing)[fed], np.asarray(free)[fed])
  lp_replay, _ = _teacher_forced_routes(model, args, rollout.routing)
  real, recorded = np.asarray(rollout.mask), np.asarray(rollout.log_probs)
  np.testing.assert_allclose(np.asarray(lp_replay)[real], recorded[real], atol=1e-5)
  np.testing.assert_allclose(np.asarray(lp_free)[real], recorded[real], atol=1e-5)


def test_a_moe_run_with_routing_replay_trains_speculatively(tmp_path):
  """``rollout.speculative: ngram`` on a synthetic mixture of experts with ``rollout.routing_replay: rollout``
  (the default): the run builds, samples speculatively every step, and its train step replays the recorded
  routes — on-policy, the first update's ratio is 1 (a route that was not the token's would move it)."""
  from jaxgrpo.run.specs import load_config
  from jaxgrpo.run.trainer import Trainer

  cfg = _run_config(tmp_path, speculative="ngram", speculative_tokens=3)
  cfg["model.synthetic"] = {"hidden_size": 32, "num_layers": 1, "num_experts": 4, "experts_per_tok": 2}
  trainer = Trainer(load_config(None, cfg), log=None)
  records = [r for r in trainer.run() if "loss" in r]
  trainer.close()
  assert len(records) == 2
  for r in records:
    assert r["rollout/speculative_on"] == 1.0 and np.isfinite(r["loss"]), r
    assert abs(r["ratio_max"] - 1.0) < 1e-4 and "moe/0/load_max" in r, r


def _run_config(tmp_path, **rollout):
  return {
    "model.synthetic": {"hidden_size": 32, "num_layers": 1},
    "data.arithmetic": {"train_size": 64, "eval_size": 8, "sft_steps": 0},
    "data.max_prompt_tokens": 64,
    "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8, **rollout},
    "step.chunk_size": None,
    "reward.timeout_s": None,
    "eval.every": 0,
    "run": {"steps": 2, "log_every": 1, "out": str(tmp_path)},
    "devices.mesh": "",
  }


def test_the_trainer_samples_by_rollout_speculative(tmp_path):
  """``rollout.speculative: ngram``, then ``draft`` with a draft model directory: the built-in engine samples
  speculatively every step (metrics say so, with the acceptance); the train step's ratio is 1 on-policy (its
  log-probs are the policy's: no ``engine/*`` mismatch). A draft of another vocabulary: one line, before its weights."""
  from jaxgrpo.run.specs import load_config
  from jaxgrpo.run.trainer import Trainer

  def run(**rollout):
    trainer = Trainer(load_config(None, _run_config(tmp_path / rollout["speculative"], **rollout)), log=None)
    records = [r for r in trainer.run() if "loss" in r]
    trainer.close()
    assert len(records) == 2
    for r in records:
      assert r["rollout/speculative_on"] == 1.0 and 0.0 <= r["rollout/spec_acceptance"] <= 1.0, r
      assert "engine/mismatch_k3" not in r
    return trainer

  trainer = run(speculative="ngram", speculative_tokens=3)
  assert trainer.engine is None or trainer.engine.switch.config.num_draft == 3
  vocab = trainer.model.config.vocab_size
  for v, where in ((vocab, "draft"), (vocab + 1, "wrong")):
    cfg = models.Qwen3Config(vocab_size=v, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    models.save_hf(models.build_model(cfg, rngs=nnx.Rngs(7)), tmp_path / where)
  with pytest.raises(ValueError, match=rf"vocab_size {vocab + 1} != the policy's {vocab}: the draft must share"):
    Trainer(
      load_config(None, _run_config(tmp_path / "x", speculative="draft", speculative_draft=str(tmp_path / "wrong")))
    )
  trainer = run(speculative="draft", speculative_draft=str(tmp_path / "draft"))


def test_combinations_refused_in_one_line(tmp_path):
  from jaxgrpo.run.specs import load_config

  base = _run_config(tmp_path, speculative="ngram")
  with pytest.raises(
    TypeError, match=r"`rollout.speculative`: expected Literal\['off', 'ngram', 'draft', 'auto'\]; got 'eagle'"
  ):
    load_config(None, {**base, "rollout": {**base["rollout"], "speculative": "eagle"}})
  partial = {**base["rollout"], "max_staleness": 1, "partial": {"enabled": True}}
  assert load_config(None, {**base, "rollout": partial}).rollout.partial.enabled  # builds: test_speculative_compose
  with_draft = {**partial, "speculative": "auto", "speculative_draft": str(tmp_path)}  # builds too (a draft model)
  assert load_config(None, {**base, "rollout": with_draft}).rollout.speculative_draft == str(tmp_path)
  moe = {"hidden_size": 32, "num_layers": 1, "num_experts": 4, "experts_per_tok": 2}  # routing replay: the default
  assert load_config(None, {**base, "model.synthetic": moe}).rollout.routing_replay == "rollout"  # builds
  with pytest.raises(ValueError, match=r"`rollout.speculative: draft` needs `rollout.speculative_draft`"):
    load_config(None, {**base, "rollout": {**base["rollout"], "speculative": "draft"}})
  with pytest.raises(ValueError, match=r"`rollout.speculative_draft` is set but `rollout.speculative: ngram` never"):
    load_config(None, {**base, "rollout": {**base["rollout"], "speculative_draft": str(tmp_path)}})
  off = load_config(None, _run_config(tmp_path))
  assert off.rollout.speculative == "off" and off.rollout.speculative_config() is None
