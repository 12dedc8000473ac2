"""jaxgrpo.loop.async_rollout: bounded-staleness rollouts.

- k = 0 through the producer/learner pipeline equals the trainer's synchronous step bit for bit
  (metrics, parameters, key, data position), dynamic sampling included;
- k = 1 with dynamic sampling, dense and LoRA: the deterministic schedule (batch m sampled with
  θ(m-2)); every trained sample's behaviour log-probs equal a teacher-forced recomputation under the
  parameter version it records (and not under its neighbours), no group is older than k, π_old is recomputed and the mismatch is reported, only informative groups are kept
  and the producer's draws are the data iterator's sequence;
- close() and a restart sample again from the trained position; the learner refuses a batch older
  than k;
- a real ``scripts/train.py`` killed (SIGKILL) during an overlapped run and resumed trains the same
  multiset of prompts as an uninterrupted run (and as the data iterator's order);
- disaggregated placement (4 + 4 of 8 CPU devices, in a child process) trains on the train mesh,
  samples on the rollout mesh, reports the weight transfer, and at k = 0 equals a colocated
  synchronous run on a 4-device mesh; a multi-turn run there one step off samples every turn with the
  version published on the rollout devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from helpers import (
  async_train_cmd,
  child_env,
  cli_env,
  kill_after_ledger_lines,
  ref_completion_log_probs,
  train_main_here,
)
from test_trainer import ROOT, tiny
from test_trainer import cli as train_cli  # scripts/train.py

from jaxgrpo.data import PromptIterator
from jaxgrpo.loop import async_rollout, iteration
from jaxgrpo.run.specs import load_config
from jaxgrpo.run.trainer import Trainer
from jaxgrpo.services.checkpoint import read_meta
from jaxgrpo.step.train import TrainState


def varied_reward(prompts, completions, **_):
  """A reward that differs between completions (the untrained tiny model never boxes an answer)."""
  return [float(sum(map(ord, c)) % 5) for c in completions]


REWARDS = {"varied": (varied_reward, 1.0)}


def _params(tr) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(tr.state.train.params)]


@pytest.mark.slow
def test_k0_pipeline_equals_the_synchronous_trainer_bit_for_bit(tmp_path):
  """The pipeline at k = 0 (serial: each batch sampled with the parameters of the step before) runs
  exactly the synchronous step's computation: same prompts, keys, samples, update."""
  changes = {"run.steps": 3, "objective.dynamic_sampling": True, "rollout.dynamic_sampling_max_rounds": 2}
  sync = Trainer(tiny(**{**changes, "run.out": str(tmp_path / "s")}), reward_fns=REWARDS, log=None)
  assert sync.rollouts is None  # max_staleness 0, colocated: today's loop
  piped = Trainer(tiny(**{**changes, "run.out": str(tmp_path / "p")}), reward_fns=REWARDS, log=None)
  piped.schedule = async_rollout.AsyncRollouts(
    piped.source, piped.learner, piped.state, max_staleness=0, steps=3, out_dir=str(tmp_path / "p")
  )
  try:
    for _ in range(3):
      ms, mp = sync.train_step(), piped.train_step()
      for k, v in ms.items():
        if k not in ("step_time", "rollout_time", "tokens_per_sec"):
          assert mp[k] == v, k
      assert mp["async/staleness_max"] == 0 and mp["async/old_logp_s"] == 0.0  # fresh: no recomputation
      for a, b in zip(_params(sync), _params(piped)):
        np.testing.assert_array_equal(a, b)
      assert jax.random.key_data(sync.state.key).tolist() == jax.random.key_data(piped.state.key).tolist()
      pos = dict(piped.state.data_position)
      assert pos.pop("untrained") == [] and pos == sync.state.data_position
  finally:
    piped.rollouts.close()
  assert ms["dynamic_sampling/rounds"] >= 1 and ms["loss"] != 0.0


def half_constant_reward(prompts, completions, **_):
  """Constant (an uninformative group, dropped by dynamic sampling) for prompts of even length."""
  return [1.0 if len(p) % 2 == 0 else float(sum(map(ord, c)) % 5) for p, c in zip(prompts, completions)]


@pytest.mark.slow
@pytest.mark.parametrize("adapters", [False, True], ids=["dense", "lora"])
def test_k1_behaviour_logp_is_the_recorded_version_and_never_older_than_k(tmp_path, adapters):
  """One-step-off with dynamic sampling, dense and LoRA (the versions are the adapters; the sampler
  runs them on the frozen base): batch 1 is sampled with θ(0) before step 1, every later batch m
  (refill rounds included) during step m-1 with θ(m-2) — staleness exactly 1."""
  steps, rounds_max = 4, 3
  changes = {
    "run.out": str(tmp_path / "k1"),
    "run.steps": steps,
    "rollout.max_staleness": 1,
    "objective.dynamic_sampling": True,
    "rollout.dynamic_sampling_max_rounds": rounds_max,
    "objective.importance_correction": "tis",
    "optim.learning_rate": 3e-2,
    "checkpoint.every": 1,
  }
  if adapters:
    changes["lora"] = {"rank": 4, "alpha": 8.0}
  cfg = tiny(**changes)
  versions = {}
  tr = Trainer(
    cfg,
    reward_fns={"r": (half_constant_reward, 1.0)},
    log=None,
    checkpoint_fn=lambda snap, run: versions.__setitem__(int(snap.step), jax.tree.map(np.asarray, snap.params)),
  )
  versions[0] = jax.tree.map(np.asarray, tr.state.train.params)
  frozen = tr.state.train.frozen
  assert (frozen is not None and len(jax.tree.leaves(frozen)) > 0) == adapters
  seen = []
  tr.rollouts.observe = seen.append
  recs = [r for r in tr.run() if "loss" in r]
  assert [b.index for b in seen] == list(range(1, steps + 1))
  assert [b.versions.tolist() for b in seen] == [[0, 0]] + [[m - 2] * 2 for m in range(2, steps + 1)]
  # overlapped steps do not wait between the learner's phases; the last one (nothing produced) does
  assert all("time/update_s" not in r for r in recs[:-1]) and recs[-1]["async/old_logp_s"] > 0

  def recompute(version, b):
    model = iteration.policy_model(tr.graphdef, TrainState(versions[version], None, None, frozen))
    return np.asarray(ref_completion_log_probs(model, b.prompt_tokens, b.prompt_mask, b.completions, b.mask))

  stale, g = 0, tr.config.rollout.group_size
  for b, rec in zip(seen, recs):
    s = (b.index - 1) - b.versions
    assert s.min() >= 0 and s.max() <= 1  # never older than k
    stale += int((s > 0).sum())
    assert [rec[f"async/staleness_hist/{i}"] for i in (0, 1)] == [int((s == 0).sum()), int((s == 1).sum())]
    for j, v in enumerate(b.versions):
      rows = slice(j * g, (j + 1) * g)
      group = b.batch._replace(
        **{f: getattr(b.batch, f)[rows] for f in ("prompt_tokens", "prompt_mask", "completions", "mask")}
      )
      behaviour, m = np.asarray(b.batch.old_logp)[rows], np.asarray(b.batch.mask)[rows]
      err = np.abs(recompute(int(v), group) - behaviour)[m].max()
      assert err < 2e-5, (b.index, j, int(v), err)
      for other in (int(v) - 1, int(v) + 1):  # the test can fail: a neighbouring version differs
        if other in versions:
          assert np.abs(recompute(other, group) - behaviour)[m].max() > 1e-3
    if s.max() > 0:  # π_old recomputed, the mismatch with μ measured, TIS applied
      assert rec["async/mismatch_kl"] > 0 and "is_weight_mean" in rec
    # dynamic sampling: informative groups kept (unless the rounds ran out), drawn from this batch's rounds
    assert rec["dynamic_sampling/rounds"] == len(b.rounds)
    if len(b.rounds) < rounds_max:
      assert (np.asarray(b.batch.rewards).reshape(len(b.prompts), g).std(axis=1) > 0).all()
    assert set(b.prompts.tolist()) <= {i for rnd in b.rounds for i in rnd}
  assert stale > 0  # the producer ran ahead
  assert sum(rec["dynamic_sampling/dropped_groups"] for rec in recs) > 0  # refills happened
  ledger = [json.loads(x) for x in open(tmp_path / "k1" / async_rollout.LEDGER)]
  assert [r["versions"] for r in ledger] == [b.versions.tolist() for b in seen]
  assert [r["prompts"] for r in ledger] == [b.prompts.tolist() for b in seen]
  # every draw of the producer, in order, is the data iterator's sequence: nothing skipped or repeated
  drawn = [i for b in seen for rnd in b.rounds for i in rnd]
  assert drawn == PromptIterator(len(tr.prompts.tokens), seed=0).next(len(drawn)).tolist()


@pytest.mark.slow
def test_close_and_restart_resample_from_the_trained_position_and_stale_batches_are_refused(tmp_path):
  cfg = tiny(
    **{
      "run.out": str(tmp_path / "o"),
      "run.steps": 4,
      "rollout.max_staleness": 1,
      "objective.importance_correction": "tis",
      "optim.learning_rate": 3e-2,  # the k = 1 test's: its compiled step is read back from the cache
    }
  )
  tr = Trainer(cfg, reward_fns=REWARDS, log=None)
  pipe = tr.rollouts
  try:
    tr.train_step()
    pipe.close()  # the producer was a batch (or two) ahead: dropped, sampled again below
    assert tr.iterator.state()["offset"] > 2
    tr.train_step()
    it = PromptIterator(len(tr.prompts.tokens), seed=0)
    ledger = [json.loads(x)["prompts"] for x in open(tmp_path / "o" / async_rollout.LEDGER)]
    assert ledger == [it.next(2).tolist(), it.next(2).tolist()]
    item = pipe._queue.popleft()  # batch 3, produced during step 2
    pipe._queue.appendleft(item._replace(versions=item.versions - 2))  # as if sampled 2 updates back
    with pytest.raises(RuntimeError, match=r"staleness .* outside \[0, 1\]"):
      tr.train_step()
  finally:
    pipe.close()


def test_meshes_and_config_errors():
  from jaxgrpo.run.specs import DevicesSpec

  with pytest.raises(ValueError, match=r"`devices.train`=2 needs `devices.rollout`"):
    DevicesSpec(train=2)
  with pytest.raises(ValueError, match=r"`devices.rollout` must be >= 1; got 0"):
    DevicesSpec(rollout=0)
  with pytest.raises(ValueError, match=r"`rollout.max_staleness` must be >= 0; got -1"):
    tiny(**{"rollout.max_staleness": -1})
  with pytest.warns(UserWarning, match=r"max_staleness`=1 without `objective.importance_correction`"):
    tiny(**{"rollout.max_staleness": 1})
  n = len(jax.devices())
  with pytest.raises(ValueError, match=r"do not fit the \d+ devices"):
    async_rollout.make_meshes(DevicesSpec(rollout=n))
  train, rollout = async_rollout.make_meshes(DevicesSpec())
  assert rollout is None and train.size == n
  # several processes: each gives train / P and rollout / P of its own devices (checked before any mesh)
  fake = [SimpleNamespace(process_index=p, id=4 * p + i) for p in range(2) for i in range(4)]
  with pytest.raises(
    ValueError, match=r"`devices.train`=3 and `devices.rollout`=4 must each divide over the 2 processes"
  ):
    async_rollout.make_meshes(DevicesSpec(train=3, rollout=4), devices=fake)
  with pytest.raises(ValueError, match=r"fit each process's 2 devices"):  # process 1 has only 2
    async_rollout.make_meshes(DevicesSpec(train=2, rollout=4), devices=fake[:6])


def _ledger_prompts(out) -> list[int]:
  return [p for line in open(os.path.join(out, async_rollout.LEDGER)) for p in json.loads(line)["prompts"]]


@pytest.mark.slow
def test_resume_after_kill_trains_every_prompt_once(tmp_path):
  """SIGKILL a real overlapped run after a few checkpoints (the producer is a batch ahead), resume it:
  the trained prompts are those of an uninterrupted run, in the data iterator's order; the
  checkpoint recorded the untrained batch, which was sampled again. The resumed run needs no process of its own
  (nothing kills it): ``scripts/train.py``'s ``main`` in this process."""
  steps = 7  # 14 prompts of 24: no epoch boundary hides a skip
  env = cli_env(tmp_path / "cache")  # the tests' compile flags (helpers.TEST_XLA_FLAGS)
  # the uninterrupted run: the same command line's config, run in this process (1 device, the same
  # compile flags and persistent compilation cache: the children below read its programs back)
  full = tmp_path / "full"
  _, overrides = train_cli.parse_args(async_train_cmd(full, steps)[2:])
  assert jax.device_count() == 1
  Trainer(load_config(None, overrides), log=None).run(handle_signals=False)
  out = tmp_path / "killed"
  proc = subprocess.Popen(async_train_cmd(out, steps), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  ledger = out / async_rollout.LEDGER
  done = kill_after_ledger_lines(proc, ledger)
  assert 3 <= done < steps
  steps_saved = [d.name for d in (out / "checkpoints").iterdir() if d.name.isdigit()]
  untrained = [read_meta(str(out / "checkpoints" / d))["data_position"].get("untrained") for d in steps_saved]
  assert any(u for u in untrained if u), untrained  # a checkpoint recorded groups not yet trained
  train_main_here(async_train_cmd(out, steps)[2:])  # the resume needs no process of its own; raises on failure
  trained = _ledger_prompts(out)
  assert sorted(trained) == sorted(_ledger_prompts(full))
  it = PromptIterator(24, seed=0)
  assert trained == it.next(2 * steps).tolist()  # nothing skipped, nothing repeated, in order
  assert len(set(trained)) == len(trained)


DISAGG_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import jax, numpy as np
from flax import nnx
from test_trainer import tiny
from test_async_rollout import REWARDS
from jaxgrpo.loop import async_rollout
from jaxgrpo.run.trainer import Trainer
mode, out = sys.argv[2], sys.argv[3]
if mode == "disaggregated":
  cfg = tiny(**{"run.out": out, "run.steps": 2, "devices.mesh": "fsdp=4", "devices.rollout": 4,
                "devices.train": 4, "devices.rollout_mesh": "fsdp=4", "optim.learning_rate": 3e-2})
  tr = Trainer(cfg, reward_fns=REWARDS, log=None)
  assert tr.rollouts is not None and tr.rollouts.k == 0 and not tr.rollouts.colocated
  train_ids = {d.id for d in tr.mesh.devices.flat}
  roll_ids = {d.id for d in tr.rollout_mesh.devices.flat}
  recs = []
  try:
    for _ in range(2):
      recs.append(tr.train_step())
      version, params = tr.rollouts._latest()
      on = {d.id for x in jax.tree.leaves(params) for d in x.devices()}
      assert version == recs[-1]["step"] and on == roll_ids, (on, roll_ids)
  finally:
    tr.rollouts.close()
  on_train = {d.id for x in jax.tree.leaves(tr.state.train.params) for d in x.devices()}
  assert on_train == train_ids and not (train_ids & roll_ids)
  # multi-turn on the rollout devices, one step off (issue 35.3): the environments' turns run on the producer's
  # published version there while the learner updates on the train devices
  from test_trainer_env import ENV
  ecfg = tiny(**ENV, **{"run.out": out + "/env", "run.steps": 2, "devices.mesh": "fsdp=4", "devices.rollout": 4,
                         "devices.train": 4, "devices.rollout_mesh": "fsdp=4", "rollout.max_staleness": 1,
                         "objective.importance_correction": "tis", "optim.learning_rate": 3e-2})
  etr = Trainer(ecfg, log=None)
  sampled_on = []
  generate = etr.source.sampling_policy
  etr.source.sampling_policy = lambda policy=None: (sampled_on.append(
    {d.id for x in jax.tree.leaves(nnx.state(policy)) for d in x.devices()}), generate(policy))[1]
  erecs = [r for r in etr.run(handle_signals=False) if "loss" in r]
  assert [r["async/staleness_max"] for r in erecs] == [0, 1] and all(r["env/turns"] >= 1 for r in erecs), erecs
  sampled_on = [s for s in sampled_on if s]  # policy None: the evaluation (the learner's policy, train devices)
  assert len(sampled_on) == 2 and all(s == roll_ids for s in sampled_on), sampled_on
else:
  cfg = tiny(**{"run.out": out, "run.steps": 2, "devices.mesh": "fsdp=4", "optim.learning_rate": 3e-2})
  tr = Trainer(cfg, reward_fns=REWARDS, log=None)
  assert tr.rollouts is None
  recs = [tr.train_step() for _ in range(2)]
params = [np.asarray(x).tolist() for x in jax.tree.leaves(tr.state.train.params)[:3]]
print("RESULT " + json.dumps({"recs": recs, "params": params}))
"""


@pytest.mark.slow
def test_disaggregated_placement_matches_colocated(tmp_path):
  results = {}
  for mode, devices in (("disaggregated", 8), ("colocated", 4)):
    env = child_env(devices)
    r = subprocess.run(
      [sys.executable, "-c", DISAGG_CHILD, os.path.join(ROOT, "tests"), mode, str(tmp_path / mode)],
      env=env,
      capture_output=True,
      timeout=600,
    )
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    line = [x for x in r.stdout.decode().splitlines() if x.startswith("RESULT ")][-1]
    results[mode] = json.loads(line[len("RESULT ") :])
  d, c = results["disaggregated"], results["colocated"]
  for rd, rc in zip(d["recs"], c["recs"]):
    assert rd["async/weight_transfer_s"] > 0
    for k in ("loss", "reward_mean", "completion_length", "grad_norm"):
      assert rd[k] == pytest.approx(rc[k], rel=1e-5, abs=1e-6), k
  for a, b in zip(d["params"], c["params"]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
