"""Mesh specs, the rules table and placement helpers (in-process; multi-device cases use abstract meshes,
the real 8-device runs are in test_train_sharded.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxgrpo.parallel import sharding as shd


def _abstract(data=1, fsdp=1, tensor=1):
  return AbstractMesh((data, fsdp, tensor), shd.MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def test_parse_mesh_spec():
  assert shd.parse_mesh_spec("data=2,fsdp=2,tensor=2") == {"data": 2, "fsdp": 2, "tensor": 2}
  assert shd.parse_mesh_spec(" tensor = 4 ") == {"data": 1, "fsdp": 1, "tensor": 4}
  assert shd.parse_mesh_spec({"fsdp": -1}) == {"data": 1, "fsdp": -1, "tensor": 1}
  assert shd.parse_mesh_spec(None) == {"data": 1, "fsdp": 1, "tensor": 1}
  for bad, msg in [
    ("data=2,data=2", "given twice"),
    ("pipeline=2", "unknown axis 'pipeline'"),
    ("data:2", "could not parse"),
    ("data=0", "size >= 1"),
    ("data=-1,fsdp=-1", "at most one axis"),
  ]:
    with pytest.raises(ValueError, match=msg):
      shd.parse_mesh_spec(bad)


def test_make_mesh_uses_every_device_and_auto_axes():
  n = jax.device_count()
  mesh = shd.make_mesh(None)
  assert mesh.axis_names == shd.MESH_AXES and mesh.shape["fsdp"] == n
  assert all(t == AxisType.Auto for t in mesh.axis_types)
  with pytest.raises(ValueError, match=f"has {2 * n} devices .* but there are {n} devices"):
    shd.make_mesh(f"data={2 * n}")
  with pytest.raises(ValueError, match="not divisible by the fixed axes"):
    shd.make_mesh(f"data={n + 1},fsdp=-1")


def test_logical_to_spec_and_divisibility():
  mesh = _abstract(2, 2, 2)
  rules = shd.DEFAULT_RULES
  assert shd.logical_to_spec(("embed", "mlp"), mesh, rules, (8, 16)) == P("fsdp", "tensor")
  assert shd.logical_to_spec(("vocab", "embed"), mesh, rules, (8, 8)) == P("tensor", "fsdp")
  assert shd.logical_to_spec(("embed", "heads", "head_dim"), mesh, rules, (8, 4, 3)) == P("fsdp", "tensor", None)
  assert shd.logical_to_spec(("batch", None), mesh, rules, (8, 5)) == P(("data", "fsdp"), None)
  assert shd.logical_to_spec(("norm",), mesh, rules, (7,)) == P(None)
  with pytest.raises(
    ValueError, match=r"q: dim 1 \('heads', size 3\) is not divisible by mesh axis 'tensor' of size 2"
  ):
    shd.logical_to_spec(("embed", "heads", "head_dim"), mesh, rules, (8, 3, 4), "q")
  with pytest.raises(ValueError, match=r"'data'×'fsdp' of size 4"):
    shd.logical_to_spec(("batch",), mesh, rules, (6,), "rewards")
  with pytest.raises(ValueError, match="used twice"):
    shd.logical_to_spec(("heads", "mlp"), mesh, rules, (4, 4))


def test_tree_shardings_of_a_model_and_its_optimizer_state():
  import optax
  from flax import nnx
  from helpers import tiny_model

  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  _, params = nnx.split(tiny_model())
  sh = shd.tree_shardings(params, mesh)
  assert sh["layers"][0]["mlp"]["gate"].spec == P("fsdp", "tensor")
  assert sh["layers"][0]["attn"]["o"].spec == P("tensor", None, "fsdp")
  assert sh["embed_tokens"].spec == P("tensor", "fsdp")
  opt_sh = shd.tree_shardings(jax.eval_shape(optax.adam(1e-3).init, params), mesh)
  assert opt_sh[0].mu["layers"][1]["mlp"]["down"].spec == P("tensor", "fsdp")
  assert opt_sh[0].count.spec == P()  # the step count is replicated
  # heads not divisible: an error naming the parameter, before anything is placed
  with pytest.raises(ValueError, match=r"attn/[qk]: dim 1 \('(kv_)?heads', size 4\) .* 'tensor' of size 8"):
    shd.tree_shardings(params, _abstract(tensor=8))
  placed, _ = shd.shard_tree(params, mesh)
  assert isinstance(placed["embed_tokens"][...].sharding, NamedSharding)


def test_place_batch_checks_rows():
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  batch = {"a": np.zeros((4, 3)), "b": np.zeros(4), "none": None}
  placed = shd.place_batch(batch, mesh)
  assert placed["a"].sharding.spec == P(("data", "fsdp"))
  with pytest.raises(ValueError, match="same leading batch axis"):
    shd.place_batch({"a": np.zeros((4, 3)), "b": np.zeros(5)}, mesh)
  with pytest.raises(ValueError, match=r"batch size 6 is not divisible .* \(data×fsdp = 4\)"):
    shd.check_batch_divisible(6, _abstract(2, 2, 1))
  with pytest.raises(ValueError, match=r"× 2 micro/mini-batches = 8"):
    shd.check_batch_divisible(12, _abstract(2, 2, 1), splits=2)
  assert shd.process_batch_rows(mesh, 4) == slice(0, 4)
