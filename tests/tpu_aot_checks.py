"""Programs compiled for a TPU slice from this CPU host, and the CPU programs' fingerprints.

Run as a child by tests/test_tpu_aot.py with ``.venv-tpu/bin/python`` (scripts/setup_tpu_venv.sh: jax[tpu] with
libtpu, no TPU attached: ``jax.experimental.topologies`` gives compile-only devices), and imported by
tests/test_target_platform.py in the main environment (:func:`cpu_program_hashes`). Imports nothing of the test
helpers (the side venv has no pytest or hypothesis).

    python tests/tpu_aot_checks.py tpu          # one JSON line: TPU dots, memory analysis, CPU hashes (side venv)
    python tests/tpu_aot_checks.py cpu-hashes   # the CPU programs' hashes, to re-pin CPU_PROGRAM_SHA256
    python tests/tpu_aot_checks.py fix          # jaxgrpo.plan's fix search on FIX_MODEL for v5e:2x2 (side venv)
    python tests/tpu_aot_checks.py tpu splash   # several reports in one process: {"tpu": ..., "splash": ...}

:data:`CPU_PROGRAM_SHA256` pins the sha256 of the lowered StableHLO text of small CPU programs (train step and
sampler of a bf16 model, a mixture of experts' step) as main produced them before the target platform was read
from the mesh (commit 1ed8a20): reading it must not change a CPU program by one byte. A deliberate change of those
programs re-pins them with the second command (say why in the commit). Re-pinned since: the sampler's four, when
GRPO's untruncated draw stopped writing ``[N, V]`` temporaries (``sampling.block_draw``, issue 51 item 4).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxgrpo as jg
from jaxgrpo import models
from jaxgrpo.models.backend import cpu_bf16_dots, cpu_kv_cache
from jaxgrpo.rollout import sampling

#: the TPU slice of the checks: v5e-4 (4 chips, one host), MaxText's argument values for it
TOPOLOGY = dict(
  platform="tpu",
  topology_name="v5e:2x2",
  chip_config_name="default",
  chips_per_host_bounds=(2, 2, 1),
  num_slices=1,
  wrap=(False, False, False),
)
MESH = "data=2,fsdp=2"
G = 4
#: the model whose sharded state is counted: one Qwen3 layer, every weight matrix's dims multiples of 128 (the
#: per-chip arrays fill whole TPU tiles, so the compiler's byte counts hold no padding beyond a few KiB)
SIZED = dict(vocab_size=5120, hidden_size=512, num_layers=1, num_heads=4, num_kv_heads=4, head_dim=128)
SIZED_F = 2048
SIZED_BATCH = dict(b=32, p=128, t=128)

CPU_PROGRAM_SHA256 = {
  "dense_step/float32": "4c318d7535bfab01509925474d8fe2c363fea932ee4893816487a94bac074918",
  "dense_step/native": "9288f261850c8a48c4081cabc27d492af42531b38a7d01340f9a84eeebbea8dc",
  "moe_step/float32": "44e09a69ce68ec58f9dfc683b84972c96dd73c8c11790c9e581a308fdd302cd5",
  "moe_step/native": "d0f39e7a07e7b40cb2d393714812a8f1fdb2bd1bae8dd5c920372a14489714f3",
  "sampler/float32/kv_compute": "f3ecfe3f7b6886915a50fb895ed980b7319aa82e57321ca8b84bf58b73102504",
  "sampler/float32/kv_float32": "99014a8ba4ae736024cafc592e3bcc81d2ceda612b41be0d39d5de5e729f8360",
  "sampler/native/kv_compute": "eab8fc880a33c35002b772a833ae9bff496c6fe353796b2e9117afcf81d66387",
  "sampler/native/kv_float32": "a8bc1bb93d07f8087dd6238f06f124837067d755fc6b6fef82060fa5f5cf1a27",
}


def dense_config(**over):
  """A Qwen3 config (tied embeddings, q/k norms); ``over`` replaces fields."""
  base = dict(
    vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8, intermediate_size=64
  )
  return models.Qwen3Config(**{**base, **over}, tie_word_embeddings=True)


def moe_config():
  """A 2-layer Qwen3-MoE config: 8 experts of width 32, top-2."""
  return models.Qwen3MoeConfig(
    vocab_size=128,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    head_dim=8,
    intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    tie_word_embeddings=True,
  )


def make_batch(b: int = 16, p: int = 4, t: int = 12, vocab: int = 128, seed: int = 0) -> jg.Batch:
  """A NumPy GRPO batch of ``b`` rows in groups of :data:`G` (prompt ``p``, completion ``t`` tokens)."""
  rng = np.random.default_rng(seed)
  mask = np.arange(t)[None] < rng.integers(1, t + 1, b)[:, None]
  return jg.Batch(
    prompt_tokens=rng.integers(1, vocab, (b, p)).astype(np.int32),
    prompt_mask=np.ones((b, p), bool),
    completions=np.where(mask, rng.integers(1, vocab, (b, t)), 0).astype(np.int32),
    mask=mask,
    old_logp=np.where(mask, -3.0, 0.0).astype(np.float32),
    group_ids=np.repeat(np.arange(b // G), G).astype(np.int32),
    rewards=rng.random(b).astype(np.float32),
  )


def dot_types(text: str) -> list[str]:
  """``"(lhs type, rhs type) -> out type"`` of every ``stablehlo.dot_general`` in a lowered module's text."""
  return [line.rsplit(":", 1)[1].strip() for line in text.splitlines() if "stablehlo.dot_general" in line]


def f32_dots(text: str) -> list[str]:
  """The dots of ``text`` whose two operands are both float32."""
  return [d for d in dot_types(text) if d.split("->")[0].count("xf32>") == 2]


def _step(cfg, mesh, *, abstract: bool, mu_dtype=None, micro_batches: int = 2):
  """``(step, state)``: a GRPO train step (AdamW) for a bf16 model of ``cfg`` on ``mesh``; the state abstract
  (``init_train_state(..., abstract=True)`` of an ``nnx.eval_shape`` model: nothing allocated) or real."""
  build = lambda: models.build_model(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  model = nnx.eval_shape(build) if abstract else build()
  opt = optax.adamw(1e-3, mu_dtype=mu_dtype)
  extra = dict(abstract=True) if abstract else {}
  graphdef, state, shardings = jg.init_train_state(model, opt, mesh, **extra)
  tc = jg.TrainConfig(micro_batches=micro_batches, group_size=G)
  step = jg.make_train_step(graphdef, opt, jg.preset("grpo"), mesh=mesh, shardings=shardings, train_config=tc)
  return step, state


def _sampler_text(graphdef, state, prompts, prompt_mask, key, mesh=None) -> str:
  """The StableHLO of ``generate``'s program (G samples of 8 new tokens) for the model's arrays as given, traced
  for the platform of those arrays (``sampling.lower_generate``: as ``generate`` traces it), or in ``mesh``."""
  model = nnx.merge(graphdef, state)
  config = sampling.SamplingConfig(num_samples=G, max_new_tokens=8, eos_ids=(1,), pad_id=0)  # suppresses the pad id
  policy = sampling.SamplingPolicy.from_config(config, temperature=1.0, vocab_size=model.config.vocab_size)
  return sampling.lower_generate(model, prompts, prompt_mask, policy, key=key, mesh=mesh).as_text()


def _sha(lower) -> str:
  """sha256 of the StableHLO text of ``lower()``, traced afresh: ``jax.jit`` caches a trace by its arguments'
  types, not by the trace-time switches (``cpu_bf16_dots``, ``cpu_kv_cache``), so the caches are cleared first."""
  jax.clear_caches()
  return hashlib.sha256(lower().encode()).hexdigest()


def cpu_program_hashes(modes=("native", "float32"), moe: bool = True) -> dict[str, str]:
  """sha256 of the StableHLO text of the CPU programs pinned by :data:`CPU_PROGRAM_SHA256`, on a 1-device CPU
  mesh, under the ``cpu_bf16_dots`` ``modes`` (whatever this CPU's AMX); ``moe``: the MoE step's too."""
  cpu = jax.devices("cpu")[:1]
  mesh = jg.make_mesh("data=1", devices=cpu)
  batch = make_batch()
  out = {}
  dense_step, dense_state = _step(dense_config(), mesh, abstract=False)
  moe_step, moe_state = _step(moe_config(), mesh, abstract=False) if moe else (None, None)
  model = models.build_model(dense_config(), rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  graphdef, state = nnx.split(model)
  prompts = jax.device_put(batch.prompt_tokens[::G], cpu[0])
  prompt_mask = jax.device_put(batch.prompt_mask[::G], cpu[0])
  key = jax.device_put(jax.random.key(0), cpu[0])
  for mode in modes:
    with cpu_bf16_dots(mode):
      out[f"dense_step/{mode}"] = _sha(lambda: dense_step.lower(dense_state, batch).as_text())
      if moe:
        out[f"moe_step/{mode}"] = _sha(lambda: moe_step.lower(moe_state, batch).as_text())
      for cache in ("float32", "compute"):
        with cpu_kv_cache(cache):
          out[f"sampler/{mode}/kv_{cache}"] = _sha(lambda: _sampler_text(graphdef, state, prompts, prompt_mask, key))
  return out


def _abstract(x, sharding):
  return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sharding)


def tpu_report() -> dict:
  """Programs compiled for :data:`TOPOLOGY` from this host: the dots of the sized bf16 model's train step and
  sampler, and of a mixture of experts' step (StableHLO); the step's ``memory_analysis()`` (compiled) with the
  model's dimensions; the CPU programs' hashes in this environment; seconds per phase."""
  from jax.experimental import topologies
  from jax.sharding import NamedSharding, PartitionSpec

  t0 = time.perf_counter()
  devices = topologies.get_topology_desc(**TOPOLOGY).devices
  mesh = jg.make_mesh(MESH, devices=devices)
  cfg = dense_config(**SIZED, intermediate_size=SIZED_F)
  step, state = _step(cfg, mesh, abstract=True, mu_dtype=jnp.float32)
  batch = make_batch(**SIZED_BATCH, vocab=cfg.vocab_size)
  lowered = step.lower(state, batch)
  step_text = lowered.as_text()
  t1 = time.perf_counter()
  memory = lowered.compile().memory_analysis()
  t2 = time.perf_counter()
  moe_step, moe_state = _step(moe_config(), mesh, abstract=True)
  moe_text = moe_step.lower(moe_state, make_batch()).as_text()
  replicated = NamedSharding(mesh, PartitionSpec())
  rows = step.batch_sharding
  graphdef = nnx.split(nnx.eval_shape(lambda: models.build_model(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)))[0]
  sample_state = nnx.State.merge(state.params, state.frozen)
  prompts = batch.prompt_tokens[:: G * 2][:4]  # 4 prompts: divisible by data × fsdp
  sample_args = (
    graphdef,
    sample_state,
    _abstract(prompts, rows),
    _abstract(np.ones(prompts.shape, bool), rows),
    jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated),
  )
  sample_text = _sampler_text(*sample_args)
  sample_mesh_text = _sampler_text(*sample_args, mesh=mesh)  # lower_generate(..., mesh=): the mesh's platform
  try:  # the real state cannot be placed on compile-only devices: one line saying so
    _step(dense_config(), mesh, abstract=False)
    refusal = None
  except ValueError as e:
    refusal = str(e)
  t3 = time.perf_counter()
  hashes = cpu_program_hashes(modes=("native",), moe=False)  # a few of them: libtpu changes no CPU program
  t4 = time.perf_counter()
  return {
    "device_kind": devices[0].device_kind,
    "platform": devices[0].platform,
    "chips": len(devices),
    "default_backend": jax.default_backend(),
    "step_dots": dot_types(step_text),
    "step_f32_dots": f32_dots(step_text),
    "sample_dots": dot_types(sample_text),
    "sample_f32_dots": f32_dots(sample_text),
    "sample_mesh_dots": dot_types(sample_mesh_text),
    "sample_mesh_f32_dots": f32_dots(sample_mesh_text),
    "moe_f32_dots": f32_dots(moe_text),
    "moe_ragged_dot": "ragged_dot" in moe_text,
    "memory": {
      "argument": memory.argument_size_in_bytes,
      "output": memory.output_size_in_bytes,
      "alias": memory.alias_size_in_bytes,
      "temp": memory.temp_size_in_bytes,
    },
    "cpu_hashes": hashes,
    "concrete_refusal": refusal,
    "seconds": {"lower": t1 - t0, "compile": t2 - t1, "moe_and_sampler": t3 - t2, "cpu_hashes": t4 - t3},
  }


#: a one-layer Qwen3 whose float32 logits dominate the step: 32 rows per chip x 256 completion tokens x a vocabulary
#: of 2**19 x 4 bytes = 16 GiB at one micro-batch (more than a v5e chip's 15.75 GiB), 8 GiB at two
FIX_MODEL = dict(model_type="qwen3", vocab_size=2**19, hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64, intermediate_size=256, max_position_embeddings=4096,
                 tie_word_embeddings=True)  # fmt: skip
#: the run: scripts/configs/demo.yaml (float32, no chunking of the head: its logits are whole) with these overrides
FIX_OVERRIDES = {"rollout.prompts_per_step": 16, "rollout.group_size": 8, "rollout.max_new_tokens": 256,
                 "data.max_prompt_tokens": 64, "objective.beta": 0.0}  # fmt: skip


def fix_search_report() -> dict:
  """``jaxgrpo.plan.plan_run`` of the step of :data:`FIX_OVERRIDES` on :data:`FIX_MODEL` for ``v5e:2x2`` (4
  chips), with the fix search: the step's verdict, the compiler's error, what the search compiled, the refusal."""
  import os
  import tempfile

  from jaxgrpo import plan
  from jaxgrpo.run import specs

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "config.json")
    with open(path, "w") as f:
      json.dump(FIX_MODEL, f)
    model_config = plan.model_config(path)
  cfg = specs.load_config(os.path.join(root, "scripts", "configs", "demo.yaml"), dict(FIX_OVERRIDES))
  t0 = time.perf_counter()
  result = plan.plan_run(cfg, plan.parse_target("v5e:2x2"), model_config, programs=("step",), log=None)
  (step,) = result.programs
  return {
    "mesh": result.mesh,
    "verdict": step.verdict,
    "error": step.error,
    "tried": step.tried,
    "fix": step.fix,
    "refusal": result.refusal,
    "seconds": time.perf_counter() - t0,
  }


#: a tiny bf16 Qwen3 whose rows (128 prompt + 512 completion tokens) reach the model's kernel attention (auto:
#: dense below 512 positions), head dim 128 (the splash kernel's lane width), on the slice as ``fsdp=4``
SPLASH_MODEL = dict(vocab_size=1024, hidden_size=256, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=128)
SPLASH_MESH = "fsdp=4"


def splash_step_report() -> dict:
  """The GRPO step of :data:`SPLASH_MODEL` (attention ``auto``) compiled for :data:`TOPOLOGY` partitioned over
  its 4 chips: the implementation the model resolves, whether the lowered program holds the Mosaic kernel
  (``tpu_custom_call``) inside a ``shard_map`` (``sdy.manual_computation``), and the compiled memory."""
  from jax.experimental import topologies

  from jaxgrpo.models.attention import resolve_implementation

  t0 = time.perf_counter()
  devices = topologies.get_topology_desc(**TOPOLOGY).devices
  mesh = jg.make_mesh(SPLASH_MESH, devices=devices)
  step, state = _step(dense_config(**SPLASH_MODEL, intermediate_size=512), mesh, abstract=True)
  batch = make_batch(b=16, p=128, t=512, vocab=SPLASH_MODEL["vocab_size"])
  lowered = step.lower(state, batch)
  text = lowered.as_text()
  with jax.set_mesh(mesh):
    chosen = resolve_implementation("auto", 128 + 512)
  memory = lowered.compile().memory_analysis()
  return {
    "platform": devices[0].platform,
    "chips": len(devices),
    "implementation": chosen,
    "mosaic_kernel": "tpu_custom_call" in text,
    "shard_map": "sdy.manual_computation" in text,
    "temp_bytes": memory.temp_size_in_bytes,
    "seconds": time.perf_counter() - t0,
  }


REPORTS = {"tpu": tpu_report, "fix": fix_search_report, "splash": splash_step_report}


def reports(names: list[str]) -> dict:
  """Several reports in this one process (one start-up, one libtpu load): ``{name: report}``, a report that raised
  as ``{"failed": its traceback}`` (the others still run; ``"error"`` is a field of the fix report)."""
  import traceback

  out = {}
  for name in names:
    try:
      out[name] = REPORTS[name]()
    except Exception:  # noqa: BLE001 - reported to the test that reads this report
      out[name] = {"failed": traceback.format_exc()}
      print(out[name]["failed"], file=sys.stderr, flush=True)
  return out


if __name__ == "__main__":
  names = sys.argv[1:] or ["tpu"]
  if len(names) > 1:  # python tests/tpu_aot_checks.py tpu splash: {"tpu": ..., "splash": ...}
    result = reports(names)
  else:
    result = REPORTS.get(names[0], cpu_program_hashes)()
  print(json.dumps(result, sort_keys=True))
