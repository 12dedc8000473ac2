"""Failure modes in-process, on hand-built states (fast): non-finite values are never saved and stop
the run with a message naming the step and what went wrong; a step directory without a manifest
is moved aside so that its step can be saved again; a failed background save (a real write error
from the OS: a file-size limit, and a full tmpfs where mounting is allowed) is reported at once
with the step, path and OS error, stops or lets training continue, and never costs a complete
checkpoint; truncated or garbage safetensors files give one ValueError naming the file and tensor.

The same failures through ``scripts/train.py`` in child processes (and the signals) are in
``test_failure_modes_runs.py``; ``docs/failure_modes.md`` lists them all.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import io
import json
import logging
import os
import resource
import shutil
import struct
import subprocess
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxgrpo.models import hf
from jaxgrpo.run.control import nonfinite_error as _nonfinite_error
from jaxgrpo.services import _orbax_noise
from jaxgrpo.services import checkpoint as ck
from jaxgrpo.services.checkpoint import RunMeta, Snapshot

RUN = RunMeta(identity={"model": "tiny"}, guarded={"lr": 1e-2}, config={"run": {"steps": 9}})


def _state(step: int, shape=(4, 3), poison: str | None = None) -> Snapshot:
  """A snapshot with random parameters and Adam moments; ``poison`` puts a NaN into ``"params"`` (the
  second parameter) or ``"opt_state"`` (the second moment of the first parameter)."""
  rng = np.random.default_rng(step)
  params = {"a": jnp.asarray(rng.normal(size=shape), jnp.float32), "b": jnp.asarray(rng.normal(size=shape[-1:]))}
  opt = optax.adam(1e-2)
  _, opt_state = opt.update(jax.tree.map(jnp.ones_like, params), opt.init(params), params)
  if poison == "params":
    params["b"] = params["b"].at[1].set(jnp.nan)
  if poison == "opt_state":
    adam = opt_state[0]
    opt_state = (adam._replace(nu={**adam.nu, "a": adam.nu["a"].at[0, 0].set(jnp.inf)}),) + tuple(opt_state[1:])
  key = jax.random.fold_in(jax.random.key(0), step)
  return Snapshot(params, opt_state, jnp.asarray(step, jnp.int32), key, {"offset": step})


def _wait_for(pred, timeout=60.0):
  t0 = time.monotonic()
  while not pred():
    if time.monotonic() - t0 > timeout:
      return False
    time.sleep(0.05)
  return True


# ----------------------------------------------------------------------------- non-finite values


def test_first_nonfinite_names_the_first_bad_leaf():
  s = _state(1)
  assert ck.first_nonfinite(s.params) is None and ck.first_nonfinite(s.opt_state) is None
  assert ck.first_nonfinite(_state(1, poison="params").params, "params") == "params['b']"
  where = ck.first_nonfinite(_state(1, poison="opt_state").opt_state, "opt_state")
  assert where is not None and where.startswith("opt_state[0].nu['a']"), where
  # integer and key leaves are skipped, not misread; a mixed tree with an inf deep inside
  tree = {
    "count": jnp.asarray(3, jnp.int32),
    "key": jax.random.key(0),
    "x": [jnp.zeros(3), jnp.asarray([1.0, -np.inf])],
  }
  assert ck.first_nonfinite(tree) == "['x'][1]"
  want = [np.all(np.isfinite(np.asarray(x))) for x in (tree["x"][0], tree["x"][1])]  # NumPy reference
  assert want == [True, False]


def test_nonfinite_error_policy_and_message():
  finite = {"step": 5, "loss": 0.5, "grad_norm": 1.0}
  assert _nonfinite_error(5, finite, None, stop_on_loss=True) is None
  # another metric non-finite, state finite: a warning only (None here)
  assert _nonfinite_error(5, {**finite, "kl": float("nan")}, None, stop_on_loss=True) is None
  # non-finite loss with a finite state: stops by default, goes on when asked to
  err = _nonfinite_error(5, {**finite, "loss": float("inf")}, None, stop_on_loss=True)
  assert err is not None and err.step == 5 and err.where == "loss"
  assert "step 5" in str(err) and "loss = inf" in str(err) and "still finite" in str(err)
  assert _nonfinite_error(5, {**finite, "loss": float("nan")}, None, stop_on_loss=False) is None
  # a non-finite state always stops: the first non-finite metric and the state entry are named
  m = {"step": 7, "loss": 0.1, "grad_norm": float("nan"), "kl": float("nan")}
  err = _nonfinite_error(7, m, "params['w']", stop_on_loss=False)
  assert err.where == "grad_norm" and "first non-finite metric: grad_norm = nan (all: grad_norm, kl)" in str(err)
  assert "params['w']" in str(err) and "Nothing of step 7 was saved" in str(err)
  err = _nonfinite_error(7, finite, "opt_state[0].nu['a']", stop_on_loss=True)  # metrics finite: the path
  assert err.where == "opt_state[0].nu['a']" and "opt_state[0].nu['a']" in str(err)


def test_nonfinite_state_is_never_saved_and_good_checkpoints_survive(tmp_path):
  root = str(tmp_path / "ckpt")
  with ck.Checkpointer(root, max_to_keep=2, log=None) as c:
    c.save(_state(1), RUN)
    c.save(_state(2), RUN)
    for poison in ("params", "opt_state", "params"):  # more bad saves than keep-last-2 would keep
      with pytest.raises(ck.NonFiniteError, match=r"refusing to save step 3: (params|opt_state)\S* holds NaN"):
        c.save(_state(3, poison=poison), RUN)
    c.wait()
    assert ck.complete_steps(root, log=None) == [1, 2]  # before: NaN steps saved, 1 and 2 deleted
    c.save(_state(4), RUN)
  assert ck.complete_steps(root, log=None) == [2, 4]
  got = ck.Checkpointer(root, log=None).restore(_state(0), RUN)
  assert ck.first_nonfinite(got.params) is None and int(got.step) == 4


# ----------------------------------------------------------------------------- manifest-less steps


def test_manifestless_step_is_moved_aside_and_saved_again(tmp_path):
  """The state a kill between Orbax's rename and the manifest write left (an older foreground
  save): constructed from a real save by removing its manifest. Before: resume from step 1, then
  StepAlreadyExistsError when saving step 2, at every restart."""
  root = str(tmp_path / "ckpt")
  with ck.Checkpointer(root, async_save=False, log=None) as c:
    c.save(_state(1), RUN)
    c.save(_state(2), RUN)
  os.remove(os.path.join(root, "2", ck.MANIFEST))
  for restart in range(2):  # a scheduler restarting the job twice
    msgs = []
    with ck.Checkpointer(root, async_save=False, log=msgs.append) as c:
      got = c.restore_fn(RUN, _state(0))
      assert int(got.step) == (1 if restart == 0 else 2)
      if restart == 0:
        assert any("moved aside" in m and "step 2 will be saved again" in m for m in msgs), msgs
      c.save(_state(2 + restart), RUN)  # restart 0 saves step 2 again, restart 1 step 3
  assert ck.complete_steps(root, log=None) == [1, 2, 3]
  aside = [n for n in os.listdir(root) if ".incomplete-" in n]
  assert len(aside) == 1 and aside[0].startswith("2.incomplete-")
  for s in (1, 2, 3):
    ck.verify_step(os.path.join(root, str(s)))


def test_foreground_save_writes_the_manifest_before_the_rename(tmp_path, monkeypatch):
  """Foreground saves now take the asynchronous path and wait: the manifest is written into the
  temporary directory, so no kill can leave a renamed step without it."""
  seen = []
  orig = ck.Checkpointer._finalized

  def spy(self):
    seen.append(os.path.isdir(os.path.join(self.directory, f"{self._saves.step}{ck.TMP_SUFFIX}")))
    orig(self)

  monkeypatch.setattr(ck.Checkpointer, "_finalized", spy)
  root = str(tmp_path / "ckpt")
  with ck.Checkpointer(root, async_save=False, log=None) as c:
    c.save(_state(1), RUN)
    assert ck.complete_steps(root, log=None) == [1]  # on disk when save returns
  assert seen == [True]


# ----------------------------------------------------------------------------- failed saves


def _big_state(step: int) -> Snapshot:
  """~0.5 MB of incompressible parameters (random normal)."""
  params = {"w": jax.random.normal(jax.random.key(step), (256, 512))}
  return Snapshot(params, optax.adam(1e-2).init(params), jnp.asarray(step, jnp.int32), jax.random.key(step), {})


class _FileSizeLimit:
  """RLIMIT_FSIZE on this process: a write past ``limit`` bytes fails with EFBIG (Python ignores
  SIGXFSZ). A real OS write error without mount rights."""

  def __init__(self, limit: int):
    self.limit = limit

  def __enter__(self):
    self.old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.old[1]))

  def __exit__(self, *exc):
    resource.setrlimit(resource.RLIMIT_FSIZE, self.old)


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_failed_background_save_is_reported_at_once_and_keeps_good_checkpoints(tmp_path, policy):
  root = str(tmp_path / "ckpt")
  msgs = []
  c = ck.Checkpointer(root, max_to_keep=2, log=msgs.append, on_save_error=policy)
  c.save(_big_state(1), RUN)
  c.save(_big_state(2), RUN)
  c.wait()
  with _FileSizeLimit(64 * 1024):
    c.save(_big_state(3), RUN)  # returns: the write runs in the background
    # reported at once, from the background, without any further call into the checkpointer
    assert _wait_for(lambda: any(m.startswith("error:") for m in msgs)), msgs
  (msg,) = [m for m in msgs if m.startswith("error:")]
  assert "checkpoint save of step 3 failed: EFBIG (File too large)" in msg, msg
  assert os.path.join(root, "3") in msg and "last complete checkpoint is step 2" in msg
  assert ck.complete_steps(root, log=None) == [1, 2]  # keep-last-2 did not drop step 1 for a failed save
  assert not [n for n in os.listdir(root) if ck.TMP_SUFFIX in n]  # the partial step was removed
  if policy == "stop":
    with pytest.raises(ck.CheckpointSaveError) as e:
      c.observe({"step": 3, "loss": 0.0})  # the trainer's next call
    assert e.value.step == 3 and e.value.reason.startswith("EFBIG") and e.value.last_complete == 2
    assert isinstance(e.value.__cause__, Exception) and "Training stops" in str(e.value)
    c.observe({"step": 3, "loss": 0.0})  # raised once
  else:
    c.observe({"step": 3, "loss": 0.0})
    assert [f.step for f in c.failed_saves] == [3] and "Training continues" in msg
  c.save(_big_state(4), RUN)  # space is back: the next save works
  c.close()
  assert ck.complete_steps(root, log=None) == [2, 4]
  for s in (2, 4):
    ck.verify_step(os.path.join(root, str(s)))


def test_failed_foreground_save_raises_in_save(tmp_path):
  root = str(tmp_path / "ckpt")
  with ck.Checkpointer(root, async_save=False, log=None) as c:
    c.save(_big_state(1), RUN)
    with _FileSizeLimit(64 * 1024), pytest.raises(ck.CheckpointSaveError, match=r"step 2 failed: EFBIG"):
      c.save(_big_state(2), RUN)
    assert ck.complete_steps(root, log=None) == [1]


@pytest.fixture
def small_tmpfs(tmp_path):
  """A 2 MB tmpfs (needs mount rights: skipped where they are missing); unmounted afterwards."""
  mnt = tmp_path / "tmpfs"
  mnt.mkdir()
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(mnt)], capture_output=True, text=True)
  if r.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
  yield mnt
  subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full_on_a_small_tmpfs(small_tmpfs):
  root = str(small_tmpfs / "ckpt")
  msgs = []
  c = ck.Checkpointer(root, max_to_keep=3, log=msgs.append)
  last_ok = 0
  for s in range(1, 8):  # ~0.55 MB per step: the fourth does not fit next to three
    try:
      c.save(_big_state(s), RUN)
      c.wait()
    except ck.CheckpointSaveError as e:
      failed = e
      break
    last_ok = s
  else:
    pytest.fail(f"the disk never filled up: {msgs}")
  c.close()
  assert failed.reason == f"ENOSPC ({os.strerror(errno.ENOSPC)})" and failed.last_complete == last_ok >= 1
  assert any(m.startswith("error: checkpoint save of step") and "ENOSPC" in m for m in msgs)
  done = ck.complete_steps(root, log=None)
  assert done and done[-1] == last_ok and failed.step > last_ok
  assert not [n for n in os.listdir(root) if ck.TMP_SUFFIX in n]
  for s in done:
    ck.verify_step(os.path.join(root, str(s)))


# ----------------------------------------------------------------------------- safetensors files


def _write_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
  """The format written by hand from its spec: u64 header length, JSON header, raw little-endian data."""
  header, blobs, offset = {}, [], 0
  for name, x in tensors.items():
    raw = np.ascontiguousarray(x).tobytes()
    header[name] = {"dtype": {np.float32: "F32", np.int32: "I32"}[x.dtype.type], "shape": list(x.shape)}
    header[name]["data_offsets"] = [offset, offset + len(raw)]
    blobs.append(raw)
    offset += len(raw)
  head = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def test_safetensors_reader_roundtrip_and_clear_errors(tmp_path):
  a = np.arange(12, dtype=np.float32).reshape(3, 4)
  b = np.asarray([7, -1], np.int32)
  good = tmp_path / "good.safetensors"
  _write_safetensors(good, {"a": a, "b": b})
  got = hf._mmap_safetensors(str(good))
  np.testing.assert_array_equal(got["a"], a)
  np.testing.assert_array_equal(got["b"], b)
  raw = good.read_bytes()
  n = struct.unpack("<Q", raw[:8])[0]

  def bad(name, data, pattern):
    p = tmp_path / name
    p.write_bytes(data)
    with pytest.raises(ValueError, match=pattern) as e:
      hf._mmap_safetensors(str(p))
    assert str(p) in str(e.value)

  bad("empty.safetensors", b"", r"0 bytes, shorter than the 8-byte header length")
  bad("garbage.safetensors", os.urandom(3000), r"the header claims \d+ bytes|header is not JSON|not an object")
  bad("cut_header.safetensors", raw[: 8 + n // 2], rf"the header claims {n} bytes")
  bad("not_json.safetensors", struct.pack("<Q", 5) + b"hello" + raw[8 + n :], r"its 5-byte header is not JSON")
  bad("list.safetensors", struct.pack("<Q", 2) + b"[]", r"header is a JSON list, not an object")
  bad("truncated.safetensors", raw[:-5], r"tensor 'b' in \S+: its bytes \[48, 56\) run past the end .* truncated")
  head = json.loads(raw[8 : 8 + n])
  head["a"]["shape"] = [4, 4]
  h = json.dumps(head).encode()
  bad("shape.safetensors", struct.pack("<Q", len(h)) + h + raw[8 + n :], r"tensor 'a' .*48 bytes for shape \(4, 4\)")
  head["a"] = "oops"
  h = json.dumps(head).encode()
  bad("entry.safetensors", struct.pack("<Q", len(h)) + h + raw[8 + n :], r"tensor 'a' .*malformed header entry")
  # a sharded directory whose index is garbage or names a missing shard
  d = tmp_path / "sharded"
  d.mkdir()
  (d / "model.safetensors.index.json").write_text("{not json")
  with pytest.raises(ValueError, match=r"model.safetensors.index.json is not a safetensors index"):
    hf.read_checkpoint(str(d))
  (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "part-1.safetensors"}}))
  with pytest.raises(ValueError, match=r"lists shards that are not in .*part-1.safetensors"):
    hf.read_checkpoint(str(d))
  shutil.copy(good, d / "part-1.safetensors")
  assert set(hf.read_checkpoint(str(d))) == {"a", "b"}


def test_closed_loop_noise_filter_drops_only_that_traceback():
  """TensorStore's "Event loop is closed" tracebacks after a failed save are dropped; other
  tracebacks, lines split across writes and progress-bar fragments pass through unchanged."""
  out = io.StringIO()
  f = ck.ClosedLoopNoiseFilter(out)
  noise = (
    "Traceback (most recent call last):\n"
    '  File "asyncio/base_events.py", line 806, in call_soon_threadsafe\n'
    "    self._check_closed()\n"
    "RuntimeError: Event loop is closed\n"
  )
  other = 'Traceback (most recent call last):\n  File "a.py", line 1, in f\nRuntimeError: Event loop is closed\n'
  f.write("before\n")
  f.write(noise[:30])
  f.write(noise[30:] + noise)
  f.write("\r 50%|█")
  f.write(other)
  f.write("error: checkpoint save of step 3 failed\n")
  f.flush()
  assert out.getvalue() == "before\n\r 50%|█" + other + "error: checkpoint save of step 3 failed\n"


def _unretrieved_task_failure(message: str, raiser=None) -> None:
  """Runs an asyncio task that fails with ``message`` (or whatever ``raiser()`` raises) and is never awaited,
  then collects it: asyncio logs ``Task exception was never retrieved`` as Orbax's sibling writes do after a
  failed save."""

  async def fail():
    if raiser is not None:
      raiser()
    raise ValueError(message)

  async def main():
    asyncio.get_running_loop().create_task(fail())
    asyncio.gather(fail())  # a _GatheringFuture never awaited, as Orbax leaves them too
    await asyncio.sleep(0.01)

  asyncio.run(main())
  gc.collect()


def test_unretrieved_write_errors_of_a_failed_save_are_not_logged(tmp_path, caplog):
  """The sibling write errors of a failed save (already reported in one line) are dropped from the
  asyncio log; the same error for another directory or another message still shows."""
  mine = ck.Checkpointer(str(tmp_path / "ckpt"), log=None)
  _orbax_noise.hide_unretrieved_writes(mine.directory)  # as scripts/train.py does
  try:
    tmp = os.path.join(mine.directory, "3" + ck.TMP_SUFFIX, "opt_state")
    with caplog.at_level(logging.ERROR, logger="asyncio"):
      _unretrieved_task_failure(f"RESOURCE_EXHAUSTED: Error writing in {tmp}: No space left on device")
      assert "never retrieved" not in caplog.text
      other = str(tmp_path / "elsewhere" / ("3" + ck.TMP_SUFFIX))
      _unretrieved_task_failure(f"RESOURCE_EXHAUSTED: Error writing in {other}")
      assert "Task exception was never retrieved" in caplog.text and "elsewhere" in caplog.text
      caplog.clear()
      _unretrieved_task_failure("a bug in the user's own coroutine")
      assert "a bug in the user's own coroutine" in caplog.text
      caplog.clear()  # ENOSPC raised when Orbax's writer closes a file (as seen in CI): no path in the error
      _unretrieved_task_failure("", raiser=_orbax_frame_raising_enospc())
      assert "never retrieved" not in caplog.text
      _unretrieved_task_failure("", raiser=_enospc)  # the same error from anyone else's code still shows
      assert "Future exception was never retrieved" in caplog.text or "Task exception" in caplog.text
  finally:
    mine.close()


def _enospc():
  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _orbax_frame_raising_enospc():
  """A function whose frame lies in Orbax's path writer (its code compiled under that file name) and raises
  ENOSPC, as ``orbax/checkpoint/_src/path/async_path.py``'s ``_write`` does on a full disk."""
  name = os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "_src", "path", "async_path.py")
  scope = {"errno": errno, "os": os}
  exec(compile("def _write():\n  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n", name, "exec"), scope)
  return scope["_write"]


def test_closed_loop_noise_filter_with_interleaved_threads():
  """Two TensorStore threads print the noise at once, line by line interleaved (as seen in CI):
  both are dropped, and a real traceback from a third thread, interleaved too, passes whole."""
  out = io.StringIO()
  f = ck.ClosedLoopNoiseFilter(out)
  noise = [
    "Traceback (most recent call last):\n",
    '  File "asyncio/base_events.py", line 806, in call_soon_threadsafe\n',
    "    self._check_closed()\n",
    "RuntimeError: Event loop is closed\n",
  ]
  other = ["Traceback (most recent call last):\n", '  File "a.py", line 1, in f\n', "ValueError: real\n"]
  order = [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (0, 2), (2, 2), (1, 2), (0, 3), (1, 3)]
  texts = [noise, noise, other]
  turn = [0]
  cond = threading.Condition()

  def writer(who):
    for k, (w, i) in enumerate(order):
      if w != who:
        continue
      with cond:
        cond.wait_for(lambda k=k: turn[0] == k)
        f.write(texts[w][i])
        turn[0] += 1
        cond.notify_all()

  threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=30)
  f.write("error: checkpoint save of step 3 failed\n")
  f.flush()
  assert out.getvalue() == "".join(other) + "error: checkpoint save of step 3 failed\n"
