"""Moving arrays between two meshes of different devices: the rollout mesh's copy of the policy
(``jaxgrpo.loop.async_rollout``, ``devices.rollout``) and a distillation teacher's batch and log-probs
(``jaxgrpo.step.feed.make_teacher``, ``devices.teacher``).

One process: ``jax.device_put`` (XLA copies device to device). Several processes, where JAX cannot move an
array between two device sets: each process copies its own shards device to device when its target devices
need exactly the blocks its source devices hold (the meshes split the array alike per process); a leaf for
which some process lacks a block goes through the host (an all-gather of it, then each process places its
blocks) — decided once per tree, the same way on every process.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxgrpo.parallel import distributed

__all__ = ["local_blocks", "move", "transfer_fn"]


def transfer_fn(tree, shardings) -> Callable:
  """The function that places a tree like ``tree`` (arrays on one mesh) with ``shardings`` (a tree of
  ``NamedSharding`` of another mesh, matching ``tree``): module docstring. Its ``.direct`` (several
  processes): per leaf, shard by shard (True) or through the host (False)."""
  if jax.process_count() == 1:
    return lambda t: jax.device_put(t, shardings)
  leaves, treedef = jax.tree.flatten(tree)
  target = jax.tree.leaves(shardings)  # NamedSharding leaves, in the order of the arrays
  assert len(target) == len(leaves), (len(target), len(leaves))
  local = [local_blocks(x, s) is not None for x, s in zip(leaves, target)]
  every = distributed.gather_objects(local)
  direct = [all(e[i] for e in every) for i in range(len(leaves))]

  def transfer(t):
    out = []
    for x, s, fast in zip(jax.tree.leaves(t), target, direct):
      if fast:
        blocks = local_blocks(x, s)
      else:
        host = np.asarray(multihost_utils.process_allgather(x, tiled=True))
        blocks = [(d, host[idx]) for d, idx in s.addressable_devices_indices_map(x.shape).items()]
      arrays = [jax.device_put(b, d) for d, b in blocks]
      out.append(jax.make_array_from_single_device_arrays(x.shape, s, arrays))
    return jax.tree.unflatten(treedef, out)

  transfer.direct = direct
  return transfer


def move(tree, sharding):
  """``tree``'s arrays placed with ``sharding`` (one ``NamedSharding`` for every leaf, e.g. a batch's rows over
  another mesh's ``data × fsdp``), by :func:`transfer_fn` (built for this tree: one small all-gather with several
  processes)."""
  shardings = jax.tree.map(lambda _: sharding, tree)
  return transfer_fn(tree, shardings)(tree)


def local_blocks(x: jax.Array, sharding) -> list | None:
  """``[(target device, this process's shard of x with exactly its block)]``, or None when a block of this
  process's target devices is not one of its shards of ``x``."""
  key = lambda idx: tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(idx, x.shape))
  held = {key(s.index): s.data for s in x.addressable_shards}
  blocks = []
  for d, idx in sharding.addressable_devices_indices_map(x.shape).items():
    if key(idx) not in held:
      return None
    blocks.append((d, held[key(idx)]))
  return blocks
