"""jaxgrpo side of the peer benchmark (one process = one measurement; see bench_peers.py).

    python scripts/peers/worker_jaxgrpo.py MODEL_DIR sample|iter REPEATS

sample: `jaxgrpo.sampling.generate` (16 prompts × 8 samples × 128 tokens, temperature 1, no EOS
stop), one warm-up (compile) then REPEATS timed calls.
iter: one full GRPO iteration = rollout (as above) + reward (host) + reference log-probs (β=0.04)
+ one AdamW update of the jitted train step (preset grpo with seq-mean-token-mean aggregation as
Tunix's default and TRL's loss_type="grpo", k3 KL, 2 micro-batches of 64 rows); one warm-up
iteration then REPEATS timed ones. The library has no public "one iteration" API outside the
trainer's data pipeline, so this composes `sampling.generate` + `train.make_reference_fn` +
`train.make_train_step` exactly as `jaxgrpo.trainer` does.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxgrpo import models, train  # noqa: E402
from jaxgrpo import sharding as shd
from jaxgrpo.config import preset  # noqa: E402
from jaxgrpo.sampling import generate  # noqa: E402


def main():
  model_dir, task, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
  t0 = time.perf_counter()
  model = models.load_hf(model_dir)
  load_s = time.perf_counter() - t0
  prompts = jnp.asarray(common.prompt_ids(), jnp.int32)
  pmask = jnp.ones(prompts.shape, bool)
  n_tokens = common.PROMPTS * common.SAMPLES * common.NEW_TOKENS

  def rollout(m, key):
    return generate(
      m,
      prompts,
      pmask,
      num_samples=common.SAMPLES,
      max_new_tokens=common.NEW_TOKENS,
      temperature=1.0,
      top_p=1.0,
      top_k=0,
      eos_ids=(),
      pad_id=0,
      key=key,
    )

  res = {"impl": "jaxgrpo", "task": task, "load_s": load_s, "jax": jax.__version__}
  if task == "sample":
    t0 = time.perf_counter()
    jax.block_until_ready(rollout(model, jax.random.key(0)))
    res["warmup_s"] = time.perf_counter() - t0
    times = []
    for r in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(rollout(model, jax.random.key(r + 1)))
      times.append(time.perf_counter() - t0)
    res.update(times=times, tokens=n_tokens)
  else:
    config = preset("grpo", aggregation="seq-mean-token-mean", beta=common.BETA)
    mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
    opt = optax.adamw(common.LR)
    rows = common.PROMPTS * common.SAMPLES
    tc = train.TrainConfig(
      micro_batches=rows // common.MICRO, chunk_size=common.CHUNK, group_size=common.SAMPLES, entropy=False
    )
    graphdef, state, shardings = train.init_train_state(model, opt, mesh)
    step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc)
    ref_fn = train.make_reference_fn(graphdef, mesh=mesh, param_shardings=shardings.params, train_config=tc)
    ref_params = train.init_train_state(model, optax.identity(), mesh)[1].params
    del model

    def iteration(state, key):
      t0 = time.perf_counter()
      ro = jax.block_until_ready(rollout(nnx.merge(graphdef, state.params), key))
      t1 = time.perf_counter()
      comps, mask = np.asarray(ro.completions), np.asarray(ro.mask)
      rewards = np.array([common.reward_ids(c[m]) for c, m in zip(comps, mask)], np.float32)
      batch = shd.place_batch(train.Batch.from_rollout(ro, rewards), mesh)
      batch = batch._replace(ref_logp=jax.block_until_ready(ref_fn(ref_params, batch)))
      t_ref = time.perf_counter()
      state, metrics = step(state, batch)
      jax.block_until_ready(state)
      t2 = time.perf_counter()
      return state, (t2 - t0, t1 - t0, t2 - t1, t_ref - t1, float(metrics["loss"]))

    state, (w, *_) = iteration(state, jax.random.key(0))
    res["warmup_s"] = w
    times, roll, upd, refs = [], [], [], []
    for r in range(repeats):
      state, (t, tr, tu, tf, loss) = iteration(state, jax.random.key(r + 1))
      times.append(t)
      roll.append(tr)
      upd.append(tu)
      refs.append(tf)
    res.update(times=times, rollout_s=roll, update_s=upd, reward_and_ref_s=refs, tokens=n_tokens, loss=loss)
  common.report(res)


if __name__ == "__main__":
  main()
