"""``for_rank``: the sampler a user gave, for one rank of a run: the same class (a subclass stays one,
with its own attributes), the same arguments, a fresh epoch; refused, saying why, where no split can
give every rank the same order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastcollate import IndexBatches, TokenBudgetBatches

LENGTHS = np.random.default_rng(0).integers(1, 30, size=41)


class TaggedIndexBatches(IndexBatches):
    """A user's subclass with an argument of its own."""

    def __init__(self, n, batch_size, tag, **options):
        super().__init__(n, batch_size, **options)
        self.tag = tag


class TaggedTokenBatches(TokenBudgetBatches):
    def __init__(self, lengths, max_tokens, tag, **options):
        super().__init__(lengths, max_tokens, **options)
        self.tag = tag


def as_lists(sampler):
    return [[int(i) for i in batch] for batch in sampler]


CASES = {
    "index-shuffled": (TaggedIndexBatches, IndexBatches, (41, 4), dict(shuffle=True, seed=4)),
    "index-drop-last": (TaggedIndexBatches, IndexBatches, (41, 4), dict(drop_last=True)),
    "index-sampler-drop-last": (
        TaggedIndexBatches,
        IndexBatches,
        (41, 4),
        dict(shuffle=True, sampler_drop_last=True, rank=1, world_size=2),
    ),
    "tokens-shuffled": (TaggedTokenBatches, TokenBudgetBatches, (LENGTHS, 60), dict(shuffle=True, seed=2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_for_rank_keeps_the_class_its_attributes_and_its_arguments(case):
    subclass, base, arguments, options = CASES[case]
    sampler = subclass(*arguments, "mine", **options)
    given_split = (sampler.rank, sampler.world_size)
    unsplit = {key: value for key, value in options.items() if key not in ("rank", "world_size")}
    for rank in range(3):
        split = sampler.for_rank(rank, 3)
        assert type(split) is subclass and split.tag == "mine"
        assert as_lists(split) == as_lists(base(*arguments, rank=rank, world_size=3, **unsplit))
    assert (sampler.rank, sampler.world_size) == given_split, "the sampler given is left as it was"


@pytest.mark.parametrize(
    "make", [lambda: IndexBatches(30, 4, shuffle=True), lambda: TokenBudgetBatches(LENGTHS, 60, shuffle=True)]
)
def test_for_rank_starts_a_fresh_epoch_and_leaves_the_original_s_going_on(make):
    sampler = make()
    iterator = iter(sampler)
    next(iterator)  # the epoch under way
    state = sampler.state_dict()
    loaded = make()
    loaded.load_state_dict(state)  # a position waiting for the next iteration
    fresh = make().for_rank(1, 2)
    fresh_state, fresh_length, fresh_batches = fresh.state_dict(), len(fresh), as_lists(fresh)
    for split in (sampler.for_rank(1, 2), loaded.for_rank(1, 2)):
        assert split.state_dict() == fresh_state and len(split) == fresh_length
        assert as_lists(split) == fresh_batches, "the whole epoch, from its first batch"
    assert sampler.state_dict() == state, "the original's epoch goes on where it was"
    assert len(list(iterator)) == len(sampler) - 1
    assert len(as_lists(loaded)) == len(loaded) - 1, "the loaded one resumes after the batch taken"


def test_index_batches_with_a_generator_cannot_be_split_by_rank_and_says_why():
    sampler = IndexBatches(30, 4, shuffle=True, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="generator: cannot be combined with rank and world_size.*Pass seed"):
        sampler.for_rank(0, 2)


SAMPLERS = {IndexBatches: (30, 4), TokenBudgetBatches: (LENGTHS, 60)}


@pytest.mark.parametrize("kind", list(SAMPLERS), ids=lambda kind: kind.__name__)
@pytest.mark.parametrize(("rank", "world_size"), [(2, 2), (-1, 2), (0, 0), (0.0, 2)])
def test_a_bad_split_is_refused_by_for_rank_in_the_constructor_s_words(kind, rank, world_size):
    with pytest.raises((ValueError, TypeError)) as by_constructor:
        kind(*SAMPLERS[kind], rank=rank, world_size=world_size)
    with pytest.raises((ValueError, TypeError)) as by_for_rank:
        kind(*SAMPLERS[kind]).for_rank(rank, world_size)
    assert type(by_for_rank.value) is type(by_constructor.value)
    assert str(by_for_rank.value) == str(by_constructor.value)
