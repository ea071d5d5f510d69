"""The rounds a ratio is measured in: an epoch as a ratio benchmark runs it (``endless``: the next
batches of an iterator kept across rounds) and the spread it reports (``quartiles``)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator

from torch.utils.data import DataLoader

Epoch = Callable[[int], Iterator]  # batches -> an iterator over that many batches


def endless(epochs: Callable[[], Iterator]) -> Epoch:
    """The next ``batches`` batches of an iterator kept across rounds, a new epoch begun when one ends:
    a round measures batches as training meets them, with the per-epoch work (a permutation of every
    index) spread over the epoch's batches, not charged to the first few."""
    state = {"it": epochs()}

    def run(batches: int) -> Iterator:
        for _ in range(batches):
            try:
                yield next(state["it"])
            except StopIteration:
                state["it"] = epochs()
                yield next(state["it"])

    return run


def loader_epoch(loader: DataLoader) -> Epoch:
    return endless(lambda: iter(loader))


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]
