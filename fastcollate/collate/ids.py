"""Sample ids: what errors, audits and ledgers name a sample by, kept apart from its batch position."""

from __future__ import annotations

import copy
import numbers
from collections.abc import Mapping, MutableMapping
from typing import Any, NamedTuple

from torch.utils.data import Dataset, IterableDataset

from ..data.arrays import Arrays

__all__ = ["TARGET_KEYS", "IdentifiedSample", "guess_target_path", "with_ids"]

TARGET_KEYS = ("y", "label", "labels", "target", "targets")
"""Field names taken as a sample's targets, in order of preference, when none is named (``doctor``
without ``--targets``, ``bench``)."""


class IdentifiedSample(NamedTuple):
    """A sample that is not a mapping, with its dataset index as ``id``.

    ``assemble`` collates it to ``IdentifiedSample(id=tensor([...]), sample=<batched sample>)``.
    """

    id: int
    sample: Any


class _WithIds(Dataset):
    def __init__(self, dataset: Dataset, key: str) -> None:
        self.dataset = dataset
        self.key = key

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self._tagged(self.dataset[index], self._id(index))

    def __getitems__(self, indices: list[int]) -> list[Any]:
        # Defined, not found through __getattr__: the wrapped dataset's own would hand out its samples
        # without the ids (DataLoader calls it whenever a dataset has it).
        read_batch = getattr(self.dataset, "__getitems__", None)
        if read_batch is None:
            return [self[index] for index in indices]
        samples = read_batch(indices)
        ids = map(self._id, indices)
        return [self._tagged(sample, index) for sample, index in zip(samples, ids, strict=True)]

    def _id(self, index: Any) -> Any:
        """The id of the sample read at ``index``: counted from the start, as a sampler's indices are (an
        index from the end reads the same sample), and a Python int."""
        if isinstance(index, numbers.Integral) and not isinstance(index, bool):
            index = int(index)
            return index + len(self) if index < 0 else index
        return index

    def _tagged(self, sample: Any, index: int) -> Any:
        if isinstance(sample, Mapping):
            if self.key in sample:
                return sample  # the dataset's own ids win: they are what its owner knows samples by
            if isinstance(sample, MutableMapping) and type(sample) is not dict:
                tagged = copy.copy(sample)
                tagged[self.key] = index
                return tagged
            return {**sample, self.key: index}
        return IdentifiedSample(id=index, sample=sample)

    def __getattr__(self, name: str) -> Any:  # keep the wrapped dataset's attributes reachable
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def with_ids(dataset: Dataset, key: str = "id") -> Dataset:
    """Wraps a map-style dataset so every sample carries its dataset index as an id.

    Mapping samples get ``key`` added (a sample that already has ``key`` is left as it is); other
    samples become ``IdentifiedSample(id=index, sample=sample)``. Errors from ``assemble`` then name
    the failing sample's index instead of its batch position.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``).
        key: the id key, as ``assemble.using(id_key=...)`` reads it.
    """
    if isinstance(dataset, IterableDataset):
        raise TypeError(
            "with_ids needs a map-style dataset: an IterableDataset's position in the stream is not a "
            "stable id (each worker has its own stream). Yield an id field from the iterable itself."
        )
    if isinstance(dataset, Arrays):  # its batches still gathered by column, with the ids
        if key in dataset.columns:
            return dataset  # each sample holds the key: the dataset's own ids win, as over any mapping
        if dataset.index_as in (None, key):
            return dataset.indexed_as(key)
    return _WithIds(dataset, key)


def guess_target_path(sample: Any) -> str | None:
    """The path (as ``tree.lookup`` reads it) of a sample's or a batch's targets, when none is named:
    the first of ``TARGET_KEYS`` a mapping or namedtuple has, or the last field of an
    ``IdentifiedSample``'s (input, ..., target) tuple, the torchvision convention. None otherwise."""
    if isinstance(sample, IdentifiedSample):
        inner = sample.sample
        return f"sample.{len(inner) - 1}" if isinstance(inner, (list, tuple)) and len(inner) >= 2 else None
    if isinstance(sample, Mapping):
        names = sample.keys()
    elif isinstance(sample, tuple) and hasattr(type(sample), "_fields"):
        names = type(sample)._fields
    else:
        return None
    return next((name for name in TARGET_KEYS if name in names), None)
