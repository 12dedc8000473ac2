"""Layer 2, placement: meshes and sharding rules (``sharding``) and multi-process start-up with its
watchdog (``distributed``)."""

__all__ = []
