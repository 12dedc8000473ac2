"""float32 vs mixed precision (bf16 compute, float32 parameters and accumulation) on the peers' 20m workload.

    python scripts/bench_precision.py                     # 3 alternating rounds, the 20m workload
    python scripts/bench_precision.py --rounds 5
    python scripts/bench_precision.py --precision bf16    # one precision only (no ratios)

The workload of ``scripts/peers/worker_jaxgrpo.py`` (``common.WORKLOAD``, 20m: a random 20.5M-parameter Qwen3,
vocab 32000, hidden 384, 4 layers; 16 prompts × 8 samples × 128 new tokens, temperature 1, no EOS stop; grpo
with 2 micro-batches of 64 rows, β = 0.04, AdamW), built here from one seed in both precisions, so both
models hold the same float32 weights: ``fp32`` (``dtype=param_dtype=float32``, the benchmark's definition) and
``bf16`` (``dtype=bfloat16, param_dtype=float32``: jaxgrpo's mixed precision, what ``model.dtype: bfloat16``
with the default ``model.param_dtype: float32`` of a run config gives).

Every round runs one whole GRPO iteration (``jaxgrpo.loop.iteration.grpo_iteration``) per precision, the
order alternating from round to round, after one warm-up iteration each; the phases it times are reported:
the rollout (the sampler), the reference pass (with the host reward) and the train step. Medians over the
rounds and the median of the per-round ratios fp32 ÷ bf16 (the machine may be shared: quote the ratios).

Then the log-prob cost: one mixed-precision rollout's sampler log-probs against the float32 model's
recomputation of the same tokens (``completion_log_probs``), max and mean |Δ log p| over the sampled
tokens, beside the same figure for the float32 sampler (its own rounding only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
import _bench  # noqa: E402
import common  # noqa: E402

from jaxgrpo import models  # noqa: E402
from jaxgrpo.kernels.config import preset  # noqa: E402
from jaxgrpo.loop import iteration  # noqa: E402
from jaxgrpo.models import layers  # noqa: E402
from jaxgrpo.models.log_probs import completion_log_probs  # noqa: E402
from jaxgrpo.parallel import sharding as shd  # noqa: E402
from jaxgrpo.step import train  # noqa: E402

PRECISIONS = {"fp32": (jnp.float32, jnp.float32), "bf16": (jnp.bfloat16, jnp.float32)}
# diagnostic: mixed precision as before the native bf16 dot (``layers.mixed_on_cpu``, the name ``dense`` reads, False while this
# runner traces: f32-accumulated dots upcast to float32, projections bf16 x bf16 -> bf16)
VARIANTS = {**PRECISIONS, "bf16-upcast": PRECISIONS["bf16"]}
PHASES = ("rollout_s", "reference_s", "update_s", "iteration_s")


def build(precision: str, seed: int):
  """The workload's random Qwen3 in ``precision`` (same float32 weights for every precision)."""
  cfg = _bench.qwen3_config(common.MODEL, common.PROMPT_LEN + common.NEW_TOKENS)
  dtype, param_dtype = VARIANTS[precision]
  return models.build_model(cfg, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=param_dtype)


def reward(prompts, completions):
  return [common.reward_ids(c) for c in completions]


class Runner:
  """One precision's model, train step, reference and state, as ``worker_jaxgrpo.py`` builds them."""

  def __init__(self, precision: str, seed: int):
    self.precision = precision
    self.model = build(precision, seed)
    name, overrides = common.jaxgrpo_preset([])  # grpo, as the peers' jaxgrpo row
    opt = optax.adamw(common.LR)
    mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
    rows = common.PROMPTS * common.SAMPLES
    tc = train.TrainConfig(
      micro_batches=rows // common.MICRO, chunk_size=common.CHUNK, group_size=common.SAMPLES, entropy=False
    )
    graphdef, self.state, shardings = train.init_train_state(self.model, opt, mesh)
    self.step = train.make_train_step(
      graphdef, opt, preset(name, **overrides), mesh=mesh, shardings=shardings, train_config=tc
    )
    self.reference = iteration.make_reference(self.step, self.state.params)

  def traced(self, fn, *args):
    """``fn(*args)`` with this runner's dot choice in effect (``bf16-upcast``: the earlier code's)."""
    native = layers.mixed_on_cpu
    if self.precision == "bf16-upcast":
      layers.mixed_on_cpu = lambda *xs: False  # read when the programs are traced (the warm-up call)
    try:
      return fn(*args)
    finally:
      layers.mixed_on_cpu = native

  def iterate(self, prompts, pmask, key) -> dict:
    return self.traced(self._iterate, prompts, pmask, key)

  def _iterate(self, prompts, pmask, key) -> dict:
    t0 = time.perf_counter()
    out = iteration.grpo_iteration(
      self.step,
      self.state,
      prompts,
      pmask,
      key=key,
      reward_fn=reward,
      sampling=SAMPLING,
      reference=self.reference,
      buckets=None,
    )
    self.state = out.state
    m = out.metrics
    return {
      "rollout_s": m["rollout_s"],
      "reference_s": m["reward_s"] + m["reference_s"],
      "update_s": m["update_s"],
      "iteration_s": time.perf_counter() - t0,
    }


SAMPLING = iteration.SamplingConfig(
  num_samples=common.SAMPLES, max_new_tokens=common.NEW_TOKENS, top_p=1.0, top_k=0, pad_id=0
)


def logp_gap(sampler_model, fp32_model, prompts, pmask, key) -> tuple[float, float]:
  """max and mean |sampler log-probs − float32 recomputation| over the sampled tokens of one rollout."""
  r = iteration.sample(sampler_model, prompts, pmask, SAMPLING, key=key)
  want, _ = jax.jit(lambda m, a, b, c, d: completion_log_probs(m, a, b, c, d, chunk_size=common.CHUNK))(
    fp32_model, r.prompt_tokens, r.prompt_mask, r.completions, r.mask
  )
  mask = np.asarray(r.mask)
  d = np.abs(np.asarray(r.log_probs, np.float64) - np.asarray(want, np.float64))[mask]
  return float(d.max()), float(d.mean())


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument(
    "--precision",
    default="fp32,bf16",
    help="comma-separated, of fp32, bf16 and bf16-upcast (the mixed precision of the earlier code, diagnosis)",
  )
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  names = args.precision.split(",")
  for n in names:
    if n not in VARIANTS:
      raise SystemExit(f"--precision: {n!r} is not one of {sorted(VARIANTS)}")
  print(f"jax {jax.__version__}, {jax.default_backend()}; workload {common.WORKLOAD.name}: {common.MODEL}", flush=True)
  prompts = jnp.asarray(common.prompt_ids(), jnp.int32)
  pmask = jnp.ones(prompts.shape, bool)
  runners = {}
  for n in names:
    t0 = time.perf_counter()
    runners[n] = Runner(n, args.seed)
    runners[n].iterate(prompts, pmask, jax.random.key(1000))  # warm-up (compiles)
    print(f"{n}: warm-up iteration {time.perf_counter() - t0:.1f} s", flush=True)
  times = {n: {p: [] for p in PHASES} for n in names}
  for r in range(args.rounds):
    order = names[r % len(names) :] + names[: r % len(names)]
    for n in order:
      t = runners[n].iterate(prompts, pmask, jax.random.key(r))
      for p in PHASES:
        times[n][p].append(t[p])
      print(f"[round {r}] {n}: " + ", ".join(f"{p} {t[p]:.2f}" for p in PHASES), flush=True)
  print(
    f"\nmedians (and minima) over rounds, s; ratios {names[0]} / other: median of the per-round ratios (each round's "
    "values), and the ratio of the minima (the least-loaded repetition of each)"
  )
  for p in PHASES:
    cells = [f"{n} {statistics.median(times[n][p]):.2f} (min {min(times[n][p]):.2f})" for n in names]
    for n in names[1:]:
      ratios = [a / b for a, b in zip(times[names[0]][p], times[n][p])]
      cells.append(
        f"{names[0]}/{n} {statistics.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)}; minima "
        f"{min(times[names[0]][p]) / min(times[n][p]):.2f}x)"
      )
    print(f"  {p:12s} " + "; ".join(cells))
  fp32_model = runners["fp32"].model if "fp32" in runners else build("fp32", args.seed)
  for n in names:
    mx, mean = runners[n].traced(logp_gap, runners[n].model, fp32_model, prompts, pmask, jax.random.key(7))
    print(f"{n} sampler log-probs vs the float32 recomputation: max |dlogp| {mx:.3g}, mean {mean:.3g}")


if __name__ == "__main__":
  main()
