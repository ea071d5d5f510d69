"""fastcollate: from Dataset samples to a GPU batch, correct by contract and as fast as the hardware allows.

    from fastcollate import assemble
    loader = DataLoader(dataset, batch_size=256, collate_fn=assemble)

The package mirrors csrc/: ``collate`` (the contract, the walk and the column gather), ``data`` (Arrays,
Arrow and mapped files, the samplers), ``transfer`` (staging, the workers' shared slots, DeviceLoader,
device transforms) and ``integrations`` (Lightning, thread pipelines). ``tools`` (the audit, bench,
profile, doctor and the CLI) is apart: importing fastcollate loads none of it; the audit's public names
below load it when first used.
"""

import importlib

from ._ext import _C  # noqa: F401  (first: a missing build says how to fix it)
from .assembler import Assembler, assemble
from .collate.contract import Contract, Field, Packing
from .collate.errors import ContractError
from .collate.ids import IdentifiedSample, with_ids
from .data.arrays import Arrays
from .data.columns import Chunked, Ragged
from .data.index_batches import IndexBatches
from .data.mapped_files import MappedFileError
from .data.sampler_state import sampler_state
from .data.token_batches import TokenBudgetBatches
from .data.token_windows import TokenWindows
from .integrations.thread_pipelines import fetch_batches
from .transfer.device_loader import DeviceLoader
from .transfer.staging import StagingRing
from .transfer.transforms import Normalize

__all__ = [
    "Arrays",
    "Assembler",
    "AuditReport",
    "Contract",
    "ContractError",
    "DeviceLoader",
    "Field",
    "IdentifiedSample",
    "IndexBatches",
    "Ledger",
    "MappedFileError",
    "Normalize",
    "Packing",
    "Chunked",
    "Ragged",
    "StagingRing",
    "TagWorker",
    "TokenBudgetBatches",
    "TokenWindows",
    "assemble",
    "audit",
    "fetch_batches",
    "sampler_state",
    "with_ids",
]

__version__ = "0.1.0"

_FROM_THE_AUDIT = ("AuditReport", "Ledger", "TagWorker")


def __getattr__(name: str):
    # The audit is a tool: it loads when a program first names it, not with the collate.
    if name in _FROM_THE_AUDIT:
        return getattr(importlib.import_module(".audit", __name__), name)
    if name == "audit":
        return importlib.import_module(".audit", __name__)
    raise AttributeError(f"module 'fastcollate' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
