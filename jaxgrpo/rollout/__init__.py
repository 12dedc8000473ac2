"""Layer 5, the rollout side (no train step below it): sampling (``sampling``: ``generate``, ``SamplingConfig``;
``refill``: slot refill; ``speculative``: exact speculative decoding; ``conversation``: multi-turn sampling), engines (``engines``: built-in, vLLM, yours) and
environments (``environments``: multi-turn agents). What turns samples into training batches is one layer above
the step: ``jaxgrpo.loop``."""

__all__ = []
