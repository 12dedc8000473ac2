"""Deprecated alias of :mod:`jaxgrpo.tasks.arithmetic` (the offline demo moved there).

Kept only while ``tests/test_data.py`` still imports ``build_tokenizer`` from here; new code imports
``jaxgrpo.tasks.arithmetic``. This module will be removed.
"""

from jaxgrpo.tasks.arithmetic import build_tokenizer

__all__ = ["build_tokenizer"]
