"""A mixture of experts on 8 virtual CPU devices (child process): expert parallelism changes nothing.

The same GRPO step (routing replay, load-balancing and z losses, 2 micro-batches) on 1 device and on
meshes with experts over ``tensor`` (expert parallelism) and rows over ``data × fsdp``, and the
expert weights really are split by expert."""

from __future__ import annotations

import pytest
from helpers import run_child

_EQUIVALENCE = r"""
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
from jax.sharding import PartitionSpec as P
from hf_utils import tiny_moe_config
from helpers import flat_params
from jaxgrpo import models; from jaxgrpo.parallel import sharding as shd; from jaxgrpo.step import train
from jaxgrpo.kernels.config import preset
from jaxgrpo.rollout.sampling import SamplingConfig, generate

assert jax.device_count() == 8
cfg = models.config_from_hf(tiny_moe_config("qwen3_moe", num_hidden_layers=2, mlp_only_layers=[]))
model = models.build_model(cfg, rngs=nnx.Rngs(0))
for path, var in nnx.to_flat_state(nnx.state(model)):
  if path[-1] == "router":
    var.set_value(var.get_value() * 50)
rng = np.random.default_rng(0)
prompts = rng.integers(1, 128, (4, 5)).astype(np.int32)
pmask = np.arange(5)[None] >= np.array([0, 2, 1, 0])[:, None]
r = generate(model, jnp.asarray(prompts), jnp.asarray(pmask),
             SamplingConfig(num_samples=4, max_new_tokens=6, pad_id=0, record_routing=True), key=jax.random.key(0))
r = jax.tree.map(np.asarray, r)
batch = train.Batch.from_rollout(r, rng.random(16).astype(np.float32), ref_logp=r.log_probs)
opt = optax.sgd(0.5, momentum=0.9)
tc = train.TrainConfig(micro_batches=2, router_aux_loss=0.1, router_z_loss=0.01, chunk_size=8)
MESHES = ["data=1", "data=2,fsdp=2,tensor=2", "fsdp=4,tensor=2", "data=8"]
results, ref = {}, {}
for spec in MESHES:
  mesh = shd.make_mesh(spec, devices=jax.devices()[:1] if spec == "data=1" else None)
  graphdef, state, shardings = train.init_train_state(model, opt, mesh)
  step = train.make_train_step(graphdef, opt, preset("grpo"), mesh=mesh, shardings=shardings, train_config=tc)
  for _ in range(2):
    state, metrics = step(state, batch)
  if mesh.shape["tensor"] > 1:
    gate = state.params["layers"][0]["mlp"]["gate"][...]
    assert gate.sharding.spec == P("tensor", "fsdp", None), gate.sharding
    assert gate.addressable_shards[0].data.shape[0] == cfg.num_experts // mesh.shape["tensor"]
  ref_fn = train.make_reference_fn(graphdef, mesh=mesh, param_shardings=shardings.params, train_config=tc)
  ref[spec] = np.asarray(ref_fn(jax.tree.map(jnp.copy, state.params), batch))
  results[spec] = (flat_params(state.params), {k: float(v) for k, v in metrics.items()})
  print(spec, {k: round(float(v), 5) for k, v in metrics.items() if k in ("loss", "grad_norm", "moe/aux_loss")})
base, base_m = results["data=1"]
for spec in MESHES[1:]:
  params, m = results[spec]
  for k in base:
    np.testing.assert_allclose(params[k], base[k], rtol=1e-5, atol=1e-6, err_msg=f"{spec} {k}")
  for k in base_m:
    np.testing.assert_allclose(m[k], base_m[k], rtol=1e-4, atol=1e-6, err_msg=f"{spec} metric {k}")
  np.testing.assert_allclose(ref[spec], ref["data=1"], rtol=1e-5, atol=1e-5, err_msg=f"{spec} reference")
# the expert axis may not shard the batch too
mesh = shd.make_mesh("fsdp=8")
graphdef, state, shardings = train.init_train_state(model, opt, mesh, rules={**model.rules})
bad = models.build_model(cfg, rngs=nnx.Rngs(0), rules={**shd.DEFAULT_RULES, "expert": "fsdp", "embed": None})
graphdef, state, shardings = train.init_train_state(bad, opt, mesh)
step = train.make_train_step(graphdef, opt, preset("grpo"), mesh=mesh, shardings=shardings, train_config=tc)
try:
  step(state, batch)
except ValueError as e:
  assert "shard both the batch and the experts" in str(e), e
else:
  raise AssertionError("expert over a batch axis should fail")
print("OK")
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_expert_parallel_train_step_equals_one_device_8_devices():
  assert run_child(_EQUIVALENCE, devices=8, timeout=900).strip().endswith("OK")
