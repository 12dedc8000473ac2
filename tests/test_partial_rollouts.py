"""Partial rollouts (``rollout.partial``, issue 36 items 2-3): rows in flight across weight updates.

- every trained token's behaviour log-prob equals a teacher-forced recomputation under the version it records
  (and rows do span two versions); the step's importance weights equal a NumPy TIS computation from those
  recorded log-probs and π_old (θ(n-1) recomputed here); the metrics count the rows that span versions;
- rows that could not wait for the next batch within the bound are finished in this one (no drops); a group
  holding a token older than the bound is dropped before it can be trained, counted (``rollout/dropped_rows``)
  and listed in the ledger, never trained;
- the same through an engine (``EnginePool``: a user's engine in a trainer run, the ``BuiltinEngine`` in the
  pool alone; vLLM in its own venv, tests/vllm_trainer.py ``partial``);
- dynamic sampling on the pool: the filtered groups are those with equal recorded rewards, counted and listed in
  the ledger, and ``untrained`` stays every drawn prompt neither trained, filtered nor dropped;
- a MoE (no routing replay) and a LoRA policy train under partial rollouts, each token its version's;
- combinations it does not build are refused at load, one line each (MoE routing replay for its mathematical
  reason); off by default (the async tests run unchanged);
- a real run killed (SIGKILL) and resumed trains or drops every drawn prompt exactly once: the checkpoint
  discards the rows in flight and records their prompts, drawn again first after the resume.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import async_train_cmd, cli_env, kill_after_ledger_lines, ref_completion_log_probs
from hf_utils import tiny_hf_config
from test_async_rollout import REWARDS
from test_engines import OFFSET
from test_packing_models import randomized
from test_trainer import tiny

from jaxgrpo import models
from jaxgrpo.data import PromptIterator, pad_left
from jaxgrpo.loop import async_rollout, iteration
from jaxgrpo.loop.episodes import example_row
from jaxgrpo.loop.partial.engine import EnginePool
from jaxgrpo.loop.partial.pool import RowPool
from jaxgrpo.rollout.engines import BuiltinEngine
from jaxgrpo.rollout.sampling import SamplingConfig
from jaxgrpo.run import assemble
from jaxgrpo.run.composition import check_composition
from jaxgrpo.run.trainer import Trainer
from jaxgrpo.services.checkpoint import read_meta
from jaxgrpo.step.train import TrainState

PARTIAL = {"enabled": True, "refill_every": 2}


def log_probs_under(tr, versions: dict):
  """``logp(version, batch) -> f32[rows, T]``: the teacher-forced log-probs of ``batch``'s completions under the
  parameters ``versions[version]`` (host copies, placed on the device: a MoE layer indexes its experts by
  tracers) of the trainer ``tr``'s policy, with its frozen variables as they are now."""
  frozen = tr.state.train.frozen

  def logp(version, b):
    params = jax.device_put(versions[version])
    model = iteration.policy_model(tr.graphdef, TrainState(params, None, None, frozen))
    return np.asarray(ref_completion_log_probs(model, b.prompt_tokens, b.prompt_mask, b.completions, b.mask))

  return logp


def ragged(prompt: int, sample: int) -> int:
  """Completion budgets of 1..8 tokens (the untrained tiny model rarely samples EOS)."""
  return 1 + (7 * prompt + 3 * sample) % 8


@pytest.mark.parametrize("engine", [None, "test_engines:make_offset_engine"], ids=["builtin", "engine"])
def test_tokens_carry_their_version_into_the_loss_and_stale_groups_are_dropped(tmp_path, engine):
  """The built-in row pool, and a user's engine (``OffsetEngine``: the jitted sampler reporting log-probs
  ``OFFSET`` nats above the policy's) through ``EnginePool``: each boundary re-submits prompt ‖ completion so
  far, so μ of every token is its version's log-prob (+ the offset), pushed when the version changed."""
  steps = 5
  offset = 0.0 if engine is None else OFFSET
  cfg = tiny(
    **{
      "run.out": str(tmp_path / "p"),
      "run.steps": steps,
      "rollout.max_staleness": 2,  # the producer runs 1 batch ahead: a row may cross one version
      "rollout.partial": PARTIAL,
      "objective.importance_correction": "tis",
      "optim.learning_rate": 3e-2,
      **({} if engine is None else {"rollout.engine": engine}),
    }
  )
  tr = Trainer(cfg, reward_fns=REWARDS, log=None)
  versions = {0: jax.tree.map(np.asarray, tr.state.train.params)}
  pipe = tr.rollouts
  assert type(pipe).__name__ == "PartialRollouts" and pipe.ahead == 1
  assert type(pipe.pool) is (RowPool if engine is None else EnginePool)
  pipe.pool.budget_of = ragged
  seen, recs = [], []
  pipe.observe = seen.append

  logp_under = log_probs_under(tr, versions)

  try:
    for step in range(1, steps + 1):
      if step == 4:  # make a group in flight look 5 versions old: producing batch 5 must drop it
        old = next(g for g in pipe.pool.groups.values() if g.oldest() is not None)
        for row in old.rows:
          row.versions[: row.t] -= 5
      recs.append(tr.train_step())
      versions[step] = jax.tree.map(np.asarray, tr.state.train.params)
  finally:
    pipe.close()
  crossing = 0
  for b, rec in zip(seen, recs):
    n, mask, mu = b.index, np.asarray(b.batch.mask), np.asarray(b.batch.old_logp)
    tv = b.token_versions
    assert ((tv >= 0) == mask).all() and tv[mask].min() >= n - 1 - 2 and tv[mask].max() <= n - 1
    spans = np.asarray([row[m].max() - row[m].min() for row, m in zip(tv, mask)])
    assert rec["rollout/partial_rows"] == int((spans > 0).sum()) and rec["rollout/version_span"] == spans.max()
    crossing += int((spans > 0).sum())
    for v in np.unique(tv[mask]):  # μ of each token is its own version's log-prob, not a neighbour's
      sel = mask & (tv == v)
      assert np.abs(logp_under(int(v), b.batch) + offset - mu)[sel].max() < 2e-5, (n, v)
      if int(v) + 1 in versions:
        assert np.abs(logp_under(int(v) + 1, b.batch) + offset - mu)[sel].max() > 1e-3
    # the step's TIS weights, from π_old = θ(n-1) and the recorded μ (token level, cap 2)
    ratio = np.exp(logp_under(n - 1, b.batch) - mu)[mask]
    assert rec["is_ratio_max"] == pytest.approx(ratio.max(), rel=1e-4)
    assert rec["is_weight_mean"] == pytest.approx(np.minimum(ratio, 2.0).mean(), rel=1e-4)
    assert rec["is_capped_frac"] == pytest.approx((ratio > 2.0).mean(), abs=1e-6)
    assert rec["async/staleness_max"] == int(n - 1 - b.versions.min())
    if engine is not None:  # the learner's mismatch: k3 of log π_old/μ over the sampled tokens
      log_r = (logp_under(n - 1, b.batch) - mu)[mask].astype(np.float64)
      assert rec["engine/mismatch_k3"] == pytest.approx(np.mean(np.exp(log_r) - log_r - 1), rel=1e-4)
  assert crossing > 0  # rows did cross a weight update
  if engine is not None:  # one push per version sampled with: batch n is produced by θ(max(0, n - 2))
    assert tr.engine.pushes == steps - 1 and sum("engine/push_s" in r for r in recs) == steps - 1
  ledger = [json.loads(x) for x in open(tmp_path / "p" / async_rollout.LEDGER)]
  assert [r["prompts"] for r in ledger] == [b.prompts.tolist() for b in seen]
  # dropped: only the aged group, while batch 5 was produced; rows that could not wait were finished instead
  assert [r["dropped"] for r in ledger] == [[], [], [], [], [old.prompt]]
  dropped = [p for r in ledger for p in r["dropped"]]
  assert [r["rollout/dropped_rows"] for r in recs] == [4 * len(r["dropped"]) for r in ledger]
  assert recs[-1]["rollout/dropped_rows_total"] == 4 * len(dropped)
  trained = [p for r in ledger for p in r["prompts"]]
  assert not set(dropped) & set(trained) and len(set(trained)) == len(trained)


@pytest.mark.parametrize("through", ["pool", "engine"])
def test_pool_finishes_a_row_that_cannot_wait_and_each_token_is_its_versions(full_fp32_matmuls, through):
  """The row pool alone, three versions (three random models), k = 2, one group per batch, G = 2, 4 slots:
  batch 1 takes the short group and leaves prompt 0's long row running; batch 2 (version 1) continues it
  re-prefilled; batch 3 (version 2) may not leave it running (its version-0 tokens would be 3 old in batch 4):
  it finishes it after a short group is already complete, and takes it first (oldest). Its tokens span the
  three versions, each token's log-prob that version's teacher-forced one. ``engine``: the same through
  ``EnginePool`` and the ``BuiltinEngine`` (prompt ‖ completion so far re-submitted every boundary; a push
  per version)."""
  cfg = models.config_from_hf(tiny_hf_config("qwen3"))
  policies = [randomized(models.build_model(cfg, rngs=nnx.Rngs(0)), seed=v) for v in range(3)]
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 100, 1 + i % 5).tolist() for i in range(8)]
  sampling = SamplingConfig(num_samples=2, max_new_tokens=12)
  engine, pushed = BuiltinEngine(), []

  def engine_for(model, version):
    if not pushed or pushed[-1] != version:
      engine.push_weights(model)
      pushed.append(version)
    return engine

  engine_args = dict(engine_for=engine_for, engine_sampling=sampling) if through == "engine" else {}
  pool = (EnginePool if engine_args else RowPool)(
    **engine_args,
    sampling=sampling,
    temperature=1.0,
    prompt_len=6,
    num_slots=4,
    refill_every=2,
    budget_of=lambda p, s: 10 if (p, s) == (0, 0) else 1,
  )
  order = iter(range(8))
  draw = lambda: [next(order)]
  taken, infos = [], []
  for batch in (1, 2, 3):
    v = batch - 1
    infos.append(
      pool.run(
        policies[v], v, jax.random.key(batch), need=1, draw=draw, prompt_tokens=prompts, batch=batch, max_staleness=2
      )
    )
    taken.append(pool.take(1)[0])
  assert [g.prompt for g in taken] == [1, 2, 0]
  assert [i["finishing_boundaries"] > 0 for i in infos] == [False, False, True]
  assert infos[1]["reprefilled"] == 1 and infos[2]["reprefilled"] >= 1  # the long row, under each new version
  long = taken[2].rows[0]
  assert long.t == 10 and set(long.versions[:10].tolist()) == {0, 1, 2} and pool.untrained() == [3, 4]
  tok, mask = pad_left([prompts[0]], 6, 0)
  comp, cmask = long.tokens[None], (np.arange(12) < long.t)[None]
  for v, policy in enumerate(policies):
    lp = ref_completion_log_probs(policy, tok, mask, comp, cmask)
    err = np.abs(np.asarray(lp)[0] - long.logp)[long.versions == v]
    assert err.max() < 2e-5, (v, err)
    other = np.abs(np.asarray(lp)[0] - long.logp)[(long.versions >= 0) & (long.versions != v)]
    assert other.min() > 1e-4  # another version's log-probs differ: the test can fail
  assert pushed == ([0, 1, 2] if engine_args else [])


def mostly_constant_reward(prompts, completions, **_):
  """Constant (an uninformative group) for two prompt lengths in three, else differing between completions."""
  return [1.0 if len(p) % 3 else float(sum(map(ord, c)) % 5) for p, c in zip(prompts, completions)]


@pytest.mark.parametrize("engine", [None], ids=["builtin"])
def test_dynamic_sampling_filters_like_the_sync_path_and_every_drawn_prompt_is_settled_once(tmp_path, engine):
  """``objective.dynamic_sampling`` on the pool: every complete group is scored once; the filtered ones are
  exactly those whose recorded rewards are all equal (NumPy, from the rewards the reward function returned),
  counted in ``dynamic_sampling/dropped_groups`` and listed in the ledger's ``filtered``; a trained group is
  informative unless the round limit filled the batch. A ``close()`` mid-run (what a resume does: the pool is
  emptied, the recorded untrained prompts drawn again first) keeps the bookkeeping exact: after every step the
  state's ``untrained`` is the iterator's drawn prompts less those trained, filtered or dropped, in order.
  (``engine="test_engines:make_offset_engine"`` runs it through ``EnginePool``: passed when written; the selection
  does not depend on the sampler, so the suite runs the built-in pool only, and the environment test runs dynamic
  sampling through an engine.)"""
  steps, max_rounds, g = 6, 2, 4
  cfg = tiny(
    **{
      "run.out": str(tmp_path / "ds"),
      "run.steps": steps,
      "rollout.max_staleness": 2,
      "rollout.partial": PARTIAL,
      "objective.importance_correction": "tis",
      "objective.dynamic_sampling": True,
      "rollout.dynamic_sampling_max_rounds": max_rounds,
      "optim.learning_rate": 3e-2,
      **({} if engine is None else {"rollout.engine": engine}),
    }
  )
  tr = Trainer(cfg, reward_fns={"r": (mostly_constant_reward, 1.0)}, log=None)
  pipe = tr.rollouts
  assert type(pipe.pool) is (RowPool if engine is None else EnginePool)
  pipe.pool.budget_of = ragged
  scored, score = [], pipe.source.score  # every row scored: (prompt index, reward), in order

  def recording(indices, rows):
    res = score(indices, rows)
    scored.extend(zip(np.asarray(indices)[np.asarray(rows.group_ids)].tolist(), np.asarray(res.total).tolist()))
    return res

  pipe.source.score = recording
  seen, recs, positions = [], [], []
  pipe.observe = lambda item: seen.append((item, list(scored)))
  try:
    for step in range(1, steps + 1):
      recs.append(tr.train_step())
      positions.append(tr.state.data_position)
      if step == 3:
        pipe.close()  # the rows in flight are dropped; the next step draws the recorded prompts first
  finally:
    pipe.close()
  ledger = [json.loads(x) for x in open(tmp_path / "ds" / async_rollout.LEDGER)]
  assert [r["prompts"] for r in ledger] == [b.prompts.tolist() for b, _ in seen]
  settled: list[int] = []
  for n, (rec, line, (item, rows)) in enumerate(zip(recs, ledger, seen), start=1):
    groups = {}  # the rewards each prompt's group got when it was last scored (before this batch was trained)
    for i in range(0, len(rows), g):
      assert len({p for p, _ in rows[i : i + g]}) == 1  # a call scores whole groups
      groups[rows[i][0]] = np.asarray([r for _, r in rows[i : i + g]], np.float32)
    constant = {p for p, r in groups.items() if np.ptp(r) == 0}  # equal rewards: no advantage
    assert set(line["filtered"]) <= constant, n
    trained_constant = len(set(line["prompts"]) & constant)
    assert rec["dynamic_sampling/dropped_groups"] == len(line["filtered"]) + trained_constant
    assert trained_constant == 0 or rec["dynamic_sampling/rounds"] == max_rounds  # filled only at the limit
    assert 1 <= rec["dynamic_sampling/rounds"] <= max_rounds
    want = np.concatenate([groups[p] for p in line["prompts"]])
    assert np.array_equal(np.asarray(item.batch.rewards), want), n  # each group trains its own rewards
    settled += line["prompts"] + line["filtered"] + line["dropped"]
    assert len(set(settled)) == len(settled)  # nothing trained, filtered or dropped twice
    drawn = PromptIterator(len(tr.prompts.tokens), seed=0).next(positions[n - 1]["offset"]).tolist()
    pending = [p for rnd in positions[n - 1]["untrained"] for p in rnd]
    assert pending == [p for p in drawn if p not in settled], n  # untrained: drawn, not settled, in order
  assert sum(len(r["filtered"]) for r in ledger) > 0 and max(r["dynamic_sampling/rounds"] for r in recs) > 1


MOE = {"hidden_size": 32, "num_layers": 1, "num_experts": 4, "experts_per_tok": 2}


@pytest.mark.parametrize("policy", ["moe", "lora"])
def test_a_moe_or_lora_policy_trains_under_partial_rollouts(tmp_path, policy):
  """A mixture of experts (``routing_replay: none``: each pass routes by its own top-k) and a LoRA policy (the
  versions are the adapters on the frozen base) under partial rollouts: rows cross a version, each token's
  behaviour log-prob is its own version's teacher-forced one (another version's differs), and the update moves
  the trained parameters (LoRA: the adapters only, the base bit for bit unchanged)."""
  changes = {
    "run.out": str(tmp_path / policy),
    "run.steps": 3,
    "rollout.max_staleness": 2,
    "rollout.partial": PARTIAL,
    "objective.importance_correction": "tis",
    "optim.learning_rate": 3e-2,
  }
  if policy == "moe":
    changes.update({"model.synthetic": MOE, "rollout.routing_replay": "none"})
  else:
    changes["lora"] = {"rank": 4, "alpha": 8.0}
  tr = Trainer(tiny(**changes), reward_fns=REWARDS, log=None)
  versions = {0: jax.tree.map(np.asarray, tr.state.train.params)}
  frozen = tr.state.train.frozen
  base = jax.tree.map(np.asarray, frozen)
  assert (len(jax.tree.leaves(frozen)) > 0) == (policy == "lora")
  pipe, seen = tr.rollouts, []
  pipe.pool.budget_of = ragged
  pipe.observe = seen.append
  try:
    for step in (1, 2, 3):
      tr.train_step()
      versions[step] = jax.tree.map(np.asarray, tr.state.train.params)
  finally:
    pipe.close()

  logp_under = log_probs_under(tr, versions)

  crossing = 0
  for b in seen:
    mask, mu, tv = np.asarray(b.batch.mask), np.asarray(b.batch.old_logp), b.token_versions
    spans = sum(int(row[m].max() > row[m].min()) for row, m in zip(tv, mask))
    crossing += spans
    for v in np.unique(tv[mask]) if spans else ():  # the batches of rows that crossed a version
      sel = mask & (tv == v)
      assert np.abs(logp_under(int(v), b.batch) - mu)[sel].max() < 2e-5, (b.index, v)
      assert np.abs(logp_under(int(v) + 1, b.batch) - mu)[sel].max() > 1e-3
  assert crossing > 0
  if policy == "moe":  # a sampler recording experts (a MoE checkpoint's, which the load check cannot see): refused
    recording = copy.copy(tr.source)
    recording.sampling = dataclasses.replace(tr.source.sampling, record_routing=True)
    with pytest.raises(ValueError, match=r"no single routing per position"):
      assemble.schedule(tr.config, recording, tr.learner, tr.state, rollout_mesh=None, resumed=False)
  moved = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(versions[0]), jax.tree.leaves(versions[3]))]
  assert min(moved) > 0 if policy == "lora" else max(moved) > 0  # LoRA: every adapter moved
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(tr.state.train.frozen)))


def test_partial_rollouts_refuse_what_they_do_not_build():
  assert tiny().rollout.partial.enabled is False
  on = {"rollout.partial": {"enabled": True}, "objective.importance_correction": "tis"}
  with pytest.raises(ValueError, match=r"needs `rollout.max_staleness` >= 1 .* got 0"):
    tiny(**on)
  with pytest.raises(ValueError, match=r"`rollout.partial.ahead`=2 must be < `rollout.max_staleness`=2"):
    tiny(**{**on, "rollout.max_staleness": 2, "rollout.partial": {"enabled": True, "ahead": 2}})
  for engine in ("vllm", "test_engines:make_offset_engine"):  # engines load (EnginePool; vLLM: tests/vllm_trainer.py)
    assert tiny(**{**on, "rollout.max_staleness": 1, "rollout.engine": engine}).rollout.partial.enabled
  tiny(**{**on, "rollout.max_staleness": 1, "objective.dynamic_sampling": True})  # builds
  with pytest.raises(ValueError, match=r"no single routing per position .* set `rollout.routing_replay: none`"):
    tiny(**{**on, "rollout.max_staleness": 1, "model.synthetic": MOE})  # routing_replay: rollout, the default
  tiny(**{**on, "rollout.max_staleness": 1, "model.synthetic": MOE, "rollout.routing_replay": "none"})  # builds
  with pytest.raises(ValueError, match=r"`rollout.partial.refill_every` must be >= 1; got 0"):
    tiny(**{**on, "rollout.max_staleness": 1, "rollout.partial": {"enabled": True, "refill_every": 0}})
  check_composition(tiny(**{**on, "rollout.max_staleness": 1}), process_count=2)  # built: test_compose_multihost.py


class Countdown:
  """An environment whose episodes last 1, 2 or 3 turns (by creation order: the groups of a batch end at
  different turns, so trajectories are in flight when a batch is taken), rewarded 0.1 × the share of digits in
  each turn's text (advantages are not all 0), "Go on." after each turn but the last."""

  tools = ()
  made = [0]

  def __init__(self, flat: bool = False):
    self.length, self.turn, self.flat = 1 + self.made[0] % 3, 0, flat
    self.made[0] += 1

  def reset(self, row):
    return [{"role": "user", "content": row["problem"]}]

  def step(self, text):
    from jaxgrpo.rollout.environments import StepResult

    self.turn += 1
    reward = 0.0 if self.flat else 0.1 * sum(c.isdigit() for c in text) / max(len(text), 1)
    if self.turn == self.length:
      return StepResult((), reward, True)
    return StepResult([{"role": "user", "content": "Go on."}], reward, False)


def make_countdown(row):
  """``env.factory: test_partial_rollouts:make_countdown``."""
  return Countdown()


def make_flat_countdown(row):
  """``Countdown`` rewarding 0 on every turn for a problem of even length (a group dynamic sampling filters)."""
  return Countdown(flat=len(row["problem"]) % 2 == 0)


@pytest.mark.parametrize("engine", ["test_engines:make_offset_engine"], ids=["engine"])
def test_environment_trajectories_continue_across_updates_turn_by_turn(tmp_path, engine):
  """Multi-turn partial rollouts (``jaxgrpo.loop.partial.env``): episodes of 1-3 turns kept across weight
  updates; every policy token's behaviour log-prob equals a teacher-forced recomputation under the version it
  records (and trajectories do span two versions, a turn being one version's); observations are not policy
  tokens; every trained group's trajectories are complete; the ledger trains each drawn prompt once. With dynamic
  sampling: half the environments reward 0 on every turn; their groups are filtered (or filled in at the round
  limit), counted, never trained as informative. Every turn goes through a user's engine (``OffsetEngine``: the
  built-in sampler on the pushed weights, each turn's ids sent as a prompt, its log-probs 0.5 nats above the
  policy's, as μ), so the pushes are checked too; the built-in sampler's own turns (``engine=None``, the same
  pool) run in tests/test_compose_multihost.py. Measured with the built-in sampler too: the same checks pass."""
  steps = 4
  offset = 0.0 if engine is None else OFFSET
  cfg = tiny(
    **{
      "env.factory": "test_partial_rollouts:make_flat_countdown",
      "env.max_turns": 3,
      "env.max_tokens": 48,
      "env.turn_tokens": 6,
      "run.out": str(tmp_path / "p"),
      "run.steps": steps,
      "rollout.max_staleness": 2,
      "rollout.partial": {"enabled": True, "slots": 12},
      "objective.dynamic_sampling": True,
      "rollout.dynamic_sampling_max_rounds": 2,
      "objective.importance_correction": "tis",
      "optim.learning_rate": 3e-2,
      **({} if engine is None else {"rollout.engine": engine}),
    }
  )
  tr = Trainer(cfg, log=None)
  versions = {0: jax.tree.map(np.asarray, tr.state.train.params)}
  pipe = tr.rollouts
  assert type(pipe.pool).__name__ == "EpisodePool"
  seen, recs = [], []
  pipe.observe = seen.append

  logp_under = log_probs_under(tr, versions)

  try:
    for step in range(1, steps + 1):
      recs.append(tr.train_step())
      versions[step] = jax.tree.map(np.asarray, tr.state.train.params)
  finally:
    pipe.close()
  crossing = 0
  for b, rec in zip(seen, recs):
    n, mask, pol = b.index, np.asarray(b.batch.mask), np.asarray(b.batch.policy_mask)
    mu, tv = np.asarray(b.batch.old_logp), b.token_versions
    assert ((tv >= 0) == mask).all() and (pol <= mask).all() and (mask & ~pol).any()  # observations: no loss
    assert tv[pol].min() >= n - 1 - 2 and tv[pol].max() <= n - 1
    assert all((np.diff(row[m]) >= 0).all() for row, m in zip(tv, mask))  # a trajectory's versions only grow
    spans = np.asarray([row[m].max() - row[m].min() for row, m in zip(tv, pol)])
    assert rec["rollout/partial_rows"] == int((spans > 0).sum())
    crossing += int((spans > 0).sum())
    for v in np.unique(tv[pol]):
      sel = pol & (tv == v)
      assert np.abs(logp_under(int(v), b.batch) + offset - mu)[sel].max() < 2e-5, (n, v)
      if int(v) + 1 in versions:
        assert np.abs(logp_under(int(v) + 1, b.batch) + offset - mu)[sel].max() > 1e-3
    assert 1.0 <= rec["env/turns"] <= 3.0 and rec["async/staleness_max"] == int(n - 1 - b.versions.min())
  assert crossing > 0  # trajectories did continue under a newer version
  if engine is not None:  # the engine got each version it sampled with, once
    assert tr.engine.pushes == sum("engine/push_s" in r for r in recs) >= 2
  ledger = [json.loads(x) for x in open(tmp_path / "p" / async_rollout.LEDGER)]
  trained = [p for r in ledger for p in r["prompts"]]
  assert [r["prompts"] for r in ledger] == [b.prompts.tolist() for b in seen] and len(set(trained)) == len(trained)
  # dynamic sampling on the episode pool: a trained group's rewards differ unless the round limit filled it in
  # (a flat environment's group never does); every equal-reward group met is counted
  flat = lambda p: len(example_row(tr.source.examples[p])["problem"]) % 2 == 0  # the row the environment gets
  for b, rec, line in zip(seen, recs, ledger):
    equal = np.ptp(np.asarray(b.batch.rewards).reshape(len(b.prompts), -1), axis=1) == 0
    assert rec["dynamic_sampling/dropped_groups"] == len(line["filtered"]) + int(equal.sum())
    assert not equal.any() or rec["dynamic_sampling/rounds"] == 2
    assert all(equal[j] for j, p in enumerate(line["prompts"]) if flat(p))
  filtered = [p for r in ledger for p in r["filtered"]]
  assert filtered and not set(filtered) & set(trained) and len(set(filtered)) == len(filtered)


CHILD = r"""
import runpy, sys
sys.path.insert(0, sys.argv[1])
from test_partial_rollouts import ragged
from jaxgrpo.loop.partial import schedule as partial_schedule
init = partial_schedule.PartialRollouts.__init__
partial_schedule.PartialRollouts.__init__ = lambda self, *a, **kw: init(self, *a, **{**kw, "budget_of": ragged})
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_resume_after_kill_trains_or_drops_every_prompt_once(tmp_path, monkeypatch):
  """SIGKILL a real ``scripts/train.py`` with partial rollouts (ragged lengths: rows in flight at every
  checkpoint), resume it: every drawn prompt is trained or dropped exactly once, nothing is skipped, and the
  prompts a checkpoint recorded in flight are the first drawn after the resume. The resumed run needs no process
  of its own (nothing kills it): ``scripts/train.py``'s ``main`` in this process, with the child's ragged budgets."""
  steps = 7
  out = tmp_path / "killed"
  cmd = async_train_cmd(out, steps, **{"rollout.max_staleness": "2", "rollout.partial": json.dumps(PARTIAL)})
  cmd = [sys.executable, "-c", CHILD, str(__import__("pathlib").Path(__file__).parent), *cmd[1:]]
  env = cli_env(tmp_path / "cache")
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  ledger = out / async_rollout.LEDGER
  done = kill_after_ledger_lines(proc, ledger)
  assert 3 <= done < steps
  last = max(int(d.name) for d in (out / "checkpoints").iterdir() if d.name.isdigit())
  recorded = read_meta(str(out / "checkpoints" / str(last)))["data_position"]["untrained"]
  assert recorded and recorded[0], recorded  # rows were in flight: discarded, their prompts recorded
  from helpers import train_main_here

  from jaxgrpo.loop.partial import schedule as partial_schedule

  init = partial_schedule.PartialRollouts.__init__
  ragged_init = lambda self, *a, **kw: init(self, *a, **{**kw, "budget_of": ragged})  # as CHILD does
  monkeypatch.setattr(partial_schedule.PartialRollouts, "__init__", ragged_init)
  train_main_here(cmd[5:])  # the same arguments (after python -c CHILD tests/ scripts/train.py); raises on failure
  lines = [json.loads(x) for x in ledger.read_text().splitlines()]
  assert [x["step"] for x in lines] == list(range(1, steps + 1))
  settled = [p for x in lines for p in x["prompts"] + x["dropped"]]
  assert len(set(settled)) == len(settled)  # nothing trained (or dropped) twice
  final = read_meta(str(out / "checkpoints" / str(steps)))["data_position"]
  pending = [p for rnd in final["untrained"] for p in rnd]
  drawn = PromptIterator(24, seed=0).next(final["offset"]).tolist()
  assert sorted(settled + pending) == sorted(drawn)  # nothing skipped: every drawn prompt is settled or pending
  after = [p for x in lines[last:] for p in x["prompts"] + x["dropped"]]
  assert set(recorded[0]) <= set(after)  # the recorded prompts were drawn again and settled after the resume
