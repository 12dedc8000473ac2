"""Compare jaxgrpo's advantages, KL terms, losses and loss gradients with the peers' outputs.

    python scripts/peers/compare.py .peers/out      # reads inputs.npz, trl.npz, verl.npz, tunix.npz

Run in jaxgrpo's own environment after `numbers_trl.py`, `numbers_verl.py` and `numbers_tunix.py` (see
`scripts/peers/run_all.sh`). Prints one markdown table: for each matching pair (our function
and settings ↔ the peer's mode), the largest absolute difference over all rows/tokens, and a
verdict: `equal` (≤ 2e-6 relative to the magnitude), or `differs` with the reason. Also prints
the case showing that a k1 KL *loss term* (Tunix's default `kl_loss_mode="kl"`) has zero expected
gradient.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxgrpo as jg

TOL = 2e-6


def ours(inp):
  """Our numbers, keyed like the peers' outputs (value, and a function of logp for gradients)."""
  b, t = inp["mask"].shape
  g = int(inp["group_size"])
  ng = b // g
  r, gid, mask = jnp.asarray(inp["rewards"]), jnp.asarray(inp["group_ids"]), jnp.asarray(inp["mask"])
  olp, rp = jnp.asarray(inp["old_logp"]), jnp.asarray(inp["ref_logp"])
  adv = jnp.asarray(inp["advantages"])
  beta, lo, hi = float(inp["beta"]), float(inp["epsilon_low"]), float(inp["epsilon_high"])
  o = {}
  for ddof in (0, 1):
    for eps in (1e-4, 1e-6):
      o[f"adv/group/ddof={ddof}/eps={eps:g}"] = jg.group_advantages(r, gid, ng, ddof=ddof, eps=eps)
      o[f"adv/batch/ddof={ddof}/eps={eps:g}"] = jg.group_advantages(r, gid, ng, scale="batch", ddof=ddof, eps=eps)
  o["adv/none"] = jg.group_advantages(r, gid, ng, scale="none")
  o["adv/rloo"] = jg.rloo_advantages(r, gid, ng)
  lp = jnp.asarray(inp["logp"])
  for kind in ("k1", "k2", "k3"):
    o[f"kl/{kind}"] = jg.kl_penalty(lp, rp, kind)

  def loss_fn(aggregation, kind, lo_, hi_, dual=None, beta_=beta):
    def f(x):
      kl = None if kind is None else jg.kl_penalty(x, rp, kind)
      hyper = jg.GRPOHyper(
        clip_eps_low=lo_, clip_eps_high=hi_, dual_clip=dual, aggregation=aggregation, beta=beta_ if kind else 0.0
      )
      return jg.policy_loss(x, olp, adv, mask, hyper, kl=kl)[0]

    return f

  losses = {
    "loss/token-mean/k3/0.2-0.28": loss_fn("token-mean", "k3", lo, hi),
    "loss/seq-mean-token-mean/k3/0.2-0.28": loss_fn("seq-mean-token-mean", "k3", lo, hi),
    "loss/seq-mean-token-sum-norm/k3/0.2-0.28": loss_fn("seq-mean-token-sum-norm", "k3", lo, hi),
    "loss/token-mean/none/0.2-0.28": loss_fn("token-mean", None, lo, hi),
    "loss/token-mean/k3/0.2-0.28/dual3": loss_fn("token-mean", "k3", lo, hi, 3.0),
    "loss/seq-mean-token-mean/k3/0.2-0.28/dual3": loss_fn("seq-mean-token-mean", "k3", lo, hi, 3.0),
    "loss/seq-mean-token-sum-norm/k3/0.2-0.28/dual3": loss_fn("seq-mean-token-sum-norm", "k3", lo, hi, 3.0),
  }
  for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
    for kind in ("k1", "k3"):
      losses[f"loss/{agg}/{kind}/0.2-0.2"] = loss_fn(agg, kind, lo, lo)
  for k, f in losses.items():
    v, gr = jax.value_and_grad(f)(lp)
    o[k], o["grad/" + k[5:]] = v, gr
  # no jaxgrpo mode: Tunix's "sequence-mean-token-sum-norm" = Σ l·m / rows = our token-mean × (Σm / rows)
  rows_scale = float(np.sum(inp["mask"])) / b
  for kind in ("k1", "k3"):
    o[f"loss/token-mean×tokens/rows/{kind}/0.2-0.2"] = o[f"loss/token-mean/{kind}/0.2-0.2"] * rows_scale
  o.update(ours_new_losses(inp))
  return {k: np.asarray(v) for k, v in o.items()}


def ours_new_losses(inp):
  """GSPO, GSPO-token, CISPO, SAPO, GMPO, the entropy bonus and TIS/MIS (issue 15), keyed
  ``loss/<surrogate>/<aggregation>/<variant>``, with ``grad/...`` (w.r.t. logp) and ``grad_entropy/...``."""
  mask = jnp.asarray(inp["mask"])
  olp, rp, blp = (jnp.asarray(inp[k]) for k in ("old_logp", "ref_logp", "behavior_logp"))
  adv, tok_adv = jnp.asarray(inp["advantages"]), jnp.asarray(inp["token_advantages"])
  beta, lo, hi = float(inp["beta"]), float(inp["epsilon_low"]), float(inp["epsilon_high"])
  cap, coef = float(inp["is_cap"]), float(inp["entropy_coef"])
  lp, ent = jnp.asarray(inp["logp"]), jnp.asarray(inp["entropy"])
  o = {}
  for kind in ("tis", "mis"):
    for level in ("token", "sequence"):
      w = jg.importance_weights(olp, blp, mask, correction=kind, level=level, cap=cap)
      o[f"is/{kind}/{level}"] = w.weights
  o["mismatch_kl"] = jnp.sum(w.mismatch_kl) / jnp.sum(mask)

  def run(key, loss, aggregation, lo_, hi_, *, kl=True, dual=None, a=adv, imp=None, entropy=False):
    importance = None
    if imp is not None:
      importance = jg.importance_weights(olp, blp, mask, correction=imp[0], level=imp[1], cap=cap)

    def f(x, h):
      hyper = jg.GRPOHyper(
        loss=loss,
        clip_eps_low=lo_,
        clip_eps_high=hi_,
        dual_clip=dual,
        aggregation=aggregation,
        beta=beta if kl else 0.0,
        entropy_coef=coef if entropy else 0.0,
      )
      return jg.policy_loss(
        x,
        olp,
        a,
        mask,
        hyper,
        kl=jg.kl_penalty(x, rp, "k3") if kl else None,
        importance=importance,
        entropy=h if entropy else None,
      )[0]

    v, (g, gh) = jax.value_and_grad(f, argnums=(0, 1))(lp, ent)
    o[f"loss/{key}"], o[f"grad/{key}"] = v, g
    if entropy:
      o[f"grad_entropy/{key}"] = gh

  sm, tm = "seq-mean-token-mean", "token-mean"
  for agg in (tm, sm):
    run(f"gspo/{agg}/k3/0.2-0.28", "gspo", agg, lo, hi)
    run(f"gspo_token/{agg}/k3/0.2-0.28", "gspo_token", agg, lo, hi)
    run(f"gspo_token/{agg}/k3/0.2-0.28/token_advantages", "gspo_token", agg, lo, hi, a=tok_adv)
    run(f"cispo/{agg}/k3/0.2-0.28", "cispo", agg, lo, hi)
    run(f"cispo/{agg}/k3/0.2-0.28/token_advantages", "cispo", agg, lo, hi, a=tok_adv)
  run("gspo/seq-mean-token-mean/k3/3e-4-4e-4", "gspo", sm, 3e-4, 4e-4)
  run("gspo_token/seq-mean-token-mean/k3/3e-4-4e-4", "gspo_token", sm, 3e-4, 4e-4)
  run("cispo/token-mean/k3/max=5", "cispo", tm, 1.0, 4.0)
  run("cispo/token-mean/k3/max=1.28", "cispo", tm, 1.0, 0.28)
  run("sapo/seq-mean-token-mean/k3", "sapo", sm, lo, hi)
  run("sapo/seq-mean-token-mean/k3/token_advantages", "sapo", sm, lo, hi, a=tok_adv)
  run("gmpo/seq-mean-token-mean/0.4", "gmpo", sm, 0.4, 0.4, kl=False)
  run("gmpo/seq-mean-token-mean/0.2-0.28", "gmpo", sm, lo, hi, kl=False)
  for agg in (tm, sm):
    run(f"ppo/{agg}/k3/0.2-0.28/entropy", "ppo", agg, lo, hi, entropy=True)
    run(f"ppo/{agg}/k3/0.2-0.28/dual3/entropy", "ppo", agg, lo, hi, dual=3.0, entropy=True)
  for kind in ("tis", "mis"):
    for level in ("token", "sequence"):
      run(f"ppo/token-mean/k3/0.2-0.28/{kind}/{level}", "ppo", tm, lo, hi, imp=(kind, level))
      run(f"ppo/token-mean/k3/0.2-0.28/dual3/{kind}/{level}", "ppo", tm, lo, hi, dual=3.0, imp=(kind, level))
  run("gspo_token/seq-mean-token-mean/k3/0.2-0.28/tis/sequence", "gspo_token", sm, lo, hi, imp=("tis", "sequence"))
  # no jaxgrpo mode: TRL's "grpo" entropy bonus is the token mean of H under a per-sequence policy loss
  m = jnp.asarray(inp["mask"], jnp.float32)
  base = "ppo/seq-mean-token-mean/k3/0.2-0.28"
  run(base, "ppo", sm, lo, hi)
  key = base + "/entropy=token-mean"
  o[f"loss/{key}"] = o[f"loss/{base}"] - coef * jnp.sum(ent * m) / jnp.sum(m)
  o[f"grad/{key}"], o[f"grad_entropy/{key}"] = o[f"grad/{base}"], -coef * m / jnp.sum(m)
  return o


NEW_LOSS_PAIRS = [
  # TRL 1.16 GRPOTrainer._compute_loss (β = 0.04 k3 without the bias-correction ratio)
  ("trl/{}/gspo/0.2-0.28", "{}/gspo/seq-mean-token-mean/k3/0.2-0.28", "importance_sampling_level='sequence'"),
  ("trl/{}/gspo/3e-4-4e-4", "{}/gspo/seq-mean-token-mean/k3/3e-4-4e-4", "GSPO's ε (the preset)"),
  ("trl/{}/cispo/max=5", "{}/cispo/token-mean/k3/max=5", "TRL's epsilon_high = ε_max = 1 + our ε_high"),
  ("trl/{}/cispo/max=1.28", "{}/cispo/token-mean/k3/max=1.28", ""),
  ("trl/{}/sapo", "{}/sapo/seq-mean-token-mean/k3", "τ 1.0 / 1.05"),
  ("trl/{}/sapo/token_advantages", "{}/sapo/seq-mean-token-mean/k3/token_advantages", "per-token advantages"),
  ("trl/{}/dapo/entropy", "{}/ppo/token-mean/k3/0.2-0.28/entropy", "entropy_coef = 0.01"),
  (
    "trl/{}/grpo/entropy",
    "{}/ppo/seq-mean-token-mean/k3/0.2-0.28/entropy",
    "TRL averages H over tokens whatever the loss type; ours aggregates it like the loss (as verl)",
  ),
  ("trl/{}/grpo/entropy", "{}/ppo/seq-mean-token-mean/k3/0.2-0.28/entropy=token-mean", "TRL's token-mean H"),
  ("trl/{}/dapo/is=token_truncate", "{}/ppo/token-mean/k3/0.2-0.28/tis/token", "vLLM IS correction, C = 2"),
  ("trl/{}/dapo/is=token_mask", "{}/ppo/token-mean/k3/0.2-0.28/mis/token", ""),
  ("trl/{}/dapo/is=sequence_truncate", "{}/ppo/token-mean/k3/0.2-0.28/tis/sequence", ""),
  ("trl/{}/dapo/is=sequence_mask", "{}/ppo/token-mean/k3/0.2-0.28/mis/sequence", ""),
  # verl 0.9.1: policy_loss_fn + β·agg_loss(k3) [− c·agg_loss(H)], vanilla always dual-clips (c = 3)
  (
    "verl/{}/gspo/seq-mean-token-mean/0.2-0.28",
    "{}/gspo_token/seq-mean-token-mean/k3/0.2-0.28",
    "verl's gspo is GSPO-token",
  ),
  ("verl/{}/gspo/seq-mean-token-mean/0.2-0.28", "{}/gspo/seq-mean-token-mean/k3/0.2-0.28", "= GSPO, one A per row"),
  ("verl/{}/gspo/token-mean/0.2-0.28", "{}/gspo_token/token-mean/k3/0.2-0.28", ""),
  ("verl/{}/gspo/seq-mean-token-mean/3e-4-4e-4", "{}/gspo_token/seq-mean-token-mean/k3/3e-4-4e-4", ""),
  (
    "verl/{}/gspo/seq-mean-token-mean/token_advantages",
    "{}/gspo_token/seq-mean-token-mean/k3/0.2-0.28/token_advantages",
    "per-token advantages",
  ),
  ("verl/{}/gspo/token-mean/token_advantages", "{}/gspo_token/token-mean/k3/0.2-0.28/token_advantages", ""),
  ("verl/{}/cispo/token-mean", "{}/cispo/token-mean/k3/0.2-0.28", ""),
  ("verl/{}/cispo/seq-mean-token-mean", "{}/cispo/seq-mean-token-mean/k3/0.2-0.28", ""),
  ("verl/{}/cispo/token-mean/token_advantages", "{}/cispo/token-mean/k3/0.2-0.28/token_advantages", ""),
  ("verl/{}/sapo", "{}/sapo/seq-mean-token-mean/k3", ""),
  ("verl/{}/sapo/token_advantages", "{}/sapo/seq-mean-token-mean/k3/token_advantages", ""),
  ("verl/{}/geo_mean/0.4", "{}/gmpo/seq-mean-token-mean/0.4", "verl's GMPO (geo_mean), ε = 0.4, no KL"),
  ("verl/{}/geo_mean/0.2-0.28", "{}/gmpo/seq-mean-token-mean/0.2-0.28", ""),
  ("verl/{}/token-mean/entropy", "{}/ppo/token-mean/k3/0.2-0.28/dual3/entropy", "entropy_coeff = 0.01"),
  ("verl/{}/seq-mean-token-mean/entropy", "{}/ppo/seq-mean-token-mean/k3/0.2-0.28/dual3/entropy", ""),
  ("verl/{}/token-mean/is=tis/token", "{}/ppo/token-mean/k3/0.2-0.28/dual3/tis/token", "rollout_is_weights"),
  ("verl/{}/token-mean/is=mis/token", "{}/ppo/token-mean/k3/0.2-0.28/dual3/mis/token", ""),
  ("verl/{}/token-mean/is=tis/sequence", "{}/ppo/token-mean/k3/0.2-0.28/dual3/tis/sequence", ""),
  ("verl/{}/token-mean/is=mis/sequence", "{}/ppo/token-mean/k3/0.2-0.28/dual3/mis/sequence", ""),
  (
    "verl/{}/gspo/seq-mean-token-mean/is=tis/sequence",
    "{}/gspo_token/seq-mean-token-mean/k3/0.2-0.28/tis/sequence",
    "",
  ),
]
IS_PAIRS = [
  ("trl/is_weights/token_truncate", "is/tis/token", "TRL's expressions (need vLLM to run in place)"),
  ("trl/is_weights/token_mask", "is/mis/token", ""),
  ("trl/is_weights/sequence_truncate", "is/tis/sequence", "the product of the token ratios"),
  ("trl/is_weights/sequence_mask", "is/mis/sequence", ""),
  ("verl/is_weights/tis/token", "is/tis/token", "compute_rollout_correction_weights, threshold 2"),
  ("verl/is_weights/mis/token", "is/mis/token", "IcePop form '1e-30_2.0'"),
  ("verl/is_weights/tis/sequence", "is/tis/sequence", ""),
  ("verl/is_weights/mis/sequence", "is/mis/sequence", ""),
  ("verl/mismatch_kl", "mismatch_kl", "compute_offpolicy_metrics' k3_kl"),
]


def new_pairs():
  """(peer key, our key, note) for the losses of issue 15: value, gradient and entropy gradient rows."""
  rows = []
  for peer, our, note in NEW_LOSS_PAIRS:
    rows.append((peer.format("loss"), our.format("loss"), note))
    rows.append((peer.format("grad"), our.format("grad"), "gradient w.r.t. the current log-probs"))
    if "entropy" in peer:
      rows.append((peer.format("grad_entropy"), our.format("grad_entropy"), "gradient w.r.t. the entropies"))
  return rows + IS_PAIRS


BIAS_KL = (
  "TRL's default use_bias_correction_kl=True multiplies k3 by the ratio ρ=π/π_old "
  "(DeepSeek-V3.2); jaxgrpo has no such option"
)

# (peer key, our key, note)
PAIRS = [
  ("trl/advantages/scale=group", "adv/group/ddof=1/eps=0.0001", "TRL: std ddof=1, eps 1e-4"),
  (
    "trl/advantages/scale=group",
    "adv/group/ddof=0/eps=1e-06",
    "our default (ddof=0, eps 1e-6) vs TRL's ddof=1, eps 1e-4",
  ),
  ("trl/advantages/scale=batch", "adv/batch/ddof=1/eps=0.0001", ""),
  ("trl/advantages/scale=none", "adv/none", ""),
  ("tunix/advantages/grpo", "adv/group/ddof=1/eps=1e-06", "Tunix: std ddof=1, eps 1e-6"),
  ("tunix/advantages/grpo", "adv/group/ddof=0/eps=1e-06", "our default ddof=0 vs Tunix's ddof=1"),
  ("tunix/advantages/drgrpo", "adv/none", ""),
  ("tunix/advantages/rloo", "adv/rloo", ""),
  ("verl/advantages/norm_by_std=True", "adv/group/ddof=1/eps=1e-06", "verl: torch.std (ddof=1), eps 1e-6"),
  ("verl/advantages/norm_by_std=False", "adv/none", ""),
  ("verl/advantages/rloo", "adv/rloo", ""),
  ("trl/kl/k3", "kl/k3", ""),
  ("tunix/kl/low_var_kl", "kl/k3", ""),
  ("tunix/kl/kl", "kl/k1", ""),
  ("tunix/kl/mse_kl", "kl/k2", ""),
  ("verl/kl/low_var_kl", "kl/k3", "verl clamps k3 to ±10 (inactive here)"),
  ("verl/kl/kl", "kl/k1", ""),
  ("verl/kl/mse", "kl/k2", ""),
  ("trl/loss/grpo/use_bias_correction_kl=False", "loss/seq-mean-token-mean/k3/0.2-0.28", ""),
  ("trl/loss/bnpo/use_bias_correction_kl=False", "loss/token-mean/k3/0.2-0.28", ""),
  ("trl/loss/dapo/use_bias_correction_kl=False", "loss/token-mean/k3/0.2-0.28", ""),
  (
    "trl/loss/dr_grpo/use_bias_correction_kl=False",
    "loss/seq-mean-token-sum-norm/k3/0.2-0.28",
    "max_completion_length = T",
  ),
  ("trl/loss/grpo", "loss/seq-mean-token-mean/k3/0.2-0.28", BIAS_KL),
  ("trl/loss/dapo", "loss/token-mean/k3/0.2-0.28", BIAS_KL),
  ("tunix/loss/grpo/token-mean/low_var_kl", "loss/token-mean/k3/0.2-0.2", ""),
  ("tunix/loss/grpo/sequence-mean-token-mean/low_var_kl", "loss/seq-mean-token-mean/k3/0.2-0.2", ""),
  ("tunix/loss/grpo/sequence-mean-token-scale/low_var_kl", "loss/seq-mean-token-sum-norm/k3/0.2-0.2", ""),
  (
    "tunix/loss/grpo/sequence-mean-token-sum-norm/low_var_kl",
    "loss/token-mean×tokens/rows/k3/0.2-0.2",
    "no jaxgrpo mode: Σ l·m / rows",
  ),
  ("tunix/loss/grpo/token-mean/kl", "loss/token-mean/k1/0.2-0.2", "Tunix default kl_loss_mode='kl' is k1"),
  ("tunix/loss/grpo/sequence-mean-token-mean/kl", "loss/seq-mean-token-mean/k1/0.2-0.2", "Tunix's default config"),
  (
    "tunix/loss/grpo/sequence-mean-token-mean/kl",
    "loss/seq-mean-token-mean/k3/0.2-0.2",
    "Tunix's default KL is k1, ours k3",
  ),
  ("tunix/loss/dapo/token-mean/none", "loss/token-mean/none/0.2-0.28", ""),
  (
    "tunix/loss/drgrpo/sequence-mean-token-scale/kl",
    "loss/seq-mean-token-sum-norm/k1/0.2-0.2",
    "DrGRPOConfig inherits kl_loss_mode='kl' (k1)",
  ),
  ("verl/loss/token-mean", "loss/token-mean/k3/0.2-0.28/dual3", "verl's vanilla loss always dual-clips (c=3)"),
  ("verl/loss/token-mean", "loss/token-mean/k3/0.2-0.28", "without our dual_clip=3"),
  ("verl/loss/seq-mean-token-mean", "loss/seq-mean-token-mean/k3/0.2-0.28/dual3", ""),
  ("verl/loss/seq-mean-token-sum-norm", "loss/seq-mean-token-sum-norm/k3/0.2-0.28/dual3", "horizon = T"),
]
GRAD_PAIRS = [
  ("trl/grad/grpo/use_bias_correction_kl=False", "grad/seq-mean-token-mean/k3/0.2-0.28"),
  ("trl/grad/bnpo/use_bias_correction_kl=False", "grad/token-mean/k3/0.2-0.28"),
  ("trl/grad/dapo/use_bias_correction_kl=False", "grad/token-mean/k3/0.2-0.28"),
  ("trl/grad/dr_grpo/use_bias_correction_kl=False", "grad/seq-mean-token-sum-norm/k3/0.2-0.28"),
  ("tunix/grad/grpo/token-mean/low_var_kl", "grad/token-mean/k3/0.2-0.2"),
  ("tunix/grad/grpo/sequence-mean-token-mean/low_var_kl", "grad/seq-mean-token-mean/k3/0.2-0.2"),
  ("tunix/grad/grpo/sequence-mean-token-scale/low_var_kl", "grad/seq-mean-token-sum-norm/k3/0.2-0.2"),
  ("tunix/grad/grpo/sequence-mean-token-mean/kl", "grad/seq-mean-token-mean/k1/0.2-0.2"),
  ("tunix/grad/dapo/token-mean/none", "grad/token-mean/none/0.2-0.28"),
]


def k1_loss_gradient_case():
  """Exact expected gradient of a KL loss term over one categorical step: k1 gives 0, k3 does not.

  E_{a~π}[∇θ D(a)] with π = softmax(θ), D the per-token estimator of KL(π‖π_ref) placed in the
  loss, the sample a treated as data (as every GRPO loss does). For k1 = log π(a) − log π_ref(a):
  Σ_a π(a) ∇ log π(a) = ∇ Σ_a π(a) = 0 for *any* θ, so a k1 loss term pulls π nowhere in
  expectation. k3's is ∇θ KL(π_ref‖π), the *forward* KL's gradient (nonzero); TRL's default
  `use_bias_correction_kl` multiplies k3 by the ratio to get the reverse KL's gradient instead.
  """
  theta = jnp.array([[2.0, 0.5, -1.0, 0.0]])
  ref = jax.nn.log_softmax(jnp.zeros((1, 4)))

  def expected(kind):
    def f(th):
      logp = jax.nn.log_softmax(th)
      p = jax.lax.stop_gradient(jnp.exp(logp))
      return jnp.sum(p * jg.kl_penalty(logp, ref, kind))

    return jax.grad(f)(theta)

  forward = jax.grad(lambda th: jnp.sum(jnp.exp(ref) * (ref - jax.nn.log_softmax(th))))(theta)
  return expected("k1"), expected("k3"), forward


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  d = argv[0] if argv else ".peers/out"
  inp = dict(np.load(os.path.join(d, "inputs.npz")))
  peer = {}
  for name in ("trl.npz", "verl.npz", "tunix.npz"):
    path = os.path.join(d, name)
    if os.path.exists(path):
      peer.update(dict(np.load(path)))
    else:
      print(f"(missing {path})")
  o = ours(inp)
  print("versions: " + ", ".join(f"{k[9:]} {peer[k]}" for k in sorted(peer) if k.startswith("versions/")))
  print(
    f"inputs: B={inp['mask'].shape[0]} rows in groups of {int(inp['group_size'])}, T={inp['mask'].shape[1]}, "
    f"{int(inp['mask'].sum())} real tokens, β={float(inp['beta']):.4g}, ε={float(inp['epsilon_low']):.4g}/"
    f"{float(inp['epsilon_high']):.4g}\n"
  )
  print("| peer output | jaxgrpo | max abs diff | verdict | note |")
  print("| --- | --- | ---: | --- | --- |")
  rows = []
  for pk, ok, note in PAIRS + [(a, b, "gradient w.r.t. the current log-probs") for a, b in GRAD_PAIRS] + new_pairs():
    if pk not in peer:
      print(f"| `{pk}` | `{ok}` | — | not produced | {note} |")
      continue
    p, q = np.asarray(peer[pk], np.float64), np.asarray(o[ok], np.float64)
    if p.shape != q.shape:
      p = p.reshape(q.shape)
    diff = float(np.max(np.abs(p - q)))
    scale = max(1.0, float(np.max(np.abs(q))))
    verdict = "equal" if diff <= TOL * scale else "differs"
    rows.append((pk, ok, diff, verdict))
    print(f"| `{pk}` | `{ok}` | {diff:.1e} | {verdict} | {note} |")
  k1, k3, true = k1_loss_gradient_case()
  print(
    "\nExpected gradient of a KL *loss term* over one categorical step, π = softmax([2, 0.5, -1, 0]), "
    "π_ref uniform (exact sum over actions):"
  )
  print(f"  k1 (Tunix's default kl_loss_mode='kl'): {[round(float(v), 4) for v in np.asarray(k1).ravel()]}")
  print(f"  k3 (TRL, verl low_var_kl, jaxgrpo default): {[round(float(v), 4) for v in np.asarray(k3).ravel()]}")
  print(f"  ∇θ KL(π_ref‖π) exactly:                   {[round(float(v), 4) for v in np.asarray(true).ravel()]}")
  return rows


if __name__ == "__main__":
  main()
