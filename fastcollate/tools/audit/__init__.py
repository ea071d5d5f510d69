"""Audit: a ledger of the sample ids (and target digests) a loader actually delivered, epoch by epoch,
and the checks that compare ledgers: missing, duplicated, changed or reordered samples, across workers,
epochs, configurations and ``torch.distributed`` ranks.

    ledger = fastcollate.audit.Ledger(id_key="id", target_key="y")
    for batch in ledger.watch(loader):      # batches pass through unchanged
        ...
    print(fastcollate.audit.check(ledger.last, expected=len(dataset)))

One concept a module: ``workers`` (which worker collated a batch), ``epoch`` (what one pass
delivered), ``column`` (its storage), ``digests`` (stable per-sample digests), ``ledger`` (recording),
``differences`` (the vectorised set arithmetic), ``checks`` (check, compare, compare_loaders),
``report`` (AuditReport), ``distributed`` (check_distributed). ``python -m fastcollate doctor`` is
``fastcollate.audit.doctor`` (its ``checklist``, ``tracing``, ``failures``, ``setting_run`` and
``record_sheet``), imported only when it runs: ``import fastcollate`` does not load the doctor.
"""

from __future__ import annotations

# Also importable from here, outside __all__ as before: TARGET_KEYS (bench and the doctor guess
# targets by it), digest_rows and string_code (bench digests its targets), Order, UNKNOWN_WORKER,
# MAX_NAMED_SOURCES.
from ...collate.ids import TARGET_KEYS  # noqa: F401
from .checks import MAX_NAMED_SOURCES, check, compare, compare_loaders  # noqa: F401
from .digests import digest_rows, string_code  # noqa: F401
from .distributed import check_distributed
from .epoch import Epoch
from .ledger import Ledger
from .report import AuditReport, Order  # noqa: F401
from .workers import MAIN_PROCESS, UNKNOWN_WORKER, TagWorker, WorkerTagged  # noqa: F401

__all__ = [
    "MAIN_PROCESS",
    "AuditReport",
    "Epoch",
    "Ledger",
    "TagWorker",
    "WorkerTagged",
    "check",
    "check_distributed",
    "compare",
    "compare_loaders",
]

