"""What one pass over a loader delivered: the ids in delivery order, with their target digests and
workers, as the ledger records it and the checks compare it."""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["Epoch"]

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
