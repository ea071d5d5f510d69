"""Shared slots: DataLoader workers collate straight into memory the main process maps once.

Without them every batch a worker collates goes into fresh shared memory: a new segment, a new mapping
in each process and a page fault per 4 KiB on both sides, then (under DeviceLoader) one more copy into
pinned memory. With them (csrc/shared_slots.cpp):

- The main process makes a pool (one memfd: no name in /dev/shm, mode 0600) when its workers start: in
  a fork hook for forked workers, or when the Assembler is pickled for a spawned or forkserver worker,
  whose pickle then carries the descriptor.
- A worker's ``assemble`` claims a free slot (a compare-and-swap in the shared header), writes the
  batch there, and its tensors are pickled as (slot, sequence number, view): a few dozen bytes.
- The main process maps each slot once and lends the batch a storage over that mapping; when the last
  tensor over it dies the slot is free again. Under a DeviceLoader the mapping is page-locked once, so
  the batch arrives pinned and DeviceLoader copies straight from it, holding the batch until its copy's
  event has completed. Nothing else page-locks slots, and a batch received elsewhere (another loader
  sharing the Assembler) is over a separate, pageable mapping of the slot: an asynchronous
  ``.to(non_blocking=True)`` from a page-locked slot could still be reading it when the batch is
  dropped and a worker writes the next one there (torch's pinned allocator guards only its own blocks
  that way), so with ``pin_memory=True`` DataLoader pins a copy, as it does for ``default_collate``.

A batch falls back to fresh shared memory, with correct data, when every slot is held (with one warning
per worker, giving the numbers), when the pool was not handed to the worker, or when it is switched off
(``Assembler(shared_slots=False)`` or ``FASTCOLLATE_SHARED_SLOTS=0``).
"""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.reduction
import os
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import get_worker_info

from ._ext import _C
from .staging import active_ring

__all__ = ["SharedSlotStats", "SlotPool", "slots_switched_on"]

SWITCH = "FASTCOLLATE_SHARED_SLOTS"
# The header's room. Slots cost memory only once a batch is written into one, and workers take the
# lowest free one, so the slots in use stay as few as the batches alive at once.
DEFAULT_CAPACITY = 64


@dataclass(frozen=True)
class SharedSlotStats:
    """A pool's state. ``lent`` slots hold batches this process still uses; ``fresh_fallbacks`` counts
    batches that found every slot held and went to fresh shared memory instead."""

    capacity: int
    free: int
    writing: int
    delivered: int
    lent: int
    slots_used: int
    bytes_held: int
    claims: int
    fresh_fallbacks: int
    reclaimed: int
    receipts: int
    mappings: int
    registrations: int
    registration_failures: int
    registered_bytes: int  # bytes of this process's slot mappings page-locked now (DeviceLoader's)


def slots_switched_on(requested: bool) -> bool:
    """The Assembler's ``shared_slots`` unless ``FASTCOLLATE_SHARED_SLOTS=0`` forces today's path."""
    return requested and os.environ.get(SWITCH, "1") != "0"


_pools: weakref.WeakValueDictionary[int, SlotPool] = weakref.WeakValueDictionary()  # by token


class SlotPool:
    """One pool of shared slots: made by the main process, reached by its workers."""

    def __init__(self, native: Any, handed_over: bool) -> None:
        self.native = native
        self.handed_over = handed_over  # attached from a descriptor its owner sent to this process
        self._warned = False
        _pools[native.token] = self

    @classmethod
    def create(cls, capacity: int) -> SlotPool:
        return cls(_C.SharedSlots.create(capacity), handed_over=False)

    def handle_for_child(self) -> Any:
        """The descriptor, for the process being started (spawn, forkserver) to attach."""
        return multiprocessing.reduction.DupFd(self.native.fd)

    @classmethod
    def attach(cls, handle: Any) -> SlotPool:
        return cls(_C.SharedSlots.attach(handle.detach()), handed_over=True)

    def owned_here(self) -> bool:
        return self.native.owner_pid == os.getpid()

    def serves_this_worker(self) -> bool:
        """A forked worker uses its parent's pool; a spawned one the pool its parent sent it."""
        return self.handed_over or self.native.owner_pid == os.getppid()

    def claim(self, nbytes: int, max_slots: int | None) -> torch.Tensor | None:
        """A buffer over a free slot for a batch of ``nbytes``, or None (counted, and said once)."""
        info = get_worker_info()
        # DataLoader keeps at most prefetch_factor (2 by default) batches per worker in flight; DeviceLoader
        # holds `depth` (2 by default) more while they copy, and the consumer one or two.
        bound = max_slots or 2 * (info.num_workers if info is not None else 1) + 4
        buffer = self.native.claim(nbytes, bound)
        if buffer is None:
            self.native.count_fresh_fallback()
            self._warn_full(bound)
        return buffer

    def _warn_full(self, bound: int) -> None:
        if self._warned:
            return
        self._warned = True
        s = self.native.stats()
        warnings.warn(
            f"fastcollate: all {min(bound, s.capacity)} shared slots are held ({s.lent} by batches the main "
            f"process still holds, {s.delivered} sent and not yet received, {s.writing} being written); "
            f"worker pid {os.getpid()} writes batches into fresh shared memory instead (slower). "
            "Drop batches sooner, or raise Assembler(max_shared_slots=...).",
            RuntimeWarning,  # shown by default (a ResourceWarning is not), in the worker's stderr
            stacklevel=4,
        )

    def stats(self) -> SharedSlotStats:
        self.native.reclaim_dead_writers()
        s = self.native.stats()
        return SharedSlotStats(**{name: getattr(s, name) for name in SharedSlotStats.__dataclass_fields__})


def for_workers(current: SlotPool | None, capacity: int) -> SlotPool:
    """The pool this process owns for its workers: ``current``, or a new one when ``current`` belongs
    to another process (a forked child making workers of its own)."""
    if current is not None and current.owned_here():
        current.native.reclaim_dead_writers()  # slots left by the previous workers that died
        return current
    return SlotPool.create(capacity)


def being_spawned() -> bool:
    """True while pickling for a process being started (spawn, forkserver): a descriptor can go along."""
    return multiprocessing.context.get_spawning_popen() is not None


# The main process: rebuilding a worker's slot tensor.


def _pin_device() -> int:
    """The CUDA device to page-lock a received batch's slot with: DeviceLoader's, when it is the one
    fetching the batch on this thread (it holds the batch until its copy has completed), else none (-1).
    A batch received anywhere else (another loader, DataLoader's pin-memory thread) is over a separate,
    pageable mapping, so no copy made from it can outlive its slot."""
    ring = active_ring()
    if ring is None or not ring.pinned:
        return -1
    return ring.device_index if ring.device_index >= 0 else torch.cuda.current_device()


def _receive(
    token: int, slot: int, seq: int, nbytes: int, dtype: torch.dtype, offset: int, shape: tuple, stride: tuple
) -> torch.Tensor:
    pool = _pools.get(token)
    if pool is None:
        raise RuntimeError(
            "fastcollate: a batch from a DataLoader worker names shared slots this process does not hold: "
            "its Assembler was deleted while the batch was in flight, or the batch was sent on to another "
            "process"
        )
    return pool.native.receive(slot, seq, nbytes, dtype, offset, shape, stride, _pin_device())


# A worker: sending slot tensors as views.

_reducer_lock = threading.Lock()
_reducer_installed_in: int | None = None  # the pid: a forked child installs its own


def install_reducer() -> bool:
    """Makes this worker's queue send slot tensors as views, and every other tensor as torch does.

    The one place that reaches into torch's multiprocessing reductions; if they ever change shape, the
    worker sends every batch the ordinary way (False).
    """
    global _reducer_installed_in
    if _reducer_installed_in == os.getpid():
        return True  # the per-batch case: no lock
    with _reducer_lock:
        if _reducer_installed_in == os.getpid():
            return True
        try:
            from torch.multiprocessing.reductions import reduce_tensor as torch_reduce_tensor
        except ImportError:
            return False

        def reduce_tensor(tensor: torch.Tensor) -> Any:
            sent = _C.deliver_slot_tensor(tensor) if not tensor.requires_grad else []
            if not sent:
                return torch_reduce_tensor(tensor)
            token, slot, seq, nbytes = sent
            return _receive, (
                token,
                slot,
                seq,
                nbytes,
                tensor.dtype,
                tensor.storage_offset(),
                tuple(tensor.shape),
                tensor.stride(),
            )

        multiprocessing.reduction.ForkingPickler.register(torch.Tensor, reduce_tensor)
        _reducer_installed_in = os.getpid()
        return True


# The fork hook: forked workers inherit the pools that exist at fork time, so make them then.

_assemblers: weakref.WeakSet = weakref.WeakSet()


def track(assembler: Any) -> None:
    """Registers an Assembler, so that a fork of this process makes its pool first."""
    _assemblers.add(assembler)


def _before_fork() -> None:
    if get_worker_info() is not None:
        return  # a worker's own children are not its workers
    for assembler in list(_assemblers):
        try:
            assembler.prepare_shared_slots()
        except Exception as error:  # noqa: BLE001 - a failed pool must not fail the fork: batches fall back
            warnings.warn(
                f"fastcollate: shared slots unavailable, batches use fresh shared memory ({error})",
                ResourceWarning,
                stacklevel=2,
            )


os.register_at_fork(before=_before_fork)
