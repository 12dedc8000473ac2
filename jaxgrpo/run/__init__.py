"""Layer 7, the run: the config schema (``specs``, ``spec_schema``, ``_spec_fields``), what it builds
(``builders``), evaluation, the collapse guard and the ``Trainer`` loop."""

__all__ = []
