"""The attention dispatcher compiled ahead of time for a TPU chip from this CPU host (no TPU attached).

Run as a child by tests/test_attention_platforms.py with ``.venv-tpu/bin/python`` (scripts/setup_tpu_venv.sh:
jax[tpu] with libtpu; ``jax.experimental.topologies`` gives compile-only devices). Prints one JSON line: for the
gradient of ``jaxgrpo.parallel.attention.attention(..., implementation="auto")`` at Qwen3-8B's attention shapes
(32 query heads, 8 key/value heads of 128, bf16; a linear read-out ``⟨out, w⟩``) on one row of ``S`` tokens, the implementation chosen, whether the
lowered program holds the Mosaic (Pallas TPU) kernel, and the compiled program's memory analysis.

    python tests/attention_tpu_aot.py 16384 32768  # one JSON line, a report per length
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tpu_aot_checks import TOPOLOGY  # the v5e:2x2 slice of tests/test_tpu_aot.py (this script's folder)

from jaxgrpo.parallel.attention import attention, choose_implementation

H, N, K = 32, 8, 128  # Qwen3-8B: 32 query heads, 8 key/value heads, head dim 128


def report(S: int) -> dict:
  from jax.experimental import topologies

  device = topologies.get_topology_desc(**TOPOLOGY).devices[0]
  mesh = Mesh(np.array([device]), ("data",))
  here = NamedSharding(mesh, PartitionSpec())
  spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=here)

  def loss(q, k, v, seg, w):  # a linear read-out: the cotangent of the attention output is w
    return jnp.vdot(attention(q, k, v, seg), w)

  with jax.set_mesh(mesh):
    chosen = choose_implementation("auto")
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    lowered = grad.lower(
      spec(1, S, H, K), spec(1, S, N, K), spec(1, S, N, K), spec(1, S, dtype=jnp.int32), spec(1, S, H, K)
    )
  text = lowered.as_text()
  memory = lowered.compile().memory_analysis()
  return {
    "platform": device.platform,
    "device_kind": device.device_kind,
    "default_backend": jax.default_backend(),
    "implementation": chosen,
    "mosaic_kernel": "tpu_custom_call" in text,
    "tokens": S,
    "argument_bytes": memory.argument_size_in_bytes,
    "temp_bytes": memory.temp_size_in_bytes,
    "output_bytes": memory.output_size_in_bytes,
  }


if __name__ == "__main__":
  print(json.dumps([report(int(s)) for s in sys.argv[1:]]))
