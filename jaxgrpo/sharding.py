"""Meshes, the one table of logical-axis rules, and placement of parameters, optimizer state and batches.

The models annotate every parameter with logical axis names (``jaxgrpo.models.LOGICAL_AXES``);
:data:`DEFAULT_RULES` maps them to the mesh axes ``data``, ``fsdp`` and ``tensor``.
"""
from __future__ import annotations

from typing import Mapping

from jax.sharding import Mesh, PartitionSpec

__all__ = ["DEFAULT_RULES", "logical_to_spec"]

DEFAULT_RULES: dict[str, str | None] = {
    "vocab": "tensor", "embed": "fsdp", "mlp": "tensor", "heads": "tensor", "kv_heads": "tensor",
}


def logical_to_spec(axes: tuple[str | None, ...], mesh: Mesh, rules: Mapping[str, str | None],
                    shape: tuple[int, ...] | None = None, name: str = "") -> PartitionSpec:
  """PartitionSpec for logical ``axes`` under ``rules`` (logical name → mesh axis or None).

  Logical names missing from ``rules`` and mesh axes missing from ``mesh`` map to None. A mesh
  axis used twice, or a dim not divisible by its mesh axis size, raises ValueError.
  """
  spec, used = [], set()
  for i, a in enumerate(axes):
    m = rules.get(a) if a is not None else None
    if m is not None and m not in mesh.axis_names:
      m = None
    if m is not None:
      if m in used:
        raise ValueError(f"{name}: mesh axis {m!r} used twice in logical axes {axes}")
      used.add(m)
      if shape is not None and shape[i] % mesh.shape[m]:
        raise ValueError(f"{name}: dim {i} ({a!r}, size {shape[i]}) is not divisible by mesh axis "
                         f"{m!r} of size {mesh.shape[m]}; change the rules")
    spec.append(m)
  return PartitionSpec(*spec)
