"""Asynchronous rollouts on this machine: measured phase and step times of the real trainer, and the
step times ``jaxgrpo.loop.pipeline_sim`` predicts from those phase times.

Five schedules of the same demo-sized run, each warmed up (``--warmup`` steps: compilation), then
timed in ``--rounds`` alternating rounds of ``--steps`` steps (the order rotated every round), on
``--cpu-devices`` virtual CPU devices (XLA_FLAGS, set before JAX is imported):

1. ``sync``: the trainer's synchronous loop (``rollout.max_staleness: 0``), colocated.
2. ``k0``: the pipeline at k = 0 (serial, the same computation): the phase times ``time/generate_s``,
   ``time/reference_s``, ``time/update_s``, ``async/weight_transfer_s``, nothing overlapping.
3. ``k1``: one-step-off, colocated (time-shared devices); ``async/old_logp_s``.
4. ``k0_disagg``: serial on disjoint meshes (``devices.rollout`` half, ``devices.train`` half): the
   phase times on those meshes, nothing overlapping.
5. ``k1_disagg``: one-step-off on the disjoint meshes.

The measured step is the wall time of a round divided by its steps (the pipeline's period; the
pipeline runs in the trainer's thread, so nothing of one schedule runs while another is timed). The
predictions are the model's, fed with the phase times measured without overlap (runs 2 and 4;
π_old recomputation from the last step of runs 3 and 5, where nothing else is produced). On a CPU the "disjoint"
virtual devices share the same cores, so overlap cannot make anything faster: the gap between
measured and predicted there is the cost of that sharing, not a property of the pipeline.

    python scripts/bench_async.py                    # ~4 min on 2 cores
    python scripts/bench_async.py --rounds 5 --json out.json

``--long-tail``: the partial-rollouts workload (issue 36.4). Completion lengths log-normal with the median at a
tenth of ``max_new_tokens`` (``--sigma``), imposed as row budgets in the row pool; a static batch (the sync and
one-step-off schedules' sampler) decodes until its longest row ends, which here is ``max_new_tokens`` (the
untrained model samples no EOS; with 64 rows the tail reaches it). Schedules: ``lt_k0`` (phase times),
``lt_sync``, ``lt_k1``; partial rollouts with twice B·G slots: ``lt_partial0`` / ``lt_partial0_refill`` (k = 1,
nothing ahead: sync + partial, and the pool's generation time alone), ``lt_partial`` / ``lt_partial_refill``
(k = 2, one batch ahead; ``refill: false`` / ``true``); ``lt_k1_disagg`` / ``lt_partial_refill_disagg`` on half
the devices each. Beside each, the phase model's step from the generation time measured alone and the learner
phases of ``lt_k0`` (π_old from ``lt_k1``).

    python scripts/bench_async.py --long-tail --cpu-devices 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def _devices_flag(argv) -> int:
  n = 2
  for i, tok in enumerate(argv):
    if tok == "--cpu-devices" and i + 1 < len(argv):
      n = int(argv[i + 1])
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()
  return n


if __name__ == "__main__":
  _devices_flag(sys.argv[1:])

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402

from jaxgrpo.loop import async_rollout
from jaxgrpo.loop.pipeline_sim import Phases, simulate  # noqa: E402
from jaxgrpo.run.specs import load_config  # noqa: E402
from jaxgrpo.run.trainer import Trainer  # noqa: E402

RUN = {
  "model.synthetic": {"hidden_size": 64, "num_layers": 2},
  "data.arithmetic": {"train_size": 256, "eval_size": 8, "sft_steps": 0},
  "data.max_prompt_tokens": 64,
  "rollout.group_size": 8,
  "rollout.prompts_per_step": 8,
  "rollout.max_new_tokens": 32,
  "objective.beta": 0.04,  # a reference pass
  "objective.importance_correction": "tis",
  "step.chunk_size": None,
  "optim.learning_rate": 1e-3,
  "reward.timeout_s": None,
  "eval.every": 0,
  "run.log_every": 1,
}


def varied_reward(prompts, completions, **_):
  """Rewards that differ within groups (the untrained model never boxes an answer): a real update."""
  return [float(sum(map(ord, c)) % 5) for c in completions]


MODES = ("sync", "k0", "k1", "k0_disagg", "k1_disagg")
KEYS = (
  "rollout_time",
  "time/generate_s",
  "time/reference_s",
  "time/update_s",
  "async/old_logp_s",
  "async/weight_transfer_s",
  "async/learner_idle_s",
  "async/producer_idle_s",
  "async/staleness_mean",
)


def build(mode: str, steps: int, out: str) -> Trainer:
  """The trainer of one schedule (``steps``: every step it will run, warm-up included)."""
  n = len(jax.devices())
  changes = {**RUN, "run.steps": steps, "run.out": os.path.join(out, mode), "devices.mesh": f"fsdp={n}"}
  if mode == "k1":
    changes["rollout.max_staleness"] = 1
  elif mode in ("k0_disagg", "k1_disagg"):
    changes.update(
      {
        "rollout.max_staleness": int(mode[1]),
        "devices.rollout": n // 2,
        "devices.train": n - n // 2,
        "devices.mesh": f"fsdp={n - n // 2}",
        "devices.rollout_mesh": f"fsdp={n // 2}",
      }
    )
  tr = Trainer(load_config(None, changes), reward_fns={"varied": (varied_reward, 1.0)}, log=None)
  if mode == "k0":
    tr.schedule = async_rollout.AsyncRollouts(tr.source, tr.learner, tr.state, max_staleness=0, steps=steps)
  return tr


def measure(steps: int, warmup: int, rounds: int, out: str) -> dict:
  """Every schedule warmed up, then ``rounds`` rounds of ``steps`` steps each, the schedules in a
  rotated order every round (machine noise hits them alike); medians over rounds of the wall time per
  step, medians over steps of the phase times."""
  trainers = {m: build(m, warmup + rounds * steps, out) for m in MODES}
  records = {m: [] for m in MODES}
  periods = {m: [] for m in MODES}
  try:
    for tr in trainers.values():
      for _ in range(warmup):
        tr.train_step()
    for r in range(rounds):
      order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
      for m in order:
        tr = trainers[m]
        t0 = time.perf_counter()
        records[m] += [tr.train_step() for _ in range(steps)]
        periods[m].append((time.perf_counter() - t0) / steps)
  finally:
    for tr in trainers.values():
      tr.schedule.close()
  result = {}
  for m in MODES:
    # a phase time is measured in the steps where nothing else overlaps it (k = 0, the last k steps)
    phases = {k: statistics.median([rec[k] for rec in records[m] if k in rec] or [0.0]) for k in KEYS}
    result[m] = {"period": statistics.median(periods[m]), "periods": periods[m], **phases}
  return result


def predictions(m: dict) -> dict:
  """The model's step times from the measured phase times."""
  k0, k1, dis, dis1 = m["k0"], m["k1"], m["k0_disagg"], m["k1_disagg"]
  colocated = Phases(
    generate=k0["time/generate_s"],
    reference=k0["time/reference_s"],
    update=k0["time/update_s"],
    old_logp=k1["async/old_logp_s"],
    transfer=k0["async/weight_transfer_s"],
  )
  disjoint = Phases(
    generate=dis["time/generate_s"],
    reference=dis["time/reference_s"],
    update=dis["time/update_s"],
    old_logp=dis1["async/old_logp_s"],
    transfer=dis["async/weight_transfer_s"],
  )
  sim = lambda ph, k, d: simulate(ph, steps=50, max_staleness=k, disaggregated=d).step_time
  return {
    "sync": sim(colocated, 0, False),
    "k1": sim(colocated, 1, False),
    "k0_disagg": sim(disjoint, 0, True),
    "k1_disagg": sim(disjoint, 1, True),
    "k2_disagg": sim(disjoint, 2, True),
  }


LT_MODES = (
  "lt_k0",
  "lt_sync",
  "lt_k1",
  "lt_partial0",
  "lt_partial0_refill",
  "lt_partial",
  "lt_partial_refill",
  "lt_k1_disagg",
  "lt_partial_refill_disagg",
)
LT_RUN = {"rollout.max_new_tokens": 64, "rollout.prompts_per_step": 8, "rollout.group_size": 8}


def lognormal_budget(t_max: int, sigma: float):
  """``budget_of(prompt, sample)``: round(exp(N(log(T/10), sigma))) clipped to [1, T], fixed per row."""

  def budget_of(prompt: int, sample: int) -> int:
    z = np.random.default_rng([prompt, sample]).normal()
    return int(np.clip(round(float(np.exp(np.log(t_max / 10) + sigma * z))), 1, t_max))

  return budget_of


def build_long_tail(mode: str, steps: int, out: str, sigma: float) -> Trainer:
  """The trainer of one long-tail schedule."""
  n = len(jax.devices())
  changes = {**RUN, **LT_RUN, "run.steps": steps, "run.out": os.path.join(out, mode), "devices.mesh": f"fsdp={n}"}
  rows = LT_RUN["rollout.prompts_per_step"] * LT_RUN["rollout.group_size"]
  if mode in ("lt_k1", "lt_k1_disagg"):
    changes["rollout.max_staleness"] = 1
  if mode.startswith("lt_partial"):  # lt_partial0*: nothing ahead (k = 1): the pool's generation time alone
    ahead = 0 if mode.startswith("lt_partial0") else 1
    changes["rollout.max_staleness"] = ahead + 1
    changes["rollout.partial"] = {"enabled": True, "slots": 2 * rows, "refill": "refill" in mode, "ahead": ahead}
  if mode.endswith("_disagg"):
    changes.update(
      {
        "devices.rollout": n // 2,
        "devices.train": n - n // 2,
        "devices.mesh": f"fsdp={n - n // 2}",
        "devices.rollout_mesh": f"fsdp={n // 2}",
      }
    )
  tr = Trainer(load_config(None, changes), reward_fns={"varied": (varied_reward, 1.0)}, log=None)
  if mode == "lt_k0":
    tr.schedule = async_rollout.AsyncRollouts(tr.source, tr.learner, tr.state, max_staleness=0, steps=steps)
  if mode.startswith("lt_partial"):
    tr.schedule.pool.budget_of = lognormal_budget(LT_RUN["rollout.max_new_tokens"], sigma)
  return tr


def long_tail(args) -> dict:
  """The long-tail table: measured step per schedule, and the model's prediction from the phase times."""
  steps = args.warmup + args.rounds * args.steps
  trainers = {m: build_long_tail(m, steps, args.out, args.sigma) for m in LT_MODES}
  records, periods = {m: [] for m in LT_MODES}, {m: [] for m in LT_MODES}
  try:
    for tr in trainers.values():
      for _ in range(args.warmup):
        tr.train_step()
    for r in range(args.rounds):
      for m in LT_MODES[r % len(LT_MODES) :] + LT_MODES[: r % len(LT_MODES)]:
        t0 = time.perf_counter()
        records[m] += [trainers[m].train_step() for _ in range(args.steps)]
        periods[m].append((time.perf_counter() - t0) / args.steps)
  finally:
    for tr in trainers.values():
      tr.schedule.close()
  med = lambda m, k: statistics.median([rec[k] for rec in records[m] if k in rec] or [0.0])
  gen = lambda m: med(m, "rollout_time")  # sampling + rewards of the step's batch (every schedule reports it)
  k0 = {k: med("lt_k0", k) for k in ("time/reference_s", "time/update_s", "async/weight_transfer_s")}
  old = med("lt_k1", "async/old_logp_s")

  def predict(m, k, disaggregated):
    ph = Phases(
      generate=gen(m),  # measured without overlap (lt_k0, lt_partial0*)
      reference=k0["time/reference_s"],
      update=k0["time/update_s"],
      old_logp=old if k else 0.0,
      transfer=k0["async/weight_transfer_s"],
    )
    return simulate(ph, steps=50, max_staleness=k, disaggregated=disaggregated).step_time

  # schedule: (its generation phase measured alone, batches ahead, disjoint pools); the disaggregated rows are
  # predicted from the colocated phase times (on real hardware each pool has its own devices)
  plan = {
    "lt_sync": ("lt_k0", 0, False),
    "lt_k1": ("lt_k0", 1, False),
    "lt_partial0": ("lt_partial0", 0, False),
    "lt_partial0_refill": ("lt_partial0_refill", 0, False),
    "lt_partial": ("lt_partial0", 1, False),
    "lt_partial_refill": ("lt_partial0_refill", 1, False),
    "lt_k1_disagg": ("lt_k0", 1, True),
    "lt_partial_refill_disagg": ("lt_partial0_refill", 1, True),
  }
  print("\n| schedule | measured step (s) | generate (s) | predicted step (s) | partial rows | dropped rows |")
  print("|---|---|---|---|---|---|")
  result = {}
  for m, (phase, k, d) in plan.items():
    result[m] = {
      "period": statistics.median(periods[m]),
      "generate_s": gen(m),
      "predicted": predict(phase, k, d),
      "partial_rows": med(m, "rollout/partial_rows"),
      "dropped_rows": sum(rec.get("rollout/dropped_rows", 0) for rec in records[m]),
    }
    x = result[m]
    print(
      f"| {m} | {x['period']:.3f} | {x['generate_s']:.3f} | {x['predicted']:.3f} | {x['partial_rows']:.0f} | "
      f"{x['dropped_rows']} |"
    )
  return result


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=4, help="steps per schedule and round")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--warmup", type=int, default=3, help="untimed steps of each schedule first (compilation)")
  p.add_argument("--cpu-devices", type=int, default=2, help="virtual CPU devices (set before JAX starts)")
  p.add_argument("--json", default=None, help="also write the results here")
  p.add_argument("--long-tail", action="store_true", help="the partial-rollouts long-tail table instead")
  p.add_argument("--sigma", type=float, default=1.0, help="--long-tail: log-normal sigma of the lengths")
  args = p.parse_args(argv)
  print(_bench.backend_line())
  if args.long_tail:
    with tempfile.TemporaryDirectory() as out:
      args.out = out
      result = long_tail(args)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return result
  with tempfile.TemporaryDirectory() as out:
    measured = measure(args.steps, args.warmup, args.rounds, out)
  for mode in MODES:
    print(mode, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in measured[mode].items()}))
  pred = predictions(measured)
  print("\n| schedule | measured step (s) | predicted step (s) |\n|---|---|---|")
  for mode in ("sync", "k1", "k0_disagg", "k1_disagg", "k2_disagg"):
    got = measured.get(mode, {}).get("period")
    print(f"| {mode} | {'—' if got is None else f'{got:.3f}'} | {pred[mode]:.3f} |")
  result = {"measured": measured, "predicted": pred, "devices": len(jax.devices())}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
