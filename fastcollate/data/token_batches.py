"""Batches of dataset indices filled up to a token budget: what packed batches want, a steady number of
tokens a step instead of a steady number of samples."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from .arguments import distributed_split, flag, integer
from .sampler_state import ResumableEpochs, ResumeAllowance

__all__ = ["TokenBudgetBatches"]


class TokenBudgetBatches(ResumableEpochs, Sampler[list[int]]):
    """A batch sampler whose batches hold at most ``max_tokens`` tokens each, every index once an epoch.

        loader = DataLoader(dataset, batch_sampler=TokenBudgetBatches(lengths, 16384, shuffle=True),
                            collate_fn=fastcollate.assemble.using(packed_contract))

    Each epoch takes the indices in order (with ``shuffle``, a permutation seeded ``seed + epoch``, the
    same in every process) and fills a batch until the next sample would take it past ``max_tokens``.

    With ``rank`` and ``world_size`` every process cuts the same batches and takes every
    ``world_size``-th from ``rank``. Nothing is repeated to even the ranks out (DistributedSampler's
    padding): a multi-sample batch is split in two, the largest first, until the batches divide evenly,
    so every rank runs the same number of steps and the union of the ranks is the dataset, once. So
    an epoch can be refused with a ValueError (naming the world sizes that would work) where
    DistributedSampler would repeat samples: where no count of batches from the fewest the budget
    fills to one a sample with tokens is a multiple of ``world_size``. That is always so with fewer
    samples than ranks, and can be so with a few more, when samples nearly fill ``max_tokens`` (3
    samples of 40 tokens each, under ``max_tokens=64``, make neither 2 batches nor 4).

    ``state_dict()`` and ``load_state_dict()`` resume an epoch mid-way on any world size, repeating
    nothing (``ResumableEpochs``).

    Args:
        lengths: each sample's token count (what the packed field's length will be).
        max_tokens: the budget; a sample longer on its own is an error naming it.
        shuffle, seed: the order of each epoch (``set_epoch`` changes it).
        rank, world_size: the distributed split, both or neither (never read from torch.distributed).
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray | torch.Tensor,
        max_tokens: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.lengths = np.asarray(lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)
        if self.lengths.ndim != 1 or (self.lengths.size and self.lengths.dtype.kind not in "iu"):
            raise TypeError(
                f"lengths: expected one integer a sample, got an array of shape {self.lengths.shape} "
                f"and dtype {self.lengths.dtype}"
            )
        self.lengths = self.lengths.astype(np.int64)
        self.max_tokens = integer("max_tokens", max_tokens, low=1)
        self.shuffle = flag("shuffle", shuffle)
        self.seed = integer("seed", seed)
        self.rank, self.world_size = distributed_split(rank, world_size) or (0, 1)
        negative = np.flatnonzero(self.lengths < 0)
        if negative.size:
            raise ValueError(
                f"lengths: sample {int(negative[0])} has length {int(self.lengths[negative[0]])}"
            )
        too_long = np.flatnonzero(self.lengths > self.max_tokens)
        if too_long.size:
            index = int(too_long[0])
            raise ValueError(
                f"sample {index} has {int(self.lengths[index])} tokens, over max_tokens={self.max_tokens} "
                f"on its own ({too_long.size} samples are): raise max_tokens, or truncate or drop it "
                "in the dataset"
            )
        self.epoch = 0
        self._count = len(self.lengths)
        self._last_layout: tuple[tuple, _RankBatches] | None = None
        self._made_for_cached: dict | None = None

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch: with ``shuffle`` the order is seeded ``seed + epoch``. Call it before each
        epoch. After ``load_state_dict``, the saved epoch keeps the loaded position; another drops it."""
        self._change_epoch(integer("epoch", epoch))

    @property
    def sampler(self) -> TokenBudgetBatches:
        """This batch sampler itself, for code that calls ``batch_sampler.sampler.set_epoch(epoch)``."""
        return self

    def for_rank(self, rank: int, world_size: int) -> TokenBudgetBatches:
        """The same sampler for one rank of ``world_size``, what each process of a run makes: a shallow
        copy, so a subclass stays a subclass with its own attributes, with the split set and its epoch
        state fresh (epoch 0, no position)."""
        split = self._fresh_copy()
        split.rank, split.world_size = distributed_split(rank, world_size) or (0, 1)
        return split

    def resume_allowance(self, world_size: int, resumed_world_size: int) -> ResumeAllowance:
        """Nothing: an epoch resumed on any world size delivers every sample exactly once (batches are
        split, never padded; nothing is dropped)."""
        return ResumeAllowance(repeats=0, drops=0)

    def __iter__(self) -> Iterator[list[int]]:
        position = self._claim() or self._fresh_position()
        self._begin(position)
        while position.taken < position.layout.count:
            batch = position.layout.batch(position.taken)
            position.taken += 1
            yield batch
        position.exhausted = True

    def _made_for(self) -> dict:
        # Computed once: StatefulDataLoader asks for the state after every batch, and the sum and digest
        # of the lengths are O(n). write_state copies it, so a state never shares it.
        if self._made_for_cached is None:
            self._made_for_cached = {
                "n": len(self.lengths),
                "tokens": int(self.lengths.sum()),
                "lengths_digest": hashlib.blake2b(self.lengths.tobytes(), digest_size=8).hexdigest(),
                "max_tokens": self.max_tokens,
                "shuffle": self.shuffle,
                "seed": self.seed,
            }
        return self._made_for_cached

    def _layout(self, epoch: int, start: int, world_size: int) -> _RankBatches:
        """The batches of the epoch's order from ``start`` on, for ``world_size`` ranks, as this rank
        takes them (rank 0's when ``world_size`` is not this sampler's: only the counts are read);
        the last one laid out is kept, as len() and iter() ask for the same."""
        rank = self.rank if world_size == self.world_size else 0
        key = (epoch, start, world_size, rank)
        if self._last_layout is None or self._last_layout[0] != key:
            n = len(self.lengths)
            if self.shuffle:
                generator = torch.Generator()
                generator.manual_seed(self.seed + epoch)
                order = torch.randperm(n, generator=generator).numpy()
            else:
                order = np.arange(n, dtype=np.int64)
            rest = order[start:]
            filled = _fill(rest, self.lengths[rest], self.max_tokens)
            batches = _split_to_multiple(filled, self.lengths, world_size)
            if batches is None:
                raise ValueError(self._unshared(epoch, start, len(rest), filled, world_size))
            self._last_layout = (key, _RankBatches(batches, start, world_size, rank))
        return self._last_layout[1]

    def _unshared(
        self, epoch: int, start: int, samples: int, filled: list[np.ndarray], world_size: int
    ) -> str:
        """Why ``filled`` cannot be shared evenly by ``world_size`` ranks, and which world sizes can."""
        fewest, most = len(filled), _most_batches(filled, self.lengths)
        if start:
            what = f"the {samples} samples left of epoch {epoch} ({start} were consumed)"
            fits = _ranks_that_fit(fewest, most, world_size)
            way_out = f"resume on {fits}, or from another checkpoint"
        else:
            what = f"epoch {epoch}'s {samples} samples"
            way_out = (
                f"use {_ranks_that_fit(fewest, most, world_size)}, or raise max_tokens in a new run (a "
                "checkpoint resumes only with the max_tokens it was made with)"
            )
        counts = f"{fewest} to {most} batches" if fewest < most else f"{fewest} batch{'es' * (fewest > 1)}"
        if fewest == most:
            verdict = f"{fewest} does not divide"
        else:
            verdict = f"no count from {fewest} to {most} divides"
        return (
            f"TokenBudgetBatches: {what} fill {counts} within max_tokens={self.max_tokens} (a batch needs a "
            f"sample with tokens), and {verdict} among {world_size} ranks: every rank must run as many "
            f"batches, and no sample is repeated. {way_out[0].upper()}{way_out[1:]}"
        )


class _RankBatches:
    """One segment of a TokenBudgetBatches epoch as one rank takes it: every ``world_size``-th batch of
    the segment from ``rank``."""

    def __init__(self, batches: list[np.ndarray], start: int, world_size: int, rank: int) -> None:
        self._batches, self._world_size, self._rank, self._start = batches, world_size, rank, start
        self.count = len(batches) // world_size
        # Samples in the segment's first i batches: the ranks' first k batches are its first k * W.
        self._consumed = np.concatenate([[0], np.cumsum([len(b) for b in batches], dtype=np.int64)])

    def samples_done(self, taken: int) -> int:
        return self._start + int(self._consumed[taken * self._world_size])

    def batch(self, j: int) -> list[int]:
        return self._batches[self._rank + j * self._world_size].tolist()


def _fill(order: np.ndarray, lengths: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Cuts ``order`` where the running token count would pass ``max_tokens`` (one pass over the lengths;
    the budget restarts at each cut, so no closed form)."""
    cuts = []
    used = 0
    for position, length in enumerate(lengths.tolist()):
        if used + length > max_tokens and position:
            cuts.append(position)
            used = 0
        used += length
    return np.split(order, cuts) if len(order) else []


def _split_to_multiple(
    batches: list[np.ndarray], lengths: np.ndarray, world_size: int
) -> list[np.ndarray] | None:
    """Splits the largest batches in two until every rank gets as many batches, or None where no split
    can. Only a batch with two samples that have tokens is split, between them: a half of empty samples
    alone is a batch of no tokens, which the packed collate refuses, on that rank only (and DDP's other
    ranks would wait). So the counts reachable run from the cut's own to ``_most_batches``, one a split."""
    fewest, most = len(batches), _most_batches(batches, lengths)
    if -(-fewest // world_size) * world_size > most:
        return None
    batches = list(batches)
    while len(batches) % world_size:
        splittable = [i for i, b in enumerate(batches) if np.count_nonzero(lengths[b]) > 1]
        largest = max(splittable, key=lambda i: int(lengths[batches[i]].sum()))
        batch = batches[largest]
        with_tokens = np.flatnonzero(lengths[batch])
        # The middle, moved inside (first sample with tokens, last one]: both halves then have tokens.
        cut = min(max(len(batch) // 2, int(with_tokens[0]) + 1), int(with_tokens[-1]))
        batches[largest : largest + 1] = [batch[:cut], batch[cut:]]
    return batches


def _most_batches(batches: list[np.ndarray], lengths: np.ndarray) -> int:
    """The most batches splitting can make of ``batches``: one a sample with tokens (a cut gives each batch
    one; one batch, if none has tokens)."""
    with_tokens = sum(int(np.count_nonzero(lengths[b])) for b in batches)
    return max(with_tokens, len(batches))


def _ranks_that_fit(fewest: int, most: int, world_size: int) -> str:
    """The world sizes nearest ``world_size`` that some count of batches from ``fewest`` to ``most`` is a
    multiple of, as words: "1, 2 or 4 ranks"."""
    fits = [w for w in range(1, most + 1) if -(-fewest // w) * w <= most]
    near = [w for w in fits if w < world_size][-3:] + [w for w in fits if w > world_size][:2]
    if len(near) == 1:
        return f"{near[0]} rank{'s' * (near[0] > 1)}"
    return ", ".join(map(str, near[:-1])) + f" or {near[-1]} ranks"
