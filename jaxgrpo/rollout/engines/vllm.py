"""vLLM behind the :class:`~jaxgrpo.rollout.engines.base.Engine` interface, colocated in the calling process.

:class:`VLLMEngine` starts from the policy's Hugging Face config alone (``load_format="dummy"``: no
checkpoint on disk, no copy of the weights besides vLLM's own); :meth:`~VLLMEngine.push_weights`
sends every parameter through the exporters' name map (``jaxgrpo.models.hf.hf_entries``; a LoRA
policy merged, NumPy views on CPU) into vLLM's ``reload_weights``, then repacks a tied LM head and
resets the prefix cache, checked (without either, the engine samples from stale weights). Qwen3-MoE / Qwen2-MoE
policies go the same way (one HF tensor per expert, ``...mlp.experts.{e}.gate_proj.weight``, into vLLM's fused-MoE
layers); on CPU their experts are re-prepacked after every push (:func:`_repack_cpu_experts`: vLLM 0.32 skips
that step on a weight update). With ``lora_rank`` a LoRA policy is synced as adapters only (a PEFT directory
and a ``LoRARequest``; the base only when its fingerprint changed) instead of merged.
:meth:`~VLLMEngine.generate` takes token ids (``int32[B, P]``, ``bool[B, P]``) and returns N = B·G
rows, one request per row with a seed drawn from ``key`` (a key gives the same rollout for the same
weights). ``Generation.rollout.log_probs`` follow ``jaxgrpo.rollout.sampling.generate``'s contract,
``log_softmax(logits / temperature)[token]`` over the full vocabulary: vLLM's raw log-probs when
``logprobs_temperature`` is 1 (exact whatever the filters; greedy too), its processed ones otherwise
(exact only without top-k, top-p and suppressed ids, which ``generate`` then requires). vLLM fixes the
log-prob mode when the engine starts, so ``generate`` refuses a temperature other than
``logprobs_temperature`` (greedy, 0, is allowed: its log-probs are at temperature 1 either way). Suppressed ids
get a −100 logit bias; EOS ids stop a row and are kept. ``release_memory``/``reacquire_memory``:
vLLM's sleep mode on a GPU, a prefix-cache reset on CPU. ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set
before vLLM is imported (the engine core runs in this process, so ``collective_rpc`` can take the
weight iterator); vLLM makes ``torch.set_num_threads`` a no-op process-wide. Needs the ``vllm`` extra.

Checked at construction, before vLLM starts: the head size (vLLM's CPU attention takes only
:func:`supported_head_sizes`). Two messages vLLM logs on every start and push of this engine, with correct
results, are filtered (:class:`ExpectedVLLMWarnings`): the chat-template warm-up failing because the engine
has no tokenizer, and "RotaryEmbedding: Failed to load weights" (the rotary tables are computed, not loaded).

docs/sampling.md, "Engines": the weight path step by step, memory on one GPU, installation, tests.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import typing
import warnings
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgrpo import _checks
from jaxgrpo.models import lora
from jaxgrpo.models.hf import StackedEntry, hf_entries
from jaxgrpo.models.registry import family_of, registered
from jaxgrpo.rollout.engines.base import FINISH_REASONS, Generation
from jaxgrpo.rollout.sampling import Rollout, SamplingConfig, SamplingPolicy, check_sampling

__all__ = [
  "INSTALL_HINT",
  "ExpectedVLLMWarnings",
  "VLLMEngine",
  "check_installed",
  "hf_weights",
  "supported_head_sizes",
]

INSTALL_HINT = (
  "vLLM is not installed in this environment: `pip install 'jaxgrpo[vllm]'` (its own environment: vLLM pins "
  "transformers<5.20), or `bash scripts/setup_vllm_venv.sh` and run with `.venv-vllm/bin/python`"
)

DTYPES = ("float32", "bfloat16", "float16")
_SUPPRESS_BIAS = -100.0  # vLLM clamps logit biases to [-100, 100]


def check_installed() -> None:
  """ImportError with the install hint when vLLM cannot be imported (nothing heavy is loaded otherwise)."""
  if importlib.util.find_spec("vllm") is None:
    raise ImportError(INSTALL_HINT)


def supported_head_sizes(on_gpu: bool) -> tuple[int, ...] | None:
  """The head sizes vLLM's CPU attention backend implements (its ``get_supported_head_sizes``: 32, 64, 80, 96,
  112, 128, 160, 192, 224, 256, 512 in vLLM 0.32); None on a GPU (the backend is chosen per GPU) or when
  this vLLM has no such list."""
  if on_gpu:
    return None
  try:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
  except ImportError:
    return None
  return tuple(int(h) for h in CPUAttentionBackend.get_supported_head_sizes())


def check_head_size(config, on_gpu: bool) -> None:
  """ValueError naming ``head_dim`` when vLLM's attention backend has no kernel for the model's head size."""
  sizes = supported_head_sizes(on_gpu)
  if sizes is not None and config.head_dim not in sizes:
    raise ValueError(
      f"`config.head_dim`={config.head_dim} (hidden_size {config.hidden_size} / num_heads {config.num_heads} "
      f"unless set): vLLM's CPU attention supports head sizes {list(sizes)}; pick a model config with one of them"
    )


def check_moe_sizes(config, on_gpu: bool) -> None:
  """ValueError naming ``moe_intermediate_size`` / ``hidden_size`` when a MoE policy's expert sizes are not
  multiples of 32 on CPU: vLLM's CPU grouped-gemm experts need the hidden size in multiples of 32 and pad the
  expert width to one, and the push's repack (:func:`_repack_cpu_experts`) re-lays unpadded experts only."""
  if on_gpu or not family_of(config).experts:
    return
  for name in ("moe_intermediate_size", "hidden_size"):
    value = getattr(config, name)
    if value % 32:
      raise ValueError(
        f"`config.{name}`={value}: vLLM's CPU fused-MoE kernel (pushed weights re-laid by the engine) needs "
        f"{name} a multiple of 32; pick a model config with one"
      )


def _most_fused(config) -> int:
  """The most projections one HF weight tensor of the family's name map holds (3: GPT-2's fused ``c_attn``; 1
  otherwise): a PEFT adapter of that tensor has up to that many times the policy's rank (``lora.save_peft``)."""
  return max(collections.Counter(e.hf_name for e in hf_entries(config) if e.hf_name.endswith(".weight")).values())


class ExpectedVLLMWarnings:
  """A ``logging`` filter for the two warnings vLLM logs on every start / push of :class:`VLLMEngine` whose
  results are correct, and for nothing else from the same loggers:

  - ``vllm.renderers.base``: "Chat template warmup failed" with a traceback whose exception says
    "Tokenizer not available" (the engine runs without a tokenizer: ``skip_tokenizer_init``);
  - ``vllm.model_executor.model_loader.reload.layerwise``: "RotaryEmbedding: Failed to load weights" (the
    rotary tables are buffers computed at start, not checkpoint weights; a push leaves them as they are),
    and "ParallelLMHead: Failed to load weights" only while a model with tied embeddings is pushed (it has
    no ``lm_head.weight``; :meth:`VLLMEngine.push_weights` repacks the head from the embedding right after).

  :meth:`install` adds one instance to each of the two loggers (once per process).
  """

  LOGGERS = ("vllm.renderers.base", "vllm.model_executor.model_loader.reload.layerwise")
  tied_push = False  # set by VLLMEngine.push_weights while a tied model's weights are reloaded

  def filter(self, record) -> bool:
    if record.msg == "Chat template warmup failed":
      exc = record.exc_info[1] if record.exc_info else None
      return not (exc is not None and "Tokenizer not available" in str(exc))
    if record.msg == "%s: Failed to load weights":
      return not (
        record.args == ("RotaryEmbedding",) or (record.args == ("ParallelLMHead",) and ExpectedVLLMWarnings.tied_push)
      )
    return True

  @classmethod
  def install(cls) -> None:
    for name in cls.LOGGERS:
      log = logging.getLogger(name)
      if not any(isinstance(f, cls) for f in log.filters):
        log.addFilter(cls())


def _to_torch(x):
  """A torch tensor sharing ``x``'s memory: NumPy (bfloat16 through a uint16 view) or a jax.Array (DLPack)."""
  import torch

  if isinstance(x, jax.Array):
    return torch.from_dlpack(x)
  if x.dtype == jnp.bfloat16:
    return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
  return torch.from_numpy(x)


def hf_weights(model, *, on_host: bool | None = None) -> Iterator[tuple[str, object]]:
  """``(Hugging Face name, torch tensor)`` for every tensor of ``model`` in HF layout, as ``save_hf`` writes
  them (fused tensors concatenated), without copies where the layout allows.

  A LoRA/QLoRA model is merged first (``models.lora.merge_lora``: ``w + s·A·B``, dequantised). On the host
  (``on_host``; default: when the parameters live on CPU) the HF layout is a NumPy view of each JAX buffer
  (``np.asarray`` shares it; transposes stay views; torch reads them in place); on an accelerator it is
  computed with ``jnp`` and handed over by DLPack. The tensors are read-only views: the receiver copies.
  A tied model has no ``lm_head.weight`` (it is the embedding).
  """
  entries = hf_entries(model.config)
  flat = dict(nnx.to_flat_state(nnx.state(model)))
  if lora.has_adapters(model) or set(flat) - {e.path for e in entries}:  # adapters or quantised weights
    model = lora.merge_lora(model)
    flat = dict(nnx.to_flat_state(nnx.state(model)))
  if on_host is None:
    first = next(iter(flat.values())).get_value()
    on_host = all(d.platform == "cpu" for d in first.devices())
  pieces: dict[str, list] = {}
  for e in entries:
    value = flat[e.path].get_value()
    value = np.asarray(value) if on_host else value
    if isinstance(e, StackedEntry):  # MoE experts [E, ...]: one HF tensor per expert, a view of slice e
      for name, v in zip(e.hf_names, value):
        pieces[name] = [e.to_hf(v)]
      continue
    pieces.setdefault(e.hf_name, []).append(e.to_hf(value))
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    for name, parts in pieces.items():
      if len(parts) == 1:
        tensor = parts[0]
      else:
        tensor = np.concatenate(parts, axis=-1) if on_host else jnp.concatenate(parts, axis=-1)
      yield name, _to_torch(tensor)


def _repack_lm_head(model) -> None:
  """Rebuild the LM head's kernel-format copy from its (tied, just reloaded) weight."""
  head = getattr(model, "lm_head", None)
  method = getattr(head, "quant_method", None)
  if method is not None and hasattr(method, "process_weights_after_loading"):
    method.process_weights_after_loading(head)


def _cpu_experts(layer):
  """The CPU grouped-gemm experts kernel of a fused-MoE layer (vLLM's ``CPUUnquantizedExperts``: it has an
  ``isa`` and prepacks its weights), or None for any other layer / backend."""
  kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
  experts = getattr(kernel, "fused_experts", None)
  if experts is None or not isinstance(getattr(experts, "isa", None), str) or getattr(experts, "_use_zentorch", True):
    return None
  return experts


def _repack_cpu_experts(model) -> int:
  """Prepack every CPU fused-MoE layer's just-reloaded ``w13_weight`` / ``w2_weight`` in place; the number of
  layers repacked.

  vLLM 0.32's ``UnquantizedFusedMoEMethod._setup_kernel`` prepacks the experts into the CPU kernel's
  grouped-gemm layout (``fused_experts.process_weights_after_loading``) only on the first load: on a weight
  update (``moe_kernel`` already built) it copies the checkpoint-layout tensors into the parameters and skips
  the prepack, so the kernel reads unpacked weights as packed ones (log-probs ~10 nats off after the first
  push). This runs the same prepack (``vllm._custom_ops.cpu_prepack_moe_weight``, the kernel's ``isa``) on
  them, which is what the first load computes from the same tensors (checked bit for bit)."""
  from vllm._custom_ops import cpu_prepack_moe_weight

  count = 0
  for layer in model.modules():
    experts = _cpu_experts(layer)
    if experts is None or not hasattr(layer, "w13_weight"):
      continue
    for name in ("w13_weight", "w2_weight"):
      w = getattr(layer, name)
      w.data.copy_(cpu_prepack_moe_weight(w.data, experts.isa))
    count += 1
  return count


def _vllm_lora_rank(rank: int) -> int:
  """The smallest ``max_lora_rank`` vLLM accepts (its ``MaxLoRARanks``) that holds ``rank``."""
  from vllm.config.lora import MaxLoRARanks

  allowed = sorted(int(r) for r in typing.get_args(MaxLoRARanks))
  fits = [r for r in allowed if r >= rank]
  if not fits:
    raise ValueError(f"`lora_rank`={rank}: vLLM's LoRA takes ranks up to {allowed[-1]}; push merged (lora_rank=None)")
  return fits[0]


class VLLMEngine:
  """vLLM in this process, sampling from the weights last pushed (see the module docstring).

  Args:
    config: the policy's model config (``model.config``): GPT-2, Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE.
    dtype: vLLM's compute and weight dtype, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
    max_model_len: the longest prompt + completion (default: ``config.max_position_embeddings``).
    kv_cache_bytes: the KV cache size in bytes (CPU; default 256 MiB). None on a GPU: ``gpu_memory_utilization``.
    gpu_memory_utilization: vLLM's share of the GPU's memory (ignored on CPU).
    max_num_seqs: the most sequences vLLM decodes at once (continuous batching).
    enforce_eager: run the model eagerly (no torch.compile / CUDA graphs): faster start-up.
    logprobs_temperature: the temperature of the reported log-probs, fixed when vLLM starts: every
      :meth:`generate` with ``temperature`` > 0 must use this one (the trainer passes ``step.temperature``).
    seed: vLLM's global seed (each request has its own seed from ``generate``'s key).
    lora_rank: the policy's LoRA rank ``r``: vLLM starts with LoRA enabled (``enable_lora``, ``max_loras=1``,
      ``max_lora_rank`` the smallest rank vLLM allows ≥ r, 3r for GPT-2's fused ``c_attn``) and
      :meth:`push_weights` syncs a LoRA policy's adapters only (a PEFT directory loaded as a ``LoRARequest``;
      the base weights only when they changed). None (default): a LoRA policy is pushed merged.
    max_logprobs: the most log-probs a request may ask for (vLLM's, default 20; a teacher's top-k may need more).
    model: optional: push these weights at once.
  """

  name = "vllm"
  logprobs_are_policy = False  # other kernels: the trainer recomputes old_logp (engine_old_logp)
  #: at a temperature other than 1 vLLM reports the log-probs of the filtered distribution (after top-k, top-p
  #: and suppressed ids): a run refuses those filters then and sends no suppressed ids (jaxgrpo.run.assemble)
  filtered_logprobs_off_unit_temperature = True
  #: why a mixture of experts' routing replay (``rollout.routing_replay: rollout``) is refused through it
  routing_replay_refusal = (
    "`rollout.routing_replay: rollout` with `rollout.engine: vllm` and a mixture-of-experts policy: vLLM 0.32 "
    "returns routed experts only from its Model Runner V2 (`enable_return_routed_experts`), which needs Triton, "
    "absent from its CPU build; set `rollout.routing_replay: none` (each pass then routes by its own top-k)"
  )

  def __init__(
    self,
    config,
    *,
    dtype: str = "float32",
    max_model_len: int | None = None,
    kv_cache_bytes: int | None = 256 * 2**20,
    gpu_memory_utilization: float = 0.3,
    max_num_seqs: int = 256,
    enforce_eager: bool = True,
    logprobs_temperature: float = 1.0,
    seed: int = 0,
    lora_rank: int | None = None,
    max_logprobs: int = 20,
    model=None,
  ):
    served = sorted(f.model_type for f in registered() if f.vllm)  # the registry's (jaxgrpo.models.registry)
    if getattr(config, "model_type", None) not in served or not family_of(config).vllm:
      raise ValueError(f"`config` must be a jaxgrpo model config of {served}; got {config!r:.80}")
    dtype = _checks.check_choice(dtype, DTYPES, "dtype")
    self.logprobs_temperature = _checks.check_python_float(
      logprobs_temperature, "logprobs_temperature", above=0.0, hint="temperature of the reported log-probs"
    )
    check_installed()
    self.on_gpu = any(d.platform == "gpu" for d in jax.devices())
    check_head_size(config, self.on_gpu)
    check_moe_sizes(config, self.on_gpu)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    ExpectedVLLMWarnings.install()
    from vllm import LLM

    self.config = config
    self.moe = family_of(config).experts
    if lora_rank is not None:
      lora_rank = _checks.check_python_int(lora_rank, "lora_rank", minimum=1, hint="the policy's LoRA rank r")
    self.lora_rank = lora_rank
    self._lora_request = None  # the adapter of the last adapter-only push
    self._lora_version = 0
    self._base_fingerprint = None  # lora.base_fingerprint of the base weights in vLLM (adapter-only sync)
    self.max_model_len = int(max_model_len or config.max_position_embeddings)
    self._dir = tempfile.TemporaryDirectory(prefix="jaxgrpo-vllm-")
    hf = config.to_hf()  # its architectures: the transformers class vLLM picks its implementation by
    hf["torch_dtype"] = hf["dtype"] = dtype
    with open(os.path.join(self._dir.name, "config.json"), "w") as f:
      json.dump(hf, f)
    kw = dict(
      model=self._dir.name,
      load_format="dummy",
      skip_tokenizer_init=True,
      dtype=dtype,
      seed=seed,
      max_model_len=self.max_model_len,
      max_num_seqs=max_num_seqs,
      enforce_eager=enforce_eager,
      enable_prefix_caching=True,
      logprobs_mode="raw_logprobs" if self.logprobs_temperature == 1.0 else "processed_logprobs",
      max_logprobs=int(max_logprobs),
    )
    if lora_rank is not None:
      kw.update(enable_lora=True, max_loras=1, max_lora_rank=_vllm_lora_rank(lora_rank * _most_fused(config)))
    if self.on_gpu:
      kw.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)
    else:
      # CPU: no chunked prefill. A prompt split over two scheduler steps makes vLLM rewind the request's
      # seeded generator (Generator.set_offset), which CPU generators do not have ("CPU Generator does not
      # use offset"); whole prompts only, up to max(4096, max_model_len) tokens per step.
      kw.update(enable_chunked_prefill=False, max_num_batched_tokens=max(4096, self.max_model_len))
      if kv_cache_bytes is not None:
        kw.update(kv_cache_memory_bytes=int(kv_cache_bytes))
    self.llm = LLM(**kw)
    self.asleep = False
    self.push_seconds: float | None = None
    if model is not None:
      self.push_weights(model)

  # ------------------------------------------------------------------ weights and memory
  def push_weights(self, model) -> None:
    """Copy ``model``'s parameters into vLLM (see the module docstring); ``self.push_seconds`` is the time."""
    if model.config.to_hf() != self.config.to_hf():
      raise ValueError("push_weights: `model` has another architecture than the engine's config")
    if self.asleep:
      raise RuntimeError("push_weights: the engine's memory is released; call reacquire_memory() first")
    t0 = time.perf_counter()
    if self.lora_rank is not None and lora.has_adapters(model):
      self._push_adapters(model)
    else:
      self._lora_request = self._base_fingerprint = None
      self._reload(model)
    self._reset_prefix_cache("push_weights")
    self.push_seconds = time.perf_counter() - t0

  def _reset_prefix_cache(self, what: str) -> None:
    """Drops every cached KV block, or RuntimeError: vLLM resets its prefix cache only when no request holds a
    block (it returns False and logs a warning otherwise), and a prompt sharing a prefix with an earlier one
    — partial rollouts re-submit prompt ‖ completion so far after every push — would then be continued from
    KV computed with the old weights."""
    if not self.llm.reset_prefix_cache():
      raise RuntimeError(
        f"{what}: vLLM could not reset its prefix cache (unfinished requests hold KV blocks: "
        f"has_unfinished_requests={self.llm.llm_engine.has_unfinished_requests()}), so a prompt with a cached prefix "
        "would reuse KV computed with the old weights; finish or abort those requests first"
      )

  def _reload(self, model) -> None:
    """All of ``model``'s weights (a LoRA policy merged) into vLLM's parameters, then the CPU repacks."""
    weights = hf_weights(model, on_host=not self.on_gpu)
    ExpectedVLLMWarnings.tied_push = bool(self.config.tie_word_embeddings)
    try:
      self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
    finally:
      ExpectedVLLMWarnings.tied_push = False
    if self.config.tie_word_embeddings:
      self.llm.apply_model(_repack_lm_head)
    if self.moe and not self.on_gpu:
      self.llm.apply_model(_repack_cpu_experts)

  def _push_adapters(self, model) -> None:
    """Adapter-only sync: the base weights (``lora.base_model``, dequantised) when their fingerprint changed,
    then the adapters as a PEFT directory (``lora.save_peft``) loaded into vLLM now as a new ``LoRARequest``
    (the previous one removed): every later :meth:`generate` samples base + adapters."""
    from vllm.lora.request import LoRARequest

    fingerprint = lora.base_fingerprint(model)
    if fingerprint != self._base_fingerprint:
      self._base_fingerprint = None
      self._reload(lora.base_model(model))
      self._base_fingerprint = fingerprint
    self._lora_version += 1
    path = os.path.join(self._dir.name, f"adapter-{self._lora_version}")
    lora.save_peft(model, path)
    request = LoRARequest(f"jaxgrpo-policy-{self._lora_version}", self._lora_version, path)
    engine = self.llm.llm_engine
    if not engine.add_lora(request):
      raise RuntimeError(f"push_weights: vLLM did not load the adapter directory {path}")
    previous, self._lora_request = self._lora_request, request
    if previous is not None:
      engine.remove_lora(previous.lora_int_id)
      shutil.rmtree(previous.lora_path, ignore_errors=True)

  def release_memory(self) -> None:
    """GPU: vLLM's sleep mode, level 1 (weights to host memory, KV cache freed). CPU: the prefix cache is
    dropped; vLLM's CPU worker has no sleep mode, so its KV cache stays allocated."""
    if self.on_gpu:
      self.llm.sleep(level=1)
    else:
      self._reset_prefix_cache("release_memory")
    self.asleep = True

  def reacquire_memory(self) -> None:
    """Undo :meth:`release_memory` (push the weights again before generating if they changed)."""
    if self.on_gpu:
      self.llm.wake_up()
    self.asleep = False

  # ------------------------------------------------------------------ sampling
  def generate(
    self, prompt_tokens, prompt_mask, sampling: SamplingConfig, *, key: jax.Array, temperature: float = 1.0
  ) -> Generation:
    """G completions per prompt from vLLM (the arguments of :func:`jaxgrpo.rollout.sampling.generate`;
    ``sampling.merge_lora`` is moot, :meth:`push_weights` merges a LoRA policy or syncs its adapters;
    ``sampling.record_routing`` is refused: vLLM 0.32's CPU build cannot return the routed experts).

    Returns:
      :class:`~jaxgrpo.rollout.engines.base.Generation`: a NumPy ``Rollout`` (``num_steps`` = the longest
      completion) and the finish reasons.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if self.asleep:
      raise RuntimeError("generate: the engine's memory is released; call reacquire_memory() first")
    check_sampling(sampling, "VLLMEngine.generate")
    if sampling.record_routing:
      raise ValueError(
        "VLLMEngine.generate: `sampling.record_routing=True` needs the built-in sampler (vLLM 0.32 returns routed "
        "experts only from its Model Runner V2, which needs Triton, absent from its CPU build); pass a "
        "SamplingConfig with record_routing=False"
      )
    tokens, mask = _checks.check_prompts(prompt_tokens, prompt_mask)
    tokens, mask = np.asarray(tokens), np.asarray(mask, bool)
    policy = SamplingPolicy.from_config(
      sampling, temperature=temperature, vocab_size=self.config.vocab_size, where="VLLMEngine.generate"
    )
    t = sampling.require_max_new_tokens("VLLMEngine.generate")
    g, temperature, top_p, top_k = policy.num_samples, policy.temperature, policy.top_p, policy.top_k
    eos_ids, pad_id, suppress = policy.eos_ids, policy.pad_id, policy.suppress_ids
    key = _checks.check_prng_key(key)
    _checks.check_positions(
      [(f"prompt length {tokens.shape[1]}", tokens.shape[1]), (f"max_new_tokens {t}", t)],
      self.max_model_len,
      "the engine (max_model_len)",
      "shorten the prompts, lower SamplingConfig.max_new_tokens or build the engine with a larger max_model_len",
    )
    tau = self.logprobs_temperature
    if temperature > 0 and temperature != tau:  # vLLM's log-prob mode is fixed at start: refuse, never mislabel
      raise ValueError(
        f"temperature={temperature}: this engine reports log-probs at logprobs_temperature={tau} (fixed when it "
        f"starts); build VLLMEngine(config, logprobs_temperature={temperature}) to sample at {temperature}"
      )
    if tau != 1.0:  # vLLM's processed log-probs: exact only without filters and suppressed ids
      if suppress:
        raise ValueError(
          f"suppress_ids={suppress}: an engine with logprobs_temperature={tau} != 1 reports log-probs after vLLM's "
          "logit bias; pass a SamplingConfig with suppress_ids=() for full-vocabulary log-probs"
        )
      if temperature > 0 and (top_k or top_p < 1.0):
        raise ValueError(
          f"top_k={top_k}, top_p={top_p}: an engine with logprobs_temperature={tau} != 1 reports full-vocabulary "
          "log-probs only without top-k / top-p filtering"
        )
    b = tokens.shape[0]
    seeds = np.asarray(jax.random.randint(key, (b * g,), 0, 2**31 - 1, dtype=jnp.int32))
    bias = {int(i): _SUPPRESS_BIAS for i in suppress} or None
    prompts, params = [], []
    for row in range(b * g):
      ids = tokens[row // g][mask[row // g]].tolist()
      prompts.append(TokensPrompt(prompt_token_ids=ids))
      params.append(
        SamplingParams(
          n=1,
          temperature=temperature,
          top_p=top_p,
          top_k=top_k,
          max_tokens=t,
          seed=int(seeds[row]),
          logprobs=0,
          stop_token_ids=list(eos_ids),
          ignore_eos=True,  # no tokenizer: EOS is stop_token_ids only
          logit_bias=bias,
          detokenize=False,
        )
      )
    outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request)
    comps = np.full((b * g, t), pad_id, np.int32)
    logps = np.zeros((b * g, t), np.float32)
    lengths = np.zeros(b * g, np.int32)
    reasons = np.full(b * g, FINISH_REASONS[1], dtype=object)
    for row, out in enumerate(outputs):
      o = out.outputs[0]
      ids = list(o.token_ids)
      n = len(ids)
      comps[row, :n] = ids
      logps[row, :n] = [lp[i].logprob for i, lp in zip(ids, o.logprobs)]
      lengths[row] = n
      reasons[row] = FINISH_REASONS[0] if (n and ids[-1] in eos_ids and o.finish_reason == "stop") else "length"
    rollout = Rollout(
      prompt_tokens=np.repeat(tokens, g, axis=0),
      prompt_mask=np.repeat(mask, g, axis=0),
      completions=comps,
      mask=np.arange(t)[None, :] < lengths[:, None],
      log_probs=logps,
      group_ids=np.repeat(np.arange(b, dtype=np.int32), g),
      num_steps=np.int32(lengths.max(initial=0)),
    )
    return Generation(rollout, reasons.astype(str))

  def close(self) -> None:
    """Shut vLLM down and remove its config directory."""
    llm, self.llm = getattr(self, "llm", None), None
    if llm is not None:
      engine = getattr(llm, "llm_engine", None)
      shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None), "shutdown", None)
      if shutdown is not None:
        shutdown()
    self._dir.cleanup()
