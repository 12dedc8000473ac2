"""The built-in sampler for several processes whose requests differ: multi-turn rollouts with one
process per block of rows.

In a multi-process run the policy's parameters span the processes, so every sampler call is one
program that all of them must enter together, with the same shapes. A multi-turn rollout makes as many
calls as its turns need, and each process holds other trajectories: they end at different turns, need
other context widths, and may stop at other ids. :class:`CollectiveSampler` is an engine
(``jaxgrpo.rollout.engines.Engine``) that turns each process's own ``generate`` call into a collective
**round**::

    every process: its request (rows, width, sampling settings) or "idle"   one small all-gather
    for each distinct settings of the round, in one order on every process:
        each process places its rows (or R padding rows), left-padded to the round's width
        one sampler program on the global mesh (key = fold_in(key, round))  each row's draws: key + row
            generate, or generate_speculative when the rollout speculates (below)
        each process takes its own rows back (distributed.process_rows)

A process whose rollout has finished calls :meth:`CollectiveSampler.drain`, which joins rounds as "idle"
until every process is idle. The rounds pair the n-th call of every process, whatever turn each is at,
so no process waits for a turn structure the others do not share. One process: a round is the sampler
(plain or speculative) on the mesh.

**Speculative rounds** (``rollout.speculative``, the built-in engine's
:class:`~jaxgrpo.rollout.speculative.SpeculativeSwitch`): the kind of a rollout is the switch's ``mode_now()``,
read once when the sampler is made (one per rollout) from a switch whose state is the same on every process
(below), so every process enters the same program with the same shapes. A speculating rollout's rounds call
``generate_speculative`` — prompt lookup, or the switch's draft model, which ``generate_speculative`` replicates
on every device of the mesh (``jaxgrpo.rollout.speculative.draft_on_mesh``) — and every policy token's
recorded log-prob stays the target's (exact speculative decoding). Each round's statistics (verify steps,
drafted, accepted) are the global program's, the same scalars on every process, counted over the processes'
own rows only (``generate_speculative``'s ``counted``: a padding row drafts from a pad token), and are summed over
the rollout's rounds.

**One decision on every process.** :meth:`CollectiveSampler.finish` (after the rollout: :meth:`drain`, then
one small all-gather) makes the rollout one call of the switch with numbers agreed by all processes: the
policy tokens of every process's trajectories summed, over the slowest process's seconds in the rounds'
programs (dispatch to its rows fetched; never the environments' time nor the wait for another process's
request). Every process thus observes the same call, and ``auto``'s timed calls, its decision and the logged
measurement are the same everywhere.
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import numpy as np

from jaxgrpo.parallel import distributed
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout.engines.base import Generation, finish_reasons
from jaxgrpo.rollout.engines.builtin import BuiltinEngine
from jaxgrpo.rollout.sampling import SamplingConfig, generate
from jaxgrpo.rollout.speculative import SpeculativeStats, generate_speculative

__all__ = ["CollectiveSampler"]


class CollectiveSampler(BuiltinEngine):
  """An engine over the global mesh whose ``generate`` is a collective round (module docstring); pushing,
  releasing and closing are the built-in engine's (a reference to the model, nothing else held).

  Args:
    model: the policy (its parameters on ``mesh``).
    mesh: the mesh the sampler runs on.
    key: the PRNG key of the rollout; round r samples with ``fold_in(key, r)`` (the same on every process,
      whatever key a caller passes).
    switch: the run's ``SpeculativeSwitch`` (``rollout.speculative``), or None: plain rounds. Its
      ``mode_now()`` is read here, once: the kind of every round of this rollout (:attr:`mode`).

  Attributes:
    mode: ``plain``, ``ngram`` or ``draft``; stats: ``int64[3]`` verify steps, drafted, accepted summed over the
      speculative rounds; seconds: this process's seconds in the rounds' programs.
  """

  name = "jax-collective"
  logprobs_are_policy = True

  def __init__(self, model, mesh, *, key, switch=None):
    super().__init__(model)
    self.mesh, self.key, self.rounds = mesh, key, 0
    self.switch = switch
    self.mode = "plain" if switch is None else switch.mode_now()
    self.stats, self.seconds = np.zeros(3, np.int64), 0.0

  def generate(self, prompt_tokens, prompt_mask, sampling: SamplingConfig, *, key=None, temperature: float = 1.0):
    """This process's ``Generation`` of ``prompt_tokens`` (``int32[n, P]`` left-padded, its own rows), sampled in
    one collective round (``key`` is not used: the round's key is the same on every process)."""
    tokens, mask = np.asarray(prompt_tokens), np.asarray(prompt_mask, bool)
    settings = {**dataclasses.asdict(sampling), "temperature": float(temperature)}
    out = self._round((tokens, mask, json.dumps(settings, sort_keys=True, default=list)))
    return Generation(out, finish_reasons(out.completions, out.mask, sampling.eos_ids))

  def drain(self) -> None:
    """Join rounds as idle until every process is idle (call once this process's rollout is done)."""
    while self._round(None) is not None:
      pass

  def finish(self, policy_tokens: int) -> None:
    """After this process's rollout (``policy_tokens``: its trajectories' policy tokens): :meth:`drain`, then,
    with a switch, the rollout is one call of it, observed with numbers agreed by every process (module
    docstring): ``sum(policy_tokens) / max(seconds)`` over the processes and the rounds' summed stats. Every
    process must call it once per rollout (it all-gathers)."""
    self.drain()
    if self.switch is None:
      return
    every = distributed.gather_objects([int(policy_tokens), float(self.seconds)])
    tokens, seconds = sum(t for t, _ in every), max(s for _, s in every)
    stats = None if self.mode == "plain" else SpeculativeStats(*(np.int64(c) for c in self.stats))
    self.switch.observe(self.mode, tokens / max(seconds, 1e-9), stats)

  def _round(self, request):
    mine = None if request is None else (int(request[0].shape[0]), int(request[0].shape[1]), request[2])
    every = distributed.gather_objects(mine)
    asks = [e for e in every if e is not None]
    if not asks:
      return None
    per = max(n for n, _, _ in asks)
    shards = max(1, shd.batch_shards(self.mesh) // jax.process_count())
    per = -(-per // shards) * shards  # rows each process sends: the largest request, over its batch shards
    width = max(w for _, w, _ in asks)
    result = None if request is None else False
    for settings in sorted({s for _, _, s in asks}):
      self.rounds += 1
      sampling = _sampling(settings)
      tokens = np.full((per, width), sampling.pad_id, np.int32)
      mask = np.zeros((per, width), bool)
      mask[:, -1] = True  # padding rows: one real (pad) token each; their samples are dropped
      real = np.zeros((per,), bool)  # the rows a speculative round's stats count
      own = request is not None and request[2] == settings
      if own:
        n, w = request[0].shape
        tokens[:n] = sampling.pad_id
        mask[:n] = False
        tokens[:n, width - w :], mask[:n, width - w :] = request[0], request[1]
        real[:n] = True
      if jax.process_count() > 1:
        tokens, mask, real = shd.place_batch((tokens, mask, real), self.mesh, process_local=True)
      key = jax.random.fold_in(self.key, self.rounds)
      t0 = time.perf_counter()
      rollout = self._sample(tokens, mask, real, sampling, key, json.loads(settings)["temperature"])
      rows = distributed.process_rows(rollout._replace(num_steps=None), self.mesh)
      self.seconds += time.perf_counter() - t0
      if own:
        n = request[0].shape[0]
        rows = rows._replace(prompt_tokens=request[0], prompt_mask=request[1])
        result = jax.tree.map(lambda x, n=n: x if x is None or x.shape[0] == n else x[:n], rows)
    return result

  def _sample(self, tokens, mask, real, sampling, key, temperature):
    """One round's program: ``generate``, or ``generate_speculative`` of :attr:`mode` (its stats summed over the
    ``real`` rows, the processes' requests: padding rows draw from a pad token and would skew the acceptance)."""
    if self.mode == "plain":
      return generate(self.model, tokens, mask, sampling, key=key, temperature=temperature)
    rollout, stats = generate_speculative(
      self.model, tokens, mask, sampling, key=key, temperature=temperature, speculative=self.switch.config,
      draft_model=self.switch.draft_model, counted=real,
    )  # fmt: skip
    self.stats += np.asarray(jax.device_get(tuple(stats)), np.int64)  # scalars: replicated on every process
    return rollout


def _sampling(settings: str) -> SamplingConfig:
  d = json.loads(settings)
  d.pop("temperature")
  for name, value in d.items():
    if isinstance(value, list):
      d[name] = tuple(value)
  return SamplingConfig(**d)
