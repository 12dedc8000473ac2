"""Services every layer may call: checkpoints (``checkpoint``, the entry point, over ``checkpointer``,
``snapshot`` and ``checkpoint_files``), metrics sinks (``metrics``), the one-run-per-directory lock
(``runlock``) and the killable worker pool for verifiers (``timeout_pool``). A service imports nothing of
jaxgrpo but other services and ``_checks``."""

__all__ = []
