"""Two processes on localhost (gloo, 2 CPU devices each) reach the same parameters as one process with
4 devices; each process feeds only its own rows of the batch."""

from __future__ import annotations

import socket

import numpy as np
import pytest
from helpers import finish_child, start_child

_CHILD = r"""
import sys
import jax, numpy as np, optax
from jax.experimental import multihost_utils
from jaxgrpo import sharding as shd, train
from jaxgrpo.parallel import distributed
from jaxgrpo.kernels.config import preset
from helpers import G, make_batch, tiny_model

nproc, pid, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
started = distributed.initialize(f"127.0.0.1:{port}" if nproc > 1 else None, nproc if nproc > 1 else None,
                                 pid if nproc > 1 else None)
assert started == (nproc > 1)
assert jax.process_count() == nproc and jax.device_count() == 4, (jax.process_count(), jax.device_count())
mesh = shd.make_mesh("fsdp=2,tensor=2")
model = tiny_model(layers=1)
opt = optax.sgd(0.5, momentum=0.9)
graphdef, state, shardings = train.init_train_state(model, opt, mesh)
step = train.make_train_step(graphdef, opt, preset("lambda_grpo"), mesh=mesh, shardings=shardings,
                             train_config=train.TrainConfig(micro_batches=2, group_size=G, chunk_size=8))
batch = make_batch()._replace(ref_logp=None)
rows = shd.process_batch_rows(mesh, batch.completions.shape[0])
if nproc > 1:
  assert rows.stop - rows.start == batch.completions.shape[0] // nproc, rows
local = train.Batch(*[None if x is None else x[rows] for x in batch])
b = shd.place_batch(local, mesh, process_local=True)
for _ in range(2):
  state, metrics = step(state, b)
flat = {"/".join(map(str, k)): v for k, v in __import__("flax").nnx.to_flat_state(state.params)}
gathered = multihost_utils.process_allgather({k: v[...] for k, v in flat.items()}, tiled=True)
if pid == 0:
  np.savez(out, loss=float(metrics["loss"]), **{k: np.asarray(v) for k, v in gathered.items()})
print("OK", rows, float(metrics["loss"]))
"""


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.subprocess
def test_two_processes_match_one(tmp_path):
  port = _free_port()
  two, one = tmp_path / "two.npz", tmp_path / "one.npz"
  procs = [start_child(_CHILD, devices=2, args=(2, i, port, two)) for i in range(2)]
  single = start_child(_CHILD, devices=4, args=(1, 0, 0, one))
  outs = [finish_child(p) for p in procs]
  out_one = finish_child(single)
  assert "OK slice(0, 8" in outs[0] and "OK slice(8, 16" in outs[1], outs
  assert "OK" in out_one
  a, b = np.load(two), np.load(one)
  assert set(a.files) == set(b.files)
  for k in a.files:
    np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_initialize_flag_errors(monkeypatch):
  from jaxgrpo.parallel import distributed

  for name in (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "SLURM_JOB_ID",
    "OMPI_COMM_WORLD_SIZE",
    "TPU_WORKER_HOSTNAMES",
    "MEGASCALE_COORDINATOR_ADDRESS",
  ):
    monkeypatch.delenv(name, raising=False)
  assert distributed.cluster_detected() is None
  assert distributed.initialize() is False  # single process: nothing to start
  with pytest.raises(ValueError, match="num_processes, process_id missing"):
    distributed.initialize("127.0.0.1:1234")
  with pytest.raises(ValueError, match="host:port"):
    distributed.initialize("localhost", 2, 0)
  with pytest.raises(ValueError, match=r"process_id must be in \[0, num_processes=2\)"):
    distributed.initialize("127.0.0.1:1234", 2, 2)
  monkeypatch.setenv("SLURM_JOB_ID", "7")
  monkeypatch.setenv("SLURM_NTASKS", "4")
  assert distributed.cluster_detected() == "slurm"
