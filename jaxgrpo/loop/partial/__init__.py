"""Partial rollouts (docs/trainer.md): rows in flight across weight updates. ``pool``: the slot pools of the
built-in sampler (``RowPool``); ``engine``: the same over an engine; ``env``: environment episodes in flight;
``schedule``: ``PartialRollouts``, the asynchronous schedule that carries unfinished rows to the next policy;
``teacher``: a distillation teacher's scores of complete groups, for dynamic sampling."""

__all__ = []
