"""Layer 6, the rollout side: sampling (``sampling``: ``generate``, ``SamplingConfig``; ``refill``: slot refill),
engines
(``engines``: built-in, vLLM, yours), environments (``environments``: multi-turn agents), one-iteration
helpers (``iteration``) and asynchronous rollouts (``async_rollout``, ``pipeline_sim``)."""

__all__ = []
