"""Layer 2, placement: meshes and sharding rules (``sharding``), the platform a program is built for
(``target``) and multi-process start-up with its watchdog (``distributed``)."""

__all__ = []
