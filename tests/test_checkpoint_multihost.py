"""Multi-host checkpoints: two processes (localhost, 2 CPU devices each, one fsdp=2 x tensor=2 mesh) save
one checkpoint, each writing its own shards; it restores exactly in two processes again (the same two,
through a new Checkpointer, once every save is complete) and in the test's own process on a different mesh
(1 device), which never opened it (a child process of its own would cost a JAX start-up)."""

from __future__ import annotations

import os
import socket

import pytest
from helpers import finish_child, start_child


def save_restore(root: str, mode: str) -> tuple[int, int]:
  """``mode`` ``save``: save a state that differs from a fresh init under ``root``, verify it (process 0), then, once
  every process's save is complete, restore it through a new Checkpointer; ``restore``: restore it only. The
  restored state must equal the saved one exactly (parameters and optimizer moments gathered over the processes,
  the step, key and data position) and sit on this run's mesh (``fsdp=2,tensor=2`` on 4 devices, else
  ``fsdp=1``). Returns ``(jax.process_count(), jax.device_count())``."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from helpers import tiny_model
  from jax.experimental import multihost_utils

  from jaxgrpo.parallel import sharding as shd
  from jaxgrpo.services.checkpoint import Checkpointer, RunMeta, Snapshot, verify_step
  from jaxgrpo.step import train

  mesh = shd.make_mesh("fsdp=2,tensor=2" if jax.device_count() == 4 else "fsdp=1")
  opt = optax.adamw(1e-2)
  graphdef, fresh, sh = train.init_train_state(tiny_model(), opt, mesh)
  # the saved state: parameters and optimizer moments that differ from a fresh init
  upd = jax.jit(lambda p: jax.tree.map(lambda x: x * 1.5 + 0.25, p), out_shardings=sh.params)
  params = upd(fresh.params)
  grads = jax.jit(lambda p: jax.tree.map(lambda x: jnp.sin(x), p), out_shardings=sh.params)(params)
  _, opt_state = jax.jit(opt.update, out_shardings=(sh.params, sh.opt_state))(grads, fresh.opt_state, params)
  want = Snapshot(
    params,
    opt_state,
    jax.device_put(jnp.asarray(7, jnp.int32), sh.step),
    jax.random.key(3),
    {"epoch": 1, "offset": 5, "seed": 0, "num_prompts": 10, "shuffle": True},
  )
  cfg = RunMeta(identity={"model": "tiny"}, guarded={"lr": 1e-2}, config={"run": {"steps": 7}})
  ck = Checkpointer(root, log=print)
  if mode == "save":
    ck.save(want, cfg)
    ck.close()
    if jax.process_index() == 0:
      verify_step(root + "/7")
    print("SAVED", jax.process_count(), flush=True)
    # the same processes restore next, through a new Checkpointer reading the files: every process's save
    # is complete first (and the step verified)
    multihost_utils.sync_global_devices("saved")
    ck = Checkpointer(root, log=print)
  got = ck.restore(Snapshot(fresh.params, fresh.opt_state, fresh.step, jax.random.key(0), {}), cfg)
  ck.close()
  gather = lambda t: multihost_utils.process_allgather(t, tiled=True)
  for name, a, b in (("params", got.params, want.params), ("opt_state", got.opt_state, want.opt_state)):
    la, lb = jax.tree.leaves(gather(a)), jax.tree.leaves(gather(b))
    assert len(la) == len(lb) > 0
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)), name
  leaf = jax.tree.leaves(got.params)[0]
  assert leaf.sharding == jax.tree.leaves(fresh.params)[0].sharding  # placed on this run's mesh
  assert int(got.step) == 7 and got.data_position["offset"] == 5
  assert np.array_equal(jax.random.key_data(got.key), jax.random.key_data(jax.random.key(3)))
  return jax.process_count(), jax.device_count()


_CHILD = r"""
import sys
nproc, pid, port, root, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
from jaxgrpo.parallel import distributed
distributed.initialize(f"127.0.0.1:{port}", nproc, pid)
from test_checkpoint_multihost import save_restore
print("RESTORED", *save_restore(root, mode))
"""


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _two(root, mode):
  port = _free_port()
  procs = [start_child(_CHILD, devices=2, args=(2, i, port, root, mode)) for i in range(2)]
  return [finish_child(p) for p in procs]


@pytest.mark.slow
@pytest.mark.subprocess
def test_two_hosts_save_each_their_shards_restore_on_two_hosts_and_on_one_device(tmp_path):
  root = str(tmp_path / "ckpt")
  outs = _two(root, "save")  # save, then restore in the same two processes (two start-ups fewer)
  assert all("SAVED 2" in o and "RESTORED 2 4" in o.split("SAVED 2")[1] for o in outs), outs
  per_process = sorted(d for d in os.listdir(os.path.join(root, "7", "params")) if d.startswith("ocdbt.process_"))
  assert per_process == ["ocdbt.process_0", "ocdbt.process_1"]  # each host wrote its shards
  # then in this process (1 device), which never saw the checkpoint: a restore on another mesh
  assert save_restore(root, "restore") == (1, 1)
