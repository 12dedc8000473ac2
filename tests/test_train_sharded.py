"""The train step on 8 virtual CPU devices (child processes): sharding changes nothing, parameters and
optimizer state really are sharded, and bad meshes / batches fail before anything is compiled."""

from __future__ import annotations

import os

import pytest
from helpers import child_result, start_child

_EQUIVALENCE = r"""
import jax, numpy as np, optax
from jax.sharding import PartitionSpec as P
from helpers import G, flat_params, make_batch, tiny_model
from jaxgrpo.parallel import sharding as shd; from jaxgrpo.step import train
from jaxgrpo.kernels.config import preset

assert jax.device_count() == 8
MESHES = ["data=1", "data=8", "data=2,fsdp=2,tensor=2", "fsdp=2,tensor=4"]
def check(name):
  config = preset(name)
  model = tiny_model(layers=1)  # one layer: every layer is sharded alike, and it halves compile time
  # SGD with momentum: a sharded optimizer state, and an update linear in the gradient (Adam's
  # g/sqrt(v) turns last-bit differences of near-zero gradients into lr-sized ones)
  opt = optax.sgd(0.5, momentum=0.9)
  batch = make_batch()
  if not config.needs_reference:
    batch = batch._replace(ref_logp=None)
  results = {}
  for spec in MESHES:
    mesh = shd.make_mesh(spec, devices=jax.devices()[:1] if spec == "data=1" else None)
    graphdef, state, shardings = train.init_train_state(model, opt, mesh)
    step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings,
                                 train_config=train.TrainConfig(micro_batches=2, group_size=G, chunk_size=8))
    b = shd.place_batch(batch, mesh)
    assert b.completions.sharding.spec == P(("data", "fsdp")), b.completions.sharding
    for _ in range(2):
      state, metrics = step(state, b)
    assert step.traces == 1
    if mesh.shape["fsdp"] > 1 and mesh.shape["tensor"] > 1:
      f, t = mesh.shape["fsdp"], mesh.shape["tensor"]
      layer = state.params["layers"][0]
      trace = state.opt_state[0].trace["layers"][0]
      trees = [layer, trace]  # parameters, momentum (and Adam's moments, once)
      if name == "grpo":
        _, adam_state, _ = train.init_train_state(model, optax.adamw(1e-3), mesh)
        trees += [adam_state.opt_state[0].mu["layers"][0], adam_state.opt_state[0].nu["layers"][0]]
      for tree in trees:
        gate, q, down = tree["mlp"]["gate"][...], tree["attn"]["q"][...], tree["mlp"]["down"][...]
        assert gate.sharding.spec == P("fsdp", "tensor"), gate.sharding
        assert q.sharding.spec == P("fsdp", "tensor", None), q.sharding
        assert down.sharding.spec == P("tensor", "fsdp"), down.sharding
        for w in (gate, q, down):
          shard = w.addressable_shards[0].data.shape
          assert np.prod(shard) * f * t == np.prod(w.shape), (w.shape, shard)
      emb = state.params["embed_tokens"][...]
      assert emb.sharding.spec == P("tensor", "fsdp") and emb.addressable_shards[0].data.shape == (128 // t, 32 // f)
    results[spec] = flat_params(state.params)
    print(name, spec, {k: round(float(v), 5) for k, v in metrics.items() if k in ("loss", "grad_norm")})

  base = results["data=1"]
  for spec in MESHES[1:]:
    for k in base:
      np.testing.assert_allclose(results[spec][k], base[k], rtol=1e-5, atol=1e-7, err_msg=f"{name} {spec} {k}")


"""

_ERRORS = r"""
def errors():  # bad meshes and batches fail before anything is compiled
  import jax, numpy as np, optax, pytest
  from helpers import make_batch, tiny_config, tiny_model
  from jaxgrpo.parallel import sharding as shd; from jaxgrpo.step import train
  from jaxgrpo.kernels.config import preset
  from jaxgrpo.models import build_model

  opt = optax.adam(1e-3)
  model = tiny_model()  # eager init compiles small programs: build it before counting
  batch = make_batch(b=12, g=4)._replace(ref_logp=None)
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None)
  with pytest.raises(ValueError, match=r"has 4 devices .* but there are 8 devices"):
    shd.make_mesh("data=2,fsdp=2")
  with pytest.raises(ValueError, match="unknown axis 'model'"):
    shd.make_mesh("model=8")
  # heads not divisible by tensor: 4 heads over tensor=8
  with pytest.raises(ValueError, match=r"attn/[qk]: dim 1 \('(kv_)?heads', size 4\) is not divisible by mesh axis 'tensor' of size 8"):
    train.init_train_state(model, opt, shd.make_mesh("tensor=8"))
  assert not compiles, compiles
  # batch not divisible across data x fsdp: 12 rows over data=4 x fsdp=2
  mesh = shd.make_mesh("data=4,fsdp=2")
  graphdef, state, shardings = train.init_train_state(model, opt, mesh)
  step = train.make_train_step(graphdef, opt, preset("grpo"), mesh=mesh, shardings=shardings)
  n = len(compiles)
  with pytest.raises(ValueError, match=r"batch size 12 is not divisible by the batch mesh axes \(data×fsdp = 8\)"):
    shd.place_batch(batch, mesh)
  with pytest.raises(ValueError, match=r"batch size 12 is not divisible"):
    step(state, batch)
  assert len(compiles) == n and step.traces == 0, compiles
"""


# the one child's driver: each part (``errors``, or a preset's equivalence) in turn; a part's failure is reported (its
# traceback, then ``FAILED part``) and the next still runs
_DRIVER = r"""
import sys, traceback
for part in sys.argv[1:]:
  try:
    errors() if part == "errors" else check(part)
    print("OK", part, flush=True)
  except Exception:
    traceback.print_exc()
    print("FAILED", part, flush=True)
"""
PRESETS = ("grpo", "lambda_grpo", "frpo")


@pytest.fixture(scope="module")
def sharded_child(request):
  """One 8-device child for the module (one JAX start-up): the error checks, then grpo, lambda_grpo and frpo one
  after the other, for the tests selected (a ``-m "not slow"`` run checks the errors only): ``(exit status, stdout,
  stderr)``."""
  selected = {i.originalname for i in request.session.items if i.path.name == os.path.basename(__file__)}
  parts = ["errors"] * ("test_errors_before_compiling_8_devices" in selected)
  parts += list(PRESETS) * ("test_sharding_changes_nothing_8_devices" in selected)
  child = start_child(_ERRORS + _EQUIVALENCE + _DRIVER, devices=8, args=parts)
  return child_result(child)


@pytest.mark.subprocess
def test_errors_before_compiling_8_devices(sharded_child):
  rc, out, err = sharded_child
  assert "OK errors" in out.splitlines(), f"exit {rc}\n{out[-3000:]}\n{err[-8000:]}"


@pytest.mark.slow
@pytest.mark.subprocess
def test_sharding_changes_nothing_8_devices(sharded_child):
  """grpo, lambda_grpo and frpo, one after the other in one child process (8 devices)."""
  rc, out, err = sharded_child
  for name in PRESETS:
    assert f"OK {name}" in out.splitlines(), f"{name}: exit {rc}\n{out[-3000:]}\n{err[-8000:]}"
  assert out.count("data=8") == 3, out
