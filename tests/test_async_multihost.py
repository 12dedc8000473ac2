"""Asynchronous rollouts (``rollout.max_staleness: 1``) on two real processes (127.0.0.1, gloo CPU
collectives), against one process on the same global meshes.

1. Disaggregated (1 rollout + 1 train device per process: train mesh ``fsdp=2``, rollout mesh ``data=2``,
   so a version reaches the rollout devices shard by shard for replicated parameters and through the
   host for the fsdp-sharded ones) with dynamic sampling and a distillation teacher (each process scores
   its own rows of each produced round on the train mesh, the per-group signals gathered), 4 steps, ``Trainer.run()`` in each process; the same on one process with 4
   devices (2 + 2). Both processes log the same metrics bit for bit (timings aside) and the same
   ledger; the two-process run equals the one-process run: the same versions, prompts, rewards,
   completion lengths and dynamic-sampling decisions (the sampler is one program over the global
   rollout mesh), and — two shards per mesh — the same losses and parameters bit for bit. Processes
   that hold different states (step, key, data position) are refused at the start, on every process.
2. Colocated, ``scripts/train.py --processes 2``: both processes SIGKILLed (a lost node) once three
   steps are in the ledger, the same command again resumes from the last complete checkpoint; the
   trained prompts are the data iterator's sequence, each once, and the checkpoint recorded the
   batch produced ahead (``untrained``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time

import numpy as np
import pytest
from helpers import async_train_cmd, cli_env, finish_children, start_child

from jaxgrpo.data import PromptIterator
from jaxgrpo.loop import async_rollout
from jaxgrpo.services import checkpoint as ck
from jaxgrpo.services.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.slow, pytest.mark.subprocess]
TIMING = ("tokens_per_sec", "step_time", "rollout_time")

_WORKER = r"""
import json, sys
nproc, pid, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
from jaxgrpo.parallel import distributed
if nproc > 1:
  distributed.initialize(f"127.0.0.1:{port}", nproc, pid)
import jax, numpy as np
from test_trainer import tiny
from test_async_rollout import half_constant_reward
from jaxgrpo.run.trainer import Trainer
assert jax.process_count() == nproc and jax.device_count() == 4
cfg = tiny(**{"run.out": out, "run.steps": 4, "rollout.max_staleness": 1, "objective.dynamic_sampling": True,
              "rollout.dynamic_sampling_max_rounds": 3, "objective.importance_correction": "tis",
              "optim.learning_rate": 3e-2, "devices.rollout": 2, "devices.train": 2, "devices.mesh": "fsdp=2",
              "devices.rollout_mesh": "data=2", "devices.host_timeout_s": 60,
              # a distillation teacher scoring each produced round (each process its own rows, the per-group
              # signals gathered; issue 52); min_signal out of reach: the rewards keep the groups
              "objective.distill": {"teacher": "synthetic:48x2", "weight": 0.5, "clip": 5.0, "min_signal": 1e9}})
tr = Trainer(cfg, reward_fns={"r": (half_constant_reward, 1.0)}, log=None)
train_ids = {d.id for d in tr.mesh.devices.flat}
roll_ids = {d.id for d in tr.rollout_mesh.devices.flat}
assert len(train_ids) == len(roll_ids) == 2 and not train_ids & roll_ids
# every process holds one device of each mesh
assert {d.process_index for d in tr.mesh.devices.flat} == {d.process_index for d in tr.rollout_mesh.devices.flat}
if nproc > 1:  # fsdp-sharded parameters go through the host (replicated on data=2), replicated ones directly
  direct = tr.rollouts._transfer.direct
  assert any(direct) and not all(direct), direct
seen = []
tr.rollouts.observe = lambda b: seen.append({"versions": b.versions.tolist(), "prompts": b.prompts.tolist(),
                                             "rows": int(b.batch.completions.shape[0])})
recs = tr.run()
if nproc > 1:  # a resume that read different states on two processes is refused, on both
  from jaxgrpo.loop import async_rollout
  step, key, position = int(tr.state.train.step), tr.state.key, dict(tr.state.data_position)
  async_rollout._check_processes_agree(step, key, position)  # the run's own state: they agree
  try:
    async_rollout._check_processes_agree(step, key, {**position, "untrained": [[pid]]})
    raise AssertionError("different states were not refused")
  except RuntimeError as e:
    assert "start the rollouts from different states" in str(e), e
params = distributed.to_host(tr.state.train.params)
if pid == 0:
  np.savez(out + f"/params_{nproc}.npz", *[np.asarray(x) for x in jax.tree.leaves(params)])
with open(out + f"/recs_{nproc}_{pid}.json", "w") as f:
  json.dump({"recs": recs, "seen": seen}, f)
print("OK")
"""


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _strip(recs):
  return [
    {k: v for k, v in r.items() if k not in TIMING and not k.startswith("time/") and not k.endswith("_s")} for r in recs
  ]


def test_two_processes_disaggregated_k1_dynamic_sampling_equal_one(tmp_path):
  two, one = tmp_path / "two", tmp_path / "one"
  two.mkdir()
  one.mkdir()
  port = _free_port()
  procs = [start_child(_WORKER, devices=2, args=(2, i, port, two)) for i in range(2)]
  single = start_child(_WORKER, devices=4, args=(1, 0, 0, one))
  results = finish_children([*procs, single], timeout=400)
  assert all(r.startswith("OK") or "\nOK" in r for r in results), "\n=====\n".join(results)
  r0, r1 = (json.loads((two / f"recs_2_{i}.json").read_text()) for i in range(2))
  r = json.loads((one / "recs_1_0.json").read_text())
  # every process logs the same metrics and trains the same groups (each feeds its half of the rows)
  assert _strip(r0["recs"]) == _strip(r1["recs"])
  assert r0["seen"] == r1["seen"] and [b["rows"] for b in r0["seen"]] == [4] * 4
  assert [b["versions"] for b in r0["seen"]] == [[0, 0], [0, 0], [1, 1], [2, 2]]  # staleness 0, 1, 1, 1
  ledger = [json.loads(x) for x in open(two / async_rollout.LEDGER)]
  assert [{"versions": x["versions"], "prompts": x["prompts"]} for x in ledger] == [
    {"versions": b["versions"], "prompts": b["prompts"]} for b in r0["seen"]
  ]
  # two processes == one process: decisions exactly, float results within rounding
  assert [{**b, "rows": 0} for b in r0["seen"]] == [{**b, "rows": 0} for b in r["seen"]]
  a, b = ([x for x in _strip(rr["recs"]) if "loss" in x] for rr in (r0, r))
  assert [x["step"] for x in a] == [x["step"] for x in b] == [1, 2, 3, 4]
  assert sum(x["dynamic_sampling/dropped_groups"] for x in a) > 0  # refills happened
  assert all(x["dynamic_sampling/kept_by_teacher"] == 0 and np.isfinite(x["distill/reverse_kl"]) for x in a)
  # bit for bit: with two shards per mesh every cross-device reduction adds two partial sums, the same
  # two numbers in either process layout (a commutative float add); measured equal, not just close
  assert a == b
  pa, pb = np.load(two / "params_2.npz"), np.load(one / "params_1.npz")
  assert len(pa.files) == len(pb.files) > 0
  for k in pa.files:
    np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


MESH = {"devices.mesh": "data=2,fsdp=2", "devices.host_timeout_s": "10"}


def test_two_processes_killed_and_resumed_train_every_prompt_once(tmp_path):
  steps = 6  # 12 prompts of 24: no epoch boundary hides a skip
  env = cli_env(tmp_path / "cache")  # the tests' compile flags (helpers.TEST_XLA_FLAGS)
  out = tmp_path / "run"
  cmd = [*async_train_cmd(out, steps, **MESH), "--processes", "2", "--cpu-devices", "2"]
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
  ledger = out / async_rollout.LEDGER
  pids, lines = None, []
  deadline = time.time() + 300
  for line in proc.stdout:
    lines.append(line)
    if pids is None and (m := re.match(r"launch: 2 processes, coordinator \S+, pids \[(\d+), (\d+)\]", line)):
      pids = [int(m.group(1)), int(m.group(2))]
    if pids and ledger.exists() and len(ledger.read_text().splitlines()) >= 3 or time.time() > deadline:
      break
  assert pids and proc.poll() is None, "".join(lines)[-3000:]
  for pid in pids:  # a lost node: both processes at once
    os.kill(pid, signal.SIGKILL)
  proc.communicate(timeout=120)
  done = len(ledger.read_text().splitlines())
  assert 3 <= done < steps, done
  complete = ck.complete_steps(str(out / "checkpoints"), log=None)
  untrained = [ck.read_meta(str(out / "checkpoints" / str(s)))["data_position"].get("untrained") for s in complete]
  assert complete and all(u for u in untrained), (complete, untrained)  # each recorded the batch produced ahead
  r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
  assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
  assert re.search(r"resumed from checkpoint \S+ \(step %d\)" % complete[-1], r.stdout + r.stderr)
  trained = [p for line in open(ledger) for p in json.loads(line)["prompts"]]
  assert trained == PromptIterator(24, seed=0).next(2 * steps).tolist()  # nothing skipped or repeated, in order
  recs = [x for x in read_jsonl(str(out / "metrics.jsonl")) if "loss" in x]
  assert [x["step"] for x in recs] == list(range(1, steps + 1))
  assert [x["async/staleness_max"] for x in recs] == [
    0 if s in (1, complete[-1] + 1) else 1 for s in range(1, steps + 1)
  ]
