"""Sequence-classifier reward models: Hugging Face ``*ForSequenceClassification`` checkpoints of Llama, Qwen2 and
Qwen3 on the policy's decoder.

A classifier checkpoint is the decoder (``model.*``, the causal LM's tensors without ``lm_head``) plus
``score.weight [num_labels, D]``, a bias-free Linear applied to the final hidden state. Transformers reads it at
one token per row: the **rightmost token that is not** ``pad_token_id`` (``argmax(arange(S) * (ids != pad))``;
row 0 when every token is padding; the last position for every row when the config has no ``pad_token_id``,
which transformers allows for a batch of one only). That rule handles left and right padding alike, and it is
the rule here (:func:`last_token_index`): a ``pad_token_id`` *inside* a row (a Llama RM whose pad is its EOS)
is skipped the same way, so the scores are the ones the model was trained to give.

- :func:`load_reward_model`: a checkpoint folder → :class:`RewardModel` (parameters placed on a mesh shard by
  shard, as ``jaxgrpo.models.load_hf`` places a policy, through the same name map).
- :meth:`RewardModel.score`: ``(tokens int[B, S], mask bool[B, S]) → f32[B, num_labels]`` in one jitted
  program (compiled once per shape), under the mesh when the model has one.
- :class:`RewardModelReward`: a reward function ``(prompts, completions, **columns) -> list[float]`` that
  renders prompt + completion with the reward model's tokenizer (its chat template when it has one), pads to a
  few fixed shapes and scores in batches.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from safetensors.numpy import load_file, save_file

from jaxgrpo import _checks
from jaxgrpo.models.base import freeze_rules, positions_from_mask
from jaxgrpo.models.build import build_model
from jaxgrpo.models.config import LlamaConfig, config_from_hf
from jaxgrpo.models.hf import (
  Entry,
  LayerEntry,
  hf_entries,
  load_layers,
  load_tokenizer,
  logical_to_spec,
  read_checkpoint,
  resolve_path,
  save_hf,
  stack_layer_entries,
  tensor_view,
)
from jaxgrpo.models.layers import dense, param
from jaxgrpo.models.registry import family_of, registered
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.parallel.sharding import DEFAULT_RULES
from jaxgrpo.rewards.reward_set import PROMPT_MESSAGES, CountingReward

__all__ = [
  "RewardModel",
  "RewardModelReward",
  "last_token_index",
  "load_reward_model",
  "save_reward_model",
  "encode_row",
  "parameter_bytes",
  "SCORE_HEAD",
]

#: The classifier head's tensor name in a transformers checkpoint (``GenericForSequenceClassification.score``).
SCORE_HEAD = "score.weight"


def last_token_index(tokens: jax.Array, pad_token_id: int | None) -> jax.Array:
  """``int32[B]``: the position each row is read at, transformers' rule — the rightmost token that is not
  ``pad_token_id`` (0 for a row of padding only); ``S - 1`` for every row when ``pad_token_id`` is None."""
  b, s = tokens.shape
  if pad_token_id is None:
    return jnp.full((b,), s - 1, jnp.int32)
  real = (tokens != pad_token_id).astype(jnp.int32)
  return jnp.argmax(jnp.arange(s, dtype=jnp.int32) * real, axis=-1).astype(jnp.int32)


class RewardModel(nnx.Module):
  """A decoder (``jaxgrpo.models.LlamaModel``: Llama, Qwen2, Qwen3) and a score head ``score [D, num_labels]``.

  Attributes:
    model: the decoder, built without an LM head (a classifier has none).
    score_head: ``nnx.Param [D, num_labels]`` (logical axes ``("embed", None)``).
    pad_token_id: the id transformers skips when it finds the row's last token (None: the last position).
    num_labels: the head's width (1 for a scalar reward model).
    mesh, rules: where the parameters live (None: the default device).
  """

  def __init__(
    self,
    config: LlamaConfig,
    num_labels: int,
    *,
    pad_token_id: int | None,
    rngs: nnx.Rngs,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rules: Mapping[str, Any] | None = None,
    scan_layers: bool = False,
  ):
    if not family_of(config).reward_model:
      names = ", ".join(f.config.__name__ for f in registered() if f.reward_model)
      raise TypeError(f"config must be one of {names} (a dense decoder); got {type(config).__name__}")
    num_labels = _checks.check_python_int(num_labels, "num_labels", minimum=1, hint="the score head's width")
    config = dataclasses.replace(config, tie_word_embeddings=True)  # no LM head: a classifier never has one
    self.model = build_model(
      config, rngs=rngs, dtype=dtype, param_dtype=param_dtype, rules=rules, scan_layers=scan_layers
    )
    self.score_head = param(rngs.params(), (config.hidden_size, num_labels), ("embed", None), param_dtype)
    self.num_labels = num_labels
    self.pad_token_id = None if pad_token_id is None else int(pad_token_id)
    self.dtype = dtype
    self.mesh = None  # static: set by load_reward_model
    self.sharding_rules = freeze_rules(rules)

  @property
  def rules(self) -> dict[str, Any]:
    """The logical-axis rules of the parameters and activations (``DEFAULT_RULES`` by default)."""
    return dict(self.sharding_rules)

  @property
  def config(self) -> LlamaConfig:
    return self.model.config

  def __call__(self, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """``f32[B, num_labels]``: the head at :func:`last_token_index` of each row (traceable; no checks)."""
    positions = positions_from_mask(mask)
    hidden, _ = self.model(tokens, positions, attention_mask=mask)
    idx = last_token_index(tokens, self.pad_token_id)
    h = jnp.take_along_axis(hidden, idx[:, None, None], axis=1)[:, 0]  # [B, D]
    w = self.score_head[...].astype(self.dtype)
    return dense(h.astype(self.dtype), w, preferred_element_type=jnp.float32).astype(jnp.float32)

  def score(self, tokens, mask=None) -> np.ndarray:
    """``f32[B, num_labels]`` NumPy scores of ``tokens`` (``int[B, S]``, left- or right-padded) in one jitted
    program (one compile per ``[B, S]``).

    Args:
      tokens: ``int[B, S]`` token ids, padded with ``pad_token_id``.
      mask: ``bool[B, S]`` attention mask (True on real tokens); None: ``tokens != pad_token_id`` (every token
        when the model has no pad id).

    Raises:
      ValueError: a shape that is not ``[B, S]``, a mask of another shape, ids outside the vocabulary, a batch
        of more than one row without a ``pad_token_id`` (transformers refuses it too: the rows' ends are
        unknown), or B not divisible by the mesh's batch shards.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(f"`tokens` must be int[B, S]; got {tokens.dtype}{list(tokens.shape)}")
    b, s = tokens.shape
    if b and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
      raise ValueError(
        f"`tokens` must be ids in [0, {self.config.vocab_size}); got values in [{tokens.min()}, {tokens.max()}]"
      )
    if self.pad_token_id is None and b > 1:
      raise ValueError(
        f"`tokens` has {b} rows but the reward model has no pad_token_id, so the last token of a padded row "
        "is unknown (transformers refuses this too); pass pad_token_id= to load_reward_model"
      )
    if mask is None:
      mask = np.ones_like(tokens, bool) if self.pad_token_id is None else tokens != self.pad_token_id
    mask = np.asarray(mask)
    if mask.shape != tokens.shape:
      raise ValueError(f"`mask` must have the shape of `tokens` {list(tokens.shape)}; got {list(mask.shape)}")
    tokens, mask = tokens.astype(np.int32), mask.astype(bool)
    graphdef, state = nnx.split(self)
    if self.mesh is None:
      return np.asarray(score_program(graphdef, state, tokens, mask))
    shd.check_batch_divisible(b, self.mesh, self.rules, what="reward-model batch")
    sharding = shd.batch_sharding(self.mesh, self.rules)
    tokens, mask = jax.device_put(tokens, sharding), jax.device_put(mask, sharding)
    with jax.set_mesh(self.mesh):
      return np.asarray(score_program(graphdef, state, tokens, mask))


@functools.partial(jax.jit, static_argnums=0)
def score_program(graphdef, state, tokens, mask):
  """The one scoring program: compiled once per graph (model) and ``[B, S]``."""
  return nnx.merge(graphdef, state)(tokens, mask)


def _config_json(directory: str) -> dict:
  with open(os.path.join(directory, "config.json")) as f:
    return json.load(f)


def load_reward_model(
  path: str | os.PathLike,
  *,
  dtype=jnp.float32,
  param_dtype=None,
  mesh: Mesh | None = None,
  rules: Mapping[str, Any] | None = None,
  pad_token_id: int | None = None,
  scan_layers: bool = False,
) -> RewardModel:
  """A ``LlamaForSequenceClassification`` / ``Qwen2ForSequenceClassification`` / ``Qwen3ForSequenceClassification``
  folder (or hub id, when reachable) as a :class:`RewardModel`.

  Args:
    path: the checkpoint folder (``config.json`` and ``model.safetensors`` or its shards).
    dtype: compute dtype (``jnp.float32`` or ``jnp.bfloat16``); the head accumulates and returns float32.
    param_dtype: storage dtype (default: ``dtype``).
    mesh: place the parameters on this mesh as the policy's (``DEFAULT_RULES`` or ``rules``): e.g. the train
      mesh, beside the policy, or a mesh of other devices. None: the default device.
    pad_token_id: overrides the config's ``pad_token_id`` (which transformers reads).
    scan_layers: the decoder's stacked layout (``jaxgrpo.models.build_model``).

  Raises:
    ValueError: a folder whose ``architectures`` is not a sequence classifier, a family other than
      Llama/Qwen2/Qwen3, a missing or mis-shaped tensor (named), or ``score.weight`` missing.
  """
  directory = resolve_path(path)
  raw = _config_json(directory)
  arch = (raw.get("architectures") or [None])[0]
  if not (isinstance(arch, str) and arch.endswith("ForSequenceClassification")):
    raise ValueError(
      f"{directory}: config.json architectures={raw.get('architectures')!r}; a reward model must be a "
      "*ForSequenceClassification checkpoint (Llama, Qwen2, Qwen3)"
    )
  cfg = config_from_hf(raw)
  if not family_of(cfg).reward_model:
    names = ", ".join(f.model_type for f in registered() if f.reward_model)
    raise ValueError(f"{directory}: model_type={raw.get('model_type')!r}; reward models: {names}")
  tensors = read_checkpoint(directory)
  if SCORE_HEAD not in tensors:
    raise ValueError(f"tensor {SCORE_HEAD!r} (the classifier head) is missing from the checkpoint in {directory}")
  head = tensors[SCORE_HEAD]
  if head.ndim != 2 or head.shape[1] != cfg.hidden_size:
    raise ValueError(f"tensor {SCORE_HEAD!r} has shape {tuple(head.shape)}, expected (num_labels, {cfg.hidden_size})")
  num_labels = int(head.shape[0])
  if pad_token_id is None:
    pad_token_id = raw.get("pad_token_id")
    if isinstance(pad_token_id, list):  # a list is never a pad id transformers compares against
      pad_token_id = pad_token_id[0] if pad_token_id else None
  param_dtype = dtype if param_dtype is None else param_dtype
  rules = dict(DEFAULT_RULES if rules is None else rules)
  if mesh is not None and not isinstance(mesh, Mesh):
    raise TypeError(f"`mesh` must be a jax.sharding.Mesh or None; got {type(mesh).__name__}")
  abstract = nnx.eval_shape(
    lambda: RewardModel(
      cfg,
      num_labels,
      pad_token_id=pad_token_id,
      rngs=nnx.Rngs(0),
      dtype=dtype,
      param_dtype=param_dtype,
      rules=rules,
      scan_layers=scan_layers,
    )
  )
  graphdef, state = nnx.split(abstract)
  flat = dict(nnx.to_flat_state(state))
  dec_cfg = abstract.model.config
  entries = hf_entries(dec_cfg)
  if scan_layers:
    entries = stack_layer_entries(entries, dec_cfg.num_layers)
  entries = [e._replace(path=("model",) + e.path) for e in entries]
  entries.append(Entry(("score_head",), SCORE_HEAD, (num_labels, cfg.hidden_size), lambda a: a.T, lambda a: a.T))
  uncovered = set(flat) - {e.path for e in entries}
  if uncovered:
    raise AssertionError(f"the reward model's name map does not cover {sorted(uncovered)}")
  device = jax.devices()[0]
  np_dtype = np.dtype(param_dtype)
  for e in entries:
    var = flat[e.path]
    if isinstance(e, LayerEntry):
      load_layers(e, tensors, var, directory, mesh, rules, device, np_dtype)
      continue
    view = tensor_view(e, tensors, directory)
    if mesh is None:
      sharding = jax.sharding.SingleDeviceSharding(device)
    else:
      axes = var.get_metadata("out_sharding")
      sharding = NamedSharding(mesh, logical_to_spec(axes, mesh, rules, view.shape, e.hf_name))
    var.set_value(
      jax.make_array_from_callback(
        view.shape, sharding, lambda idx, view=view: np.array(view[idx], dtype=np_dtype, order="C")
      )
    )
  model = nnx.merge(graphdef, state)
  model.mesh = mesh
  return model


def save_reward_model(model: RewardModel, path: str | os.PathLike, tokenizer=None) -> None:
  """Write ``model`` as a Hugging Face ``<Family>ForSequenceClassification`` folder that
  ``transformers.AutoModelForSequenceClassification`` and :func:`load_reward_model` read: the decoder's
  tensors (``jaxgrpo.models.save_hf``: ``model.*``, no LM head), ``score.weight [num_labels, D]`` and a
  ``config.json`` with the classifier's ``architectures``, ``num_labels`` and ``pad_token_id``; ``tokenizer``
  (when given) saved beside them. Parameters are gathered to the host (single-process)."""
  if not isinstance(model, RewardModel):
    raise TypeError(f"`model` must be a RewardModel; got {type(model).__name__}")
  path = os.fspath(path)
  save_hf(model.model, path)
  weights = os.path.join(path, "model.safetensors")
  tensors = load_file(weights)
  tensors[SCORE_HEAD] = np.ascontiguousarray(np.asarray(jax.device_get(model.score_head[...])).T)
  save_file(tensors, weights, metadata={"format": "pt"})
  raw = _config_json(path)
  raw["architectures"] = [raw["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")]
  raw["id2label"] = {str(i): f"LABEL_{i}" for i in range(model.num_labels)}
  raw["label2id"] = {f"LABEL_{i}": i for i in range(model.num_labels)}
  raw["pad_token_id"] = model.pad_token_id
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(raw, f, indent=2, sort_keys=True)
  if tokenizer is not None:
    tokenizer.save_pretrained(path)


def parameter_bytes(model: nnx.Module) -> tuple[int, int]:
  """``(total, per_device)``: the bytes of ``model``'s parameters, and the most any one device holds (its
  shards: the total divided by the shards of each sharded tensor; a replicated tensor counts in full)."""
  total, per_device = 0, collections.Counter()
  for x in jax.tree.leaves(nnx.state(model, nnx.Param)):
    total += x.size * x.dtype.itemsize
    for shard in x.addressable_shards:
      per_device[shard.device] += shard.data.size * x.dtype.itemsize
  return int(total), int(max(per_device.values(), default=0))


def encode_row(tokenizer, prompt: Any, completion: str) -> list[int]:
  """The token ids a :class:`RewardModelReward` scores for one row: ``tokenizer``'s chat template over
  ``[user: prompt, assistant: completion]`` (a prompt that is a message list is used as it is), else
  ``prompt + completion`` with the tokenizer's special tokens. Train a reward model on rows encoded this way."""
  if getattr(tokenizer, "chat_template", None):
    messages = list(prompt) if isinstance(prompt, (list, tuple)) else [{"role": "user", "content": str(prompt)}]
    messages.append({"role": "assistant", "content": completion})
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
  if isinstance(prompt, (list, tuple)):
    raise TypeError("a prompt given as a message list needs a tokenizer with a chat template")
  return list(tokenizer(str(prompt) + completion)["input_ids"])


def _bucket(n: int, multiple: int, cap: int) -> int:
  return min(cap, -(-max(n, 1) // multiple) * multiple)


class RewardModelReward(CountingReward):
  """A reward function ``(prompts, completions, **columns) -> list[float]`` scored by a :class:`RewardModel`.

  Each row is rendered as the reward model saw its training data: with the tokenizer's chat template when it
  has one (``[{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]``, or the
  prompt's own message list when ``prompts[i]`` is one), else ``prompt + completion`` with the tokenizer's
  special tokens. Rows are right-padded with the model's ``pad_token_id`` to a multiple of ``pad_multiple``
  tokens (so a few shapes compile) and scored ``batch_size`` rows per program call; a row longer than
  ``max_length`` keeps its last ``max_length`` tokens (counted, ``truncated``).

  Args:
    model: a :class:`RewardModel` (or a folder: :func:`load_reward_model` with ``**load_kwargs``).
    tokenizer: a transformers tokenizer (None: the one in the model's folder).
    batch_size: rows per call (a multiple of the mesh's batch shards).
    max_length: the longest row in tokens (default: the model's ``max_position_embeddings``).
    label: which of the head's outputs is the reward (0 for a scalar reward model).
    name: the reward's name in a ``RewardSet`` (``__name__``).

  Counters (``pop_counters``): ``truncated``; ``nonfinite`` (a NaN or ±inf score: returned as NaN, a missing
  sample).
  """

  nan_is_missing = True  # a non-finite score (an overflowing head) is a missing sample (jaxgrpo.rewards.reward_set)

  #: given the ``prompt_messages`` column (``rewards.reward_set.PROMPT_MESSAGES``): each prompt before the policy's template
  wants_prompt_messages = True

  def __init__(
    self,
    model: RewardModel | str | os.PathLike,
    tokenizer=None,
    *,
    batch_size: int = 8,
    max_length: int | None = None,
    pad_multiple: int = 64,
    label: int = 0,
    name: str = "reward_model",
    **load_kwargs,
  ):
    super().__init__()
    if not isinstance(model, RewardModel):
      path = os.fspath(model)
      model = load_reward_model(path, **load_kwargs)
      tokenizer = load_tokenizer(path) if tokenizer is None else tokenizer
    elif load_kwargs:
      raise TypeError(f"load options {sorted(load_kwargs)} apply to a folder, not to a loaded RewardModel")
    if tokenizer is None:
      raise ValueError("`tokenizer` is required with a loaded RewardModel (the one its checkpoint was trained with)")
    if model.pad_token_id is None:
      raise ValueError(
        "the reward model has no pad_token_id (config.json); load it with pad_token_id=tokenizer.pad_token_id"
      )
    self.model, self.tokenizer = model, tokenizer
    self.batch_size = _checks.check_python_int(batch_size, "batch_size", minimum=1)
    cap = model.config.max_position_embeddings
    self.max_length = _checks.check_python_int(cap if max_length is None else max_length, "max_length", minimum=1)
    self.pad_multiple = _checks.check_python_int(pad_multiple, "pad_multiple", minimum=1)
    self.label = _checks.check_python_int(label, "label", minimum=0)
    if self.label >= model.num_labels:
      raise ValueError(f"`label` must be < num_labels ({model.num_labels}); got {label}")
    self.__name__ = name

  def encode(self, prompt: Any, completion: str) -> list[int]:
    """The token ids of one row (:func:`encode_row` with the reward model's tokenizer)."""
    return encode_row(self.tokenizer, prompt, completion)

  def score_ids(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
    """``f32[N]`` rewards of already tokenized rows (the ``label`` output of the head)."""
    out = np.empty(len(rows), np.float32)
    pad = self.model.pad_token_id
    for start in range(0, len(rows), self.batch_size):
      chunk = [list(r)[-self.max_length :] for r in rows[start : start + self.batch_size]]
      self._count("truncated", sum(len(r) > self.max_length for r in rows[start : start + self.batch_size]))
      s = _bucket(max(len(r) for r in chunk), self.pad_multiple, self.max_length)
      tokens = np.full((self.batch_size, s), pad, np.int32)
      mask = np.zeros((self.batch_size, s), bool)
      for i, r in enumerate(chunk):
        tokens[i, : len(r)], mask[i, : len(r)] = r, True
      out[start : start + len(chunk)] = self.model.score(tokens, mask)[: len(chunk), self.label]
    return out

  def __call__(self, prompts, completions, **columns) -> list[float]:
    if len(prompts) != len(completions):
      raise ValueError(f"`prompts` ({len(prompts)}) and `completions` ({len(completions)}) must have one entry per row")
    # the trainer's rows carry their prompt as chat messages: rendered once, with this model's template
    prompts = columns.get(PROMPT_MESSAGES) or prompts
    rows = [self.encode(p, c) for p, c in zip(prompts, completions)]
    scores = self.score_ids(rows)
    bad = ~np.isfinite(scores)
    self._count("nonfinite", int(bad.sum()))  # a missing sample (NaN), never a number
    return [float(v) for v in np.where(bad, np.nan, scores)]
