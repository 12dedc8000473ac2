"""TRL's (and verl's) advantages, KL and losses on the shared inputs (run inside .peers/trl).

    .peers/trl/bin/python scripts/peers/numbers_trl.py .peers/out/inputs.npz .peers/model .peers/out/trl.npz

TRL: a real `GRPOTrainer` on the saved model. Advantages come from its own
`_generate_and_score_completions` (it generates, then a reward function hands back the shared
rewards row by row); losses from its own `_compute_loss`, with `_get_per_token_logps_and_entropies`
replaced by a stub returning the shared current-policy log-probs (the only model call in it) and
`old_per_token_logps` / `ref_per_token_logps` / `advantages` passed as inputs. `use_bias_correction_kl` (default True: the KL term is multiplied by the
importance ratio) is run both ways. The model is put in
eval mode so that no gradient-accumulation normaliser is applied.

verl: `verl.trainer.ppo.core_algos` (imported without Ray/vLLM): `compute_grpo_outcome_advantage`,
`kl_penalty(..., "low_var_kl")`, and per `loss_agg_mode` the actor's loss
`compute_policy_loss_vanilla(...) + β·agg_loss(kl)` (verl's vanilla loss always has the dual clip, c = 3).
Every output key is `<peer>/<quantity>/<variant>`.
"""

from __future__ import annotations

import sys
import tempfile

import numpy as np
import torch


def trl_numbers(inp, model_dir) -> dict[str, np.ndarray]:
  import datasets
  import transformers
  import trl
  from trl import GRPOConfig, GRPOTrainer

  b, t = inp["mask"].shape
  g = int(inp["group_size"])
  rewards = inp["rewards"]
  out = {}

  def reward_fn(prompts, completions, row, **kwargs):
    return [float(rewards[r]) for r in row]

  tok = transformers.AutoTokenizer.from_pretrained(model_dir)
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  prompts = [f"t{5 + i} t{9 + i}" for i in range(b // g)]
  ds = datasets.Dataset.from_dict({"prompt": prompts, "row": list(range(b // g))})
  runs = [(scale, "grpo", True) for scale in ("group", "batch", "none")]
  runs += [("group", lt, bc) for lt in ("bnpo", "dr_grpo", "dapo") for bc in (True, False)]
  runs += [("group", "grpo", False)]
  for scale, loss_type, bias_kl in runs:
    with tempfile.TemporaryDirectory() as tmp:
      args = GRPOConfig(
        output_dir=tmp,
        per_device_train_batch_size=b,
        num_generations=g,
        max_completion_length=t,
        beta=float(inp["beta"]),
        epsilon=float(inp["epsilon_low"]),
        epsilon_high=float(inp["epsilon_high"]),
        loss_type=loss_type,
        scale_rewards=scale,
        report_to=[],
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        use_bias_correction_kl=bias_kl,
      )
      trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=ds, processing_class=tok)
    if loss_type == "grpo" and bias_kl:
      rows = [{"prompt": prompts[i // g], "row": i} for i in range(b)]  # what RepeatSampler yields
      trainer.model.train()
      scored = trainer._generate_and_score_completions(rows)
      out[f"trl/advantages/scale={scale}"] = scored["advantages"].detach().numpy()
    if scale != "group":
      continue
    trainer.model.eval()
    logp = torch.tensor(inp["logp"], requires_grad=True)
    trainer._get_per_token_logps_and_entropies = lambda *a, logp=logp, **k: (logp, torch.zeros_like(logp), None)
    mask = torch.tensor(inp["mask"], dtype=torch.int64)
    inputs = {
      "prompt_ids": torch.ones((b, 1), dtype=torch.int64),
      "prompt_mask": torch.ones((b, 1), dtype=torch.int64),
      "completion_ids": torch.ones((b, t), dtype=torch.int64),
      "completion_mask": mask,
      "old_per_token_logps": torch.tensor(inp["old_logp"]),
      "ref_per_token_logps": torch.tensor(inp["ref_logp"]),
      "advantages": torch.tensor(inp["advantages"]),
      "num_items_in_batch": mask.sum(),
    }
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    key = f"{loss_type}" + ("" if bias_kl else "/use_bias_correction_kl=False")
    out[f"trl/loss/{key}"] = loss.detach().numpy()
    out[f"trl/grad/{key}"] = logp.grad.numpy()
  lp, rp = torch.tensor(inp["logp"]), torch.tensor(inp["ref_logp"])
  out["trl/kl/k3"] = (torch.exp(rp - lp) - (rp - lp) - 1).numpy()  # the expression inside _compute_loss
  out["versions/trl"] = np.array(trl.__version__)
  out["versions/transformers"] = np.array(transformers.__version__)
  out["versions/torch"] = np.array(torch.__version__)
  return out


def verl_numbers(inp) -> dict[str, np.ndarray]:
  from importlib.metadata import version

  from verl.trainer.ppo import core_algos as ca

  out = {"versions/verl": np.array(version("verl"))}
  b, t = inp["mask"].shape
  mask = torch.tensor(inp["mask"], dtype=torch.float32)
  scores = torch.zeros((b, t))
  lengths = inp["mask"].sum(1)
  scores[torch.arange(b), torch.tensor(lengths - 1)] = torch.tensor(inp["rewards"])  # reward on the last token
  index = np.array([f"p{i}" for i in inp["group_ids"]], dtype=object)
  for norm in (True, False):
    adv, _ = ca.compute_grpo_outcome_advantage(scores, mask, index, norm_adv_by_std_in_grpo=norm)
    out[f"verl/advantages/norm_by_std={norm}"] = adv[:, 0].numpy()
  try:
    adv, _ = ca.compute_rloo_outcome_advantage(scores, mask, index)
    out["verl/advantages/rloo"] = adv[:, 0].numpy()
  except Exception as e:  # noqa: BLE001
    print("verl rloo:", type(e).__name__, e)
  lp, olp, rp = (torch.tensor(inp[k]) for k in ("logp", "old_logp", "ref_logp"))
  for kind in ("low_var_kl", "kl", "mse"):
    out[f"verl/kl/{kind}"] = ca.kl_penalty(lp, rp, kind).numpy()
  adv = torch.tensor(inp["advantages"])[:, None].expand(b, t)
  from omegaconf import OmegaConf

  cfg = OmegaConf.create(
    {
      "clip_ratio": float(inp["epsilon_low"]),
      "clip_ratio_low": float(inp["epsilon_low"]),
      "clip_ratio_high": float(inp["epsilon_high"]),
      "clip_ratio_c": 3.0,
      "global_batch_info": {},
    }
  )
  kl = ca.kl_penalty(lp, rp, "low_var_kl")
  for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum"):
    # verl's actor: policy_loss = pg_loss + kl_coef * agg_loss(kl, mask, mode)  (dual clip c = 3 is always on)
    pg, _ = ca.compute_policy_loss_vanilla(
      old_log_prob=olp, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode=mode, config=cfg
    )
    out[f"verl/loss/{mode}"] = (pg + float(inp["beta"]) * ca.agg_loss(kl, mask, mode)).numpy()
  return out


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  inp = dict(np.load(argv[0]))
  out = trl_numbers(inp, argv[1])
  try:
    out.update(verl_numbers(inp))
  except Exception as e:  # noqa: BLE001
    import traceback

    traceback.print_exc()
    out["versions/verl"] = np.array(f"not importable: {type(e).__name__}: {e}")
  np.savez(argv[2], **out)
  print(f"wrote {argv[2]}: {sorted(out)}")


if __name__ == "__main__":
  main()
