"""The checks that compare ledgers: one epoch against the dataset (``check``), against another epoch
(``compare``) or one loader against another (``compare_loaders``), with what ``drop_last`` and a
sampler's padding account for told apart from real losses and repeats."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from .differences import Differences, copies_by_source, find_differences
from .epoch import Epoch
from .ledger import Ledger, id_codes
from .report import AuditReport, Order

__all__ = ["MAX_NAMED_SOURCES", "as_reference", "check", "compare", "compare_loaders", "reference_size"]

MAX_NAMED_SOURCES = 10_000
"""Duplicated ids whose copies' workers (or ranks) a report names; the rest are counted."""


def compare(
    reference: Epoch | int,
    other: Epoch,
    *,
    order: Order = "same",
    drop_last: bool = False,
    batch_size: int | None = None,
    dataset_size: int | None = None,
    allowed_dropped: int | None = None,
    allowed_repeats: int = 0,
    what: str = "",
    source_kind: str = "worker",
) -> AuditReport:
    """Compares what ``other`` delivered with ``reference``: same ids, once each, same targets.

    Args:
        reference: the epoch taken as right (``num_workers=0``, or the first epoch), or an int ``N``
            for the ids ``0..N-1`` in any order (what ``with_ids`` gives a dataset of N samples).
        other: the epoch to check.
        order: ``"same"`` (a different order is a failure: workers with ``in_order=True``),
            ``"shuffled"`` (a different order is expected; the same one is noted) or ``"any"``.
        drop_last, batch_size, dataset_size: how many samples ``drop_last`` may leave out
            (``dataset_size % batch_size``); those are reported as ``dropped``, not ``missing``.
        allowed_dropped: overrides that count (an IterableDataset drops up to one partial batch per
            worker; a DistributedSampler drops its own tail).
        allowed_repeats: surplus copies a sampler's padding accounts for (``check_distributed``).
        what: the report's title.
        source_kind: what ``other.workers`` holds: ``"worker"`` or ``"rank"``.
    """
    pair = _Pair.of(reference, other)
    if dataset_size is None and pair.reference_epoch is None:
        dataset_size = int(reference)
    if allowed_dropped is None:
        allowed_dropped = dataset_size % batch_size if drop_last and batch_size and dataset_size else 0
    notes: list[str] = []
    diff = pair.differences()
    missing, unexpected, dropped = _account_for_drops(diff, allowed_dropped, dataset_size, notes)
    if diff.reference_repeats:
        notes.append(f"the reference itself repeated {diff.reference_repeats} deliveries")
    duplicated, padded, sources = _account_for_repeats(diff, pair, allowed_repeats, source_kind, notes)
    order_differs, first_difference = _order_difference(pair, order, notes)
    if order == "same" and order_differs and (missing.size or duplicated):
        notes.append("the order difference may only follow from the missing or duplicated samples")
    if not other.complete:
        notes.append("the epoch was stopped before the loader was exhausted")
    return AuditReport(
        what=what or "delivered against reference",
        expected=diff.expected,
        delivered=int(other.ids.size),
        missing=pair.label(missing),
        unexpected=pair.label(unexpected),
        duplicated=duplicated,
        changed_targets=pair.label(pair.changed_targets(diff)),
        dropped=pair.label(dropped),
        padded=padded,
        order=order,
        order_differs=order_differs,
        first_order_difference=first_difference,
        duplicate_sources=sources,
        source_kind=source_kind,
        targets_compared=pair.compare_targets,
        notes=notes,
    )


class _Pair:
    """The two sides ``compare`` compares, with what follows from them alone."""

    def __init__(
        self, reference: Epoch | int, other: Epoch, compare_targets: bool, same_sequence: bool
    ) -> None:
        self.reference = reference
        self.reference_epoch = None if isinstance(reference, int) else reference
        self.other = other
        self.compare_targets = compare_targets
        self.same_sequence = same_sequence
        reference_names = self.reference_epoch.names if self.reference_epoch is not None else None
        names = {**(reference_names or {}), **(other.names or {})}
        self.label = Epoch(ids=np.zeros(0, np.int64), names=names or None).labels

    @classmethod
    def of(cls, reference: Epoch | int, other: Epoch) -> _Pair:
        if isinstance(reference, (int, np.integer)):
            return cls(int(reference), other, compare_targets=False, same_sequence=False)
        compare_targets = reference.digests is not None and other.digests is not None
        same_sequence = reference.ids.size == other.ids.size and np.array_equal(reference.ids, other.ids)
        return cls(reference, other, compare_targets, same_sequence)

    def differences(self) -> Differences:
        # With the same sequence, digests compare position by position (changed_targets): no
        # per-id alignment needed.
        aligned = self.compare_targets and not self.same_sequence
        reference_ids = self.reference if self.reference_epoch is None else self.reference_epoch.ids
        return find_differences(
            reference_ids,
            self.reference_epoch.digests if aligned else None,
            self.other.ids,
            self.other.digests if aligned else None,
        )

    def changed_targets(self, diff: Differences) -> np.ndarray:
        if self.compare_targets and self.same_sequence:
            return np.unique(self.other.ids[self.reference_epoch.digests != self.other.digests])
        return diff.changed if diff.changed is not None else np.zeros(0, np.int64)


def _account_for_drops(
    diff: Differences, allowed_dropped: int, dataset_size: int | None, notes: list[str]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(missing, unexpected, dropped)``: the ids not delivered (or absent from the reference) that
    ``drop_last`` accounts for become ``dropped``, not a loss."""
    missing, unexpected = diff.missing, diff.unexpected
    dropped = np.zeros(0, np.int64)
    if 0 < missing.size <= allowed_dropped:
        dropped, missing = missing, dropped
        notes.append(
            f"{dropped.size} ids not delivered are within drop_last's allowance of {allowed_dropped}"
        )
    elif missing.size and allowed_dropped:
        notes.append(
            f"drop_last accounts for at most {allowed_dropped} undelivered ids; {missing.size} are missing"
        )
    if (
        unexpected.size
        and dataset_size is not None
        and unexpected.size <= allowed_dropped
        and diff.expected + unexpected.size <= dataset_size
    ):
        notes.append(f"{unexpected.size} ids absent from the reference are ones its own drop_last left out")
        dropped = np.union1d(dropped, unexpected)
        unexpected = unexpected[:0]
    return missing, unexpected, dropped


def _account_for_repeats(
    diff: Differences, pair: _Pair, allowed_repeats: int, source_kind: str, notes: list[str]
) -> tuple[dict, dict, dict]:
    """``(duplicated, padded, sources)``: id -> copies delivered, those a sampler's padding accounts
    for, and id -> the worker (or rank) of each copy."""
    duplicated = dict(zip(pair.label(diff.duplicated_ids), diff.duplicated_counts.tolist(), strict=True))
    surplus = int(np.sum(diff.duplicated_counts - 1))
    sources: dict = {}
    workers = pair.other.workers
    if duplicated and workers is not None:
        named = slice(0, MAX_NAMED_SOURCES)  # naming every copy of millions of ids helps nobody
        copies = copies_by_source(pair.other, diff.duplicated_ids[named], diff.duplicated_counts[named])
        sources = {
            sample: tuple(ws.tolist()) for sample, ws in zip(list(duplicated)[named], copies, strict=True)
        }
        if len(duplicated) > MAX_NAMED_SOURCES:
            notes.append(f"{source_kind}s named for the first {MAX_NAMED_SOURCES:,} duplicated ids only")
    padded: dict = {}
    if duplicated and surplus <= allowed_repeats:
        padded, duplicated = duplicated, {}
        notes.append(f"{surplus} repeated deliveries are within the sampler's padding of {allowed_repeats}")
    elif duplicated:
        notes += _duplicate_diagnosis(diff, workers, source_kind)
    return duplicated, padded, sources


def _order_difference(pair: _Pair, order: Order, notes: list[str]) -> tuple[bool, tuple | None]:
    """Whether the delivery order differs from the reference's, and ``(position, reference id,
    delivered id)`` at the first difference."""
    reference = pair.reference_epoch
    if reference is None:
        return False, None
    other = pair.other
    length = min(reference.ids.size, other.ids.size)
    if not pair.same_sequence and not np.array_equal(reference.ids[:length], other.ids[:length]):
        position = int(np.argmax(reference.ids[:length] != other.ids[:length]))
        return True, (
            position,
            pair.label(reference.ids[position : position + 1])[0],
            pair.label(other.ids[position : position + 1])[0],
        )
    if order == "shuffled" and length > 1:
        notes.append(
            "the order is the same as the reference's although shuffling was expected: "
            "is the sampler's generator re-seeded every epoch?"
        )
    return False, None


def _duplicate_diagnosis(diff: Differences, workers: np.ndarray | None, source_kind: str) -> list[str]:
    """Names the classic pattern: every worker (or rank) read the whole stream."""
    if workers is None:  # TagWorker names workers; ranks are named by whoever gathers them
        if source_kind == "rank":
            return []
        return [
            "the loader's batches carry no worker tag: use fastcollate.audit.TagWorker to name the workers"
        ]
    sources = np.unique(workers)
    sources = sources[sources >= 0]
    everything_repeated = diff.duplicated_ids.size == diff.delivered_unique >= diff.expected
    if sources.size > 1 and everything_repeated and np.all(diff.duplicated_counts == sources.size):
        if source_kind == "rank":
            return [
                f"each of the {sources.size} ranks delivered every sample: the sampler does not shard "
                "(use DistributedSampler, or shard the IterableDataset by rank)"
            ]
        return [
            f"each of the {sources.size} workers delivered the whole stream: an IterableDataset must shard "
            "its stream in __iter__ with torch.utils.data.get_worker_info() (id, num_workers)"
        ]
    return []



def as_reference(expected: int | Iterable | Epoch | None, epoch: Epoch) -> Epoch | int:
    """The reference ``compare`` takes for a dataset's ids: an Epoch of them, or N for ``0..N-1``."""
    if isinstance(expected, Epoch):
        return expected
    if expected is None:
        return Epoch(ids=np.unique(epoch.ids), names=epoch.names)
    if isinstance(expected, (int, np.integer)):
        return int(expected)
    names: dict[int, str] = {}
    codes, _ = id_codes(
        list(expected) if not isinstance(expected, (np.ndarray, torch.Tensor)) else expected, names
    )
    return Epoch(ids=np.unique(codes), names=names or None)


def reference_size(reference: Epoch | int) -> int:
    """How many distinct ids a reference (as ``as_reference`` gives it) holds."""
    return reference if isinstance(reference, int) else int(reference.ids.size)



def check(
    epoch: Epoch,
    expected: int | Iterable | None = None,
    *,
    drop_last: bool = False,
    batch_size: int | None = None,
    allowed_dropped: int | None = None,
    what: str = "",
) -> AuditReport:
    """Checks one epoch against the dataset: every expected id delivered, and only once.

    Args:
        epoch: what the loader delivered.
        expected: the dataset's ids: an int ``N`` for ids ``0..N-1`` (``with_ids`` gives those), an
            iterable of ids, or None to check duplicates only.
        drop_last, batch_size: ``N % batch_size`` ids may be left out by ``drop_last``.
        allowed_dropped: overrides that count.
        what: the report's title.
    """
    reference = as_reference(expected, epoch)
    return compare(
        reference,
        epoch,
        order="any",
        drop_last=drop_last,
        batch_size=batch_size,
        dataset_size=reference_size(reference) if expected is not None else None,
        allowed_dropped=allowed_dropped,
        what=what or "delivered against the dataset",
    )



def compare_loaders(
    reference: Iterable | Callable[[], Iterable],
    other: Iterable | Callable[[], Iterable],
    *,
    id_key: str = "id",
    target_key: str | Sequence[str] | None = None,
    order: Order = "same",
    drop_last: bool = False,
    batch_size: int | None = None,
    dataset_size: int | None = None,
    what: str = "",
) -> AuditReport:
    """Runs one epoch of each loader and compares them: the one-call form of ``Ledger`` + ``compare``.

    Args:
        reference: the loader taken as right (or a function making it), e.g. ``num_workers=0``.
        other: the loader to check (or a function making it).
        id_key, target_key: as for ``Ledger``.
        order, drop_last, batch_size, dataset_size: as for ``compare``.
        what: the report's title.
    """
    epochs = []
    for loader in (reference, other):
        if callable(loader) and not isinstance(loader, Iterable):
            loader = loader()
        epochs.append(Ledger(id_key, target_key).run(loader))
    return compare(
        epochs[0],
        epochs[1],
        order=order,
        drop_last=drop_last,
        batch_size=batch_size,
        dataset_size=dataset_size,
        what=what or "loader against reference loader",
    )
