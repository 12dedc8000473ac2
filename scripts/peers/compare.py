"""Compare jaxgrpo's advantages, KL terms, losses and loss gradients with the peers' outputs.

    python scripts/peers/compare.py .peers/out      # reads inputs.npz, trl.npz, tunix.npz

Run in jaxgrpo's own environment after `numbers_trl.py` and `numbers_tunix.py` (see
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
      return jg.policy_loss(
        x,
        olp,
        adv,
        mask,
        clip_eps_low=lo_,
        clip_eps_high=hi_,
        dual_clip=dual,
        aggregation=aggregation,
        kl=kl,
        beta=beta_ if kind else 0.0,
      )[0]

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
  return {k: np.asarray(v) for k, v in o.items()}


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
  for name in ("trl.npz", "tunix.npz"):
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
  for pk, ok, note in PAIRS + [(a, b, "gradient w.r.t. the current log-probs") for a, b in GRAD_PAIRS]:
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
