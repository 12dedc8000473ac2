"""Ring attention over a ``context`` mesh axis of 8 CPU devices (a child process with 8 virtual devices) equals the
unsharded blockwise attention and the NumPy formula: values and the gradients of q, k, v, on packed and
left-padded rows whose segments cross the shard boundaries."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import run_child
from test_attention_blockwise import _reference

pytestmark = [pytest.mark.subprocess]

CHILD = r"""
import json, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxgrpo.kernels.attention import blockwise_attention
from jaxgrpo.parallel.ring_attention import ring_attention

inputs = {k: np.asarray(v) for k, v in json.loads(open(__import__("sys").argv[1]).read()).items()}
q, k, v, w = (jnp.asarray(inputs[n], jnp.float32) for n in ("q", "k", "v", "w"))
seg = jnp.asarray(inputs["seg"], jnp.int32)
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "context"))
on_context = NamedSharding(mesh, P(None, "context"))
q, k, v, seg = (jax.device_put(x, on_context) for x in (q, k, v, seg))

def ring(q, k, v):
  return ring_attention(q, k, v, seg, mesh, axis="context", block_q=4, block_kv=8)

def flat(q, k, v):
  return blockwise_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, block_q=8, block_kv=8)

result = {}
for name, fn in (("ring", ring), ("flat", flat)):
  out, vjp = jax.vjp(jax.jit(fn), q, k, v)
  result[name] = [np.asarray(x).tolist() for x in (out, *vjp(w))]
try:
  ring_attention(q, k, v, seg, mesh, axis="sequence")
except ValueError as e:
  result["refusal"] = str(e)
print(json.dumps(result))
"""


def test_ring_attention_on_8_devices_equals_the_unsharded_attention(tmp_path):
  rng = np.random.default_rng(21)
  B, S, H, N, K = 2, 64, 4, 2, 8  # 4 context shards of 16 tokens
  seg = np.array([[0] * 5 + [1] * 30 + [2] * 29, [1] * 10 + [2] * 3 + [3] * 51], np.int32)
  arrays = {
    "q": rng.normal(size=(B, S, H, K)),
    "k": rng.normal(size=(B, S, N, K)),
    "v": rng.normal(size=(B, S, N, K)),
    "w": rng.normal(size=(B, S, H, K)) * (seg > 0)[..., None, None],
    "seg": seg,
  }
  path = tmp_path / "inputs.json"
  path.write_text(json.dumps({n: np.asarray(a).tolist() for n, a in arrays.items()}))
  result = json.loads(run_child(CHILD, devices=8, args=[str(path)]).strip().splitlines()[-1])
  f32 = {n: np.asarray(a, np.float32) for n, a in arrays.items()}
  want = _reference(f32["q"], f32["k"], f32["v"], f32["w"], seg, seg)
  for name, ring, flat, ref in zip(("out", "dq", "dk", "dv"), result["ring"], result["flat"], want):
    np.testing.assert_allclose(np.asarray(ring), np.asarray(flat), rtol=1e-5, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(np.asarray(ring), ref, rtol=1e-5, atol=1e-5, err_msg=name)
  assert "'sequence' is not an axis of the mesh" in result["refusal"], result
