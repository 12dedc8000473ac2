"""Partial rollouts (``rollout.partial``, issue 36 items 2-3): rows in flight across weight updates.

- every trained token's behaviour log-prob equals a teacher-forced recomputation under the version it records
  (and rows do span two versions); the step's importance weights equal a NumPy TIS computation from those
  recorded log-probs and π_old (θ(n-1) recomputed here); the metrics count the rows that span versions;
- rows that could not wait for the next batch within the bound are finished in this one (no drops); a group
  holding a token older than the bound is dropped before it can be trained, counted (``rollout/dropped_rows``)
  and listed in the ledger, never trained;
- the same through an engine (``EnginePool``: a user's engine in a trainer run, the ``BuiltinEngine`` in the
  pool alone; vLLM in its own venv, tests/vllm_trainer.py ``partial``);
- combinations it does not build are refused at load, one line each; off by default (the async tests run
  unchanged);
- a real run killed (SIGKILL) and resumed trains or drops every drawn prompt exactly once: the checkpoint
  discards the rows in flight and records their prompts, drawn again first after the resume.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import async_train_cmd, cli_env, kill_after_ledger_lines
from hf_utils import tiny_hf_config
from test_async_rollout import REWARDS
from test_engines import OFFSET
from test_packing_models import randomized
from test_trainer import tiny

from jaxgrpo import models
from jaxgrpo.data import PromptIterator, pad_left
from jaxgrpo.models.log_probs import completion_log_probs
from jaxgrpo.rollout import async_rollout, iteration
from jaxgrpo.rollout.engines import BuiltinEngine
from jaxgrpo.rollout.partial import RowPool
from jaxgrpo.rollout.partial_engine import EnginePool
from jaxgrpo.rollout.sampling import SamplingConfig
from jaxgrpo.run.composition import check_composition
from jaxgrpo.run.trainer import Trainer
from jaxgrpo.services.checkpoint import read_meta
from jaxgrpo.step.train import TrainState

PARTIAL = {"enabled": True, "refill_every": 2}


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
  frozen = tr.state.train.frozen
  pipe = tr.rollouts
  assert type(pipe).__name__ == "PartialRollouts" and pipe.ahead == 1
  assert type(pipe.pool) is (RowPool if engine is None else EnginePool)
  pipe.pool.budget_of = ragged
  seen, recs = [], []
  pipe.observe = seen.append

  def logp_under(version, b):
    model = iteration.policy_model(tr.graphdef, TrainState(versions[version], None, None, frozen))
    lp, _ = completion_log_probs(
      model, b.prompt_tokens, b.prompt_mask, b.completions, b.mask, temperature=1.0, chunk_size=None
    )
    return np.asarray(lp)

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
    lp, _ = completion_log_probs(policy, tok, mask, comp, cmask, temperature=1.0, chunk_size=None)
    err = np.abs(np.asarray(lp)[0] - long.logp)[long.versions == v]
    assert err.max() < 2e-5, (v, err)
    other = np.abs(np.asarray(lp)[0] - long.logp)[(long.versions >= 0) & (long.versions != v)]
    assert other.min() > 1e-4  # another version's log-probs differ: the test can fail
  assert pushed == ([0, 1, 2] if engine_args else [])


def test_partial_rollouts_refuse_what_they_do_not_build():
  assert tiny().rollout.partial.enabled is False
  on = {"rollout.partial": {"enabled": True}, "objective.importance_correction": "tis"}
  with pytest.raises(ValueError, match=r"needs `rollout.max_staleness` >= 1 .* got 0"):
    tiny(**on)
  with pytest.raises(ValueError, match=r"`rollout.partial.ahead`=2 must be < `rollout.max_staleness`=2"):
    tiny(**{**on, "rollout.max_staleness": 2, "rollout.partial": {"enabled": True, "ahead": 2}})
  for engine in ("vllm", "test_engines:make_offset_engine"):  # engines load (EnginePool; vLLM: tests/vllm_trainer.py)
    assert tiny(**{**on, "rollout.max_staleness": 1, "rollout.engine": engine}).rollout.partial.enabled
  with pytest.raises(ValueError, match=r"with `objective.dynamic_sampling`: not built"):
    tiny(**{**on, "rollout.max_staleness": 1, "objective.dynamic_sampling": True})
  with pytest.raises(ValueError, match=r"`rollout.partial.refill_every` must be >= 1; got 0"):
    tiny(**{**on, "rollout.max_staleness": 1, "rollout.partial": {"enabled": True, "refill_every": 0}})
  check_composition(tiny(**{**on, "rollout.max_staleness": 1}), process_count=2)  # built: test_compose_multihost.py


class Countdown:
  """An environment whose episodes last 1, 2 or 3 turns (by creation order: the groups of a batch end at
  different turns, so trajectories are in flight when a batch is taken), rewarded 0.1 × the share of digits in
  each turn's text (advantages are not all 0), "Go on." after each turn but the last."""

  tools = ()
  made = [0]

  def __init__(self):
    self.length, self.turn = 1 + self.made[0] % 3, 0
    self.made[0] += 1

  def reset(self, row):
    return [{"role": "user", "content": row["problem"]}]

  def step(self, text):
    from jaxgrpo.rollout.environments import StepResult

    self.turn += 1
    reward = 0.1 * sum(c.isdigit() for c in text) / max(len(text), 1)
    if self.turn == self.length:
      return StepResult((), reward, True)
    return StepResult([{"role": "user", "content": "Go on."}], reward, False)


def make_countdown(row):
  """``env.factory: test_partial_rollouts:make_countdown``."""
  return Countdown()


def test_environment_trajectories_continue_across_updates_turn_by_turn(tmp_path):
  """Multi-turn partial rollouts (``jaxgrpo.rollout.partial_env``): episodes of 1-3 turns kept across weight
  updates; every policy token's behaviour log-prob equals a teacher-forced recomputation under the version it
  records (and trajectories do span two versions, a turn being one version's); observations are not policy
  tokens; every trained group's trajectories are complete; the ledger trains each drawn prompt once."""
  steps = 4
  cfg = tiny(
    **{
      "env.factory": "test_partial_rollouts:make_countdown",
      "env.max_turns": 3,
      "env.max_tokens": 48,
      "env.turn_tokens": 6,
      "run.out": str(tmp_path / "p"),
      "run.steps": steps,
      "rollout.max_staleness": 2,
      "rollout.partial": {"enabled": True, "slots": 12},
      "objective.importance_correction": "tis",
      "optim.learning_rate": 3e-2,
    }
  )
  tr = Trainer(cfg, log=None)
  versions = {0: jax.tree.map(np.asarray, tr.state.train.params)}
  frozen = tr.state.train.frozen
  pipe = tr.rollouts
  assert type(pipe.pool).__name__ == "EpisodePool"
  seen, recs = [], []
  pipe.observe = seen.append

  def logp_under(version, b):
    model = iteration.policy_model(tr.graphdef, TrainState(versions[version], None, None, frozen))
    lp, _ = completion_log_probs(
      model, b.prompt_tokens, b.prompt_mask, b.completions, b.mask, temperature=1.0, chunk_size=None
    )
    return np.asarray(lp)

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
      assert np.abs(logp_under(int(v), b.batch) - mu)[sel].max() < 2e-5, (n, v)
      if int(v) + 1 in versions:
        assert np.abs(logp_under(int(v) + 1, b.batch) - mu)[sel].max() > 1e-3
    assert 1.0 <= rec["env/turns"] <= 3.0 and rec["async/staleness_max"] == int(n - 1 - b.versions.min())
  assert crossing > 0  # trajectories did continue under a newer version
  ledger = [json.loads(x) for x in open(tmp_path / "p" / async_rollout.LEDGER)]
  trained = [p for r in ledger for p in r["prompts"]]
  assert [r["prompts"] for r in ledger] == [b.prompts.tolist() for b in seen] and len(set(trained)) == len(trained)


CHILD = r"""
import runpy, sys
sys.path.insert(0, sys.argv[1])
from test_partial_rollouts import ragged
from jaxgrpo.rollout import partial_schedule
init = partial_schedule.PartialRollouts.__init__
partial_schedule.PartialRollouts.__init__ = lambda self, *a, **kw: init(self, *a, **{**kw, "budget_of": ragged})
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_resume_after_kill_trains_or_drops_every_prompt_once(tmp_path):
  """SIGKILL a real ``scripts/train.py`` with partial rollouts (ragged lengths: rows in flight at every
  checkpoint), resume it: every drawn prompt is trained or dropped exactly once, nothing is skipped, and the
  prompts a checkpoint recorded in flight are the first drawn after the resume."""
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
  r = subprocess.run(cmd, env=env, capture_output=True, timeout=600)
  assert r.returncode == 0, r.stderr.decode()[-3000:]
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
