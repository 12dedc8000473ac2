"""jaxgrpo side of the peer benchmark (one process = one measurement; see bench_peers.py).

    python scripts/peers/worker_jaxgrpo.py MODEL_DIR sample|iter REPEATS [grpo|lambda_grpo|frpo]

``PEERS_PRECISION=bf16`` loads the model in mixed precision (bf16 compute, float32 parameters; `DTYPES`).

sample: `jaxgrpo.rollout.sampling.generate` (16 prompts × 8 samples × 128 tokens, temperature 1, no EOS
stop), one warm-up (compile) then REPEATS timed calls.
iter: one full GRPO iteration = rollout (as above) + reward (host) + reference log-probs (β=0.04)
+ one AdamW update of the jitted train step (the preset of the 4th argument, default grpo, with
seq-mean-token-mean aggregation as Tunix's default and TRL's loss_type="grpo", k3 KL, 2 micro-batches
of 64 rows; `common.jaxgrpo_preset` records it in the RESULT); the head's logits kept for the backward
pass (``TrainConfig.head_logits``, ``PEERS_HEAD_LOGITS``: ``keep``, the default here, or ``recompute``, the
library's default; recorded in the RESULT); one warm-up iteration then REPEATS timed ones. The iteration is
the library's public one, `jaxgrpo.loop.iteration.grpo_iteration` (no bucketing: the completions keep their 128 columns).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from jaxgrpo import models
from jaxgrpo.kernels.config import preset  # noqa: E402
from jaxgrpo.loop import iteration
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.step import train

# PEERS_PRECISION (common.PRECISION): bf16 is jaxgrpo's mixed precision, bf16 compute over float32 parameters
# (float32 accumulation in the head and in every `dense` product on the CPU, float32 AdamW state)
DTYPES = {"fp32": {}, "bf16": dict(dtype=jnp.bfloat16, param_dtype=jnp.float32)}
SAMPLING = iteration.SamplingConfig(
  num_samples=common.SAMPLES, max_new_tokens=common.NEW_TOKENS, top_p=1.0, top_k=0, pad_id=0
)


def even_token_fraction(prompts, completions):
  """The shared host-side reward on token ids (``common.reward_ids``), one per row."""
  return [common.reward_ids(c) for c in completions]


def main():
  model_dir, task, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
  t0 = time.perf_counter()
  model = models.load_hf(model_dir, **DTYPES[common.PRECISION])
  load_s = time.perf_counter() - t0
  prompts = jnp.asarray(common.prompt_ids(), jnp.int32)
  pmask = jnp.ones(prompts.shape, bool)
  n_tokens = common.PROMPTS * common.SAMPLES * common.NEW_TOKENS

  res = {"impl": "jaxgrpo", "task": task, "load_s": load_s, "jax": jax.__version__}
  res["compute_dtype"], res["param_dtype"] = str(jnp.dtype(model.dtype)), str(model.embed_tokens[...].dtype)
  if task == "sample":
    t0 = time.perf_counter()
    jax.block_until_ready(iteration.sample(model, prompts, pmask, SAMPLING, key=jax.random.key(0)))
    res["warmup_s"] = time.perf_counter() - t0
    times = []
    for r in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(iteration.sample(model, prompts, pmask, SAMPLING, key=jax.random.key(r + 1)))
      times.append(time.perf_counter() - t0)
    res.update(times=times, tokens=n_tokens)
  else:
    name, overrides = common.jaxgrpo_preset()
    config = preset(name, **overrides)
    mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
    opt = optax.adamw(common.LR)
    rows = common.PROMPTS * common.SAMPLES
    res["head_logits"] = os.environ.get("PEERS_HEAD_LOGITS", "keep")
    tc = train.TrainConfig(
      micro_batches=rows // common.MICRO,
      chunk_size=common.CHUNK,
      group_size=common.SAMPLES,
      entropy=False,
      head_logits=res["head_logits"],
    )
    graphdef, state, shardings = train.init_train_state(model, opt, mesh)
    step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc)
    reference = iteration.make_reference(step, state.params)
    del model

    def one(state, key):
      t0 = time.perf_counter()
      out = iteration.grpo_iteration(
        step,
        state,
        prompts,
        pmask,
        key=key,
        reward_fn=even_token_fraction,
        sampling=SAMPLING,
        reference=reference,
        buckets=None,
      )
      return out.state, time.perf_counter() - t0, out.metrics

    state, w, _ = one(state, jax.random.key(0))
    res["warmup_s"] = w
    times, roll, upd, refs = [], [], [], []
    for r in range(repeats):
      state, t, m = one(state, jax.random.key(r + 1))
      times.append(t)
      roll.append(m["rollout_s"])
      upd.append(m["reward_s"] + m["reference_s"] + m["update_s"])  # everything after the rollout
      refs.append(m["reward_s"] + m["reference_s"])
      loss = m["loss"]
    res.update(times=times, rollout_s=roll, update_s=upd, reward_and_ref_s=refs, tokens=n_tokens, loss=loss)
  common.report(res)


if __name__ == "__main__":
  main()
