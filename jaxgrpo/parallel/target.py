"""The platform a program is built for ("cpu", "gpu", "tpu"), read while it is traced.

Some choices of the models depend on the hardware that will run the program: on XLA:CPU a bf16 model's
products take float32 operands or the hand-written mixed kernel, its KV cache is float32, a mixture of experts
dispatches by tiles; on an accelerator the products stay bf16, the cache keeps the compute dtype, the experts go
through ``ragged_dot`` (docs/models.md, "Target platform"). Those choices read :func:`current_platform` at trace
time, which is the platform of the devices the program is compiled for, never the host's default backend: a
program compiled on a CPU host for TPU devices (``jax.experimental.topologies``, scripts/setup_tpu_venv.sh) is
the TPU program.

The rule (:func:`current_platform`), first that applies:

1. the context mesh (``with jax.set_mesh(mesh):``, which the train step, the reference pass and the reward model
   enter around their programs): the platform of its devices. The mesh is part of ``jax.jit``'s cache key, so a
   program is never reused for another platform;
2. the innermost :func:`target_platform` block: the samplers enter one with the platform of the model's arrays
   (``jax.jit`` keys its cache on their devices too);
3. ``jax.default_backend()``: only a program traced with neither (e.g. a bare ``jax.jit(model)``) falls back to
   the process's default device.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import jax
from jax.sharding import Mesh, Sharding

__all__ = ["current_platform", "platform_of", "target_platform"]

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxgrpo_target_platform", default=None)


def platform_of(where: Any) -> str | None:
  """The platform name of ``where``, or None when it names none:

  - a ``str``: itself ("cpu", "gpu", "tpu", ...);
  - a ``jax.sharding.Mesh``: its first device's ``platform``; an ``AbstractMesh``: its abstract device's
    (None when it has none);
  - a ``jax.Device``: its ``platform``; a ``Sharding``: its first device's;
  - an array or ``jax.ShapeDtypeStruct`` with a sharding: the sharding's; one without (a NumPy array, an
    unplaced ``ShapeDtypeStruct``): None;
  - any other pytree (an ``nnx.State``, a tuple of arrays): the first leaf that names a platform.
  """
  if isinstance(where, str):
    return where
  if isinstance(where, Mesh):
    return where.devices.flat[0].platform
  if isinstance(where, jax.sharding.AbstractMesh):
    device = getattr(where, "abstract_device", None)
    return None if device is None else device.platform
  if isinstance(where, jax.Device):
    return where.platform
  if isinstance(where, Sharding):
    return next(iter(where.device_set)).platform
  sharding = getattr(where, "sharding", None)
  if isinstance(sharding, Sharding):
    return platform_of(sharding)
  leaves = jax.tree.leaves(where)
  if len(leaves) == 1 and leaves[0] is where:
    return None
  return next((p for p in map(platform_of, leaves) if p is not None), None)


@contextlib.contextmanager
def target_platform(where: Any) -> Iterator[str | None]:
  """Inside the block, programs traced without a context mesh are built for ``platform_of(where)`` (a platform
  name, a mesh, a device, a sharding, or a pytree of placed arrays; one that names no platform changes nothing).
  Yields the platform set (or None). Read at trace time; ``jax.jit`` does not key its cache on it, so enter it
  with the platform of the arguments' devices (as the samplers do), not to force another one."""
  platform = platform_of(where)
  token = _TARGET.set(platform) if platform is not None else None
  try:
    yield platform
  finally:
    if token is not None:
      _TARGET.reset(token)


def current_platform() -> str:
  """The platform of the program being traced: the context mesh's, else the innermost :func:`target_platform`'s,
  else ``jax.default_backend()`` (module docstring)."""
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    platform = platform_of(mesh)
    if platform is not None:
      return platform
  target = _TARGET.get()
  return jax.default_backend() if target is None else target
