"""The multi-turn rollout: the policy and its environments take turns until every trajectory ends.

For N = prompts × G trajectories (one environment each, ``make_env(row)``)::

    prompt_i = ChatFormat.prompt_ids(env_i.reset(row))          # rendered with tools=env.tools
    repeat (at most max_turns times), over the trajectories still running, batched:
      turn_i  = sample(policy, prompt_i ‖ traj_i)                # until EOS / </tool_call> / turn_tokens
      traj_i += turn_i                                           # policy tokens, kept as sampled
      result  = env_i.step(decode(turn_i))                       # host side, the turn's calls concurrent
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

One job at ~690 lines: the multi-turn rollout loop — trajectories and their token accounting, the environments'
calls (concurrent, with timeouts, failures and stops) and the assembly of the batch; the cached sampler is
``jaxgrpo.rollout.conversation``, the chat rendering ``environments.chat``.
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

from jaxgrpo import _checks
from jaxgrpo.data import pad_left
from jaxgrpo.rollout.conversation import ConversationSampler
from jaxgrpo.rollout.environments.base import StepResult
from jaxgrpo.rollout.environments.chat import ChatFormat
from jaxgrpo.rollout.environments.tools import TOOL_CALL_END
from jaxgrpo.rollout.sampling import SamplingPolicy, cache_slots, generate
from jaxgrpo.rollout.speculative import SpeculativeStats, generate_speculative

__all__ = [
  "MultiTurnConfig",
  "MultiTurnRollout",
  "EnvironmentFailed",
  "EnvironmentTimeout",
  "RolloutInterrupted",
  "Trajectory",
  "add_turns",
  "assemble",
  "call_all",
  "policy_turn",
  "quantized_turns",
  "rollout_metrics",
  "sample_multiturn",
  "sample_turn",
  "start_groups",
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
    step_timeout: seconds an ``env.reset`` or ``env.step`` call may take (None: no bound). The calls of a turn
      (and the resets of a rollout) run concurrently in daemon threads, at most ``workers`` at once, so a turn
      waits at most ``step_timeout × ⌈calls / workers⌉`` seconds in all (one ``step_timeout`` when every
      call has a thread), however many calls hang. A step past the bound ends its trajectory (rewards so far
      stand), counts in ``env_timeouts`` and is logged the first time per environment class (naming the
      trajectory's row); a reset past it raises ``TimeoutError`` (there is no prompt to train on). Python
      cannot kill a thread: the abandoned call runs on in the background and keeps its thread, which counts
      against ``workers`` until the call returns — so the threads of a process stay at most ``workers``
      however many calls time out (the sandbox's tools run in subprocesses, which their own limits kill).
    workers: the most environment calls running at once in this process (threads, abandoned calls included;
      >= 1; 32). 1: one call at a time, as an environment that shares state between its instances unlocked needs.
      Each running call may hold a process of its own (the sandbox's code tool): at most ``workers`` at once.
    fail_fast: re-raise the first exception an environment raises (with its traceback), for debugging,
      instead of ending the trajectory and counting it in ``env_errors``.
  """

  max_turns: int = 4
  max_tokens: int = 256
  turn_tokens: int | None = None
  stop_at_tool_call: bool | None = None
  step_timeout: float | None = 30.0
  workers: int = 32
  fail_fast: bool = False

  def __post_init__(self):
    for name in ("max_turns", "max_tokens", "workers"):
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
  rollouts (``jaxgrpo.loop.partial.env``) keep them across weight updates.

  Attributes:
    tokens: the interleaved trajectory after the prompt (policy and observation token ids).
    policy: per token, whether the policy sampled it; logp: per token, its sampling log-prob (0 on
      observations); version: per token, the policy version of the turn that sampled it or that it follows.
    reward: the sum of the step rewards (float32, summed as the steps come); turns: policy turns so far.
    metrics: per-trajectory sums (:data:`BASE_METRICS`, ``env_errors/<Type>``, the environment's own).
    appended: the observation appended after the last turn (None: none).
    running: the trajectory takes another turn.
    where: which trajectory this is, for the log (``start_group``: ``"trajectory j of group b (row {...})"``).
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
  where: str = ""

  def _count(self, name: str, value) -> None:
    self.metrics[name] = np.float32(self.metrics.get(name, np.float32(0.0)) + np.float32(float(value)))

  def add_turn(
    self, ids, lps, *, cfg: MultiTurnConfig, tokenizer, should_stop=None, last_turn: bool, version: int = 0
  ) -> bool:
    """Appends a sampled turn (``ids``/``lps``: its tokens and log-probs, cut to the room left), steps the
    environment with its text, and appends the observation when another turn follows and fits. Returns
    :attr:`running`: False after ``done``, an error, a timeout, the last turn, or when ``max_tokens`` leaves
    no room (``truncated``). One trajectory of :func:`add_turns`."""
    return add_turns(
      [self],
      [(ids, lps)],
      cfg=cfg,
      tokenizer=tokenizer,
      should_stop=should_stop,
      last_turn=[last_turn],
      version=version,
    )[0]

  def _append_turn(self, ids, lps, cfg: MultiTurnConfig, version: int) -> list:
    """The sampled turn appended (cut to the room left); returns its ids."""
    ids = list(ids)[: cfg.max_tokens - len(self.tokens)]
    self.tokens += ids
    self.policy += [True] * len(ids)
    self.logp += list(lps)[: len(ids)]
    self.version += [version] * len(ids)
    self.turns += 1
    self.appended = None
    return ids

  def _end_turn(self, ids, result: StepResult, status: str, error, cfg: MultiTurnConfig, last_turn: bool, version):
    """The environment's answer to the turn ``ids`` counted and its observation appended (see add_turn)."""
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


def policy_turn(sample) -> tuple[list, list]:
  """``(ids, log-probs)`` of a sampled row ``(tokens, mask, log_probs)`` (``sample_turn``'s), its masked tokens."""
  tokens, mask, lps = sample
  return tokens[mask].tolist(), lps[mask].tolist()


def add_turns(
  trs: Sequence[Trajectory], turns, *, cfg: MultiTurnConfig, tokenizer, should_stop=None, last_turn, version: int = 0
) -> list[bool]:
  """One turn of each trajectory of ``trs``: ``turns[i] = (ids, log-probs)`` appended to ``trs[i]``, the
  environments stepped with their texts **concurrently** (:func:`call_all`: at most ``cfg.workers`` threads,
  the turn bounded as a whole by ``cfg.step_timeout``), and each observation appended when another turn
  follows (``last_turn[i]`` False) and fits. Returns each trajectory's :attr:`Trajectory.running`.
  ``cfg.fail_fast`` re-raises the first environment exception (in trajectory order) once every call ended."""
  ids = [tr._append_turn(i, lp, cfg, version) for tr, (i, lp) in zip(trs, turns)]
  calls = [(tr.env.step, _turn_text(tr.env, tokenizer, i)) for tr, i in zip(trs, ids)]
  outcomes = call_all(calls, timeout=cfg.step_timeout, workers=cfg.workers, should_stop=should_stop)
  for tr, (status, out) in zip(trs, outcomes):
    if status == "error":
      if cfg.fail_fast:
        raise out
      _log_first(out, f"{type(tr.env).__name__}.step")
    elif status == "timeout":
      _log_timeout(tr, out, cfg)
  running = []
  for tr, i, (status, out), last in zip(trs, ids, outcomes, last_turn):
    result = _step_result(out) if status == "ok" else StepResult((), 0.0, True, {})
    running.append(tr._end_turn(i, result, status, out if status == "error" else None, cfg, last, version))
  return running


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
_TIMEOUTS_LOGGED: set = set()  # environment classes whose first timeout was logged in this process

#: the environment-call threads of this process still running, abandoned (timed-out) calls included; a call
#: starts only while fewer than its ``workers`` run, so they stay bounded however many calls hang
_LIVE: set = set()
_LIVE_CHANGED = threading.Condition()


#: the reason of a call that found no free thread until its turn's time was up
_NO_THREAD = (
  "it never started: all env.workers={workers} environment threads were held by earlier calls still running, "
  "calls that timed out among them (an environment that hangs holds its threads until it returns)"
)


class EnvironmentFailed(RuntimeError):
  """An environment could not be made or reset (``env.factory`` or ``reset`` raised): there is no prompt to
  sample from. The message is one line naming the call, the exception and the row; the original exception is
  the ``__cause__`` (its traceback is the user's)."""


class EnvironmentTimeout(EnvironmentFailed, TimeoutError):
  """A ``reset`` did not return (or could not start) within ``env.step_timeout``: no prompt to sample from."""


def _short(row, limit: int = 160) -> str:
  text = repr(dict(row)) if isinstance(row, Mapping) else repr(row)
  return text if len(text) <= limit else text[: limit - 3] + "..."


def _run_call(fn, arg, box: dict) -> None:
  """The body of one environment-call thread: ``fn(arg)`` into ``box``; leaves :data:`_LIVE` when it ends."""
  try:
    box["result"] = fn(arg)
  except BaseException as e:  # noqa: BLE001 — handed to the caller
    box["error"] = e
  finally:
    with _LIVE_CHANGED:
      _LIVE.discard(threading.current_thread())
      box["done"] = True
      _LIVE_CHANGED.notify_all()


def _outcome(box: dict) -> tuple[str, Any]:
  if "error" in box:
    if not isinstance(box["error"], Exception):
      raise box["error"]  # KeyboardInterrupt, SystemExit: not the environment's fault to count
    return "error", box["error"]
  return "ok", box["result"]


def call_all(calls, *, timeout: float | None, workers: int, should_stop: Callable[[], bool] | None = None):
  """``fn(arg)`` for each ``(fn, arg)`` of ``calls``, concurrently → ``[(status, value)]`` in order: ``("ok",
  result)``, ``("error", exception)`` or ``("timeout", reason)``.

  Each call runs in a daemon thread named ``jaxgrpo-env-call``; a call starts only while fewer than ``workers``
  such threads are alive in this process (:data:`_LIVE`: an abandoned call keeps its thread until it returns,
  so threads never exceed ``workers``). A call times out ``timeout`` seconds after it started, and every call
  not done ``timeout × ⌈len(calls) / workers⌉`` seconds after this function began times out too (also one
  that could not start: every thread held by a hung call) — the wall time is bounded as a whole. A call that
  times out is abandoned (Python cannot stop a thread). ``should_stop`` is polled every 50 ms:
  :class:`RolloutInterrupted` when it turns true. KeyboardInterrupt/SystemExit raised by a call are re-raised.
  """
  results: list[Any] = [None] * len(calls)
  queue = list(range(len(calls)))[::-1]  # popped from the end: in order
  running: dict[int, tuple[float, dict]] = {}
  t0 = time.monotonic()
  turn_end = None if timeout is None else t0 + timeout * math.ceil(len(calls) / workers)
  with _LIVE_CHANGED:
    while queue or running:
      now = time.monotonic()
      while queue and len(_LIVE) < workers:
        i = queue.pop()
        box: dict[str, Any] = {}
        thread = threading.Thread(target=_run_call, args=(*calls[i], box), name="jaxgrpo-env-call", daemon=True)
        _LIVE.add(thread)
        thread.start()
        running[i] = (now, box)
      for i, (start, box) in list(running.items()):
        if box.get("done"):
          results[i] = _outcome(box)
          del running[i]
        elif timeout is not None and now >= min(start + timeout, turn_end):
          results[i] = ("timeout", f"still running after {now - start:.1f} s")
          del running[i]
      if turn_end is not None and now >= turn_end:
        for i in queue:
          results[i] = ("timeout", _NO_THREAD.format(workers=workers))
        queue = []
      if not (queue or running):
        break
      if should_stop is not None and should_stop():
        fn = calls[next(iter(running), queue[-1] if queue else 0)][0]
        raise RolloutInterrupted(f"stopped while waiting on {getattr(fn, '__qualname__', fn)!s}")
      wake = [] if timeout is None else [turn_end, *(start + timeout for start, _ in running.values())]
      wait = max(0.0, min(wake) - now) if wake else None
      if should_stop is not None:
        wait = 0.05 if wait is None else min(wait, 0.05)
      _LIVE_CHANGED.wait(wait)
  return results


def _log_timeout(tr: Trajectory, reason: str, cfg: MultiTurnConfig) -> None:
  """Log an environment's first step timeout in this process (per class), naming the trajectory and its row."""
  name = type(tr.env).__name__
  if name in _TIMEOUTS_LOGGED:
    return
  _TIMEOUTS_LOGGED.add(name)
  log.warning(
    "%s.step of %s did not return within env.step_timeout=%s s (%s): the trajectory ends (its rewards so far "
    "stand; counted in env/env_timeouts) and the call is abandoned, its thread running on (at most env.workers=%d "
    "environment threads at once) — logged the first time per environment class; raise env.step_timeout or fix "
    "the environment",
    name,
    tr.where or "a trajectory",
    cfg.step_timeout,
    reason,
    cfg.workers,
  )


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


def _step_result(out) -> StepResult:
  return out if isinstance(out, StepResult) else StepResult(*out)


def make_envs(make_env: Callable, row, count: int, group: int) -> list:
  """``count`` environments ``make_env(row)`` of group ``group``; :class:`EnvironmentFailed` (one line naming the
  factory, the exception and the row) when the factory raises."""
  try:
    return [make_env(row) for _ in range(count)]
  except Exception as e:
    name = getattr(make_env, "__qualname__", type(make_env).__name__)
    raise EnvironmentFailed(
      f"the environment factory {name}(row) raised {type(e).__name__}: {e} (group {group}, row {_short(row)})"
    ) from e


def reset_all(envs, rows, cfg: MultiTurnConfig, should_stop=None) -> list:
  """``envs[i].reset(rows[i])`` for every i, concurrently (:func:`call_all`): the initial messages.
  :class:`EnvironmentTimeout` (a ``TimeoutError`` naming the bound and the row) when one ran past
  ``cfg.step_timeout``; :class:`EnvironmentFailed` when one raised (the exception as its cause)."""
  outcomes = call_all(
    [(env.reset, row) for env, row in zip(envs, rows)],
    timeout=cfg.step_timeout,
    workers=cfg.workers,
    should_stop=should_stop,
  )
  for env, row, (status, out) in zip(envs, rows, outcomes):
    name = type(env).__name__
    if status == "timeout":
      what = "did not run" if out.startswith("it never started") else "did not return"
      raise EnvironmentTimeout(
        f"{name}.reset {what} within env.step_timeout={cfg.step_timeout} s ({out}; row {_short(row)}): "
        "there is no prompt to sample from (fix the environment, or raise env.step_timeout / env.workers)"
      )
    if status == "error":
      raise EnvironmentFailed(f"{name}.reset raised {type(out).__name__}: {out} (row {_short(row)})") from out
  return [out for _, out in outcomes]


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
  speculative=None,
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
    speculative: None, or a ``jaxgrpo.rollout.speculative.SpeculativeSwitch`` (the built-in engine's
      ``rollout.speculative``; not with an ``engine``): the policy's turns are decoded by exact speculative
      decoding when the switch says so (``mode_now``) — the cached sampler by verify steps
      (``ConversationSampler(speculative=, draft_model=)``: prompt lookup, or the switch's draft model, whose own
      KV cache is kept beside the policy's across turns), the re-prefill path by ``generate_speculative`` each
      turn. Drafting stops at each turn's end; observation tokens are appended, never drafted. The rollout is one call of the switch (``observe``: policy tokens over the sampler's
      seconds, the environments' time excluded; ``auto`` decides on it; ``switch.metrics`` says what ran).

  With ``sampling.quantize`` (int8 / fp8) and no ``engine``, every turn samples the quantised copy of ``model``
  made once at the start (:func:`quantized_turns`): the policy tokens' ``log_probs`` are that policy's (μ), so the
  learner recomputes ``old_logp`` (``multiturn_iteration``, the trainer's rollout source) and TIS/MIS correct it.

  Returns:
    A :class:`MultiTurnRollout` (NumPy arrays).
  """
  if not isinstance(env_config, MultiTurnConfig):
    raise TypeError(f"env_config must be a MultiTurnConfig; got {type(env_config).__name__}")
  if not rows:
    raise ValueError("`rows` is empty: sample_multiturn needs at least one dataset row")
  model, sampling = quantized_turns(model, sampling, engine)
  g, n = sampling.num_samples, len(rows) * sampling.num_samples
  groups = [(make_envs(make_env, row, g, b), row, b) for b, row in enumerate(rows)]
  trs = start_groups(groups, tokenizer, sampling.eos_ids, env_config, should_stop)
  t_max, per_turn = env_config.max_tokens, env_config.per_turn
  prompts, stops = [tr.prompt for tr in trs], [tr.stop for tr in trs]
  p_max = max(len(p) for p in prompts)
  width = context_width(p_max, env_config, model.config.max_position_embeddings)
  running = list(range(n))
  vocab = model.config.vocab_size
  suppress = {
    SamplingPolicy.from_config(sampling, temperature=temperature, vocab_size=vocab, stop_ids=s).suppress_ids
    for s in stops
  }
  mode = "plain" if speculative is None or engine is not None else speculative.mode_now()
  spec = None if mode == "plain" else (speculative.config, speculative.draft_model)
  stats, sampler_s = np.zeros(3, np.int64), 0.0  # verify steps, drafted, accepted; seconds in the sampler
  conv = None
  if kv_cache and engine is None and len(suppress) == 1:
    # every token of a trajectory after the prompt fits: p_max + t_max tokens, the last never fed
    conv = ConversationSampler(
      model, prompts, sampling, max_len=cache_slots(p_max, t_max), temperature=temperature, suppress_eos=stops[0],
      speculative=None if spec is None else spec[0], draft_model=None if spec is None else spec[1],
    )  # fmt: skip

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
    t0 = time.perf_counter()
    if conv is not None:  # one call for every stop set: the keys draw as the separate calls below would
      sampled = cached_turn(batches)
    else:
      sampled = {}
      for turn_key, rows_now in batches:
        sampled.update(
          sample_turn(
            model,
            trs,
            rows_now,
            turn_key,
            sampling,
            per_turn,
            width,
            temperature=temperature,
            engine=engine,
            speculative=spec,
            stats=stats,
          )  # fmt: skip
        )
    sampler_s += time.perf_counter() - t0
    last = turn == env_config.max_turns - 1
    add_turns(
      [trs[i] for i in running],
      [policy_turn(sampled[i]) for i in running],
      cfg=env_config,
      tokenizer=tokenizer,
      should_stop=should_stop,
      last_turn=[last] * len(running),
    )
    running = [i for i in running if trs[i].running]
  out = assemble(trs, g, t_max, sampling.pad_id)
  if speculative is not None and engine is None:
    counted = stats if conv is None or conv.speculative is None else conv.stats
    spec_stats = None if spec is None else SpeculativeStats(*(np.int64(c) for c in counted))
    speculative.observe(mode, float(out.policy_mask.sum()) / max(sampler_s, 1e-9), spec_stats)
  return out


def quantized_turns(model, sampling, engine):
  """``(model, sampling)`` the turns sample with: without an ``engine`` and with ``sampling.quantize``, the
  quantised copy ``sampling.model_to_sample(model)`` made once for the whole rollout (from the current arrays,
  adapters merged) and ``sampling`` with ``quantize`` cleared (the turns' samplers must not quantise it again);
  else both unchanged (an engine quantises what it is pushed: the collective sampler's ``generate``)."""
  if engine is not None or sampling.quantize is None:
    return model, sampling
  return sampling.model_to_sample(model), dataclasses.replace(sampling, quantize=None, merge_lora=False)


def start_group(envs, row, group: int, tokenizer, eos_ids, cfg: MultiTurnConfig, should_stop=None) -> list[Trajectory]:
  """The G trajectories of one group: each environment of ``envs`` reset with ``row`` (within
  ``cfg.step_timeout``), the prompts rendered with the group's tools (they must agree), the turns' stop ids."""
  return start_groups([(envs, row, group)], tokenizer, eos_ids, cfg, should_stop)


def start_groups(groups, tokenizer, eos_ids, cfg: MultiTurnConfig, should_stop=None) -> list[Trajectory]:
  """The trajectories of ``groups`` (``[(envs, row, group index)]``, in order): every environment reset with its
  group's row, all concurrently (:func:`reset_all`), then each group as :func:`start_group` describes."""
  flat = [(env, row) for envs, row, _ in groups for env in envs]
  messages = iter(reset_all([e for e, _ in flat], [r for _, r in flat], cfg, should_stop))
  trs = []
  for envs, row, group in groups:
    fmt = ChatFormat(tokenizer, tools=getattr(envs[0], "tools", None))
    prompts = [fmt.prompt_ids(next(messages)) for _ in envs]
    if any(p != prompts[0] for p in prompts):
      raise ValueError(f"env.reset gave different prompts within group {group}: a group must share its prompt")
    at_tool = bool(fmt.tools) if cfg.stop_at_tool_call is None else cfg.stop_at_tool_call
    stop = _stop_ids(tokenizer, eos_ids, at_tool)
    where = [f"trajectory {j} of group {group} (row {_short(row)})" for j in range(len(envs))]
    trs += [Trajectory(env, fmt, p, stop, where=w) for env, p, w in zip(envs, prompts, where)]
  return trs


def context_width(p_max: int, cfg: MultiTurnConfig, limit: int) -> int:
  """The re-prefill context width of prompts up to ``p_max`` tokens: ``p_max + max_tokens`` rounded up to a
  multiple of 64 (few compiled shapes) while a turn still fits the model's ``limit`` positions."""
  width = -(-(p_max + cfg.max_tokens) // 64) * 64
  if width + cfg.per_turn > limit:
    width = p_max + cfg.max_tokens
    _checks.check_positions(
      [(f"prompt {p_max}", p_max), (f"env.max_tokens {cfg.max_tokens}", cfg.max_tokens)]
      + [(f"turn tokens {cfg.per_turn}", cfg.per_turn)],
      limit,
      "the model (max_position_embeddings)",
      "lower env.max_tokens or env.turn_tokens, or shorten the prompts",
    )
  return width


def turn_batches(rows: Sequence[int], stops: Sequence[tuple], turn_key) -> list[tuple[Any, list[int]]]:
  """The running rows split by their stop ids (one sampler call per stop set, one unless groups mix tools):
  ``[(key, rows)]``, the first set sampled with ``turn_key``, set j with ``fold_in(turn_key, j)``."""
  by_stop: dict[tuple[int, ...], list[int]] = {}
  for i in rows:
    by_stop.setdefault(stops[i], []).append(i)
  return [(turn_key if j == 0 else jax.random.fold_in(turn_key, j), r) for j, r in enumerate(by_stop.values())]


def sample_turn(
  model, trs, rows_now, turn_key, sampling, per_turn, width, *, temperature, engine=None, speculative=None, stats=None
) -> dict:
  """One turn of the trajectories ``trs[i]``, ``i`` in ``rows_now`` (one stop set), re-prefilled: ``prompt ‖
  trajectory`` left-padded to ``width``, the row count rounded up to a power of two (copies of the first row,
  discarded); sampled by ``generate`` on ``model``, by ``generate_speculative`` with ``speculative = (config,
  draft model or None)`` (its verify steps, drafted and accepted counts added to ``stats int64[3]``), or by
  ``engine``. Returns ``{i: (tokens, mask, log-probs)}`` (NumPy rows of ``per_turn``)."""
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
  if engine is None and speculative is not None:
    out, st = generate_speculative(
      model, ctx, ctx_mask, turn_sampling, key=turn_key, temperature=temperature, speculative=speculative[0],
      draft_model=speculative[1], counted=np.arange(len(rows_padded)) < len(rows_now),
    )  # fmt: skip
    stats += np.asarray(jax.device_get(tuple(st)), np.int64)
  elif engine is None:
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
