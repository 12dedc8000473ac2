"""A multi-turn run (``env:``) on two real processes (127.0.0.1, gloo CPU collectives, 2 devices each, mesh
``data=2,fsdp=2``), issue 35.4: each process runs the environments of its own groups only (its turns sampled
in collective rounds, ``jaxgrpo.rollout.engines.collective``), with dynamic sampling (and a distillation teacher
scoring each process's own rows, its per-group signals gathered; issue 52) and an evaluation split over the
processes; both processes log the same metrics (every decision gathered); a run resumed from the
straight run's checkpoint of step 1 equals its step 2 bit for bit (parameters, loss, rewards). Then the same for
a user's engine, single-turn (issue 35.5): one engine per process, pushed a whole host copy of the policy
gathered from every process's shards, sampling that process's own groups; the policy recomputes ``old_logp``
(``engine/mismatch_k3`` equals the engine's known offset). Then partial rollouts (issue 36, ``rollout.partial``,
k = 2, ragged lengths so rows are in flight at every step): each process's row pool samples its own group of
every batch (its rows' group ids), every own token's μ is the teacher-forced log-prob of the version it records
(rows do cross a version), both processes log the same metrics, a group aged on process 0 alone is dropped and
counted on both and listed in the ledger; every prompt the data iterator drew (its order rebuilt here) is trained,
dropped or recorded untrained exactly once, in the straight run and in one resumed from step 1's state (that one
with dynamic sampling: each pool filters its own groups; the filtered prompts, gathered into the ledger, are
settled too and counted in the summed ``dynamic_sampling/dropped_groups``; a distillation teacher scores each complete
group, its pass taken by both processes in turns). Then speculative decoding in the
multi-turn collective rounds (issue 51.3): ``auto`` timing plain then prompt-lookup rollouts and deciding alike on
both processes from the numbers they agreed on; every policy token's recorded log-prob equals a teacher-forced
pass of the parameters that sampled it (1e-5), observations carry 0; the same for single-turn rows with a
draft model (its copy replicated on the mesh); and environments with partial rollouts speculating by prompt
lookup, each process's episode pool in its own programs, the speculative metrics combined over both.

(Two processes do not equal one process here: a turn's sampler batch holds each process's running rows
padded to the largest, so the rows sit at other global indices than in one process; docs/trainer.md.)
"""

from __future__ import annotations

import json
import math
import socket

import pytest
from helpers import finish_children, start_child

from jaxgrpo.data import PromptIterator

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

_WORKER = r"""
import json, sys
nproc, pid, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
from jaxgrpo.parallel import distributed
distributed.initialize(f"127.0.0.1:{port}", nproc, pid)
import dataclasses
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
nnx_state = lambda m: nnx.split(m)[1]
import test_trainer_env
from test_trainer import tiny
from jaxgrpo.run.trainer import Trainer
assert jax.process_count() == 2 and jax.device_count() == 4
resets = []
reset = test_trainer_env.SecondChance.reset
test_trainer_env.SecondChance.reset = lambda self, row: (resets.append(row["problem"]), reset(self, row))[1]
# with a distillation teacher (issue 52): each process scores its own multi-turn rows, the signals are gathered;
# min_signal out of reach, so the groups kept are the rewards' (a refill stays possible)
from test_distill_run import TEACHER
cfg = tiny(**test_trainer_env.ENV, **{"run.out": out, "run.steps": 2, "checkpoint.every": 1, "eval.every": 2,
              "objective.dynamic_sampling": True, "rollout.dynamic_sampling_max_rounds": 2,
              "objective.distill": {**TEACHER, "min_signal": 1e9},
              "optim.learning_rate": 3e-2, "devices.mesh": "data=2,fsdp=2", "devices.host_timeout_s": 120})
saved = {}
save = lambda snap, meta: saved.__setitem__(int(snap.step), jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, snap))
tr = Trainer(cfg, checkpoint_fn=save, log=None)
recs = tr.run(handle_signals=False)
params = [np.asarray(x) for x in jax.tree.leaves(tr.state.train.params)]
res = Trainer(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out=out + "/b")),
              restore_fn=lambda meta, template: saved[1], log=None)
got = res.run(handle_signals=False)
same = all(np.array_equal(a, np.asarray(b)) for a, b in zip(params, jax.tree.leaves(res.state.train.params)))
# a user's engine (log-probs 0.5 nats off the policy's), single-turn: one engine per process for its own groups
from test_async_rollout import REWARDS
import test_engines
pushes = []
make = test_engines.make_offset_engine
test_engines.make_offset_engine = lambda **kw: (lambda e: (pushes.append(e), e)[1])(make(**kw))
ecfg = tiny(**{"run.out": out + "/e", "run.steps": 2, "checkpoint.every": 1, "optim.learning_rate": 3e-2,
               "rollout.engine": "test_engines:make_offset_engine", "objective.importance_correction": "tis",
               "devices.mesh": "data=2,fsdp=2", "devices.host_timeout_s": 120})
saved = {}
etr = Trainer(ecfg, checkpoint_fn=save, reward_fns=REWARDS, log=None)
erecs = etr.run(handle_signals=False)
eparams = [np.asarray(x) for x in jax.tree.leaves(etr.state.train.params)]
eres = Trainer(dataclasses.replace(ecfg, run=dataclasses.replace(ecfg.run, out=out + "/eb")),
               restore_fn=lambda meta, template: saved[1], reward_fns=REWARDS, log=None)
egot = eres.run(handle_signals=False)
esame = all(np.array_equal(a, np.asarray(b)) for a, b in zip(eparams, jax.tree.leaves(eres.state.train.params)))
# the engine's model is a whole host copy (NumPy) of the policy, equal on both processes
engine_params = [np.asarray(x).tolist() for x in jax.tree.leaves(nnx_state(pushes[0].model))][:1]
# partial rollouts (issue 36): each process's row pool feeds its own group of every batch (B = 2, k = 2)
from test_partial_rollouts import PARTIAL, ragged
from test_async_rollout import half_constant_reward
from jaxgrpo.loop import async_rollout
from jaxgrpo.step.train import TrainState
from jaxgrpo.step import feed
from jaxgrpo.models.log_probs import completion_log_probs
pcfg = tiny(**{"run.out": out + "/p", "run.steps": 3, "checkpoint.every": 1, "rollout.max_staleness": 2,
               "rollout.partial": PARTIAL, "objective.importance_correction": "tis", "optim.learning_rate": 3e-2,
               "devices.mesh": "data=2,fsdp=2", "devices.host_timeout_s": 120})
saved, host, positions = {}, {}, {}
def psave(snap, meta):
  save(snap, meta)
  host[int(snap.step)] = distributed.to_host(snap.params)
  positions[int(snap.step)] = snap.data_position
ptr = Trainer(pcfg, checkpoint_fn=psave, reward_fns=REWARDS, log=None)
ptr.rollouts.pool.budget_of = ragged
host[0] = distributed.to_host(ptr.state.train.params)
pseen, aged = [], []
def pobserve(b):
  pseen.append(b)
  if b.index == 1 and pid == 0:  # a group in flight made 5 versions old: producing batch 3 drops it (both log it)
    g = next(g for g in ptr.rollouts.pool.groups.values() if g.oldest() is not None)
    for row in g.rows:
      row.versions[: row.t] -= 5
    aged.append(g.prompt)
ptr.rollouts.observe = pobserve
precs = ptr.run(handle_signals=False)
pfinal = dict(ptr.state.data_position)
# mu of each own token is the teacher-forced log-prob under the version it records
local = lambda tree: jax.device_put(tree, jax.local_devices()[0])
err, crossing = 0.0, 0
for b in pseen:
  tv, mask, mu = b.token_versions, np.asarray(b.batch.mask), np.asarray(b.batch.old_logp)
  assert ((tv >= 0) == mask).all() and b.batch.completions.shape[0] == 4, tv
  assert np.asarray(b.batch.group_ids).tolist() == [pid] * 4, b.batch.group_ids
  crossing += int(sum((r[m].max() > r[m].min()) for r, m in zip(tv, mask) if m.any()))
  for v in np.unique(tv[mask]):
    model = feed.policy_model(ptr.graphdef, TrainState(local(host[int(v)]), None, None, ptr.state.train.frozen))
    bb = jax.tree.map(lambda x: None if x is None else np.asarray(x), b.batch)
    lp, _ = completion_log_probs(model, bb.prompt_tokens, bb.prompt_mask, bb.completions, bb.mask, temperature=1.0, chunk_size=None)
    sel = mask & (tv == v)
    err = max(err, float(np.abs(np.asarray(lp) - mu)[sel].max()))
pledger = [json.loads(x) for x in open(out + "/p/" + async_rollout.LEDGER)] if pid == 0 else None
# resumed from step 1's state: steps 2 and 3 again, with dynamic sampling (each pool filters its own groups) and a
# distillation teacher scoring each complete group (its pass spans both processes: every process takes each turn,
# its rows padded to the other's; min_signal out of reach, so the groups kept are the rewards')
teacher_cfg = tiny(**{"objective.distill": {**TEACHER, "min_signal": 1e9}}).objective.distill
pds = dataclasses.replace(pcfg, run=dataclasses.replace(pcfg.run, out=out + "/pb"),
                          objective=dataclasses.replace(pcfg.objective, dynamic_sampling=True, distill=teacher_cfg),
                          rollout=dataclasses.replace(pcfg.rollout, dynamic_sampling_max_rounds=2))
pres = Trainer(pds, restore_fn=lambda meta, template: saved[1],
               reward_fns={"r": (half_constant_reward, 1.0)}, log=None)
pres.rollouts.pool.budget_of = ragged
pgot = pres.run(handle_signals=False)
pres_final = dict(pres.state.data_position)
pres_ledger = [json.loads(x) for x in open(out + "/pb/" + async_rollout.LEDGER)] if pid == 0 else None
partial = {"recs": precs, "resumed": pgot, "final": pfinal, "resumed_final": pres_final, "ledger": pledger,
           "resumed_ledger": pres_ledger, "seen": [{"prompts": b.prompts.tolist(), "versions": b.versions.tolist()} for b in pseen],
           "aged": aged, "mu_err": err, "crossing": crossing, "position_1": positions[1]}
# environments with partial rollouts: each process's episode pool runs its own groups' trajectories, turn by turn
# (each turn by prompt-lookup speculative decoding: the pools' counts combined over the processes)
env_resets = list(resets)
vcfg = tiny(**test_trainer_env.ENV, **{"run.out": out + "/v", "run.steps": 2, "rollout.max_staleness": 2,
               "rollout.partial": {"enabled": True}, "objective.importance_correction": "tis",
               "rollout.speculative": "ngram",
               "optim.learning_rate": 3e-2, "devices.mesh": "data=2,fsdp=2", "devices.host_timeout_s": 120})
vtr = Trainer(vcfg, log=None)
vseen = []
vtr.rollouts.observe = vseen.append
venv = {"recs": vtr.run(handle_signals=False), "pool": type(vtr.rollouts.pool).__name__,
        "groups": [np.asarray(b.batch.group_ids).tolist() for b in vseen],
        "policy": [bool(np.asarray(b.batch.policy_mask).any()) for b in vseen]}
# rollout.speculative on two processes (issue 51.3). `auto` with its timed calls taken at once (warmup 0): step 1
# plain, step 2 speculative, step 3 the faster, decided from numbers both processes agreed on. Multi-turn: each
# turn's collective round is one generate_speculative program (prompt lookup); single-turn: the sampler's one
# program over both processes, with a draft model (replicated on the mesh)
import logging
from flax import nnx
from jaxgrpo import models
spec_log = []
class _Keep(logging.Handler):
  def emit(self, record):
    spec_log.append(record.getMessage())
logging.getLogger("jaxgrpo.rollout.speculative").addHandler(_Keep())
def spec_run(env, **over):  # every step's records, the switch, each step's sampled-token error to teacher forcing
  scfg = tiny(**(test_trainer_env.ENV if env else {}), **{
    "run.steps": 3, "rollout.speculative": "auto", "rollout.speculative_ngram": 1,
    "data.arithmetic": {"train_size": 64, "eval_size": 0, "sft_steps": 0},  # no evaluation: the rollouts only
    "optim.learning_rate": 3e-2, "devices.mesh": "data=2,fsdp=2", "devices.host_timeout_s": 120, **over})
  stn = Trainer(scfg, log=None, **({} if env else {"reward_fns": REWARDS}))
  stn.engine.switch.warmup = 0
  seen, batch_fn = [], stn.source.batch
  def capture(*a, **kw):  # the batch and the parameters that sampled it (whole, on the host)
    params = distributed.to_host(stn.state.train.params)
    got = batch_fn(*a, **kw)
    seen.append((params, got.batch))
    return got
  stn.source.batch = capture
  recs = stn.run(handle_signals=False)
  err = []
  for params, b in seen:
    model = feed.policy_model(stn.graphdef, TrainState(local(params), None, None, stn.state.train.frozen))
    b = jax.tree.map(lambda x: None if x is None else np.asarray(x), b)
    lp, _ = completion_log_probs(model, b.prompt_tokens, b.prompt_mask, b.completions, b.mask, temperature=1.0, chunk_size=None)
    sampled = b.mask if b.policy_mask is None else b.policy_mask
    assert (b.mask & ~sampled).any() == env and (b.old_logp[~sampled] == 0).all()  # observations: 0
    err.append(float(np.abs(np.asarray(lp) - b.old_logp)[sampled].max()))
  return {"recs": recs, "err": err, "measured": stn.engine.switch.measured, "vocab": stn.model.config.vocab_size}
spec = spec_run(True, **{"run.out": out + "/s"})
spec["log"] = list(spec_log)
small = models.Qwen3Config(vocab_size=spec["vocab"], hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
models.save_hf(models.build_model(small, rngs=nnx.Rngs(7)), out + f"/draft_{pid}")  # the same weights on both
single = spec_run(False, **{"run.out": out + "/d", "rollout.speculative_draft": out + f"/draft_{pid}"})
single["log"] = spec_log[len(spec["log"]):]
spec["single"] = single
with open(out + f"/recs_{pid}.json", "w") as f:
  json.dump({"recs": recs, "resumed": got, "same": same, "resets": env_resets, "env_partial": venv, "engine_recs": erecs,
             "engine_resumed": egot, "engine_same": esame, "engine_pushes": pushes[0].pushes,
             "engine_params": engine_params, "partial": partial, "spec": spec}, f)
print("OK")
"""


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_run_their_own_environments_and_resume_exactly(tmp_path):
  port = _free_port()
  procs = [start_child(_WORKER, devices=2, args=(2, i, port, tmp_path)) for i in range(2)]
  results = finish_children(procs, timeout=500)
  assert all("OK" in r for r in results), "\n=====\n".join(results)
  r0, r1 = (json.loads((tmp_path / f"recs_{i}.json").read_text()) for i in range(2))
  timing = lambda r: {
    k: v for k, v in r.items() if not (k.endswith("_s") or k in ("tokens_per_sec", "step_time", "rollout_time"))
  }
  assert [timing(x) for x in r0["recs"]] == [timing(x) for x in r1["recs"]]  # every decision and mean gathered
  steps = [x for x in r0["recs"] if "loss" in x]
  assert [x["step"] for x in steps] == [1, 2] and all(x["grad_norm"] > 0 for x in steps)
  assert all(1.0 <= x["env/turns"] <= 2.0 for x in steps) and any("eval_env_reward" in x for x in r0["recs"])
  assert all(x["dynamic_sampling/kept_by_teacher"] == 0 and math.isfinite(x["distill/reverse_kl"]) for x in steps)
  # each process reset only the environments of its own rows: per sampling round its one group (G = 4 rows of
  # the B = 2 groups), per evaluation its half of the 8 held-out problems x 2 samples (steps 0 and 2, and the
  # resumed run's step 2)
  rounds = sum(x["dynamic_sampling/rounds"] for x in r0["recs"] + r0["resumed"] if "loss" in x)
  for r in (r0, r1):
    assert len(r["resets"]) == 4 * rounds + 3 * 4 * 2, (len(r["resets"]), rounds)
  assert r0["same"] and r1["same"], "the resumed run's parameters differ from the straight run's"
  want = [x for x in r0["recs"] if x.get("step") == 2 and "loss" in x][0]
  have = [x for x in r0["resumed"] if "loss" in x][0]
  assert have["loss"] == want["loss"] and have["reward_mean"] == want["reward_mean"]
  # the engine cell: every process's engine sampled its own groups; log-probs recomputed by the policy
  e0, e1 = r0["engine_recs"], r1["engine_recs"]
  assert [timing(x) for x in e0] == [timing(x) for x in e1]
  esteps = [x for x in e0 if "loss" in x]
  assert [x["step"] for x in esteps] == [1, 2] and all(x["grad_norm"] > 0 for x in esteps)
  k3 = math.exp(-0.5) + 0.5 - 1  # test_engines.OFFSET: the engine's μ is π·e^0.5 on every sampled token
  assert all(abs(x["engine/mismatch_k3"] - k3) < 1e-4 for x in esteps), [x["engine/mismatch_k3"] for x in esteps]
  assert r0["engine_pushes"] == r1["engine_pushes"] == 2 and r0["engine_params"] == r1["engine_params"]
  assert r0["engine_same"] and r1["engine_same"]
  ewant = [x for x in esteps if x["step"] == 2][0]
  ehave = [x for x in r0["engine_resumed"] if "loss" in x][0]
  assert ehave["loss"] == ewant["loss"] and ehave["reward_mean"] == ewant["reward_mean"]
  # partial rollouts: every process runs its own row pool (its own group of each batch, its rows' tokens and
  # versions), the bookkeeping gathered: the same metrics on both, drops counted over both (the group aged on
  # process 0 alone), mu of each token its version's own log-prob
  p0, p1 = r0["partial"], r1["partial"]
  assert [timing(x) for x in p0["recs"]] == [timing(x) for x in p1["recs"]]
  assert [timing(x) for x in p0["resumed"]] == [timing(x) for x in p1["resumed"]]
  psteps = [x for x in p0["recs"] if "loss" in x]
  assert [x["step"] for x in psteps] == [1, 2, 3] and p0["seen"] == p1["seen"]
  assert p0["mu_err"] < 2e-5 and p1["mu_err"] < 2e-5, (p0["mu_err"], p1["mu_err"])
  assert p0["crossing"] + p1["crossing"] == sum(x["rollout/partial_rows"] for x in psteps) > 0  # rows crossed
  ledger, resumed = p0["ledger"], p0["resumed_ledger"]
  assert [x["prompts"] for x in ledger] == [b["prompts"] for b in p0["seen"]]
  assert len(p0["aged"]) == 1 and not p1["aged"]
  assert [x["dropped"] for x in ledger] == [[], [], p0["aged"]]
  assert [x["rollout/dropped_rows"] for x in psteps] == [0, 0, 4] and psteps[-1]["rollout/dropped_rows_total"] == 4
  # every prompt drawn (the data iterator's order, rebuilt here) is trained, dropped or recorded untrained, once
  # each: in the straight run, and in the run resumed from step 1's state (which recorded rows in flight)

  def settled_once(lines, before, position):
    settled = before + [p for x in lines for p in x["prompts"] + x["dropped"] + x.get("filtered", [])]
    pending = [p for rnd in position["untrained"] for p in rnd]
    assert len(set(settled)) == len(settled), settled
    assert sorted(settled + pending) == sorted(PromptIterator(64, seed=0).next(position["offset"]).tolist())
    return settled

  assert p0["final"] == p1["final"]  # one data position: every iterator caught up with the furthest
  settled_once(ledger, [], p0["final"])
  assert p0["position_1"]["untrained"] and p0["position_1"] == p1["position_1"]
  assert [x["step"] for x in resumed] == [2, 3] and p0["resumed_final"] == p1["resumed_final"]
  after = settled_once(resumed, ledger[0]["prompts"], p0["resumed_final"])
  # the resumed run's dynamic sampling: the filtered prompts (both processes', in the ledger) are settled above and
  # counted in the summed metric (which also counts groups filled in at the round limit)
  rsteps = [x for x in p0["resumed"] if "loss" in x]
  assert all(x["dynamic_sampling/dropped_groups"] >= len(line["filtered"]) for x, line in zip(rsteps, resumed))
  assert all(x["dynamic_sampling/kept_by_teacher"] == 0 and math.isfinite(x["distill/reverse_kl"]) for x in rsteps)
  assert sum(len(line["filtered"]) for line in resumed) > 0, resumed
  # environments with partial rollouts on two processes: each its own episode pool and groups, the same metrics
  # (the speculative ones too: each pool's counts combined over the processes)
  v0, v1 = r0["env_partial"], r1["env_partial"]
  assert v0["pool"] == v1["pool"] == "EpisodePool" and v0["policy"] == v1["policy"] == [True, True]
  assert [timing(x) for x in v0["recs"]] == [timing(x) for x in v1["recs"]]
  vsteps = [x for x in v0["recs"] if "loss" in x]
  assert [x["step"] for x in vsteps] == [1, 2] and all(x["grad_norm"] > 0 and x["env/turns"] >= 1 for x in vsteps)
  assert all(x["rollout/speculative_on"] == 1.0 and 0 <= x["rollout/spec_acceptance"] <= 1 for x in vsteps), vsteps
  assert v0["groups"] == [[0] * 4] * 2 and v1["groups"] == [[1] * 4] * 2
  assert set(p0["position_1"]["untrained"][0]) <= set(after[2:])  # drawn again first, then settled
  # rollout.speculative on two processes (issue 51.3; with environments refused before, and a draft model failed
  # on a mesh of other devices): multi-turn, the turns' collective rounds speculate by prompt lookup; single-turn,
  # with a draft model replicated on the mesh. Each `auto` made one decision on both processes, from the agreed
  # numbers it logged, applied in step 3; every sampled token's recorded log-prob is a teacher-forced pass's of the
  # parameters that sampled it
  for s0, s1, drafter in ((r0["spec"], r1["spec"], "ngram"), (r0["spec"]["single"], r1["spec"]["single"], "draft")):
    assert [timing(x) for x in s0["recs"]] == [timing(x) for x in s1["recs"]]
    ssteps = [x for x in s0["recs"] if "loss" in x]
    assert [x["step"] for x in ssteps] == [1, 2, 3] and all(x["grad_norm"] > 0 for x in ssteps)
    m = s0["measured"]
    assert m == s1["measured"] and m["drafter"] == drafter
    assert [x["rollout/speculative_on"] for x in ssteps] == [0.0, 1.0, float(m["speculative_on"])]
    assert ssteps[1]["rollout/spec_acceptance"] == m["acceptance"] > 0
    assert len(s0["err"] + s1["err"]) == 6 and max(s0["err"] + s1["err"]) < 1e-5, (s0["err"], s1["err"])
    for s in (s0, s1):
      (line,) = s["log"]
      want = f"plain {m['plain_tokens_per_s']:.1f} tokens/s, {drafter} {m['speculative_tokens_per_s']:.1f} tokens/s"
      assert line.startswith("rollout.speculative auto: ") and want in line, (line, want)
