"""Shared slots: DataLoader workers collate straight into memory the main process maps once.

Without them every batch a worker collates goes into fresh shared memory: a new segment, a new mapping
in each process and a page fault per 4 KiB on both sides, then (under DeviceLoader) one more copy into
pinned memory. With them (csrc/memory/shared_slots.h):

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

The bound: each DataLoader's workers may use ``Assembler(max_shared_slots=...)`` slots (by default
``2 x num_workers + 4``), and the pool's bound is the sum over the loaders whose workers are alive. A
worker registers in the pool's header at its first claim, with its loader's key (the iterator's base seed,
the same in each of its workers) and bound, and a dead worker's entry is forgotten when slots are taken
back. So a train and an eval loader on one collate, with persistent workers, do not crowd each other out
(the train workers' prefetched batches wait in slots while the eval loader runs), and a consumer that
keeps every batch still stops at the bound.

A batch falls back to fresh shared memory, with correct data, when every slot is held, when the pool's
file cannot grow (a file-size limit), when a slot cannot be mapped (an address-space limit), when the
pool could not be made, or when it is switched off (``Assembler(shared_slots=False)`` or
``FASTCOLLATE_SHARED_SLOTS=0``). Each cause but the switch is said once per process, with its numbers and
what to change, as a RuntimeWarning (shown under Python's default filters, in the worker's stderr). When
every slot is held, the main process also names the fields it kept that hold slots (kept_fields).

What crosses the pipe: the first message that sends a batch names its slot, and the slot stays held
until that message is received. A batch sent again (a collate that caches) goes the ordinary way, as a
copy, and a message that fails to pickle gives its slots back. A small field of a large batch
(fastcollate.transfer.small_fields) crosses by value, so that the main process gives it storage of its own.
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

from .._ext import _C
from . import kept_fields
from .small_fields import LARGE_BATCH_BYTES, needs_own_storage
from .staging import active_ring

__all__ = ["SharedSlotStats", "SlotPool", "slots_switched_on"]

SWITCH = "FASTCOLLATE_SHARED_SLOTS"
MAX_CAPACITY = 4096  # the most slots a pool's header has room for (SharedSlots::create)
REGISTRY_ENTRIES = 64  # the workers a pool's registry counts (kMaxWriters in shared_slots_layout.h)
DEFAULT_BOUND_PER_WORKER = 6  # a loader's default bound, 2 x num_workers + 4, is at most 6 a worker
LOADER_KEY_MASK = (1 << 64) - 1


def capacity_for(max_shared_slots: int | None) -> int:
    """The header's room: the bounds of every loader the registry counts, each registered worker adding at
    most one loader's bound. Slots cost memory only once a batch is written into one, and workers take the
    lowest free one, so the slots in use stay as few as the batches alive at once."""
    return min(MAX_CAPACITY, REGISTRY_ENTRIES * (max_shared_slots or DEFAULT_BOUND_PER_WORKER))


@dataclass(frozen=True)
class SharedSlotStats:
    """A pool's state. ``lent`` slots hold batches this process still uses; ``fresh_fallbacks`` counts
    batches that found every slot held (all ``bound`` of them) and went to fresh shared memory instead."""

    capacity: int
    free: int
    writing: int
    delivered: int
    lent: int
    kept_by_writers: int
    slots_used: int
    bytes_held: int
    file_bytes: int
    claims: int
    fresh_fallbacks: int
    reclaimed: int
    receipts: int
    mappings: int
    registrations: int
    registration_failures: int
    registered_bytes: int  # bytes of this process's slot mappings page-locked now (DeviceLoader's)
    loaders: int  # DataLoaders with a worker alive that has claimed a slot
    bound: int  # the slots their workers may use at once: the sum of each loader's bound


def slots_switched_on(requested: bool) -> bool:
    """The Assembler's ``shared_slots`` unless ``FASTCOLLATE_SHARED_SLOTS=0`` forces today's path."""
    return requested and os.environ.get(SWITCH, "1") != "0"


_pools: weakref.WeakValueDictionary[int, SlotPool] = weakref.WeakValueDictionary()  # by token

# (pid, cause): a forked child says its own. No lock: one a thread held at a fork would never be released
# in the child, and two threads racing here at worst both say it.
_warned: set[tuple[int, str]] = set()


def warn_once(cause: str, message: str, stacklevel: int = 3) -> None:
    """Says ``message`` the first time ``cause`` happens in this process: the slots stopped serving, and
    batches went to fresh shared memory (correct, slower). A RuntimeWarning, shown by default."""
    key = (os.getpid(), cause)
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(f"fastcollate: {message}", RuntimeWarning, stacklevel=stacklevel + 1)


class SlotPool:
    """One pool of shared slots: made by the main process, reached by its workers."""

    def __init__(self, native: Any, handed_over: bool) -> None:
        self.native = native
        self.handed_over = handed_over  # attached from a descriptor its owner sent to this process
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
        """A buffer over a free slot for a batch of ``nbytes``, or None (counted, and said once). In a
        DataLoader worker, its loader's bound counts toward the pool's (see the module's docstring)."""
        info = get_worker_info()
        workers = info.num_workers if info is not None else 0  # 0 outside a worker: no loader to register
        # DataLoader keeps at most prefetch_factor (2 by default) batches per worker in flight; DeviceLoader
        # holds `depth` (2 by default) more while they copy, and the consumer one or two.
        bound = max_slots or 2 * max(workers, 1) + 4
        # The iterator's base seed: the same in each of its workers, drawn anew for each iterator.
        loader = (info.seed - info.id) & LOADER_KEY_MASK if info is not None else 0
        buffer, cause, detail = self.native.claim(nbytes, bound, loader, workers)
        if buffer is None:
            self.native.count_fresh_fallback()
            self._warn_fallback(cause, detail)
        return buffer

    def _warn_fallback(self, cause: str, detail: str) -> None:
        where = f"worker pid {os.getpid()} writes batches into fresh shared memory instead (slower)"
        if cause not in ("bound", "room"):
            warn_once(cause, f"a shared slot could not serve: {detail}; {where}. Raise the limit, or switch "
                      "the slots off (FASTCOLLATE_SHARED_SLOTS=0).", stacklevel=4)
            return
        # Every slot is held: the main process alone knows by what, and names the fields it kept.
        kept_fields.send_with_next_message(self.native)
        alive = self.native.stats().loaders
        loaders = f"{alive} loader{'s' if alive != 1 else ''}"
        kept = (f"A field kept from a batch under {LARGE_BATCH_BYTES >> 20} MiB (an id or a label kept for "
                "metrics) holds the batch's whole slot; the main process names the fields it keeps that do.")
        if cause == "room":
            warn_once(cause, f"{detail}; {where}. Drop batches sooner, or have fewer loaders' workers alive "
                      f"at once ({loaders} now; persistent_workers=False on a loader used now and then). "
                      f"{kept}", stacklevel=4)
            return
        warn_once(
            cause,
            f"{detail}; {where}. Drop batches sooner, or raise Assembler(max_shared_slots=...): the bound is "
            f"its value for each loader whose workers are alive ({loaders} now), by default "
            f"2 x num_workers + 4, which assumes prefetch_factor 2. {kept}",
            stacklevel=4,
        )

    def stats(self) -> SharedSlotStats:
        self.native.reclaim_dead_writers()
        s = self.native.stats()
        return SharedSlotStats(**{name: getattr(s, name) for name in SharedSlotStats.__dataclass_fields__})


# Two threads starting workers at once (two loaders sharing an Assembler) must get one pool: the one that
# lost would be orphaned, and its workers' batches named slots this process does not hold.
preparing = threading.Lock()


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


# _C.shared_slot_kind of a tensor (C++'s SlotKind, exported once as _C.SLOT_KIND_*): a worker's view of the
# slot it writes; a batch received over a page-locked mapping (DeviceLoader's).
WRITING = _C.SLOT_KIND_WRITING
PAGE_LOCKED = _C.SLOT_KIND_PAGE_LOCKED


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
    pin_device = _pin_device()
    tensor = pool.native.receive(slot, seq, nbytes, dtype, offset, shape, stride, pin_device)
    if pin_device < 0:
        return tensor
    if _C.shared_slot_kind(tensor) == PAGE_LOCKED:
        # DeviceLoader's ring counts them: it looks for any the batch does not show. A pageable one (the
        # slot could not be page-locked) is no hazard, and would only make it search for nothing.
        active_ring().views_handed_out += 1
    elif pool.native.registration_failures:
        warn_once("page-locking", "a shared slot could not be page-locked (cudaHostRegister failed: the "
                  "memlock limit, ulimit -l, or no GPU memory for it); its batches are received pageable and "
                  "DeviceLoader packs them into its pinned ring (one more host copy each). Raise ulimit -l.")
    return tensor


def _own_copy(data: bytearray, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A small field of a large batch, sent by value: storage of its own, so keeping it keeps no slot."""
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).view(shape)


# A worker: sending slot tensors as views.



class _Message(threading.local):
    # The (token, slot, seq) of the batches the message being pickled on this thread is the first to
    # send; None outside ForkingPickler.dumps.
    delivered: list[tuple[int, int, int]] | None = None


_message = _Message()


def _track_messages(pickler: type) -> None:
    """Wraps ``pickler.dumps`` (what every multiprocessing queue and connection sends with) so that the
    reducer knows which message it is pickling: a batch an earlier message sent takes the ordinary path,
    and a message that fails to pickle (an object after the tensors cannot be) gives back the slots it
    marked delivered, instead of leaving them held for the life of the worker."""
    original = pickler.__dict__["dumps"].__func__

    def dumps(cls: type, obj: Any, protocol: int | None = None) -> Any:
        outer, _message.delivered = _message.delivered, []
        try:
            return original(cls, kept_fields.with_held_fields(obj), protocol)
        except BaseException:
            for token, slot, seq in _message.delivered:
                pool = _pools.get(token)
                if pool is not None:
                    pool.native.undeliver(slot, seq)
            raise
        finally:
            _message.delivered = outer

    dumps.tracks_messages = True  # type: ignore[attr-defined]
    pickler.dumps = classmethod(dumps)


def _reduce_slot_tensor(tensor: torch.Tensor) -> tuple | None:
    """How a tensor over a slot this worker wrote crosses the pipe, or None for the ordinary way."""
    if needs_own_storage(tensor.nbytes, tensor.untyped_storage().nbytes()):
        # resolve_conj/resolve_neg: a conjugate or negative view has no plain bytes to view as uint8.
        plain = tensor.detach().resolve_conj().resolve_neg().contiguous()
        data = bytearray(plain.reshape(-1).view(torch.uint8).numpy())
        return _own_copy, (data, tensor.dtype, tuple(tensor.shape))
    message = _message.delivered
    if message is None:
        return None  # pickled outside ForkingPickler.dumps: nothing would tell when the message ends
    sent = _C.deliver_slot_tensor(tensor)
    if not sent:
        return None  # received already: a batch sent again
    token, slot, seq, nbytes, first = sent
    if first:
        message.append((token, slot, seq))
    elif (token, slot, seq) not in message:
        return None  # an earlier message sent it: that one holds the slot until it is received
    return _receive, (
        token, slot, seq, nbytes, tensor.dtype, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
    )


_reducer_lock = threading.Lock()
_reducer_installed_in: int | None = None  # the pid: a forked child installs its own


def install_reducer() -> bool:
    """Makes this worker's queue send slot tensors as views, and every other tensor as torch does.

    The one place that reaches into torch's multiprocessing reductions (and multiprocessing's pickler);
    if they ever change shape, the worker sends every batch the ordinary way (False).
    """
    global _reducer_installed_in
    if _reducer_installed_in == os.getpid():
        return True  # the per-batch case: no lock
    with _reducer_lock:
        if _reducer_installed_in == os.getpid():
            return True
        pickler = multiprocessing.reduction.ForkingPickler
        try:
            from torch.multiprocessing.reductions import reduce_tensor as torch_reduce_tensor
        except ImportError:
            return False
        if not isinstance(pickler.__dict__.get("dumps"), classmethod):
            return False

        def reduce_tensor(tensor: torch.Tensor) -> Any:
            if not tensor.requires_grad and _C.shared_slot_kind(tensor) == WRITING:
                reduced = _reduce_slot_tensor(tensor)
                if reduced is not None:
                    return reduced
            return torch_reduce_tensor(tensor)

        if not getattr(pickler.dumps, "tracks_messages", False):  # a forked child inherits the wrapper
            _track_messages(pickler)
        pickler.register(torch.Tensor, reduce_tensor)
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
            warn_pool_not_made(error)


def warn_pool_not_made(error: Exception) -> None:
    warn_once("pool", f"the shared slots could not be made ({error}); workers write batches into fresh "
              "shared memory instead (slower). Switch them off with FASTCOLLATE_SHARED_SLOTS=0.")


os.register_at_fork(before=_before_fork)
