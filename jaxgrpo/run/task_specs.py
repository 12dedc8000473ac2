"""The config sections of the built-in synthetic task (``model.synthetic``, ``data.arithmetic``): plain
frozen dataclasses the run schema validates, so the schema names them without importing the task, which
registers itself (``jaxgrpo.run.registry``) and is loaded only by a run that uses it."""

from __future__ import annotations

import dataclasses

from jaxgrpo import _checks

__all__ = ["SyntheticModel", "ArithmeticTask"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticModel:
  """The arithmetic task's model: a tiny Qwen3-architecture transformer (random init, seeded by the
  run's seed) with the tokenizer of :func:`build_tokenizer`.

  Attributes:
    hidden_size: D, the model width (4 heads of D/4, 2 kv heads, MLP width 2D, tied embeddings).
    num_layers: L, the number of decoder layers.
    num_experts: E > 0: a Qwen3-MoE model (``jaxgrpo.models.moe``) whose every layer routes each
      token to ``experts_per_tok`` (k) of E SwiGLU experts of width 2D/k (the dense model's active
      width); 0 (default): the dense Qwen3 model.
    experts_per_tok: k, experts per token (with ``num_experts``).
    max_positions: the positions the model takes (rotary: no parameter depends on it), at least
      ``data.max_prompt_tokens + rollout.max_new_tokens``; default 2048 (``tasks.arithmetic.SYNTHETIC_POSITIONS``).
  """

  hidden_size: int = 64
  num_layers: int = 2
  num_experts: int = 0
  experts_per_tok: int = 2
  max_positions: int = 2048

  def __post_init__(self):
    _checks.check_python_int(self.num_experts, "synthetic.num_experts", minimum=0, hint="0: a dense model")
    _checks.check_python_int(self.experts_per_tok, "synthetic.experts_per_tok", minimum=1)
    if self.num_experts and self.experts_per_tok > self.num_experts:
      raise ValueError(
        f"`synthetic.experts_per_tok`={self.experts_per_tok} exceeds `synthetic.num_experts`={self.num_experts}"
      )
    _checks.check_python_int(self.num_layers, "synthetic.num_layers", minimum=1)
    _checks.check_python_int(self.hidden_size, "synthetic.hidden_size", minimum=8)
    _checks.check_python_int(self.max_positions, "synthetic.max_positions", minimum=1)
    if self.hidden_size % 8:
      raise ValueError(
        f"`synthetic.hidden_size` must be a multiple of 8 (4 heads of even width); got {self.hidden_size}"
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticTask:
  """The synthetic prompt set "What is a + b?" and the supervised warm-up of the synthetic model.

  Attributes:
    max_operand: operands a, b are in ``[0, max_operand]``.
    train_size: training problems, drawn with replacement from the pairs not held out.
    eval_size: held-out problems (distinct operand pairs never seen in training).
    sft_steps: supervised warm-up steps before RL (0: none). The warm-up trains the synthetic model
      (``model.synthetic``) only.
    sft_learning_rate, sft_batch_size: the warm-up's peak learning rate (cosine schedule) and batch.
    sft_noise: fraction of warm-up demonstrations that box a wrong answer (see :func:`sft_warmup`).
  """

  max_operand: int = 19
  train_size: int = 4000
  eval_size: int = 128
  sft_steps: int = 800
  sft_learning_rate: float = 3e-3
  sft_batch_size: int = 32
  sft_noise: float = 0.7

  def __post_init__(self):
    c = _checks
    c.check_python_int(self.max_operand, "arithmetic.max_operand", minimum=1)
    c.check_python_int(self.train_size, "arithmetic.train_size", minimum=1)
    c.check_python_int(self.eval_size, "arithmetic.eval_size", minimum=0)
    c.check_python_int(self.sft_steps, "arithmetic.sft_steps", minimum=0, hint="0: no warm-up")
    if self.sft_steps == 1:  # the cosine schedule needs a warm-up step and a decay step
      raise ValueError(
        "`arithmetic.sft_steps` must be 0 (no warm-up) or >= 2 (a linear warm-up step, then the cosine decay); got 1"
      )
    c.check_python_int(self.sft_batch_size, "arithmetic.sft_batch_size", minimum=1)
    c.check_python_float(self.sft_learning_rate, "arithmetic.sft_learning_rate", above=0.0)
    c.check_python_float(self.sft_noise, "arithmetic.sft_noise", at_least=0.0, at_most=1.0)
    pairs = (self.max_operand + 1) ** 2
    if self.eval_size >= pairs:
      raise ValueError(
        f"`arithmetic.eval_size`={self.eval_size} leaves no training problems out of the {pairs} operand "
        f"pairs of max_operand={self.max_operand}"
      )
