"""A distillation teacher served by vLLM: each row's prompt + completion scored as one prompt with
``SamplingParams(prompt_logprobs=k, max_tokens=1)`` (``objective.distill.teacher: vllm:<teacher>``).

For completion position t of row i, vLLM's prompt log-probs at the prompt index ``P_i + t`` (``P_i`` the row's
real prompt tokens) hold ``log softmax(logits)[y_t]`` of the given token and the k most likely ids with their
log-probs (its ``rank`` 1..k; the given token's entry is added when it ranks below k): the numbers of
``jaxgrpo.step.feed.Teacher`` for the same weights, computed by vLLM's kernels (tests/test_engine_vllm.py's teacher
tests: float32 within 1e-4 of the Flax teacher; ids equal where the Flax teacher's k-th and (k+1)-th log-probs
differ by more than 1e-4).

**Temperature 1 only.** vLLM computes prompt log-probs from the raw logits whatever ``logprobs_mode`` says
(its ``gpu_model_runner._get_prompt_logprobs_dict``: "prompt tokens skip sampling processors, so processed_* and
raw_* yield the same scores"), and ``raw_logits`` would give the top-k logits without the full-vocabulary
normaliser that dividing by a temperature needs: a step temperature other than 1 is refused in one line.
``prompt_logprobs`` above vLLM's ``max_logprobs`` (default 20) is raised at start (``max_logprobs=k``).
The weights are pushed from the JAX teacher model once (``VLLMEngine.push_weights``); the prefix cache is on
(a group's shared prompt is computed once; vLLM recomputes a cached prefix's prompt log-probs).
"""

from __future__ import annotations

import numpy as np

from jaxgrpo.models.log_probs import logprob_temperature
from jaxgrpo.rollout.engines.vllm import VLLMEngine

__all__ = ["VLLMTeacher", "check_engine_temperature"]


def check_engine_temperature(temperature: float) -> None:
  """ValueError in one line unless log-probs at ``temperature`` are vLLM's prompt log-probs (temperature 1)."""
  if logprob_temperature(temperature) != 1.0:
    raise ValueError(
      f"a vLLM teacher (objective.distill.teacher: vllm:...) scores at temperature 1 only, the step's is "
      f"{float(temperature)!r}: vLLM's prompt log-probs skip the sampling processors (no temperature) and its "
      "raw logits come without the normaliser; set step.temperature 1, or use an in-process or remote teacher"
    )


class VLLMTeacher:
  """The teacher model ``model`` (a JAX model of a vLLM family) in vLLM, scoring host rows.

  Args:
    model: the teacher (its weights pushed once).
    top_k: k of a top-k distillation form, or None (the sampled-token form: the given tokens' log-probs only).
    temperature: the step's temperature (1 only: :func:`check_engine_temperature`).
    dtype, kv_cache_bytes, max_model_len: as :class:`~jaxgrpo.rollout.engines.vllm.VLLMEngine`'s.
  """

  def __init__(
    self, model, *, top_k=None, temperature=1.0, dtype="float32", kv_cache_bytes=256 * 2**20, max_model_len=None
  ):
    check_engine_temperature(temperature)
    self.top_k = top_k
    self.engine = VLLMEngine(
      model.config,
      dtype=dtype,
      kv_cache_bytes=kv_cache_bytes,
      max_model_len=max_model_len,
      max_logprobs=max(20, top_k or 0),
      model=model,
    )

  def scores(self, prompt_tokens, prompt_mask, completions, mask):
    """``(logp f32[B, T], ids int32[B, T, k] | None, topk_logp f32[B, T, k] | None)`` of the rows; positions
    outside ``mask`` are 0 (ids 0, log-probs −inf for the top-k)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt_tokens, prompt_mask = np.asarray(prompt_tokens), np.asarray(prompt_mask, bool)
    completions, mask = np.asarray(completions), np.asarray(mask, bool)
    b, t = completions.shape
    k = self.top_k
    ends = np.where(mask.any(1), t - np.argmax(mask[:, ::-1], 1), 0)  # one past each row's last real token
    starts = prompt_mask.sum(1)
    if (starts == 0).any():
      raise ValueError(f"`prompt_mask`: row {int(np.argmin(starts))} has no prompt token; every row needs one")
    prompts = [
      TokensPrompt(prompt_token_ids=prompt_tokens[i][prompt_mask[i]].tolist() + completions[i, : ends[i]].tolist())
      for i in range(b)
    ]
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=k or 0, detokenize=False)
    outputs = self.engine.llm.generate(prompts, params, use_tqdm=False)
    logp = np.zeros((b, t), np.float32)
    ids = None if k is None else np.zeros((b, t, k), np.int32)
    top = None if k is None else np.full((b, t, k), -np.inf, np.float32)
    for i, out in enumerate(outputs):
      given = prompts[i]["prompt_token_ids"]
      for j in range(int(ends[i])):
        entry = out.prompt_logprobs[starts[i] + j]  # {token id: Logprob(logprob, rank, ...)}
        logp[i, j] = entry[given[starts[i] + j]].logprob
        if k is not None:
          best = sorted(entry.items(), key=lambda kv: kv[1].rank)[:k]
          ids[i, j, : len(best)] = [tok for tok, _ in best]
          top[i, j, : len(best)] = [lp.logprob for _, lp in best]
    return logp, ids, top

  def close(self) -> None:
    """Stops vLLM (its memory and threads)."""
    self.engine.close()
