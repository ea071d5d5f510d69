"""Batches of dataset indices as numpy int64 arrays: one permutation per epoch, cut into batches."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

from .arguments import distributed_split, flag, integer
from .sampler_state import Position, ResumableEpochs, ResumeAllowance

__all__ = ["IndexBatches"]


class IndexBatches(ResumableEpochs, Sampler[np.ndarray]):
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

    ``state_dict()`` and ``load_state_dict()`` resume an epoch mid-way, exactly once, on any world size
    (``ResumableEpochs``): the rest of the order, padded as DistributedSampler pads, from the start of
    the epoch's order, or cut with ``sampler_drop_last``.
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
        self._split_by(distributed_split(rank, world_size))
        self.epoch = 0
        self._count = self.n

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch: with ``shuffle`` (and no generator) the permutation is seeded ``seed + epoch``.
        Call it before each epoch's ``iter()``, as for DistributedSampler. After ``load_state_dict``, the
        saved epoch keeps the loaded position; another drops it and starts from its beginning."""
        self._change_epoch(integer("epoch", epoch))

    @property
    def sampler(self) -> IndexBatches:
        """This batch sampler itself: Lightning, and code written for ``BatchSampler``, tell the epoch
        through ``batch_sampler.sampler.set_epoch(epoch)``, never the batch sampler's own."""
        return self

    def for_rank(self, rank: int, world_size: int) -> IndexBatches:
        """The same sampler for one rank of ``world_size``, what each process of a run makes: a shallow
        copy, so a subclass stays a subclass with its own attributes, with the split set and its epoch
        state fresh (epoch 0, no position).

        Raises:
            ValueError: the sampler has a generator (one process's state: every rank must draw the same
                permutation; pass ``seed`` instead).
        """
        split = self._fresh_copy()
        split._split_by(distributed_split(rank, world_size))
        return split

    def resume_allowance(self, world_size: int, resumed_world_size: int) -> ResumeAllowance:
        """What an epoch checkpointed on ``world_size`` ranks and resumed on ``resumed_world_size`` may
        repeat and leave out, counted over the ids delivered before and after the checkpoint. With W
        the larger of the two world sizes: DistributedSampler's padding repeats at most W - 1 samples
        (none with ``sampler_drop_last``); ``sampler_drop_last`` cuts at most W - 1 and ``drop_last``
        at most W * (batch_size - 1). The resume pads or cuts only what is left of the epoch, so the
        bounds are the larger world size's, not the two added (some data set size and checkpoint reaches
        each)."""
        widest = max(
            integer("world_size", world_size, low=1), integer("resumed_world_size", resumed_world_size, low=1)
        )
        repeats = 0 if self.sampler_drop_last else widest - 1
        cut = widest - 1 if self.sampler_drop_last else 0
        short_batches = widest * (self.batch_size - 1) if self.drop_last else 0
        return ResumeAllowance(repeats=repeats, drops=cut + short_batches)

    def _split_by(self, split: tuple[int, int] | None) -> None:
        """Sets the distributed split (None: one process reads everything) and what follows from it."""
        if split is None:
            if self.sampler_drop_last:
                raise ValueError(
                    "sampler_drop_last: is DistributedSampler's drop_last and needs rank and world_size; "
                    "drop_last drops a short last batch"
                )
            self.rank, self.world_size, self.distributed = 0, 1, False
        else:
            if self.generator is not None:
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

    def __iter__(self) -> Iterator[np.ndarray]:
        # A generator: the order is drawn at the first next(), as BatchSampler(...) draws it.
        position = self._claim()
        draws = position is None  # a loaded position drew its order, and the tail, at load
        if position is None:
            position = self._fresh_position(draw=True)
        self._begin(position)
        layout = position.layout
        while position.taken < layout.count:
            batch = layout.batch(position.taken)
            if draws and len(batch) < self.batch_size:  # BatchSampler reads past the end to fill it
                self._tail_draw()
            position.taken += 1
            yield batch
        if draws and layout.short_batch_missing:
            self._tail_draw()  # no short batch: BatchSampler reads past the end at the next() that stops
        position.exhausted = True

    def _fresh_position(self, draw: bool = False) -> Position:
        """The epoch from its start; with ``draw``, its order drawn now (an epoch of no batches draws too, as
        RandomSampler does), the generator's state taken first."""
        generator_state = self._generator_state()
        order = self._order(self.epoch) if draw else None
        layout = self._layout(self.epoch, 0, self.world_size, order)
        return Position(self.epoch, 0, self.world_size, 0, layout, generator_state=generator_state)

    def _restore(self, position: Position) -> None:
        if self.generator is not None:
            # The epoch's order and its tail draw, taken now: the generator then stands where the
            # uninterrupted epoch leaves it, whether this epoch is continued or dropped by set_epoch.
            try:
                self.generator.set_state(
                    torch.frombuffer(bytearray(position.generator_state), dtype=torch.uint8)
                )
            except RuntimeError as error:
                raise ValueError(
                    f"IndexBatches.load_state_dict: generator_state is not a state of this generator: {error}"
                ) from None
            order = self._order(position.epoch)
            self._tail_draw()
            position.layout = self._layout(position.epoch, position.start, position.world_size, order)

    def _made_for(self) -> dict:
        return {
            "n": self.n,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "sampler_drop_last": self.sampler_drop_last,
            "generator": self.generator is not None,
        }

    def _generator_state(self) -> bytes | None:
        return None if self.generator is None else self.generator.get_state().numpy().tobytes()

    def _layout(
        self, epoch: int, start: int, world_size: int, order: np.ndarray | None = None
    ) -> _RankBatches:
        """The batches of the epoch's order from ``start`` on, cut for ``world_size`` ranks, as this rank
        takes them (rank 0's when ``world_size`` is not this sampler's: only the counts are read)."""
        rank = self.rank if world_size == self.world_size else 0
        return _RankBatches(self, epoch, start, world_size, rank, order)

    def _tail_draw(self) -> None:
        # RandomSampler draws a second randperm (for its num_samples % n tail, empty) when its first
        # is used up; draw it at the same next(), so a generator shared across epochs stays in step.
        if self.shuffle and self.generator is not None and self.n:
            torch.randperm(self.n, generator=self.generator)

    def _order(self, epoch: int) -> np.ndarray:
        """The epoch's order of all ``n`` samples, before the distributed split."""
        if not self.shuffle or self.n == 0:
            return np.arange(self.n, dtype=np.int64)
        generator = self.generator
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
        return torch.randperm(self.n, generator=generator).numpy()


class _RankBatches:
    """One segment of an IndexBatches epoch as one rank takes it: the epoch's order from ``start`` on,
    padded with repeats of the start of the order (DistributedSampler's padding, several rounds when
    ``world_size`` exceeds the samples) or cut (``sampler_drop_last``) to a multiple of ``world_size``,
    every ``world_size``-th from ``rank``, in batches. The counts need no order; the order is drawn at
    the first ``batch()``."""

    def __init__(
        self,
        sampler: IndexBatches,
        epoch: int,
        start: int,
        world_size: int,
        rank: int,
        order: np.ndarray | None,
    ) -> None:
        self._sampler, self._epoch, self._order = sampler, epoch, order
        self.start, self.world_size, self.rank = start, world_size, rank
        rest = sampler.n - start
        self.per_rank = rest // world_size if sampler.sampler_drop_last else -(-rest // world_size)
        size = sampler.batch_size
        self.count = self.per_rank // size if sampler.drop_last else -(-self.per_rank // size)
        # No short last batch: BatchSampler reads past the end once more, at the next() that stops.
        self.short_batch_missing = sampler.drop_last or self.per_rank % size == 0
        self._rank_order: np.ndarray | None = None

    def samples_done(self, taken: int) -> int:
        # Rank r's first taken batches are positions r, r + W, ... of the segment: together a prefix.
        return self.start + self.world_size * taken * self._sampler.batch_size

    def batch(self, j: int) -> np.ndarray:
        if self._rank_order is None:
            self._rank_order = self._cut()
        size = self._sampler.batch_size
        return self._rank_order[j * size : (j + 1) * size]

    def _cut(self) -> np.ndarray:
        order = self._order if self._order is not None else self._sampler._order(self._epoch)
        rest = order[self.start :]
        if self.world_size == 1:
            return rest
        total = self.per_rank * self.world_size
        if total > len(rest):
            rest = np.concatenate([rest, np.resize(order, total - len(rest))])
        # Contiguous, so each batch is one plain block.
        return np.ascontiguousarray(rest[self.rank : total : self.world_size])
