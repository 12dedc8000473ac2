"""What the scripts print around the work: tqdm step bars whose ETA excludes compilation, and the
silencing of a library notice the user cannot act on.

Bars follow ``binary_tree_cli``'s conventions: ``unit="step"``, a ``desc`` naming the phase, the postfix
``compiling`` while XLA compiles, then the running metrics (``bar.set_postfix``)."""

from __future__ import annotations

import logging

from jaxgrpo.services.progress import start_clock, step_bar

__all__ = ["TORCH_BANNER", "hide_torch_banner", "start_clock", "step_bar"]

TORCH_BANNER = "PyTorch was not found."


class _TorchBannerFilter(logging.Filter):
  """Drops transformers' ``PyTorch was not found. Models won't be available ...`` advice (logged by
  ``transformers/__init__.py`` at import when torch is absent): jaxgrpo never needs torch's models."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(TORCH_BANNER)


_BANNER_FILTER = _TorchBannerFilter()


def hide_torch_banner() -> None:
  """Process-wide, before ``transformers`` is imported: the filter above on the ``transformers`` logger
  (idempotent). Every other transformers record passes."""
  logging.getLogger("transformers").addFilter(_BANNER_FILTER)
