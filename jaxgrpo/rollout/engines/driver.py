"""How a rollout loop drives an engine, whichever it is: push a policy, take this process's rows of a sampling
call, sample the turns of multi-turn rollouts.

What differs between engines is read from the engine's class attributes (capabilities), never from its name::

    samples_on_mesh    True: the library's jitted sampler on the caller's mesh (``BuiltinEngine``): one program
                       over every process's devices, each process placing its own prompts and taking back its own
                       rows (``BuiltinEngine.sample_rows``); a push is a reference swap (made before every call,
                       nothing gathered, nothing timed: the call returns once dispatched); multi-turn turns run
                       the KV-cached conversation sampler on the pushed model (several processes: collective
                       rounds, ``CollectiveSampler``); the partial pool decodes in slots of its own programs.
                       False (vLLM, a user's engine): each process's engine samples its own groups of prompts
                       (``generate``, checked by ``check_generation``), is pushed the whole policy (gathered from
                       every process's shards) when it holds another version, and gets each turn as token ids.

The other capabilities (``logprobs_are_policy``, ``static_shapes``, ``records_routing``,
``filtered_logprobs_off_unit_temperature``, ``routing_replay_refusal``) are read where they matter: the learner,
the partial pools, the run's checks (``jaxgrpo.rollout.engines.registry``). Nothing here imports the rollout
source or the schedules: they call these functions.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from flax import nnx

from jaxgrpo.parallel import distributed
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout.engines.base import check_generation
from jaxgrpo.rollout.engines.collective import CollectiveSampler
from jaxgrpo.rollout.sampling import Rollout, SamplingConfig

__all__ = ["finish_turns", "push_policy", "sample_rows", "samples_on_mesh", "turn_sampler"]


def samples_on_mesh(engine) -> bool:
  """Whether ``engine`` samples on its caller's mesh (the class attribute ``samples_on_mesh``, False when absent;
  the module docstring)."""
  return getattr(engine, "samples_on_mesh", False) is True


def push_policy(engine, model) -> None:
  """``engine.push_weights(model)`` (``model``: what is to be sampled, LoRA merged by the caller when asked).
  Several processes: an engine that is not on the mesh gets the whole policy, gathered from every process's
  shards (``distributed.to_host``); an engine on the mesh gets a reference (its program spans the processes)."""
  if jax.process_count() > 1 and not samples_on_mesh(engine):  # a whole host copy for this process's engine
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, distributed.to_host(state))
  engine.push_weights(model)


def sample_rows(
  engine,
  prompt_tokens,
  prompt_mask,
  sampling: SamplingConfig,
  *,
  key,
  temperature: float,
  mesh,
  on_dispatched: Callable[[Rollout | None], None] | None = None,
) -> Rollout:
  """This process's rows (NumPy; all N = B·G rows in one process) of G = ``sampling.num_samples`` completions of
  each of the B left-padded prompts ``int32[B, P]`` / ``bool[B, P]`` (every process passes the same), row
  ``b·G + g`` with ``group_ids`` b (the prompt's index among the B), ``num_steps`` None.

  An engine on the mesh: ``engine.sample_rows`` (one program on ``mesh``; ``on_dispatched(rollout)`` once it is
  dispatched). Another: each process samples its own block of groups (``sharding.process_batch_rows`` of
  ``mesh``; the key folded with the block's first group) with ``engine.generate``, checked
  (``check_generation``: a ValueError naming the engine); ``on_dispatched(None)`` is called first (the learner
  runs while the engine samples)."""
  if samples_on_mesh(engine):
    return engine.sample_rows(
      prompt_tokens, prompt_mask, sampling, key=key, temperature=temperature, mesh=mesh, on_dispatched=on_dispatched
    )
  tokens, mask, first = prompt_tokens, prompt_mask, 0
  if jax.process_count() > 1:  # several processes: each process's engine samples its own groups
    g = sampling.num_samples
    rows = shd.process_batch_rows(mesh, len(tokens) * g)
    first, last = rows.start // g, rows.stop // g
    tokens, mask, key = tokens[first:last], mask[first:last], jax.random.fold_in(key, first)
  if on_dispatched is not None:
    on_dispatched(None)
  gen = engine.generate(tokens, mask, sampling, key=key, temperature=temperature)
  gen = check_generation(
    engine,
    gen,
    num_prompts=len(tokens),
    num_samples=sampling.num_samples,
    max_new_tokens=sampling.max_new_tokens,
    temperature=temperature,
  )
  rollout = gen.rollout._replace(num_steps=None)
  return rollout._replace(group_ids=np.asarray(rollout.group_ids) + first)


def turn_sampler(engine, policy, *, mesh=None, key=None) -> tuple:
  """``(model, turn_engine)`` for multi-turn rollouts (``environments.rollout.sample_multiturn``'s ``policy``
  and ``engine``), ``engine`` holding the version to sample (pushed by the caller). An engine on the mesh: its
  pushed model and no engine (the KV-cached conversation sampler runs on the model), or, given ``mesh`` with
  several processes, a :class:`CollectiveSampler` on it (each process's turns in collective rounds keyed by
  ``key``, speculative when the engine's ``rollout.speculative`` switch says so; :func:`finish_turns` after the
  rollout). Another engine: ``policy`` (its config is read) and the engine (each turn sent as token ids)."""
  if not samples_on_mesh(engine):
    return policy, engine
  if mesh is not None and jax.process_count() > 1:
    return engine.model, CollectiveSampler(engine.model, mesh, key=key, switch=getattr(engine, "switch", None))
  return engine.model, None


def finish_turns(turn_engine, policy_tokens: int = 0) -> None:
  """After a multi-turn rollout: a :class:`CollectiveSampler` joins the other processes' rounds until every
  process is done (their turns may still need this process's devices), then its speculative switch observes the
  rollout with numbers agreed by every process (``policy_tokens``: this process's trajectories' policy tokens;
  ``CollectiveSampler.finish``); nothing for another engine."""
  if isinstance(turn_engine, CollectiveSampler):
    turn_engine.finish(policy_tokens)
