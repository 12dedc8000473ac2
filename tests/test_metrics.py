"""jaxgrpo.services.metrics: metrics.jsonl truncation on resume, TensorBoard event files (read back and checked),
progress bar content, first-host-only logging, and the W&B/TensorBoard install hints."""

from __future__ import annotations

import builtins
import glob
import json
import os
import struct
import subprocess
import sys

import pytest

from jaxgrpo.services import metrics as M


def _raw_events(logdir: str) -> list:
  """Every Event proto in the TFRecord event files under ``logdir`` (record framing parsed here)."""
  from tensorboardX.proto import event_pb2

  out = []
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    i = 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i : i + 8])
      ev = event_pb2.Event()
      ev.ParseFromString(data[i + 12 : i + 12 + n])
      i += 12 + n + 4
      out.append(ev)
  return out


def _events(logdir: str) -> list[tuple[int, str, float]]:
  """(step, tag, value) of every scalar under ``logdir``."""
  return [
    (ev.step, v.tag, v.simple_value)
    for ev in _raw_events(logdir)
    for v in ev.summary.value
    if v.HasField("simple_value")
  ]


def test_truncate_jsonl_keeps_steps_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  recs = [{"step": 0, "eval_accuracy": 0.1}] + [{"step": s, "loss": s / 10} for s in range(1, 6)]
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in recs)
    f.write('{"step": 6, "lo')  # killed mid-write
  assert M.read_jsonl(path) == recs
  assert M.truncate_jsonl(path, 3) == 3
  assert M.read_jsonl(path) == recs[:4]
  assert open(path).read().endswith("\n")
  assert M.truncate_jsonl(path, 3) == 0 and M.truncate_jsonl(str(tmp_path / "none.jsonl"), 1) == 0


def test_tensorboard_scalars_progress_bar_and_purge_on_resume(tmp_path, capsys):
  out = str(tmp_path)
  with M.MetricsLogger(out, total_steps=4, progress=True, tensorboard=True, config={"lr": 1.0}, is_main=True) as log:
    log({"step": 0, "eval_accuracy": 0.25})
    for s in (1, 2, 3):
      log(
        {
          "step": s,
          "loss": -s / 10,
          "reward_mean": s / 4,
          "kl": 0.01 * s,
          "tokens_per_sec": 1000.0 * s,
          "note": "text is skipped",
          "flag": True,
        }
      )
    log.write("a message")
  err = capsys.readouterr()
  bar = err.err + err.out
  assert "3/4" in bar and "reward=0.75" in bar and "kl=0.03" in bar and "tok/s=3e+03" in bar
  assert "a message" in bar
  ev = _events(os.path.join(out, "tensorboard"))
  assert (0, "eval_accuracy", 0.25) in ev and (3, "reward_mean", 0.75) in ev
  assert {t for _, t, _ in ev} == {"eval_accuracy", "loss", "reward_mean", "kl", "tokens_per_sec"}
  # resumed from step 1: TensorBoard drops the crashed run's events after step 1
  with M.MetricsLogger(out, total_steps=4, start_step=1, progress=False, tensorboard=True, is_main=True) as log:
    log({"step": 2, "loss": 9.0})
  from tensorboardX.proto import event_pb2

  purges = [
    ev.step
    for ev in _raw_events(os.path.join(out, "tensorboard"))
    if ev.HasField("session_log") and ev.session_log.status == event_pb2.SessionLog.START
  ]
  assert purges == [2]  # TensorBoard discards earlier-written events with step >= 2
  assert (2, "loss", 9.0) in _events(os.path.join(out, "tensorboard"))


def test_tensorboard_writer_does_not_load_torch_and_leaves_it_importable(tmp_path):
  # a fresh process: tensorboardX imports torch (~1.2 s) only for its tensor type; the logger keeps it out,
  # writes the same events, and `import torch` afterwards still works
  code = (
    "import sys\nfrom jaxgrpo.services import metrics as M\n"
    "with M.MetricsLogger(sys.argv[1], total_steps=2, progress=False, tensorboard=True, is_main=True) as log:\n"
    "  log({'step': 1, 'loss': 0.5})\n"
    "assert 'tensorboardX' in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)[:5]\n"
    "import torch\nprint(torch.ones(2).sum().item())\n"
  )
  r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.strip() == "2.0"
  assert _events(os.path.join(tmp_path, "tensorboard")) == [(1, "loss", 0.5)]


def test_only_the_first_host_logs(tmp_path, capsys):
  with M.MetricsLogger(str(tmp_path), total_steps=3, progress=True, tensorboard=True, is_main=False) as log:
    log({"step": 1, "loss": 1.0})
    log.write("hidden")
  assert not os.path.exists(tmp_path / "tensorboard")
  cap = capsys.readouterr()
  assert "hidden" not in cap.out + cap.err


def test_missing_logger_packages_give_install_hints(tmp_path, monkeypatch):
  real_import = builtins.__import__

  def fake_import(name, *a, **k):
    if name in ("wandb", "tensorboardX"):
      raise ImportError(f"No module named {name!r}")
    return real_import(name, *a, **k)

  monkeypatch.setattr(builtins, "__import__", fake_import)
  with pytest.raises(ImportError, match=r"wandb: pip install 'jaxgrpo\[logging\]'"):
    M.MetricsLogger(str(tmp_path), total_steps=1, progress=False, tensorboard=False, wandb_project="p", is_main=True)
  with pytest.raises(ImportError, match=r"tensorboardX: pip install 'jaxgrpo\[logging\]'"):
    M.MetricsLogger(str(tmp_path), total_steps=1, progress=False, tensorboard=True, is_main=True)
  # nothing asked for: nothing imported
  M.MetricsLogger(str(tmp_path), total_steps=1, progress=False, tensorboard=False, is_main=True).close()


@pytest.mark.parametrize(
  "tail, kept",
  [
    (b'{"step": 3, "loss": 0.3}', 4),  # a whole last record without its newline (before: the next append joined it)
    (b'{"step": 3, "lo', 3),  # cut short by a full disk
    (b'{"step": 3, "loss": 0.3}\n\xff\xfe\x00garbage', 4),  # bytes that are not text (before: UnicodeDecodeError)
    (b"\n\n", 3),  # empty lines
  ],
)
def test_truncate_jsonl_repairs_the_end_so_appending_goes_on_cleanly(tmp_path, tail, kept):
  path = str(tmp_path / "metrics.jsonl")
  recs = [{"step": s, "loss": s / 10} for s in range(4)]
  with open(path, "wb") as f:
    f.write(b"".join(json.dumps(r).encode() + b"\n" for r in recs[:3]) + tail)
  M.truncate_jsonl(path, 5)
  with open(path, "ab", buffering=0) as f:  # what the resumed trainer does next
    M.append_record(f, {"step": 4, "loss": 0.4})
  lines = open(path, "rb").read().split(b"\n")
  assert lines[-1] == b"" and [json.loads(x) for x in lines[:-1]] == recs[:kept] + [{"step": 4, "loss": 0.4}]


class _FullDisk:
  """An unbuffered file that takes ``room`` bytes, then fails like a full disk."""

  name = "/full/metrics.jsonl"

  def __init__(self, room):
    self.room, self.data = room, b""

  def write(self, b):
    if not self.room:
      raise OSError(28, "No space left on device")
    n = min(self.room, len(b))
    self.data += bytes(b[:n])
    self.room -= n
    return n


def test_append_record_continues_short_writes_and_names_a_full_disk():
  f = _FullDisk(room=10**6)
  M.append_record(f, {"step": 1, "x": "y" * 5000})
  assert json.loads(f.data) == {"step": 1, "x": "y" * 5000}
  f = _FullDisk(room=4096)
  with pytest.raises(M.MetricsWriteError) as e:
    M.append_record(f, {"step": 7, "x": "y" * 5000}, path="OUT/metrics.jsonl")
  assert str(e.value) == "writing the metrics of step 7 to OUT/metrics.jsonl failed: ENOSPC (No space left on device)"
  assert e.value.step == 7 and len(f.data) == 4096  # the cut line truncate_jsonl drops on resume
