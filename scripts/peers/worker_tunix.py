"""Tunix side of the peer benchmark (run with .peers/tunix/bin/python; see bench_peers.py).

    .peers/tunix/bin/python scripts/peers/worker_tunix.py MODEL_DIR sample|iter REPEATS

``PEERS_PRECISION=bf16``: Tunix's Qwen3 with ``dtype=bfloat16, param_dtype=float32`` (`DTYPES`).

The saved HF model of the workload (``PEERS_WORKLOAD``, shape ``common.MODEL``) is loaded with
Tunix's Qwen3 safetensors loader (`tunix.models.qwen3.params.create_model_from_safe_tensors`) on a
1×1 mesh whose axes are `AxisType.Auto` (Tunix's Qwen3 needs that). The word-level HF tokenizer is
passed as is.

sample: Tunix's vanilla `Sampler` on the PROMPTS prompts each repeated SAMPLES times (16 × 8 = 128
rows in the 20m workload; Tunix has no shared-prefill group sampling), NEW_TOKENS steps, temperature
1.0 with `top_p=1.0, top_k=None` (without them it decodes greedily); one warm-up then REPEATS timed
calls.
iter: `GRPOLearner.train` (rollout engine "vanilla", actor + a separate reference copy, β=0.04,
AdamW, one update per iteration, micro-batches of MICRO rows = MICRO / SAMPLES prompts, one rollout
of all rows) for 1 + REPEATS + 1 steps; iteration times are the intervals between the reward
function's calls (called once per iteration, after the rollout), so the first interval holds the
compile and is reported as warm-up.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402
import transformers  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

CACHE = (
  -(-(common.PROMPT_LEN + common.NEW_TOKENS) // 128) * 128
)  # KV-cache slots: prompt + completion, rounded up to 128


# PEERS_PRECISION (common.PRECISION): bf16 is Tunix's mixed precision, ModelConfig(dtype=bfloat16,
# param_dtype=float32): its einsums take bf16 operands (bf16 results), the parameters stay float32
DTYPES = {"fp32": {}, "bf16": dict(dtype=jax.numpy.bfloat16, param_dtype=jax.numpy.float32)}


def load(model_dir, mesh):
  from tunix.models.qwen3 import model as qwen3_model
  from tunix.models.qwen3 import params as qwen3_params

  m = common.MODEL
  cfg = qwen3_model.ModelConfig(
    num_layers=m.layers,
    vocab_size=m.vocab,
    embed_dim=m.hidden,
    hidden_dim=m.intermediate,
    num_heads=m.heads,
    head_dim=m.head_dim,
    num_kv_heads=m.kv_heads,
    rope_theta=1_000_000,
    norm_eps=1e-6,
    use_tied_embedding=True,
    **DTYPES[common.PRECISION],
  )
  with jax.set_mesh(mesh):
    return qwen3_params.create_model_from_safe_tensors(model_dir, cfg, mesh)


def nnx_state(model):
  from flax import nnx

  return nnx.state(model, nnx.Param)


def main():
  from importlib.metadata import version

  model_dir, task, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:1])
  t0 = time.perf_counter()
  model = load(model_dir, mesh)
  tok = transformers.AutoTokenizer.from_pretrained(model_dir)
  res = {
    "impl": "tunix",
    "task": task,
    "load_s": time.perf_counter() - t0,
    "tunix": version("google-tunix"),
    "jax": jax.__version__,
    "compute_dtype": str(jax.numpy.dtype(model.config.dtype)) if hasattr(model, "config") else None,
    "param_dtype": sorted({str(x.dtype) for x in jax.tree.leaves(nnx_state(model))}),
  }
  texts = common.prompt_texts()
  n_tokens = common.PROMPTS * common.SAMPLES * common.NEW_TOKENS
  if task == "sample":
    from tunix.generate import sampler as sampler_lib

    m = common.MODEL
    cache = sampler_lib.CacheConfig(cache_size=CACHE, num_layers=m.layers, num_kv_heads=m.kv_heads, head_dim=m.head_dim)
    sampler = sampler_lib.Sampler(transformer=model, tokenizer=tok, cache_config=cache)
    rows = [t for t in texts for _ in range(common.SAMPLES)]

    def run(seed):
      out = sampler(
        input_strings=rows,
        max_generation_steps=common.NEW_TOKENS,
        max_prompt_length=common.PROMPT_LEN,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        echo=False,
        seed=seed,
      )
      jax.block_until_ready(out.tokens) if hasattr(out, "tokens") else None
      return out

    with jax.set_mesh(mesh):
      t0 = time.perf_counter()
      out = run(0)
      res["warmup_s"] = time.perf_counter() - t0
      times = []
      for r in range(repeats):
        t0 = time.perf_counter()
        out = run(r + 1)
        times.append(time.perf_counter() - t0)
    generated = sum(len(t.split()) for t in out.text)
    res.update(times=times, tokens=n_tokens, generated_words_last=generated)
  else:
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    ref = load(model_dir, mesh)
    steps = repeats + 2
    training = rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optax.adamw(common.LR),
      eval_every_n_steps=10**6,
      max_steps=steps,
      mini_batch_size=common.PROMPTS,
      train_micro_batch_size=common.MICRO // common.SAMPLES,
      rollout_micro_batch_size=common.PROMPTS,
      compute_logps_micro_batch_size=common.MICRO // common.SAMPLES,
    )
    rollout = base_rollout.RolloutConfig(
      max_tokens_to_generate=common.NEW_TOKENS,
      max_prompt_length=common.PROMPT_LEN,
      kv_cache_size=CACHE,
      temperature=1.0,
      top_p=1.0,
      top_k=None,
    )
    roles = rl_cluster_lib.Role
    cluster = rl_cluster_lib.RLCluster(
      actor=model,
      reference=ref,
      tokenizer=tok,
      cluster_config=rl_cluster_lib.ClusterConfig(
        role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=training,
        rollout_config=rollout,
      ),
    )
    clock = common.RewardClock(lambda prompts, completions, **kw: [common.reward_text(c) for c in completions])
    algo = grpo_learner.GRPOConfig(num_generations=common.SAMPLES, num_iterations=1, beta=common.BETA, epsilon=0.2)
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, reward_fns=clock, algo_config=algo)
    ds = [{"prompts": texts} for _ in range(steps)]
    t0 = time.perf_counter()
    with mesh:  # the legacy context: Tunix's trainer reads pxla.thread_resources' physical mesh
      learner.train(ds)
    total = time.perf_counter() - t0
    iv = clock.intervals()
    res.update(
      warmup_s=(clock.stamps[0] - t0) + iv[0] if iv else total,
      times=iv[1:],
      tokens=n_tokens,
      total_s=total,
      reward_calls=len(clock.stamps),
    )
  common.report(res)


if __name__ == "__main__":
  main()
