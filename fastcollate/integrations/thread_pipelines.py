"""The stage a thread pipeline (SPDL, torchdata.nodes) runs per batch: fetch its samples, then collate
them, as a DataLoader worker does, on whichever thread the pipeline gives it.

Any number of threads may call one ``assemble`` at once: the walk holds the GIL for a few microseconds
a batch, the copy runs without it, and each batch gets a staging slot of its own (or a fresh buffer when
every slot is held), so a batch kept by one thread is never written by another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..assembler import assemble

__all__ = ["fetch_batches"]


def fetch_batches(dataset: Dataset, collate_fn: Callable[[Sequence[Any]], Any] = assemble) -> Callable:
    """A callable ``indices -> batch`` for a thread pipeline's map stage.

    Args:
        dataset: a map-style dataset. One with ``__getitems__`` (``fastcollate.Arrays``) hands it the
            whole list of indices, as DataLoader does, so an Arrays batch is gathered by index in C++.
        collate_fn: the collate function; ``fastcollate.assemble`` or a configured ``Assembler``.
    """
    getitems = getattr(dataset, "__getitems__", None)
    if callable(getitems):
        # As DataLoader passes them: a list as a list, index arrays (IndexBatches') as they are, with no
        # Python int each; anything else (a range, a generator) as a list.
        return lambda indices: collate_fn(
            getitems(indices if isinstance(indices, (list, np.ndarray, torch.Tensor)) else list(indices))
        )

    def fetch(indices):
        if isinstance(indices, (np.ndarray, torch.Tensor)):
            indices = (
                indices.tolist()
            )  # Python ints, as DataLoader's sampler gives: dataset[i] is keyed by them
        return collate_fn([dataset[i] for i in indices])

    return fetch
