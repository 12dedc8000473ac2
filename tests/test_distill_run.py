"""On-policy distillation in a run (``objective.distill``, issue 52): a teacher loaded from the config (here the
arithmetic task's model of another size, ``synthetic:<hidden>x<layers>``) scores every batch on the learner
side; each composition cell trains two steps, logs the term (``distill/weight`` = w, ``distill/reverse_kl``
finite) and resumes exactly (the straight run's in-memory checkpoint of step 1, then step 2 again == the
straight step 2: parameters bit for bit, loss equal; with bounded staleness the same prompts in the same order).

- distillation alone: every reward weight 0, so the RL advantage is 0 and only the teacher's signal trains
  (grad_norm > 0 shows it does);
- GRPO + distillation; bounded staleness (async, k = 1); partial rollouts through an engine; an environment
  (observation tokens are not distilled: the step's policy mask, checked number for number in
  tests/test_distill.py::test_train_step_with_a_teacher); a top-k form (JSD over the teacher's top 8, its ids
  and log-probs carried in the batch; ``distill/topk_divergence`` logged).

The numbers of the term itself (the advantage, the update, the teacher's pass) are checked against NumPy in
tests/test_distill.py; this file checks that the pieces compose in the trainer.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_async_rollout import REWARDS
from test_compose import ASYNC, CELLS, DYNAMIC
from test_trainer import tiny
from test_trainer_env import ENV, _memory_checkpoints, _params, dataclass_replace

from jaxgrpo.loop import async_rollout
from jaxgrpo.run.trainer import Trainer

TEACHER = {"teacher": "synthetic:48x2", "weight": 0.5, "clip": 5.0}
RUN_CELLS = {
  "alone": ({"reward.weights": {"accuracy": 0.0}}, None),
  "grpo": ({}, REWARDS),
  "async": (ASYNC, REWARDS),
  "partial": (CELLS["engine-partial"], REWARDS),
  # another engine's partial pool selecting groups with the teacher's signal (each complete group scored once)
  "partial-dynamic": ({**CELLS["engine-partial"], **DYNAMIC}, REWARDS),
  "env": (ENV, None),
  # a top-k form: the teacher's top-8 per position carried in the batch, the JSD in the loss
  "topk": ({"objective.distill": {**TEACHER, "kind": "jsd", "top_k": 8, "beta": 0.5}}, REWARDS),
}


def _run_cell(tmp_path, changes, rewards):
  cfg = tiny(
    **{
      "objective.distill": TEACHER,
      **changes,
      "run.steps": 2,
      "run.out": str(tmp_path / "a"),
      "checkpoint.every": 1,
      "optim.learning_rate": 3e-2,
    }
  )
  saved, save, restore_from = _memory_checkpoints()
  straight = Trainer(cfg, checkpoint_fn=save, reward_fns=rewards, log=None)
  steps = [r for r in straight.run(handle_signals=False) if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2] and sorted(saved) == [1, 2]
  topk = changes.get("objective.distill", TEACHER).get("kind", "sampled") != "sampled"
  for r in steps:
    assert r["distill/weight"] == TEACHER["weight"] and np.isfinite(r["distill/reverse_kl"]), r
    assert r["grad_norm"] > 0, r
    assert ("distill/topk_divergence" in r) == topk and (not topk or r["distill/topk_divergence"] > 0), r
    assert ("dynamic_sampling/kept_by_teacher" in r) == changes.get("objective.dynamic_sampling", False), r
  resumed = Trainer(
    dataclass_replace(cfg, steps=2, out=tmp_path / "b"), restore_fn=restore_from(1), reward_fns=rewards, log=None
  )
  assert resumed.resumed and resumed.teacher is not None
  got = [r for r in resumed.run(handle_signals=False) if "loss" in r]
  assert [r["step"] for r in got] == [2]
  if "rollout.max_staleness" in changes:  # as tests/test_compose.py: the same prompts, once each, in order
    ledger = lambda run: [json.loads(x) for x in open(tmp_path / run / async_rollout.LEDGER)]
    assert [r["prompts"] for r in ledger("b")] == [r["prompts"] for r in ledger("a")][1:]
    return steps
  want, have = _params(straight), _params(resumed)
  for k in want:
    np.testing.assert_array_equal(have[k], want[k], err_msg=k)
  assert got[0]["loss"] == steps[1]["loss"] and got[0]["distill/reverse_kl"] == steps[1]["distill/reverse_kl"]
  return steps


def test_distillation_alone_trains_and_resumes_exactly(tmp_path):
  """Every reward weight 0: GRPO's advantages are 0, the teacher's term alone moves the policy."""
  steps = _run_cell(tmp_path, *RUN_CELLS["alone"])
  assert all(r["reward_mean"] == 0.0 for r in steps)


@pytest.mark.slow
@pytest.mark.parametrize("cell", [c for c in RUN_CELLS if c != "alone"])
def test_cell_with_a_teacher_trains_and_resumes_exactly(tmp_path, cell):
  _run_cell(tmp_path, *RUN_CELLS[cell])


def test_what_a_teacher_refuses_in_one_line(tmp_path):
  """No teacher, dynamic sampling with partial rollouts, a negative ``min_signal``, a teacher of another tokenizer,
  a teacher path that does not exist: one line each, before anything heavy (dynamic sampling itself composes:
  tests/test_distill_dynamic.py)."""
  from jaxgrpo.run import teacher as teacher_lib

  for distill, more, match in [
    ({"weight": 1.0}, {}, "needs `teacher`"),
    ({**TEACHER, "min_signal": -1.0}, {}, "distill.min_signal"),
    ({**TEACHER, "teacher": "http://127.0.0.1:8470"}, {"devices.teacher": 1}, "is served outside the run's JAX"),
    ({**TEACHER, "teacher": "vllm:synthetic:48x2"}, {"devices.teacher": 1}, "unset devices.teacher$"),
    ({**TEACHER, "kind": "kl"}, {}, "distill.kind"),
    ({**TEACHER, "beta": 2.0}, {}, "distill.beta"),
  ]:
    with pytest.raises(ValueError, match=match):
      tiny(**{"objective.distill": distill, **more})
  packed = tiny(**{"objective.distill": {**TEACHER, "kind": "jsd"}, "step.packing": 128})  # composes with packing
  assert packed.step.packing == 128
  for agg in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):  # a top-k kind with any aggregation composes
    assert (
      tiny(**{"objective.distill": {**TEACHER, "kind": "jsd"}, "objective.aggregation": agg}).objective.aggregation
      == agg
    )
  with pytest.raises(ValueError, match="does not exist"):
    Trainer(tiny(**{"objective.distill": {**TEACHER, "teacher": str(tmp_path / "nowhere")}}), log=None)
  with pytest.raises(ValueError, match="synthetic:<hidden_size>x<num_layers>"):
    teacher_lib.teacher_source("synthetic:48")

  class Other:  # a tokenizer with one entry renumbered
    def __init__(self, vocab):
      self.vocab = vocab

    def get_vocab(self):
      return self.vocab

  mine = {"a": 0, "b": 1, "c": 2}
  teacher_lib.check_tokenizers(Other(mine), Other(dict(mine)), "t")
  with pytest.raises(ValueError, match=r"its tokenizer differs from the policy's \(3 vs 3 entries, 2 differing"):
    teacher_lib.check_tokenizers(Other(mine), Other({**mine, "c": 5}), "t")


_WORKER = r"""
import dataclasses, json, sys
nproc, pid, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
from jaxgrpo.parallel import distributed
distributed.initialize(f"127.0.0.1:{port}", nproc, pid)
import jax, jax.numpy as jnp, numpy as np
from test_async_rollout import REWARDS
from test_distill_run import TEACHER
from test_trainer import tiny
from jaxgrpo.run.trainer import Trainer
assert jax.process_count() == nproc
cfg = tiny(**{"objective.distill": TEACHER, "run.out": out, "run.steps": 2, "checkpoint.every": 1,
              "optim.learning_rate": 3e-2, "devices.mesh": "data=2,fsdp=2", "devices.host_timeout_s": 120})
saved = {}
save = lambda snap, meta: saved.__setitem__(int(snap.step), jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, snap))
tr = Trainer(cfg, checkpoint_fn=save, reward_fns=REWARDS, log=None)
recs = tr.run(handle_signals=False)
gather = lambda t: [np.asarray(jax.experimental.multihost_utils.process_allgather(x, tiled=True)) for x in jax.tree.leaves(t.state.train.params)]
params = gather(tr)
res = Trainer(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out=out + "/b")),
              restore_fn=lambda meta, template: saved[1], reward_fns=REWARDS, log=None)
got = res.run(handle_signals=False)
same = all(np.array_equal(a, b) for a, b in zip(params, gather(res)))
with open(f"{out}/recs_{pid}_of_{nproc}.json", "w") as f:
  json.dump({"recs": recs, "resumed": got, "same": same, "params": [float(np.abs(p).sum()) for p in params]}, f)
print("OK")
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_two_processes_with_a_teacher_equal_one_and_resume_exactly(tmp_path):
  """Two real processes (127.0.0.1, 2 CPU devices each, mesh ``data=2,fsdp=2``): the teacher is placed on the
  global train mesh like the policy and scores the global batch; both processes log the same metrics, the run
  resumed from step 1 equals step 2 bit for bit, and the two-process run equals one process of 4 devices with
  the same mesh (the distillation term's numbers, the loss and the parameters)."""
  from helpers import finish_children, start_child
  from test_compose_multihost import _free_port

  port = _free_port()
  (tmp_path / "one").mkdir()
  procs = [start_child(_WORKER, devices=2, args=(2, i, port, tmp_path)) for i in range(2)]
  procs.append(start_child(_WORKER, devices=4, args=(1, 0, _free_port(), tmp_path / "one")))
  results = finish_children(procs, timeout=500)
  assert all("OK" in r for r in results), "\n=====\n".join(results)
  r0, r1 = (json.loads((tmp_path / f"recs_{i}_of_2.json").read_text()) for i in range(2))
  one = json.loads((tmp_path / "one" / "recs_0_of_1.json").read_text())
  timing = lambda r: {
    k: v for k, v in r.items() if not (k.endswith("_s") or k in ("tokens_per_sec", "step_time", "rollout_time"))
  }
  assert [timing(x) for x in r0["recs"]] == [timing(x) for x in r1["recs"]]
  steps = [x for x in r0["recs"] if "loss" in x]
  assert [x["step"] for x in steps] == [1, 2] and all(x["distill/weight"] == TEACHER["weight"] for x in steps)
  assert r0["same"] and r1["same"], "the resumed run's parameters differ from the straight run's"
  have = [x for x in r0["resumed"] if "loss" in x][0]
  assert have["loss"] == steps[1]["loss"] and have["distill/reverse_kl"] == steps[1]["distill/reverse_kl"]
  single = [x for x in one["recs"] if "loss" in x]
  for a, b in zip(steps, single):
    for k in ("loss", "distill/reverse_kl", "reward_mean", "grad_norm"):
      assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (k, a[k], b[k])
  np.testing.assert_allclose(r0["params"], one["params"], rtol=1e-5)


def test_a_run_directory_and_an_hf_directory_as_the_teacher(tmp_path):
  """A teacher trained by ``scripts/train.py`` (one step of a larger model, checkpointed) named by its run
  directory, and the same weights exported as an HF directory (``save_hf`` + the tokenizer): each is recognised,
  loaded with exactly the checkpoint's parameters, placed, and a student trains a step with it."""
  import dataclasses

  import jax
  import yaml
  from flax import nnx
  from helpers import train_main_here

  from jaxgrpo import models
  from jaxgrpo.run import builders
  from jaxgrpo.run import teacher as teacher_lib

  teacher_cfg = tiny(**{"model.synthetic": {"hidden_size": 48, "num_layers": 2}, "run.steps": 1, "checkpoint.every": 1})
  teacher_cfg = dataclasses.replace(teacher_cfg, run=dataclasses.replace(teacher_cfg.run, out=str(tmp_path / "t")))
  (tmp_path / "t.yaml").write_text(yaml.safe_dump(teacher_cfg.to_dict()))
  train_main_here(["--config", str(tmp_path / "t.yaml"), "--no-progress"])
  model, tokenizer, _ = builders.load_policy(str(tmp_path / "t"))
  models.save_hf(model, tmp_path / "hf")
  tokenizer.save_pretrained(str(tmp_path / "hf"))
  want = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]
  for path, kind in [(tmp_path / "t", "run"), (tmp_path / "hf", "hf")]:
    assert teacher_lib.teacher_source(str(path)) == kind
    cfg = tiny(**{"objective.distill": {**TEACHER, "teacher": str(path)}, "reward.weights": {"accuracy": 0.0}})
    tr = Trainer(dataclass_replace(cfg, steps=1, out=tmp_path / f"s_{kind}"), log=None)
    got = [np.asarray(x) for x in jax.tree.leaves(tr.teacher.params)]
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    steps = [r for r in tr.run(handle_signals=False) if "loss" in r]
    assert steps[0]["grad_norm"] > 0 and np.isfinite(steps[0]["distill/reverse_kl"])
