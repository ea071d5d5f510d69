"""IndexBatches: the same batches as torch's samplers, as one int64 array each.

Parity is exact: flattened order and batch boundaries equal ``BatchSampler`` over ``SequentialSampler``,
``RandomSampler`` (a generator in the same state) or ``DistributedSampler`` (every rank, every epoch).
torch.distributed is never initialized: ranks are computed one by one.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)

from fastcollate import IndexBatches
from fastcollate.tools.audit.distributed import SamplerAllowance

SIZES = (0, 1, 7, 10, 1000)
BATCHES = (1, 3, 10, 64)
EPOCHS = (0, 1, 2)


def batches(sampler) -> list[list[int]]:
    """What a batch sampler yields, as lists: boundaries and order both compared."""
    return [[int(i) for i in batch] for batch in sampler]


def torch_distributed(n, batch_size, drop_last, rank, world, shuffle, seed, sampler_drop_last, epoch):
    inner = DistributedSampler(
        range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=sampler_drop_last
    )
    inner.set_epoch(epoch)
    return batches(BatchSampler(inner, batch_size, drop_last))


def ours_distributed(n, batch_size, drop_last, rank, world, shuffle, seed, sampler_drop_last, epoch):
    sampler = IndexBatches(
        n,
        batch_size,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        rank=rank,
        world_size=world,
        sampler_drop_last=sampler_drop_last,
    )
    sampler.set_epoch(epoch)
    got = list(sampler)
    assert len(got) == len(sampler)
    assert all(type(b) is np.ndarray and b.dtype == np.int64 and b.ndim == 1 for b in got)
    return batches(got)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("batch_size", BATCHES)
@pytest.mark.parametrize("drop_last", (False, True))
def test_unshuffled_is_batch_sampler_over_sequential_sampler(n, batch_size, drop_last):
    sampler = IndexBatches(n, batch_size, drop_last=drop_last)
    got = list(sampler)
    assert batches(got) == batches(BatchSampler(SequentialSampler(range(n)), batch_size, drop_last))
    assert len(sampler) == len(got)
    assert all(b.dtype == np.int64 and b.flags.c_contiguous for b in got)


@pytest.mark.parametrize("n", SIZES[1:])  # RandomSampler refuses an empty source
@pytest.mark.parametrize("batch_size", BATCHES)
@pytest.mark.parametrize("drop_last", (False, True))
def test_shuffled_with_a_generator_is_random_sampler_epoch_after_epoch(n, batch_size, drop_last):
    ours_generator = torch.Generator().manual_seed(123)
    theirs_generator = torch.Generator().manual_seed(123)
    sampler = IndexBatches(n, batch_size, shuffle=True, generator=ours_generator, drop_last=drop_last)
    theirs = BatchSampler(RandomSampler(range(n), generator=theirs_generator), batch_size, drop_last)
    for epoch in EPOCHS:  # one generator across epochs: it must move exactly as RandomSampler moves it
        sampler.set_epoch(epoch)
        got = list(sampler)
        assert batches(got) == batches(theirs)
        assert len(sampler) == len(got) == len(theirs)
    assert torch.equal(ours_generator.get_state(), theirs_generator.get_state())


@pytest.mark.parametrize("n, batch_size", [(9, 3), (10, 3), (2, 3)])  # full, short and only-short tails
@pytest.mark.parametrize("drop_last", (False, True))
def test_a_shared_generator_stays_in_step_when_a_loop_stops_early(n, batch_size, drop_last):
    for taken in range(len(BatchSampler(range(n), batch_size, drop_last)) + 2):
        ours_generator = torch.Generator().manual_seed(5)
        theirs_generator = torch.Generator().manual_seed(5)
        sampler = IndexBatches(n, batch_size, shuffle=True, generator=ours_generator, drop_last=drop_last)
        theirs = BatchSampler(RandomSampler(range(n), generator=theirs_generator), batch_size, drop_last)
        # a loop that stops after `taken` batches: zip asks range first, so no batch more is drawn
        ours_first = batches(b for _, b in zip(range(taken), sampler, strict=False))
        assert ours_first == batches(b for _, b in zip(range(taken), theirs, strict=False))
        assert torch.equal(ours_generator.get_state(), theirs_generator.get_state()), taken
        assert batches(sampler) == batches(theirs)  # and the next epoch draws the same


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("seed", (0, 17))
def test_shuffled_without_a_generator_is_seeded_by_seed_plus_epoch(n, seed):
    sampler = IndexBatches(n, 4, shuffle=True, seed=seed)
    orders = []
    for epoch in EPOCHS:
        sampler.set_epoch(epoch)
        got = batches(sampler)
        assert got == batches(sampler)  # the same epoch, the same order
        assert got == torch_distributed(n, 4, False, 0, 1, True, seed, False, epoch)  # world_size=1
        orders.append(sum(got, []))
        assert sorted(orders[-1]) == list(range(n))
    if n == 1000:
        assert orders[0] != orders[1] != orders[2] != orders[0]  # set_epoch changes the permutation


def test_set_epoch_between_iter_and_the_first_batch_counts_as_for_batch_sampler():
    sampler = IndexBatches(50, 8, shuffle=True, rank=0, world_size=2)
    inner = DistributedSampler(range(50), num_replicas=2, rank=0, shuffle=True)
    theirs = BatchSampler(inner, 8, False)
    ours_iter, theirs_iter = iter(sampler), iter(theirs)
    sampler.set_epoch(3)
    inner.set_epoch(3)
    got = batches(ours_iter)
    assert got == batches(theirs_iter)
    assert got != torch_distributed(50, 8, False, 0, 2, True, 0, False, 0)  # epoch 3's, not epoch 0's


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("world", (1, 2, 3, 4))
@pytest.mark.parametrize("shuffle", (False, True))
@pytest.mark.parametrize("sampler_drop_last", (False, True))
def test_every_rank_every_epoch_is_distributed_sampler_in_batches(n, world, shuffle, sampler_drop_last):
    for rank, batch_size, drop_last, epoch in itertools.product(range(world), BATCHES, (False, True), EPOCHS):
        args = (n, batch_size, drop_last, rank, world, shuffle, 7, sampler_drop_last, epoch)
        assert ours_distributed(*args) == torch_distributed(*args), args


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("world", (1, 2, 3, 4, 16))  # 16 > 10 > 7: padding repeats the order
@pytest.mark.parametrize("sampler_drop_last", (False, True))
@pytest.mark.parametrize("drop_last", (False, True))
def test_ranks_together_cover_the_dataset_up_to_the_sampler_allowance(n, world, sampler_drop_last, drop_last):
    batch_size = 3
    ids = np.concatenate(
        [np.zeros(0, np.int64)]
        + [
            b
            for rank in range(world)
            for b in IndexBatches(
                n,
                batch_size,
                shuffle=True,
                drop_last=drop_last,
                rank=rank,
                world_size=world,
                sampler_drop_last=sampler_drop_last,
            )
        ]
    )
    allowance = SamplerAllowance.of(n, world, sampler_drop_last, drop_last, batch_size)
    assert len(ids) == n + allowance.padding - allowance.dropped
    assert ((ids >= 0) & (ids < n)).all()
    missing = n - len(np.unique(ids))
    repeats = len(ids) - len(np.unique(ids))
    if drop_last:  # a rank's short last batch may hold original ids or padding
        assert missing <= allowance.dropped and repeats <= allowance.padding
    else:
        assert (missing, repeats) == (allowance.dropped, allowance.padding)


class Gathered(Dataset):
    """A dataset that gathers a batch by index in one call, recording what it was handed."""

    def __init__(self, n):
        self.values = torch.arange(n) * 10
        self.handed = []

    def __len__(self):
        return len(self.values)

    def __getitem__(self, index):
        raise AssertionError("__getitems__ is there: DataLoader must not index sample by sample")

    def __getitems__(self, indices):
        self.handed.append(indices)
        return list(self.values[torch.from_numpy(indices)])  # one gather; default_collate stacks


@pytest.mark.parametrize("num_workers", (0, 2))
def test_a_tensor_dataset_loads_every_index_once(num_workers):
    n = 103
    dataset = TensorDataset(torch.arange(n) * 10, torch.arange(n).float())
    sampler = IndexBatches(n, 8, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers)
    assert len(loader) == len(sampler) == 13
    got = list(loader)
    assert [len(x) for x, _ in got] == [8] * 12 + [7]
    values = torch.cat([x for x, _ in got])
    assert torch.equal(values, torch.from_numpy(np.concatenate(list(sampler))) * 10)  # order kept
    assert sorted(values.tolist()) == list(range(0, 10 * n, 10))  # each index once
    assert got[0][0].dtype == torch.int64 and got[0][1].dtype == torch.float32


def test_numpy_integers_index_a_tensor_as_ints_do():
    tensor = torch.arange(5) * 10
    for index in np.arange(5, dtype=np.int64):
        assert type(index) is np.int64 and tensor[index].item() == tensor[int(index)].item()
        assert tensor[index].shape == ()


def test_a_dataset_with_getitems_gets_each_batch_as_one_array():
    dataset = Gathered(20)
    sampler = IndexBatches(20, 6, shuffle=True, drop_last=True)
    got = list(DataLoader(dataset, batch_sampler=sampler))
    assert [len(b) for b in got] == [6, 6, 6]
    assert all(type(i) is np.ndarray and i.dtype == np.int64 for i in dataset.handed)
    assert torch.equal(torch.cat(got), torch.from_numpy(np.concatenate(dataset.handed)) * 10)


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"n": -1}, ValueError, "n"),
        ({"n": 3.0}, TypeError, "n"),
        ({"n": True}, TypeError, "n"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"batch_size": "4"}, TypeError, "batch_size"),
        ({"shuffle": 1}, TypeError, "shuffle"),
        ({"drop_last": None}, TypeError, "drop_last"),
        ({"seed": 1.5}, TypeError, "seed"),
        ({"generator": 3}, TypeError, "generator"),
        ({"rank": 0}, ValueError, "rank and world_size"),
        ({"world_size": 2}, ValueError, "rank and world_size"),
        ({"rank": 2, "world_size": 2}, ValueError, "rank"),
        ({"rank": -1, "world_size": 2}, ValueError, "rank"),
        ({"rank": 0, "world_size": 0}, ValueError, "world_size"),
        ({"rank": 0, "world_size": 2, "generator": torch.Generator()}, ValueError, "generator"),
        ({"sampler_drop_last": True}, ValueError, "sampler_drop_last"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, error, name):
    args = {"n": 10, "batch_size": 4, **kwargs}
    with pytest.raises(error, match=f"^{name}:"):
        IndexBatches(args.pop("n"), args.pop("batch_size"), **args)


def test_a_bad_epoch_is_refused_by_name():
    with pytest.raises(TypeError, match="^epoch:"):
        IndexBatches(10, 4).set_epoch(1.0)


def test_numpy_integers_are_taken_as_ints():
    sampler = IndexBatches(np.int64(10), np.int32(4), rank=np.int64(1), world_size=np.int64(2))
    assert type(sampler.n) is int and batches(sampler) == [[1, 3, 5, 7], [9]]


@st.composite
def distributed_cases(draw):
    world = draw(st.integers(1, 9))
    return (
        draw(st.integers(0, 300)),  # n: often below world_size * batch_size, sometimes below world_size
        draw(st.integers(1, 40)),  # batch_size
        draw(st.booleans()),  # drop_last
        draw(st.integers(0, world - 1)),  # rank
        world,
        draw(st.booleans()),  # shuffle
        draw(st.integers(0, 2**31)),  # seed
        draw(st.booleans()),  # sampler_drop_last
        draw(st.integers(0, 1000)),  # epoch
    )


@settings(max_examples=200, deadline=None)
@given(distributed_cases())
def test_property_distributed_parity(case):
    assert ours_distributed(*case) == torch_distributed(*case)
