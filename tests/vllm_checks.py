"""The vLLM engine checked against the library's own log-probs: run by tests/test_engine_vllm.py in a child
process with vLLM's own venv (``.venv-vllm/bin/python tests/vllm_checks.py CHECK OUT.json``), because vLLM
pins transformers<5.20 (scripts/setup_vllm_venv.sh). Every number printed here is asserted on by the test.

``families``: for each case (family, tied/untied, dtype, sampling settings) a tiny random model whose output
entropy is reported (a near-deterministic model would make every comparison trivially exact), prompts of
150–200 tokens (more than one 128-token KV block, so the prefix cache is exercised), then

  1. push → sample → the engine's sampled-token log-probs vs ``models.log_probs.completion_log_probs`` of the
     same tokens (max |Δ|); sampled tokens outside the library's top-k/top-p set; suppressed ids; EOS rows;
  2. greedy: the engine's token t vs the library's argmax given the engine's own prefix (positions where the
     library's top-2 logit gap is > 1e-3; free-running comparisons flip on near-ties);
  3. one AdamW step on the NLL of the samples → push → sample the same prompts again: max |Δ| to the new
     policy's log-probs and mean |Δ| to the old policy's (stale weights or a stale prefix cache show here).

``partial``: partial rollouts through vLLM (``EnginePool``), a row across two pushes, and the prefix-cache reset's
checks (:func:`partial`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from xla_flags import TEST_XLA_FLAGS, as_compiler_options

from jaxgrpo.models import (
  GPT2Config,
  LlamaConfig,
  Qwen2Config,
  Qwen2MoeConfig,
  Qwen3Config,
  Qwen3MoeConfig,
  build_model,
  lora,
)
from jaxgrpo.models.log_probs import completion_log_probs, positions_from_mask
from jaxgrpo.rollout.engines.vllm import VLLMEngine
from jaxgrpo.rollout.sampling import SamplingConfig, filter_logits

V = 256
# the checks' programs compile once per case and run a few times: they compile with the suite's flags
# (helpers.TEST_XLA_FLAGS, given per program: the trainer runs of tests/vllm_trainer.py share this process and keep
# the default flags). The 8 cases' two programs: 22.8 and 21.7 CPU-s to compile with the backend at -O0 alone,
# 8.1 and 9.5 with the three flags (2-core AMD EPYC, loaded)
_TEST_OPTIONS = as_compiler_options(TEST_XLA_FLAGS)


def config(family: str, tied: bool):
  common = dict(vocab_size=V, hidden_size=64, num_layers=2, num_heads=2, max_position_embeddings=512)
  if family == "gpt2":
    return GPT2Config(**common, tie_word_embeddings=tied)
  kw = dict(**common, num_kv_heads=1, head_dim=32, intermediate_size=128, tie_word_embeddings=tied)
  if family == "qwen3_moe":  # 8 experts, top-2, renormalised; layer 0 dense (mlp_only_layers)
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    return Qwen3MoeConfig(**kw, **moe, mlp_only_layers=(0,))
  if family == "qwen2_moe":  # 6 experts, top-2, not renormalised, a gated shared expert
    moe = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    return Qwen2MoeConfig(**kw, **moe)
  return {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family](**kw)


def random_model(cfg, seed: int):
  """``build_model`` with every parameter redrawn N(0, σ) (norm scales around 1), σ chosen so the output
  entropy is well below log V: a model whose comparisons can fail."""
  model = build_model(cfg, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    shape = var.get_value().shape
    name = "/".join(map(str, path))
    if "norm" in name or "ln_" in name:
      value = (1.0 if name.endswith("scale") else 0.0) + 0.1 * rng.standard_normal(shape)
    elif "embed" in name or "lm_head" in name or "wpe" in name:
      value = 0.6 * rng.standard_normal(shape)
    else:
      value = 0.15 * rng.standard_normal(shape)
    var.set_value(jnp.asarray(value, jnp.float32))
  return model


def prompts(seed: int, b: int = 3, p: int = 200):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, V, (b, p)).astype(np.int32)
  lengths = rng.integers(150, p + 1, b)
  mask = np.arange(p)[None] >= (p - lengths)[:, None]
  return np.where(mask, tokens, 0).astype(np.int32), mask


@functools.partial(jax.jit, static_argnums=0, static_argnames="temperature", compiler_options=_TEST_OPTIONS)
def _library(graphdef, state, prompt_tokens, prompt_mask, completions, mask, *, temperature):
  model = nnx.merge(graphdef, state)
  logp, _ = completion_log_probs(
    model, prompt_tokens, prompt_mask, completions, mask, temperature=temperature, chunk_size=None
  )
  tokens = jnp.concatenate([prompt_tokens, completions], 1)
  attn = jnp.concatenate([prompt_mask, mask], 1)
  hidden, _ = model(tokens, positions_from_mask(attn), attention_mask=attn)
  p = prompt_tokens.shape[1]
  return logp, model.logits(hidden[:, p - 1 : -1], out_dtype=jnp.float32)


def library(model, rollout, temperature):
  """``(logp f32[N, T], logits f32[N, T, V])``: ``models.log_probs.completion_log_probs`` of the engine's
  tokens at ``temperature``, and the library's logits of every completion position given the engine's
  prefix (one jitted program per model structure: the cases' several calls share its compile)."""
  r = rollout
  graphdef, state = nnx.split(model)
  logp, logits = _library(
    graphdef, state, r.prompt_tokens, r.prompt_mask, r.completions, r.mask, temperature=float(temperature)
  )
  return np.asarray(logp), np.array(logits)


@functools.partial(jax.jit, static_argnums=0, compiler_options=_TEST_OPTIONS)
def _update(graphdef, params, rest, prompt_tokens, prompt_mask, completions, mask, lr):
  opt = optax.adamw(lr)

  def loss(params):
    m = nnx.merge(graphdef, params, rest)
    logp, _ = completion_log_probs(m, prompt_tokens, prompt_mask, completions, mask, chunk_size=None)
    return -jnp.sum(logp * mask) / jnp.sum(mask)

  grads = jax.grad(loss)(params)
  updates, _ = opt.update(grads, opt.init(params), params)
  return optax.apply_updates(params, updates)


def update(model, rollout, lr=3e-2):
  """One AdamW step on the mean NLL of the rollout's tokens (the policy moves away from its samples' NLL)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  r = rollout
  new = _update(graphdef, params, rest, r.prompt_tokens, r.prompt_mask, r.completions, r.mask, lr)
  return nnx.merge(graphdef, new, rest)


def _lap(out, name, t0):
  out.setdefault("phases", {})[name] = round(time.perf_counter() - t0, 2)
  return time.perf_counter()


def one_case(case: dict) -> dict:
  cfg = config(case["family"], case["tied"])
  model = random_model(cfg, case.get("seed", 0))
  if case.get("lora"):
    lora.apply_lora(model, lora.LoRAConfig(rank=4, alpha=8.0), key=jax.random.key(1))
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):  # B = 0 at init: make it matter
      var.set_value(0.2 * jax.random.normal(jax.random.key(zlib.crc32(str(path).encode())), var.get_value().shape))
  tau = case.get("temperature", 1.0)
  settings = SamplingConfig(
    num_samples=4,
    max_new_tokens=24,
    top_p=case.get("top_p", 1.0),
    top_k=case.get("top_k", 0),
    eos_ids=(1,),
    pad_id=0,
    suppress_ids=case.get("suppress_ids"),
  )
  t0 = time.perf_counter()
  engine = VLLMEngine(
    cfg, dtype=case.get("dtype", "float32"), logprobs_temperature=tau if tau > 0 else 1.0, kv_cache_bytes=64 * 2**20
  )
  out = dict(case=case, start_s=time.perf_counter() - t0)
  engine.push_weights(model)
  out["push_s"] = engine.push_seconds
  t0 = time.perf_counter()
  tokens, mask = prompts(case.get("seed", 0))
  out["prompt_lengths"] = mask.sum(1).tolist()
  gen = engine.generate(tokens, mask, settings, key=jax.random.key(7), temperature=tau)
  r = gen.rollout
  t0 = _lap(out, "generate", t0)
  try:  # another temperature than the engine's log-prob temperature: refused before sampling (issue 33 item 12)
    engine.generate(tokens, mask, settings, key=jax.random.key(7), temperature=(tau or 1.0) + 0.3)
    out["other_temperature_error"] = None
  except ValueError as e:
    out["other_temperature_error"] = str(e)
  try:  # expert routing: the built-in sampler's only (issue 34 item 5), refused before sampling
    engine.generate(tokens, mask, dataclasses.replace(settings, record_routing=True), key=jax.random.key(7))
    out["record_routing_error"] = None
  except ValueError as e:
    out["record_routing_error"] = str(e)
  lib, logits = library(model, r, tau if tau > 0 else 1.0)
  m = np.asarray(r.mask)
  out["tokens"] = int(m.sum())
  out["max_abs_logp"] = float(np.abs(lib - r.log_probs)[m].max())
  out["mean_abs_logp"] = float(np.abs(lib - r.log_probs)[m].mean())
  log_r = (lib - r.log_probs)[m].astype(np.float64)  # log π/μ: the trainer's engine/mismatch_k3 of these tokens
  out["mismatch_k3"] = float(np.mean(np.exp(log_r) - log_r - 1))
  logz = logits - np.logaddexp.reduce(logits, -1, keepdims=True)
  out["entropy"] = float(-(np.exp(logz) * logz).sum(-1)[m].mean())
  out["log_vocab"] = float(np.log(V))
  if settings.top_k or settings.top_p < 1.0:
    allowed = np.asarray(filter_logits(jnp.asarray(logits / (tau or 1.0)), top_k=settings.top_k, top_p=settings.top_p))
    chosen = np.take_along_axis(allowed, np.asarray(r.completions)[..., None], -1)[..., 0]
    out["outside_filter"] = int((~np.isfinite(chosen))[m].sum())
  suppressed = (0,) if settings.suppress_ids is None else tuple(settings.suppress_ids)
  out["suppressed_sampled"] = int(np.isin(np.asarray(r.completions), suppressed)[m].sum())
  comps = np.asarray(r.completions)
  lengths = m.sum(1)
  last = comps[np.arange(len(comps)), np.maximum(lengths - 1, 0)]
  out["stop_rows"] = int((gen.finish_reasons == "stop").sum())
  out["finish_reasons_ok"] = bool(
    np.all((gen.finish_reasons == "stop") == ((last == 1) & (lengths > 0)))
    and np.all((gen.finish_reasons == "length") <= (lengths == settings.max_new_tokens))
    and not np.any((comps[:, :-1] == 1) & m[:, 1:])  # nothing after an EOS
  )
  t0 = _lap(out, "library", t0)
  # greedy: engine token == library argmax given the engine's prefix
  greedy = engine.generate(tokens, mask, settings, key=jax.random.key(8), temperature=0.0).rollout
  t0 = _lap(out, "greedy_generate", t0)
  greedy_logp, glogits = library(model, greedy, 1.0)
  gm = np.asarray(greedy.mask)
  if settings.suppress_ids is None:
    glogits[..., 0] = -np.inf
  top2 = np.sort(glogits, -1)[..., -2:]
  clear = gm & (top2[..., 1] - top2[..., 0] > 1e-3)
  agree = np.argmax(glogits, -1) == np.asarray(greedy.completions)
  out["greedy_positions"] = int(clear.sum())
  out["greedy_agree"] = int((agree & clear).sum())
  out["greedy_max_abs_logp"] = float(np.abs(greedy_logp - greedy.log_probs)[gm].max())
  # an optimizer update, pushed: the engine must follow the new policy (not stale weights or prefix cache)
  t0 = _lap(out, "greedy_library", t0)
  new = update(model, r, lr=case.get("lr", 3e-2))
  t0 = _lap(out, "update", t0)
  engine.push_weights(new)
  out["push2_s"] = engine.push_seconds
  gen2 = engine.generate(tokens, mask, settings, key=jax.random.key(7), temperature=tau).rollout
  m2 = np.asarray(gen2.mask)
  lib_new, lib_old = library(new, gen2, tau or 1.0)[0], library(model, gen2, tau or 1.0)[0]
  out["after_update_max_abs_logp"] = float(np.abs(lib_new - gen2.log_probs)[m2].max())
  out["after_update_vs_old_mean_abs"] = float(np.abs(lib_old - gen2.log_probs)[m2].mean())
  _lap(out, "after_update", t0)
  engine.close()
  return out


CASES = [
  dict(family="gpt2", tied=True),
  dict(family="llama", tied=False, top_k=20),
  dict(family="qwen2", tied=True, top_p=0.9),
  # one qwen3 case for LoRA, another temperature and EOS not suppressed (one engine start fewer in the suite:
  # measured 288 tokens, max |dlogp| 1.7e-5, greedy 288/288, after the update 15.6 nats from the old policy);
  # seed 1: the seed-0 adapters (a CRC of the path) made the model stop early (199 tokens compared)
  dict(family="qwen3", tied=True, lora=True, seed=1, temperature=0.7, suppress_ids=()),
  dict(family="qwen2", tied=False, dtype="bfloat16"),
  # mixtures of experts (issue 35 item 6): the fused-MoE path of vLLM's CPU build, experts through the HF map
  dict(family="qwen3_moe", tied=True, lr=6e-2),  # at 3e-2 its update moved the samples' log-probs 0.95 nats
  dict(family="qwen2_moe", tied=False, top_k=20),
  dict(family="qwen3_moe", tied=False, dtype="bfloat16"),
]


def families(cases=CASES) -> list[dict]:
  """``one_case`` of every case (one engine each, one after the other in this process)."""
  results = []
  for c in cases:
    t0 = time.perf_counter()
    results.append(one_case(c))
    print(f"vllm_checks: {c} {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
  return results


@functools.partial(jax.jit, static_argnums=0, compiler_options=_TEST_OPTIONS)
def _update_adapters(graphdef, adapters, rest, prompt_tokens, prompt_mask, completions, mask, lr):
  opt = optax.adamw(lr)

  def loss(adapters):
    m = nnx.merge(graphdef, adapters, rest)
    logp, _ = completion_log_probs(m, prompt_tokens, prompt_mask, completions, mask, chunk_size=None)
    return -jnp.sum(logp * mask) / jnp.sum(mask)

  grads = jax.grad(loss)(adapters)
  updates, _ = opt.update(grads, opt.init(adapters), adapters)
  return optax.apply_updates(adapters, updates)


def lora_sync(reps: int = 5) -> dict:
  """Adapter-only sync (``VLLMEngine(lora_rank=r)``) against the merged push, in one engine: a Qwen3 LoRA
  policy (rank 4, random B) pushed as adapters, then merged (``lora.merge_lora``, a plain model: the merged
  path), the same prompts and seeds sampled after each; one AdamW step on the adapters only, pushed as
  adapters (the base stays: no base push). Every rollout's log-probs vs the library's; the full weight pushes
  each path made (counted at the engine's ``_reload``) and its push seconds (``reps`` pushes of the same model, the
  engine's ``push_seconds``; recorded, not asserted: BENCHMARKS.md times the two paths)."""
  cfg = config("qwen3", False)
  model = random_model(cfg, 3)
  lora.apply_lora(model, lora.LoRAConfig(rank=4, alpha=8.0), key=jax.random.key(1))
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
    var.set_value(0.2 * jax.random.normal(jax.random.key(zlib.crc32(str(path).encode())), var.get_value().shape))
  settings = SamplingConfig(num_samples=4, max_new_tokens=24, eos_ids=(1,), pad_id=0)
  tokens, mask = prompts(3)
  engine = VLLMEngine(cfg, lora_rank=4, kv_cache_bytes=64 * 2**20)
  out = {}
  base_pushes = []  # one entry per full weight push into vLLM (the engine's _reload): what the adapter path avoids
  reload = engine._reload
  engine._reload = lambda m: (base_pushes.append(1), reload(m))[1]

  def sample_and_compare(name, policy):
    r = engine.generate(tokens, mask, settings, key=jax.random.key(7)).rollout
    lib, _ = library(policy, r, 1.0)
    m = np.asarray(r.mask)
    out[f"{name}_max_abs_logp"] = float(np.abs(lib - r.log_probs)[m].max())
    out[f"{name}_tokens"] = int(m.sum())
    return r

  engine.push_weights(model)
  out["first_adapter_push_s"] = engine.push_seconds  # the base and the adapters
  out["adapter_request"] = engine._lora_request is not None
  r_adapter = sample_and_compare("adapter", model)
  engine.lora_rank = None  # this engine's merged path: push_weights merges the LoRA policy (lora.merge_lora)
  engine.push_weights(model)
  out["merged_request"] = engine._lora_request is not None
  r_merged = sample_and_compare("merged", model)
  same = np.asarray(r_adapter.completions) == np.asarray(r_merged.completions)
  both = np.asarray(r_adapter.mask) & np.asarray(r_merged.mask)
  out["paths_same_tokens"] = float(same[both].mean())
  first = np.cumprod(same | ~both, axis=1).astype(bool) & both  # positions before the first differing token
  out["paths_max_abs_logp"] = float(
    np.abs(np.asarray(r_adapter.log_probs) - np.asarray(r_merged.log_probs))[first].max()
  )
  out["paths_positions"] = int(first.sum())
  merged_s, before = [], len(base_pushes)
  for _ in range(reps):
    engine.push_weights(model)
    merged_s.append(engine.push_seconds)
  out["merged_base_pushes"] = len(base_pushes) - before
  engine.lora_rank = 4
  # an update of the adapters only: the adapter push leaves the base in vLLM (after the merged pushes above,
  # its first push re-sends the base; the timed ones after it do not)
  graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
  r = r_adapter
  new = nnx.merge(
    graphdef,
    _update_adapters(graphdef, adapters, rest, r.prompt_tokens, r.prompt_mask, r.completions, r.mask, 3e-2),
    rest,
  )
  engine.push_weights(new)
  out["adapter_push_after_merged_s"] = engine.push_seconds
  adapter_s, before = [], len(base_pushes)
  for _ in range(reps):
    engine.push_weights(new)
    adapter_s.append(engine.push_seconds)
  out["adapter_base_pushes"] = len(base_pushes) - before
  r_new = sample_and_compare("after_update", new)
  lib_old, _ = library(model, r_new, 1.0)
  out["after_update_vs_old_mean_abs"] = float(np.abs(lib_old - r_new.log_probs)[np.asarray(r_new.mask)].mean())
  out["merged_push_s"] = merged_s
  out["adapter_push_s"] = adapter_s
  engine.close()
  return out


def partial() -> dict:
  """Issue 36: partial rollouts through vLLM (``jaxgrpo.loop.partial.engine.EnginePool``: each boundary
  re-submits every running row as prompt ‖ completion so far; each new version pushed, which resets the prefix
  cache). Three versions (three random Qwen3 models, tied head), k = 2, one group per batch, G = 2, 4 slots,
  prompts of 150–200 tokens (a full 128-token KV block, so re-submissions hit the prefix cache) and K = 4
  tokens per boundary: prompt 0's first row (24 tokens; the others 4) runs across both pushes and is finished
  in batch 3. Every token's engine log-prob vs the library's teacher-forced one under the version it records,
  and vs another version's. Then the checks of the reset itself: the same context sampled after a reload of
  version 0 *without* the reset (the cached version-2 KV is reused: far off), and ``push_weights`` refusing
  while a request holds KV blocks (vLLM cannot reset its prefix cache then)."""
  from types import SimpleNamespace

  from vllm import SamplingParams
  from vllm.inputs import TokensPrompt

  from jaxgrpo.loop.partial.engine import EnginePool

  cfg = config("qwen3", True)
  policies = [random_model(cfg, seed) for seed in (0, 1, 2)]
  tokens, mask = prompts(4, b=8)
  prompt_ids = [t[m].tolist() for t, m in zip(tokens, mask)]
  settings = SamplingConfig(num_samples=2, max_new_tokens=24, eos_ids=(1,), pad_id=0)
  engine = VLLMEngine(cfg, kv_cache_bytes=64 * 2**20)
  pushed = []

  def engine_for(model, version):
    if not pushed or pushed[-1] != version:
      engine.push_weights(model)
      pushed.append(version)
    return engine

  pool = EnginePool(
    engine_for=engine_for,
    engine_sampling=settings,
    sampling=settings,
    temperature=1.0,
    prompt_len=tokens.shape[1],
    num_slots=4,
    refill_every=4,
    budget_of=lambda p, s: 24 if (p, s) == (0, 0) else 4,
  )
  order = iter(range(8))
  taken, infos = [], []
  for batch in (1, 2, 3):
    v = batch - 1
    info = pool.run(
      policies[v],
      v,
      jax.random.key(batch),
      need=1,
      draw=lambda: [next(order)],
      prompt_tokens=prompt_ids,
      batch=batch,
      max_staleness=2,
    )
    infos.append(info)
    taken.append(pool.take(1)[0])
  rows = [r for g in taken for r in g.rows]
  r = SimpleNamespace(
    prompt_tokens=tokens[[row.prompt for row in rows]],
    prompt_mask=mask[[row.prompt for row in rows]],
    completions=np.stack([row.tokens for row in rows]),
    mask=np.arange(settings.max_new_tokens)[None] < np.asarray([row.t for row in rows])[:, None],
  )
  logp = np.stack([row.logp for row in rows])
  versions = np.stack([row.versions for row in rows])
  out = {"taken": [g.prompt for g in taken], "pushed": pushed, "infos": infos, "per_version": []}
  out["spans"] = [sorted(set(row.versions[: row.t].tolist())) for row in rows]
  lib = [library(p, r, 1.0)[0] for p in policies]
  for v in range(3):
    sel = versions == v
    out["per_version"].append(
      {
        "version": v,
        "tokens": int(sel.sum()),
        "max_abs_logp": float(np.abs(lib[v] - logp)[sel].max()),
        "other_version_min_mean_abs": min(float(np.abs(lib[u] - logp)[sel].mean()) for u in range(3) if u != v),
      }
    )
  out["contexts"] = [len(prompt_ids[row.prompt]) + row.t for row in rows]
  # the reset matters: version 0's weights reloaded *without* the reset, the long row's context sampled again
  long = next(row for row in rows if row.t == 24)
  context = np.asarray([prompt_ids[long.prompt] + long.tokens[:20].tolist()], np.int32)
  one = dataclasses.replace(settings, num_samples=1, max_new_tokens=4)
  engine._reload(policies[0])  # no reset: version 2's cached blocks of this context stay
  stale = engine.generate(context, np.ones_like(context, bool), one, key=jax.random.key(9)).rollout
  engine.push_weights(policies[0])  # with the reset
  fresh = engine.generate(context, np.ones_like(context, bool), one, key=jax.random.key(9)).rollout
  for name, g in (("stale_cache", stale), ("after_reset", fresh)):
    # the long row's prompt ‖ 20 tokens ‖ the 4 new ones, in the rows' shapes above (no new compile)
    comp = np.concatenate([long.tokens[:20], np.asarray(g.completions)[0]])
    again = SimpleNamespace(
      prompt_tokens=np.repeat(tokens[[long.prompt]], len(rows), 0),
      prompt_mask=np.repeat(mask[[long.prompt]], len(rows), 0),
      completions=np.repeat(comp[None], len(rows), 0),
      mask=np.repeat((np.arange(24) < 20 + np.asarray(g.mask)[0].sum())[None], len(rows), 0),
    )
    lp = library(policies[0], again, 1.0)[0][0, 20:]
    out[f"{name}_max_abs_logp"] = float(np.abs(lp - np.asarray(g.log_probs)[0])[np.asarray(g.mask)[0]].max())
  # a request holding KV blocks: vLLM cannot reset its prefix cache, so the push refuses
  core = engine.llm.llm_engine
  core.add_request("jaxgrpo-probe", TokensPrompt(prompt_token_ids=prompt_ids[0]), SamplingParams(max_tokens=8))
  core.step()
  try:
    engine.push_weights(policies[1])
    out["held_blocks_error"] = None
  except RuntimeError as e:
    out["held_blocks_error"] = str(e)
  core.abort_request(["jaxgrpo-probe"])
  engine.push_weights(policies[1])  # nothing holds a block now: the reset succeeds
  engine.close()
  return out


def engine_api() -> dict:
  """The engine's checks at construction and its log filters: a head size vLLM's CPU attention lacks (16) is
  refused before vLLM starts; warnings from the filtered loggers that are not the expected ones still show
  (the test reads this process's stderr)."""
  import logging

  small = dataclasses.replace(config("qwen3", True), hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16)
  t0 = time.perf_counter()
  try:
    VLLMEngine(small, kv_cache_bytes=64 * 2**20)
    head_error = None
  except ValueError as e:
    head_error = str(e)
  seconds = time.perf_counter() - t0
  # the same loggers, other messages / causes: these must reach stderr
  logging.getLogger("vllm.renderers.base").warning(
    "Chat template warmup failed", exc_info=RuntimeError("jaxgrpo-probe")
  )
  layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
  layerwise.warning("%s: Failed to load weights", "JaxgrpoProbeLinear")
  layerwise.warning("%s: Failed to load weights", "ParallelLMHead")  # not during a tied model's push: a real one
  return {"head_error": head_error, "head_error_s": seconds}


def main(argv):
  check, path = argv[1], argv[2]
  if check == "partial":
    results = partial()
  elif check == "families":
    results = families(CASES[int(argv[3]) if len(argv) > 3 else 0 :])
  else:
    raise SystemExit(f"unknown check {check!r}")
  with open(path, "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main(sys.argv)
