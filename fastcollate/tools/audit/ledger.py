"""The ledger: the sample ids (and target digests) a loader actually delivered, epoch by epoch, read
from the batches themselves.

    ledger = fastcollate.audit.Ledger(id_key="id", target_key="y")
    for batch in ledger.watch(loader):      # batches pass through unchanged
        ...
    print(fastcollate.audit.check(ledger.last, expected=len(dataset)))
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from ...structure import tree
from .column import GrowingColumn
from .digests import digest_fields, string_code
from .epoch import Epoch
from .workers import MAIN_PROCESS, UNKNOWN_WORKER, TagWorker, WorkerTagged

__all__ = ["Ledger", "id_codes"]


def _count_ids(ids: Any) -> int:
    """How many ids a batch's id field holds."""
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        return int(ids.numel() if isinstance(ids, torch.Tensor) else ids.size)
    if isinstance(ids, Sequence) and not isinstance(ids, (str, bytes)):
        return len(ids)
    return 1


def id_codes(value: Any, names: dict[int, str]) -> tuple[np.ndarray, str]:
    """A batch's ids as int64 codes, and their kind (``"int"`` or ``"str"``); each string id's code is
    added to ``names``, so that reports can show the id as the dataset knows it."""
    if isinstance(value, (str, bytes)):
        value = [value]
    if isinstance(value, torch.Tensor):
        array = value.detach().cpu().reshape(-1).numpy()
    elif isinstance(value, np.ndarray):
        array = value.reshape(-1)
    elif isinstance(value, (int, np.integer)):
        array = np.array([value])
    elif isinstance(value, Sequence) and value and all(isinstance(v, (str, bytes)) for v in value):
        codes = np.fromiter((string_code(v) for v in value), np.int64, len(value))
        for code, text in zip(codes.tolist(), value, strict=True):
            names[code] = text if isinstance(text, str) else text.decode(errors="replace")
        return codes, "str"
    elif isinstance(value, Sequence):
        array = np.asarray(value)
    else:
        raise TypeError(f"ids must be integers or strings, got a {type(value).__name__}")
    if array.dtype.kind not in "iub":
        raise TypeError(f"ids must be integers or strings, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False), "int"


class Ledger:
    """Records, per epoch, the sample ids a loader delivered and, optionally, a digest of each
    sample's targets, from the batches themselves (the ids ``assemble`` keeps in them).

    Args:
        id_key: where each batch holds its ids: a mapping key or attribute, dotted for nested ones
            (``"id"`` reads ``batch["id"]`` and ``IdentifiedSample.id`` alike). Ids are integers
            (a tensor, array or list) or strings (a list).
        target_key: the field(s) whose per-sample digest is recorded, to catch changed targets
            (``"y"``, ``("y", "boxes")``); None records ids only. A digest covers the field's bytes
            as collated, so a padded field's digest depends on its batch's longest sample: digest
            fixed-size targets, or compare only settings that batch identically.
    """

    def __init__(self, id_key: str = "id", target_key: str | Sequence[str] | None = None) -> None:
        self.id_key = id_key
        self.target_keys: tuple[str, ...] = (
            () if target_key is None else (target_key,) if isinstance(target_key, str) else tuple(target_key)
        )
        self.epochs: list[Epoch] = []
        self._open = False
        self._id_kind: str | None = None

    # -- recording --------------------------------------------------------------------------------

    def begin_epoch(self) -> None:
        """Starts recording an epoch (``record`` starts one itself when none is open)."""
        if self._open:
            self.end_epoch(complete=False)
        self._ids = GrowingColumn(np.int64)
        self._digests = GrowingColumn(np.uint64) if self.target_keys else None
        self._workers = GrowingColumn(np.int16)
        self._any_worker = False
        self._names: dict[int, str] = {}
        self._batches = 0
        self._started = time.perf_counter()
        self._first: float | None = None
        self._wait = 0.0
        self._open = True

    def record(self, batch: Any, worker: int | None = None) -> None:
        """Records one batch's ids (and target digests).

        Args:
            batch: a collated batch holding ``id_key`` (and ``target_key``); a ``WorkerTagged`` batch
                gives its worker itself.
            worker: the worker that collated the batch, if known.
        """
        if isinstance(batch, WorkerTagged):
            worker, batch = batch.worker if worker is None else worker, batch.batch
        try:
            ids = tree.lookup(batch, self.id_key)
        except (KeyError, IndexError, TypeError):
            raise KeyError(
                f"the batch has no ids at {self.id_key!r}. Give samples an id (fastcollate.with_ids(dataset) "
                "for a map-style dataset; an id field yielded by an IterableDataset) or set "
                "Ledger(id_key=...)"
            ) from None
        digests = None
        if self.target_keys:
            targets = (self._target(batch, key) for key in self.target_keys)
            digests = digest_fields(targets, _count_ids(ids))
        self.record_ids(ids, digests=digests, worker=worker)

    @staticmethod
    def _target(batch: Any, key: str) -> Any:
        try:
            return tree.lookup(batch, key)
        except (KeyError, IndexError, TypeError):
            raise KeyError(f"the batch has no target field {key!r} (Ledger(target_key=...))") from None

    def record_ids(self, ids: Any, digests: np.ndarray | None = None, worker: int | None = None) -> None:
        """Records ids directly (a tensor, array or list of ints, or a list of strings).

        Args:
            ids: the batch's ids in order.
            digests: uint64, one per id, when this ledger records targets.
            worker: the worker that produced them, if known.
        """
        if not self._open:
            self.begin_epoch()
        codes, kind = id_codes(ids, self._names)
        if self._id_kind is None:
            self._id_kind = kind
        elif kind != self._id_kind:
            raise TypeError(f"this ledger holds {self._id_kind} ids; a batch brought {kind} ids")
        if self._digests is not None:
            if digests is None or len(digests) != codes.size:
                raise ValueError(f"this ledger records targets: {codes.size} digests needed")
            self._digests.append(np.asarray(digests, np.uint64))
        self._ids.append(codes)
        self._workers.append(np.full(codes.size, UNKNOWN_WORKER if worker is None else worker, np.int16))
        self._any_worker |= worker is not None
        self._batches += 1

    @property
    def recorded(self) -> int:
        """Ids recorded so far in the epoch being recorded (0 when none is open): where a later cut of
        that epoch ends (``Epoch.ids[:recorded]``)."""
        return self._ids.size if self._open else 0

    def end_epoch(self, complete: bool = True) -> Epoch:
        """Closes the epoch being recorded and returns it (also appended to ``epochs``)."""
        if not self._open:
            self.begin_epoch()
        workers = self._workers.finish()
        epoch = Epoch(
            ids=self._ids.finish(),
            digests=self._digests.finish() if self._digests is not None else None,
            workers=workers if self._any_worker else None,
            names=self._names if self._id_kind == "str" else None,
            batches=self._batches,
            complete=complete,
            first_batch_seconds=self._first,
            wait_seconds=self._wait,
            wall_seconds=time.perf_counter() - self._started,
        )
        self._open = False
        self.epochs.append(epoch)
        return epoch

    # -- watching a loader ------------------------------------------------------------------------

    def watch(self, loader: Iterable) -> Iterator[Any]:
        """Iterates ``loader`` once, recording every batch as one epoch, and yields the batches unchanged.

        A DataLoader with workers gets its collate_fn wrapped in ``TagWorker`` for the length of this
        pass (the wrapper is in place only while its iterator is created), so every id is attributed
        to its worker; with ``persistent_workers`` the workers already hold their collate_fn: pass
        ``collate_fn=TagWorker(...)`` yourself to get workers named. Stopping early records the epoch
        as incomplete.

        Args:
            loader: a DataLoader, or any iterable of collated batches.
        """
        self.begin_epoch()
        iterator, worker = _iterate_tagged(loader)
        complete = False
        try:
            while True:
                start = time.perf_counter()
                try:
                    item = next(iterator)
                except StopIteration:
                    complete = True
                    break
                waited = time.perf_counter() - start
                self._wait += waited
                if self._first is None:
                    self._first = waited
                if isinstance(item, WorkerTagged):
                    self.record(item.batch, worker=item.worker)
                    yield item.batch
                else:
                    self.record(item, worker=worker)
                    yield item
        finally:
            self.end_epoch(complete=complete)

    def run(self, loader: Iterable) -> Epoch:
        """Consumes one epoch of ``loader`` (batches discarded) and returns what it delivered."""
        for _ in self.watch(loader):
            pass
        return self.epochs[-1]

    @property
    def last(self) -> Epoch:
        """The last epoch recorded."""
        if not self.epochs:
            raise IndexError("the ledger has no epoch yet: iterate ledger.watch(loader) first")
        return self.epochs[-1]


def _iterate_tagged(loader: Iterable) -> tuple[Iterator, int | None]:
    """An iterator over ``loader`` whose batches name their worker, and the worker to assume for
    untagged ones (the main process for ``num_workers=0``)."""
    if not isinstance(loader, DataLoader):
        return iter(loader), None
    if loader.num_workers == 0:
        return iter(loader), MAIN_PROCESS
    if isinstance(loader.collate_fn, TagWorker) or loader.persistent_workers:
        return iter(loader), None
    original = loader.collate_fn
    loader.collate_fn = TagWorker(original)  # the iterator copies it for its workers when created
    try:
        return iter(loader), None
    finally:
        loader.collate_fn = original


# --------------------------------------------------------------------------------------------------
# Checks
