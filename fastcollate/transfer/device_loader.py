"""DeviceLoader: batches to the GPU as one host-to-device copy each, on a side stream, overlapped with
compute.

For every batch: its tensors sit in one pinned staging slot (``assemble`` in the main process writes
there directly; a batch ``assemble`` wrote in a worker arrives in a shared slot this process
page-locked; a batch in fresh shared memory, or from ``default_collate``, is packed into one with a
multi-threaded copy), one ``cudaMemcpyAsync`` moves the slot to the device on a dedicated copy
stream, optional transforms run there, and the consumer's stream waits only on that batch's event.
``depth`` batches are kept in flight. A slot is reused only after its copy's event has completed and
no tensor references it; device memory is tied to the consumer stream with ``record_stream``.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import record_function

from .._ext import _C
from ..structure import jagged, tree
from . import worker_slots
from .hidden_tensors import copy_out_hidden
from .small_fields import SMALL_FIELD_BYTES, needs_own_storage
from .staging import StagingRing, slot_holding, staging_in
from .transforms import apply_to_fields
from .worker_diagnosis import name_the_waited_worker

__all__ = ["DeviceLoader"]


def _read_through(name: str) -> property:
    """A read-only attribute of the wrapped loader, so code that reaches through a DataLoader
    (``loader.sampler.set_epoch(epoch)``, Lightning's sampler hooks, ``len(loader.dataset)``) works on
    the DeviceLoader wrapping it."""

    def get(self: DeviceLoader) -> Any:
        try:
            return getattr(self.loader, name)
        except AttributeError:
            raise AttributeError(
                f"DeviceLoader: the wrapped loader ({type(self.loader).__name__}) has no {name!r}"
            ) from None

    return property(get, doc=f"The wrapped loader's ``{name}``.")


def device_fields(device_bytes: torch.Tensor, host: list[torch.Tensor],
                   offsets: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The device tensors of ``host`` (at ``offsets`` in ``device_bytes``, the batch's one copy), and
    those of them that got storage of their own. A small field of a large batch (ids, labels, lengths:
    ``small_fields.needs_own_storage``) is cloned, so that keeping it for metrics does not keep the
    whole batch (its images) on the device; every other field is a view of the one copy. Runs on the
    copy stream, after the copy."""
    batch_bytes = device_bytes.numel()
    fields, clones = [], []
    for leaf, offset in zip(host, offsets, strict=True):
        field = device_bytes[offset : offset + leaf.nbytes].view(leaf.dtype).view(leaf.shape)
        if needs_own_storage(leaf.nbytes, batch_bytes):
            field = field.clone()
            clones.append(field)
        fields.append(field)
    return fields, clones


def _wait_for_copies(unpooled: deque) -> None:
    """Lets the host buffers that DeviceLoader's copies still read go only once those copies ran: run
    when a DeviceLoader is dropped without ``close()`` (and at exit), as the staging ring's destructor
    waits for its slots' copies. Without it a worker's shared slot would be free at once, and a sibling
    loader sharing the Assembler could have a worker write into it while the DMA still reads it."""
    while unpooled:
        event, _ = unpooled[0]
        with contextlib.suppress(Exception):  # at exit the CUDA runtime may be gone: nothing to wait for
            event.synchronize()
        unpooled.popleft()


@dataclass
class _Staged:
    batch: Any
    ready: torch.cuda.Event | None = None
    device_tensors: list[torch.Tensor] = field(default_factory=list)
    loader_state: Any = None  # the wrapped loader's state_dict() just after it gave this batch


class DeviceLoader:
    """Wraps an iterable of batches and yields them on ``device``, ``depth`` batches ahead.

    Args:
        loader: any iterable of batches: a DataLoader with ``collate_fn=fastcollate.assemble`` (best: no
            extra host copy with ``num_workers=0``), or with ``default_collate``; any nesting of dicts,
            lists, tuples and namedtuples. Non-tensor leaves (ids, strings) pass through unchanged.
        device: ``"cuda"``, ``"cuda:N"``, or ``"cpu"`` (batches pass through; transforms still run).
        depth: batches copied ahead of the one being consumed.
        transforms: field name (a top-level key of mapping batches) to a callable run on the device
            after the copy, on the copy stream, e.g. ``{"image": fastcollate.Normalize(mean, std)}``.
        record_copy_events: keep a timing CUDA event pair (start, end) for each copy in
            ``copy_events``, so copy intervals can be laid against compute intervals.

    ``dataset``, ``sampler``, ``batch_sampler``, ``batch_size`` and ``num_workers`` are the wrapped
    loader's, and ``len()`` is its length. Any iterable works: a DataLoader, a torchdata.nodes
    ``Loader``, an SPDL ``Pipeline`` (iterated inside its ``auto_stop()``). A loader with
    ``state_dict``/``load_state_dict`` (torchdata's ``Loader``, ``StatefulDataLoader``) is resumable
    through this one: ``state_dict()`` is its state at the batch last handed out (see ``_state_dict``).
    """

    dataset = _read_through("dataset")
    sampler = _read_through("sampler")
    batch_sampler = _read_through("batch_sampler")
    batch_size = _read_through("batch_size")
    num_workers = _read_through("num_workers")

    def __init__(
        self,
        loader: Iterable,
        device: str | torch.device = "cuda",
        depth: int = 2,
        transforms: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
        record_copy_events: bool = False,
    ) -> None:
        if depth < 1:
            raise ValueError(f"DeviceLoader: depth must be >= 1, got {depth}")
        self.loader = loader
        self.device = torch.device(device)
        self.depth = depth
        self.transforms = dict(transforms or {})
        self.copy_events: deque[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
        self._copy_stream: torch.cuda.Stream | None = None
        self._ring: StagingRing | None = None
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    "DeviceLoader: device 'cuda' was asked for but no CUDA device is visible. "
                    "Use device='cpu' to pass batches through unchanged."
                )
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self._copy_stream = torch.cuda.Stream(self.device)
            # One slot per batch in flight: a slot frees as soon as its copy ends (the host batch is
            # dropped when staged), and acquire waits for that copy rather than allocate past the bound.
            self._ring = StagingRing(max_slots=depth, pinned=True, device=self.device)
            if record_copy_events:
                self.copy_events = deque(maxlen=4096)
        elif self.device.type != "cpu":
            raise ValueError(f"DeviceLoader: device must be 'cuda' or 'cpu', got {self.device}")
        self._counts = {"batches": 0, "host_packs": 0, "direct_from_slot": 0, "small_field_clones": 0,
                        "small_fields_apart": 0, "hidden_pinned_copies": 0}
        # Host buffers from outside the ring (it overflowed, or a worker's shared slot) that a copy may
        # still read: each is kept with the event recorded after its copy until that event completes,
        # also when this loader is dropped without close() (the finalizer waits for the events).
        self._unpooled: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()
        self._finalizer = weakref.finalize(self, _wait_for_copies, self._unpooled)
        self._closed = False
        # The wrapped loader's state as of the batch last handed out (None: before any iteration).
        self._state_handed_out: Any = None
        self._tracks_state = callable(getattr(loader, "state_dict", None))
        # state_dict and load_state_dict exist only where the wrapped loader has them, as attributes of
        # this instance: code that checks for the stateful protocol (Lightning's CombinedLoader, with
        # hasattr or a static lookup) must find a plain DataLoader's DeviceLoader not stateful. Bound
        # through a weak reference, so that a dropped DeviceLoader is finalized at once, not by the GC.
        if self._tracks_state:
            self.state_dict = _weakly_bound(self, DeviceLoader._state_dict)
        if callable(getattr(loader, "load_state_dict", None)):
            self.load_state_dict = _weakly_bound(self, DeviceLoader._load_state_dict)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]  (TypeError when the loader has no length)

    def set_epoch(self, epoch: int) -> None:
        """Tells the wrapped loader the epoch, before iterating it: a ``DistributedSampler`` shuffles by
        it, and without it every epoch repeats the first one's order. The loader's own ``set_epoch``
        when it has one; else that of its sampler, its batch sampler and the batch sampler's sampler
        (each that has one, as Lightning does). A loader with none of them shuffles without an epoch
        (a ``RandomSampler``), so nothing is told."""
        if callable(getattr(self.loader, "set_epoch", None)):
            self.loader.set_epoch(epoch)
            return
        batch_sampler = getattr(self.loader, "batch_sampler", None)
        candidates = (
            getattr(self.loader, "sampler", None),
            batch_sampler,
            getattr(batch_sampler, "sampler", None),
        )
        told: set[int] = set()
        for sampler in candidates:
            if callable(getattr(sampler, "set_epoch", None)) and id(sampler) not in told:
                told.add(id(sampler))
                sampler.set_epoch(epoch)

    def _state_dict(self) -> dict[str, Any]:
        """The wrapped loader's state as of the batch this loader last handed out (a copy taken when the
        loader gave it). The loader itself is ``depth`` batches further on (they are staged here): its own
        state would skip them on resume. Before any iteration, the loader's current state; after the last
        batch of an epoch, its state at the epoch's end."""
        if self._state_handed_out is None:
            return self.loader.state_dict()
        return self._state_handed_out

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Passes ``state_dict`` (from ``state_dict()``) to the wrapped loader, which resumes from it on
        the next ``iter()``."""
        self.loader.load_state_dict(state_dict)
        self._state_handed_out = None

    def _loader_state(self) -> Any:
        """A copy of the wrapped loader's state now: a loader may hand out its own dict and change it as it
        goes on, which would move a recorded state forward to where the loader is (deepcopy: about 6 us
        for torchdata.nodes' state; a StatefulDataLoader's own state_dict costs more)."""
        return copy.deepcopy(self.loader.state_dict())

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise RuntimeError("DeviceLoader: iterated after close()")
        return _DeviceIterator(self)

    def close(self) -> None:
        """Waits for copies in flight, then releases the copy stream and the pinned slots."""
        if self._closed:
            return
        self._closed = True
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        self._unpooled.clear()
        self._finalizer.detach()
        if self._ring is not None:
            self._ring.trim()
        self._ring = None
        self._copy_stream = None

    def __enter__(self) -> DeviceLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        """batches handed out; host_packs (batches copied into a slot on the host) and
        direct_from_slot (batches already in a pinned slot: this ring's, or a worker's shared one);
        small_field_clones (small fields of large batches given device storage of their own);
        small_fields_apart (small fields that arrived beside a batch's slot, copied on their own);
        hidden_pinned_copies (tensors inside leaves DeviceLoader does not open, copied out of page-locked
        slots); pinned_bytes held and pinned_allocations made."""
        ring = self._ring.stats() if self._ring is not None else None
        return {
            **self._counts,
            "pinned_bytes": ring.bytes_held if ring else 0,
            "pinned_allocations": ring.slot_allocations + ring.overflow_allocations if ring else 0,
            "pinned_slots": ring.slots if ring else 0,
            "waits_for_copies": ring.waits_for_copies if ring else 0,
            "slot_regrowths": ring.regrowths if ring else 0,
            "unpooled_in_flight": len(self._unpooled),
        }

    # Staging and hand-over, on the producing side and the consuming side of one batch.

    def _release_copied(self) -> None:
        """Lets go of the host buffers whose copies have run (in order: each copy's event follows the one
        before it on the copy stream)."""
        while self._unpooled and self._unpooled[0][0].query():
            self._unpooled.popleft()

    def _next_from(self, source: Iterator[Any]) -> Any:
        ring = self._ring
        # Before waiting for the next batch: a worker may need one of these shared slots to write it
        # (with few slots, holding them through the wait would send it to fresh shared memory).
        self._release_copied()
        with staging_in(ring) if ring is not None else contextlib.nullcontext():
            return next(source)

    def _stage(self, batch: Any) -> _Staged:
        """Starts ``batch``'s copy to the device on the copy stream: its tensors as one copy from a
        pinned slot (small fields apart, each as its own copy, when they arrived beside a worker's slot),
        then the transforms; ``ready`` is recorded after them."""
        if self._copy_stream is None:
            return _Staged(apply_to_fields(batch, self.transforms))
        leaves, rebuild = tree.flatten(batch)
        count = len(leaves)
        # A jagged tensor crosses as its values and offsets, in the same one copy, and is made again there.
        leaves, jagged_places = jagged.split(leaves)
        host = [i for i, leaf in enumerate(leaves)
                if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu"]
        staged = _Staged(batch)
        stream = self._copy_stream
        self._release_copied()
        self._copy_out_hidden_tensors(leaves)
        with torch.cuda.stream(stream):
            host = self._send_small_fields_apart(leaves, host, staged)
            if host:
                self._send_through_one_slot(leaves, host, staged)
            out = rebuild(jagged.join(leaves, jagged_places, count))
            del leaves, batch  # the host batch may go: its slot is guarded by the copy's event
            staged.batch = self._transformed(out, staged)
            staged.ready = torch.cuda.Event()
            staged.ready.record(stream)
        return staged

    def _copy_out_hidden_tensors(self, leaves: list[Any]) -> None:
        """Copies out of recycled page-locked memory the tensors the fetch handed out there that the
        batch does not show (inside a custom leaf): see ``hidden_tensors.copy_out_hidden``. Searched only
        when some are hidden: searching custom leaves costs (they may lead to a vocabulary, a dataset),
        counting the ones the batch shows does not."""
        seen = sum(isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu" and self._direct_slot(leaf)
                   for leaf in leaves)
        hidden, self._ring.views_handed_out = self._ring.views_handed_out - seen, 0
        if hidden > 0:
            self._counts["hidden_pinned_copies"] += copy_out_hidden(leaves, self._direct_slot, hidden)

    def _send_small_fields_apart(self, leaves: list[Any], host: list[int], staged: _Staged) -> list[int]:
        """Copies to the device, each on its own, the small fields that arrived beside the batch's slot
        (see ``_small_fields_apart``), replacing them in ``leaves``; returns the host positions left for
        the one copy from the slot."""
        apart = self._small_fields_apart([leaves[i] for i in host]) if host else []
        for k in apart:
            # From pageable memory: the driver has read the source when the call returns.
            leaves[host[k]] = leaves[host[k]].to(self.device, non_blocking=True)
            staged.device_tensors.append(leaves[host[k]])
        self._counts["small_fields_apart"] += len(apart)
        return [i for k, i in enumerate(host) if k not in apart]

    def _send_through_one_slot(self, leaves: list[Any], host: list[int], staged: _Staged) -> None:
        """Copies the host tensors at ``host`` to the device as one copy from their slot (packed into
        one first if they are not in one), replacing them in ``leaves`` with their device fields."""
        buffer, offsets = self._into_slot([leaves[i] for i in host])
        nbytes = max(offset + leaves[i].nbytes for i, offset in zip(host, offsets, strict=True))
        device_bytes = self._copy_slot(buffer, nbytes)
        fields, clones = device_fields(device_bytes, [leaves[i] for i in host], offsets)
        for i, device_field in zip(host, fields, strict=True):
            leaves[i] = device_field
        # The clones were made on the copy stream too: tied to the consumer's like the batch.
        staged.device_tensors.append(device_bytes)
        staged.device_tensors.extend(clones)
        self._counts["small_field_clones"] += len(clones)

    def _copy_slot(self, buffer: torch.Tensor, nbytes: int) -> torch.Tensor:
        """New device memory holding ``buffer``'s first ``nbytes``, copied on the copy stream; the
        buffer is kept untouched (a ring slot) or alive (any other) until that copy has run."""
        stream = self._copy_stream
        device_bytes = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self.copy_events is not None:
            # After the allocation: the interval is the copy's, for h2d_efficiency.
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
        device_bytes.copy_(buffer[:nbytes], non_blocking=True)
        if self.copy_events is not None:
            end.record(stream)
            self.copy_events.append((start, end))
        if not self._ring.hold_until_stream_done(buffer, stream):  # a slot stays untouched until then
            copied = torch.cuda.Event()
            copied.record(stream)
            self._unpooled.append((copied, buffer))  # not the ring's: keep it alive until then
        return device_bytes

    def _transformed(self, batch: Any, staged: _Staged) -> Any:
        """``batch`` with the transforms applied on the copy stream; the CUDA tensors they made are
        added to those ``staged`` ties to the consumer's stream."""
        out = apply_to_fields(batch, self.transforms)
        if self.transforms:
            # A transform may return any nesting of tensors, on any device: only CUDA tensors made
            # on the copy stream need tying to the consumer's stream.
            staged.device_tensors.extend(
                leaf for key in self.transforms for leaf in tree.flatten(out[key])[0]
                if isinstance(leaf, torch.Tensor) and leaf.is_cuda
            )
        return out

    def _direct_slot(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` is in a slot a copy can read directly: this ring's, or a shared slot a
        worker wrote and this process page-locked when it received the batch."""
        return self._ring.owns(tensor) or _C.shared_slot_kind(tensor) == worker_slots.PAGE_LOCKED

    def _small_fields_apart(self, tensors: list[torch.Tensor]) -> list[int]:
        """The positions of the small tensors beside a batch in a direct slot: a worker sends a large
        batch's small fields by value (worker_slots), so they arrive with storage of their own. Each
        crosses as its own small copy and the rest of the batch as one from its slot, instead of packing
        the whole batch on the host. Empty unless every tensor outside the slot is small and pageable."""
        largest = max(tensors, key=lambda t: t.nbytes)
        if not self._direct_slot(largest):
            return []
        in_slot = largest.untyped_storage().data_ptr()
        outside = [k for k, t in enumerate(tensors) if t.untyped_storage().data_ptr() != in_slot]
        # Pageable ones only: a copy from page-locked memory (another slot) still reads it after the call
        # returns, and nothing would hold that memory until then. Those are packed with the rest.
        small_and_pageable = all(tensors[k].nbytes <= SMALL_FIELD_BYTES and not tensors[k].is_pinned()
                                 for k in outside)
        return outside if small_and_pageable else []

    def _into_slot(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """The slot holding ``tensors`` and their byte offsets: the one ``assemble`` already wrote them
        into, or one they are packed into now."""
        # A slot of this ring, or a shared slot a worker wrote and this process page-locked when it
        # received the batch (kept alive by the caller until the copy's event completes).
        held = slot_holding(tensors, self._direct_slot)
        if held is not None:
            self._counts["direct_from_slot"] += 1
            return held
        self._counts["host_packs"] += 1
        return self._ring.pack(tensors)

    def _hand_over(self, staged: _Staged) -> Any:
        if staged.ready is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(staged.ready)
            for tensor in staged.device_tensors:
                # Made on the copy stream, used on the consumer's: the allocator must not reuse the
                # memory until the consumer's work on it is done.
                tensor.record_stream(consumer)
        self._counts["batches"] += 1
        if self._tracks_state:
            self._state_handed_out = staged.loader_state
        return staged.batch


def _weakly_bound(owner: DeviceLoader, method: Callable) -> Callable:
    proxy = weakref.proxy(owner)

    def bound(*args: Any, **kwargs: Any) -> Any:
        return method(proxy, *args, **kwargs)

    bound.__doc__ = method.__doc__
    bound.__name__ = method.__name__.lstrip("_")
    return bound


class _DeviceIterator:
    """One epoch: keeps ``depth`` batches staged ahead of the consumer.

    Safe to share between threads: each batch goes to exactly one caller of ``next``, in order (the
    source, a DataLoader iterator say, is only ever called by one thread at a time).
    """

    def __init__(self, owner: DeviceLoader) -> None:
        self.owner = owner
        self.source = iter(owner.loader)
        if owner._tracks_state:  # a new epoch (or a resumed one) starts from here
            owner._state_handed_out = owner._loader_state()
        self.end_state: Any = None  # the loader's state once it is exhausted (when tracked)
        self.staged: deque[_Staged] = deque()
        self.error: BaseException | None = None  # raised once the batches before it are delivered
        self.exhausted = False
        self._lock = threading.Lock()

    def __iter__(self) -> _DeviceIterator:
        return self

    def __next__(self) -> Any:
        with self._lock:
            return self._next_locked()

    def _next_locked(self) -> Any:
        self._fill()
        if not self.staged:
            if self.error is not None:
                error, self.error = self.error, None
                raise error
            if self.end_state is not None:  # every batch handed out: resume at the next epoch
                self.owner._state_handed_out = self.end_state
            raise StopIteration
        batch = self.owner._hand_over(self.staged.popleft())
        self._fill()  # queue the next copy now, so it overlaps the consumer's compute on this batch
        return batch

    def _fill(self) -> None:
        owner = self.owner
        while not self.exhausted and self.error is None and len(self.staged) < owner.depth:
            if owner._closed:
                raise RuntimeError("DeviceLoader: closed while iterating")
            with record_function("batch_wait"):
                try:
                    batch = owner._next_from(self.source)
                except StopIteration:
                    self.exhausted = True
                    if owner._tracks_state:
                        self.end_state = owner._loader_state()
                    return
                except Exception as error:  # the loader's own error, delivered in order
                    name_the_waited_worker(error, self.source)
                    self.error = error
                    return
            state = owner._loader_state() if owner._tracks_state else None
            with record_function("h2d_transfer"):
                staged = owner._stage(batch)
            staged.loader_state = state
            self.staged.append(staged)
