"""assemble: the collate function. A drop-in for ``default_collate`` with errors that name the sample
and field, and, configured with a Contract, a checked one.

The batch is walked and checked once in C++ (no Python per sample), then copied into one buffer with
the GIL released: shared memory inside a DataLoader worker (so the batch reaches the main process with
no further copy, as with default_collate), a reusable staging-ring slot in the main process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import get_worker_info

from ._ext import _C
from .contract import Contract
from .errors import ContractEmptyError
from .staging import StagingRing, main_process_ring

__all__ = ["Assembler", "assemble"]


def _shared_memory_buffer(nbytes: int) -> torch.Tensor:
    storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))


class Assembler:
    """A collate function. ``fastcollate.assemble`` is the default one; ``.using(...)`` configures another.

    Args:
        contract: checked against every sample before anything is copied; None for drop-in mode, which
            checks each sample against the batch's first one, as default_collate implicitly does.
        id_key: the mapping key (or attribute) holding each sample's id, to name samples in errors.
            Defaults to the contract's id field, else ``"id"``.
        ring: the main-process staging ring; None for this process's default one.

    Instances are picklable (they cross to spawned workers); the compiled state is rebuilt there.
    """

    def __init__(
        self, contract: Contract | None = None, *, id_key: str | None = None, ring: StagingRing | None = None
    ) -> None:
        self.contract = contract
        self.id_key = id_key or (contract.id if contract is not None and contract.id else "id")
        self.ring = ring
        self._collator = None

    def using(
        self, contract: Contract | None = None, *, id_key: str | None = None, ring: StagingRing | None = None
    ) -> Assembler:
        """A collate function that enforces ``contract`` (and/or reads ids from ``id_key``)."""
        return Assembler(contract, id_key=id_key, ring=ring)

    def __call__(self, batch: Sequence[Any]) -> Any:
        if len(batch) == 0:
            raise ContractEmptyError(
                sample_id=None, position=None, field="<batch>", expected="at least one sample",
                got="an empty batch", hint="a batch needs samples to take its structure from",
                id_key=self.id_key,
            )
        if self._collator is None:
            specs = self.contract.native_specs() if self.contract is not None else []
            self._collator = _C.Collator(self.id_key, specs, self.contract is not None)
        if get_worker_info() is not None:
            plan = self._collator.plan(batch)
            return plan.execute(_shared_memory_buffer(plan.nbytes))
        ring = self.ring or main_process_ring()  # DeviceLoader's, if active
        out, overflowed = self._collator.assemble_into(batch, ring._native)
        if overflowed:
            ring.warn_overflow()
        return out

    def __getstate__(self) -> dict:
        # The compiled collator is per process; a ring is bound to this process's memory.
        return {"contract": self.contract, "id_key": self.id_key}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["contract"], id_key=state["id_key"])

    def __repr__(self) -> str:
        what = "drop-in" if self.contract is None else f"{len(self.contract.fields)}-field contract"
        return f"fastcollate.Assembler({what}, id_key={self.id_key!r})"


assemble = Assembler()
