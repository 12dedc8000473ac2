"""What the scripts print around the work: tqdm step bars whose ETA excludes compilation, and the
silencing of a library notice the user cannot act on.

Bars follow ``binary_tree_cli``'s conventions: ``unit="step"``, a ``desc`` naming the phase, the postfix
``compiling`` while XLA compiles, then the running metrics (``bar.set_postfix``)."""

from __future__ import annotations

import logging

from tqdm.auto import tqdm

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


def step_bar(total: int, desc: str, *, disable: bool = False) -> tqdm:
  """A tqdm bar of ``total`` steps, showing ``compiling`` until :func:`start_clock` is called."""
  bar = tqdm(total=total, unit="step", desc=desc, disable=disable)
  bar.set_postfix_str("compiling")
  return bar


def start_clock(bar: tqdm) -> None:
  """Restarts ``bar``'s clock after compilation, keeping its count ``n``: elapsed time, rate and ETA then
  cover only the steps run from now on (``initial`` = ``n``), so a compile before this call — or a first,
  compiling step already counted — is not taken as the time of a step. ETA = (total − n) / rate with
  rate = (n − n₀) / (t − t₀) measured from this call (tqdm's smoothing aside)."""
  if bar.disable:
    return
  n = bar.n
  bar.reset()  # n = 0, start_t = now, the smoothed rate forgotten
  bar.n = bar.last_print_n = bar.initial = n
  bar.set_postfix_str("")
