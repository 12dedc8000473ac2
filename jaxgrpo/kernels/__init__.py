"""Layer 1, the kernels: pure JAX functions of arrays and one frozen config — advantages, process sets
(λ-GRPO), KL and FRPO, surrogates, losses, importance weights, the config (``GRPOConfig``, ``GRPOHyper``)
and the objective that composes them. JAX and NumPy only (no Flax)."""

__all__ = []
