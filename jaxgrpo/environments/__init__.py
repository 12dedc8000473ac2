"""Environments and tools for multi-turn rollouts (host side, beside ``jaxgrpo.iteration``).

- ``jaxgrpo.environments.sandbox``: run untrusted Python in a bounded, separate process (the
  code-execution tool).
"""

from jaxgrpo.environments import sandbox

__all__ = ["sandbox"]
