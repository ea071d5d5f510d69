"""assemble: the collate function. A drop-in for ``default_collate`` with errors that name the sample
and field, and, configured with a Contract, a checked one. It sits above the collate's planning
(fastcollate.collate) and the places a batch goes (fastcollate.transfer), and joins the two.

The batch is walked and checked once in C++ (no Python per sample), then copied into one buffer with
the GIL released: in the main process a reusable staging-ring slot; inside a DataLoader worker a slot
shared with the main process (fastcollate.transfer.worker_slots), which reaches it with no copy and no new
mapping, or fresh shared memory when no slot is free.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from torch.utils.data import get_worker_info

from ._ext import _C
from .collate import gather
from .collate.contract import Contract
from .collate.errors import ContractEmptyError
from .data.arrays import ArrayBatch, Arrays
from .data.mapped_files import is_read_fault, read_fault_error
from .structure import jagged
from .transfer import delivery, worker_slots
from .transfer.staging import StagingRing

__all__ = ["Assembler", "assemble"]


class Assembler:
    """A collate function. ``fastcollate.assemble`` is the default one; ``.using(...)`` configures another.

    Args:
        contract: checked against every sample before anything is copied; None for drop-in mode, which
            checks each sample against the batch's first one, as default_collate implicitly does.
        id_key: the mapping key (or attribute) holding each sample's id, to name samples in errors.
            Defaults to the contract's id field, else ``"id"``.
        ring: the main-process staging ring; None for this process's default one.
        shared_slots: DataLoader workers write batches into slots shared with the main process (no copy,
            no new mapping per batch); False, or ``FASTCOLLATE_SHARED_SLOTS=0``, gives each batch fresh
            shared memory instead, as default_collate does.
        max_shared_slots: the most slots one DataLoader's workers use at once; None for
            ``2 x num_workers + 4`` (DataLoader's default prefetch_factor, DeviceLoader's default depth and
            two batches the consumer holds). Loaders sharing the Assembler (a Trainer's train and eval
            loaders) each get theirs: the workers share a bound that is the sum over the loaders whose
            workers are alive. Past it a batch gets fresh shared memory, with one warning.

    Instances are picklable (they cross to spawned workers, with the shared slots' descriptor); the
    compiled state is rebuilt there.
    """

    def __init__(
        self,
        contract: Contract | None = None,
        *,
        id_key: str | None = None,
        ring: StagingRing | None = None,
        shared_slots: bool = True,
        max_shared_slots: int | None = None,
    ) -> None:
        if max_shared_slots is not None and not 1 <= max_shared_slots <= worker_slots.MAX_CAPACITY:
            raise ValueError(
                f"Assembler: max_shared_slots must be in [1, {worker_slots.MAX_CAPACITY}] (a pool's room) "
                f"or None, got {max_shared_slots}"
            )
        self.contract = contract
        self.id_key = id_key or (contract.id if contract is not None and contract.id else "id")
        self.ring = ring
        self.shared_slots = shared_slots
        self.max_shared_slots = max_shared_slots
        self._collator = None
        # Arrays datasets' columns as the gather reads them (gather.gatherer), or False for the per-sample
        # path: chosen once per dataset.
        self._gatherers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._slots: worker_slots.SlotPool | None = None
        worker_slots.track(self)

    def using(self, contract: Contract | None = None, **options: Any) -> Assembler:
        """A collate function that enforces ``contract``; ``options`` are Assembler's keyword arguments
        (``id_key``, ``ring``, ``shared_slots``, ``max_shared_slots``)."""
        return Assembler(contract, **options)

    def prepare_shared_slots(self) -> worker_slots.SlotPool | None:
        """Makes (or keeps) the pool of slots this process's workers write into; None when switched off.
        Runs when workers start: before a fork, and when pickled for a spawned worker."""
        if not worker_slots.slots_switched_on(self.shared_slots):
            return None
        capacity = worker_slots.capacity_for(self.max_shared_slots)
        with worker_slots.preparing:
            self._slots = worker_slots.for_workers(self._slots, capacity)
            return self._slots

    def shared_slot_stats(self) -> worker_slots.SharedSlotStats | None:
        """The state of the slots shared with this process's workers; None before any worker started."""
        return self._slots.stats() if self._slots is not None and self._slots.owned_here() else None

    def __call__(self, batch: Sequence[Any]) -> Any:
        if len(batch) == 0:
            raise ContractEmptyError(
                sample_id=None, position=None, field="<batch>", expected="at least one sample",
                got="an empty batch", hint="a batch needs samples to take its structure from",
                id_key=self.id_key,
            )
        arrays = None
        if isinstance(batch, ArrayBatch) and not batch.read:  # samples read may have been changed since
            arrays = batch.dataset
            arrays.check_files(batch.indices)  # before anything reads a mapped file, gathered or walked
            plan = self._gathered_plan(batch)
            if plan is not None:
                # Not through deliver: the ring's overflow warning counts the frames up to the caller.
                return self._nested(self._execute(plan, arrays))
            batch = batch.rows()  # what the column-wise path does not cover: the samples, walked
        if self._collator is None:
            specs = self.contract.native_specs() if self.contract is not None else []
            self._collator = _C.Collator(self.id_key, specs, self.contract is not None)
        return self._nested(self._execute(self._collator.plan(batch), arrays))

    def deliver(self, plan: Any, arrays: Arrays | None = None, into: StagingRing | None = None) -> Any:
        """A planned batch (a ``_C.BatchPlan``, walked or gathered) copied where this collate's batches go,
        in the structure they come out in; ``arrays``: the dataset it reads, to name a file that faulted.
        ``into``: a ring to write the whole batch into one slot of instead (small fields too), for a caller
        that copies that slot on at once."""
        return self._nested(self._execute(plan, arrays, into))

    def _gathered_plan(self, batch: ArrayBatch) -> Any:
        """An Arrays batch's plan, gathered column by column (fastcollate.collate.gather), or None when the
        per-sample path must collate it. The columns are chosen once per dataset."""
        dataset = batch.dataset
        try:
            gather_columns = self._gatherers.get(dataset)
        except TypeError:  # a dataset class that is not hashable: nothing kept
            gather_columns = None
        if gather_columns is None:
            gather_columns = gather.gatherer(dataset, self.contract, self.id_key) or False
            try:
                self._gatherers[dataset] = gather_columns
            except TypeError:
                pass
        return gather_columns.plan(batch.index_tensor) if gather_columns else None

    def _execute(self, plan: Any, arrays: Arrays | None = None, into: StagingRing | None = None) -> Any:
        """``plan`` run where fastcollate.transfer.delivery places this collate's batches. A read of
        ``arrays``' mapped files that faulted becomes a MappedFileError naming them (the column, when the
        gather knows it)."""
        try:
            # stacklevel 3: the caller of __call__ or deliver, through them and this method.
            return delivery.place(plan, ring=self.ring, slots=self._slots, shared_slots=self.shared_slots,
                                  max_shared_slots=self.max_shared_slots, into=into, stacklevel=3)
        except (RuntimeError, IndexError) as error:
            key = plan.failed_key or None  # the column whose gather raised, if one did
            if is_read_fault(error):
                named = read_fault_error(error) if arrays is None else arrays.read_fault(error, key)
                raise named from error
            if key is not None and arrays is not None:
                raise arrays.columns[key].named(error) from error
            raise

    def _nested(self, out: Any) -> Any:
        contract = self.contract
        if contract is None or contract.packing is None or not contract.packing.nested:
            return out
        parent, keys = contract.packed_fields()
        max_length = contract.packing.max_length
        longest = max_length[0] if max_length else None
        return jagged.nest(out, parent, keys, contract.packing.cu_seq_lens[0], longest)

    def __getstate__(self) -> dict:
        # The compiled collator is per process; a ring is bound to this process's memory. A worker being
        # started gets the shared slots' descriptor.
        state = {"contract": self.contract, "id_key": self.id_key, "shared_slots": self.shared_slots,
                 "max_shared_slots": self.max_shared_slots}
        if worker_slots.being_spawned() and get_worker_info() is None:
            try:
                slots = self.prepare_shared_slots()
            except Exception as error:  # noqa: BLE001 - a failed pool must not fail the worker: batches fall back
                worker_slots.warn_pool_not_made(error)
                slots = None
            if slots is not None:
                state["slots"] = slots.handle_for_child()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["contract"], id_key=state["id_key"], shared_slots=state.get("shared_slots", True),
                      max_shared_slots=state.get("max_shared_slots"))
        if "slots" in state:
            self._slots = worker_slots.SlotPool.attach(state["slots"])

    def __repr__(self) -> str:
        what = "drop-in" if self.contract is None else f"{len(self.contract.fields)}-field contract"
        return f"fastcollate.Assembler({what}, id_key={self.id_key!r})"


assemble = Assembler()
