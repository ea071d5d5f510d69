"""Where a planned batch's memory comes from, decided here alone: in a DataLoader worker a slot shared with
the main process (fastcollate.transfer.worker_slots), else fresh shared memory; in the main process a slot
of the staging ring (fastcollate.transfer.staging), or a ring the caller names."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import get_worker_info

from .._torch_compat import new_shared_storage
from . import worker_slots
from .staging import StagingRing, active_ring, main_process_ring

__all__ = ["place"]


def place(
    plan: Any,
    *,
    ring: StagingRing | None,
    slots: worker_slots.SlotPool | None,
    shared_slots: bool,
    max_shared_slots: int | None,
    into: StagingRing | None = None,
    stacklevel: int,
) -> Any:
    """Runs ``plan`` (a ``_C.BatchPlan``) into the memory its batch goes out in and returns the batch.
    ``ring``: the main process's ring (None: the process's default one); ``slots``, ``shared_slots`` and
    ``max_shared_slots``: a worker's shared slots and their bound (fastcollate.Assembler's); ``into``: a
    ring to write the whole batch into one slot of (small fields too), for a caller that copies that slot
    on at once. ``stacklevel`` points a full ring's warning at the collate function's caller, counted
    from this function's caller (1), as warnings.warn counts."""
    if into is not None:
        return into.execute(plan, small_fields_apart=False, stacklevel=stacklevel + 3)
    if get_worker_info() is not None:
        slot = _claimed_slot(slots, shared_slots, max_shared_slots, plan.nbytes)
        if slot is not None:
            # Small fields stay in the slot: they cross the pipe by value (worker_slots).
            return plan.execute(slot, small_fields_apart=False)
        return plan.execute(_shared_memory_buffer(plan.nbytes), small_fields_apart=True)
    ring = ring or main_process_ring()
    # A batch DeviceLoader stages is dropped once copied: its small fields part on the device instead.
    return ring.execute(plan, small_fields_apart=ring is not active_ring(), stacklevel=stacklevel + 3)


def _claimed_slot(
    slots: worker_slots.SlotPool | None, shared_slots: bool, max_shared_slots: int | None, nbytes: int
) -> torch.Tensor | None:
    if (
        slots is not None
        and worker_slots.slots_switched_on(shared_slots)
        and slots.serves_this_worker()
        and worker_slots.install_reducer()
    ):
        return slots.claim(nbytes, max_shared_slots)
    return None


def _shared_memory_buffer(nbytes: int) -> torch.Tensor:
    storage = new_shared_storage(max(nbytes, 1))
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
