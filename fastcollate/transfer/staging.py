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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import make_dataclass
from typing import Any

import torch

from .._ext import _C

__all__ = ["RingStats", "StagingRing", "active_ring", "main_process_ring", "slot_holding", "staging_in"]

DEFAULT_MAX_SLOTS = 8


_FIELD_TYPES = {"int64_t": int, "bool": bool}

# The fields are the C++ RingStats' (csrc/memory/staging_ring.h lists them once); this is their Python face.
RingStats = make_dataclass(
    "RingStats",
    [(name, _FIELD_TYPES[ctype]) for name, ctype, _ in _C.RingStats.fields],
    frozen=True,
)
RingStats.__module__ = __name__  # make_dataclass's own `module=` is Python 3.12's
RingStats.__doc__ = (
    "Counters of a ring. ``slot_allocations`` stops growing once the ring is warm.\n\nAttributes:\n"
    + "".join(f"    {name}: {what}.\n" for name, _, what in _C.RingStats.fields)
)


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
        self._native = _C.StagingRing(max_slots, pinned, self.device_index)
        self._warned = False
        # Tensors over slots this ring's owner recycles (its own, and shared slots page-locked for it),
        # handed out since its owner last looked: DeviceLoader compares them with those it sees.
        self.views_handed_out = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 tensor of ``nbytes`` over a free slot (or a fresh buffer when all are busy)."""
        buffer, overflowed = self._native.acquire(nbytes)
        if overflowed:
            self.warn_overflow()
        return buffer

    def collate_into(self, collator: _C.Collator, batch: Sequence, small_fields_apart: bool = True) -> Any:
        """Collates ``batch`` with ``collator`` (an Assembler's compiled one) into a slot of this ring: the
        walk and checks, a slot, then the copy with the GIL released. With ``small_fields_apart`` a small
        field of a large batch gets storage of its own (fastcollate.transfer.small_fields), so that keeping
        it does not keep the slot."""
        return self.execute(collator.plan(batch), small_fields_apart, stacklevel=4)  # this method's caller

    def assemble(self, collator: _C.Collator, batch: Sequence, small_fields_apart: bool = True) -> Any:
        """The old name of :meth:`collate_into` (``assemble`` is the collate function's name)."""
        warnings.warn("StagingRing.assemble is now StagingRing.collate_into", FutureWarning, stacklevel=2)
        return self.execute(collator.plan(batch), small_fields_apart, stacklevel=4)

    def execute(self, plan: _C.BatchPlan, small_fields_apart: bool = True, stacklevel: int = 5) -> Any:
        """Runs ``plan`` (a walked or gathered batch's) into a slot of this ring, the copy with the GIL
        released. ``stacklevel`` points the overflow warning at the collate function's caller (counted as
        warn_overflow counts it)."""
        try:
            out, overflowed, views = plan.execute_in_ring(self._native, small_fields_apart)
        except BaseException:
            if plan.overflowed_ring:  # said even when the batch then fails: the ring was full all the same
                self.warn_overflow(stacklevel=stacklevel)
            raise
        self.views_handed_out += views
        if overflowed:
            self.warn_overflow(stacklevel=stacklevel)
        return out

    def warn_overflow(self, stacklevel: int = 3) -> None:
        """Says once per ring that a batch got a fresh buffer because every slot was busy. ``stacklevel``
        is warnings.warn's, counted from here (3: the caller of this method's caller)."""
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"fastcollate: all {self.stats().max_slots} staging slots are held by batches still in use; "
                "using fresh buffers (slower). Drop batches sooner or raise max_slots. In a thread pipeline "
                "(SPDL, torchdata.nodes, Ray Data) its threads and queues hold batches too: give the collate "
                "a ring with a slot for each, Assembler(ring=StagingRing(max_slots=threads + queued + 2)), "
                "or fastcollate.ray.ArrowCollate(max_slots=threads + queued + 2).",
                ResourceWarning,
                stacklevel=stacklevel,
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

    def hold_until_flag_set(self, buffer: torch.Tensor, flag: _C.CompletionFlag) -> bool:
        """Keeps the slot under ``buffer`` from reuse until ``flag.set()``: a copy made by other means
        than a CUDA stream (the tests' stand-in for one). False for a buffer outside the ring."""
        return self._native.hold_until_flag_set(buffer, flag)

    def trim(self) -> int:
        """Frees every slot nothing references; returns the bytes freed."""
        return self._native.trim()

    def stats(self) -> RingStats:
        native = self._native.stats()
        return RingStats(**{name: getattr(native, name) for name, _, _ in _C.RingStats.fields})


class _ActiveRing(threading.local):
    ring: StagingRing | None = None  # a class default: reading it unset raises (and costs) nothing


_rings: dict[int, StagingRing] = {}
_rings_lock = threading.Lock()
_active = _ActiveRing()


@contextlib.contextmanager
def staging_in(ring: StagingRing) -> Iterator[None]:
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
    """The ring ``staging_in`` set on this thread (DeviceLoader's while it fetches a batch), if any."""
    return _active.ring


def main_process_ring() -> StagingRing:
    """The ring ``assemble`` writes to here: the one ``staging_in`` set on this thread, else this
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


def slot_holding(
    tensors: Sequence[torch.Tensor], in_a_slot: Callable[[torch.Tensor], bool]
) -> tuple[torch.Tensor, list[int]] | None:
    """The slot that already holds every one of ``tensors``, each contiguous, as a 1-D uint8 tensor, and their
    byte offsets in it; None when they are not all in the one slot ``in_a_slot(tensors[0])`` says the first
    lies in (then they are packed into one, ``StagingRing.pack``)."""
    storage = tensors[0].untyped_storage()
    if not in_a_slot(tensors[0]) or not all(
        t.untyped_storage().data_ptr() == storage.data_ptr() and t.is_contiguous() for t in tensors
    ):
        return None
    slot = torch.empty(0, dtype=torch.uint8).set_(storage)
    return slot, [t.storage_offset() * t.element_size() for t in tensors]
