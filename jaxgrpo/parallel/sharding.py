"""Meshes, the one table of logical-axis rules, and placement of parameters, optimizer state and batches.

Mesh axes (MaxText-style, any of them may have size 1):

- ``data``: pure data parallelism (parameters replicated across it);
- ``fsdp``: data parallelism with parameters and optimizer state sharded along the model width
  (ZeRO-3 / FSDP);
- ``tensor``: tensor (model) parallelism over heads, MLP width and vocabulary;
- ``context`` (:data:`CONTEXT_AXIS`, only in a mesh where it is > 1): context parallelism, the sequence axis
  of the activations split into consecutive chunks (``activation_length``); the model's attention becomes ring
  attention over it (``jaxgrpo.parallel.ring_attention``), everything else is GSPMD over the split activations.
  A mesh without it is the ``(data, fsdp, tensor)`` mesh of before, so the programs of meshes without context
  parallelism are unchanged.

The models annotate every parameter with logical axis names (``jaxgrpo.models.LOGICAL_AXES``);
:data:`DEFAULT_RULES` maps them, and the batch axis, to mesh axes:

=====================  ====================  =========================================================
logical axis           mesh axis             which arrays
=====================  ====================  =========================================================
``batch``              ``("data", "fsdp")``  every batch array's leading axis (B), activations' B
``embed``              ``fsdp``              D of every weight matrix and the embedding
``vocab``              ``tensor``            V of the embedding / LM head
``heads``              ``tensor``            H of q and o, and of the query/attention activations
``kv_heads``           ``tensor``            N of k and v, and of the key/value activations
``mlp``                ``tensor``            F of gate, up and down, and of the MLP hidden activation
``expert``             ``tensor``            E of the MoE expert weights (expert parallelism, ``models.moe``)
``expert_mlp``         —                     Fe of the expert weights (replicated: E takes ``tensor``)
``head_dim``           —                     (replicated)
``norm``               —                     (replicated)
``activation_length``  ``context``           S of the activations (context parallelism; none without the axis)
``activation_embed``   —                     D of the residual stream (replicated across ``tensor``)
``layers``             — (always)            L, the leading axis of a scanned layer stack (``scan_layers``)
=====================  ====================  =========================================================

``layers`` never takes a mesh axis (a rule mapping it to one is refused): the scan reads one layer
at a time, and a layer split over devices would be gathered whole at every step of the scan.

Activations are constrained through the same kind of table (:func:`constrain`, a model's
``sharding_rules``) while a mesh is active; their names and why they share the parameters' rules:
docs/models.md, "Activation sharding".

Nothing is replicated silently: a dimension that does not divide its mesh axes raises ``ValueError``
naming the parameter (or batch field, or activation), the axis and the sizes.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

__all__ = [
  "BATCH_AXES",
  "DEFAULT_RULES",
  "CONTEXT_AXIS",
  "MESH_AXES",
  "abstract_tree",
  "batch_sharding",
  "check_sequence_divisible",
  "context_size",
  "check_batch_divisible",
  "constrain",
  "logical_to_spec",
  "make_mesh",
  "parse_mesh_spec",
  "place_batch",
  "process_batch_rows",
  "shard_tree",
  "tree_shardings",
]

MESH_AXES = ("data", "fsdp", "tensor")
CONTEXT_AXIS = "context"  # the sequence axis: a mesh has it only where its size is > 1 (make_mesh)
BATCH_AXES = ("data", "fsdp")

DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
  "batch": BATCH_AXES,
  "vocab": "tensor",
  "embed": "fsdp",
  "mlp": "tensor",
  "heads": "tensor",
  "kv_heads": "tensor",
  "head_dim": None,
  "norm": None,
  "expert": "tensor",
  "expert_mlp": None,
  "activation_length": CONTEXT_AXIS,
  "activation_embed": None,
  "layers": None,
}
LAYER_AXIS = "layers"  # a scanned layer stack's leading axis (jaxgrpo.models.base.LAYER_AXIS)


def parse_mesh_spec(spec: str | Mapping[str, int] | None) -> dict[str, int]:
  """``"data=2,fsdp=2,tensor=2"`` (or a mapping) → ``{"data": 2, "fsdp": 2, "tensor": 2}``.

  Omitted axes have size 1; at most one axis may be ``-1`` (all remaining devices, resolved by
  :func:`make_mesh`). ``context`` (:data:`CONTEXT_AXIS`) is in the result only when the spec names it.
  Unknown axis names, repeated names and sizes < 1 raise ``ValueError``.
  """
  if spec is None or spec == "":
    items: list[tuple[str, int]] = []
  elif isinstance(spec, str):
    items = []
    for part in spec.split(","):
      m = re.fullmatch(r"\s*(\w+)\s*=\s*(-?\d+)\s*", part)
      if not m:
        raise ValueError(
          f"mesh spec {spec!r}: expected comma-separated axis=size pairs such as "
          f"'data=2,fsdp=2,tensor=2'; could not parse {part!r}"
        )
      items.append((m.group(1), int(m.group(2))))
  elif isinstance(spec, Mapping):
    items = [(str(k), v) for k, v in spec.items()]
  else:
    raise TypeError(f"mesh spec must be a string like 'data=2,fsdp=2,tensor=2' or a mapping; got {spec!r}")
  sizes = dict.fromkeys(MESH_AXES, 1)
  seen = set()
  for name, size in items:
    if name not in MESH_AXES + (CONTEXT_AXIS,):
      raise ValueError(f"mesh spec {spec!r}: unknown axis {name!r}; the axes are {MESH_AXES + (CONTEXT_AXIS,)}")
    if name in seen:
      raise ValueError(f"mesh spec {spec!r}: axis {name!r} given twice")
    seen.add(name)
    if not isinstance(size, (int, np.integer)) or (size < 1 and size != -1):
      raise ValueError(
        f"mesh spec {spec!r}: axis {name!r} must have size >= 1 (or -1: the remaining devices); got {size!r}"
      )
    sizes[name] = int(size)
  if sum(s == -1 for s in sizes.values()) > 1:
    raise ValueError(f"mesh spec {spec!r}: at most one axis may be -1")
  return sizes


def make_mesh(spec: str | Mapping[str, int] | None = None, *, devices=None) -> Mesh:
  """A ``(data, fsdp, tensor)`` mesh of ``AxisType.Auto`` axes (what the models need), with a fourth axis
  ``context`` when the spec gives it a size > 1 (context parallelism; a ``context=1`` mesh is the 3-axis one).

  Args:
    spec: e.g. ``"data=2,fsdp=2,tensor=2"``, ``"fsdp=-1"``, ``"fsdp=2,context=4"`` or ``{"tensor": 4}``; see
      :func:`parse_mesh_spec`. None: all devices on ``fsdp``.
    devices: the devices to use (default ``jax.devices()``, every process's, in order). The mesh size
      must equal their number: ValueError otherwise (no device is silently left out).
  """
  sizes = parse_mesh_spec("fsdp=-1" if spec is None else spec)
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if -1 in sizes.values():
    known = math.prod(s for s in sizes.values() if s != -1)
    if n % known:
      raise ValueError(f"mesh spec {spec!r}: {n} devices are not divisible by the fixed axes' product {known}")
    sizes = {k: (n // known if v == -1 else v) for k, v in sizes.items()}
  axes = MESH_AXES + ((CONTEXT_AXIS,) if sizes.get(CONTEXT_AXIS, 1) > 1 else ())
  shape = tuple(sizes[a] for a in axes)
  if math.prod(shape) != n:
    raise ValueError(
      f"mesh spec {spec!r} has {math.prod(shape)} devices "
      f"({' x '.join(f'{a}={s}' for a, s in zip(axes, shape))}) but there are {n} "
      f"devices; the mesh must use every device (set one axis to -1 to fill)"
    )
  return jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes), devices=devices)


def context_size(mesh=None) -> int:
  """The size of the ``context`` axis of ``mesh`` (default: the context mesh of ``jax.set_mesh``; 1 without one or
  without the axis): how many consecutive chunks the activations' sequence axis is split into."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  return 1 if mesh.empty or CONTEXT_AXIS not in mesh.axis_names else int(mesh.shape[CONTEXT_AXIS])


def check_sequence_divisible(length: int, mesh, what: str = "sequence") -> None:
  """ValueError (one line) unless ``length`` positions split evenly over the ``context`` axis of ``mesh``; the
  message says how many positions to pad."""
  n = context_size(mesh)
  if length % n:
    pad = -length % n
    raise ValueError(
      f"{what} length {length} is not divisible by the mesh's context axis (context={n}): pad it by {pad} to "
      f"{length + pad} positions or change the context size"
    )


def _mesh_axes(rule) -> tuple[str, ...]:
  if rule is None:
    return ()
  return (rule,) if isinstance(rule, str) else tuple(rule)


def logical_to_spec(
  axes: tuple[str | None, ...],
  mesh: Mesh,
  rules: Mapping[str, Any],
  shape: tuple[int, ...] | None = None,
  name: str = "",
) -> PartitionSpec:
  """PartitionSpec for logical ``axes`` under ``rules`` (logical name → mesh axis, tuple of mesh axes,
  or None).

  Logical names missing from ``rules`` and mesh axes missing from ``mesh`` map to None (replicated
  by design, not by accident). A mesh axis used twice, a dim not divisible by the product of its
  mesh axes' sizes, or a mesh axis for ``"layers"`` (a scanned stack's leading axis) raises ValueError.
  """
  spec, used = [], set()
  if LAYER_AXIS in axes and _mesh_axes(rules.get(LAYER_AXIS)):
    raise ValueError(
      f"{name}: rules map the stacked layer axis {LAYER_AXIS!r} to mesh axes {rules[LAYER_AXIS]!r}; "
      "a scanned layer stack (scan_layers) keeps it unsharded: set rules['layers'] = None"
    )
  for i, a in enumerate(axes):
    ms = tuple(m for m in _mesh_axes(rules.get(a) if a is not None else None) if m in mesh.axis_names)
    for m in ms:
      if m in used:
        raise ValueError(f"{name}: mesh axis {m!r} used twice in logical axes {axes}")
      used.add(m)
    size = math.prod(mesh.shape[m] for m in ms)
    if ms and shape is not None and shape[i] % size:
      mesh_text = " × ".join(f"{m}={n}" for m, n in mesh.shape.items())
      raise ValueError(
        f"{name}: dim {i} ({a!r}, size {shape[i]}) is not divisible by mesh axis "
        f"{'×'.join(map(repr, ms))} of size {size} (mesh {mesh_text} over {mesh.size} devices); "
        "change the mesh or the rules"
      )
    spec.append(None if not ms else ms[0] if len(ms) == 1 else ms)
  return PartitionSpec(*spec)


def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def tree_shardings(tree, mesh: Mesh, rules: Mapping[str, Any] | None = None):
  """A sharding for every array of a model state or optimizer state, as a prefix tree of ``tree``.

  Every ``nnx.Variable`` (parameters, and the optax moments that mirror them, which keep the
  variable's metadata) is sharded by its ``out_sharding`` logical axes under ``rules``; other leaves
  (step counts, scalars) are replicated. Works on abstract trees (``jax.eval_shape``).
  Raises ValueError for any dimension its mesh axes do not divide (e.g. heads % tensor).
  """
  rules = DEFAULT_RULES if rules is None else rules

  def one(path, x):
    name = _path_name(path)
    if isinstance(x, nnx.Variable):
      axes = x.get_metadata().get("out_sharding")
      shape = tuple(x.shape)
      if axes is None:
        if len(shape) >= 2:
          raise ValueError(
            f"{name}: parameter of shape {shape} has no logical axes (out_sharding); "
            "annotate it instead of replicating it silently"
          )
        return NamedSharding(mesh, PartitionSpec())
      if len(axes) != len(shape):
        raise ValueError(f"{name}: logical axes {axes} do not match shape {shape}")
      return NamedSharding(mesh, logical_to_spec(tuple(axes), mesh, rules, shape, name))
    return NamedSharding(mesh, PartitionSpec())

  return jax.tree_util.tree_map_with_path(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def abstract_tree(tree, shardings):
  """``tree`` with every array (a ``jax.Array``, a NumPy array, a ``jax.ShapeDtypeStruct``, or an ``nnx.Variable``
  holding one) replaced by a ``jax.ShapeDtypeStruct`` of its shape and dtype placed by ``shardings`` (the tree of
  :func:`tree_shardings`: one sharding per array or ``nnx.Variable``); a Variable keeps its metadata and holds the
  struct. Nothing is allocated or transferred: what ``jax.jit(...).lower`` takes to compile ahead of time, also
  for devices that cannot hold arrays (``jax.experimental.topologies``' compile-only devices)."""

  def one(sharding, x):
    if isinstance(x, nnx.Variable):
      return x.replace(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding))
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

  return jax.tree.map(one, shardings, tree, is_leaf=lambda v: isinstance(v, nnx.Variable))


def shard_tree(tree, mesh: Mesh, rules: Mapping[str, Any] | None = None):
  """``(tree placed on the mesh, its shardings)`` — model state or optimizer state; see
  :func:`tree_shardings`."""
  shardings = tree_shardings(tree, mesh, rules)
  return jax.device_put(tree, shardings), shardings


def batch_sharding(mesh: Mesh, rules: Mapping[str, Any] | None = None) -> NamedSharding:
  """The sharding of every batch array: leading axis over ``rules["batch"]`` (``data × fsdp``)."""
  rules = DEFAULT_RULES if rules is None else rules
  return NamedSharding(mesh, logical_to_spec(("batch",), mesh, rules))


def batch_shards(mesh: Mesh, rules: Mapping[str, Any] | None = None) -> int:
  """How many ways the batch axis is split (``data × fsdp`` under the default rules)."""
  rules = DEFAULT_RULES if rules is None else rules
  return math.prod(mesh.shape[m] for m in _mesh_axes(rules.get("batch")) if m in mesh.axis_names)


def check_batch_divisible(
  batch_size: int, mesh: Mesh, rules: Mapping[str, Any] | None = None, *, splits: int = 1, what: str = "batch"
) -> None:
  """ValueError unless ``batch_size`` rows split evenly into ``splits`` parts, each over
  ``data × fsdp``."""
  n = batch_shards(mesh, rules)
  if batch_size % (n * splits):
    extra = f" × {splits} micro/mini-batches" if splits > 1 else ""
    raise ValueError(
      f"{what} size {batch_size} is not divisible by the batch mesh axes "
      f"(data×fsdp = {n}){extra} = {n * splits}; pad the batch or change the mesh"
    )


def place_batch(batch, mesh: Mesh, rules: Mapping[str, Any] | None = None, *, process_local: bool = False):
  """Put every array of ``batch`` (a pytree, None leaves allowed) on the mesh, rows over
  ``data × fsdp``.

  Args:
    batch: pytree of arrays with a common leading batch axis.
    process_local: False — ``batch`` is the global batch (every process passes the same arrays).
      True — ``batch`` holds only this process's rows (:func:`process_batch_rows`), assembled into a
      global array with ``jax.make_array_from_process_local_data``: each host feeds its own slice.
  """
  sharding = batch_sharding(mesh, rules)
  leaves = [x for x in jax.tree.leaves(batch)]
  if not leaves:
    raise ValueError("batch has no arrays")
  rows = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
  if None in rows or len(rows) != 1:
    raise ValueError(f"every batch array needs the same leading batch axis; got leading sizes {sorted(map(str, rows))}")
  local = rows.pop()
  nproc = jax.process_count() if process_local else 1
  if process_local and nproc > 1:
    global_rows = local * nproc
  else:
    global_rows = local
  check_batch_divisible(global_rows, mesh, rules)
  if process_local and nproc > 1:
    return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x), (global_rows,) + np.shape(x)[1:]), batch
    )
  return jax.device_put(batch, sharding)


def process_batch_rows(mesh: Mesh, global_batch_size: int, rules: Mapping[str, Any] | None = None) -> slice:
  """The rows of the global batch this process feeds to :func:`place_batch` with ``process_local``.

  Raises ValueError when this process's devices do not hold one contiguous block of rows.
  """
  check_batch_divisible(global_batch_size, mesh, rules)
  sharding = batch_sharding(mesh, rules)
  index_map = sharding.addressable_devices_indices_map((global_batch_size,))
  starts = sorted({idx[0].start or 0 for idx in index_map.values()})
  stops = sorted({global_batch_size if idx[0].stop is None else idx[0].stop for idx in index_map.values()})
  lo, hi = starts[0], stops[-1]
  covered = sum(b - a for a, b in zip(starts, stops))
  if covered != hi - lo:
    raise ValueError(
      f"process {jax.process_index()}'s devices hold non-contiguous batch rows "
      f"{list(zip(starts, stops))}; order the mesh devices by process"
    )
  return slice(lo, hi)


def constrain(
  x: jax.Array, axes: tuple[str | None, ...], rules: Mapping[str, Any] | None = None, name: str = "activation"
) -> jax.Array:
  """``x`` constrained to the layout of its logical ``axes`` under ``rules``, when a mesh is active
  (``jax.sharding.get_abstract_mesh()`` not empty: inside ``with jax.set_mesh(mesh):``).

  Without a context mesh it returns ``x`` unchanged: the models stay mesh-agnostic, and a program
  traced without a mesh is exactly what it was before activation sharding existed. With one, every
  named dim must divide its mesh axes (``ValueError`` naming ``name``, as for parameters), and the
  mesh axes must be ``AxisType.Auto`` (``ValueError`` otherwise). Values are never changed, only
  their layout. The mesh is part of ``jax.jit``'s cache key, so a function traced without a mesh
  is retraced under one.

  Args:
    x: any array, e.g. ``f32[B, S, D]``.
    axes: one logical name (or None) per dim of ``x``, e.g. ``("batch", "activation_length",
      "activation_embed")``.
    rules: logical name → mesh axes (default :data:`DEFAULT_RULES`).
    name: what ``x`` is, for error messages.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  if len(axes) != x.ndim:
    raise ValueError(f"{name}: logical axes {axes} do not match shape {x.shape}")
  not_auto = [n for n, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Auto]
  if not_auto:
    raise ValueError(
      f"{name}: mesh axes {not_auto} are not AxisType.Auto; the models constrain activations with "
      "PartitionSpecs and let the compiler propagate: build the mesh with jaxgrpo.parallel.sharding.make_mesh"
    )
  rules = DEFAULT_RULES if rules is None else rules
  spec = logical_to_spec(tuple(axes), mesh, rules, tuple(x.shape), name)
  return jax.lax.with_sharding_constraint(x, spec)
