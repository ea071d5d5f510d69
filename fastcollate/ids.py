"""Sample ids: what errors, audits and ledgers name a sample by, kept apart from its batch position."""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from typing import Any, NamedTuple

from torch.utils.data import Dataset, IterableDataset

__all__ = ["IdentifiedSample", "with_ids"]


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
        sample = self.dataset[index]
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
    return _WithIds(dataset, key)
