"""TRL's advantages, KL and losses on the shared inputs (run inside .peers/trl).

    .peers/trl/bin/python scripts/peers/numbers_trl.py .peers/out/inputs.npz .peers/model .peers/out/trl.npz

TRL: a real `GRPOTrainer` on the saved model. Advantages come from its own
`_generate_and_score_completions` (it generates, then a reward function hands back the shared
rewards row by row); losses from its own `_compute_loss`, with `_get_per_token_logps_and_entropies`
replaced by a stub returning the shared current-policy log-probs (the only model call in it) and
`old_per_token_logps` / `ref_per_token_logps` / `advantages` passed as inputs. `use_bias_correction_kl` (default True: the KL term is multiplied by the
importance ratio) is run both ways. The model is put in
eval mode so that no gradient-accumulation normaliser is applied.

The other losses (`trl_loss_variants`): GSPO (`loss_type="grpo"`, `importance_sampling_level=
"sequence"`), CISPO (`loss_type="cispo"`: `epsilon_high` is the ratio's absolute cap ε_max), SAPO
(`loss_type="sapo"`, its default temperatures), the entropy bonus (`entropy_coef`, shared per-token
entropies returned by the same stub, gradients taken w.r.t. them too), and the vLLM importance
sampling correction: TRL computes `importance_sampling_ratio` inside `_generate_and_score_completions`,
which needs vLLM, so its four modes' expressions are evaluated here as written there
(`trl_is_ratio`) and passed to the real `_compute_loss` with `use_vllm` and
`vllm_importance_sampling_correction` switched on.

verl's numbers: `numbers_verl.py` (the same venv).
"""

from __future__ import annotations

import math
import sys
import tempfile

import numpy as np
import torch


def trl_is_ratio(inp, mode: str) -> torch.Tensor:
  """TRL's `importance_sampling_ratio` for `vllm_importance_sampling_mode=mode`, the expressions of its
  `_generate_and_score_completions` (old = the trainer's log-probs, sampling = vLLM's), clip_max = the cap."""
  mask = torch.tensor(inp["mask"], dtype=torch.float32)
  diff = (torch.tensor(inp["old_logp"]) - torch.tensor(inp["behavior_logp"])) * mask
  diff = torch.nan_to_num(diff, nan=0.0)
  if mode.startswith("sequence"):
    diff = diff.sum(dim=-1, keepdim=True)
  ratio = torch.exp(diff)
  cap = float(inp["is_cap"])
  if mode.endswith("truncate"):
    return torch.clamp(ratio, min=None, max=cap)
  return ratio.masked_fill((ratio < -math.inf) | (ratio > cap), value=0.0)


def _trainer(inp, model, tok, ds, reward_fn, tmp, **kw):
  from trl import GRPOConfig, GRPOTrainer

  b, t = inp["mask"].shape
  args = GRPOConfig(
    output_dir=tmp,
    per_device_train_batch_size=b,
    num_generations=int(inp["group_size"]),
    max_completion_length=t,
    report_to=[],
    use_cpu=True,
    logging_steps=1,
    save_strategy="no",
    use_bias_correction_kl=False,
    **kw,
  )
  trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=ds, processing_class=tok)
  trainer.model.eval()  # no gradient-accumulation normaliser
  return trainer


def _trl_loss(trainer, inp, *, advantages=None, is_ratio=None, entropy=False):
  """TRL's own `_compute_loss` on the shared log-probs (and entropies): loss, ∇logp, ∇entropy."""
  b, t = inp["mask"].shape
  logp = torch.tensor(inp["logp"], requires_grad=True)
  ent = torch.tensor(inp["entropy"], requires_grad=True) if entropy else torch.zeros((b, t))
  trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp, ent, None)
  mask = torch.tensor(inp["mask"], dtype=torch.int64)
  inputs = {
    "prompt_ids": torch.ones((b, 1), dtype=torch.int64),
    "prompt_mask": torch.ones((b, 1), dtype=torch.int64),
    "completion_ids": torch.ones((b, t), dtype=torch.int64),
    "completion_mask": mask,
    "old_per_token_logps": torch.tensor(inp["old_logp"]),
    "ref_per_token_logps": torch.tensor(inp["ref_logp"]),
    "advantages": torch.tensor(inp["advantages"] if advantages is None else advantages),
    "num_items_in_batch": mask.sum(),
  }
  if is_ratio is not None:
    trainer.use_vllm = True  # only read here to apply the ratio (no vLLM is started)
    trainer.vllm_importance_sampling_correction = True
    inputs["importance_sampling_ratio"] = is_ratio
  loss = trainer._compute_loss(trainer.model, inputs)
  loss.backward()
  out = [loss.detach().numpy(), logp.grad.numpy()]
  out.append(ent.grad.numpy() if entropy else None)
  return out


def trl_loss_variants(inp, model, tok, ds, reward_fn) -> dict[str, np.ndarray]:
  """GSPO, CISPO, SAPO, the entropy bonus and the four IS-correction modes through TRL's `_compute_loss`."""
  beta, lo, hi = float(inp["beta"]), float(inp["epsilon_low"]), float(inp["epsilon_high"])
  coef = float(inp["entropy_coef"])
  runs = {  # name: (GRPOConfig overrides, _trl_loss keywords)
    "gspo/0.2-0.28": (dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=lo, epsilon_high=hi), {}),
    "gspo/3e-4-4e-4": (
      dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
      {},
    ),
    "cispo/max=5": (dict(loss_type="cispo", epsilon_high=5.0), {}),
    "cispo/max=1.28": (dict(loss_type="cispo", epsilon_high=1.28), {}),
    "sapo": (dict(loss_type="sapo"), {}),
    "sapo/token_advantages": (dict(loss_type="sapo"), dict(advantages=inp["token_advantages"])),
    "dapo/entropy": (dict(loss_type="dapo", epsilon=lo, epsilon_high=hi, entropy_coef=coef), dict(entropy=True)),
    "grpo/entropy": (dict(loss_type="grpo", epsilon=lo, epsilon_high=hi, entropy_coef=coef), dict(entropy=True)),
  }
  for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
    runs[f"dapo/is={mode}"] = (
      dict(loss_type="dapo", epsilon=lo, epsilon_high=hi),
      dict(is_ratio=trl_is_ratio(inp, mode)),
    )
  out = {}
  for name, (config, kw) in runs.items():
    with tempfile.TemporaryDirectory() as tmp:
      trainer = _trainer(inp, model, tok, ds, reward_fn, tmp, beta=beta, **config)
      loss, grad, grad_h = _trl_loss(trainer, inp, **kw)
    out[f"trl/loss/{name}"], out[f"trl/grad/{name}"] = loss, grad
    if grad_h is not None:
      out[f"trl/grad_entropy/{name}"] = grad_h
  for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
    ratio = trl_is_ratio(inp, mode).numpy()
    out[f"trl/is_weights/{mode}"] = np.broadcast_to(ratio, inp["mask"].shape) * inp["mask"]
  return out


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
  out.update(trl_loss_variants(inp, model, tok, ds, reward_fn))
  lp, rp = torch.tensor(inp["logp"]), torch.tensor(inp["ref_logp"])
  out["trl/kl/k3"] = (torch.exp(rp - lp) - (rp - lp) - 1).numpy()  # the expression inside _compute_loss
  out["versions/trl"] = np.array(trl.__version__)
  out["versions/transformers"] = np.array(transformers.__version__)
  out["versions/torch"] = np.array(torch.__version__)
  return out


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  inp = dict(np.load(argv[0]))
  out = trl_numbers(inp, argv[1])
  np.savez(argv[2], **out)
  print(f"wrote {argv[2]}: {sorted(out)}")


if __name__ == "__main__":
  main()
