"""The multi-turn rollout: the policy and its environments take turns until every trajectory ends.

For N = prompts × G trajectories (one environment each, ``make_env(row)``)::

    prompt_i = ChatFormat.prompt_ids(env_i.reset(row))          # rendered with tools=env.tools
    repeat (at most max_turns times), over the trajectories still running, batched:
      turn_i  = sample(policy, prompt_i ‖ traj_i)                # until EOS / </tool_call> / turn_tokens
      traj_i += turn_i                                           # policy tokens, kept as sampled
      result  = env_i.step(decode(turn_i))                       # host side, one call per trajectory
      traj_i += ChatFormat.observation_ids(result.messages, turn_i)   # context tokens (policy_mask False)
    until result.done, max_turns turns, or max_tokens tokens in traj_i

Trajectories finish at different turns (ragged). The sampler (``kv_cache=True``, the default) is
``jaxgrpo.rollout.conversation.ConversationSampler``: one per-row KV cache of ``prompt + max_tokens`` slots for
the whole rollout; each prompt is prefilled once, and each turn prefills only what the cache lacks — the
last token of the row's previous turn and the observation appended since, as one chunk at the row's own
slots and positions — then decodes the turn (rows that have ended sit out, masked). ``kv_cache=False`` (and
any ``engine``) re-prefills instead: every turn samples the running trajectories (their count rounded up to
a power of two with copies of one of them, whose samples are discarded, so a few shapes compile) with
``jaxgrpo.rollout.sampling.generate`` on the whole conversation so far (``prompt ‖ traj``, left-padded to
one width per batch) and a fresh KV cache. Both give the same token ids and, up to float32 rounding, the
same log-probs for the same key (the cached sampler draws each row's uniforms as the re-prefill batch
would); the re-prefill costs one prefill of the whole conversation per turn (BENCHMARKS.md, "Multi-turn
rollout").

Token accounting: ``completions`` holds ``turn_1 ‖ obs_1 ‖ turn_2 ‖ … ‖ turn_K`` right-padded to
``max_tokens``; ``mask`` marks all of it (the model attends to the observations; λ-GRPO's process
sets hash them), ``policy_mask`` only the turns (the loss; see ``jaxgrpo.step.train.Batch.policy_mask``);
``log_probs`` are the sampler's on policy tokens and 0 on observations. A turn cut by the token budget
is kept (policy tokens, no end token); an observation that does not fit ends the trajectory without it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
import traceback
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import numpy as np

from jaxgrpo.data import pad_left
from jaxgrpo.rollout.conversation import ConversationSampler
from jaxgrpo.rollout.environments.base import StepResult
from jaxgrpo.rollout.environments.chat import ChatFormat
from jaxgrpo.rollout.environments.tools import TOOL_CALL_END
from jaxgrpo.rollout.sampling import _suppressed_ids, generate

__all__ = [
  "MultiTurnConfig",
  "MultiTurnRollout",
  "RolloutInterrupted",
  "Trajectory",
  "assemble",
  "rollout_metrics",
  "sample_multiturn",
  "sample_turn",
  "turn_batches",
]

log = logging.getLogger("jaxgrpo.rollout.environments")

METRIC_NAMES = ("tool_calls", "tool_errors", "tool_s")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiTurnConfig:
  """The bounds of a multi-turn rollout (the run config's ``env:`` section).

  Attributes:
    max_turns: policy turns per trajectory (>= 1; 1: single-turn with an environment reward).
    max_tokens: T, tokens per trajectory after the prompt, policy and observation tokens together.
    turn_tokens: tokens per policy turn (None: ``max_tokens``).
    stop_at_tool_call: a turn also ends at the tool-call end tag (``</tool_call>``, when it is one
      token of the tokenizer); the observation then closes the assistant turn. None (default): per
      group, when its environment has tools (``env.tools`` not empty) — an environment without tools
      gets turns that end at EOS only.
    step_timeout: seconds an ``env.reset`` or ``env.step`` call may take (None: no bound). The call runs in a
      daemon thread; a step past the bound ends its trajectory (rewards so far stand) and counts in
      ``env_timeouts``; a reset past it raises ``TimeoutError`` (there is no prompt to train on). Python
      cannot kill a thread: the abandoned call runs on in the background (the sandbox's tools run in
      subprocesses, which their own limits kill).
    fail_fast: re-raise the first exception an environment raises (with its traceback), for debugging,
      instead of ending the trajectory and counting it in ``env_errors``.
  """

  max_turns: int = 4
  max_tokens: int = 256
  turn_tokens: int | None = None
  stop_at_tool_call: bool | None = None
  step_timeout: float | None = 30.0
  fail_fast: bool = False

  def __post_init__(self):
    for name in ("max_turns", "max_tokens"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"`env.{name}` must be an int >= 1; got {v!r}")
    t = self.turn_tokens
    if t is not None and (not isinstance(t, int) or isinstance(t, bool) or not 1 <= t <= self.max_tokens):
      raise ValueError(f"`env.turn_tokens` must be an int in [1, max_tokens={self.max_tokens}] or null; got {t!r}")
    if self.stop_at_tool_call not in (None, True, False):
      raise ValueError(f"`env.stop_at_tool_call` must be true, false or null; got {self.stop_at_tool_call!r}")
    st = self.step_timeout
    if st is not None and (isinstance(st, bool) or not isinstance(st, (int, float)) or not 0 < st < math.inf):
      raise ValueError(f"`env.step_timeout` must be a number of seconds > 0 or null; got {st!r}")
    if not isinstance(self.fail_fast, bool):
      raise ValueError(f"`env.fail_fast` must be true or false; got {self.fail_fast!r}")

  @property
  def per_turn(self) -> int:
    return self.max_tokens if self.turn_tokens is None else self.turn_tokens


class MultiTurnRollout(NamedTuple):
  """The result of :func:`sample_multiturn` (N = prompts × G rows, row ``b·G + g``), usable wherever a
  ``jaxgrpo.rollout.sampling.Rollout`` is (``jaxgrpo.step.train.Batch.from_rollout`` also reads ``policy_mask``).

  Attributes:
    prompt_tokens: ``int32[N, P]`` left-padded prompts; prompt_mask: ``bool[N, P]``.
    completions: ``int32[N, T]`` the interleaved trajectory, right-padded with the pad id.
    mask: ``bool[N, T]`` real tokens (policy and observation); policy_mask: ``bool[N, T]`` policy tokens.
    log_probs: ``f32[N, T]`` sampling log-probs of the policy tokens, 0 elsewhere.
    group_ids: ``int32[N]``; num_steps: None.
    rewards: ``f32[N]`` the sum of each trajectory's step rewards.
    turns: ``int32[N]`` policy turns per trajectory.
    metrics: ``{name: f32[N]}`` per trajectory: ``tool_calls``, ``tool_errors``, ``tool_s``,
      ``env_errors`` (exceptions raised by ``step``), ``truncated`` (ended by ``max_tokens``), plus any
      metric the environment reports.
  """

  prompt_tokens: np.ndarray
  prompt_mask: np.ndarray
  completions: np.ndarray
  mask: np.ndarray
  log_probs: np.ndarray
  group_ids: np.ndarray
  num_steps: None
  policy_mask: np.ndarray
  rewards: np.ndarray
  turns: np.ndarray
  metrics: dict


#: the per-trajectory metrics every rollout reports (zeros when nothing happened)
BASE_METRICS = (*METRIC_NAMES, "env_errors", "env_timeouts", "truncated")


@dataclasses.dataclass(eq=False)
class Trajectory:
  """One trajectory between turns (host side): its environment, its rendered prompt, the stop ids of its
  turns, and what it holds so far. :func:`sample_multiturn` runs a batch of them to the end; partial
  rollouts (``jaxgrpo.rollout.partial_env``) keep them across weight updates.

  Attributes:
    tokens: the interleaved trajectory after the prompt (policy and observation token ids).
    policy: per token, whether the policy sampled it; logp: per token, its sampling log-prob (0 on
      observations); version: per token, the policy version of the turn that sampled it or that it follows.
    reward: the sum of the step rewards (float32, summed as the steps come); turns: policy turns so far.
    metrics: per-trajectory sums (:data:`BASE_METRICS`, ``env_errors/<Type>``, the environment's own).
    appended: the observation appended after the last turn (None: none).
    running: the trajectory takes another turn.
  """

  env: Any
  fmt: ChatFormat
  prompt: list
  stop: tuple
  tokens: list = dataclasses.field(default_factory=list)
  policy: list = dataclasses.field(default_factory=list)
  logp: list = dataclasses.field(default_factory=list)
  version: list = dataclasses.field(default_factory=list)
  reward: np.float32 = np.float32(0.0)
  turns: int = 0
  metrics: dict = dataclasses.field(default_factory=lambda: {k: np.float32(0.0) for k in BASE_METRICS})
  appended: list | None = None
  running: bool = True

  def _count(self, name: str, value) -> None:
    self.metrics[name] = np.float32(self.metrics.get(name, np.float32(0.0)) + np.float32(float(value)))

  def add_turn(
    self, ids, lps, *, cfg: MultiTurnConfig, tokenizer, should_stop=None, last_turn: bool, version: int = 0
  ) -> bool:
    """Appends a sampled turn (``ids``/``lps``: its tokens and log-probs, cut to the room left), steps the
    environment with its text, and appends the observation when another turn follows and fits. Returns
    :attr:`running`: False after ``done``, an error, a timeout, the last turn, or when ``max_tokens`` leaves
    no room (``truncated``)."""
    ids = list(ids)[: cfg.max_tokens - len(self.tokens)]
    self.tokens += ids
    self.policy += [True] * len(ids)
    self.logp += list(lps)[: len(ids)]
    self.version += [version] * len(ids)
    self.turns += 1
    self.appended = None
    result, status, error = _step(self.env, _turn_text(self.env, tokenizer, ids), cfg, should_stop)
    if status == "error":
      self._count("env_errors", 1)
      self._count(f"env_errors/{type(error).__name__}", 1)
    elif status == "timeout":
      self._count("env_timeouts", 1)
    self.reward = np.float32(self.reward + np.float32(float(result.reward)))
    for k, v in (result.metrics or {}).items():
      self._count(k, v)
    self.running = False
    if result.done or last_turn:
      return False
    if len(self.tokens) >= cfg.max_tokens:
      self._count("truncated", 1)
      return False
    obs = self.fmt.observation_ids(result.messages, ids)
    if len(self.tokens) + len(obs) >= cfg.max_tokens:  # no room for the observation and a turn after it
      self._count("truncated", 1)
      return False
    self.tokens += obs
    self.policy += [False] * len(obs)
    self.logp += [0.0] * len(obs)
    self.version += [version] * len(obs)
    self.appended = obs
    self.running = True
    return True


def _stop_ids(tokenizer, eos_ids: Sequence[int], stop_at_tool_call: bool) -> tuple[int, ...]:
  ids = list(eos_ids)
  if stop_at_tool_call:
    end = tokenizer.convert_tokens_to_ids(TOOL_CALL_END)
    if isinstance(end, int) and end != tokenizer.unk_token_id and end not in ids:
      ids.append(end)
  return tuple(ids)


def _bucket_rows(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _turn_text(env, tokenizer, ids: Sequence[int]) -> str:
  """The text ``env.step`` receives: the turn decoded with its special tokens kept (default), or without
  them when the environment sets ``skip_special_tokens = True`` (the ids stay as sampled either way)."""
  return tokenizer.decode(list(ids), skip_special_tokens=bool(getattr(env, "skip_special_tokens", False)))


class RolloutInterrupted(Exception):
  """The rollout stopped waiting on an environment call because ``should_stop()`` became true (the trainer's
  SIGTERM/SIGINT): the step is abandoned, nothing of it is trained or saved."""


_LOGGED: set = set()  # (type, file, line) of the environment exceptions already logged in this process


def _call(fn, arg, timeout: float | None, should_stop: Callable[[], bool] | None):
  """``("ok", result)``, ``("error", exception)`` or ``("timeout", None)`` of ``fn(arg)``, run in a daemon
  thread when a ``timeout`` or ``should_stop`` is given (checked every 50 ms; RolloutInterrupted when it
  turns true)."""
  if timeout is None and should_stop is None:
    try:
      return "ok", fn(arg)
    except Exception as e:  # noqa: BLE001
      return "error", e
  box: dict[str, Any] = {}

  def run():
    try:
      box["result"] = fn(arg)
    except BaseException as e:  # noqa: BLE001 — handed to the caller
      box["error"] = e

  thread = threading.Thread(target=run, name="jaxgrpo-env-call", daemon=True)
  thread.start()
  deadline = None if timeout is None else time.monotonic() + timeout
  while True:
    wait = 0.05 if should_stop is not None else max(0.0, deadline - time.monotonic())
    if deadline is not None:
      wait = min(wait, max(0.0, deadline - time.monotonic()))
    thread.join(wait)
    if not thread.is_alive():
      break
    if should_stop is not None and should_stop():
      raise RolloutInterrupted(f"stopped while waiting on {getattr(fn, '__qualname__', fn)!s}")
    if deadline is not None and time.monotonic() >= deadline:
      return "timeout", None
  if "error" in box:
    if not isinstance(box["error"], Exception):
      raise box["error"]  # KeyboardInterrupt, SystemExit: not the environment's fault to count
    return "error", box["error"]
  return "ok", box["result"]


def _log_first(e: BaseException, what: str) -> None:
  """Log an environment exception once per (type, file, line) in this process, with the frame that raised it."""
  frames = traceback.extract_tb(e.__traceback__)
  frame = frames[-1] if frames else None
  where = (frame.filename, frame.lineno) if frame else ("?", 0)
  sig = (type(e).__name__, *where)
  if sig in _LOGGED:
    return
  _LOGGED.add(sig)
  at = f"{where[0]}:{where[1]} in {frame.name}" if frame else "unknown frame"
  log.warning(
    "%s raised %s: %s (at %s); the trajectory ends and counts in env/env_errors — logged once per type and "
    "place (set env.fail_fast: true to stop at it)\n%s",
    what,
    type(e).__name__,
    e,
    at,
    "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip(),
  )


def _step(env, text: str, cfg: MultiTurnConfig, should_stop=None) -> tuple[StepResult, str, BaseException | None]:
  """``(result, status, exception)``; status ``"ok"``, ``"error"`` (``env.step`` raised) or ``"timeout"``
  (it ran past ``cfg.step_timeout``). An error or a timeout ends the trajectory: this step adds reward 0
  and the rewards of the earlier steps stand."""
  status, out = _call(env.step, text, cfg.step_timeout, should_stop)
  if status == "error":
    if cfg.fail_fast:
      raise out
    _log_first(out, f"{type(env).__name__}.step")
  if status != "ok":
    return StepResult((), 0.0, True, {}), status, out
  if not isinstance(out, StepResult):
    out = StepResult(*out)
  return out, "ok", None


def _reset(env, row, cfg: MultiTurnConfig, should_stop=None):
  status, out = _call(env.reset, row, cfg.step_timeout, should_stop)
  if status == "timeout":
    raise TimeoutError(
      f"{type(env).__name__}.reset did not return within env.step_timeout={cfg.step_timeout} s: there is no "
      "prompt to sample from (raise env.step_timeout, or fix the environment)"
    )
  if status == "error":
    raise out
  return out


def sample_multiturn(
  model,
  rows: Sequence[Mapping[str, Any]],
  make_env: Callable[[Mapping[str, Any]], Any],
  tokenizer,
  sampling,
  env_config: MultiTurnConfig,
  *,
  key,
  temperature: float = 1.0,
  engine=None,
  should_stop: Callable[[], bool] | None = None,
  kv_cache: bool = True,
) -> MultiTurnRollout:
  """G multi-turn trajectories per dataset row (see the module docstring).

  Args:
    model: the policy (``jaxgrpo.step.feed.policy_model``).
    rows: B dataset rows (``env.reset(row)`` gives each prompt; rows of a group must render the same
      prompt — one environment per trajectory, reset with the same row).
    make_env: ``make_env(row) -> Environment``, called once per trajectory.
    tokenizer: a ``transformers`` tokenizer with a chat template (decodes turns, encodes observations).
    sampling: a ``jaxgrpo.rollout.sampling.SamplingConfig`` (``num_samples`` = G, top-k/p,
      ``eos_ids``, ``pad_id``; its ``max_new_tokens`` is ignored: ``env_config`` bounds the tokens).
    env_config: a :class:`MultiTurnConfig`.
    key: PRNG key; turn k samples with ``fold_in(key, k)``.
    temperature: the sampling temperature, the train step's ``TrainConfig.temperature`` (its
      log-probs refer to it).
    engine: an :class:`~jaxgrpo.rollout.engines.Engine` to sample the turns with (None: ``jaxgrpo.rollout.sampling.generate``
      on ``model``). Each turn sends ``prompt ‖ trajectory`` to ``engine.generate`` as token ids (never
      re-tokenised text); the engine's sampled-token log-probs fill ``log_probs`` on the policy tokens. The
      caller pushes the weights first (``multiturn_iteration`` does).
    should_stop: polled (every 50 ms) while an environment call runs: when it returns True the rollout
      raises :class:`RolloutInterrupted` (the trainer's first SIGTERM/SIGINT stops a run whose environment
      hangs). None: not polled.
    kv_cache: sample with ``jaxgrpo.rollout.conversation.ConversationSampler`` (default): one KV cache per
      rollout, kept across turns — each observation is prefilled onto it and decoding continues — instead of
      re-prefilling ``prompt ‖ trajectory`` every turn (False, the former path). Same tokens and log-probs up
      to float32 rounding for the same key. Not used with an ``engine``, nor when groups' stop ids give
      different suppressed ids (a pad id that is a stop id of some groups only): those re-prefill.

  Returns:
    A :class:`MultiTurnRollout` (NumPy arrays).
  """
  if not isinstance(env_config, MultiTurnConfig):
    raise TypeError(f"env_config must be a MultiTurnConfig; got {type(env_config).__name__}")
  if not rows:
    raise ValueError("`rows` is empty: sample_multiturn needs at least one dataset row")
  g, n = sampling.num_samples, len(rows) * sampling.num_samples
  envs = [make_env(row) for row in rows for _ in range(g)]
  trs = [
    tr
    for b, row in enumerate(rows)
    for tr in start_group(envs[b * g : (b + 1) * g], row, b, tokenizer, sampling.eos_ids, env_config, should_stop)
  ]
  t_max, per_turn = env_config.max_tokens, env_config.per_turn
  prompts, stops = [tr.prompt for tr in trs], [tr.stop for tr in trs]
  p_max = max(len(p) for p in prompts)
  width = context_width(p_max, env_config, model.config.max_position_embeddings)
  running = list(range(n))
  suppress = {_suppressed_ids(sampling.suppress_ids, sampling.pad_id, s, model.config.vocab_size) for s in stops}
  conv = None
  if kv_cache and engine is None and len(suppress) == 1:
    # every token of a trajectory after the prompt fits: p_max + t_max tokens, the last never fed
    conv = ConversationSampler(
      model, prompts, sampling, max_len=p_max + t_max - 1, temperature=temperature, suppress_eos=stops[0]
    )

  def cached_turn(batches):
    budgets = {i: min(per_turn, t_max - len(trs[i].tokens)) for _, rows_now in batches for i in rows_now}
    appended = {i: trs[i].appended for i in running if trs[i].appended is not None}
    got = conv.turn(
      batches, max_new_tokens=per_turn, appended=appended, budgets=budgets, stop_ids={i: stops[i] for i in running}
    )
    return {i: (tok_i, np.ones(len(tok_i), bool), lps_i) for i, (tok_i, lps_i) in got.items()}

  for turn in range(env_config.max_turns):
    if not running:
      break
    batches = turn_batches(running, stops, jax.random.fold_in(key, turn))
    if conv is not None:  # one call for every stop set: the keys draw as the separate calls below would
      sampled = cached_turn(batches)
    else:
      sampled = {}
      for turn_key, rows_now in batches:
        sampled.update(
          sample_turn(model, trs, rows_now, turn_key, sampling, per_turn, width, temperature=temperature, engine=engine)
        )
    last = turn == env_config.max_turns - 1
    for i in running:
      tok_i, mask_i, lps_i = sampled[i]
      trs[i].add_turn(
        tok_i[mask_i].tolist(),
        lps_i[mask_i].tolist(),
        cfg=env_config,
        tokenizer=tokenizer,
        should_stop=should_stop,
        last_turn=last,
      )
    running = [i for i in running if trs[i].running]
  return assemble(trs, g, t_max, sampling.pad_id)


def start_group(envs, row, group: int, tokenizer, eos_ids, cfg: MultiTurnConfig, should_stop=None) -> list[Trajectory]:
  """The G trajectories of one group: each environment of ``envs`` reset with ``row`` (within
  ``cfg.step_timeout``), the prompts rendered with the group's tools (they must agree), the turns' stop ids."""
  fmt = ChatFormat(tokenizer, tools=getattr(envs[0], "tools", None))
  prompts = [fmt.prompt_ids(_reset(env, row, cfg, should_stop)) for env in envs]
  if any(p != prompts[0] for p in prompts):
    raise ValueError(f"env.reset gave different prompts within group {group}: a group must share its prompt")
  at_tool = bool(fmt.tools) if cfg.stop_at_tool_call is None else cfg.stop_at_tool_call
  stop = _stop_ids(tokenizer, eos_ids, at_tool)
  return [Trajectory(env, fmt, p, stop) for env, p in zip(envs, prompts)]


def context_width(p_max: int, cfg: MultiTurnConfig, limit: int) -> int:
  """The re-prefill context width of prompts up to ``p_max`` tokens: ``p_max + max_tokens`` rounded up to a
  multiple of 64 (few compiled shapes) while a turn still fits the model's ``limit`` positions."""
  width = -(-(p_max + cfg.max_tokens) // 64) * 64
  if width + cfg.per_turn > limit:
    width = p_max + cfg.max_tokens
    if width + cfg.per_turn > limit:
      raise ValueError(
        f"prompt ({p_max}) + env.max_tokens ({cfg.max_tokens}) + turn tokens ({cfg.per_turn}) exceed the model's "
        f"max_position_embeddings ({limit})"
      )
  return width


def turn_batches(rows: Sequence[int], stops: Sequence[tuple], turn_key) -> list[tuple[Any, list[int]]]:
  """The running rows split by their stop ids (one sampler call per stop set, one unless groups mix tools):
  ``[(key, rows)]``, the first set sampled with ``turn_key``, set j with ``fold_in(turn_key, j)``."""
  by_stop: dict[tuple[int, ...], list[int]] = {}
  for i in rows:
    by_stop.setdefault(stops[i], []).append(i)
  return [(turn_key if j == 0 else jax.random.fold_in(turn_key, j), r) for j, r in enumerate(by_stop.values())]


def sample_turn(model, trs, rows_now, turn_key, sampling, per_turn, width, *, temperature, engine=None) -> dict:
  """One turn of the trajectories ``trs[i]``, ``i`` in ``rows_now`` (one stop set), re-prefilled: ``prompt ‖
  trajectory`` left-padded to ``width``, the row count rounded up to a power of two (copies of the first row,
  discarded); sampled by ``generate`` on ``model`` or by ``engine``. Returns ``{i: (tokens, mask, log-probs)}``
  (NumPy rows of ``per_turn``)."""
  rows_padded = rows_now + [rows_now[0]] * (_bucket_rows(len(rows_now)) - len(rows_now))
  ctx, ctx_mask = pad_left([trs[i].prompt + trs[i].tokens for i in rows_padded], width, sampling.pad_id)
  turn_sampling = dataclasses.replace(
    sampling,
    num_samples=1,
    max_new_tokens=per_turn,
    eos_ids=trs[rows_now[0]].stop,
    merge_lora=False,
    record_routing=False,
  )
  if engine is None:
    out = generate(model, ctx, ctx_mask, turn_sampling, key=turn_key, temperature=temperature)
  else:
    out = engine.generate(ctx, ctx_mask, turn_sampling, key=turn_key, temperature=temperature).rollout
  got = jax.device_get((out.completions, out.mask, out.log_probs))
  return {i: tuple(np.asarray(x)[j] for x in got) for j, i in enumerate(rows_now)}


def assemble(trs: Sequence[Trajectory], g: int, t_max: int, pad_id: int) -> MultiTurnRollout:
  """The :class:`MultiTurnRollout` of trajectories ``trs`` (G per group, in group order; right-padded to
  ``t_max``); a metric absent from a trajectory is 0 there."""
  n = len(trs)
  p_tok, p_mask = pad_left([tr.prompt for tr in trs], max(len(tr.prompt) for tr in trs), pad_id)
  comp = np.full((n, t_max), pad_id, np.int32)
  mask, pmask = np.zeros((n, t_max), bool), np.zeros((n, t_max), bool)
  lp = np.zeros((n, t_max), np.float32)
  for i, tr in enumerate(trs):
    k = len(tr.tokens)
    comp[i, :k], mask[i, :k], pmask[i, :k], lp[i, :k] = tr.tokens, True, tr.policy, tr.logp
  names = list(BASE_METRICS) + sorted({k for tr in trs for k in tr.metrics} - set(BASE_METRICS))
  metrics = {k: np.asarray([tr.metrics.get(k, 0.0) for tr in trs], np.float32) for k in names}
  rewards = np.asarray([tr.reward for tr in trs], np.float32)
  turns = np.asarray([tr.turns for tr in trs], np.int32)
  gids = np.repeat(np.arange(n // g, dtype=np.int32), g)
  return MultiTurnRollout(p_tok, p_mask, comp, mask, lp, gids, None, pmask, rewards, turns, metrics)


def rollout_metrics(rollout: MultiTurnRollout, seconds: float | None = None) -> dict[str, float]:
  """Per-trajectory means of a rollout's turn metrics: ``env/turns``, ``env/tool_calls``,
  ``env/tool_errors``, ``env/tool_s``, ``env/env_errors``, ``env/truncated`` (and the environment's
  own), plus ``env/policy_tokens`` and ``env/observation_tokens``; ``env/rollout_s`` when given."""
  out = {"env/turns": float(np.mean(rollout.turns))}
  out.update({f"env/{k}": float(np.mean(v)) for k, v in rollout.metrics.items()})
  out["env/policy_tokens"] = float(rollout.policy_mask.sum(1).mean())
  out["env/observation_tokens"] = float((rollout.mask & ~rollout.policy_mask).sum(1).mean())
  if seconds is not None:
    out["env/rollout_s"] = float(seconds)
  return out
