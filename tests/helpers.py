"""Shared pieces of the tests: a tiny model, a random rollout batch, a hand-written full-batch reference
update (no jaxgrpo loss/advantage code), and a runner for child processes.

Import it as ``from helpers import ...``: ``tests/conftest.py`` puts this directory on ``sys.path`` for
pytest, and :func:`child_env` does the same for child processes.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import core_refs
import numpy as np
from xla_flags import TEST_XLA_FLAGS  # noqa: F401  (re-exported: ``from helpers import TEST_XLA_FLAGS``)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

B, P, T, G = 16, 4, 12, 4


def tiny_config(layers=2):
  from jaxgrpo.models import Qwen3Config

  return Qwen3Config(
    vocab_size=128,
    hidden_size=32,
    num_layers=layers,
    num_heads=4,
    num_kv_heads=4,
    head_dim=8,
    intermediate_size=64,
    tie_word_embeddings=True,
  )


def tiny_model(seed=0, cfg=None, layers=2):
  from flax import nnx

  from jaxgrpo.models import build_model

  return build_model(cfg or tiny_config(layers), rngs=nnx.Rngs(seed))


def make_batch(seed=0, b=B, p=P, t=T, g=G, vocab_small=3):
  """A rollout-like batch with shared prefixes inside groups (small completion alphabet), ragged
  completion lengths (one empty row), left-padded prompts, and rollout/reference log-probs."""
  from jaxgrpo.step.train import Batch

  rng = np.random.default_rng(seed)
  groups = b // g
  prompts = np.repeat(rng.integers(5, 128, (groups, p)), g, axis=0).astype(np.int32)
  plen = np.repeat(rng.integers(1, p + 1, groups), g)
  pmask = np.arange(p)[None] >= (p - plen)[:, None]
  prompts = np.where(pmask, prompts, 0).astype(np.int32)
  comp = rng.integers(0, vocab_small, (b, t)).astype(np.int32)
  lens = rng.integers(1, t + 1, b)
  lens[3] = 0
  mask = np.arange(t)[None] < lens[:, None]
  comp = np.where(mask, comp, 0).astype(np.int32)
  old = np.where(mask, np.log(1.0 / 128) + 0.3 * rng.standard_normal((b, t)), 0).astype(np.float32)
  ref = np.where(mask, old + 0.2 * rng.standard_normal((b, t)), 0).astype(np.float32)
  rewards = rng.integers(0, 2, b).astype(np.float32) + 0.1 * rng.random(b).astype(np.float32)
  gids = np.repeat(np.arange(groups), g).astype(np.int32)
  return Batch(prompts, pmask, comp, mask, old, gids, rewards, ref)


# ----------------------------------------------------------------------------- hand-written reference


def ref_lambda_sizes(comp, mask, gids):
  """Brute force |λ(i,t)|: rows of i's group with the same first t+1 tokens, both real."""
  b, t = comp.shape
  out = np.zeros((b, t), np.int64)
  for i in range(b):
    for s in range(t):
      if not mask[i, s]:
        continue
      out[i, s] = sum(
        1 for j in range(b) if gids[j] == gids[i] and mask[j, s] and np.array_equal(comp[j, : s + 1], comp[i, : s + 1])
      )
  return out


def ref_advantages(config, batch):
  """Group advantages (population or sample std), FRPO's cost-to-go, in NumPy."""
  a = core_refs.group_advantages(
    batch.rewards, np.asarray(batch.group_ids), ddof=config.std_ddof, eps=config.std_eps, scale=config.advantage_scale
  )
  if config.kl_placement == "future" and config.beta > 0:
    assert config.kl_estimator == "k1"
    m = np.asarray(batch.mask)
    delta = np.where(m, np.asarray(batch.old_logp, np.float64) - np.asarray(batch.ref_logp, np.float64), 0)
    togo = np.cumsum(delta[:, ::-1], axis=1)[:, ::-1]
    return (a[:, None] - config.beta * togo).astype(np.float32)
  return a.astype(np.float32)


def reference_update(
  model, batch, config, *, lr, max_grad_norm, rows=None, advantages=None, token_weights=None, loss_mask=None
):
  """Parameters after one plain SGD step on the full-batch loss, written out by hand.

  rows: optional row indices: the advantages and λ weights come from the whole batch, the loss (and
  its denominator) from these rows only — one PPO mini-batch.
  advantages, token_weights: NumPy ``[B]``/``[B, T]`` and ``[B, T]`` used instead of the config's
  (``advantages`` given: no λ weights unless ``token_weights`` is given too).
  loss_mask: NumPy ``bool[B, T]``, the tokens in the loss (default ``batch.mask``; the attention always
  covers ``batch.mask``, the λ sizes are always over ``batch.mask``) — a multi-turn policy mask.

  Returns ``(new_params_flat {path: array}, metrics {name: float}, new nnx.State)``.
  """
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jaxgrpo.models import log_probs

  graphdef, params = nnx.split(model)
  tokens = jnp.concatenate([batch.prompt_tokens, batch.completions], axis=1)
  attn = jnp.concatenate([batch.prompt_mask, batch.mask], axis=1)
  m = jnp.asarray(batch.mask if loss_mask is None else loss_mask, jnp.float32)
  old = jnp.asarray(batch.old_logp)
  ref = jnp.zeros_like(old) if batch.ref_logp is None else jnp.asarray(batch.ref_logp)  # read only when β > 0
  adv = jnp.asarray(ref_advantages(config, batch) if advantages is None else np.asarray(advantages, np.float32))
  adv = adv[:, None] * jnp.ones_like(m) if adv.ndim == 1 else adv
  w = None
  if config.process_weights and advantages is None:
    sizes = ref_lambda_sizes(np.asarray(batch.completions), np.asarray(batch.mask), np.asarray(batch.group_ids))
    w = jnp.asarray(np.where(sizes > 0, 1.0 / np.maximum(sizes, 1), 0.0), jnp.float32)
  if token_weights is not None:
    w = jnp.asarray(token_weights, jnp.float32)
  if rows is not None:
    rows = np.asarray(rows)
    tokens, attn, m, old, ref, adv = (x[rows] for x in (tokens, attn, m, old, ref, adv))
    w = None if w is None else w[rows]
  b, t = m.shape
  p = batch.prompt_tokens.shape[1]
  # the arrays are arguments of the jitted update, not constants in it: one program per config and
  # shapes, read back from the session's compilation cache by every test that builds the same one
  data = dict(tokens=tokens, attn=attn, m=m, old=old, ref=ref, adv=adv, w=w)

  def loss_fn(params, d):
    tokens, attn, m, old, ref, adv, w = (d[k] for k in ("tokens", "attn", "m", "old", "ref", "adv", "w"))
    model = nnx.merge(graphdef, params)
    lp = log_probs(model, tokens, attn, chunk_size=None)[:, p:]
    ratio = jnp.exp(lp - old)
    s = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - config.clip_eps_low, 1 + config.clip_eps_high) * adv)
    if config.dual_clip is not None:
      s = jnp.where(adv < 0, jnp.maximum(s, config.dual_clip * adv), s)
    per = -s
    if config.kl_placement == "loss" and config.beta > 0:
      assert config.kl_estimator == "k3"
      d = lp - ref
      per = per + config.beta * (jnp.exp(-d) + d - 1)
    if w is not None:
      per = per * w
    per = per * m
    if config.aggregation == "token-mean":
      loss = per.sum() / m.sum()
    elif config.aggregation == "seq-mean-token-mean":
      rows = m.sum(1)
      loss = jnp.sum(jnp.where(rows > 0, per.sum(1) / jnp.maximum(rows, 1), 0)) / jnp.sum(rows > 0)
    else:
      loss = per.sum() / (b * (config.max_tokens or t))
    return loss, (ratio, lp)

  def update(params, d):
    (loss, (ratio, lp)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, d)
    gnorm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, max_grad_norm / gnorm)
    new = jax.tree.map(lambda p_, g_: p_ - lr * scale * g_, params, grads)
    # entropy of the policy at the completion positions, from the full logits
    model = nnx.merge(graphdef, params)
    tokens, attn, m = d["tokens"], d["attn"], d["m"]
    hidden, _ = model(tokens, jnp.maximum(jnp.cumsum(attn, 1) - 1, 0), attention_mask=attn)
    logits = model.logits(hidden[:, p - 1 : -1], out_dtype=jnp.float32)
    logq = jax.nn.log_softmax(logits, -1)
    ent = -jnp.sum(jnp.exp(logq) * logq, -1)
    n = m.sum()
    metrics = {
      "loss": loss,
      "grad_norm": gnorm,
      "entropy": jnp.sum(ent * m) / n,
      "approx_kl": jnp.sum((ratio - 1 - jnp.log(ratio)) * m) / n,
    }
    return new, metrics

  new, metrics = jax.jit(update)(params, data)
  flat = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(new)}
  return flat, {k: float(v) for k, v in metrics.items()}, new


def flat_params(params):
  from flax import nnx

  return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(params)}


# ----------------------------------------------------------------------------- child processes


def child_env(devices: int) -> dict:
  e = dict(os.environ)
  e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}"
  e["JAX_PLATFORMS"] = "cpu"
  e["PYTHONPATH"] = os.pathsep.join([ROOT, HERE, e.get("PYTHONPATH", "")])
  return e


def async_train_cmd(out, steps: int, **extra: str) -> list[str]:
  """``scripts/train.py`` for an overlapped (``rollout.max_staleness`` 1, TIS) run of the tiny arithmetic
  model into ``out``: ``steps`` steps, a checkpoint each, no evaluation; ``extra`` adds or replaces dotted keys
  (``**{"devices.mesh": "data=2"}``)."""
  cfg = {
    "model.synthetic": "{hidden_size: 32, num_layers: 1}",
    "data.arithmetic": "{train_size: 24, eval_size: 4, sft_steps: 0}",
    "data.max_prompt_tokens": "64",
    "rollout.group_size": "4",
    "rollout.prompts_per_step": "2",
    "rollout.max_new_tokens": "8",
    "rollout.max_staleness": "1",
    "objective.importance_correction": "tis",
    "step.chunk_size": "null",
    "reward.timeout_s": "null",
    "eval.every": "0",
    "eval.samples": "2",
    "checkpoint.every": "1",
    "checkpoint.async_save": "false",
    "run.steps": str(steps),
    "run.log_every": "1",
    **extra,
  }
  args = [a for k, v in cfg.items() for a in (f"--{k}", v)]
  script = os.path.join(ROOT, "scripts", "train.py")
  return [sys.executable, script, *args, "--run.out", str(out), "--no-plot", "--no-progress"]


#: the XLA flags of the children of one repeated configuration (test_checkpoint_resume.py and
#: test_failure_modes_runs.py: ~25 runs of its tiny arithmetic run): XLA's defaults. Every program then compiles
#: once per session through the persistent cache (~10 s more than under TEST_XLA_FLAGS) and every run executes
#: faster: a 6-step child with a warm cache took 6.3 instead of 8.3 s of CPU (its 150-step warm-up 1.1 instead
#: of 3.0 s).
RUN_XLA_FLAGS = ""


def cli_env(cache_dir=None, *, xla_flags: str = TEST_XLA_FLAGS) -> dict:
  """The environment of a ``scripts/*.py`` child run on the CPU: compile flags ``xla_flags`` (the tests',
  ``TEST_XLA_FLAGS``, by default; no inherited device count), unbuffered output, and a persistent compilation
  cache: the session's (``tests/conftest.py``), else ``cache_dir``."""
  e = dict(os.environ)
  e["XLA_FLAGS"] = xla_flags
  cache = e.get("JAX_COMPILATION_CACHE_DIR") or cache_dir
  if cache:
    e["JAX_COMPILATION_CACHE_DIR"] = str(cache)
  e.update(
    JAX_PLATFORMS="cpu",
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    PYTHONUNBUFFERED="1",
  )
  return e


def start_child(code: str, *, devices: int, args=()) -> subprocess.Popen:
  """Start ``code`` in a fresh Python with ``devices`` virtual CPU devices (see :func:`finish_child`)."""
  return subprocess.Popen(
    [sys.executable, "-c", code, *map(str, args)],
    env=child_env(devices),
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def finish_child(proc: subprocess.Popen, timeout=600) -> str:
  """Wait for a child; its stdout, or AssertionError with its output when it failed."""
  code, out, err = child_result(proc, timeout=timeout)
  if code != 0:
    raise AssertionError(f"child failed (rc {code}):\nSTDOUT:\n{out[-4000:]}\nSTDERR:\n{err[-8000:]}")
  return out


def finish_children(procs, timeout=600) -> list[str]:
  """Wait for every child (one failure does not leave the others running): each one's stdout, or its failure's
  text (:func:`finish_child`'s AssertionError message) in its place."""
  results = []
  for proc in procs:
    try:
      results.append(finish_child(proc, timeout=timeout))
    except AssertionError as e:
      results.append(str(e))
  return results


def tpu_child_env() -> dict:
  """The environment of a child run by the libtpu side venv (``ensure_side_venv("tpu")``) that compiles for TPU
  topologies ahead of time: CPU as the default backend (no TPU probing), libtpu's one-process lockfile off (so
  concurrent tests coexist), this checkout on the path; no inherited XLA flags or compilation cache."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
  env.update(JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=ROOT)
  return env


def run_child(code: str, *, devices: int, args=(), timeout=600) -> str:
  """Run ``code`` in a fresh Python with ``devices`` virtual CPU devices; returns stdout."""
  return finish_child(start_child(code, devices=devices, args=args), timeout)


def sgd_update(model, batch, loss_of_logp, *, lr, max_grad_norm):
  """Parameters after one plain SGD step (clipped by global norm) on ``loss_of_logp(logp)``, where
  ``logp`` ``[B, T]`` are the completion log-probs from full, unchunked logits. Returns ``(new_params_flat,
  loss)``."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jaxgrpo.models import log_probs

  graphdef, params = nnx.split(model)
  tokens = jnp.concatenate([batch.prompt_tokens, batch.completions], axis=1)
  attn = jnp.concatenate([batch.prompt_mask, batch.mask], axis=1)
  p = batch.prompt_tokens.shape[1]

  def loss_fn(params):
    return loss_of_logp(log_probs(nnx.merge(graphdef, params), tokens, attn, chunk_size=None)[:, p:])

  def update(params):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    gnorm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, max_grad_norm / gnorm)
    return jax.tree.map(lambda p_, g_: p_ - lr * scale * g_, params, grads), loss

  new, loss = jax.jit(update)(params)
  return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(new)}, float(loss)


def numpy_log_probs(model, batch):
  """``f64[B, T]`` completion log-probs from the model's full logits, log-softmax in NumPy (0 on padding)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  tokens = jnp.concatenate([batch.prompt_tokens, batch.completions], axis=1)
  attn = jnp.concatenate([batch.prompt_mask, batch.mask], axis=1)
  p = batch.prompt_tokens.shape[1]
  graphdef, state = nnx.split(model)

  def forward(state, tokens, attn):  # one jitted program: eager, every op compiles on its first call
    model = nnx.merge(graphdef, state)
    hidden, _ = model(tokens, jnp.maximum(jnp.cumsum(attn, axis=1) - 1, 0), attention_mask=attn)
    return model.logits(hidden[:, p - 1 : -1], out_dtype=jnp.float32)

  logits = np.asarray(jax.jit(forward)(state, tokens, attn), np.float64)
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  picked = np.take_along_axis(logits, np.asarray(batch.completions)[..., None], -1)[..., 0]
  return np.where(np.asarray(batch.mask), picked - logz, 0.0)


def numpy_gspo_loss(logp, old_logp, mask, advantages, clip_low, clip_high):
  """GSPO (arXiv:2507.18071): ``-mean_i min(s_i A_i, clip(s_i, 1-lo, 1+hi) A_i)`` over non-empty rows,
  ``s_i = exp(mean_t(logp - old_logp))`` over row i's real tokens."""
  mask = np.asarray(mask, bool)
  n = mask.sum(1)
  s = np.exp(
    np.where(mask, np.asarray(logp, np.float64) - np.asarray(old_logp, np.float64), 0).sum(1) / np.maximum(n, 1)
  )
  a = np.asarray(advantages, np.float64)
  per = -np.minimum(s * a, np.clip(s, 1 - clip_low, 1 + clip_high) * a)
  return float(per[n > 0].mean()), s


def numpy_group_advantages(rewards, group_ids, eps=1e-6):
  """``f32[B]`` GRPO advantages (population std) under the missing-sample policy: non-finite rewards are
  left out of their group's mean and std and get advantage 0 — the kernel tests' loop reference,
  :func:`core_refs.group_advantages`, the one NumPy GRPO reference of the suite."""
  return core_refs.group_advantages(rewards, np.asarray(group_ids), eps=eps).astype(np.float32)


def load_example(name: str):
  """The module ``examples/<name>.py`` (examples are scripts, not a package)."""
  import importlib.util

  spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(ROOT, "examples", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def session_shared_dir(tmp_path_factory, name: str, build) -> "os.PathLike":
  """A directory built once per test session and shared by its modules and xdist workers: the first
  caller of ``name`` runs ``build(path)`` under a file lock, later callers (other modules, the other
  worker) wait for it and get the same ``path``. Readers must not change it (copy it first). With
  xdist the directory lies in the parent of the worker's base temp directory (pytest-xdist's recipe
  for session fixtures shared by workers), which belongs to this session alone."""
  import fcntl
  import shutil

  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent
  path = base / f"shared-{name}"
  with open(base / f"shared-{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (path / ".built").exists():  # a failed build leaves no marker: the next caller builds again
      shutil.rmtree(path, ignore_errors=True)
      path.mkdir()
      build(path)
      (path / ".built").touch()
  return path


def train_main_here(argv: list[str]) -> None:
  """``scripts/train.py``'s ``main(argv)`` in this test process (its devices, flags and compilation cache; a
  failure raises), saving a child's start-up. ``main`` quiets absl's logger process-wide (a command-line run's
  setting); its level is put back for the process's other tests."""
  sys.path.insert(0, os.path.join(ROOT, "scripts"))
  import train as cli

  with _absl_level_kept():
    cli.main(argv)


@contextlib.contextmanager
def _absl_level_kept():
  """A script's ``main`` quiets absl's logger process-wide (a command-line run's setting): put its level back."""
  import logging

  absl = logging.getLogger("absl")
  level = absl.level
  try:
    yield
  finally:
    absl.setLevel(level)


def side_venv_build_command(name: str) -> list[str]:
  """``bash scripts/setup_NAME_venv.sh`` under the file lock ``.venv-NAME.lock`` (a child python holds it), so
  that two processes never build the same venv at once: what :func:`ensure_side_venv` runs in the foreground
  and tests/conftest.py starts in the background at the beginning of a session."""
  script = os.path.join(ROOT, "scripts", f"setup_{name}_venv.sh")
  lock = os.path.join(ROOT, f".venv-{name}.lock")
  hold = (
    "import fcntl, subprocess, sys; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); "
    "sys.exit(subprocess.call(['bash', sys.argv[2]]))"
  )
  return [sys.executable, "-c", hold, lock, script]


def ensure_side_venv(name: str) -> str:
  """``bash scripts/setup_NAME_venv.sh`` (``.venv-NAME/``; idempotent: its stamp file says whether the venv is up
  to date, scripts/_venv_common.sh) under the file lock ``.venv-NAME.lock``, so two test processes never build it
  at once (:func:`side_venv_build_command`); the venv's python. A failed build fails the test with the script's
  output. A build that tests/conftest.py started in the background holds the lock: this waits for it, and then the
  script returns at once."""
  import pytest

  python = os.path.join(ROOT, f".venv-{name}", "bin", "python")
  r = subprocess.run(side_venv_build_command(name), capture_output=True, text=True)
  if r.returncode or not os.path.exists(python):
    pytest.fail(f"scripts/setup_{name}_venv.sh failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
  return python


def tiny_chat_policy(max_positions: int = 512):
  """``(tokenizer, model, sampling, eos)`` of the multi-turn tests: the calculator task's Qwen-style chat
  tokenizer, a 1-layer random policy, and a ``SamplingConfig`` of G = 2 stopping at ``<|im_end|>``."""
  from flax import nnx

  from jaxgrpo.loop.iteration import SamplingConfig
  from jaxgrpo.models import build_model
  from jaxgrpo.tasks import arithmetic, calculator

  tok = calculator.build_tokenizer()
  cfg = arithmetic.tiny_model_config(len(tok), hidden_size=32, num_layers=1, max_position_embeddings=max_positions)
  model = build_model(cfg, rngs=nnx.Rngs(0))
  eos = tok.convert_tokens_to_ids("<|im_end|>")
  sampling = SamplingConfig(num_samples=2, max_new_tokens=1, eos_ids=(eos,), pad_id=tok.pad_token_id)
  return tok, model, sampling, eos


_SGD_MESH_MODEL: list = []  # (mesh, 1-layer tiny model), built once per process by sgd_step


def _sgd_mesh_model():
  if not _SGD_MESH_MODEL:
    import jax

    from jaxgrpo import make_mesh

    _SGD_MESH_MODEL.append((make_mesh("data=1", devices=jax.devices()[:1]), tiny_model(layers=1)))
  return _SGD_MESH_MODEL[0]


def sgd_step(config, **kw):
  """``(step, opt)``: ``jaxgrpo.make_train_step`` of ``config`` (keywords passed on) for the 1-layer tiny model on a
  1-device mesh, SGD lr 0.5, G groups, no chunking (the hyper-parameter tests' step)."""
  import optax

  import jaxgrpo as jg

  mesh, model = _sgd_mesh_model()
  opt = optax.sgd(0.5)
  graphdef, _, shardings = jg.init_train_state(model, opt, mesh)
  tc = jg.TrainConfig(group_size=G, chunk_size=None)
  return jg.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc, **kw), opt


def sgd_state(opt):
  """A fresh train state of :func:`sgd_step`'s model for ``opt``."""
  import jaxgrpo as jg

  mesh, model = _sgd_mesh_model()
  return jg.init_train_state(model, opt, mesh)[1]


def kill_after_ledger_lines(proc: subprocess.Popen, ledger, lines: int = 3, timeout: float = 400) -> int:
  """SIGKILLs the asynchronous run ``proc`` once its ledger (``rollouts.jsonl``) holds ``lines`` lines (the run
  must still be alive then: its stderr is shown otherwise); the number of ledger lines after the kill."""
  import signal
  import time

  deadline = time.time() + timeout
  while time.time() < deadline and proc.poll() is None:
    if ledger.exists() and len(ledger.read_text().splitlines()) >= lines:
      break
    time.sleep(0.05)
  assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  return len(ledger.read_text().splitlines())


def child_result(proc: subprocess.Popen, timeout=900) -> tuple[int, str, str]:
  """``(exit status, stdout, stderr)`` of a child (killed after ``timeout`` s): what a module fixture that runs
  several tests' checks in one child keeps, for each test to read its part and show the child's output when it
  failed (:func:`finish_child` raises instead)."""
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
  return proc.returncode, out, err


def script_main_here(main, argv: list[str]) -> tuple[int, str, str]:
  """``main(argv)`` of a ``scripts/*.py`` (``train``, ``eval``) in this test process, its stdout and stderr
  captured: ``(exit status, stdout, stderr)`` — the status of the ``SystemExit`` it raised (``None`` is 0), 0 when
  it returned; any other exception propagates (a traceback a child would print fails the test). For the one-line
  refusals that a command gives before anything heavy runs: the same code path as a child's, without a child's
  ~3 CPU-s of start-up; each refusal family keeps one check in a real child. absl's level is put back as
  :func:`train_main_here` does."""
  import io

  out, err = io.StringIO(), io.StringIO()
  code = 0
  try:
    with _absl_level_kept(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      main(argv)
  except SystemExit as e:
    code = 0 if e.code is None else e.code
  return code, out.getvalue(), err.getvalue()


# The tests' reference passes, jitted. Run eagerly, a reference forward compiles each of its few hundred ops apart
# for every new shape (a 2-layer tiny model: ~1.4 CPU-s a shape, measured); one jitted program costs ~0.2. Same
# operations, so the same values (float32 tolerances of 1e-5 and above). Each ``nnx.jit`` is built once per process.
_REFERENCE_JITS: dict = {}


def _reference_jit(fn, static=()):
  if fn not in _REFERENCE_JITS:
    from flax import nnx

    _REFERENCE_JITS[fn] = nnx.jit(fn, static_argnames=static)
  return _REFERENCE_JITS[fn]


def _ref_log_probs(model, tokens, mask, temperature):
  from jaxgrpo.models.log_probs import log_probs

  return log_probs(model, tokens, mask, temperature=temperature, chunk_size=None)


def _ref_completion_log_probs(model, prompt_tokens, prompt_mask, completions, mask, temperature):
  from jaxgrpo.models.log_probs import completion_log_probs

  return completion_log_probs(model, prompt_tokens, prompt_mask, completions, mask, temperature=temperature,
                              chunk_size=None)[0]  # fmt: skip


def _ref_logits(model, tokens, positions, mask):
  import jax.numpy as jnp

  hidden = model(tokens, positions, attention_mask=mask)
  hidden = hidden[0] if isinstance(hidden, tuple) else hidden
  return model.logits(hidden, out_dtype=jnp.float32)


def ref_log_probs(model, tokens, mask, *, temperature: float = 1.0):
  """``models.log_probs(model, tokens, mask, temperature=temperature, chunk_size=None)``, jitted: ``f32[B, T]``
  (``out[:, t] = log_softmax(logits(hidden[:, t-1]) / temperature)[tokens[:, t]]``, 0 at t = 0 and padding)."""
  return _reference_jit(_ref_log_probs, ("temperature",))(model, tokens, mask, temperature=float(temperature))


def ref_completion_log_probs(model, prompt_tokens, prompt_mask, completions, mask, *, temperature: float = 1.0):
  """``completion_log_probs(model, prompt_tokens [B, P], prompt_mask, completions [B, T], mask,
  temperature=temperature, chunk_size=None)[0]``, jitted: ``f32[B, T]``, one cache-free forward over
  ``[prompt ‖ completion]``."""
  fn = _reference_jit(_ref_completion_log_probs, ("temperature",))
  return fn(model, prompt_tokens, prompt_mask, completions, mask, temperature=float(temperature))


def ref_logits(model, tokens, positions, mask):
  """The float32 logits ``f32[B, L, V]`` of one cache-free forward ``model(tokens [B, L], positions [B, L],
  attention_mask=mask [B, L])``, jitted."""
  return _reference_jit(_ref_logits)(model, tokens, positions, mask)
