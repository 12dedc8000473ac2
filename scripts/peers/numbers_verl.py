"""verl's advantages, KL, policy losses and rollout correction on the shared inputs (run inside .peers/trl).

    .peers/trl/bin/python scripts/peers/numbers_verl.py .peers/out/inputs.npz .peers/out/verl.npz

verl 0.9.1 is installed there without its heavy dependencies; only `verl.trainer.ppo.core_algos`
(advantages, KL, the registered policy losses and `agg_loss`) and
`verl.trainer.ppo.rollout_corr_helper` (rollout-correction weights and off-policy metrics) are
imported, never Ray or vLLM.

- Advantages: `compute_grpo_outcome_advantage` (with and without the std), `compute_rloo_outcome_advantage`.
- KL: `kl_penalty(..., "low_var_kl" / "kl" / "mse")`.
- The actor's loss as verl's `workers/utils/losses.py::ppo_loss` composes it:
  `policy_loss_fn(...) − entropy_coeff·agg_loss(entropy) + kl_loss_coef·agg_loss(kl)` with the
  aggregation mode of the actor, for the registered losses `vanilla` (always dual-clips, c = 3),
  `gspo` (the GSPO-token form), `cispo`, `sapo` (aggregates `seq-mean-token-mean` whatever the mode)
  and `geo_mean` (GMPO: `torch.mean` over rows), each with `rollout_is_weights` where noted.
- Rollout correction: `compute_rollout_correction_weights` (TIS: one threshold; masked IS: verl's
  IcePop form `"lower_upper"` with a lower bound of 1e-30, i.e. none) at token and sequence level, and
  `compute_offpolicy_metrics`' `k3_kl`.

Gradients are taken w.r.t. the current log-probs (and the entropies). Output keys `verl/<quantity>/<variant>`.
"""

from __future__ import annotations

import sys
from importlib.metadata import version

import numpy as np
import torch

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _actor_config(**kw):
  from verl.workers.config.actor import ActorConfig

  return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **kw)


def advantages_and_kl(inp, ca) -> dict[str, np.ndarray]:
  out = {}
  b, t = inp["mask"].shape
  mask = torch.tensor(inp["mask"], dtype=torch.float32)
  scores = torch.zeros((b, t))
  lengths = inp["mask"].sum(1)
  scores[torch.arange(b), torch.tensor(lengths - 1)] = torch.tensor(inp["rewards"])  # reward on the last token
  index = np.array([f"p{i}" for i in inp["group_ids"]], dtype=object)
  for norm in (True, False):
    adv, _ = ca.compute_grpo_outcome_advantage(scores, mask, index, norm_adv_by_std_in_grpo=norm)
    out[f"verl/advantages/norm_by_std={norm}"] = adv[:, 0].numpy()
  adv, _ = ca.compute_rloo_outcome_advantage(scores, mask, index)
  out["verl/advantages/rloo"] = adv[:, 0].numpy()
  lp, rp = torch.tensor(inp["logp"]), torch.tensor(inp["ref_logp"])
  for kind in ("low_var_kl", "kl", "mse"):
    out[f"verl/kl/{kind}"] = ca.kl_penalty(lp, rp, kind).numpy()
  return out


def rollout_correction(inp) -> dict[str, np.ndarray]:
  from verl.trainer.ppo import rollout_corr_helper as rc

  out = {}
  mask = torch.tensor(inp["mask"], dtype=torch.float32)
  olp, blp = torch.tensor(inp["old_logp"]), torch.tensor(inp["behavior_logp"])
  cap = float(inp["is_cap"])
  for level in ("token", "sequence"):
    for kind, threshold in (("tis", cap), ("mis", f"1e-30_{cap}")):
      w, _ = rc.compute_rollout_correction_weights(olp - blp, mask, rollout_is=level, rollout_is_threshold=threshold)
      out[f"verl/is_weights/{kind}/{level}"] = w.numpy()
  metrics = rc.compute_offpolicy_metrics(olp, blp, mask)
  out["verl/mismatch_kl"] = np.array(metrics["k3_kl"])
  return out, {(k, lv): out[f"verl/is_weights/{k}/{lv}"] for k in ("tis", "mis") for lv in ("token", "sequence")}


def losses(inp, ca, is_weights) -> dict[str, np.ndarray]:
  out = {}
  b, t = inp["mask"].shape
  mask = torch.tensor(inp["mask"], dtype=torch.float32)
  olp, rp = torch.tensor(inp["old_logp"]), torch.tensor(inp["ref_logp"])
  beta, lo, hi = float(inp["beta"]), float(inp["epsilon_low"]), float(inp["epsilon_high"])
  coef = float(inp["entropy_coef"])
  adv_rows = torch.tensor(inp["advantages"])[:, None].expand(b, t)
  adv_tokens = torch.tensor(inp["token_advantages"])

  def actor_loss(name, loss_mode, mode, *, eps=(lo, hi), adv=adv_rows, kl=True, entropy=False, weights=None):
    """verl's ppo_loss: pg(…) − entropy_coeff·agg_loss(H) + kl_loss_coef·agg_loss(k3), one backward."""
    lp = torch.tensor(inp["logp"], requires_grad=True)
    ent = torch.tensor(inp["entropy"], requires_grad=True)
    cfg = _actor_config(clip_ratio=eps[0], clip_ratio_low=eps[0], clip_ratio_high=eps[1], loss_agg_mode=mode)
    w = None if weights is None else torch.tensor(weights)
    pg, _ = ca.get_policy_loss_fn(loss_mode)(
      old_log_prob=olp, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode=mode, config=cfg,
      rollout_is_weights=w,
    )  # fmt: skip
    loss = pg
    if entropy:
      loss = loss - coef * ca.agg_loss(ent, mask, mode)
    if kl:
      loss = loss + beta * ca.agg_loss(ca.kl_penalty(lp, rp, "low_var_kl"), mask, mode)
    loss.backward()
    out[f"verl/loss/{name}"] = loss.detach().numpy()
    out[f"verl/grad/{name}"] = lp.grad.numpy()
    if entropy:
      out[f"verl/grad_entropy/{name}"] = ent.grad.numpy()

  for mode in MODES:  # the original rows (vanilla, dual clip c = 3 always on)
    actor_loss(mode, "vanilla", mode)
  for mode in ("token-mean", "seq-mean-token-mean"):
    actor_loss(f"gspo/{mode}/0.2-0.28", "gspo", mode)
    actor_loss(f"gspo/{mode}/token_advantages", "gspo", mode, adv=adv_tokens)
    actor_loss(f"cispo/{mode}", "cispo", mode)
    actor_loss(f"cispo/{mode}/token_advantages", "cispo", mode, adv=adv_tokens)
  actor_loss("gspo/seq-mean-token-mean/3e-4-4e-4", "gspo", "seq-mean-token-mean", eps=(3e-4, 4e-4))
  actor_loss("sapo", "sapo", "seq-mean-token-mean")
  actor_loss("sapo/token_advantages", "sapo", "seq-mean-token-mean", adv=adv_tokens)
  actor_loss("geo_mean/0.4", "geo_mean", "seq-mean-token-mean", eps=(0.4, 0.4), kl=False)
  actor_loss("geo_mean/0.2-0.28", "geo_mean", "seq-mean-token-mean", kl=False)
  actor_loss("token-mean/entropy", "vanilla", "token-mean", entropy=True)
  actor_loss("seq-mean-token-mean/entropy", "vanilla", "seq-mean-token-mean", entropy=True)
  for (kind, level), w in is_weights.items():
    actor_loss(f"token-mean/is={kind}/{level}", "vanilla", "token-mean", weights=w)
  actor_loss(
    "gspo/seq-mean-token-mean/is=tis/sequence", "gspo", "seq-mean-token-mean", weights=is_weights["tis", "sequence"]
  )
  return out


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  inp = dict(np.load(argv[0]))
  from verl.trainer.ppo import core_algos as ca

  out = {"versions/verl": np.array(version("verl"))}
  out.update(advantages_and_kl(inp, ca))
  corr, weights = rollout_correction(inp)
  out.update(corr)
  out.update(losses(inp, ca, weights))
  np.savez(argv[1], **out)
  print(f"wrote {argv[1]}: {sorted(out)}")


if __name__ == "__main__":
  main()
