"""TRL / transformers side of the peer benchmark (run with .peers/trl/bin/python; see bench_peers.py).

    .peers/trl/bin/python scripts/peers/worker_trl.py MODEL_DIR sample|iter REPEATS

sample: transformers `generate` on CPU torch (the generation TRL's GRPOTrainer runs without vLLM):
PROMPTS prompts, `num_return_sequences=SAMPLES`, NEW_TOKENS new tokens (`min_new_tokens`, no EOS
stop), temperature 1.0, top-k/top-p off; a short warm-up then REPEATS timed calls.
iter: `GRPOTrainer.train` (no vLLM, β=0.04 so a reference model is kept, loss_type "grpo", AdamW
lr 1e-6, per-device batch MICRO × 2 accumulation steps = one update per generation batch of all
rows, `min_new_tokens=NEW_TOKENS`) for 1 + REPEATS + 1 steps; iteration times are the intervals
between the reward function's calls (once per generation batch), the first one (start-up) reported
as warm-up.

The TRL configuration (``PEERS_TRL_VARIANT``, see docs/peers.md "TRL's configuration"):

- ``fair`` (the default, the benchmark's TRL row): float32 (``bf16=False``), no gradient
  checkpointing, torch's intra-op threads = the cores this process may use (`common.usable_cores`:
  affinity capped by the cgroup CPU quota) — the same math and the same cores jaxgrpo and Tunix get;
- ``defaults``: TRL 1.16's own defaults on CPU — ``bf16=True`` (mixed precision: bf16 autocast on
  CPU), ``gradient_checkpointing=True``, torch's default thread count.

``PEERS_TORCH_THREADS=N`` forces N intra-op threads, ``PEERS_FLUSH_DENORMAL=1`` turns on
`torch.set_flush_denormal` and ``PEERS_TORCH_MKLDNN=0`` turns oneDNN off
(`torch.backends.mkldnn.enabled = False`: bf16 matmuls then run in torch's own CPU kernels, which is
what torch does on a CPU whose oneDNN has no bf16 support — no AVX-512 or AVX2-VNNI-2) — all for
diagnosis; `trl_probe.py` sets them. The RESULT records what
was in effect: thread counts, the trainer's precision, checkpointing, optimizer, the generation
config and the dtype the policy's and reference's layers really computed in.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

VARIANTS = {
  # Same float32 math as jaxgrpo and Tunix; no activation recompute (jaxgrpo does not remat layers).
  "fair": dict(bf16=False, gradient_checkpointing=False),
  # What GRPOConfig gives a user who sets nothing (TRL's _BaseConfig: bf16 and gradient checkpointing on).
  "defaults": dict(),
}


def variant() -> str:
  name = os.environ.get("PEERS_TRL_VARIANT", "fair")
  if name not in VARIANTS:
    raise ValueError(f"PEERS_TRL_VARIANT={name!r}; expected one of {sorted(VARIANTS)}")
  return name


def set_threads(name: str) -> None:
  """Intra-op threads: ``PEERS_TORCH_THREADS`` if set, else the usable cores (``fair``) or torch's default."""
  forced = os.environ.get("PEERS_TORCH_THREADS")
  if forced:
    torch.set_num_threads(int(forced))
  elif name == "fair":
    torch.set_num_threads(common.usable_cores())
  if os.environ.get("PEERS_TORCH_MKLDNN") == "0":  # torch's own kernels, as on a CPU without oneDNN bf16
    torch.backends.mkldnn.enabled = False
  if os.environ.get("PEERS_FLUSH_DENORMAL"):
    if not torch.set_flush_denormal(True):
      raise RuntimeError("PEERS_FLUSH_DENORMAL=1 but torch.set_flush_denormal is not supported on this CPU")


def grpo_args(output_dir: str, steps: int, name: str):
  """The `trl.GRPOConfig` of the benchmark's iteration, for variant ``name``."""
  import trl

  return trl.GRPOConfig(
    output_dir=output_dir,
    per_device_train_batch_size=common.MICRO,
    gradient_accumulation_steps=common.PROMPTS * common.SAMPLES // common.MICRO,
    num_generations=common.SAMPLES,
    max_completion_length=common.NEW_TOKENS,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    generation_kwargs={"min_new_tokens": common.NEW_TOKENS},
    beta=common.BETA,
    learning_rate=common.LR,
    loss_type="grpo",
    max_steps=steps,
    logging_steps=1,
    report_to=[],
    save_strategy="no",
    use_cpu=True,
    dataloader_num_workers=0,
    disable_tqdm=True,
    seed=0,
    **precision_args(name),
  )


def precision_args(name: str) -> dict:
  """The variant's GRPOConfig settings; with ``PEERS_PRECISION=bf16`` the ``fair`` variant runs TRL's own
  mixed precision (``bf16=True``: bf16 autocast on the CPU, float32 weights), nothing else changed."""
  args = dict(VARIANTS[name])
  if common.PRECISION == "bf16":
    args["bf16"] = True
  return args


def make_trainer(model, tok, reward_fn, steps: int, output_dir: str, name: str):
  """A `trl.GRPOTrainer` on the shared prompts (each prompt once per step; TRL repeats it SAMPLES times)."""
  import datasets
  import trl

  ds = datasets.Dataset.from_dict({"prompt": common.prompt_texts() * steps})
  args = grpo_args(output_dir, steps, name)
  return trl.GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=ds, processing_class=tok)


class DtypeProbe:
  """Records the dtype one decoder layer's MLP output really had, per model and grad mode (autocast shows here)."""

  def __init__(self):
    self.seen, self.handles = set(), []

  def attach(self, model, label: str) -> None:
    layer = model.model.layers[0].mlp.down_proj

    def hook(_module, _inputs, output):
      self.seen.add(f"{label}/{'grad' if torch.is_grad_enabled() else 'no_grad'}/{output.dtype}".replace("torch.", ""))

    self.handles.append(layer.register_forward_hook(hook))


def effective_config(trainer, probe: DtypeProbe | None = None) -> dict:
  """What the trainer really ran with (read back from the trainer, not from our arguments)."""
  a = trainer.args
  opt = getattr(trainer, "optimizer", None)
  inner = getattr(opt, "optimizer", opt)
  out = {
    "variant": variant(),
    "bf16": a.bf16,
    "fp16": a.fp16,
    "mixed_precision": str(trainer.accelerator.mixed_precision),
    "gradient_checkpointing": a.gradient_checkpointing,
    "model_is_gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False)),
    "model_dtype": str(next(trainer.model.parameters()).dtype),
    "ref_model": None if trainer.ref_model is None else type(trainer.ref_model).__name__,
    "use_vllm": a.use_vllm,
    "continuous_batching": a.use_transformers_continuous_batching,
    "per_device_train_batch_size": a.per_device_train_batch_size,
    "gradient_accumulation_steps": a.gradient_accumulation_steps,
    "steps_per_generation": a.steps_per_generation,
    "generation_batch_size": a.generation_batch_size,
    "num_iterations": a.num_iterations,
    "beta": a.beta,
    "loss_type": a.loss_type,
    "max_grad_norm": a.max_grad_norm,
    "optim": str(a.optim),
    "optimizer": None if inner is None else type(inner).__name__,
    "optimizer_groups": None
    if inner is None
    else [
      {k: g.get(k) for k in ("lr", "weight_decay", "eps", "betas", "fused", "foreach")} for g in inner.param_groups
    ],
    "lr_scheduler_type": str(a.lr_scheduler_type),
    "torch_compile": a.torch_compile,
    "cast_lm_head_to_fp32": a.cast_lm_head_to_fp32,
    "generation_config": trainer.generation_config.to_diff_dict(),
    "torch_threads": torch.get_num_threads(),
    "flush_denormal": bool(os.environ.get("PEERS_FLUSH_DENORMAL")),
    "mkldnn": torch.backends.mkldnn.enabled,
  }
  if probe is not None:
    out["layer_dtypes"] = sorted(probe.seen)
  return out


def main():
  model_dir, task, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
  name = variant()
  set_threads(name)
  t0 = time.perf_counter()
  tok = transformers.AutoTokenizer.from_pretrained(model_dir)
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
  res = {
    "impl": "trl" if name == "fair" else f"trl:{name}",
    "task": task,
    "load_s": time.perf_counter() - t0,
    "torch": torch.__version__,
    "torch_threads": torch.get_num_threads(),
    "transformers": transformers.__version__,
  }
  n_tokens = common.PROMPTS * common.SAMPLES * common.NEW_TOKENS
  if task == "sample":
    ids = torch.tensor(common.prompt_ids(), dtype=torch.long)
    mask = torch.ones_like(ids)

    def run(n):
      autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=common.PRECISION == "bf16")
      with torch.inference_mode(), autocast:
        return model.generate(
          input_ids=ids,
          attention_mask=mask,
          do_sample=True,
          temperature=1.0,
          top_k=None,
          top_p=1.0,
          num_return_sequences=common.SAMPLES,
          max_new_tokens=n,
          min_new_tokens=n,
          eos_token_id=None,
          pad_token_id=0,
        )

    t0 = time.perf_counter()
    run(4)
    res["warmup_s"] = time.perf_counter() - t0
    times = []
    for r in range(repeats):
      torch.manual_seed(r + 1)
      t0 = time.perf_counter()
      out = run(common.NEW_TOKENS)
      times.append(time.perf_counter() - t0)
    assert out.shape == (common.PROMPTS * common.SAMPLES, common.PROMPT_LEN + common.NEW_TOKENS), out.shape
    res.update(times=times, tokens=n_tokens)
  else:
    import trl

    steps = repeats + 2
    clock = common.RewardClock(lambda prompts, completions, **kw: [common.reward_text(c) for c in completions])
    with tempfile.TemporaryDirectory() as tmp:
      trainer = make_trainer(model, tok, clock, steps, tmp, name)
      probe = DtypeProbe()
      probe.attach(trainer.model, "policy")
      if trainer.ref_model is not None:
        probe.attach(trainer.ref_model, "reference")
      t0 = time.perf_counter()
      trainer.train()
      total = time.perf_counter() - t0
    iv = clock.intervals()
    res.update(
      warmup_s=(clock.stamps[0] - t0) + iv[0] if iv else total,
      times=iv[1:],
      tokens=n_tokens,
      total_s=total,
      reward_calls=len(clock.stamps),
      trl=trl.__version__,
      trl_config=effective_config(trainer, probe),
    )
  common.report(res)


if __name__ == "__main__":
  main()
