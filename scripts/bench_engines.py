"""Benchmark the rollout engines: the built-in jitted sampler vs vLLM (float32, bfloat16) vs transformers.

Run it with vLLM's venv (vLLM pins transformers<5.20; ``bash scripts/setup_vllm_venv.sh``)::

    .venv-vllm/bin/python scripts/bench_engines.py                       # 20m and 150m, 3 rounds
    .venv-vllm/bin/python scripts/bench_engines.py --workloads 20m --repeats 1 --smoke   # seconds

For each workload of ``scripts/peers/common.py`` (``20m``: the random Qwen3 of 20.5M parameters, 16 prompts ×
8 samples × 128 new tokens; ``150m``: 158.6M parameters, 8 × 4 × 64), with the same random weights in every
engine, temperature 1, no filtering, no EOS (every row has exactly T tokens):

1. rollout tokens/s of ``jaxgrpo.rollout.engines.BuiltinEngine``, ``VLLMEngine`` in float32 and bfloat16, and
   transformers' ``generate`` (float32), timed round-robin (``_bench.alternating_times``) after one warm-up
   call each (compilation excluded); median of ``--repeats`` rounds;
2. ``VLLMEngine.push_weights`` seconds (median of 5) against the parameter count (float32 engine);
3. one whole GRPO iteration (push where needed → sample → reward → batch → [vLLM: the trainer's own
   ``old_logp`` pass, engine log-probs as ``behavior_logp``] → train step, ``grpo`` preset with TIS), per
   engine, median of ``--repeats`` iterations after a warm-up one.

Prints one table per workload and writes ``--out`` (JSON). Numbers depend on the machine's load: say so
when recording them (BENCHMARKS.md, "Engines").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import numpy as np
import optax
from flax import nnx

import jaxgrpo
from jaxgrpo.loop import iteration
from jaxgrpo.models import build_model, save_hf
from jaxgrpo.rollout.engines import BuiltinEngine
from jaxgrpo.rollout.engines.vllm import VLLMEngine  # imports vLLM only when an engine starts
from jaxgrpo.rollout.sampling import SamplingConfig
from jaxgrpo.step import train

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # scripts/_bench.py
sys.path.insert(0, os.path.join(HERE, "peers"))  # scripts/peers/common.py
import _bench  # noqa: E402
import common  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workloads", default="20m,150m", help="comma-separated names of scripts/peers/common.py")
  p.add_argument("--repeats", type=int, default=3, help="timed rounds (tokens/s) and iterations (GRPO)")
  p.add_argument("--smoke", action="store_true", help="the workloads shrunk to a seconds-long run")
  p.add_argument("--skip-hf", action="store_true", help="leave transformers out")
  p.add_argument(
    "--skip-vllm", action="store_true", help="leave vLLM out (a machine without vLLM's build, e.g. a GPU without it)"
  )
  p.add_argument("--out", default="runs/bench_engines.json")
  return p.parse_args(argv)


def make_model(w):
  return build_model(_bench.qwen3_config(w.model, w.prompt_len + w.new_tokens), rngs=nnx.Rngs(0))


def sampler_settings(w) -> SamplingConfig:
  return SamplingConfig(num_samples=w.samples, max_new_tokens=w.new_tokens, eos_ids=(), pad_id=0)


def hf_generate(model, w):
  """transformers' sampler on the same weights (save_hf → from_pretrained), as scripts/bench_sampler.py."""
  import torch
  import transformers

  d = tempfile.mkdtemp()
  save_hf(model, d)
  device = "cuda" if torch.cuda.is_available() else "cpu"  # the accelerator JAX uses, when torch sees one too
  hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval().to(device)

  def run(tokens):
    ids = torch.from_numpy(tokens.astype(np.int64)).to(device)
    with torch.inference_mode():
      out = hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_k=None,
        top_p=1.0,
        num_return_sequences=w.samples,
        max_new_tokens=w.new_tokens,
        min_new_tokens=w.new_tokens,
        eos_token_id=None,
        pad_token_id=0,
      )
      return out.cpu()  # synchronises a CUDA device, as the JAX engines return host arrays

  return run


def grpo_iteration_fn(model, engine, w, *, uses_engine_logp: bool):
  """A zero-argument function running one GRPO iteration through ``engine`` (see the module docstring)."""
  mesh = jaxgrpo.parallel.sharding.make_mesh(None)
  opt = optax.adamw(1e-5)
  graphdef, state, shardings = train.init_train_state(model, opt, mesh)
  config = jaxgrpo.preset("grpo", importance_correction="tis")
  tc = train.TrainConfig(micro_batches=max(1, w.prompts * w.samples // w.micro), chunk_size=w.chunk)
  step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc)
  old_logp_fn = train.make_reference_fn(graphdef, mesh=mesh, param_shardings=shardings.params, train_config=tc)
  rng = np.random.default_rng(1)
  tokens = rng.integers(1, w.model.vocab, (w.prompts, w.prompt_len)).astype(np.int32)
  mask = np.ones_like(tokens, bool)
  box = {"state": state, "n": 0}

  def run():
    box["n"] += 1
    s = box["state"]
    engine.push_weights(iteration.policy_model(graphdef, s))
    gen = engine.generate(tokens, mask, sampler_settings(w), key=jax.random.key(box["n"]), temperature=1.0)
    r = gen.rollout._replace(num_steps=None)
    rewards = (np.asarray(r.completions) % 2 == 0).mean(1).astype(np.float32)  # a cheap deterministic reward
    behavior = np.asarray(r.log_probs) if uses_engine_logp else None
    batch = iteration.make_batch(r, rewards, mesh=mesh, behavior_logp=behavior, train_config=tc)
    if uses_engine_logp:
      batch = batch._replace(old_logp=old_logp_fn(s.params, batch))
    s, metrics = step(s, batch)
    jax.block_until_ready(s)
    box["state"] = s
    return metrics

  return run


def bench_workload(name: str, args) -> dict:
  w = common.get_workload(name, smoke=args.smoke)
  model = make_model(w)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  tokens = np.random.default_rng(0).integers(1, w.model.vocab, (w.prompts, w.prompt_len)).astype(np.int32)
  mask = np.ones_like(tokens, bool)
  max_len = w.prompt_len + w.new_tokens
  print(f"[{name}] {n_params / 1e6:.1f}M parameters, {w.prompts}×{w.samples}×{w.new_tokens} tokens", flush=True)
  builtin = BuiltinEngine(model)
  v32 = v16 = start32 = None
  if not args.skip_vllm:
    t0 = time.perf_counter()
    v32 = VLLMEngine(model.config, dtype="float32", max_model_len=max_len, model=model)
    start32 = time.perf_counter() - t0
    v16 = VLLMEngine(model.config, dtype="bfloat16", max_model_len=max_len, model=model)
  keys = {"n": 0}

  def call(engine):
    def run():
      keys["n"] += 1
      return engine.generate(tokens, mask, sampler_settings(w), key=jax.random.key(keys["n"]), temperature=1.0).rollout

    return run

  names, fns = ["jaxgrpo built-in"], [call(builtin)]
  if v32 is not None:
    names += ["vLLM float32", "vLLM bfloat16"]
    fns += [call(v32), call(v16)]
  if not args.skip_hf:
    names.append("transformers float32")
    hf = hf_generate(model, w)
    fns.append(lambda: hf(tokens))
  times = _bench.alternating_times(fns, args.repeats)
  n_tokens = w.prompts * w.samples * w.new_tokens
  rows = {
    n: {"median_s": statistics.median(t), "tok_s": n_tokens / statistics.median(t), "runs": t}
    for n, t in zip(names, times)
  }
  push = None
  if v32 is not None:
    pushes = []
    for _ in range(5):
      v32.push_weights(model)
      pushes.append(v32.push_seconds)
    push = statistics.median(pushes)
  iters = {}
  for label, engine, engine_logp in (("jaxgrpo built-in", builtin, False), ("vLLM float32", v32, True)):
    if engine is not None:
      fn = grpo_iteration_fn(make_model(w), engine, w, uses_engine_logp=engine_logp)
      iters[label] = _bench.median_time(fn, args.repeats)
  if v32 is not None:
    v32.close()
    v16.close()
  out = dict(
    workload=name, params=n_params, tokens=n_tokens, engines=rows, vllm_start_s=start32, push_s=push, iteration_s=iters
  )
  base = rows["jaxgrpo built-in"]["tok_s"]
  print("| engine | median s | tokens/s | ÷ built-in |")
  for n, r in rows.items():
    print(f"| {n} | {r['median_s']:.2f} | {r['tok_s']:,.0f} | {r['tok_s'] / base:.2f} |")
  if push is not None:
    print(f"vLLM start {start32:.1f} s; push {push * 1e3:.0f} ms for {n_params / 1e6:.1f}M fp32 parameters")
  for n, s in iters.items():
    print(f"GRPO iteration through {n}: {s:.2f} s")
  return out


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  print(_bench.backend_line(), flush=True)
  results = [bench_workload(n, args) for n in args.workloads.split(",")]
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"backend": _bench.backend_line(), "results": results}, f, indent=1)
  return results


if __name__ == "__main__":
  main()
