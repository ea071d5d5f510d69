"""StagingRing: the reusable host buffers batches are assembled into in the main process.

Fresh output memory costs a page fault per 4 KiB on every batch; a ring slot is faulted in once and
reused. A slot is handed out again only when no tensor outside the ring still references it, so a
batch the user kept is never overwritten; past ``max_slots`` busy slots a fresh buffer is used (with a
warning) instead of waiting.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass

import torch

from ._ext import _C

__all__ = ["RingStats", "StagingRing", "main_process_ring"]

DEFAULT_MAX_SLOTS = 8


@dataclass(frozen=True)
class RingStats:
    """Counters of a ring. ``slot_allocations`` stops growing once the ring is warm."""

    slots: int
    max_slots: int
    bytes_held: int
    slot_allocations: int
    reuses: int
    overflow_allocations: int
    in_use: int
    pinned: bool


class StagingRing:
    """A bounded set of reusable host buffers.

    Args:
        max_slots: the most slots kept; batches past it get fresh, unpooled buffers.
        pinned: page-locked slots (needs a CUDA build and a GPU). Whoever copies out of a pinned slot
            asynchronously must hold it until the copy is done (DeviceLoader does).
    """

    def __init__(self, max_slots: int = DEFAULT_MAX_SLOTS, pinned: bool = False) -> None:
        self._native = _C.HostRing(max_slots, pinned)
        self._lock = threading.Lock()  # two threads may collate at once (a loader iterated twice)
        self._warned = False

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 tensor of ``nbytes`` over a free slot (or a fresh buffer when all are busy)."""
        with self._lock:
            before = self._native.stats().overflow_allocations
            buffer = self._native.acquire(nbytes)
            overflowed = self._native.stats().overflow_allocations != before
        if overflowed and not self._warned:
            self._warned = True
            warnings.warn(
                f"fastcollate: all {self.stats().max_slots} staging slots are held by batches still in use; "
                "using fresh buffers (slower). Drop batches sooner or raise max_slots.",
                ResourceWarning,
                stacklevel=3,
            )
        return buffer

    def trim(self) -> int:
        """Frees every slot nothing references; returns the bytes freed."""
        with self._lock:
            return self._native.trim()

    def stats(self) -> RingStats:
        s = self._native.stats()
        return RingStats(
            slots=s.slots,
            max_slots=s.max_slots,
            bytes_held=s.bytes_held,
            slot_allocations=s.slot_allocations,
            reuses=s.reuses,
            overflow_allocations=s.overflow_allocations,
            in_use=s.in_use,
            pinned=s.pinned,
        )


_rings: dict[int, StagingRing] = {}
_rings_lock = threading.Lock()


def main_process_ring() -> StagingRing:
    """This process's default ring (a forked child gets its own, never its parent's)."""
    pid = os.getpid()
    ring = _rings.get(pid)
    if ring is None:
        with _rings_lock:
            ring = _rings.setdefault(pid, StagingRing())
    return ring
