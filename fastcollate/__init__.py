"""fastcollate: from Dataset samples to a GPU batch, correct by contract and as fast as the hardware allows.

    from fastcollate import assemble
    loader = DataLoader(dataset, batch_size=256, collate_fn=assemble)
"""

from ._ext import _C  # noqa: F401, I001  (first: a missing build says how to fix it)
from . import audit
from .arrays import Arrays
from .columns import Chunked, Ragged
from .token_windows import TokenWindows
from .assemble import Assembler, assemble
from .audit import AuditReport, Ledger, TagWorker
from .contract import Contract, Field, Packing
from .device_loader import DeviceLoader
from .errors import ContractError
from .ids import IdentifiedSample, with_ids
from .mapped_files import MappedFileError
from .index_batches import IndexBatches
from .staging import StagingRing
from .thread_pipelines import fetch_batches
from .token_batches import TokenBudgetBatches
from .transforms import Normalize

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
    "with_ids",
]

__version__ = "0.1.0"
