"""TRL / transformers side of the peer benchmark (run with .peers/trl/bin/python; see bench_peers.py).

    .peers/trl/bin/python scripts/peers/worker_trl.py MODEL_DIR sample|iter REPEATS

sample: transformers `generate` on CPU torch (the generation TRL's GRPOTrainer runs without vLLM):
16 prompts, `num_return_sequences=8`, 128 new tokens (`min_new_tokens=128`, no EOS stop),
temperature 1.0, top-k/top-p off; a short warm-up then REPEATS timed calls.
iter: `GRPOTrainer.train` (no vLLM, β=0.04 so a reference model is kept, loss_type "grpo",
AdamW lr 1e-6, per-device batch 64 × 2 accumulation steps = one update per 128-completion
generation batch, `min_new_tokens=128`) for 1 + REPEATS + 1 steps; iteration times are the
intervals between the reward function's calls (once per generation batch), the first one
(start-up) reported as warm-up.
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


def main():
  model_dir, task, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
  t0 = time.perf_counter()
  tok = transformers.AutoTokenizer.from_pretrained(model_dir)
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
  res = {
    "impl": "trl",
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
      with torch.inference_mode():
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
    import datasets
    import trl

    steps = repeats + 2
    texts = common.prompt_texts()
    ds = datasets.Dataset.from_dict({"prompt": texts * steps})
    clock = common.RewardClock(lambda prompts, completions, **kw: [common.reward_text(c) for c in completions])
    with tempfile.TemporaryDirectory() as tmp:
      args = trl.GRPOConfig(
        output_dir=tmp,
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
      )
      trainer = trl.GRPOTrainer(model=model, reward_funcs=clock, args=args, train_dataset=ds, processing_class=tok)
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
    )
  common.report(res)


if __name__ == "__main__":
  main()
