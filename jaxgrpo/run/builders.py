"""What the specs describe, built: the policy (model + tokenizer) and the prompt sets; a checkpoint's
policy rebuilt from the config it saved.

The one place that turns a :class:`~jaxgrpo.run.specs.ModelSpec` into a model: an HF directory
(``jaxgrpo.models.load_hf``, straight onto the mesh) or the arithmetic task's synthetic model
(``jaxgrpo.tasks.arithmetic``), and a run's ``lora`` section into adapters on it
(:func:`build_run_policy`). The trainer, :func:`load_policy`, :func:`export_hf`,
``scripts/eval.py`` and ``scripts/export_hf.py`` all build through it.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxgrpo import _checks, models
from jaxgrpo import data as data_lib
from jaxgrpo._version import __version__
from jaxgrpo.models import lora
from jaxgrpo.parallel import distributed
from jaxgrpo.run import registry
from jaxgrpo.run.specs import DTYPES, DataSpec, EvalSpec, ModelSpec, TrainerConfig, config_from_dict
from jaxgrpo.services import checkpoint
from jaxgrpo.step import feed
from jaxgrpo.step import train as train_lib

__all__ = [
  "BASE_WEIGHTS",
  "PromptSets",
  "TOKENIZER_FILES",
  "build_tokenizer",
  "check_chat_template",
  "model_config",
  "check_lengths",
  "build_policy",
  "add_adapters",
  "build_run_policy",
  "abstract_policy",
  "special_ids",
  "prompt_length",
  "build_prompts",
  "load_policy",
  "save_policy",
  "peft_dir_for",
  "base_dir_for",
  "lora_export_dirs",
  "stored_base_dir",
  "run_base_dir",
  "export_hf",
]

#: The ``RunMeta.fingerprints`` entry of a LoRA run: ``models.lora.base_fingerprint`` of its frozen
#: base weights (after quantisation), which its adapter checkpoints are only valid on.
BASE_WEIGHTS = "base_weights"
_ADAPTER_STREAM = 0x4C6F5241  # fold_in tag of the adapters' initialisation key ("LoRA")


#: files of which an HF model directory's tokenizer needs at least one (fast, sentencepiece or BPE)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _first_line(e: BaseException) -> str:
  text = str(e).strip() or type(e).__name__
  return text.splitlines()[0]


def build_tokenizer(spec: ModelSpec):
  """The tokenizer of ``spec``: the HF directory's, or the arithmetic task's locally built one.

  Raises:
    ValueError: naming ``model.path``: a local directory without tokenizer files
      (:data:`TOKENIZER_FILES`), or a tokenizer that does not load (the loader's reason).
  """
  if spec.synthetic is not None:
    return registry.task("arithmetic").build_tokenizer()
  path = spec.path
  if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
    raise ValueError(
      f"model.path {path!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save it beside the "
      "weights (tokenizer.save_pretrained(DIR))"
    )
  try:
    return models.load_tokenizer(path)
  except ValueError:
    raise
  except Exception as e:  # noqa: BLE001 - transformers raises many kinds; re-raised naming the field
    raise ValueError(f"model.path {path!r}: its tokenizer does not load: {_first_line(e)}") from e


def check_chat_template(tokenizer, spec: ModelSpec) -> None:
  """ValueError naming ``model.path`` when ``tokenizer`` has no chat template (the prompts are
  rendered with ``tokenizer.apply_chat_template``)."""
  if getattr(tokenizer, "chat_template", None) is None:
    raise ValueError(
      f"model.path {spec.path!r}: the tokenizer has no chat template, which renders the prompts: add "
      "`chat_template` to its tokenizer_config.json (or a chat_template.jinja file)"
    )


def model_config(spec: ModelSpec, tokenizer=None):
  """The architecture config of ``spec`` (``config.json`` only; no weight is read): the synthetic
  model's over ``tokenizer`` 's vocabulary, or the HF directory's.

  Raises:
    ValueError: naming ``model.path``: no readable ``config.json``, or an unsupported ``model_type``.
  """
  if spec.synthetic is not None:
    return registry.task("arithmetic").model_config(
      spec.synthetic, len(tokenizer if tokenizer is not None else build_tokenizer(spec))
    )
  try:
    return models.config_from_hf(spec.path)
  except OSError as e:
    raise ValueError(f"model.path {spec.path!r}: cannot read its config.json: {e.strerror or e}") from None
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"model.path {spec.path!r}: {_first_line(e)}") from None


def check_lengths(cfg: TrainerConfig, config) -> None:
  """ValueError unless the longest row of a run fits the model's positions: the longest padded
  prompt (``data.max_prompt_tokens`` rounded up to the prompt bucket of 16, :func:`prompt_length`)
  plus ``rollout.max_new_tokens`` must be at most ``max_position_embeddings`` of ``config``."""
  prompt = -(-cfg.data.max_prompt_tokens // 16) * 16
  source = "model.synthetic" if cfg.model.synthetic is not None else f"model.path {cfg.model.path!r}"
  t = cfg.rollout.max_new_tokens
  _checks.check_positions(
    [(f"data.max_prompt_tokens {cfg.data.max_prompt_tokens} (padded to {prompt})", prompt)]
    + [(f"rollout.max_new_tokens {t}", t)],
    config.max_position_embeddings,
    f"{source} (max_position_embeddings)",
    "lower one of the two" + ("" if cfg.model.synthetic is None else " or raise model.synthetic.max_positions"),
  )


def build_policy(spec: ModelSpec, *, seed: int, mesh: Mesh | None = None):
  """``(model, tokenizer)`` of ``spec``.

  An HF directory is loaded with its weights (each parameter created on ``mesh`` when given); the
  synthetic model is initialised from ``nnx.Rngs(seed)`` on the default device (the train state
  places it on the mesh).
  """
  dtype, param_dtype = DTYPES[spec.dtype], DTYPES[spec.param_dtype]
  tokenizer = build_tokenizer(spec)
  if spec.synthetic is not None:
    cfg = registry.task("arithmetic").model_config(spec.synthetic, len(tokenizer))
    model = models.build_model(
      cfg,
      rngs=nnx.Rngs(seed),
      dtype=dtype,
      param_dtype=param_dtype,
      remat=spec.remat,
      scan_layers=spec.scan_layers,
      attention=spec.attention,
    )
  else:
    model = models.load_hf(
      spec.path,
      dtype=dtype,
      param_dtype=param_dtype,
      mesh=mesh,
      remat=spec.remat,
      scan_layers=spec.scan_layers,
      attention=spec.attention,
    )
  return model, tokenizer


def add_adapters(model, cfg: lora.LoRAConfig, *, seed: int) -> None:
  """``models.lora.apply_lora`` of a run: adapters (and quantised base weights) from ``cfg``, A
  initialised from ``fold_in(key(seed), "LoRA")``; placed on the model's mesh when it has one."""
  lora.apply_lora(model, cfg, key=jax.random.fold_in(jax.random.key(seed), _ADAPTER_STREAM))


def build_run_policy(
  cfg: TrainerConfig,
  *,
  mesh: Mesh | None = None,
  log: Callable[[str], None] | None = None,
  base_dir: str | None = None,
  progress: bool = False,
):
  """``(model, tokenizer)``: the policy a run starts from — :func:`build_policy`, then the arithmetic
  task's supervised warm-up of the synthetic model (``data.arithmetic.sft_steps``), then the
  ``lora`` section's adapters (:func:`add_adapters`; quantising the base weights for QLoRA).

  Deterministic in the config: rebuilding it gives the same base weights (what a LoRA checkpoint's
  adapters need, :func:`load_policy`, and a resumed run's reference). ``base_dir`` (the run's
  :func:`run_base_dir`): where a run on the synthetic model keeps its base (after the warm-up, before
  quantisation and adapters) as a Hugging Face directory, with the warm-up's inputs
  (:func:`warm_up_key`: the model spec, the task, the seed, the library version) beside it. When the
  directory holds the base of the same inputs, its weights are read instead of re-running the warm-up
  (a resumed run, ``load_policy``); else the warm-up runs and process 0 writes the directory,
  replacing what was there (also for a LoRA run without a warm-up: its adapters' base).
  ``progress``: the warm-up shows a bar."""
  log = log or (lambda s: None)
  model, tokenizer = build_policy(cfg.model, seed=cfg.run.seed, mesh=mesh)
  task = cfg.data.arithmetic
  warm = task is not None and task.sft_steps  # validated: only with model.synthetic
  if warm and base_dir is not None and _read_stored_warm_up(model, base_dir, cfg, log=log):
    log(f"supervised warm-up: read from {base_dir} (stored for the same model, task and seed; not re-run)")
  else:
    if warm:
      rows, _ = registry.task("arithmetic").task_split(task, seed=cfg.run.seed)
      res = registry.task("arithmetic").warm_up(
        model, tokenizer, rows, task, seed=cfg.run.seed, log=log, progress=progress
      )
      log(f"supervised warm-up: {task.sft_steps} steps in {res.seconds:.1f} s, final loss {res.losses[-1]:.3f}")
    stores = warm or (cfg.lora is not None and cfg.model.synthetic is not None)
    if base_dir is not None and stores and jax.process_index() == 0:
      _write_dir(base_dir, lambda tmp: _write_base(model, tmp, cfg if warm else None))
  if cfg.lora is not None:
    add_adapters(model, cfg.lora, seed=cfg.run.seed)
  return model, tokenizer


WARM_UP_KEY = "jaxgrpo_warm_up.json"


def warm_up_key(cfg: TrainerConfig) -> dict:
  """What the synthetic model's warmed-up weights are a function of: the model spec, the arithmetic task
  (its warm-up settings among them), ``run.seed`` and the library version (written beside a stored base,
  :data:`WARM_UP_KEY`; another value anywhere means the warm-up runs again)."""
  d = cfg.to_dict()
  return {"model": d["model"], "arithmetic": d["data"]["arithmetic"], "seed": d["run"]["seed"], "version": __version__}


def _write_base(model, tmp: str, cfg: TrainerConfig | None) -> None:
  """The base as an HF directory, every file at the usual mode, with a manifest (size and CRC32 of every file,
  ``checkpoint.write_files_manifest``) that :func:`_verified_base` checks before the base is read."""
  models.save_hf(model, tmp)
  if cfg is not None:
    with open(os.path.join(tmp, WARM_UP_KEY), "w") as f:
      json.dump(warm_up_key(cfg), f, indent=1)
  _usual_file_modes(tmp)
  checkpoint.write_files_manifest(tmp)


def _verified_base(base_dir: str, log: Callable[[str], None] | None) -> bool:
  """Whether the stored base in ``base_dir`` matches its manifest (every file's size and CRC32). A damaged one
  (or one without a manifest) is moved aside to ``base.corrupt-<UTC time>`` by process 0 (kept, not deleted),
  with a ``WARNING:`` through ``log``: the caller rebuilds it (the warm-up is deterministic in its inputs)."""
  try:
    checkpoint.verify_step(base_dir)
    return True
  except checkpoint.CheckpointError as e:
    reason = " ".join(str(e).split())
  if jax.process_index() == 0:
    target = checkpoint.move_aside(base_dir, "corrupt")
    (log or print)(
      f"WARNING: the stored warm-up model is damaged ({reason}); moved aside to {target} (kept, not deleted); "
      "re-running the warm-up, which gives the same weights, as the base and KL reference"
    )
  return False


def _load_stored_base(base_dir: str, spec: ModelSpec):
  """The synthetic model stored in ``base_dir`` (:func:`stored_base_dir`), in ``spec``'s dtypes and layout."""
  return models.load_hf(
    base_dir,
    dtype=DTYPES[spec.dtype],
    param_dtype=DTYPES[spec.param_dtype],
    remat=spec.remat,
    scan_layers=spec.scan_layers,
    attention=spec.attention,
  )


def _read_stored_warm_up(model, base_dir: str, cfg: TrainerConfig, *, log=None) -> bool:
  """Puts the weights stored in ``base_dir`` into ``model`` when they are the warm-up of ``cfg``'s inputs
  (:func:`warm_up_key`) and intact (:func:`_verified_base`: a damaged base is moved aside); False (nothing
  read) when the directory, its key or its weights are missing, other or damaged."""
  try:
    with open(os.path.join(base_dir, WARM_UP_KEY)) as f:
      if json.load(f) != json.loads(json.dumps(warm_up_key(cfg))):
        return False
  except (OSError, ValueError):
    return False
  if not _verified_base(base_dir, log):
    return False
  stored = _load_stored_base(base_dir, cfg.model)
  # placed as the warm-up leaves its result: uncommitted arrays on this process's default device (the train state
  # then places them on the mesh, also across processes)
  nnx.update(model, jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), nnx.state(stored, nnx.Param)))
  return True


def _write_dir(path: str, write: Callable[[str], None]) -> None:
  """``write(tmp)`` into a temporary sibling of ``path``, then swap it in: a reader never sees a half-written
  directory (at worst none, which :func:`load_policy` handles by rebuilding)."""
  path = os.path.normpath(os.fspath(path))
  tmp = f"{path}.tmp-{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  write(tmp)
  shutil.rmtree(path, ignore_errors=True)
  os.rename(tmp, path)


def stored_base_dir(path: str) -> str:
  """Where a LoRA run on the synthetic model keeps its base weights: ``<checkpoint root>/base``, for a
  run directory, its ``checkpoints/`` or a step directory ``path`` (what :func:`load_policy` reads)."""
  return os.path.join(checkpoint.checkpoint_root(path), "base")


def run_base_dir(out: str) -> str:
  """:func:`stored_base_dir` of the run writing to ``out`` (``out/checkpoints/base``), also before its
  first checkpoint (what the trainer writes)."""
  return os.path.join(checkpoint.checkpoint_dir(out), "base")


def abstract_policy(spec: ModelSpec):
  """``(abstract model, tokenizer)``: the model of ``spec`` as ``ShapeDtypeStruct`` s (no weights read,
  nothing allocated), e.g. a target for :func:`jaxgrpo.services.checkpoint.restore_params`."""
  dtype, param_dtype = DTYPES[spec.dtype], DTYPES[spec.param_dtype]
  tokenizer = build_tokenizer(spec)
  cfg = model_config(spec, tokenizer)
  build = lambda: models.build_model(
    cfg,
    rngs=nnx.Rngs(0),
    dtype=dtype,
    param_dtype=param_dtype,
    remat=spec.remat,
    scan_layers=spec.scan_layers,
    attention=spec.attention,
  )
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
    train_rows, eval_rows = registry.task("arithmetic").task_split(data.arithmetic, seed=seed)
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
  :class:`~jaxgrpo.run.specs.TrainerConfig` saved with it.

  Full fine-tuning: the model skeleton comes from the config's ``model`` spec (the synthetic model,
  or ``config.json`` of its HF directory), then the parameters are restored into it (verified
  against the manifest). LoRA (a ``lora`` section; the checkpoint holds the adapters only): the base
  is rebuilt with its weights — the HF weights; for the synthetic model the base the run stored
  beside its checkpoints (:func:`stored_base_dir`), or, when that is missing or other, its seeded
  warm-up re-run (:func:`build_run_policy`) — its :data:`BASE_WEIGHTS` fingerprint must equal the
  checkpoint's, then the adapters are restored into it: the result carries the adapters
  (``models.lora.merge_lora`` for a plain model).

  Args:
    path: a run directory, a checkpoint root or a step directory.
    step: None: the step named by ``path``, else the latest complete one.
  Raises:
    CheckpointError: no complete checkpoint, corrupt files, no saved config, a parameter tree
      that does not match the rebuilt model, or (LoRA) other base weights than the checkpoint's.
  """
  meta = checkpoint.read_meta(path, step=step)
  if not meta.get("config"):
    raise checkpoint.CheckpointError(
      f"checkpoint {path} (step {meta['step']}) holds no config: cannot rebuild the model"
    )
  cfg = config_from_dict(meta["config"], where=f"config saved in {path}")
  if cfg.lora is not None:
    model, tokenizer = _stored_lora_base(path, cfg, meta) or build_run_policy(cfg)
    fingerprints = {BASE_WEIGHTS: lora.base_fingerprint(model)}
    adapters = checkpoint.restore_params(
      path, nnx.state(model, nnx.LoRAParam), step=meta["step"], fingerprints=fingerprints
    )
    nnx.update(model, adapters)
    return model, tokenizer, cfg
  abstract, tokenizer = abstract_policy(cfg.model)
  graphdef, shapes = nnx.split(abstract)
  params = checkpoint.restore_params(path, shapes, step=meta["step"])
  return nnx.merge(graphdef, params), tokenizer, cfg


def _stored_lora_base(path: str, cfg: TrainerConfig, meta: dict):
  """``(model with adapters, tokenizer)`` from the base a LoRA run on the synthetic model stored
  (:func:`stored_base_dir`), when it is there and its fingerprint is the checkpoint's; else None (the
  caller rebuilds the base, re-running the warm-up)."""
  base = stored_base_dir(path)
  if cfg.model.synthetic is None or not os.path.isfile(os.path.join(base, "config.json")):
    return None
  try:  # a damaged base is rebuilt (the caller re-runs the warm-up), never read
    checkpoint.verify_step(base)
  except checkpoint.CheckpointError:
    return None
  spec = cfg.model
  model = _load_stored_base(base, spec)
  add_adapters(model, cfg.lora, seed=cfg.run.seed)
  if lora.base_fingerprint(model) != meta.get("fingerprints", {}).get(BASE_WEIGHTS):
    return None
  return model, build_tokenizer(spec)


def save_policy(
  model,
  tokenizer,
  out_dir: str,
  *,
  peft_dir: str | None = None,
  base_model_name_or_path: str | None = None,
  base_dir: str | None = None,
) -> list[str]:
  """Writes ``model`` as a Hugging Face directory that ``transformers`` loads (``save_hf`` + the
  tokenizer); a model with adapters is merged first (``models.lora.merge_lora``: adapters added,
  quantised weights dequantised) and, with ``peft_dir``, its adapters are also written there as a
  PEFT adapter directory (``models.lora.save_peft``, naming ``base_model_name_or_path``) that
  ``peft.PeftModel.from_pretrained`` loads onto the base model. ``base_dir`` (a base that is not an
  HF directory, e.g. the synthetic model): the base itself — adapters removed, quantised weights
  dequantised, so PEFT on it computes what ``model`` computes — is written there with the
  tokenizer, and the PEFT directory names it by its path relative to the working directory (never an
  absolute one: ``peft.AutoPeftModelForCausalLM.from_pretrained(peft_dir)`` run from the same directory finds
  it). Returns the directories written."""
  adapted = lora.has_adapters(model)
  if peft_dir is not None and not adapted:
    raise ValueError(f"peft_dir={peft_dir!r}: the model has no adapters to write as a PEFT directory")
  if base_dir is not None and peft_dir is None:
    raise ValueError(f"base_dir={base_dir!r} is written beside a PEFT directory: give peft_dir too")
  models.save_hf(lora.merge_lora(model) if adapted else model, out_dir)
  _finish_hf_dir(out_dir, tokenizer)
  if peft_dir is None:
    return [out_dir]
  written = [out_dir, peft_dir]
  if base_dir is not None:
    models.save_hf(lora.merge_lora(lora.reference_model(model)), base_dir)
    _finish_hf_dir(base_dir, tokenizer)
    # relative, as PEFT writes the path its base was loaded from: the tree stays movable, and no local absolute path
    # (home directory, user name) leaks into a directory that is shared or pushed to a hub
    base_model_name_or_path = os.path.relpath(base_dir)
    written.append(base_dir)
  lora.save_peft(model, peft_dir, base_model_name_or_path=base_model_name_or_path)
  _usual_file_modes(peft_dir)
  return written


_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _finish_hf_dir(out_dir: str, tokenizer) -> None:
  """The tokenizer beside ``save_hf``'s files, its special-token ids in ``config.json`` where the model's
  config has none (the synthetic model's) and in ``generation_config.json`` — without an EOS id
  ``transformers``' ``generate`` runs to its token limit — and every file at the usual mode."""
  from transformers import GenerationConfig

  tokenizer.save_pretrained(out_dir)
  path = os.path.join(out_dir, "config.json")
  with open(path) as f:
    hf = json.load(f)
  for key in _TOKEN_IDS:
    if hf.get(key) is None:
      hf[key] = getattr(tokenizer, key, None)
  with open(path, "w") as f:
    json.dump(hf, f, indent=2, sort_keys=True)
  GenerationConfig(**{k: hf[k] for k in _TOKEN_IDS}).save_pretrained(out_dir)
  _usual_file_modes(out_dir)


def _usual_file_modes(directory: str) -> None:
  """Every file directly in ``directory`` at ``0o666 & ~umask`` (0644 under the default umask 022):
  ``safetensors`` writes its files 0600, which other users (a serving account) cannot read."""
  umask = os.umask(0)
  os.umask(umask)
  for name in os.listdir(directory):
    path = os.path.join(directory, name)
    if os.path.isfile(path) and not os.path.islink(path):
      os.chmod(path, 0o666 & ~umask)


def peft_dir_for(out_dir: str) -> str:
  """Where a LoRA run's PEFT adapter directory goes beside its merged export ``out_dir``: ``<out_dir>-peft``."""
  return os.path.normpath(os.fspath(out_dir)) + "-peft"


def base_dir_for(out_dir: str) -> str:
  """Where the base of a LoRA run on the synthetic model goes beside its merged export ``out_dir``
  (the PEFT directory's ``base_model_name_or_path``): ``<out_dir>-base``."""
  return os.path.normpath(os.fspath(out_dir)) + "-base"


def lora_export_dirs(cfg: TrainerConfig, out_dir: str, peft_dir: str | None = None) -> dict:
  """The :func:`save_policy` keywords of a LoRA run's export to ``out_dir``: the PEFT directory
  (default :func:`peft_dir_for`) and its base: ``model.path``, or, for the synthetic model, the base
  written to :func:`base_dir_for` ``(out_dir)``."""
  peft_dir = peft_dir_for(out_dir) if peft_dir is None else peft_dir
  if cfg.model.synthetic is not None:
    return {"peft_dir": peft_dir, "base_dir": base_dir_for(out_dir)}
  return {"peft_dir": peft_dir, "base_model_name_or_path": cfg.model.path}


def save_run_model(cfg: TrainerConfig, graphdef, train_state, tokenizer, out_dir: str) -> list[str]:
  """A run's current policy (``graphdef`` with ``train_state``'s parameters) as a Hugging Face directory
  (:func:`save_policy`); a LoRA run writes the merged model there and its adapters as a PEFT directory
  (:func:`lora_export_dirs`). With several processes every process must call it (they all take part in
  gathering parameters that span processes) and process 0 writes. Returns the directories written."""
  t = train_state
  if jax.process_count() > 1:
    params, frozen = distributed.to_host((t.params, t.frozen))
    t = t._replace(params=params, frozen=frozen)
  model = feed.policy_model(graphdef, t)
  if jax.process_index() != 0:
    return []
  if cfg.lora is None:
    return save_policy(model, tokenizer, out_dir)
  return save_policy(model, tokenizer, out_dir, **lora_export_dirs(cfg, out_dir))


def export_hf(path: str, out_dir: str, *, step: int | None = None, peft_dir: str | None = None) -> list[str]:
  """Writes the policy of a checkpoint (default: the latest complete one) as a Hugging Face
  directory (``save_hf`` + the tokenizer) that ``transformers`` loads. A LoRA checkpoint is merged
  into ``out_dir`` and its adapters are also written as a PEFT directory, ``peft_dir`` (default
  :func:`peft_dir_for` ``(out_dir)``), naming its base: ``model.path``, or, for the synthetic model,
  the base written beside it (:func:`base_dir_for`). Returns the directories written
  (:func:`save_policy`)."""
  model, tokenizer, cfg = load_policy(path, step=step)
  if cfg.lora is None:
    if peft_dir is not None:
      raise ValueError(f"peft_dir={peft_dir!r}: checkpoint {path} is a full fine-tuning run (no adapters)")
    return save_policy(model, tokenizer, out_dir)
  return save_policy(model, tokenizer, out_dir, **lora_export_dirs(cfg, out_dir, peft_dir))
