"""The platform a program is built for (``jaxgrpo.parallel.target``, docs/models.md "Target platform"): the choices
that depend on the hardware (bf16 products, the KV cache's dtype, a mixture of experts' dispatch) read the
platform of the devices the program is compiled for — the context mesh's, else the samplers' arrays', else the
default backend — never the host's backend alone; and reading it leaves every CPU program byte for byte as it
was (tests/tpu_aot_checks.py pins their StableHLO). The TPU side, with real TPU devices described on this host, is
tests/test_tpu_aot.py."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tpu_aot_checks as checks
from helpers import run_child

from jaxgrpo.parallel.target import current_platform, platform_of, target_platform


def test_platform_of_names_the_devices_of_a_mesh_a_device_an_array_a_struct_or_a_tree():
  import jaxgrpo as jg

  dev = jax.devices()[0]
  mesh = jg.make_mesh("data=1", devices=[dev])
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  x = jax.device_put(np.zeros(3), dev)
  assert dev.platform == "cpu"
  for where in (mesh, dev, sharding, x, jax.ShapeDtypeStruct((3,), jnp.float32, sharding=sharding), {"a": [1, x]}):
    assert platform_of(where) == "cpu", where
  assert platform_of("tpu") == "tpu"
  for where in (np.zeros(3), jax.ShapeDtypeStruct((3,), jnp.float32), 3, None, {"a": np.zeros(2)}):
    assert platform_of(where) is None, where


def test_target_platform_is_scoped_and_a_block_naming_nothing_changes_nothing():
  assert current_platform() == jax.default_backend()
  with target_platform("tpu") as p:
    assert p == "tpu" and current_platform() == "tpu"
    with target_platform(np.zeros(2)) as q:  # names no platform: the outer one stays
      assert q is None and current_platform() == "tpu"
  assert current_platform() == jax.default_backend()


_MESH_CHILD = r"""
import json
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
import jaxgrpo as jg
from jaxgrpo import models
from jaxgrpo.models import moe
from jaxgrpo.models.backend import cpu_bf16_dots, kv_cache_dtype
from jaxgrpo.models.layers import dense
from jaxgrpo.parallel.target import current_platform, target_platform
import tpu_aot_checks as checks

mesh = jg.make_mesh("data=2,fsdp=4")  # the 8 CPU devices of this process
out = {"devices": len(jax.devices()), "platform": jax.devices()[0].platform}
seen = {}

def probe(x, w):
  seen["platform"], seen["cache"], seen["dispatch"] = current_platform(), str(jnp.dtype(kv_cache_dtype(jnp.bfloat16))), moe.default_dispatch()
  return dense(x, w)

x, w = jnp.ones((8, 32), jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16)
def lowered():
  jax.clear_caches()
  return checks.dot_types(jax.jit(probe).lower(x, w).as_text()), dict(seen)

with cpu_bf16_dots("float32"):
  out["default"] = lowered()
  with target_platform("tpu"):  # a stray target: the mesh's CPU devices decide
    with jax.set_mesh(mesh):
      out["mesh_over_target"] = lowered()
    out["target_alone"] = lowered()  # no mesh: the target decides
  with jax.set_mesh(mesh):
    out["mesh"] = lowered()

  # the train step on the 8-device mesh: the same program whatever target was set around it (the mesh decides)
  step, state = checks._step(checks.dense_config(), mesh, abstract=True)
  batch = checks.make_batch()
  jax.clear_caches()
  plain = step.lower(state, batch).as_text()
  jax.clear_caches()
  with target_platform("tpu"):
    under_target = step.lower(state, batch).as_text()
  out["step_same_under_stray_target"] = plain == under_target
  out["step_f32_dots"] = len(checks.f32_dots(plain))
print(json.dumps(out))
"""


@pytest.mark.subprocess
def test_the_mesh_decides_the_program_of_a_cpu_mesh_and_a_target_decides_without_one():
  """8 CPU devices: under a CPU mesh a bf16 product is the CPU's (float32 operands in ``cpu_bf16_dots("float32")``),
  the KV cache float32 and the MoE dispatch tiled, even inside ``target_platform("tpu")``, and the train step's
  program is the same with or without that stray target; without a mesh the target decides (bf16 × bf16, a bf16
  cache, ragged_dot). Before: the host's backend decided everything, so the TPU target gave the CPU's choices."""
  r = json.loads(run_child(_MESH_CHILD, devices=8).strip().splitlines()[-1])
  assert r["devices"] == 8 and r["platform"] == "cpu"
  cpu_choices = {"platform": "cpu", "cache": "float32", "dispatch": "tiled"}
  f32_dot = ["(tensor<8x32xf32>, tensor<32x16xf32>) -> tensor<8x16xf32>"]
  for case in ("default", "mesh", "mesh_over_target"):
    dots, seen = r[case]
    assert seen == cpu_choices and dots == f32_dot, (case, r[case])
  dots, seen = r["target_alone"]
  assert seen == {"platform": "tpu", "cache": "bfloat16", "dispatch": "ragged"}, seen
  assert dots == ["(tensor<8x32xbf16>, tensor<32x16xbf16>) -> tensor<8x16xbf16>"], dots  # the plain bf16 matmul
  assert r["step_same_under_stray_target"] and r["step_f32_dots"] > 0


@pytest.mark.slow
def test_cpu_programs_are_unchanged():
  """The StableHLO text of the train step (dense and MoE) and of the sampler of a bf16 model, under both
  ``cpu_bf16_dots`` modes and both ``cpu_kv_cache`` modes, hashes to what main produced before the target
  platform was read from the mesh (``tpu_aot_checks.CPU_PROGRAM_SHA256``)."""
  assert checks.cpu_program_hashes() == checks.CPU_PROGRAM_SHA256
