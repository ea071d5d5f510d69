"""Batch lifetimes: a small field of a large batch gets storage of its own, so that keeping it (ids and
labels kept for metrics) does not keep the batch's images alive.

Every field of a batch is a view of one buffer (a staging slot, a shared slot, DeviceLoader's device
allocation), and a buffer is freed only when its last view dies. The rule is the C++ one
(csrc/collate/plan.h): fields of at most ``SMALL_FIELD_BYTES`` in batches of at least ``LARGE_BATCH_BYTES``.
"""

from __future__ import annotations

from .._ext import _C

__all__ = ["LARGE_BATCH_BYTES", "SMALL_FIELD_BYTES", "needs_own_storage"]

SMALL_FIELD_BYTES: int = _C.SMALL_FIELD_BYTES
LARGE_BATCH_BYTES: int = _C.LARGE_BATCH_BYTES


def needs_own_storage(field_bytes: int, batch_bytes: int) -> bool:
    """True when a field of ``field_bytes`` in a batch buffer of ``batch_bytes`` gets its own storage."""
    return field_bytes <= SMALL_FIELD_BYTES and batch_bytes >= LARGE_BATCH_BYTES
