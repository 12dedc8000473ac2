"""Child of tests/test_rollout_quant_tpu.py, run by the TPU side environment's python (``.venv-tpu``): the built-in
sampler of a bf16 Qwen3 (dense, and a mixture of experts) with int8 rollout weights
(``SamplingConfig(quantize="int8")``), lowered and compiled for one chip of a compile-only v5e slice
(``jax.experimental.topologies``, no TPU needed). Prints one JSON line: the StableHLO dots' operand types, and in the
compiled (optimised) HLO the fusions that hold a dot (``convolution`` on TPU) with, for each, the element types of
its parameters — whether the int8 codes enter the fusion that multiplies (the convert fused into the product) or a
separate bf16 copy of the weight is materialised first.
"""

from __future__ import annotations

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tpu_aot_checks import TOPOLOGY  # the same v5e-4 slice as the other TPU checks

from jaxgrpo import models
from jaxgrpo.rollout import sampling

#: a one-layer Qwen3 with TPU-tile-sized projections (multiples of 128), and a Qwen3-MoE of the same widths
DENSE = dict(vocab_size=1024, hidden_size=256, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=128)
MOE = dict(DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256)
G, B, P, T = 4, 2, 16, 8


def _dot_types(text: str) -> list[str]:
  return [line.rsplit(":", 1)[1].strip() for line in text.splitlines() if "stablehlo.dot_general" in line]


def _computations(hlo: str) -> list[dict]:
  """Every computation of the optimised HLO whose parameters include an int8 array, or that multiplies
  (``convolution``/``dot``/``ragged-dot``/a custom call): its name, whether it multiplies, the element types of its
  array parameters and of its root, and the computations that call it (``calls=``)."""
  blocks = {b.split(" ", 1)[0].lstrip("%"): b for b in re.split(r"\n(?=\S)", hlo) if b.strip()}
  callers: dict[str, list[str]] = {}
  for name, block in blocks.items():
    for callee in re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", block):
      callers.setdefault(callee, []).append(name)
  out = []
  for name, block in blocks.items():
    params = re.findall(r"= (\w+)\[[^\]]*\][^ ]* parameter\(", block)
    product = bool(re.search(r" (convolution|dot|ragged-dot|custom-call)\(", block))
    root = re.search(r"ROOT \S+ = \(?(\w+)\[", block)
    if product or "s8" in params:
      out.append({
        "name": name, "product": product, "params": params, "root": root.group(1) if root else None,
        "callers": callers.get(name, []),
      })  # fmt: skip
  return out


def _report(cfg, device) -> dict:
  build = lambda: models.build_model(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  config = sampling.SamplingConfig(num_samples=G, max_new_tokens=T, quantize="int8")
  # the sampler's model, as generate builds it (model_to_sample: rollout_weights), traced abstractly
  model = nnx.eval_shape(lambda: config.model_to_sample(build()))
  graphdef, state = nnx.split(model)
  place = jax.sharding.SingleDeviceSharding(device)
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=place), state)
  model = nnx.merge(graphdef, state)
  policy = sampling.SamplingPolicy.from_config(config, temperature=1.0, vocab_size=cfg.vocab_size)
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=place)
  lowered = sampling.lower_generate(
    model, spec((B, P), jnp.int32), spec((B, P), jnp.bool_), policy, key=spec((), jax.random.key(0).dtype)
  )
  hlo = lowered.compile().as_text()
  leaves = [(jax.tree_util.keystr(p), str(x.dtype)) for p, x in jax.tree_util.tree_leaves_with_path(state)]
  return {
    "state_dtypes": sorted({d for _, d in leaves}),
    "codes": sum(1 for p, d in leaves if "codes" in p and d == "int8"),
    "dots": _dot_types(lowered.as_text()),
    "ragged_dot": "ragged_dot" in lowered.as_text(),
    "computations": _computations(hlo),
  }


def main() -> None:
  from jax.experimental import topologies

  device = topologies.get_topology_desc(**TOPOLOGY).devices[0]
  report = {
    "platform": device.platform,
    "device_kind": device.device_kind,
    "dense": _report(models.Qwen3Config(**DENSE, intermediate_size=512, tie_word_embeddings=True), device),
    "moe": _report(models.Qwen3MoeConfig(**MOE, intermediate_size=512, tie_word_embeddings=True), device),
  }
  print(json.dumps(report))


if __name__ == "__main__":
  np.set_printoptions(linewidth=200)
  sys.exit(main())
