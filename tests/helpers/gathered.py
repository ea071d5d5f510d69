"""Whether an Arrays batch is gathered by column or handed to the per-sample walk, as assemble decides."""

from __future__ import annotations

from typing import Any

from fastcollate.collate import gather


def gathered_plan(batch, contract, id_key: str) -> Any:
    """The column gather's plan of ``batch`` (an ArrayBatch), or None when the walk collates it."""
    gatherer = gather.gatherer(batch.dataset, contract, id_key)
    return None if gatherer is None else gatherer.plan(batch.index_tensor)
