"""``jaxgrpo.parallel.attention.attention``: the implementation chosen by the target platform (not the host), the
splash kernel's values and gradients in Pallas interpret mode on the CPU, the cuDNN call's mask mapping (the same
``jax.nn.dot_product_attention`` call with XLA's implementation), and the splash kernel compiled ahead of time for
a TPU chip at Qwen3-8B's attention shapes (the side venv ``.venv-tpu/``), its memory linear in the length."""

from __future__ import annotations

import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, ensure_side_venv, run_child, tpu_child_env
from jax.sharding import PartitionSpec as P
from test_attention_blockwise import _inputs, _reference

from jaxgrpo.parallel.attention import attention, choose_implementation, default_blocks, gpu_fused, splash_partition
from jaxgrpo.parallel.target import target_platform

# packed (segments 1, 2 then padding) and left-padded rows
SEG = np.array([[1] * 90 + [2] * 100 + [0] * 10, [0] * 37 + [1] * 163], np.int32)


def _grads(fn, q, k, v, d_out):
  (_, out), grads = jax.value_and_grad(lambda *a: (jnp.sum(fn(*a) * d_out), fn(*a)), argnums=(0, 1, 2), has_aux=True)(
    q, k, v
  )
  return out, grads


def _assert_equal_on_real_rows(fn, H, N, tol=2e-5):
  """``fn(q, k, v)`` against the NumPy formula, values and gradients; padding query rows must be zero."""
  q, k, v, d_out = _inputs(2, SEG.shape[1], SEG.shape[1], H, N, 16, seed=11)
  d_out = d_out * (SEG > 0)[..., None, None]
  out, grads = _grads(fn, q, k, v, d_out)
  ref = _reference(q, k, v, d_out, SEG, SEG)
  assert np.all(np.asarray(out)[SEG == 0] == 0)
  for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), ref):
    np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol, err_msg=name)


def test_auto_follows_the_target_platform_not_the_host():
  assert jax.default_backend() == "cpu"
  assert choose_implementation("auto") == "blockwise"
  with target_platform("tpu"):
    assert choose_implementation("auto") == "splash" and default_blocks() == (512, 512)
  with target_platform("gpu"):
    assert choose_implementation("auto") == "cudnn" and default_blocks() == (128, 128)
  assert choose_implementation("blockwise", "tpu") == "blockwise" and default_blocks("cpu") == (128, 256)
  with pytest.raises(ValueError, match="implementation"):
    choose_implementation("flash")


def test_a_partitioned_tpu_program_gets_splash_with_its_shard_map_specs():
  """Inside a program traced under a context mesh of several devices, `auto` on TPU is splash (before: blockwise,
  and `splash` named was refused), run per device by `jax.shard_map`: rows over data × fsdp, heads over tensor, each
  only where it divides (4 rows on data=2 × fsdp=2; 3 rows: no batch axis; 1 kv head: no head axis)."""
  mesh = jax.sharding.AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))
  with target_platform("tpu"), jax.sharding.use_abstract_mesh(mesh):
    assert choose_implementation("auto") == "splash" and choose_implementation("splash") == "splash"
    assert splash_partition(4, 8) == (P(("data", "fsdp"), None, ("tensor",), None),) * 2 + (P(("data", "fsdp"), None),)
    assert splash_partition(2, 1)[0] == P(("data",), None, None, None)
    assert splash_partition(3, 2)[1] == P(None, None, ("tensor",), None)


SHARDED_CHILD = r"""
import json, sys, jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxgrpo.parallel.attention import attention
from jaxgrpo.parallel.sharding import make_mesh

inputs = {k: np.asarray(v) for k, v in json.loads(open(sys.argv[1]).read()).items()}
q, k, v, w = (jnp.asarray(inputs[n], jnp.float32) for n in ("q", "k", "v", "w"))
seg = jnp.asarray(inputs["seg"], jnp.int32)
mesh = make_mesh("data=2,fsdp=2,tensor=2")

def splash(q, k, v):  # interpret=True: the Pallas kernel run by its interpreter on these CPU devices
  return attention(q, k, v, seg, implementation="splash", interpret=True, block_q=128)

with jax.set_mesh(mesh):
  q, k, v = (jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), None, "tensor"))) for x in (q, k, v))
  fn = jax.jit(jax.grad(lambda q, k, v: jnp.vdot(splash(q, k, v), w), argnums=(0, 1, 2)))
  text = fn.lower(q, k, v).as_text()
  out, grads = jax.jit(splash)(q, k, v), fn(q, k, v)
print(json.dumps({"manual": "sdy.manual_computation" in text or "SPMDFullToShardShape" in text,
                  "out": np.asarray(out).tolist(), "grads": [np.asarray(g).tolist() for g in grads]}))
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_splash_under_shard_map_on_8_devices_equals_the_formula(tmp_path):
  """The splash kernel (named: on CPU devices `auto` is blockwise; Pallas interpret mode) inside its `shard_map`
  wrapper on 8 CPU devices, data=2 × fsdp=2 ×
  tensor=2 (one row and one kv head of 2 query heads per device), packed and left-padded rows: the program is
  manually partitioned, and values and gradients equal the NumPy formula (before: `auto` took blockwise here)."""
  seg = np.concatenate([SEG, SEG[::-1]])
  q, k, v, w = _inputs(4, seg.shape[1], seg.shape[1], 4, 2, 16, seed=13)
  w = w * (seg > 0)[..., None, None]
  path = tmp_path / "inputs.json"
  path.write_text(json.dumps({n: np.asarray(a).tolist() for n, a in dict(q=q, k=k, v=v, w=w, seg=seg).items()}))
  result = json.loads(run_child(SHARDED_CHILD, devices=8, args=[str(path)]).strip().splitlines()[-1])
  assert result["manual"], "the splash kernel did not run inside shard_map"
  ref = _reference(q, k, v, w, seg, seg)
  for name, got, want in zip(("out", "dq", "dk", "dv"), (result["out"], *result["grads"]), ref):
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("H,N", [(4, 2), (4, 1)])
def test_blockwise_path_equals_the_formula(H, N):
  _assert_equal_on_real_rows(lambda q, k, v: attention(q, k, v, SEG, implementation="auto"), H, N)


def test_bf16_inputs_run_on_the_cpu():
  """bf16 q, k, v on XLA:CPU (whose batched dot has no bf16 × bf16 → f32 kernel): float32 operands, so the result
  equals the float32 call on the bf16-rounded inputs to bf16 rounding."""
  q, k, v, _ = _inputs(2, SEG.shape[1], SEG.shape[1], 4, 2, 16, seed=12)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  got = attention(q, k, v, SEG)
  want = attention(*(x.astype(jnp.float32) for x in (q, k, v)), SEG)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2)


def test_gpu_call_maps_segments_to_the_mask():
  """The arguments the cuDNN path passes (``gpu_fused``), run by XLA's implementation of the same call on the CPU
  (no GPU here: the cuDNN kernel itself runs only on an NVIDIA GPU)."""

  def fn(q, k, v):
    out = gpu_fused(q, k, v, jnp.asarray(SEG), True, q.shape[-1] ** -0.5, implementation="xla")
    return jnp.where((SEG > 0)[..., None, None], out, 0)

  _assert_equal_on_real_rows(fn, 4, 2)


@pytest.mark.slow
def test_splash_kernel_in_interpret_mode_equals_the_formula():
  """JAX's Pallas splash kernel (multi-query per kv head, segment ids, causal mask) run by the Pallas interpreter
  on the CPU, tile 128 over 200 tokens (padded to 256): values and gradients equal the formula."""

  def fn(q, k, v):
    return attention(q, k, v, SEG, implementation="splash", interpret=True, block_q=128)

  _assert_equal_on_real_rows(fn, 4, 2)


@pytest.mark.slow
@pytest.mark.subprocess
def test_splash_kernel_compiles_for_a_tpu_chip_with_memory_linear_in_the_length():
  """The gradient of ``attention(implementation="auto")`` compiled for a TPU v5e chip from this CPU host at
  Qwen3-8B's attention shapes (32 heads, 8 kv heads of 128, bf16) on one row: "auto" picks splash, the Mosaic kernel
  is in the program, and the compiled temporaries at 32k tokens are ~1.1 GiB (the dense path's float32 scores alone
  would be 32 × 32768² × 4 B = 137 GB) and grow ~2× from 16k to 32k (linear; quadratic would be 4×). 8k is not
  compared: XLA lays that program out differently (208 MiB, the 16k program 574 MiB, 32k 1,159 MiB)."""
  python = ensure_side_venv("tpu")
  env = tpu_child_env()
  script = os.path.join(ROOT, "tests", "attention_tpu_aot.py")
  proc = subprocess.run([python, script, "16384", "32768"], env=env, capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stderr[-6000:]
  short, long = json.loads(proc.stdout.strip().splitlines()[-1])
  for r in (short, long):
    assert r["platform"] == "tpu" and r["default_backend"] == "cpu", r
    assert r["implementation"] == "splash" and r["mosaic_kernel"], r
  assert long["temp_bytes"] < 2 * 2**30, long
  assert long["temp_bytes"] / short["temp_bytes"] < 2.5, (short, long)
