"""IndexBatches and TokenBudgetBatches across a checkpoint: W ranks each take k batches, any rank's state
loads into W' fresh ranks, and the epoch is delivered exactly once (by the stated padding rule), every
rank running as many steps; the next epoch is the uninterrupted run's."""

from __future__ import annotations

import collections
import io
import itertools
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastcollate import IndexBatches, TokenBudgetBatches


def index_ranks(n, batch_size, world, **options):
    if world == 0:  # no split at all: the plain sampler
        return [IndexBatches(n, batch_size, **options)]
    return [IndexBatches(n, batch_size, rank=r, world_size=world, **options) for r in range(world)]


def token_ranks(lengths, max_tokens, world, **options):
    if world == 0:
        return [TokenBudgetBatches(lengths, max_tokens, **options)]
    return [
        TokenBudgetBatches(lengths, max_tokens, rank=r, world_size=world, **options) for r in range(world)
    ]


def at_epoch(sampler, epoch):
    sampler.set_epoch(epoch)
    return sampler


def take(samplers, k):
    """Each rank takes k batches (or all it has, without asking past its last one: the iteration stays
    open, as a training loop checkpointing after a step leaves it), in lockstep; returns every index
    handed out."""
    taken = []
    iterators = [itertools.islice(iter(s), min(k, len(s))) for s in samplers]
    for _ in range(k):
        for it in iterators:
            batch = next(it, None)
            if batch is not None:
                taken.extend(int(i) for i in batch)
    return taken


def rest(samplers):
    """Each rank's remaining batches of the iteration, as lists."""
    return [[[int(i) for i in b] for b in s] for s in samplers]


def resume(make, world, k, world_after, epoch=0):
    """W ranks take k batches of ``epoch``; rank 0's state loads into W' fresh ranks, which run out
    the epoch. Returns (consumed indices, each new rank's batches, the states of every old rank)."""
    before = make(world)
    for s in before:
        s.set_epoch(epoch)
    consumed = take(before, k)
    states = [s.state_dict() for s in before]
    after = make(world_after)
    for s in after:
        s.load_state_dict(states[-1])  # any rank's: the last one here
    return consumed, rest(after), states


def assert_next_epoch_is_the_ordinary_one(make, state):
    """The epoch after a resumed one is the uninterrupted run's, or refused alike where the ordinary
    epoch is (TokenBudgetBatches: fewer samples than ranks)."""
    resumed, fresh = make(), make()
    for sampler in resumed:
        sampler.load_state_dict(state)
        list(sampler)
        sampler.set_epoch(state["epoch"] + 1)
    for sampler in fresh:
        sampler.set_epoch(state["epoch"] + 1)
    try:
        ordinary = rest(fresh)
    except ValueError as refusal:
        with pytest.raises(ValueError, match=re.escape(str(refusal))):
            rest(resumed)
        return
    assert rest(resumed) == ordinary, "the next epoch is the uninterrupted run's"


def delivered_counts(consumed, batches_by_rank):
    counts = collections.Counter(consumed)
    for batches in batches_by_rank:
        for batch in batches:
            counts.update(batch)
    return counts


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(0, 60),
    batch_size=st.integers(1, 7),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    sampler_drop_last=st.booleans(),
    world=st.sampled_from([0, 1, 2, 3, 4]),
    world_after=st.sampled_from([0, 1, 2, 3, 4]),
    k=st.integers(0, 12),
    epoch=st.integers(0, 3),
)
def test_index_batches_resume_on_any_world_size_delivers_the_epoch_exactly_once(
    n, batch_size, shuffle, drop_last, sampler_drop_last, world, world_after, k, epoch
):
    split_drop = sampler_drop_last and world > 0 and world_after > 0
    options = dict(shuffle=shuffle, seed=5, drop_last=drop_last, sampler_drop_last=split_drop)
    consumed, after, states = resume(
        lambda w: index_ranks(n, batch_size, w, **options), world, k, world_after, epoch
    )
    assert all(state == states[0] for state in states), "every rank's state is the same state"
    assert len({len(batches) for batches in after}) == 1, "every new rank runs as many steps"
    counts = delivered_counts(consumed, after)
    w, w2 = max(world, 1), max(world_after, 1)
    assert set(counts) <= set(range(n))
    repeats = sum(c - 1 for c in counts.values())
    missing = n - len(counts)
    allowance = index_ranks(n, batch_size, w, **options)[0].resume_allowance(w, w2)
    assert missing <= allowance.drops, "every sample at least once, but for the stated drops"
    assert repeats <= allowance.repeats
    if not split_drop and n % w == 0 and (n - len(set(consumed))) % w2 == 0:
        assert repeats == 0
    assert_next_epoch_is_the_ordinary_one(
        lambda: index_ranks(n, batch_size, world_after, **options), states[0]
    )


def most_repeated_and_dropped(batch_size, world, world_after, options):
    """The most any resume repeats and drops over every dataset of 1 to 24 samples and a checkpoint after
    every batch of the epoch (the last included: the epoch done)."""
    most_repeated = most_dropped = 0
    for n in range(1, 25):

        def make(w, n=n):
            return index_ranks(n, batch_size, w, **options)

        for k in range(1, len(make(world)[0]) + 1):
            consumed, after, _ = resume(make, world, k, world_after)
            counts = delivered_counts(consumed, after)
            most_repeated = max(most_repeated, sum(c - 1 for c in counts.values()))
            most_dropped = max(most_dropped, n - len(counts))
    return most_repeated, most_dropped


@pytest.mark.parametrize("world, world_after", list(itertools.product((1, 2, 3), repeat=2)))
@pytest.mark.parametrize("drop_last, sampler_drop_last", list(itertools.product((False, True), repeat=2)))
def test_index_batches_resume_allowance_is_reached_and_never_passed(
    world, world_after, drop_last, sampler_drop_last
):
    options = dict(shuffle=True, seed=3, drop_last=drop_last, sampler_drop_last=sampler_drop_last)
    for batch_size in (1, 2, 3):
        allowance = IndexBatches(1, batch_size, **options, rank=0, world_size=world).resume_allowance(
            world, world_after
        )
        found = most_repeated_and_dropped(batch_size, world, world_after, options)
        assert found == allowance, f"batch_size={batch_size}"


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 50),
    batch_size=st.integers(1, 6),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    sampler_drop_last=st.booleans(),
    world=st.sampled_from([0, 1, 2, 3, 4]),
    k=st.integers(0, 10),
)
def test_index_batches_resumed_on_the_same_world_size_are_the_uninterrupted_run_s(
    n, batch_size, shuffle, drop_last, sampler_drop_last, world, k
):
    options = dict(
        shuffle=shuffle, seed=1, drop_last=drop_last, sampler_drop_last=sampler_drop_last and world > 0
    )
    uninterrupted = [
        [[int(i) for i in b] for b in s][k:] for s in index_ranks(n, batch_size, world, **options)
    ]
    _, after, _ = resume(lambda w: index_ranks(n, batch_size, w, **options), world, k, world)
    assert after == uninterrupted


@pytest.mark.parametrize("world, world_after", [(0, 0), (2, 3), (4, 1), (3, 3)])
def test_the_next_epoch_after_a_resume_is_the_ordinary_one(world, world_after):
    make = lambda w: index_ranks(103, 4, w, shuffle=True, seed=9)  # noqa: E731
    _, _, states = resume(make, world, 5, world_after, epoch=2)
    after, fresh = make(world_after), make(world_after)
    for s in after:
        s.load_state_dict(states[0])
        list(s)
        s.set_epoch(3)
    for s in fresh:
        s.set_epoch(3)
    assert rest(after) == rest(fresh)


def test_len_counts_the_batches_before_the_checkpoint_and_those_left():
    before = index_ranks(100, 4, 2, shuffle=True)
    take(before, 3)
    after = index_ranks(100, 4, 4, shuffle=True)
    after[1].load_state_dict(before[0].state_dict())
    left = len(list(iter(after[1])))
    assert left == 100 // 4 // 4 - 1  # 76 samples left, 19 a rank, 5 batches of 4
    fresh = index_ranks(100, 4, 4, shuffle=True)[1]
    fresh.load_state_dict(before[0].state_dict())
    assert len(fresh) == 3 + left
    list(fresh)
    assert len(fresh) == 3 + left, "once through, until the next iteration (a loader may read ahead)"
    fresh.set_epoch(0)
    assert len(fresh) == 3 + left, "the same epoch: still the one run"
    assert len(list(fresh)) == len(fresh) == 100 // 4 // 4 + 1, "the next iteration is the ordinary epoch"
    fresh.load_state_dict(fresh.state_dict())  # its iteration had ended: the next one is the ordinary epoch
    assert len(fresh) == 100 // 4 // 4 + 1


def test_a_state_is_small_plain_and_survives_torch_save_with_weights_only():
    sampler = IndexBatches(10_000_000, 256, shuffle=True, seed=3)
    take([sampler], 2)
    state = sampler.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    assert buffer.tell() < 64 * 1024
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded == state
    assert loaded["samples_done"] == 512 and loaded["epoch"] == 0


def test_a_returned_state_never_changes_and_counts_the_batches_handed_out():
    sampler = IndexBatches(50, 5)
    iterator = iter(sampler)
    next(iterator)
    first = sampler.state_dict()
    snapshot = repr(first)
    next(iterator)
    second = sampler.state_dict()
    assert repr(first) == snapshot
    assert (first["batches_done"], second["batches_done"]) == (1, 2)
    assert (first["samples_done"], second["samples_done"]) == (5, 10)


def test_a_state_loaded_twice_serves_one_iteration_each_time():
    before = IndexBatches(40, 4, shuffle=True)
    take([before], 3)
    state = before.state_dict()
    after = IndexBatches(40, 4, shuffle=True)
    after.load_state_dict(state)
    first = rest([after])
    after.load_state_dict(state)
    assert rest([after]) == first
    assert len(rest([after])[0]) == 10, "the third iteration is the whole epoch again"


def test_a_state_after_the_epoch_s_last_batch_resumes_to_nothing_then_the_next_epoch():
    before = IndexBatches(30, 4, shuffle=True, rank=0, world_size=2)
    take([before], len(before))
    state = before.state_dict()
    assert state["epoch_done"] and state["samples_done"] == 30 and not state["iteration_ended"]
    after = IndexBatches(30, 4, shuffle=True, rank=1, world_size=3)
    after.load_state_dict(state)
    assert list(after) == []
    after.set_epoch(1)
    assert rest([after]) == rest([at_epoch(IndexBatches(30, 4, shuffle=True, rank=1, world_size=3), 1)])


def test_a_state_after_the_iteration_ended_resumes_to_what_the_uninterrupted_run_starts_next():
    before = IndexBatches(30, 4, shuffle=True)
    list(before)  # through StopIteration
    state = before.state_dict()
    assert state["iteration_ended"]
    after = IndexBatches(30, 4, shuffle=True)
    after.load_state_dict(state)
    assert rest([after]) == rest([before]), "without set_epoch, the epoch's order again, as uninterrupted"
    after.load_state_dict(state)
    after.set_epoch(1)
    assert rest([after]) == rest([at_epoch(IndexBatches(30, 4, shuffle=True), 1)])


def test_set_epoch_to_another_epoch_after_loading_starts_that_epoch_from_its_beginning():
    before = IndexBatches(40, 4, shuffle=True)
    take([before], 3)
    after = IndexBatches(40, 4, shuffle=True)
    after.load_state_dict(before.state_dict())
    after.set_epoch(0)  # the saved epoch: the position holds
    assert len(rest([after])[0]) == 7
    after.load_state_dict(before.state_dict())
    after.set_epoch(1)
    assert rest([after]) == rest([at_epoch(IndexBatches(40, 4, shuffle=True), 1)])


def test_a_resume_with_a_generator_continues_its_draws_as_the_uninterrupted_run_does():
    def make():
        generator = torch.Generator()
        generator.manual_seed(11)
        return IndexBatches(23, 4, shuffle=True, generator=generator)

    uninterrupted = make()
    whole = [rest([uninterrupted]) for _ in range(3)]
    before = make()
    rest([before])  # epoch one, whole
    take([before], 2)  # two batches of epoch two
    after = make()
    after.load_state_dict(before.state_dict())
    assert rest([after])[0] == whole[1][0][2:]
    assert rest([after]) == whole[2]


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(n=41), "n=40 in the state, 41 here"),
        (dict(seed=1), "seed=0 in the state, 1 here"),
        (dict(batch_size=5), "batch_size=4 in the state, 5 here"),
        (dict(shuffle=False), "shuffle=True in the state, False here"),
        (dict(drop_last=True), "drop_last=False in the state, True here"),
    ],
)
def test_a_state_from_another_run_is_refused_naming_what_differs(change, named):
    state = IndexBatches(40, 4, shuffle=True).state_dict()
    options = dict(n=40, batch_size=4, shuffle=True) | change
    with pytest.raises(ValueError, match=named):
        IndexBatches(options.pop("n"), options.pop("batch_size"), **options).load_state_dict(state)


@pytest.mark.parametrize(
    "state, message",
    [
        ({"sampler": "TokenBudgetBatches"}, "is 'TokenBudgetBatches''s"),
        ({"_snapshot": {}}, "fastcollate.sampler_state"),
        ({"samples_done": -1}, "samples_done must be an integer"),
        ({"segment_batches": 99}, "took 99 batches of a segment that has 10"),
        ({"samples_done": 7}, "disagree with its segment"),
    ],
)
def test_a_malformed_state_is_refused_naming_the_key(state, message):
    good = IndexBatches(40, 4).state_dict()
    with pytest.raises(ValueError, match=message):
        IndexBatches(40, 4).load_state_dict(good | state)


def lengths(n, seed):
    return np.random.default_rng(seed).integers(0, 40, size=n)


def cut_exists(sizes, max_tokens, world):
    """Whether ``sizes``, in their order, can be cut into batches within ``max_tokens``, each with a sample
    that has tokens (one batch when none has), whose count divides among ``world`` ranks: every count
    reachable, by dynamic programming over where the last batch starts."""
    world = max(world, 1)
    if len(sizes) == 0 or not any(sizes):
        return len(sizes) == 0 or world == 1
    ends = np.concatenate([[0], np.cumsum(sizes)])
    counts = [set() for _ in range(len(sizes) + 1)]
    counts[0].add(0)
    for end in range(1, len(sizes) + 1):
        for start in range(end):
            if counts[start] and ends[end] - ends[start] <= max_tokens and any(sizes[start:end]):
                counts[end] |= {count + 1 for count in counts[start]}
    return any(count % world == 0 for count in counts[-1])


def assert_refused_as_no_cut_allows(error, sizes, max_tokens, world, works_on=None):
    """A refusal is right only where no cut of ``sizes`` exists for ``world`` ranks, and every world size
    it names instead has one (and, given ``works_on``, is accepted by it)."""
    message = str(error)
    assert not cut_exists(sizes, max_tokens, world), message
    named = re.search(r"(?:on|Use) ((?:\d+, )*\d+)(?: or (\d+))? ranks?\b", message)
    assert named, message
    others = [int(w) for w in named.group(1).split(", ")] + ([int(named.group(2))] if named.group(2) else [])
    for other in others:
        assert other != world and cut_exists(sizes, max_tokens, other), message
        if works_on is not None:
            works_on(other)


@settings(max_examples=120, deadline=None)
@given(
    n=st.integers(0, 60),
    max_tokens=st.integers(40, 200),
    shuffle=st.booleans(),
    world=st.sampled_from([0, 1, 2, 3, 4]),
    world_after=st.sampled_from([0, 1, 2, 3, 4]),
    k=st.integers(0, 8),
    seed=st.integers(0, 5),
)
def test_token_budget_batches_resume_on_any_world_size_repeats_and_loses_nothing(
    n, max_tokens, shuffle, world, world_after, k, seed
):
    check_token_budget_resume(lengths(n, seed), max_tokens, shuffle, world, world_after, k, seed)


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 10), max_size=14),
    shuffle=st.booleans(),
    world=st.integers(1, 5),
    world_after=st.integers(1, 5),
    k=st.integers(0, 4),
    seed=st.integers(0, 3),
)
def test_token_budget_batches_on_a_tight_budget_are_refused_exactly_where_no_cut_divides_among_the_ranks(
    sizes, shuffle, world, world_after, k, seed
):
    # max_tokens=10: a sample of over 5 tokens shares a batch with little, so few cuts exist.
    check_token_budget_resume(np.array(sizes, dtype=np.int64), 10, shuffle, world, world_after, k, seed)


def check_token_budget_resume(sizes, max_tokens, shuffle, world, world_after, k, seed):
    """W ranks take k batches; W' ranks resume: every sample once, each batch within the budget; or a
    refusal exactly where no cut allows it, naming world sizes that work."""
    n = len(sizes)

    def make(w):
        return token_ranks(sizes, max_tokens, w, shuffle=shuffle, seed=seed)

    # One rank cuts the order into batches and never splits them: together they are the epoch's order.
    order = np.array([int(i) for batch in at_epoch(make(1)[0], seed) for i in batch], dtype=np.int64)
    before = make(world)
    try:
        for sampler in before:
            sampler.set_epoch(seed)
        take(before, k)
        state = before[0].state_dict()
    except ValueError as error:  # the epoch itself cannot be shared by the ranks
        assert_refused_as_no_cut_allows(error, sizes[order], max_tokens, world)
        return
    try:
        for sampler in make(world_after):
            sampler.load_state_dict(state)
    except ValueError as error:  # the samples left cannot be shared by the new ranks
        assert_refused_as_no_cut_allows(
            error, sizes[order[state["samples_done"]:]], max_tokens, world_after,
            works_on=lambda other: make(other)[0].load_state_dict(state),
        )
        return
    consumed, after, states = resume(make, world, k, world_after, epoch=seed)
    assert all(state == states[0] for state in states)
    assert all(0 < sizes[batch].sum() <= max_tokens or not sizes.any() for ranks in after for batch in ranks)
    assert len({len(batches) for batches in after}) == 1
    counts = delivered_counts(consumed, after)
    assert sorted(counts) == list(range(n)) and set(counts.values()) <= {1}
    assert make(0)[0].resume_allowance(max(world, 1), max(world_after, 1)) == (0, 0), "as it states"
    assert_next_epoch_is_the_ordinary_one(lambda: make(world_after), states[0])
    if world == world_after:
        fresh = [at_epoch(s, seed) for s in make(world)]
        assert after == [b[k:] for b in rest(fresh)]


def test_token_budget_state_from_other_lengths_is_refused():
    state = TokenBudgetBatches(lengths(30, 0), 100).state_dict()
    with pytest.raises(ValueError, match="lengths_digest="):
        TokenBudgetBatches(lengths(30, 1), 100).load_state_dict(state)


def test_token_budget_resume_onto_more_ranks_than_samples_left_is_refused_with_the_count():
    sizes = np.full(10, 10)
    before = token_ranks(sizes, 20, 1)
    take(before, 4)  # 8 of 10 samples consumed
    refused = (r"the 2 samples left of epoch 0 \(8 were consumed\) fill 1 to 2 batches .* no count from 1 "
               r"to 2 divides among 4 ranks.* Resume on 1 or 2 ranks, or from another checkpoint")
    with pytest.raises(ValueError, match=refused):
        token_ranks(sizes, 20, 4)[0].load_state_dict(before[0].state_dict())


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["index", "tokens"]),
    n=st.integers(0, 50),
    batch_size=st.integers(1, 6),
    drop_last=st.booleans(),
    worlds=st.lists(st.integers(1, 5), min_size=2, max_size=3),
    stops=st.lists(st.floats(0, 1), min_size=2, max_size=2),
    epoch=st.integers(0, 2),
)
def test_a_lightning_like_loop_preempted_along_a_chain_of_world_sizes_runs_the_epoch_to_its_last_sample(
    kind, n, batch_size, drop_last, worlds, stops, epoch
):
    """The loop Lightning runs with ExactResume: at each start it restores its step count from the
    checkpoint (the state's batches_done) and counts the epoch as len() after the load, then steps every
    rank in lockstep until its count; it is preempted part-way along W -> W' (-> W''). The sampler must
    hand out exactly the counted batches, never fewer (the loop would wait, then close the epoch early)
    nor more (they would be left behind), and the chain must deliver the epoch: once for
    TokenBudgetBatches, within IndexBatches' padding and drop_last allowance summed over the segments."""
    sizes = lengths(n, epoch)

    def make(world):
        if kind == "index":
            return index_ranks(n, batch_size, world, shuffle=True, seed=1, drop_last=drop_last)
        return token_ranks(sizes, 40 + 10 * batch_size, world, shuffle=True, seed=1)

    delivered, state, ready = collections.Counter(), None, 0
    for segment, world in enumerate(worlds):
        ranks = make(world)
        try:
            for sampler in ranks:
                sampler.set_epoch(epoch)
                if state is not None:
                    sampler.load_state_dict(state)
            count = len(ranks[0])
        except ValueError:  # TokenBudgetBatches: no cut for these ranks (tested on its own above)
            return
        assert all(len(sampler) == count for sampler in ranks), "every rank counts the same steps"
        last = segment == len(worlds) - 1
        stop = count if last else ready + int(stops[segment] * (count - ready))
        iterators = [iter(sampler) for sampler in ranks]
        for _ in range(ready, stop):
            for iterator in iterators:
                batch = next(iterator, None)
                assert batch is not None, f"segment {segment}: counted {count} steps, the sampler ran out"
                delivered.update(int(i) for i in batch)
        ready = stop
        if last:
            assert all(next(iterator, None) is None for iterator in iterators), "batches past the count"
        else:
            state = ranks[0].state_dict()
            assert state["batches_done"] == ready, "the state's step count is the loop's"
    assert set(delivered) <= set(range(n))
    repeats, missing = sum(delivered.values()) - len(delivered), n - len(delivered)
    if kind == "tokens":
        assert (repeats, missing) == (0, 0)
    else:
        assert repeats <= sum(world - 1 for world in worlds)
        assert missing <= (sum(worlds) * (batch_size - 1) if drop_last else 0)
