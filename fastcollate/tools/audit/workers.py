"""Which DataLoader worker collated a batch: read in the worker itself and carried with the batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from torch.utils.data import get_worker_info

__all__ = ["MAIN_PROCESS", "UNKNOWN_WORKER", "TagWorker", "WorkerTagged"]

MAIN_PROCESS = -1
"""The worker id recorded for batches collated in the main process (``num_workers=0``)."""
UNKNOWN_WORKER = -2
"""The worker id recorded when a loader's batches carry no worker tag."""


class WorkerTagged(NamedTuple):
    """A batch and the DataLoader worker that collated it (``MAIN_PROCESS`` for the main process).

    A NamedTuple so that DataLoader's pin-memory thread pins the batch inside it.
    """

    worker: int
    batch: Any


class TagWorker:
    """A collate_fn that tags each batch with the worker that made it: ``WorkerTagged(worker, batch)``.

    ``Ledger.watch`` unwraps the tag, so the loop sees the inner collate's batches unchanged. The
    worker is read in the worker itself (``get_worker_info()``), not guessed from the DataLoader's
    round-robin order, which ``in_order=False`` and uneven iterable shards both break.

    Args:
        collate_fn: the collate function to tag; ``fastcollate.assemble`` when None.
    """

    def __init__(self, collate_fn: Callable[[list], Any] | None = None) -> None:
        if collate_fn is None:
            # imported late: the rest of the audit needs no native extension
            from ...assembler import assemble

            collate_fn = assemble
        self.collate_fn = collate_fn

    def __call__(self, samples: list) -> WorkerTagged:
        return WorkerTagged(current_worker(), self.collate_fn(samples))

    def __repr__(self) -> str:
        return f"fastcollate.audit.TagWorker({self.collate_fn!r})"


def current_worker() -> int:
    """The DataLoader worker this code runs in, or ``MAIN_PROCESS``."""
    info = get_worker_info()
    return MAIN_PROCESS if info is None else info.id
