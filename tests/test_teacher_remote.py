"""A distillation teacher served over HTTP (``objective.distill.teacher: http://...``, issue 52 item 2): the real
server (``scripts/teacher_server.py`` in a subprocess on 127.0.0.1) scores rows with the numbers of the
in-process teacher (``feed.make_teacher``, the same weights) within 1e-6, sampled-token and top-k; the client
checks the server's vocabulary and tokenizer at start, a response's shapes and a refused request in one line;
a run with the remote teacher trains as the in-process one does; a server killed mid-run stops the run with
:class:`TeacherUnavailable` (one line naming the URL) after its retries, and the CLI exits 2 with one line.
"""

from __future__ import annotations

import http.server
import json
import os
import pathlib
import socket
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
from helpers import child_env

from jaxgrpo.kernels import distill
from jaxgrpo.step.teacher_remote import (
  RemoteTeacher,
  TeacherProtocolError,
  TeacherUnavailable,
  encode_array,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
SERVER = ROOT / "scripts" / "teacher_server.py"
TEACHER = "synthetic:48x2"  # the arithmetic task's tokenizer (128 ids), a run of run.seed 0 builds it from seed 1


def start_server(teacher=TEACHER, seed=1):
  """``(process, url)``: scripts/teacher_server.py on a free port of 127.0.0.1, once it prints its line."""
  proc = subprocess.Popen(
    [sys.executable, str(SERVER), "--teacher", teacher, "--seed", str(seed), "--port", "0", "--chunk-size", "5"],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=child_env(1),
  )
  line = proc.stdout.readline()
  if not line.startswith("serving "):
    proc.kill()
    raise AssertionError(f"teacher server did not start: {line!r} {proc.stderr.read()[-2000:]}")
  return proc, line.split(" on ")[1].split()[0]


def stop(proc):
  proc.kill()
  proc.wait(30)
  proc.stdout.close()
  proc.stderr.close()


@pytest.fixture(scope="module")
def server():
  proc, url = start_server()
  yield url
  stop(proc)


def _in_process(top_k, temperature):
  """The in-process teacher (``feed.make_teacher``) of TEACHER seed 1 beside a tiny student's step, and a batch."""
  import optax
  from helpers import G, make_batch, tiny_model

  from jaxgrpo.kernels.config import preset
  from jaxgrpo.parallel import sharding as shd
  from jaxgrpo.run.teacher import load_teacher
  from jaxgrpo.step import feed, train

  kind = "sampled" if top_k is None else "jsd"
  config = preset("grpo", distill=distill.DistillConfig(weight=0.5, kind=kind, top_k=top_k or 16))
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.sgd(0.1)
  graphdef, _, shardings = train.init_train_state(tiny_model(layers=1), opt, mesh)
  tc = train.TrainConfig(group_size=G, chunk_size=5, micro_batches=2, temperature=temperature)
  step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc)
  model, _ = load_teacher(TEACHER, seed=1)
  return feed.make_teacher(step, model, student_vocab=128), make_batch(31)


@pytest.mark.subprocess
@pytest.mark.parametrize("top_k,temperature", [(None, 1.0), (5, 0.7)])
def test_remote_scores_equal_the_in_process_teacher(server, top_k, temperature):
  """The server's log-probs of the sampled tokens (and top-k ids and log-probs) equal the in-process teacher's
  of the same weights: ids exactly, log-probs within 1e-6 (float32), at the step's temperature."""
  local, batch = _in_process(top_k, temperature)
  want = local(batch)
  got = RemoteTeacher(server, top_k=top_k, temperature=temperature)(batch)
  mask = np.asarray(batch.mask)
  np.testing.assert_allclose(np.asarray(got.teacher_logp)[mask], np.asarray(want.teacher_logp)[mask], atol=1e-6)
  if top_k is None:
    assert got.teacher_topk_ids is None and got.teacher_topk_logp is None
    return
  np.testing.assert_array_equal(np.asarray(got.teacher_topk_ids)[mask], np.asarray(want.teacher_topk_ids)[mask])
  np.testing.assert_allclose(
    np.asarray(got.teacher_topk_logp)[mask], np.asarray(want.teacher_topk_logp)[mask], atol=1e-6
  )


@pytest.mark.subprocess
def test_vocabulary_and_tokenizer_are_checked_at_start(server):
  """``check``: the server's vocab size against the policy's, then its tokenizer fingerprint (one line each)."""
  from jaxgrpo.run.teacher import load_teacher, tokenizer_fingerprint

  client = RemoteTeacher(server)
  with pytest.raises(ValueError, match=r"vocab_size=128 but the policy's is 64") as e:
    client.check(64, None)
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match=r"tokenizer fingerprint sha256:\w+ but the policy's is sha256:other"):
    client.check(128, "sha256:other")
  tok = load_teacher("synthetic:32x1", seed=0)[1]  # the policy's tokenizer: the arithmetic task's
  assert client.check(128, tokenizer_fingerprint(tok))["vocab_size"] == 128


@pytest.mark.subprocess
def test_a_refused_request_and_a_dead_server_in_one_line(server):
  """A token id outside the teacher's vocabulary: the server's 400 line, not retried; nothing listening: every
  attempt fails, then :class:`TeacherUnavailable` naming the URL and the attempts."""
  client = RemoteTeacher(server, retries=2, backoff_s=0.01)
  rows = np.full((2, 3), 500, np.int32), np.ones((2, 3), bool), np.zeros((2, 4), np.int32), np.ones((2, 4), bool)
  with pytest.raises(TeacherProtocolError, match=r"HTTP 400: `prompt_tokens` holds id 500 outside .*\[0, 128\)"):
    client.scores(*rows)
  assert client.requests == 1
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]  # closed when the block ends: nothing listens there
  dead = RemoteTeacher(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01)
  with pytest.raises(TeacherUnavailable, match=rf"127.0.0.1:{port}/score: no answer after 3 attempts") as e:
    dead.scores(*rows)
  assert "\n" not in str(e.value) and dead.requests == 3


class _Wrong(http.server.BaseHTTPRequestHandler):
  """A server that answers /score with ``logp`` one position short."""

  def do_POST(self):
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    b, t = body["completions"]["shape"]
    data = json.dumps({"logp": encode_array(np.zeros((b, t - 1), np.float32))}).encode()
    self.send_response(200)
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def log_message(self, *args):
    pass


def test_a_response_of_the_wrong_shape_is_refused():
  httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Wrong)
  threading.Thread(target=httpd.serve_forever, daemon=True).start()
  try:
    client = RemoteTeacher(f"http://127.0.0.1:{httpd.server_address[1]}")
    rows = np.zeros((2, 3), np.int32), np.ones((2, 3), bool), np.zeros((2, 4), np.int32), np.ones((2, 4), bool)
    with pytest.raises(TeacherProtocolError, match=r"`logp` is float32\[2, 3\], expected float32\[2, 4\]"):
      client.scores(*rows)
  finally:
    httpd.shutdown()
    httpd.server_close()


def _tiny_run(tmp_path, teacher, steps):
  from test_trainer import tiny

  return tiny(
    **{
      "objective.distill": {"teacher": teacher, "weight": 0.5, "clip": 5.0},
      "reward.weights": {"accuracy": 0.0},  # distillation alone: only the teacher's signal trains
      "run.steps": steps,
      "run.out": str(tmp_path),
      "checkpoint.every": 0,
      "optim.learning_rate": 3e-2,
    }
  )


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_run_with_a_remote_teacher_trains_like_the_in_process_one(server, tmp_path):
  """Two steps of distillation alone with the remote teacher: the same losses, grad norms and reverse KL as the
  in-process teacher of the same weights (1e-5), and the term trains (grad_norm > 0)."""
  from jaxgrpo.run.trainer import Trainer

  recs = {}
  for name, teacher in (("remote", server), ("local", TEACHER)):
    trainer = Trainer(_tiny_run(tmp_path / name, teacher, 2), log=None)
    recs[name] = [r for r in trainer.run(handle_signals=False) if "loss" in r]
  assert [r["step"] for r in recs["remote"]] == [1, 2]
  for a, b in zip(recs["remote"], recs["local"]):
    assert a["grad_norm"] > 0
    for key in ("loss", "grad_norm", "distill/reverse_kl"):
      np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_server_killed_mid_run_stops_it(tmp_path, capfd):
  """The server killed after step 1: step 2's teacher call retries, then raises TeacherUnavailable (one line,
  the URL); the CLI on a dead URL exits 2 with one ``error:`` line before anything trains (``scripts/train.py``'s
  ``main`` in this process: what it checks needs no process of its own)."""
  from helpers import train_main_here

  from jaxgrpo.run.trainer import Trainer

  proc, url = start_server()
  steps = []

  def on_record(rec):  # the server dies once step 1 is logged
    if "loss" in rec:
      steps.append(rec["step"])
      if proc.poll() is None:
        stop(proc)

  try:
    trainer = Trainer(_tiny_run(tmp_path / "run", url, 3), log=None)
    trainer.teacher.backoff_s = 0.01
    trainer.on_record = on_record
    with pytest.raises(TeacherUnavailable, match=rf"remote teacher {url}/score: no answer after 4 attempts") as e:
      trainer.run(handle_signals=False)
  finally:
    if proc.poll() is None:
      stop(proc)
  assert steps == [1]
  assert "\n" not in str(e.value)
  capfd.readouterr()
  with pytest.raises(SystemExit) as cli:
    train_main_here(
      ["--config", os.devnull, "--no-progress"] + [f"--{k}={v}" for k, v in _cli_flags(tmp_path / "cli", url).items()]
    )
  err = capfd.readouterr().err
  assert cli.value.code == 2, err[-2000:]
  lines = err.strip().splitlines()
  assert lines[-1].startswith("error: `objective.distill.teacher`: remote teacher") and url in lines[-1]


def _cli_flags(out, url):
  return {
    "model.synthetic.hidden_size": 32,
    "model.synthetic.num_layers": 1,
    "data.arithmetic.sft_steps": 0,
    "data.arithmetic.train_size": 64,
    "rollout.group_size": 2,
    "rollout.prompts_per_step": 2,
    "rollout.max_new_tokens": 4,
    "run.steps": 1,
    "run.out": str(out),
    "devices.mesh": "",
    "objective.distill": json.dumps({"teacher": url, "weight": 0.5}),
  }


PLAN_TEACHERS = ("http://127.0.0.1:9", "vllm:synthetic:96x3")

# scripts/plan.py's main, once per config given, in one process of 2 CPU devices (what --topology cpu-2 sets before
# jax is imported): {config: {"rc": exit status, "stdout": its stdout}} on the last line
_PLAN = r"""
import contextlib, io, json, os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import plan
results = {}
for config in sys.argv[1:]:
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    rc = plan.main(["--config", config, "--topology", "cpu-2", "--json", "--programs", "step"])
  results[config] = {"rc": rc, "stdout": out.getvalue()}
print("PLANS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def teacher_plans(request, tmp_path_factory):
  """``{teacher: (exit status, stdout, the child's stderr)}``: scripts/plan.py's main for each teacher of
  PLAN_TEACHERS the selected tests name (the demo config, distilling from it), one after the other in one child of
  2 CPU devices (one JAX start-up instead of one per teacher)."""
  import yaml
  from helpers import child_result, start_child

  mine = [item for item in request.session.items if item.path.name == os.path.basename(__file__)]
  teachers = [t for t in PLAN_TEACHERS if any(f"[{t}]" in item.name for item in mine)]
  configs = {}
  for i, teacher in enumerate(teachers):
    d = yaml.safe_load(open(ROOT / "scripts" / "configs" / "demo.yaml"))
    d["objective"].update(beta=0.0, distill={"teacher": teacher, "weight": 1.0, "kind": "forward_kl", "top_k": 4})
    configs[teacher] = tmp_path_factory.mktemp("plan") / f"distill_{i}.yaml"
    configs[teacher].write_text(yaml.safe_dump(d))
  child = start_child(_PLAN, devices=2, args=list(configs.values()))
  rc, out, err = child_result(child, timeout=600)
  last = out.strip().splitlines()[-1:] or [""]
  if rc != 0 or not last[0].startswith("PLANS "):  # each test reads the failure
    return {t: (f"child exit {rc}", out, err) for t in teachers}
  results = json.loads(last[0][len("PLANS ") :])
  return {t: (results[str(c)]["rc"], results[str(c)]["stdout"], err) for t, c in configs.items()}


@pytest.mark.subprocess
@pytest.mark.parametrize("teacher", PLAN_TEACHERS)
def test_a_teacher_outside_the_run_is_planned_off_the_train_devices(teacher_plans, teacher):
  """scripts/plan.py with a server or vLLM teacher (nothing is contacted or loaded): the step still compiles with
  the teacher's fields in its batch, no ``teacher`` program, nothing of the teacher resident beside the step
  (before: the URL was read as a model name, exit 2)."""
  rc, stdout, err = teacher_plans[teacher]
  assert rc == 0, (rc, stdout[-2000:], err[-3000:])
  (step,) = json.loads(stdout)["programs"]
  assert step["verdict"] == "no fit test" and step["other_resident_bytes"] == 0, step
