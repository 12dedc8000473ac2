"""Layer 8, the loop: what turns samplers and the train step into training iterations — the rollout source
(``source``: one batch per step from any engine, single-turn or environment episodes), scoring and batch assembly
(``collect``), the learner and the update schedules (``schedule``), asynchronous rollouts (``async_rollout``,
``pipeline_sim``), partial rollouts across weight updates (``partial/``), environment episodes as training rows
(``episodes``) and the one-iteration API (``iteration``). Below it: the samplers, engines and environments
(``jaxgrpo.rollout``), the rewards, the train step (``jaxgrpo.step``); above it: the run (``jaxgrpo.run``)."""

__all__ = []
