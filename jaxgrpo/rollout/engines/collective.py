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
        each process takes its own rows back (distributed.process_rows)

A process whose rollout has finished calls :meth:`CollectiveSampler.drain`, which joins rounds as "idle"
until every process is idle. The rounds pair the n-th call of every process, whatever turn each is at,
so no process waits for a turn structure the others do not share. One process: a round is the plain
sampler on the mesh.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np

from jaxgrpo.parallel import distributed
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout.engines.base import Generation, finish_reasons
from jaxgrpo.rollout.engines.builtin import BuiltinEngine
from jaxgrpo.rollout.sampling import SamplingConfig, generate

__all__ = ["CollectiveSampler"]


class CollectiveSampler(BuiltinEngine):
  """An engine over the global mesh whose ``generate`` is a collective round (module docstring); pushing,
  releasing and closing are the built-in engine's (a reference to the model, nothing else held).

  Args:
    model: the policy (its parameters on ``mesh``).
    mesh: the mesh the sampler runs on.
    key: the PRNG key of the rollout; round r samples with ``fold_in(key, r)`` (the same on every process,
      whatever key a caller passes).
  """

  name = "jax-collective"
  logprobs_are_policy = True

  def __init__(self, model, mesh, *, key):
    super().__init__(model)
    self.mesh, self.key, self.rounds = mesh, key, 0

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
      own = request is not None and request[2] == settings
      if own:
        n, w = request[0].shape
        tokens[:n] = sampling.pad_id
        mask[:n] = False
        tokens[:n, width - w :], mask[:n, width - w :] = request[0], request[1]
      if jax.process_count() > 1:
        tokens, mask = shd.place_batch((tokens, mask), self.mesh, process_local=True)
      key = jax.random.fold_in(self.key, self.rounds)
      rollout = generate(self.model, tokens, mask, sampling, key=key, temperature=json.loads(settings)["temperature"])
      rows = distributed.process_rows(rollout._replace(num_steps=None), self.mesh)
      if own:
        n = request[0].shape[0]
        rows = rows._replace(prompt_tokens=request[0], prompt_mask=request[1])
        result = jax.tree.map(lambda x, n=n: x if x is None or x.shape[0] == n else x[:n], rows)
    return result


def _sampling(settings: str) -> SamplingConfig:
  d = json.loads(settings)
  d.pop("temperature")
  for name, value in d.items():
    if isinstance(value, list):
      d[name] = tuple(value)
  return SamplingConfig(**d)
