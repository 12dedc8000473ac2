"""The adapter sites of a model: its projections that can carry a LoRA adapter, and the placement helpers
every LoRA edit shares.

Private to ``jaxgrpo.models.lora`` (which adds, quantises, merges and counts) and ``jaxgrpo.models.lora_peft``
(which writes and reads PEFT directories): a :class:`Site` is one projection of a model (the modules listing
``PROJECTIONS``, which the model's family names in its registry entry, ``Family.lora_modules``: attention q/k/v/o,
the SwiGLU gate/up/down, GPT-2's fc/proj) with the only name-based access to its weight and adapter;
:func:`edit_layers` runs an edit on a scanned model's loop layout; :func:`place_like` puts a
new array on its weight's mesh.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import jax
from flax import nnx
from jax.sharding import NamedSharding

from jaxgrpo.models.base import CausalLM, stack_blocks, to_loop_layers
from jaxgrpo.models.layers import LoRA, QuantizedWeight
from jaxgrpo.models.registry import family_of
from jaxgrpo.parallel.sharding import DEFAULT_RULES, logical_to_spec


class Site(NamedTuple):
  """One projection: its module, its name there, its contracted dims and its dotted path."""

  module: nnx.Module
  name: str
  contract: int
  path: tuple  # the weight's path in the model state, e.g. ("layers", 0, "attn", "q")

  @property
  def dotted(self) -> str:
    return ".".join(str(p) for p in self.path)

  # The three attribute accessors below are the only name-based access to the model.
  def weight(self):
    return getattr(self.module, self.name)

  def adapter(self) -> LoRA | None:
    return getattr(self.module, self.name + "_lora")

  def set(self, *, weight=None, adapter=None, clear_adapter: bool = False) -> None:
    if weight is not None:
      setattr(self.module, self.name, weight)
    if adapter is not None:
      setattr(self.module, self.name + "_lora", nnx.data(adapter))
    if clear_adapter:
      setattr(self.module, self.name + "_lora", nnx.data(None))


def check_model(model) -> None:
  if not isinstance(model, CausalLM):
    raise TypeError(f"model must be a jaxgrpo.models CausalLM, got {type(model).__name__}")


def edit_layers(model, edit):
  """``edit(model)``; for a scanned model, ``edit`` of its loop layout, whose layers are then stacked
  again into ``model`` (in place) — only if ``edit`` and the stacking succeed."""
  if not model.scan_layers:
    return edit(model)
  loop = to_loop_layers(model)
  out = edit(loop)
  model.layers = stack_blocks(list(loop.layers))
  return model if out is loop else out


def adapter_sites(model) -> list[Site]:
  """The projections of the modules the model's family adapts (``Family.lora_modules``), in module order."""
  adaptable = family_of(model.config).lora_modules
  out = []
  for path, module in nnx.iter_modules(model):
    if isinstance(module, adaptable):
      for name, contract in module.PROJECTIONS.items():
        out.append(Site(module, name, contract, tuple(path) + (name,)))
  return out


def weight_info(w) -> tuple[tuple[int, ...], tuple, Any]:
  """(shape, logical axes, the array whose placement new arrays follow) of a weight."""
  if isinstance(w, QuantizedWeight):
    return w.shape, w.axes, w.codes.get_value()
  return tuple(w.shape), tuple(w.get_metadata()["out_sharding"]), w.get_value()


def place_like(value: jax.Array, axes: tuple, like, rules: Mapping[str, Any] | None, name: str) -> jax.Array:
  """``value`` on ``like``'s mesh, sharded by its logical ``axes``, when ``like`` is mesh-sharded."""
  sharding = getattr(like, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return value
  rules = DEFAULT_RULES if rules is None else rules
  spec = logical_to_spec(tuple(axes), sharding.mesh, rules, tuple(value.shape), name)
  return jax.device_put(value, NamedSharding(sharding.mesh, spec))
