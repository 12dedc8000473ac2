"""Tunix's advantages, KL and GRPO losses on the shared inputs (run inside .peers/tunix).

    .peers/tunix/bin/python scripts/peers/numbers_tunix.py .peers/out/inputs.npz .peers/out/tunix.npz

Advantages: the registered estimators `grpo`, `drgrpo`, `rloo` (`tunix.rl.algo_core`). KL:
`common.compute_kl_divergence` for each method. Loss: the registered policy loss `grpo_loss_fn`
with Tunix's own configs (`GRPOConfig`, `DAPOConfig`, `DrGRPOConfig`) for every aggregation mode;
its only model call, `common.compute_per_token_logps`, is replaced by a stub returning the shared
current-policy log-probs, and the old/reference log-probs and advantages go in through its
`TrainExample`. Gradients are taken with respect to those log-probs. Output keys:
`tunix/<quantity>/<variant>`.
"""

from __future__ import annotations

import dataclasses
import sys
from importlib.metadata import version

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  inp = dict(np.load(argv[0]))
  from tunix.rl import algo_core, common, function_registry
  from tunix.rl.grpo import dapo_learner, drgrpo_learner, grpo_learner

  g = int(inp["group_size"])
  out = {"versions/tunix": np.array(version("google-tunix")), "versions/tunix_jax": np.array(jax.__version__)}
  for name in ("grpo", "drgrpo", "rloo"):
    fn = function_registry.get_advantage_estimator(name)
    out[f"tunix/advantages/{name}"] = np.asarray(fn(rewards=inp["rewards"], num_generations=g))
  lp, rp = jnp.asarray(inp["logp"]), jnp.asarray(inp["ref_logp"])
  for method in ("kl", "mse_kl", "low_var_kl"):
    out[f"tunix/kl/{method}"] = np.asarray(common.compute_kl_divergence(lp, rp, method))

  class Dummy(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.zeros(()))

  b, t = inp["mask"].shape
  mask = jnp.asarray(inp["mask"], jnp.int32)

  def loss_of(config, logp):
    original = common.compute_per_token_logps
    common.compute_per_token_logps = lambda *a, **k: (logp, jnp.zeros((b, t, 4)))
    try:
      example = grpo_learner.TrainExample(
        prompt_ids=jnp.ones((b, 1), jnp.int32),
        prompt_mask=jnp.ones((b, 1), jnp.int32),
        completion_ids=jnp.ones((b, t), jnp.int32),
        completion_mask=mask,
        advantages=jnp.asarray(inp["advantages"]),
        ref_per_token_logps=rp,
        old_per_token_logps=jnp.asarray(inp["old_logp"]),
      )
      loss, _ = algo_core.grpo_loss_fn(Dummy(), example, config, pad_id=0, eos_id=1)
      return loss
    finally:
      common.compute_per_token_logps = original

  beta, eps, eps_high = float(inp["beta"]), float(inp["epsilon_low"]), float(inp["epsilon_high"])
  configs = {}
  for mode in (
    "token-mean",
    "sequence-mean-token-mean",
    "sequence-mean-token-scale",
    "seq-mean-token-sum",
    "sequence-mean-token-sum-norm",
  ):
    for kl_mode in ("kl", "low_var_kl"):
      configs[f"grpo/{mode}/{kl_mode}"] = grpo_learner.GRPOConfig(
        num_generations=g, beta=beta, epsilon=eps, loss_agg_mode=mode, kl_loss_mode=kl_mode
      )
  configs["dapo/token-mean/none"] = dapo_learner.DAPOConfig(num_generations=g, epsilon=eps, epsilon_high=eps_high)
  configs["drgrpo/sequence-mean-token-scale/kl"] = drgrpo_learner.DrGRPOConfig(
    num_generations=g, beta=beta, epsilon=eps
  )
  for key, config in configs.items():
    if not hasattr(config, "temperature"):
      object.__setattr__(config, "temperature", 1.0)
    loss, grad = jax.value_and_grad(lambda x, config=config: loss_of(config, x))(lp)
    out[f"tunix/loss/{key}"] = np.asarray(loss)
    out[f"tunix/grad/{key}"] = np.asarray(grad)
  out["tunix/defaults/GRPOConfig"] = np.array(
    repr({f.name: getattr(grpo_learner.GRPOConfig(), f.name) for f in dataclasses.fields(grpo_learner.GRPOConfig)})
  )
  np.savez(argv[1], **out)
  print(f"wrote {argv[1]}: {sorted(out)}")


if __name__ == "__main__":
  main()
