"""Shared by the benchmark workers, the driver and the probes (NumPy + stdlib only: imported inside every venv).

The workload is chosen by the environment variable ``PEERS_WORKLOAD`` (``20m``, the default, or
``150m``; `bench_peers.py --workload` sets it for every worker it starts) and shrunk to a
seconds-long run of the same code paths by ``PEERS_SMOKE=1``. The module-level constants
(``PROMPTS``, ``PROMPT_LEN``, ``SAMPLES``, ``NEW_TOKENS``, ``VOCAB``, ``BETA``, ``LR``, ``MICRO``,
``CHUNK``, ``MODEL``) are that workload's; :func:`get_workload` gives any workload by name.

Every worker's ``RESULT`` line (:func:`report`) carries the process's environment at start and at
end (:func:`environment`): CPU counts, affinity, cgroup CPU quota, thread settings, load average,
system CPU time split (steal, other processes), memory, page faults, context switches, so that a
slow run can be explained from its own record.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import sys
import time

PEERS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(PEERS_DIR))


def peers_root() -> str:
  """Where the peers' virtual environments live: ``$PEERS_ROOT`` or ``<repo>/.peers`` (holds ``tunix/``, ``trl/``)."""
  return os.path.abspath(os.environ.get("PEERS_ROOT") or os.path.join(REPO_ROOT, ".peers"))


def venv_python(name: str) -> str:
  """The interpreter of one peer's venv (``tunix`` or ``trl``) under :func:`peers_root`."""
  return os.path.join(peers_root(), name, "bin", "python")


# ----------------------------------------------------------------------------- workloads


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """A random Qwen3-architecture model (tied embeddings, fp32): D, L, H q-heads / KV kv-heads of K, I, V."""

  hidden: int  # D
  layers: int  # L
  heads: int  # H
  kv_heads: int  # KV
  head_dim: int  # K
  intermediate: int  # I (SwiGLU)
  vocab: int  # V

  @property
  def trunk_matmul_params(self) -> int:
    """Parameters that take part in a matmul per token, excluding the (tied) head: q, k, v, o and the SwiGLU."""
    d, hk, kvk = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
    return self.layers * (d * hk + 2 * d * kvk + hk * d + 3 * d * self.intermediate)

  @property
  def n_params(self) -> int:
    """All parameters (what `save_pretrained` writes): matmul weights, tied embedding, RMSNorm scales."""
    norms = self.layers * (2 * self.hidden + 2 * self.head_dim) + self.hidden
    return self.trunk_matmul_params + self.vocab * self.hidden + norms


@dataclasses.dataclass(frozen=True)
class Workload:
  """One benchmark protocol: the model, the rollout (PROMPTS × SAMPLES rows of NEW_TOKENS) and the update."""

  name: str
  model: ModelShape
  prompts: int
  prompt_len: int
  samples: int
  new_tokens: int
  micro: int  # rows per micro-batch (update and reference pass); 2 micro-batches per update in every workload
  chunk: int  # jaxgrpo's log-prob chunk (positions): micro × chunk tokens of f32 logits at a time
  beta: float = 0.04  # KL coefficient (GRPO rows)
  lr: float = 1e-6  # AdamW learning rate

  @property
  def rows(self) -> int:
    return self.prompts * self.samples

  @property
  def model_dir_name(self) -> str:
    return "model" if self.name == "20m" else f"model-{self.name}"


# The 20.5M workload of the earlier runs (unchanged) and a matmul-dominated one of 158.6M parameters:
# Qwen3-0.6B's layer shape (D 1024, 16 q heads / 8 kv heads of 128, SwiGLU 3072) with 8 layers and
# vocab 32000. 8 prompts × 4 samples × 64 new tokens keeps one iteration near 4.3 TFLOP (≈ 33 s at
# 130 GFLOP/s, see `model_flops`), so a round of three implementations fits in minutes on 2 cores.
WORKLOADS = {
  "20m": Workload(
    name="20m",
    model=ModelShape(hidden=384, layers=4, heads=8, kv_heads=4, head_dim=32, intermediate=1536, vocab=32000),
    prompts=16,
    prompt_len=32,
    samples=8,
    new_tokens=128,
    micro=64,
    chunk=32,  # 64 rows × 32 positions = 2048 tokens of f32 logits (262 MB)
  ),
  "150m": Workload(
    name="150m",
    model=ModelShape(hidden=1024, layers=8, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=32000),
    prompts=8,
    prompt_len=32,
    samples=4,
    new_tokens=64,
    micro=16,
    chunk=64,  # 16 rows × 64 positions = 1024 tokens of f32 logits (131 MB)
  ),
}


def get_workload(name: str, smoke: bool = False) -> Workload:
  """The named workload; ``smoke`` shrinks the rollout (2 prompts, 8 new tokens, one group per micro-batch)."""
  if name not in WORKLOADS:
    raise ValueError(f"unknown workload {name!r}; expected one of {sorted(WORKLOADS)}")
  w = WORKLOADS[name]
  if smoke:  # a seconds-long run of the same code paths (not a benchmark)
    w = dataclasses.replace(w, prompts=2, new_tokens=8, micro=w.samples, chunk=8)
  return w


WORKLOAD = get_workload(os.environ.get("PEERS_WORKLOAD", "20m"), smoke=bool(os.environ.get("PEERS_SMOKE")))
MODEL = WORKLOAD.model
PROMPTS, PROMPT_LEN, SAMPLES, NEW_TOKENS, VOCAB = (
  WORKLOAD.prompts,
  WORKLOAD.prompt_len,
  WORKLOAD.samples,
  WORKLOAD.new_tokens,
  MODEL.vocab,
)
BETA, LR, MICRO = (
  WORKLOAD.beta,
  WORKLOAD.lr,
  WORKLOAD.micro,
)  # KL coefficient, AdamW learning rate, rows per micro-batch
CHUNK = WORKLOAD.chunk  # jaxgrpo's log-prob chunk (positions)
# ``PEERS_PRECISION``: ``fp32`` (the default, every library in float32) or ``bf16`` (each library in its own
# mixed-precision mode, bf16 compute with float32 parameters: jaxgrpo ``load_hf(dtype=bfloat16,
# param_dtype=float32)``, Tunix ``ModelConfig(dtype=bfloat16, param_dtype=float32)``, TRL ``bf16=True`` autocast)
PRECISIONS = ("fp32", "bf16")
PRECISION = os.environ.get("PEERS_PRECISION", "fp32")
if PRECISION not in PRECISIONS:
  raise ValueError(f"PEERS_PRECISION={PRECISION!r}; expected one of {PRECISIONS}")


def model_flops(w: Workload) -> dict[str, float]:
  """Model FLOPs of one GRPO iteration of workload ``w`` (a matmul counts 2 FLOPs per multiply-add).

  With N = trunk matmul parameters (q, k, v, o, SwiGLU of every layer), V·D the tied head,
  A(c) = 4·L·H·K·c the attention FLOPs of one query over c keys (q·kᵀ and p·v), P the prompt length,
  T the new tokens, R = prompts × samples rows, S = P + T, and C(n) = Σ_{s=1..n} A(s) causal
  attention over n positions:

  - rollout: each prompt's prefill once, 2·N·P + C(P) (shared by its G samples, as jaxgrpo's
    sampler does; the peers prefill every row, which is their extra work); then per row the head
    for each of the T sampled tokens, 2·V·D·T, and T − 1 decode steps, Σ_{i=1..T-1} 2·N + A(P + i)
    (the last sampled token is never fed back);
  - reference pass: one forward, R·(2·N·S + 2·V·D·T + C(S)) (the head only where a completion
    token is predicted);
  - train step: 3 × the reference pass's forward (a matmul's backward is two matmuls of its size);
  - head recompute: + 2·V·D·R·T (jaxgrpo recomputes each head chunk in the backward pass under
    `jax.checkpoint`; TRL's chunked log-prob kernel does the same).

  ``total`` (the floor of the issue: rollout + reference + train + head recompute) is what
  `bench_peers.py` divides by the same run's matmul GFLOP/s. tests/test_peers_flops.py checks every
  term against torch's FLOP counter on the Hugging Face model.
  """
  m = w.model
  n, head = m.trunk_matmul_params, m.vocab * m.hidden
  att = 4 * m.layers * m.heads * m.head_dim  # per query per key

  def causal(length):  # C(length)
    return att * length * (length + 1) // 2

  p, t, r = w.prompt_len, w.new_tokens, w.rows
  s = p + t
  rollout = w.prompts * (2 * n * p + causal(p)) + r * (2 * head * t + sum(2 * n + att * (p + i) for i in range(1, t)))
  forward = r * (2 * n * s + 2 * head * t + causal(s))
  recompute = r * 2 * head * t
  out = {"rollout": rollout, "reference": forward, "train": 3 * forward, "head_recompute": recompute}
  out["total"] = sum(out.values())
  return out


# ----------------------------------------------------------------------------- the shared data


def prompt_ids(seed: int = 0):
  """The shared prompts: int[PROMPTS, PROMPT_LEN] token ids in [2, VOCAB) (0 = pad, 1 = EOS are never drawn)."""
  import numpy as np

  return np.random.default_rng(seed).integers(2, VOCAB, (PROMPTS, PROMPT_LEN))


def prompt_texts(seed: int = 0) -> list[str]:
  """The same prompts as text for the word-level tokenizer ("t17 t2093 ...")."""
  return [" ".join(f"t{i}" for i in row) for row in prompt_ids(seed)]


def reward_ids(ids) -> float:
  """The shared (cheap, host-side) reward: fraction of even token ids in the completion."""
  ids = [int(i) for i in ids]
  return sum(1 for i in ids if i % 2 == 0) / max(len(ids), 1)


def reward_text(text: str) -> float:
  return reward_ids(w[1:] for w in text.split() if w.startswith("t") and w[1:].isdigit())


# ----------------------------------------------------------------------------- jaxgrpo presets

JAXGRPO_PRESETS = ("grpo", "lambda_grpo", "frpo")
_RECORD: dict = {}  # fields a worker asked to have added to its RESULT (see `jaxgrpo_preset`)


def jaxgrpo_preset(argv=None) -> tuple[str, dict]:
  """``(preset name, overrides)`` of the jaxgrpo iteration, from the worker's 4th argument (default ``grpo``).

  Every row uses ``seq-mean-token-mean`` (Tunix's default, TRL's ``loss_type="grpo"``); GRPO and
  λ-GRPO get β = ``BETA`` with the k3 KL in the loss; FRPO keeps its own β = 0.01 future-KL in the
  advantage (its definition). Both need the reference pass. The name is recorded in the RESULT, so
  `bench_peers.py` can check the worker really ran the preset it was asked for::

      name, overrides = common.jaxgrpo_preset()
      config = preset(name, **overrides)
  """
  argv = sys.argv if argv is None else argv
  name = argv[4] if len(argv) > 4 else "grpo"
  if name not in JAXGRPO_PRESETS:
    raise ValueError(f"jaxgrpo preset {name!r} is not benchmarked; expected one of {JAXGRPO_PRESETS}")
  overrides = {"aggregation": "seq-mean-token-mean"}
  if name != "frpo":
    overrides["beta"] = BETA
  _RECORD["preset"] = name
  return name, overrides


# ----------------------------------------------------------------------------- environment record

_ENV_VARS = (
  "OMP_NUM_THREADS",
  "MKL_NUM_THREADS",
  "OPENBLAS_NUM_THREADS",
  "OMP_WAIT_POLICY",
  "GOMP_SPINCOUNT",
  "KMP_BLOCKTIME",
  "KMP_AFFINITY",
  "OMP_PROC_BIND",
  "XLA_FLAGS",
  "JAX_PLATFORMS",
  "MALLOC_ARENA_MAX",
  "PEERS_WORKLOAD",
  "PEERS_SMOKE",
  "PEERS_TORCH_THREADS",
  "PEERS_TRL_VARIANT",
  "PEERS_FLUSH_DENORMAL",
  "PEERS_TORCH_MKLDNN",
)
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")


def _read(path: str) -> str | None:
  try:
    with open(path) as f:
      return f.read().strip()
  except OSError:
    return None


def cgroup_cpu_quota() -> dict:
  """The CPU quota of this process's cgroup: ``{"cores": quota/period or None (no limit), "source": file}``.

  cgroup v2 ``cpu.max`` ("max 100000" or "200000 100000") or v1 ``cpu.cfs_quota_us`` /
  ``cpu.cfs_period_us`` (-1: no limit), at the process's cgroup path and at the mount root.
  """
  paths = {"v2": [], "v1": []}
  for line in (_read("/proc/self/cgroup") or "").splitlines():
    hid, ctrl, path = line.split(":", 2)
    if hid == "0":
      paths["v2"].append(path)
    elif "cpu" in ctrl.split(","):
      paths["v1"].append((ctrl, path))
  for path in paths["v2"] + ["/"]:
    f = os.path.join("/sys/fs/cgroup", path.lstrip("/"), "cpu.max")
    text = _read(f)
    if text:
      quota, period = text.split()
      return {"cores": None if quota == "max" else int(quota) / int(period), "source": f}
  for ctrl, path in paths["v1"] + [("cpu", "/")]:
    for mount in (ctrl, "cpu", "cpu,cpuacct"):
      base = os.path.join("/sys/fs/cgroup", mount, path.lstrip("/"))
      quota, period = _read(os.path.join(base, "cpu.cfs_quota_us")), _read(os.path.join(base, "cpu.cfs_period_us"))
      if quota is not None and period is not None:
        q = int(quota)
        return {"cores": None if q < 0 else q / int(period), "source": os.path.join(base, "cpu.cfs_quota_us")}
  return {"cores": None, "source": None}


def usable_cores() -> int:
  """Cores this process can really use: the affinity mask, capped by the cgroup CPU quota (rounded up)."""
  n = len(os.sched_getaffinity(0))
  quota = cgroup_cpu_quota()["cores"]
  return max(1, min(n, math.ceil(quota))) if quota else n


def _system_cpu() -> list[int]:
  """/proc/stat's aggregate jiffies: user, nice, system, idle, iowait, irq, softirq, steal."""
  first = (_read("/proc/stat") or "cpu 0 0 0 0 0 0 0 0").splitlines()[0].split()
  return [int(x) for x in first[1:9]]


def cpu_model() -> dict:
  """The CPU's model name and which of the vector/matrix extensions that decide fp32/bf16 speed it has."""
  info = _read("/proc/cpuinfo") or ""
  model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), None)
  flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
  return {"model": model, "flags": [f for f in CPU_FLAGS if f in flags]}


def _meminfo() -> dict:
  out = {}
  for line in (_read("/proc/meminfo") or "").splitlines():
    key, _, rest = line.partition(":")
    if key in ("MemTotal", "MemAvailable", "SwapTotal", "SwapFree"):
      out[key] = round(int(rest.split()[0]) / 2**20, 2)  # GiB
  return out


def _process_threads() -> int | None:
  for line in (_read("/proc/self/status") or "").splitlines():
    if line.startswith("Threads:"):
      return int(line.split()[1])
  return None


def torch_settings() -> dict | None:
  """torch's thread pools and CPU capability, if torch is imported in this process (None otherwise)."""
  torch = sys.modules.get("torch")
  if torch is None:
    return None
  out = {
    "version": torch.__version__,
    "threads": torch.get_num_threads(),
    "interop_threads": torch.get_num_interop_threads(),
    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
  }
  parallel = torch.__config__.parallel_info()
  for line in parallel.splitlines():
    line = line.strip()
    if line.startswith(("omp_get_max_threads()", "mkl_get_max_threads()", "ATen parallel backend")):
      key, _, value = line.partition(":")
      out[key.strip()] = value.strip()
  return out


def environment() -> dict:
  """A snapshot of what decides how fast this process can run (see the module docstring)."""
  ru = resource.getrusage(resource.RUSAGE_SELF)
  times = os.times()
  return {
    "time": time.time(),
    "cpu": cpu_model(),
    "cpu_count": os.cpu_count(),
    "affinity": len(os.sched_getaffinity(0)),
    "cgroup_cpu": cgroup_cpu_quota(),
    "usable_cores": usable_cores(),
    "loadavg": list(os.getloadavg()),
    "system_cpu_jiffies": _system_cpu(),
    "process_cpu_s": round(times.user + times.system, 3),
    "process_threads": _process_threads(),
    "mem_gib": _meminfo(),
    "major_faults": ru.ru_majflt,
    "voluntary_switches": ru.ru_nvcsw,
    "involuntary_switches": ru.ru_nivcsw,
    "env": {k: os.environ[k] for k in _ENV_VARS if k in os.environ},
    "torch": torch_settings(),
  }


_START = environment()
_START_WALL = time.perf_counter()


def environment_summary(start: dict, end: dict, wall_s: float) -> dict:
  """What happened between two snapshots: the process's average busy cores, the machine's CPU split."""
  d = [b - a for a, b in zip(start["system_cpu_jiffies"], end["system_cpu_jiffies"])]
  total = max(sum(d), 1)
  return {
    "process_busy_cores": round((end["process_cpu_s"] - start["process_cpu_s"]) / max(wall_s, 1e-9), 2),
    "machine_busy_frac": round(1 - (d[3] + d[4]) / total, 3),  # everything but idle and iowait, all processes
    "machine_steal_frac": round(d[7] / total, 3),  # taken by the hypervisor from this VM
    "major_faults": end["major_faults"] - start["major_faults"],
    "involuntary_switches": end["involuntary_switches"] - start["involuntary_switches"],
  }


def others_cores(result: dict) -> float:
  """Cores' worth of CPU time other processes used while a worker ran (machine busy − the worker), from its RESULT."""
  s = result["env_summary"]
  return max(0.0, s["machine_busy_frac"] * result["env_end"]["cpu_count"] - s["process_busy_cores"])


def peak_rss_gb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


class RewardClock:
  """Wraps a reward function; the times between its calls are the iteration times of a trainer
  that calls it once per GRPO iteration (after the rollout, before the update)."""

  def __init__(self, fn):
    self.fn, self.stamps = fn, []
    self.__name__ = "even_token_fraction"

  def __call__(self, *args, **kwargs):
    self.stamps.append(time.perf_counter())
    return self.fn(*args, **kwargs)

  def intervals(self) -> list[float]:
    return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


def report(result: dict) -> None:
  """Print the worker's ``RESULT`` JSON line, with the workload, peak RSS and the environment at start and end."""
  end = environment()
  result.update(_RECORD)
  result["workload"] = WORKLOAD.name
  result["precision"] = PRECISION
  result["smoke"] = bool(os.environ.get("PEERS_SMOKE"))
  result["peak_rss_gb"] = round(peak_rss_gb(), 3)
  result["pid"] = os.getpid()
  result["env_start"], result["env_end"] = _START, end
  result["env_summary"] = environment_summary(_START, end, time.perf_counter() - _START_WALL)
  print("RESULT " + json.dumps(result, default=str), flush=True)
  sys.stdout.flush()
