"""Layer 5, the train step: the ``Batch`` carrier (``batch``), packing (``packing`` primitives,
``batch_packing`` for batches) and the jitted step (``train``)."""

__all__ = []
