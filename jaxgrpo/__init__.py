"""jaxgrpo: pure-JAX GRPO, λ-GRPO and FRPO for LLM post-training.

Public API is re-exported here; the code lives in one module per topic.
"""
from jaxgrpo._version import __version__

__all__ = ["__version__"]
