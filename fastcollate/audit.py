"""Audit: a ledger of the sample ids (and target digests) a loader actually delivered, epoch by epoch,
and the checks that compare ledgers: missing, duplicated, changed or reordered samples, across workers,
epochs, configurations and ``torch.distributed`` ranks.

    ledger = fastcollate.audit.Ledger(id_key="id", target_key="y")
    for batch in ledger.watch(loader):      # batches pass through unchanged
        ...
    print(fastcollate.audit.check(ledger.last, expected=len(dataset)))
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, get_worker_info

from . import tree
from .ids import TARGET_KEYS  # noqa: F401  (fastcollate.audit.TARGET_KEYS, as before)

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

MAIN_PROCESS = -1
"""The worker id recorded for batches collated in the main process (``num_workers=0``)."""
UNKNOWN_WORKER = -2
"""The worker id recorded when a loader's batches carry no worker tag."""

MAX_NAMED_SOURCES = 10_000
"""Duplicated ids whose copies' workers (or ranks) a report names; the rest are counted."""

Order = Literal["same", "shuffled", "any"]


# --------------------------------------------------------------------------------------------------
# Worker attribution


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
            from .assemble import assemble

            collate_fn = assemble
        self.collate_fn = collate_fn

    def __call__(self, samples: list) -> WorkerTagged:
        info = get_worker_info()
        return WorkerTagged(info.id if info is not None else MAIN_PROCESS, self.collate_fn(samples))

    def __repr__(self) -> str:
        return f"fastcollate.audit.TagWorker({self.collate_fn!r})"


# --------------------------------------------------------------------------------------------------
# Storage


class _Column:
    """A growing 1-D array stored in blocks: appending never moves what is stored, and ``finish``
    builds the final array block by block, so the peak is one copy plus a block, not a doubling
    buffer's 2x (which would take 10 million int64 ids past 200 MB)."""

    _FIRST_BLOCK = 4096
    _MAX_BLOCK = 1 << 20

    def __init__(self, dtype: np.dtype | type) -> None:
        self.dtype = np.dtype(dtype)
        self.blocks: list[np.ndarray] = []
        self.fill = 0  # items used in the last block
        self.size = 0

    def append(self, values: np.ndarray) -> None:
        values = np.asarray(values).reshape(-1)
        done = 0
        while done < values.size:
            if not self.blocks or self.fill == self.blocks[-1].size:
                grow = (
                    self._FIRST_BLOCK if not self.blocks else min(2 * self.blocks[-1].size, self._MAX_BLOCK)
                )
                self.blocks.append(np.empty(grow, self.dtype))
                self.fill = 0
            block = self.blocks[-1]
            take = min(block.size - self.fill, values.size - done)
            block[self.fill : self.fill + take] = values[done : done + take]
            self.fill += take
            done += take
        self.size += values.size

    def finish(self) -> np.ndarray:
        out = np.empty(self.size, self.dtype)
        position = 0
        while self.blocks:
            block = self.blocks.pop(0)  # freed as soon as it is copied
            take = min(block.size, self.size - position)
            out[position : position + take] = block[:take]
            position += take
        self.fill = self.size = 0
        return out


@dataclasses.dataclass
class Epoch:
    """What one pass over a loader delivered, in delivery order.

    Attributes:
        ids: int64, one per sample delivered. Integer ids as they are; string ids as stable 64-bit
            codes (``names`` maps them back).
        digests: uint64 digest of each sample's targets (see ``Ledger``), or None when not recorded.
        workers: int16 worker that collated each sample (``MAIN_PROCESS``, ``UNKNOWN_WORKER``), or
            None when not recorded. In a distributed check, the rank.
        names: code to string id, for string ids; None for integer ids.
        batches: batches delivered.
        complete: False when the pass stopped before the loader was exhausted.
        first_batch_seconds: wait for the first batch (worker start-up shows here).
        wait_seconds: total time spent waiting on the loader (``next``), first batch included.
        wall_seconds: from the pass's start to its end, the consumer's own work included.
    """

    ids: np.ndarray
    digests: np.ndarray | None = None
    workers: np.ndarray | None = None
    names: dict[int, str] | None = None
    batches: int = 0
    complete: bool = True
    first_batch_seconds: float | None = None
    wait_seconds: float = 0.0
    wall_seconds: float = 0.0

    def __len__(self) -> int:
        return int(self.ids.size)

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (the string-id table, a Python dict, is not counted)."""
        return sum(a.nbytes for a in (self.ids, self.digests, self.workers) if a is not None)

    @property
    def steady_samples_per_second(self) -> float | None:
        """Samples per second of loader wait after the first batch: start-up excluded."""
        if self.first_batch_seconds is None or self.batches < 2:
            return None
        rest = self.wait_seconds - self.first_batch_seconds
        first = self.ids.size / max(self.batches, 1)  # the first batch's share, near enough
        return (self.ids.size - first) / rest if rest > 0 else None

    def labels(self, codes: np.ndarray) -> list:
        """The ids as a person knows them (strings back from their codes)."""
        if self.names is None:
            return [int(c) for c in codes]
        return [self.names.get(int(c), f"<id code {int(c)}>") for c in codes]

    def save(self, path: str) -> None:
        """Writes the epoch to ``path`` (``.npz``), e.g. to compare runs made in different jobs."""
        arrays = {"ids": self.ids}
        if self.digests is not None:
            arrays["digests"] = self.digests
        if self.workers is not None:
            arrays["workers"] = self.workers
        if self.names is not None:
            codes = np.fromiter(self.names.keys(), np.int64, len(self.names))
            arrays["name_codes"] = codes
            arrays["name_values"] = np.array([self.names[int(c)] for c in codes], dtype=object)
        np.savez(path, **arrays)

    @classmethod
    def load(cls, path: str) -> Epoch:
        with np.load(path, allow_pickle=True) as data:
            names = None
            if "name_codes" in data:
                names = {int(c): str(v) for c, v in zip(data["name_codes"], data["name_values"], strict=True)}
            return cls(
                ids=data["ids"],
                digests=data["digests"] if "digests" in data else None,
                workers=data["workers"] if "workers" in data else None,
                names=names,
            )


# --------------------------------------------------------------------------------------------------
# Reading ids and targets out of a batch



def string_code(text: str | bytes) -> int:
    """The stable 64-bit code of a string id: the same in every process and on every rank (Python's
    ``hash`` is salted per process)."""
    data = text.encode() if isinstance(text, str) else bytes(text)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _count(ids: Any) -> int:
    """How many ids a batch's id field holds."""
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        return int(ids.numel() if isinstance(ids, torch.Tensor) else ids.size)
    if isinstance(ids, Sequence) and not isinstance(ids, (str, bytes)):
        return len(ids)
    return 1


def _id_codes(value: Any, names: dict[int, str]) -> tuple[np.ndarray, str]:
    """The batch's ids as int64 codes, and their kind (``"int"`` or ``"str"``)."""
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


_COEFFICIENTS = np.zeros(0, np.uint64)


def _coefficients(width: int) -> np.ndarray:
    """Odd 64-bit multipliers, the same in every process (fixed seed): digests agree across workers,
    runs and ranks. Odd, so that a change in any one 8-byte word always changes the digest."""
    global _COEFFICIENTS
    if _COEFFICIENTS.size < width:
        size = max(width, 2 * _COEFFICIENTS.size, 64)
        rng = np.random.default_rng(0x5EED_FA57)
        _COEFFICIENTS = (
            rng.integers(0, np.iinfo(np.uint64).max, size=size, dtype=np.uint64, endpoint=True) | 1
        )
    return _COEFFICIENTS[:width]


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: spreads every input bit over the whole digest. In place on a copy, with
    one scratch array: fresh temporaries cost more than the arithmetic on large inputs."""
    h = np.array(h, dtype=np.uint64)  # a copy
    scratch = np.empty_like(h)
    with np.errstate(over="ignore"):
        for shift, multiplier in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None)):
            np.right_shift(h, np.uint64(shift), out=scratch)
            h ^= scratch
            if multiplier is not None:
                h *= np.uint64(multiplier)
    return h


def _seed(text: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little"))


def digest_rows(value: Any, n: int) -> np.ndarray:
    """A uint64 digest per sample of a collated field: per batch, vectorised over its rows.

    Tensors and arrays are hashed by their bytes (dtype and per-sample shape mixed in); lists of
    strings or numbers element by element; mappings and sequences of fields by combining their leaves.
    """
    if isinstance(value, np.ndarray) and value.dtype != object:
        value = torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] != n:
            raise ValueError(f"expected {n} rows, got shape {list(value.shape)}")
        t = value.detach().cpu().contiguous()
        seed = _seed(f"{t.dtype}{list(t.shape[1:])}")
        rows = t.reshape(n, -1).view(torch.uint8).numpy() if t.numel() else np.zeros((n, 0), np.uint8)
        width = rows.shape[1]
        if width % 8:
            rows = np.concatenate([rows, np.zeros((n, 8 - width % 8), np.uint8)], axis=1)
        words = np.ascontiguousarray(rows).view(np.uint64)
        with np.errstate(over="ignore"):
            h = (words * _coefficients(words.shape[1])).sum(axis=1, dtype=np.uint64)
        return _mix(h ^ seed)
    if isinstance(value, Mapping):
        h = np.full(n, _seed("mapping"), np.uint64)
        for key in sorted(value, key=str):
            h = _combine(h, _mix(digest_rows(value[key], n) ^ _seed(str(key))))
        return h
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) == n and all(isinstance(v, (str, bytes, int, float, bool)) for v in value):
            # one entry per sample: strings, or numbers a custom collate left as Python values
            return _mix(np.fromiter((string_code(repr(v)) for v in value), np.int64, n).view(np.uint64))
        h = np.full(n, _seed("sequence"), np.uint64)
        for index, item in enumerate(value):
            h = _combine(h, _mix(digest_rows(item, n) ^ _seed(str(index))))
        return h
    raise TypeError(f"cannot digest a {type(value).__name__} per sample")


def _combine(h: np.ndarray, other: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return _mix(h * np.uint64(0x9E3779B97F4A7C15) + other)


# --------------------------------------------------------------------------------------------------
# The ledger


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
        self._ids = _Column(np.int64)
        self._digests = _Column(np.uint64) if self.target_keys else None
        self._workers = _Column(np.int16)
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
            n = _count(ids)
            digests = np.full(n, _seed("targets"), np.uint64)
            for key in self.target_keys:
                try:
                    value = tree.lookup(batch, key)
                except (KeyError, IndexError, TypeError):
                    raise KeyError(
                        f"the batch has no target field {key!r} (Ledger(target_key=...))"
                    ) from None
                digests = _combine(digests, digest_rows(value, n))
        self.record_ids(ids, digests=digests, worker=worker)

    def record_ids(self, ids: Any, digests: np.ndarray | None = None, worker: int | None = None) -> None:
        """Records ids directly (a tensor, array or list of ints, or a list of strings).

        Args:
            ids: the batch's ids in order.
            digests: uint64, one per id, when this ledger records targets.
            worker: the worker that produced them, if known.
        """
        if not self._open:
            self.begin_epoch()
        codes, kind = _id_codes(ids, self._names)
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


@dataclasses.dataclass
class AuditReport:
    """What a delivered epoch got wrong against a reference (another epoch, or the dataset's ids).

    Ids are shown as the dataset knows them (strings for string ids). ``ok`` is False when anything
    was lost, duplicated, unexpected or changed, or reordered where the same order was expected.

    Attributes:
        what: what was compared (``"workers=2 against workers=0"``).
        expected: distinct ids in the reference.
        delivered: samples delivered, repeats included.
        missing: reference ids never delivered (excluding ``dropped``).
        unexpected: delivered ids the reference does not have.
        duplicated: id -> times delivered, for ids delivered more than once (excluding ``padded``).
        changed_targets: ids delivered (at least once) with a target digest other than the reference's.
        dropped: ids not delivered that ``drop_last`` (or the sampler) accounts for: not a loss.
        padded: ids delivered more than once that a DistributedSampler's padding accounts for.
        order: the order expected: ``"same"``, ``"shuffled"`` or ``"any"``.
        order_differs: whether the delivery order differs from the reference's.
        first_order_difference: ``(position, reference id, delivered id)`` at the first difference.
        duplicate_sources: id -> the workers (or ranks) that delivered each copy, for duplicated ids.
        source_kind: ``"worker"`` or ``"rank"``: what ``duplicate_sources`` names.
        targets_compared: whether target digests were compared.
        notes: diagnoses and accounting a person should read.
    """

    what: str
    expected: int
    delivered: int
    missing: list
    unexpected: list
    duplicated: dict
    changed_targets: list
    dropped: list
    padded: dict
    order: Order
    order_differs: bool
    first_order_difference: tuple[int, Any, Any] | None
    duplicate_sources: dict
    source_kind: str
    targets_compared: bool
    notes: list[str]

    @property
    def ok(self) -> bool:
        return not (
            self.missing
            or self.unexpected
            or self.duplicated
            or self.changed_targets
            or (self.order == "same" and self.order_differs)
        )

    @property
    def duplicate_workers(self) -> dict:
        """id -> worker ids that delivered a copy (empty when workers were not recorded)."""
        return self.duplicate_sources if self.source_kind == "worker" else {}

    @property
    def duplicate_ranks(self) -> dict:
        """id -> ranks that delivered a copy (distributed checks)."""
        return self.duplicate_sources if self.source_kind == "rank" else {}

    def problems(self) -> list[str]:
        """One line per class of problem found; empty when ``ok``."""
        out = []
        if self.missing:
            out.append(f"{len(self.missing)} missing")
        if self.duplicated:
            out.append(f"{len(self.duplicated)} duplicated")
        if self.unexpected:
            out.append(f"{len(self.unexpected)} unexpected")
        if self.changed_targets:
            out.append(f"{len(self.changed_targets)} with changed targets")
        if self.order == "same" and self.order_differs:
            out.append("order differs")
        return out

    def __str__(self) -> str:
        verdict = "OK" if self.ok else "FAILED: " + ", ".join(self.problems())
        lines = [
            f"{self.what}: {verdict}",
            f"  delivered {self.delivered} samples; reference has {self.expected} ids",
        ]
        if self.missing:
            lines.append(f"  missing ({len(self.missing)}): {_few(self.missing)}")
        if self.duplicated:
            shown = []
            for sample, count in list(self.duplicated.items())[:10]:
                sources = self.duplicate_sources.get(sample)
                where = f" ({self.source_kind}s {', '.join(map(_source_name, sources))})" if sources else ""
                shown.append(f"{sample!r} x{count}{where}")
            more = f", ... ({len(self.duplicated) - 10} more)" if len(self.duplicated) > 10 else ""
            lines.append(f"  duplicated ({len(self.duplicated)}): {', '.join(shown)}{more}")
        if self.unexpected:
            lines.append(f"  unexpected ({len(self.unexpected)}): {_few(self.unexpected)}")
        if self.changed_targets:
            lines.append(f"  changed targets ({len(self.changed_targets)}): {_few(self.changed_targets)}")
        if self.order_differs and self.order != "any":
            expected = {"same": "the same order was expected", "shuffled": "as shuffling does"}
            where = ""
            if self.first_order_difference is not None:
                position, ref, got = self.first_order_difference
                where = f", first at position {position} (reference id {ref!r}, delivered {got!r})"
            lines.append(f"  order differs{where}: {expected[self.order]}")
        if self.dropped:
            lines.append(
                f"  dropped by drop_last, accounted, not lost ({len(self.dropped)}): {_few(self.dropped)}"
            )
        if self.padded:
            lines.append(
                f"  repeated by the sampler's padding, accounted ({len(self.padded)}): "
                f"{_few(list(self.padded))}"
            )
        lines.append("  targets: " + ("compared" if self.targets_compared else "not compared (ids only)"))
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def to_dict(self, limit: int = 100) -> dict:
        """A JSON-ready summary: counts, and at most ``limit`` ids of each kind."""

        def ids(values: Iterable) -> list:
            return [_plain(v) for v in list(values)[:limit]]

        return {
            "what": self.what,
            "ok": self.ok,
            "problems": self.problems(),
            "expected": self.expected,
            "delivered": self.delivered,
            "missing": {"count": len(self.missing), "ids": ids(self.missing)},
            "duplicated": {
                "count": len(self.duplicated),
                "ids": [
                    {
                        "id": _plain(k),
                        "count": int(c),
                        f"{self.source_kind}s": [int(s) for s in self.duplicate_sources.get(k, ())],
                    }
                    for k, c in list(self.duplicated.items())[:limit]
                ],
            },
            "unexpected": {"count": len(self.unexpected), "ids": ids(self.unexpected)},
            "changed_targets": {"count": len(self.changed_targets), "ids": ids(self.changed_targets)},
            "dropped": {"count": len(self.dropped), "ids": ids(self.dropped)},
            "padded": {"count": len(self.padded), "ids": ids(self.padded)},
            "order": self.order,
            "order_differs": self.order_differs,
            "first_order_difference": None
            if self.first_order_difference is None
            else [_plain(v) for v in self.first_order_difference],
            "targets_compared": self.targets_compared,
            "notes": list(self.notes),
        }


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def _source_name(source: int) -> str:
    return {MAIN_PROCESS: "main", UNKNOWN_WORKER: "?"}.get(int(source), str(int(source)))


def _few(values: Sequence, limit: int = 10) -> str:
    shown = ", ".join(repr(v) for v in list(values)[:limit])
    return shown + (f", ... ({len(values) - limit} more)" if len(values) > limit else "")


class _Differences(NamedTuple):
    expected: int  # distinct reference ids
    delivered_unique: int  # distinct delivered ids
    missing: np.ndarray
    unexpected: np.ndarray
    duplicated_ids: np.ndarray
    duplicated_counts: np.ndarray
    reference_repeats: int  # surplus copies in the reference itself
    changed: np.ndarray | None  # ids whose digests differ; None when not compared


# Two ways to the same differences. Ids that fill a range densely (dataset indices: the usual case)
# go through bitmaps over that range: no sort, and few large allocations, which on a small VM cost
# more than the arithmetic (faulting in a fresh 80 MB array takes a good fraction of a second).
# Sparse ids (string codes, arbitrary integers) go through a sort.


def _dense_span(reference: np.ndarray | int, ids: np.ndarray) -> tuple[int, int] | None:
    """``(low, span)`` covering every id when that range is at most about twice the ids, else None."""
    lows, highs = [], []
    for array in (ids, reference if isinstance(reference, np.ndarray) else None):
        if array is not None and array.size:
            lows.append(int(array.min()))
            highs.append(int(array.max()))
    if isinstance(reference, int) and reference > 0:
        lows.append(0)
        highs.append(reference - 1)
    if not lows:
        return 0, 0
    low, span = min(lows), max(highs) - min(lows) + 1
    size = reference if isinstance(reference, int) else reference.size
    return (low, span) if span <= 2 * (ids.size + size) + 4096 else None


def _differences_dense(
    reference: np.ndarray | int,
    reference_digests: np.ndarray | None,
    ids: np.ndarray,
    digests: np.ndarray | None,
    low: int,
    span: int,
) -> _Differences:
    def slots(array: np.ndarray) -> np.ndarray:
        return array - low if low else array  # no copy for ids that start at 0

    got_at = slots(ids)
    in_got = np.zeros(span, bool)
    in_got[got_at] = True
    in_ref = np.zeros(span, bool)
    if isinstance(reference, int):
        ref_at = None
        in_ref[-low : reference - low] = True
        reference_repeats = 0
    else:
        ref_at = slots(reference)
        in_ref[ref_at] = True
        reference_repeats = reference.size - int(np.count_nonzero(in_ref))
    delivered_unique = int(np.count_nonzero(in_got))
    duplicated_ids = duplicated_counts = np.zeros(0, np.int64)
    if delivered_unique < ids.size:
        counts = np.bincount(got_at, minlength=span)
        repeated = np.flatnonzero(counts > 1)
        duplicated_ids, duplicated_counts = repeated + low, counts[repeated]
    changed = None
    if digests is not None and reference_digests is not None and ref_at is not None:
        by_ref = np.zeros(span, np.uint64)
        by_ref[ref_at] = reference_digests
        by_got = np.zeros(span, np.uint64)
        by_got[got_at] = digests  # a repeated id keeps one copy's digest here: the others follow
        changed = np.flatnonzero(in_ref & in_got & (by_ref != by_got)) + low
        if duplicated_ids.size:  # every copy of a repeated id against the reference
            is_repeated = np.zeros(span, bool)
            is_repeated[duplicated_ids - low] = True
            rows = np.flatnonzero(is_repeated[got_at])
            at = got_at[rows]
            differs = in_ref[at] & (digests[rows] != by_ref[at])
            changed = np.union1d(changed, ids[rows][differs])
    return _Differences(
        int(np.count_nonzero(in_ref)),
        delivered_unique,
        np.flatnonzero(in_ref & ~in_got) + low,
        np.flatnonzero(in_got & ~in_ref) + low,
        duplicated_ids,
        duplicated_counts,
        reference_repeats,
        changed,
    )


class _Index(NamedTuple):
    unique: np.ndarray  # sorted distinct ids
    counts: np.ndarray | None  # times each was delivered; None when every id came once


def _index(ids: np.ndarray) -> _Index:
    """Distinct ids with counts: one (SIMD) sort, no Python per sample."""
    ordered = np.sort(ids)
    if ordered.size < 2 or not np.any(ordered[1:] == ordered[:-1]):
        return _Index(ordered, None)
    head = np.ones(ordered.size, bool)
    np.not_equal(ordered[1:], ordered[:-1], out=head[1:])
    starts = np.flatnonzero(head)
    del head
    counts = np.diff(np.append(starts, ordered.size))
    return _Index(ordered[starts], counts)


def _member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """``values`` found in ``sorted_set``, as a mask (``np.isin`` without its re-sorting). Fast when
    ``values`` is sorted too or ``sorted_set`` is small: a random probe into a large set misses cache."""
    if sorted_set.size == 0:
        return np.zeros(values.shape, bool)
    position = np.searchsorted(sorted_set, values)
    position[position == sorted_set.size] = 0
    return sorted_set[position] == values


def _difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sorted distinct ids of ``a`` that ``b`` (sorted, distinct) lacks."""
    if a.size == b.size and np.array_equal(a, b):
        return a[:0]
    return a[~_member(a, b)]


def _differences_sorted(
    reference: np.ndarray | int,
    reference_digests: np.ndarray | None,
    ids: np.ndarray,
    digests: np.ndarray | None,
) -> _Differences:
    reference = np.arange(reference, dtype=np.int64) if isinstance(reference, int) else reference
    ref, got = _index(reference), _index(ids)
    duplicated_ids = duplicated_counts = np.zeros(0, np.int64)
    if got.counts is not None:
        repeated = got.counts > 1
        duplicated_ids, duplicated_counts = got.unique[repeated], got.counts[repeated]
    changed = None
    if digests is not None and reference_digests is not None:
        changed = _changed_sorted(reference, reference_digests, ids, digests, ref.unique)
    return _Differences(
        int(ref.unique.size),
        int(got.unique.size),
        _difference(ref.unique, got.unique),
        _difference(got.unique, ref.unique),
        duplicated_ids,
        duplicated_counts,
        0 if ref.counts is None else int(np.sum(ref.counts - 1)),
        changed,
    )


def _pairs(ids: np.ndarray, digests: np.ndarray) -> np.ndarray:
    """One 64-bit code per (id, target digest) pair."""
    return _combine(_mix(ids.view(np.uint64)), digests).view(np.int64)


def _changed_sorted(
    reference: np.ndarray,
    reference_digests: np.ndarray,
    ids: np.ndarray,
    digests: np.ndarray,
    known: np.ndarray,
) -> np.ndarray:
    """Ids (among ``known``, the reference's) delivered at least once with another digest than the
    reference's. Each (id, digest) pair becomes one word, and the two sorted word sets are compared:
    plain sorts, no argsort to align digests by id; ids are looked up only for the pairs that differ."""
    pairs = _pairs(ids, digests)
    odd = _difference(np.sort(pairs), np.sort(_pairs(reference, reference_digests)))
    if odd.size == 0:
        return np.zeros(0, np.int64)
    odd = np.unique(odd)
    if odd.size * 8 < ids.size:
        rows = np.flatnonzero(_member(pairs, odd))  # few differ: probe a small set
    else:
        values, order = torch.sort(torch.from_numpy(pairs))
        rows = order.numpy()[_member(values.numpy(), odd)]
    candidates = np.unique(ids[rows])
    return candidates[_member(candidates, known)]


def _copies_by_source(epoch: Epoch, duplicated_ids: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """For each duplicated id (sorted), the worker (or rank) of each copy, in delivery order."""
    if duplicated_ids.size * 8 < epoch.ids.size:
        rows = np.flatnonzero(_member(epoch.ids, duplicated_ids))  # few duplicates: probe a small set
        rows = rows[np.argsort(epoch.ids[rows], kind="stable")]
    else:
        order = np.argsort(epoch.ids, kind="stable")
        rows = order[_member(epoch.ids[order], duplicated_ids)]
    return np.split(epoch.workers[rows], np.cumsum(counts)[:-1])


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
    is_range = isinstance(reference, (int, np.integer))
    reference_ids = int(reference) if is_range else reference.ids
    if dataset_size is None and is_range:
        dataset_size = int(reference)
    if allowed_dropped is None:
        allowed_dropped = dataset_size % batch_size if drop_last and batch_size and dataset_size else 0
    notes: list[str] = []
    compare_targets = not is_range and reference.digests is not None and other.digests is not None
    names = {**((reference.names if not is_range else None) or {}), **(other.names or {})} or None
    label = Epoch(ids=np.zeros(0, np.int64), names=names).labels
    same_sequence = (
        not is_range and reference.ids.size == other.ids.size and np.array_equal(reference.ids, other.ids)
    )

    # With the same sequence, digests compare position by position: no per-id alignment needed.
    aligned = compare_targets and not same_sequence
    ref_digests = reference.digests if aligned else None
    got_digests = other.digests if aligned else None
    span = _dense_span(reference_ids, other.ids)
    if span is not None:
        diff = _differences_dense(reference_ids, ref_digests, other.ids, got_digests, *span)
    else:
        diff = _differences_sorted(reference_ids, ref_digests, other.ids, got_digests)

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
    if diff.reference_repeats:
        notes.append(f"the reference itself repeated {diff.reference_repeats} deliveries")

    duplicated = dict(zip(label(diff.duplicated_ids), diff.duplicated_counts.tolist(), strict=True))
    surplus = int(np.sum(diff.duplicated_counts - 1))
    sources: dict = {}
    if duplicated and other.workers is not None:
        named = slice(0, MAX_NAMED_SOURCES)  # naming every copy of millions of ids helps nobody
        copies = _copies_by_source(other, diff.duplicated_ids[named], diff.duplicated_counts[named])
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
        notes += _duplicate_diagnosis(diff, other.workers, source_kind)

    if compare_targets and same_sequence:
        changed = np.unique(other.ids[reference.digests != other.digests])
    else:
        changed = diff.changed if diff.changed is not None else np.zeros(0, np.int64)

    order_differs, first_difference = False, None
    if not is_range:
        length = min(reference.ids.size, other.ids.size)
        if not same_sequence and not np.array_equal(reference.ids[:length], other.ids[:length]):
            position = int(np.argmax(reference.ids[:length] != other.ids[:length]))
            order_differs = True
            first_difference = (
                position,
                label(reference.ids[position : position + 1])[0],
                label(other.ids[position : position + 1])[0],
            )
        elif order == "shuffled" and length > 1:
            notes.append(
                "the order is the same as the reference's although shuffling was expected: "
                "is the sampler's generator re-seeded every epoch?"
            )
    if order == "same" and order_differs and (missing.size or duplicated):
        notes.append("the order difference may only follow from the missing or duplicated samples")
    if not other.complete:
        notes.append("the epoch was stopped before the loader was exhausted")

    return AuditReport(
        what=what or "delivered against reference",
        expected=diff.expected,
        delivered=int(other.ids.size),
        missing=label(missing),
        unexpected=label(unexpected),
        duplicated=duplicated,
        changed_targets=label(changed),
        dropped=label(dropped),
        padded=padded,
        order=order,
        order_differs=order_differs,
        first_order_difference=first_difference,
        duplicate_sources=sources,
        source_kind=source_kind,
        targets_compared=compare_targets,
        notes=notes,
    )


def _duplicate_diagnosis(diff: _Differences, workers: np.ndarray | None, source_kind: str) -> list[str]:
    """Names the classic pattern: every worker (or rank) read the whole stream."""
    if workers is None:
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


def _as_reference(expected: int | Iterable | Epoch | None, epoch: Epoch) -> Epoch | int:
    """The reference ``compare`` takes for a dataset's ids: an Epoch of them, or N for ``0..N-1``."""
    if isinstance(expected, Epoch):
        return expected
    if expected is None:
        return Epoch(ids=np.unique(epoch.ids), names=epoch.names)
    if isinstance(expected, (int, np.integer)):
        return int(expected)
    names: dict[int, str] = {}
    codes, _ = _id_codes(
        list(expected) if not isinstance(expected, (np.ndarray, torch.Tensor)) else expected, names
    )
    return Epoch(ids=np.unique(codes), names=names or None)


def _size(reference: Epoch | int) -> int:
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
    reference = _as_reference(expected, epoch)
    return compare(
        reference,
        epoch,
        order="any",
        drop_last=drop_last,
        batch_size=batch_size,
        dataset_size=_size(reference) if expected is not None else None,
        allowed_dropped=allowed_dropped,
        what=what or "delivered against the dataset",
    )


def check_distributed(
    source: Ledger | Epoch,
    expected: int | Iterable,
    *,
    sampler_drop_last: bool = False,
    drop_last: bool = False,
    batch_size: int | None = None,
    group: Any = None,
) -> AuditReport:
    """Gathers every rank's epoch and checks their union against the dataset: complete, and disjoint
    up to ``DistributedSampler``'s documented padding. Call it on every rank (it is a collective);
    every rank gets the same report. Without an initialized process group it checks this process alone.

    Args:
        source: this rank's ledger (its last epoch) or epoch.
        expected: the dataset's ids, as for ``check``.
        sampler_drop_last: the DistributedSampler's ``drop_last``: it leaves out the tail instead of
            padding with repeats.
        drop_last, batch_size: each rank's DataLoader ``drop_last``: up to ``num_samples % batch_size``
            more ids left out per rank.
        group: the process group (the default one when None).
    """
    epoch = source.last if isinstance(source, Ledger) else source
    payload = {"ids": epoch.ids, "names": epoch.names}
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed:
        world = torch.distributed.get_world_size(group)
        gathered: list[Any] = [None] * world
        torch.distributed.all_gather_object(gathered, payload, group=group)
    else:
        world, gathered = 1, [payload]
    ids = np.concatenate([np.asarray(p["ids"], np.int64) for p in gathered])
    ranks = np.repeat(np.arange(world, dtype=np.int16), [len(p["ids"]) for p in gathered])
    names = {k: v for p in gathered for k, v in (p["names"] or {}).items()} or None
    union = Epoch(ids=ids, workers=ranks, names=names)
    reference = _as_reference(expected, union)

    # DistributedSampler: num_samples per rank, padded with repeats up to a multiple of the world size,
    # or (sampler drop_last) cut down to one.
    size = _size(reference)
    if sampler_drop_last and size % world:
        per_rank = math.ceil((size - world) / world)
    else:
        per_rank = math.ceil(size / world)
    total = per_rank * world
    padding, sampler_dropped = max(total - size, 0), max(size - total, 0)
    loader_dropped = world * (per_rank % batch_size) if drop_last and batch_size else 0
    report = compare(
        reference,
        union,
        order="any",
        dataset_size=size,
        allowed_dropped=sampler_dropped + loader_dropped,
        allowed_repeats=padding,
        what=f"{world} ranks together against the dataset",
        source_kind="rank",
    )
    if not distributed:
        report.notes.append("torch.distributed is not initialized: checked this process alone")
    return report


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
