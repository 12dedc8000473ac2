"""Evaluation metrics for sampled answers: the unbiased pass@k estimator and mean@k.

With n samples per problem of which c are correct (Chen et al., 2021, "Evaluating Large Language
Models Trained on Code", eq. 1):

    pass@k = E_problems[ 1 - C(n - c, k) / C(n, k) ]      (k <= n)

the probability that at least one of k samples drawn without replacement from the n is correct,
computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (stable for large n). mean@k is the mean accuracy
of k samples per problem, ``E_problems[c / n]`` with n = k samples (the λ-GRPO / FRPO papers'
"mean@k"; pass@1 equals it).

:func:`evaluate_policy` samples k completions per held-out prompt (``jaxgrpo.loop.collect.sample``),
scores them with a reward function and reports both (the trainer's evaluation and ``scripts/eval.py``).
With several processes each samples and scores its share of the problems on the global mesh and the
correct counts are gathered.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxgrpo.data import pad_left
from jaxgrpo.loop import episodes as env_training
from jaxgrpo.loop import iteration
from jaxgrpo.parallel import distributed
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rewards.reward_set import CountingReward
from jaxgrpo.rollout.engines.collective import CollectiveSampler
from jaxgrpo.run import assemble, builders

__all__ = [
  "pass_at_k",
  "mean_at_k",
  "summarize_eval",
  "evaluate_policy",
  "eval_settings",
  "evaluate_run",
  "evaluate_checkpoint",
]


def _check(num_samples, num_correct):
  n = np.asarray(num_samples)
  c = np.asarray(num_correct)
  if not (np.issubdtype(n.dtype, np.integer) and np.issubdtype(c.dtype, np.integer)):
    raise TypeError(f"`num_samples` and `num_correct` must be integers; got {n.dtype}, {c.dtype}")
  if np.any(n < 1) or np.any(c < 0) or np.any(c > n):
    raise ValueError(
      "need 1 <= num_samples and 0 <= num_correct <= num_samples; got "
      f"num_samples={n.tolist()}, num_correct={c.tolist()}"
    )
  return np.broadcast_arrays(n, c)


def pass_at_k(num_samples, num_correct, k: int) -> np.ndarray:
  """Unbiased pass@k per problem: ``1 - C(n-c, k) / C(n, k)``; float64 with the broadcast shape.

  Args:
    num_samples: n samples per problem, ``int`` or ``int[P]``; k <= n required.
    num_correct: c correct samples per problem, ``int[P]``.
    k: int >= 1.

  Returns:
    ``f64[P]`` (the broadcast shape of the inputs).
  """
  n, c = _check(num_samples, num_correct)
  if not isinstance(k, (int, np.integer)) or k < 1:
    raise ValueError(f"`k` must be an int >= 1; got {k!r}")
  if np.any(k > n):
    raise ValueError(f"`k`={k} exceeds num_samples={n.tolist()}")
  out = np.empty(n.shape, np.float64)
  for idx in np.ndindex(n.shape):
    ni, ci = int(n[idx]), int(c[idx])
    if ni - ci < k:
      out[idx] = 1.0
    else:
      out[idx] = 1.0 - float(np.prod(1.0 - k / np.arange(ni - ci + 1, ni + 1, dtype=np.float64)))
  return out


def mean_at_k(num_samples, num_correct) -> np.ndarray:
  """Per-problem accuracy ``c / n``: ``f64[P]`` from ``int`` or ``int[P]`` n and ``int[P]`` c; its mean
  over problems is mean@k with n = k."""
  n, c = _check(num_samples, num_correct)
  return c.astype(np.float64) / n


def summarize_eval(correct: np.ndarray, ks=(1,)) -> dict[str, float]:
  """``correct`` ``bool[P, n]`` (n samples per problem) → ``{"eval_accuracy": mean@n,
  "eval_pass@k": ... for k in ks (k <= n)}``, averaged over the P problems."""
  correct = np.asarray(correct, bool)
  if correct.ndim != 2 or correct.shape[1] < 1:
    raise ValueError(f"`correct` must be bool[P, n] with n >= 1; got shape {correct.shape}")
  n = correct.shape[1]
  c = correct.sum(1)
  out = {"eval_accuracy": float(mean_at_k(n, c).mean())}
  for k in ks:
    if k <= n:
      out[f"eval_pass@{k}"] = float(pass_at_k(n, c, int(k)).mean())
  return out


def evaluate_policy(
  model,
  tokenizer,
  token_lists: Sequence[Sequence[int]],
  answers: Sequence[str],
  *,
  accuracy: Callable,
  k: int,
  pass_k: Sequence[int] = (1,),
  temperature: float,
  max_new_tokens: int,
  prompt_len: int,
  pad_id: int,
  eos_ids: Sequence[int],
  batch_prompts: int = 64,
  top_p: float = 1.0,
  top_k: int = 0,
  key: jax.Array,
  mesh: Mesh | None = None,
) -> dict[str, float]:
  """mean@k and pass@j of ``model`` on held-out prompts.

  Samples ``k`` completions per prompt (``jaxgrpo.rollout.sampling.generate``), decodes them, scores them
  with ``accuracy`` (a reward function ``(prompts, completions, answer=...) -> list[float]``, e.g.
  :class:`~jaxgrpo.rewards.reward_set.MathAccuracy`; a score > 0.5 counts as correct) and returns
  ``{"eval_accuracy": mean@k, "eval_pass@j": ... for j in pass_k}`` (the unbiased estimator,
  :func:`pass_at_k`) plus the verifier's counters (``eval_<counter>``).

  Args:
    model: a ``jaxgrpo.models`` model.
    tokenizer: its tokenizer (``batch_decode``).
    token_lists: P prompts, each a list of token ids (chat template applied), at most ``prompt_len`` long.
    answers: P ground-truth answers.
    k: samples per prompt; ``pass_k``: the j (each <= k).
    temperature, top_p, top_k, max_new_tokens: sampling (temperature 0: greedy).
    prompt_len: the padded prompt length (left padding with ``pad_id``).
    eos_ids: token ids that end a completion.
    batch_prompts: prompts per ``generate`` call; the last batch is padded by repeating its last
      prompt, so every call has one compiled shape ``int32[batch_prompts, prompt_len]`` (with a
      ``mesh``, ``batch_prompts`` is rounded up to a multiple of its batch axes ``data × fsdp``).
    key: PRNG key; batch ``i`` samples with ``fold_in(key, i · batch_prompts)``.
    mesh: the model's mesh. With several processes it is required: each batch is sampled on the
      global mesh, every process decodes and scores only its own rows
      (``jaxgrpo.parallel.distributed.process_rows``) and the correct counts are gathered; the result is the
      same on every process and equals a one-process run on the same mesh. None: one process.
  """
  if len(token_lists) != len(answers) or not token_lists:
    raise ValueError(
      f"`token_lists` and `answers` must be non-empty and of one length; got {len(token_lists)} and {len(answers)}"
    )
  if mesh is None and jax.process_count() > 1:
    raise ValueError("evaluate_policy: pass the model's `mesh` in a multi-process run (each process scores its rows)")
  sampling = iteration.SamplingConfig(
    num_samples=k,
    max_new_tokens=max_new_tokens,
    top_p=top_p,
    top_k=top_k,
    eos_ids=tuple(eos_ids),
    pad_id=pad_id,
  )
  nb = min(batch_prompts, len(token_lists))
  if mesh is not None:
    shards = shd.batch_shards(mesh)
    nb = -(-nb // shards) * shards
  correct = []
  for start in range(0, len(token_lists), nb):
    chunk = list(range(start, min(start + nb, len(token_lists))))
    padded = chunk + [chunk[-1]] * (nb - len(chunk))
    tokens, mask = pad_left([token_lists[i] for i in padded], prompt_len, pad_id)
    if mesh is not None:
      tokens, mask = iteration.place_prompts(tokens, mask, mesh=mesh)
    rollout = iteration.sample(
      model, tokens, mask, sampling, key=jax.random.fold_in(key, start), temperature=temperature
    )
    rollout = rollout._replace(num_steps=None)
    rows = distributed.process_rows(rollout, mesh) if mesh is not None else jax.tree.map(np.asarray, rollout)
    comp, cmask = rows.completions, rows.mask  # this process's rows of int32[nb·k, T], bool[nb·k, T]
    real = np.flatnonzero(np.asarray(rows.group_ids) < len(chunk))  # rows of the padding prompts are not scored
    texts = tokenizer.batch_decode([comp[i][cmask[i]].tolist() for i in real], skip_special_tokens=True)
    gold = [answers[chunk[rows.group_ids[i]]] for i in real]
    ok = np.zeros(len(comp), bool)
    if real.size:
      ok[real] = np.asarray(accuracy([""] * len(texts), texts, answer=gold), np.float64) > 0.5
    if mesh is not None:
      ok = distributed.all_rows(ok, mesh)
    correct.append(ok.reshape(nb, k)[: len(chunk)])
  out = summarize_eval(np.concatenate(correct), ks=pass_k)
  if isinstance(accuracy, CountingReward):
    totals: dict[str, int] = {}
    for counters in distributed.gather_objects(accuracy.pop_counters()):
      for name, v in counters.items():
        totals[name] = totals.get(name, 0) + v
    out.update({f"eval_{c}": v for c, v in totals.items()})
  return out


def eval_settings(cfg) -> dict:
  """The sampling settings of a run's held-out evaluation (``cfg``: a ``TrainerConfig``), as keyword arguments
  of :func:`evaluate_policy`: ``k`` = ``eval.samples``, ``pass_k`` = ``eval.pass_k``, ``temperature`` =
  ``eval.temperature`` (None: ``step.temperature``), ``max_new_tokens``, ``top_p``, ``top_k`` of ``rollout``,
  ``batch_prompts`` = ``eval.batch_prompts``."""
  return {
    "k": cfg.eval.samples,
    "pass_k": tuple(cfg.eval.pass_k),
    "temperature": cfg.step.temperature if cfg.eval.temperature is None else cfg.eval.temperature,
    "max_new_tokens": cfg.rollout.max_new_tokens,
    "top_p": cfg.rollout.top_p,
    "top_k": cfg.rollout.top_k,
    "batch_prompts": cfg.eval.batch_prompts,
  }


def evaluate_run(
  cfg,
  policy,
  tokenizer,
  data,
  *,
  accuracy,
  sampling,
  make_env,
  pad_id: int,
  eos_ids,
  mesh: Mesh | None,
  key=None,
  should_stop: Callable[[], bool] | None = None,
) -> dict[str, float]:
  """A run's held-out evaluation (``cfg``: a ``TrainerConfig``; ``data``: its ``assemble.DataParts``):
  mean@k of the environment reward with ``env`` (``environments.training.env_evaluate``), else mean@k
  (``eval_accuracy``) and ``eval_pass@k`` of :func:`evaluate_policy` with :func:`eval_settings`, from ``key``
  (default ``key(run.seed + 1)``)."""
  key = jax.random.key(cfg.run.seed + 1) if key is None else key
  settings = eval_settings(cfg)
  if make_env is not None:  # mean@k of the environment reward
    temperature = settings["temperature"]
    return _env_evaluate(cfg, policy, tokenizer, data, sampling, make_env, mesh, key, temperature, should_stop)
  return evaluate_policy(
    policy,
    tokenizer,
    data.eval_prompts.tokens,
    [e.answer for e in data.eval_examples],
    accuracy=accuracy,
    prompt_len=data.prompt_len,
    pad_id=pad_id,
    eos_ids=eos_ids,
    key=key,
    mesh=mesh,
    **settings,
  )


def evaluate_checkpoint(cfg, policy, tokenizer, *, data=None, mesh: Mesh | None = None) -> dict[str, float]:
  """The trainer's held-out evaluation of ``policy`` under the run config ``cfg`` (e.g. a checkpoint's saved
  config, ``builders.load_policy``), rebuilt piece by piece as ``Trainer`` builds it: the same rows, prompts and
  padded prompt length (``assemble.build_data``), verifier (``assemble.verifier``), sampling settings, environment
  (``env.factory``) and key (``key(run.seed + 1)``), through :func:`evaluate_run`. So ``scripts/eval.py
  --checkpoint OUT --step N`` prints the numbers of step N's eval record in ``OUT/metrics.jsonl``. ``data``: the
  ``assemble.build_data(cfg, tokenizer, policy.config)`` already built (None: built here).

  Raises:
    ValueError: the run has no held-out set (``eval.dataset`` unset and no ``data.arithmetic``, or an
      ``env.episodes`` run without ``env.eval_episodes``).
  """
  pad_id, eos_ids = builders.special_ids(tokenizer)
  data = assemble.build_data(cfg, tokenizer, policy.config) if data is None else data
  if data.eval_examples is None:
    raise ValueError("the run has no held-out set (eval.dataset, data.arithmetic or env.eval_episodes): pass one")
  sampling = assemble.sampling_config(cfg, policy, pad_id=pad_id, eos_ids=eos_ids)
  make_env = None if cfg.env is None else cfg.env.make_env()
  accuracy = assemble.verifier(cfg)
  try:
    return evaluate_run(
      cfg,
      policy,
      tokenizer,
      data,
      accuracy=accuracy,
      sampling=sampling,
      make_env=make_env,
      pad_id=pad_id,
      eos_ids=eos_ids,
      mesh=mesh,
    )
  finally:
    accuracy.close()


def _env_evaluate(cfg, policy, tokenizer, data, sampling, make_env, mesh, key, temperature, should_stop) -> dict:
  """``environments.training.env_evaluate`` of the held-out rows; several processes: each evaluates its share
  (contiguous), its turns sampled in collective rounds (``engines.collective.CollectiveSampler``), and the means
  are combined weighted by rows."""
  examples, procs = data.eval_examples, jax.process_count()
  lo = len(examples) * jax.process_index() // procs
  hi = len(examples) * (jax.process_index() + 1) // procs
  engine = None if procs == 1 else CollectiveSampler(policy, mesh, key=key)
  result = {}
  if hi > lo:
    result = env_training.env_evaluate(
      policy,
      examples[lo:hi],
      make_env,
      tokenizer,
      sampling,
      cfg.env.multiturn_config(),
      k=cfg.eval.samples,
      key=key,
      batch_prompts=cfg.eval.batch_prompts,
      temperature=temperature,
      should_stop=should_stop,
      engine=engine,
    )
  if engine is None:
    return result
  engine.drain()
  every = [(n, r) for n, r in distributed.gather_objects([hi - lo, result]) if n]
  total = sum(n for n, _ in every)
  names = sorted({k for _, r in every for k in r})  # a metric an environment reported on some process only: 0 elsewhere
  return {k: sum(n * r.get(k, 0.0) for n, r in every) / total for k in names}
