"""The check every run passes or is flagged by: the ids (and targets) an epoch delivered against those of
the reference epoch (default_collate, 0 workers), through ``fastcollate.audit.compare``."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .. import audit

__all__ = ["Delivered", "compare_to_reference"]


@dataclasses.dataclass
class Delivered:
    """What an epoch delivered, in delivery order: every batch's ids, and its targets where each id had
    one (None otherwise)."""

    ids: np.ndarray
    targets: np.ndarray | None = None


def compare_to_reference(
    run: Delivered, reference: Delivered, asked_samples: int | None = None
) -> dict[str, Any]:
    """Same ids, each once, and, where both have them, the same target for each id
    (``fastcollate.audit.compare``).

    A run asked for the first ``asked_samples`` of the subset is held to the reference's first that
    many: the reference (workers=0, in order) delivers the subset in its order. ``duplicated`` counts
    the surplus copies of ids delivered more than once, ``unexpected`` the ids the reference (so
    held) lacks, ``targets_mismatched`` the ids delivered with another target than the reference's.
    """
    targets, reference_targets = run.targets, reference.targets
    if targets is not None and reference_targets is not None:  # compared by value, as == does
        common = np.result_type(targets, reference_targets)
        targets, reference_targets = targets.astype(common), reference_targets.astype(common)
    expected = _epoch(reference.ids, reference_targets, asked_samples)
    report = audit.compare(expected, _epoch(run.ids, targets), order="any")
    duplicated = sum(count - 1 for count in report.duplicated.values())
    return {
        "lost": len(report.missing),
        "duplicated": duplicated,
        "unexpected": len(report.unexpected),
        "targets_mismatched": len(report.changed_targets),
        "lost_ids": report.missing[:10],
        "duplicated_ids": list(report.duplicated)[:10],
        "unexpected_ids": report.unexpected[:10],
        "order_matches": bool(np.array_equal(run.ids, reference.ids)),
        "match": report.ok,
    }


def _epoch(ids: np.ndarray, targets: np.ndarray | None, limit: int | None = None) -> audit.Epoch:
    """A run's ids and targets (the first ``limit``) as an audit epoch, targets as their digests."""
    ids = np.asarray(ids[:limit], dtype=np.int64)
    digests = None if targets is None else audit.digest_rows(targets[:limit], ids.size)
    return audit.Epoch(ids=ids, digests=digests)
