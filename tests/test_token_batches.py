"""TokenBudgetBatches: batches filled up to a token budget, every index once an epoch, on every rank the
same number of batches; and the packed batches it feeds, audited."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from fastcollate import Contract, Field, IndexBatches, Packing, TokenBudgetBatches, assemble, audit
from fastcollate.collate.errors import ContractSizeError
from fastcollate.tools.audit import distributed


def lengths_of(n, seed=0, low=16, high=2048):
    return np.random.default_rng(seed).integers(low, high + 1, n)


def test_batches_are_cut_in_order_where_the_next_sample_would_pass_the_budget():
    sampler = TokenBudgetBatches([3, 4, 2, 5, 1, 6], max_tokens=7)
    assert list(sampler) == [[0, 1], [2, 3], [4, 5]]
    assert len(sampler) == 3


def test_a_sample_longer_than_the_budget_on_its_own_is_named():
    with pytest.raises(ValueError, match="sample 2 has 9 tokens, over max_tokens=8"):
        TokenBudgetBatches([3, 4, 9, 5, 10], max_tokens=8)


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(0, 300),
    max_tokens=st.integers(2048, 20000),
    seed=st.integers(0, 50),
    epoch=st.integers(0, 3),
    shuffle=st.booleans(),
)
def test_every_index_comes_once_an_epoch_and_no_batch_passes_the_budget(n, max_tokens, seed, epoch, shuffle):
    lengths = lengths_of(n, seed)
    sampler = TokenBudgetBatches(lengths, max_tokens, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    batches = list(sampler)
    assert len(batches) == len(sampler)
    assert sorted(i for b in batches for i in b) == list(range(n))
    assert all(b and lengths[b].sum() <= max_tokens for b in batches)
    # Greedy: a batch ends only where the next sample would not have fitted.
    for batch, following in zip(batches, batches[1:], strict=False):
        assert lengths[batch].sum() + lengths[following[0]] > max_tokens


def test_shuffle_changes_with_the_epoch_and_repeats_with_it():
    sampler = TokenBudgetBatches(lengths_of(200), 8192, shuffle=True, seed=3)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    sampler.set_epoch(0)
    assert list(sampler) == first and second != first
    assert list(TokenBudgetBatches(lengths_of(200), 8192)) == list(TokenBudgetBatches(lengths_of(200), 8192))
    assert [i for b in TokenBudgetBatches(lengths_of(200), 8192) for i in b] == list(range(200))


@pytest.mark.parametrize("world_size", [2, 3, 8])
@pytest.mark.parametrize("epoch", [0, 1])
def test_ranks_share_the_epoch_once_and_run_the_same_number_of_steps(world_size, epoch):
    lengths = lengths_of(101, seed=epoch)
    ranks = [
        TokenBudgetBatches(lengths, 6000, shuffle=True, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    for sampler in ranks:
        sampler.set_epoch(epoch)
    per_rank = [list(s) for s in ranks]
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == len(ranks[0])
    every = sorted(i for batches in per_rank for b in batches for i in b)
    assert every == list(range(101))
    assert all(lengths[b].sum() <= 6000 for batches in per_rank for b in batches)


def test_ranks_that_cannot_get_as_many_batches_without_a_repeat_are_refused():
    sampler = TokenBudgetBatches([5, 5, 5], max_tokens=5, rank=0, world_size=2)
    expected = "epoch 0's 3 samples fill 3 batches within max_tokens=5 .* 3 does not divide among 2 ranks"
    with pytest.raises(ValueError, match=expected):
        list(sampler)


@pytest.mark.parametrize("lengths", [[0, 0, 5, 5], [0, 0, 0, 7, 3], [4, 0, 0, 0, 0, 6], [0, 5, 0, 5, 0]])
def test_a_batch_split_to_even_the_ranks_never_leaves_a_rank_a_batch_of_no_tokens(lengths):
    """A half of empty samples alone would be refused by the packed collate on that rank only, and the
    other ranks would wait for it in DDP."""
    batches = [list(TokenBudgetBatches(lengths, max_tokens=10, rank=rank, world_size=2)) for rank in (0, 1)]
    assert len(batches[0]) == len(batches[1])
    assert sorted(int(i) for shard in batches for batch in shard for i in batch) == list(range(len(lengths)))
    for shard in batches:
        for batch in shard:
            assert sum(lengths[int(i)] for i in batch) > 0, batch


def test_a_split_that_could_only_leave_a_batch_of_no_tokens_is_refused_on_every_rank_alike():
    for rank in (0, 1):
        refused = r"epoch 0's 4 samples fill 1 batch .*\(a batch needs a sample with tokens\).* Use 1 rank,"
        with pytest.raises(ValueError, match=refused):
            list(TokenBudgetBatches([0, 0, 5, 0], max_tokens=10, rank=rank, world_size=2))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(lengths=[[1, 2]], max_tokens=4), "one integer a sample"),
        (dict(lengths=[1.5], max_tokens=4), "one integer a sample"),
        (dict(lengths=[1, -1], max_tokens=4), "sample 1 has length -1"),
        (dict(lengths=[1], max_tokens=0), "at least 1"),
        (dict(lengths=[1], max_tokens=4, rank=0), "give both"),
        (dict(lengths=[1], max_tokens=4, rank=2, world_size=2), "rank: must be in"),
    ],
)
def test_bad_arguments_are_refused(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        TokenBudgetBatches(**options)


@pytest.mark.parametrize(
    ("rank", "world_size"),
    [(0, None), (None, 2), (2, 2), (-1, 2), (0, 0), (0.0, 2), (True, 2), (0, "2")],
)
def test_both_samplers_refuse_a_bad_split_in_the_same_words(rank, world_size):
    with pytest.raises((ValueError, TypeError)) as by_tokens:
        TokenBudgetBatches([1, 2, 3], max_tokens=4, rank=rank, world_size=world_size)
    with pytest.raises((ValueError, TypeError)) as by_index:
        IndexBatches(3, 2, rank=rank, world_size=world_size)
    assert type(by_tokens.value) is type(by_index.value)
    assert str(by_tokens.value) == str(by_index.value)
    assert str(by_tokens.value).startswith(("rank", "world_size"))


class Sequences(Dataset):
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, index):
        ids = torch.full((int(self.lengths[index]),), index % 50, dtype=torch.int64)
        return {"id": index, "input_ids": ids, "labels": ids}


def packed(max_tokens=None):
    tokens = dict(dtype=torch.int64, shape=("T",), pack=True)
    return Contract(
        {"id": Field(kind="number"), "input_ids": Field(**tokens), "labels": Field(**tokens, separator=-100)},
        packing=Packing(max_tokens=max_tokens),
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_packed_batches_from_the_sampler_pass_the_audit(workers):
    lengths = lengths_of(64, seed=1)
    sampler = TokenBudgetBatches(lengths, 8192, shuffle=True)
    loader = DataLoader(
        Sequences(lengths),
        batch_sampler=sampler,
        num_workers=workers,
        collate_fn=assemble.using(packed(max_tokens=8192)),
    )
    ledger = audit.Ledger()
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for batch in ledger.watch(loader):
            assert batch["input_ids"].shape[1] == batch["cu_seq_lens_q"][-1] <= 8192
        assert audit.check(ledger.last, 64).ok
    assert ledger.epochs[0].ids.tolist() != ledger.epochs[1].ids.tolist()


def test_the_ranks_together_pass_check_distributed(monkeypatch):
    lengths = lengths_of(75, seed=2)
    epochs = []
    for rank in range(3):
        sampler = TokenBudgetBatches(lengths, 5000, shuffle=True, rank=rank, world_size=3)
        loader = DataLoader(Sequences(lengths), batch_sampler=sampler, collate_fn=assemble.using(packed()))
        epochs.append(audit.Ledger().run(loader))
    # What gloo's all_gather would hand every rank: the three epochs, tagged by rank.
    gathered = [{"ids": e.ids, "names": e.names} for e in epochs]
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(
        distributed, "gather_epochs", lambda epoch, group=None: (distributed._union(gathered), 3)
    )
    assert distributed.check_distributed(epochs[0], 75).ok
    # The check is not blind: a rank that repeats another's batch fails it.
    gathered[1]["ids"] = np.concatenate([gathered[1]["ids"], gathered[0]["ids"][:2]])
    assert not distributed.check_distributed(epochs[0], 75).ok


def test_a_batch_over_the_contract_s_max_tokens_is_refused_naming_the_sample_that_passes_it():
    samples = [Sequences([40, 30, 50])[i] for i in range(3)]
    with pytest.raises(ContractSizeError) as raised:
        assemble.using(packed(max_tokens=100))(samples)
    assert raised.value.sample_id == 2 and "at most 100 tokens (Packing.max_tokens)" in str(raised.value)
    assert "120 tokens up to this sample" in str(raised.value)
    assert assemble.using(packed(max_tokens=120))(samples)["input_ids"].shape == (1, 120)
