"""What the specs describe, built: the policy (model + tokenizer) and the prompt sets; a checkpoint's
policy rebuilt from the config it saved.

The one place that turns a :class:`~jaxgrpo.specs.ModelSpec` into a model: an HF directory
(``jaxgrpo.models.load_hf``, straight onto the mesh) or the arithmetic task's synthetic model
(``jaxgrpo.tasks.arithmetic``). The trainer, :func:`load_policy`, :func:`export_hf`,
``scripts/eval.py`` and ``scripts/export_hf.py`` all build through it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from flax import nnx
from jax.sharding import Mesh

from jaxgrpo import checkpoint, models
from jaxgrpo import data as data_lib
from jaxgrpo import train as train_lib
from jaxgrpo.specs import DTYPES, DataSpec, EvalSpec, ModelSpec, TrainerConfig, config_from_dict
from jaxgrpo.tasks import arithmetic

__all__ = [
  "PromptSets",
  "build_tokenizer",
  "build_policy",
  "abstract_policy",
  "special_ids",
  "prompt_length",
  "build_prompts",
  "load_policy",
  "export_hf",
]


def build_tokenizer(spec: ModelSpec):
  """The tokenizer of ``spec``: the HF directory's, or the arithmetic task's locally built one."""
  if spec.synthetic is not None:
    return arithmetic.build_tokenizer()
  return models.load_tokenizer(spec.path)


def build_policy(spec: ModelSpec, *, seed: int, mesh: Mesh | None = None):
  """``(model, tokenizer)`` of ``spec``.

  An HF directory is loaded with its weights (each parameter created on ``mesh`` when given); the
  synthetic model is initialised from ``nnx.Rngs(seed)`` on the default device (the train state
  places it on the mesh).
  """
  dtype, param_dtype = DTYPES[spec.dtype], DTYPES[spec.param_dtype]
  tokenizer = build_tokenizer(spec)
  if spec.synthetic is not None:
    cfg = arithmetic.model_config(spec.synthetic, len(tokenizer))
    model = models.build_model(cfg, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=param_dtype, remat=spec.remat)
  else:
    model = models.load_hf(spec.path, dtype=dtype, param_dtype=param_dtype, mesh=mesh, remat=spec.remat)
  return model, tokenizer


def abstract_policy(spec: ModelSpec):
  """``(abstract model, tokenizer)``: the model of ``spec`` as ``ShapeDtypeStruct`` s (no weights read,
  nothing allocated), e.g. a target for :func:`jaxgrpo.checkpoint.restore_params`."""
  dtype, param_dtype = DTYPES[spec.dtype], DTYPES[spec.param_dtype]
  tokenizer = build_tokenizer(spec)
  if spec.synthetic is not None:
    cfg = arithmetic.model_config(spec.synthetic, len(tokenizer))
  else:
    cfg = models.config_from_hf(spec.path)
  build = lambda: models.build_model(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype, remat=spec.remat)
  return nnx.eval_shape(build), tokenizer


def special_ids(tokenizer) -> tuple[int, tuple[int, ...]]:
  """``(pad_id, eos_ids)`` of a tokenizer: its pad token (else its EOS token) and every EOS id.

  Raises:
    ValueError: the tokenizer has neither a pad nor an EOS token.
  """
  if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
    raise ValueError(f"tokenizer {type(tokenizer).__name__} has neither a pad nor an EOS token")
  pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  eos = tokenizer.eos_token_id
  eos_ids = tuple(sorted({int(e) for e in ([eos] if isinstance(eos, int) else eos or [])}))
  return int(pad_id), eos_ids


def prompt_length(token_lists: Sequence[Sequence[int]], max_prompt_tokens: int) -> int:
  """The padded prompt length: the longest prompt rounded up to a multiple of 16 (one compiled
  shape per bucket)."""
  longest = max(len(t) for t in token_lists)
  return train_lib.bucket_length(longest, tuple(range(16, max_prompt_tokens + 16, 16)))


class PromptSets(NamedTuple):
  """The encoded prompts of a run.

  Attributes:
    train: the training prompts (``jaxgrpo.data.EncodedPrompts``: token lists, texts, kept indices).
    train_examples: the ``MathExample`` of each kept training prompt (answers and reward columns).
    eval, eval_examples: the same for the held-out set (None: no evaluation).
    train_rows: the arithmetic task's training rows (for the supervised warm-up), else None.
    prompt_len: the padded prompt length of both sets (:func:`prompt_length`).
  """

  train: data_lib.EncodedPrompts
  train_examples: list
  eval: data_lib.EncodedPrompts | None
  eval_examples: list | None
  train_rows: list[dict] | None
  prompt_len: int


def build_prompts(data: DataSpec, evaluation: EvalSpec, tokenizer, *, seed: int) -> PromptSets:
  """The training and held-out prompts of ``data`` and ``evaluation``, encoded with ``tokenizer``'s
  chat template (prompts longer than ``data.max_prompt_tokens`` are dropped and counted)."""
  train_rows = None
  if data.arithmetic is not None:
    train_rows, eval_rows = arithmetic.task_split(data.arithmetic, seed=seed)
    train = data_lib.examples_from_rows(train_rows, "openrs")
    evals = data_lib.examples_from_rows(eval_rows, "openrs") if eval_rows else None
  else:
    train = data_lib.load_math_dataset(data.dataset, split=data.split, mapping=data.mapping, name=data.dataset_config)
    evals = None
    if evaluation.dataset is not None:
      evals = data_lib.load_math_dataset(
        evaluation.dataset,
        split=evaluation.split,
        mapping=evaluation.mapping,
        limit=evaluation.limit,
        name=evaluation.dataset_config,
      )
  encode = lambda examples: data_lib.encode_prompts(
    tokenizer, examples, max_prompt_tokens=data.max_prompt_tokens, instruction=data.instruction
  )
  prompts = encode(train)
  if not prompts.tokens:
    raise ValueError(f"no training prompt fits in data.max_prompt_tokens={data.max_prompt_tokens}")
  eval_prompts = eval_examples = None
  if evals is not None:
    if evaluation.limit is not None:
      evals = evals[: evaluation.limit]
    eval_prompts = encode(evals)
    eval_examples = [evals[i] for i in eval_prompts.kept]
  prompt_len = prompt_length(prompts.tokens + (eval_prompts.tokens if evals else []), data.max_prompt_tokens)
  return PromptSets(prompts, [train[i] for i in prompts.kept], eval_prompts, eval_examples, train_rows, prompt_len)


def load_policy(path: str, *, step: int | None = None) -> tuple[nnx.Module, Any, TrainerConfig]:
  """``(model, tokenizer, config)``: the policy of a checkpoint, rebuilt from the
  :class:`~jaxgrpo.specs.TrainerConfig` saved with it.

  The model skeleton comes from the config's ``model`` spec (the synthetic model, or ``config.json``
  of its HF directory), then the parameters are restored into it (verified against the manifest).

  Args:
    path: a run directory, a checkpoint root or a step directory.
    step: None: the step named by ``path``, else the latest complete one.
  Raises:
    CheckpointError: no complete checkpoint, corrupt files, no saved config, or a parameter tree
      that does not match the rebuilt model.
  """
  meta = checkpoint.read_meta(path, step=step)
  if not meta.get("config"):
    raise checkpoint.CheckpointError(
      f"checkpoint {path} (step {meta['step']}) holds no config: cannot rebuild the model"
    )
  cfg = config_from_dict(meta["config"], where=f"config saved in {path}")
  abstract, tokenizer = abstract_policy(cfg.model)
  graphdef, shapes = nnx.split(abstract)
  params = checkpoint.restore_params(path, shapes, step=meta["step"])
  return nnx.merge(graphdef, params), tokenizer, cfg


def export_hf(path: str, out_dir: str, *, step: int | None = None) -> str:
  """Writes the policy of a checkpoint (default: the latest complete one) as a Hugging Face
  directory (``save_hf`` + the tokenizer) that ``transformers`` loads; returns ``out_dir``."""
  model, tokenizer, _ = load_policy(path, step=step)
  models.save_hf(model, out_dir)
  tokenizer.save_pretrained(out_dir)
  return out_dir
