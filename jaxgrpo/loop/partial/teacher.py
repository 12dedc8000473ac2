"""A distillation teacher's scores of a partial pool's complete groups, for dynamic sampling
(``objective.dynamic_sampling`` with ``objective.distill``; ``PartialRollouts._informative``).

The synchronous path scores each sampled round with the teacher (``RolloutSource.teacher``: one pass of the train
mesh's program, ``jaxgrpo.step.feed.teacher_host_scores``); a partial pool has no rounds, its groups complete one by
one across weight updates, so each complete group is scored once, when it completes. The pass is one program over
the mesh's devices, which shapes the call: the rows are padded with blank rows (their scores dropped) to a multiple
of the mesh's batch shards, and with several processes — whose pools complete groups at their own pace — every
process enters each pass with the most rows, prompt width and completion length any process has (one small
all-gather decides them), a process without new groups entering with blank rows only; no process enters when none
has rows.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxgrpo.loop import scoring
from jaxgrpo.parallel import distributed
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.step import feed
from jaxgrpo.step.batch import Batch

__all__ = ["teacher_scores"]


def teacher_scores(source, rows, groups: int, *, episodes: bool) -> tuple[np.ndarray | None, dict | None]:
  """``rows`` (``groups`` complete groups of G = ``source.sampling.num_samples`` rows of this process: a
  ``Rollout`` of a pool's rows, or with ``episodes`` an environment pool's ``MultiTurnRollout``; None when it has
  none) scored by ``source.teacher`` as a synchronous round is.

  Returns:
    ``(signal f32[groups], fields)``: each group's ``scoring.teacher_signal`` (the mean ``|log π_s − log π_t|`` over
    its distilled tokens) and the rows' teacher fields (``feed.TEACHER_FIELDS``: ``teacher_logp`` ``f32[N, T]``, and
    a top-k form's ids and log-probs), kept for the step; ``(None, None)`` without rows. Several processes: a
    collective — every process calls it at each turn of the selection, with or without rows.
  """
  g = source.sampling.num_samples
  n = groups * g
  shape = (0, 0, 0) if rows is None else (n, *np.shape(rows.prompt_tokens)[1:], *np.shape(rows.completions)[1:])
  most, width, t = (max(e[i] for e in distributed.gather_objects(list(shape))) for i in range(3))
  if most == 0:
    return None, None
  shards = shd.batch_shards(source.mesh)
  blank = _blank_rows(-(-most // shards) * shards - n, width, t, source.pad_id, policy_mask=episodes)
  if rows is None:
    source.teacher(blank)
    return None, None
  own = Batch(
    prompt_tokens=np.asarray(rows.prompt_tokens, np.int32),
    prompt_mask=np.asarray(rows.prompt_mask, bool),
    completions=np.asarray(rows.completions, np.int32),
    mask=np.asarray(rows.mask, bool),
    old_logp=np.asarray(rows.log_probs, np.float32),
    group_ids=np.repeat(np.arange(groups, dtype=np.int32), g),
    rewards=np.zeros(n, np.float32),
    policy_mask=np.asarray(rows.policy_mask, bool) if episodes else None,
  )
  own = scoring.pad_prompts(own, width, source.pad_id)
  scored = source.teacher(jax.tree.map(lambda a, b: np.concatenate([a, b]), own, blank))
  fields = {f: np.asarray(getattr(scored, f))[:n] for f in feed.TEACHER_FIELDS if getattr(scored, f) is not None}
  return scoring.teacher_signal(own._replace(**fields), g), fields


def _blank_rows(k: int, width: int, t: int, pad_id: int, *, policy_mask: bool) -> Batch:
  """``k`` rows that fill a teacher pass's batch and are then dropped: one real prompt token (the pad id; a row
  attends to something), no completion token; with ``policy_mask`` (environment rows) that field too."""
  prompt_mask = np.zeros((k, width), bool)
  prompt_mask[:, -1] = True
  return Batch(
    prompt_tokens=np.full((k, width), pad_id, np.int32),
    prompt_mask=prompt_mask,
    completions=np.full((k, t), pad_id, np.int32),
    mask=np.zeros((k, t), bool),
    old_logp=np.zeros((k, t), np.float32),
    group_ids=np.zeros(k, np.int32),
    rewards=np.zeros(k, np.float32),
    policy_mask=np.zeros((k, t), bool) if policy_mask else None,
  )
