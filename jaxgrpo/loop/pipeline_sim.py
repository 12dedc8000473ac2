"""A discrete-event model of the rollout/learner pipeline: predicted step time from phase times.

Two agents share one or two device pools:

- the **producer** makes batch n (sampling + rewards, ``generate`` seconds) as soon as its pool is
  free and parameter version ``n - 1 - k`` is published (k = ``max_staleness``); it samples with the
  newest version published at its start;
- the **learner** trains batch n once it is produced and its pool is free: ``old_logp`` (only when the
  batch is stale), ``reference``, ``update`` and ``other`` seconds, then ``transfer`` seconds to
  publish version n to the producer.

Colocated placement is one pool, time-shared first come first served (a job holds the devices to its
end, as one XLA program does); disaggregated placement gives each agent its own pool. Jobs are
executed in the order their agents become ready (ties: the learner first), which is the event order of
this two-agent system. The same rules as ``jaxgrpo.loop.async_rollout``; the times are inputs — measured on
the devices each pool really has (a phase on fewer devices takes longer: the model does not scale
them).

Steady state with constant phase times (L = old_logp + reference + update + other + transfer):
synchronous (k = 0) step = generate + L − old_logp; disaggregated one-step-off (k = 1) step =
max(generate, L); colocated k >= 1 gains nothing (one pool does the same work, plus the
recomputation). A larger k only helps when generation times vary (``generate`` as a per-batch
sequence: long tails).

Pure Python, no JAX.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

__all__ = ["Phases", "SimResult", "simulate"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Phases:
  """Seconds per batch of each phase (measured on the pool that runs it).

  Attributes:
    generate: sampling + rewards of one batch on the producer's pool; a float, or one value per
      batch (a sequence at least ``steps`` long) for varying lengths.
    old_logp: the learner's recomputation of π_old for a stale batch (0 for a fresh one).
    reference: the reference pass (β > 0).
    update: the train step (μ·M optimizer updates).
    other: any other learner-side time per step (host work, logging).
    transfer: publishing the new parameters to the producer (a copy colocated, a reshard to the
      rollout mesh disaggregated); the learner waits for it.
  """

  generate: float | Sequence[float]
  update: float
  old_logp: float = 0.0
  reference: float = 0.0
  other: float = 0.0
  transfer: float = 0.0

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      values = v if isinstance(v, Sequence) else [v]
      if not values or any(not isinstance(x, (int, float)) or x < 0 for x in values):
        raise ValueError(f"`Phases.{f.name}` must be >= 0 seconds (or a non-empty sequence of them); got {v!r}")

  def generate_time(self, n: int) -> float:
    """Generation time of batch n (1-based)."""
    g = self.generate
    if isinstance(g, Sequence):
      if n > len(g):
        raise ValueError(f"`Phases.generate` has {len(g)} values; batch {n} needs one")
      return float(g[n - 1])
    return float(g)


class SimResult(NamedTuple):
  """What :func:`simulate` predicts.

  Attributes:
    step_end: the time each learner step ends (seconds from the start), ``[steps]``.
    step_time: the mean step time after the first ``max_staleness + 1`` steps (the pipeline's fill).
    staleness: ``[steps]`` the staleness of each trained batch.
    learner_idle: ``[steps]`` time the learner waited for batch n.
    producer_idle: ``[steps]`` time the producer waited (for a version or its pool) before batch n.
    queue_depth: ``[steps]`` batches ready when the learner asked for batch n (batch n included).
  """

  step_end: list
  step_time: float
  staleness: list
  learner_idle: list
  producer_idle: list
  queue_depth: list


def simulate(phases: Phases, *, steps: int, max_staleness: int = 0, disaggregated: bool = False) -> SimResult:
  """Runs the pipeline for ``steps`` steps (see the module docstring).

  Args:
    phases: the phase times.
    steps: learner steps (>= 1).
    max_staleness: k >= 0.
    disaggregated: separate pools for the producer and the learner (False: one shared pool).
  """
  if not isinstance(steps, int) or steps < 1:
    raise ValueError(f"`steps` must be an int >= 1; got {steps!r}")
  if not isinstance(max_staleness, int) or max_staleness < 0:
    raise ValueError(f"`max_staleness` must be an int >= 0; got {max_staleness!r}")
  k = max_staleness
  free = {"producer": 0.0, "learner": 0.0}
  pool = {"producer": "producer" if disaggregated else "learner", "learner": "learner"}
  published = [0.0]  # published[v]: when version v is available to the producer
  gen_end, version_of, gen_idle = [], [], []
  learn_end, staleness, learner_idle, depth = [], [], [], []
  producer_done = 0.0
  while len(learn_end) < steps:
    n_p, n_l = len(gen_end) + 1, len(learn_end) + 1
    # when each agent is ready to start its next job (None: waiting on the other agent)
    p_ready = None
    if n_p <= steps and n_p - 1 - k < len(published):
      p_ready = max(producer_done, published[max(0, n_p - 1 - k)])
    l_ready = None
    if n_l <= len(gen_end):
      l_ready = max(learn_end[-1] if learn_end else 0.0, gen_end[n_l - 1])
    if l_ready is not None and (p_ready is None or l_ready <= p_ready):
      prev = learn_end[-1] if learn_end else 0.0
      start = max(l_ready, free[pool["learner"]])
      s = (n_l - 1) - version_of[n_l - 1]
      busy = (phases.old_logp if s > 0 else 0.0) + phases.reference + phases.update + phases.other + phases.transfer
      end = start + busy
      free[pool["learner"]] = end
      learn_end.append(end)
      published.append(end)
      staleness.append(s)
      learner_idle.append(max(0.0, start - prev))
      depth.append(sum(1 for t in gen_end[n_l - 1 :] if t <= l_ready))
    elif p_ready is not None:
      start = max(p_ready, free[pool["producer"]])
      version = max(v for v, t in enumerate(published) if t <= start)
      end = start + phases.generate_time(n_p)
      free[pool["producer"]] = end
      gen_idle.append(start - producer_done)
      producer_done = end
      gen_end.append(end)
      version_of.append(min(version, n_p - 1))
    else:  # unreachable: the learner always has a batch or the producer a version
      raise RuntimeError("pipeline deadlock")
  warm = min(k + 1, steps - 1)
  span = learn_end[-1] - (learn_end[warm - 1] if warm else 0.0)
  return SimResult(learn_end, span / (steps - warm), staleness, learner_idle, gen_idle[:steps], depth)
