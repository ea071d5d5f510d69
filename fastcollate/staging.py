"""StagingRing: the reusable host buffers batches are assembled into in the main process.

Fresh output memory costs a page fault per 4 KiB on every batch; a ring slot is faulted in once and
reused. A slot is handed out again only when no tensor outside the ring still references it, so a
batch the user kept is never overwritten; past ``max_slots`` busy slots a fresh buffer is used (with a
warning) instead of waiting.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ._ext import _C

__all__ = ["RingStats", "StagingRing", "active_ring", "main_process_ring", "staging_into"]

DEFAULT_MAX_SLOTS = 8


@dataclass(frozen=True)
class RingStats:
    """Counters of a ring. ``slot_allocations`` stops growing once the ring is warm."""

    slots: int
    max_slots: int
    bytes_held: int
    slot_allocations: int
    regrowths: int
    reuses: int
    overflow_allocations: int
    waits_for_copies: int
    in_use: int
    pinned: bool


class StagingRing:
    """A bounded set of reusable host buffers.

    Args:
        max_slots: the most slots kept; batches past it get fresh, unpooled buffers.
        pinned: page-locked slots (needs a CUDA build and a GPU). Whoever copies out of a pinned slot
            asynchronously must hold it until the copy is done (DeviceLoader does).
        device: the CUDA device whose context pins the slots (default: the current one), so that a
            process working on ``cuda:1`` makes no context on GPU 0.

    New slots are sized to the largest batch seen so far; a slot that must grow gets 1/16 headroom, so
    batches of creeping size re-pin rarely (``RingStats.regrowths`` counts it).
    """

    def __init__(
        self,
        max_slots: int = DEFAULT_MAX_SLOTS,
        pinned: bool = False,
        device: torch.device | int | None = None,
    ) -> None:
        index = None if device is None else torch.device(device).index  # an int is a CUDA ordinal
        self.pinned = pinned
        self.device_index = -1 if index is None else index  # -1: the current CUDA device
        # Locked natively: two threads may collate at once.
        self._native = _C.HostRing(max_slots, pinned, self.device_index)
        self._warned = False

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 tensor of ``nbytes`` over a free slot (or a fresh buffer when all are busy)."""
        buffer, overflowed = self._native.acquire(nbytes)
        if overflowed:
            self.warn_overflow()
        return buffer

    def warn_overflow(self) -> None:
        """Says once per ring that a batch got a fresh buffer because every slot was busy."""
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"fastcollate: all {self.stats().max_slots} staging slots are held by batches still in use; "
                "using fresh buffers (slower). Drop batches sooner or raise max_slots.",
                ResourceWarning,
                stacklevel=3,  # the caller of assemble (or of acquire)
            )

    def pack(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """Copies CPU tensors into one slot at aligned offsets (multi-threaded, GIL released).

        Returns the slot's bytes and each tensor's byte offset in it.
        """
        return self._native.pack(list(tensors))

    def owns(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` points into one of this ring's slots."""
        return self._native.owns(tensor)

    def hold_until_stream_done(self, buffer: torch.Tensor, stream: torch.cuda.Stream) -> bool:
        """Keeps the slot under ``buffer`` from reuse until the work queued so far on ``stream`` (a copy
        reading the slot) has finished. False for a buffer outside the ring."""
        return self._native.hold_until_stream_done(buffer, stream.cuda_stream, stream.device_index)

    def hold_until_flag(self, buffer: torch.Tensor, flag: _C.CompletionFlag) -> bool:
        """Keeps the slot under ``buffer`` from reuse until ``flag.set()``: a copy made by other means
        than a CUDA stream (the tests' stand-in for one). False for a buffer outside the ring."""
        return self._native.hold_until_flag(buffer, flag)

    def trim(self) -> int:
        """Frees every slot nothing references; returns the bytes freed."""
        return self._native.trim()

    def stats(self) -> RingStats:
        s = self._native.stats()
        return RingStats(
            slots=s.slots,
            max_slots=s.max_slots,
            bytes_held=s.bytes_held,
            slot_allocations=s.slot_allocations,
            regrowths=s.regrowths,
            reuses=s.reuses,
            overflow_allocations=s.overflow_allocations,
            waits_for_copies=s.waits_for_copies,
            in_use=s.in_use,
            pinned=s.pinned,
        )


class _ActiveRing(threading.local):
    ring: StagingRing | None = None  # a class default: reading it unset raises (and costs) nothing


_rings: dict[int, StagingRing] = {}
_rings_lock = threading.Lock()
_active = _ActiveRing()


@contextlib.contextmanager
def staging_into(ring: StagingRing) -> Iterator[None]:
    """Within this block, on this thread, ``assemble`` in the main process writes batches into ``ring``.

    DeviceLoader uses it so that a batch collated in the main process lands straight in its pinned
    ring and crosses to the device with no further host copy.
    """
    previous = _active.ring
    _active.ring = ring
    try:
        yield
    finally:
        _active.ring = previous


def active_ring() -> StagingRing | None:
    """The ring ``staging_into`` set on this thread (DeviceLoader's while it fetches a batch), if any."""
    return _active.ring


def main_process_ring() -> StagingRing:
    """The ring ``assemble`` writes to here: the one ``staging_into`` set on this thread, else this
    process's default (pageable) ring. A forked child gets its own, never its parent's."""
    active = _active.ring
    if active is not None:
        return active
    pid = os.getpid()
    ring = _rings.get(pid)
    if ring is None:
        with _rings_lock:
            ring = _rings.setdefault(pid, StagingRing())
    return ring
