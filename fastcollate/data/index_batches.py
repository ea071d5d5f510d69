"""Batches of dataset indices as numpy int64 arrays: one permutation per epoch, cut into batches."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

from .arguments import distributed_split, flag, integer

__all__ = ["IndexBatches"]


class IndexBatches(Sampler[np.ndarray]):
    """A batch sampler that yields each batch of indices as one ``np.ndarray`` of int64, shape (k,).

    ``BatchSampler`` over a stock sampler builds one Python int per sample; a dataset that gathers a
    batch by index in one call (``__getitems__``, e.g. over arrays or a memory map) wants the indices as
    one array. Each epoch draws one permutation (one ``torch.randperm``), converts it once with
    ``.numpy()``, and yields contiguous slices of it; no per-sample Python ints are made.

        loader = DataLoader(dataset, batch_sampler=IndexBatches(len(dataset), 256, shuffle=True))

    The order is exactly the stock samplers' (the tests hold it):

    * without ``rank``/``world_size``: ``BatchSampler(SequentialSampler(range(n)), batch_size,
      drop_last)``; with ``shuffle`` and a ``generator``, ``BatchSampler(RandomSampler(range(n),
      generator=generator), ...)``, drawing from the generator as RandomSampler does (the epoch is then
      not used: the generator's state moves on every epoch). With ``shuffle`` and no generator, the
      permutation is seeded with ``seed + epoch`` (not from torch's global RNG, as RandomSampler would):
      reproducible, changed by ``set_epoch``, and the same as ``world_size=1`` below.
    * with ``rank`` and ``world_size``: ``BatchSampler(DistributedSampler(range(n), world_size, rank,
      shuffle, seed, drop_last=sampler_drop_last), batch_size, drop_last)`` after ``set_epoch(epoch)``:
      padded with repeats of the start of the order (or cut, with ``sampler_drop_last``) to a multiple of
      ``world_size``, then every ``world_size``-th index from ``rank``. Both are given explicitly, never
      read from ``torch.distributed``: the same call means the same order in every process.

    A DataLoader hands each array to ``dataset.__getitems__`` when the dataset has it, else indexes
    ``dataset[i]`` per element (numpy integers index tensors and lists like ints do).
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        generator: torch.Generator | None = None,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        sampler_drop_last: bool = False,
    ) -> None:
        self.n = integer("n", n, low=0)
        self.batch_size = integer("batch_size", batch_size, low=1)
        self.shuffle = flag("shuffle", shuffle)
        self.drop_last = flag("drop_last", drop_last)
        self.sampler_drop_last = flag("sampler_drop_last", sampler_drop_last)
        self.seed = integer("seed", seed)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
        self.generator = generator
        split = distributed_split(rank, world_size)
        if split is None:
            if sampler_drop_last:
                raise ValueError(
                    "sampler_drop_last: is DistributedSampler's drop_last and needs rank and world_size; "
                    "drop_last drops a short last batch"
                )
            self.rank, self.world_size, self.distributed = 0, 1, False
        else:
            if generator is not None:
                raise ValueError(
                    "generator: cannot be combined with rank and world_size: every rank must draw the same "
                    "permutation, which DistributedSampler seeds with seed + epoch; a generator's state "
                    "belongs to one process. Pass seed instead"
                )
            self.rank, self.world_size = split
            self.distributed = True
        # DistributedSampler's num_samples: ceil(n / world) padded, or floor when it cuts the tail
        # (its ceil((n - world) / world) when n % world, which is n // world).
        if self.sampler_drop_last:
            self.num_samples = self.n // self.world_size
        else:
            self.num_samples = -(-self.n // self.world_size)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch: with ``shuffle`` (and no generator) the permutation is seeded ``seed + epoch``.
        Call it before each epoch's ``iter()``, as for DistributedSampler."""
        self.epoch = integer("epoch", epoch)

    @property
    def sampler(self) -> IndexBatches:
        """This batch sampler itself: Lightning, and code written for ``BatchSampler``, tell the epoch
        through ``batch_sampler.sampler.set_epoch(epoch)``, never the batch sampler's own."""
        return self

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def __iter__(self) -> Iterator[np.ndarray]:
        # A generator, so the order is drawn at the first next() as BatchSampler(...) draws it: a
        # set_epoch between iter() and next() counts, and a shared generator moves at the same calls.
        order = self._order()
        stop = len(self) * self.batch_size if self.drop_last else len(order)
        for start in range(0, stop, self.batch_size):
            batch = order[start : start + self.batch_size]
            if len(batch) < self.batch_size:  # BatchSampler reads past the end to fill a short batch
                self._tail_draw()
            yield batch
        if self.drop_last or len(order) % self.batch_size == 0:
            self._tail_draw()  # no short batch: BatchSampler reads past the end at the next() that stops

    def _tail_draw(self) -> None:
        # RandomSampler draws a second randperm (for its num_samples % n tail, empty) when its first
        # is used up; draw it at the same next(), so a generator shared across epochs stays in step.
        if self.shuffle and self.generator is not None and self.n:
            torch.randperm(self.n, generator=self.generator)

    def _order(self) -> np.ndarray:
        if not self.shuffle or self.n == 0:
            order = np.arange(self.n, dtype=np.int64)
        else:
            generator = self.generator
            if generator is None:
                generator = torch.Generator()
                generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=generator).numpy()
        if not self.distributed:
            return order
        # np.resize repeats the order cyclically (DistributedSampler's padding, several rounds when
        # world_size > n) or cuts it (sampler_drop_last); contiguous so each batch is one plain block.
        total = self.num_samples * self.world_size
        return np.ascontiguousarray(np.resize(order, total)[self.rank : total : self.world_size])

