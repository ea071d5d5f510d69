"""The resume attacked as a hostile or unlucky user would: states taken mid-prefetch or after the epoch's
StopIteration, hand-edited or foreign states, chained resumes on changing world sizes, a worker killed in
the resumed epoch, huge datasets, and ``doctor --resume`` on factories that do not play along."""

from __future__ import annotations

import collections
import io
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from fastcollate import IndexBatches, TokenBudgetBatches, sampler_state
from tests.helpers.resume import Indices, doctor, factory, through_disk

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")

ROOT = Path(__file__).resolve().parent.parent


def ids(loader_or_iterator):
    return [i for batch in loader_or_iterator for i in batch.tolist()]


def exactly_once(delivered, n):
    counts = collections.Counter(delivered)
    return sorted(set(range(n)) - set(counts)), sorted(i for i, c in counts.items() if c > 1)


# -- StatefulDataLoader with workers --------------------------------------------------------------


@pytest.mark.parametrize("prefetch_factor", [2, 4])
@pytest.mark.parametrize("persistent_workers", [False, True])
@pytest.mark.parametrize("workers_after", [2, 0])
def test_a_state_taken_mid_prefetch_resumes_exactly_once_with_prefetched_batches_accounted_for(
    prefetch_factor, persistent_workers, workers_after
):
    n = 37
    options = dict(prefetch_factor=prefetch_factor, persistent_workers=persistent_workers)
    sampler = IndexBatches(n, 4, shuffle=True, seed=1)
    loader = StatefulDataLoader(Indices(n), batch_sampler=sampler, num_workers=2, **options)
    list(loader)  # a whole epoch first: persistent workers carry over into the next
    sampler.set_epoch(1)
    iterator = iter(loader)
    consumed = [i for _ in range(3) for i in next(iterator).tolist()]
    state = through_disk(loader.state_dict())
    del iterator, loader

    resumed = IndexBatches(n, 4, shuffle=True, seed=1)
    options = options if workers_after else {}
    loader = StatefulDataLoader(Indices(n), batch_sampler=resumed, num_workers=workers_after, **options)
    if workers_after == 2:
        loader.load_state_dict(state)
    else:
        resumed.load_state_dict(sampler_state(state))
    assert exactly_once(consumed + ids(loader), n) == ([], [])


@pytest.mark.parametrize("persistent_workers", [False, True])
@pytest.mark.parametrize(
    "make",
    [
        lambda: IndexBatches(30, 4, shuffle=True, seed=1),
        lambda: IndexBatches(30, 4, shuffle=True, seed=1, drop_last=True),
        lambda: TokenBudgetBatches([3] * 30, 9, shuffle=True, seed=1),
    ],
    ids=["index-batches", "index-batches-drop-last", "token-budget"],
)
def test_a_state_taken_after_stop_iteration_with_workers_resumes_as_the_uninterrupted_run_goes_on(
    persistent_workers, make
):
    # A finished StatefulDataLoader primes the prefetch of a restoring iterator, then throws it away and
    # starts a fresh one: the ended state must leave no position for either to claim, at any workers.
    n = 30
    sampler = make()
    options = dict(num_workers=2, persistent_workers=persistent_workers)
    loader = StatefulDataLoader(Indices(n), batch_sampler=sampler, **options)
    iterator = iter(loader)
    epoch = [i for batch in iterator for i in batch.tolist()]  # through StopIteration
    state = through_disk(loader.state_dict())
    del iterator, loader

    resumed = make()
    loader = StatefulDataLoader(Indices(n), batch_sampler=resumed, **options)
    loader.load_state_dict(state)
    assert ids(loader) == epoch, "without set_epoch, the next iteration is epoch 0's order again"
    resumed.set_epoch(1)
    ordinary = make()
    ordinary.set_epoch(1)
    assert ids(loader) == [int(i) for batch in ordinary for i in batch]


def test_a_worker_killed_in_the_resumed_epoch_fails_clearly_and_the_state_resumes_again_exactly_once():
    n = 60
    sampler = IndexBatches(n, 4, shuffle=True, seed=1)
    loader = StatefulDataLoader(Indices(n, delay=0.002), batch_sampler=sampler, num_workers=2)
    iterator = iter(loader)
    consumed = [i for _ in range(3) for i in next(iterator).tolist()]
    state = through_disk(loader.state_dict())
    del iterator, loader

    for how in ("own", "sampler's part"):
        resumed = IndexBatches(n, 4, shuffle=True, seed=1)
        loader = StatefulDataLoader(Indices(n, delay=0.002), batch_sampler=resumed, num_workers=2)
        if how == "own":
            loader.load_state_dict(state)
        else:
            resumed.load_state_dict(sampler_state(state))
        iterator = iter(loader)
        next(iterator)
        with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\) is killed by signal"):
            os.kill(iterator._workers[0].pid, signal.SIGKILL)
            time.sleep(0.5)
            for _ in iterator:
                pass
        del iterator, loader

        again = IndexBatches(n, 4, shuffle=True, seed=1)
        loader = StatefulDataLoader(Indices(n), batch_sampler=again, num_workers=2)
        loader.load_state_dict(state)
        assert exactly_once(consumed + ids(loader), n) == ([], []), how


# -- states from elsewhere ------------------------------------------------------------------------


def generator(seed=7):
    made = torch.Generator()
    made.manual_seed(seed)
    return made


@pytest.mark.parametrize(
    "edit, with_generator",
    [
        ({"generator_state": b"junk"}, True),  # torch: RuntimeError "Expected a CPUGeneratorImplState"
        ({"generator_state": None}, True),  # TypeError "cannot convert 'NoneType' object to bytearray"
        ({"generator_state": b"junk"}, False),  # accepted, and handed on in every later state
    ],
    ids=["junk-into-generator", "none-into-generator", "bytes-into-seeded"],
)
def test_a_hand_edited_generator_state_is_a_value_error_naming_it(edit, with_generator):
    # Breaks: the generator's state is checked for type only, not against the sampler's generator.
    make = lambda: IndexBatches(  # noqa: E731
        20, 3, shuffle=True, generator=generator() if with_generator else None
    )
    state = make().state_dict() | edit
    with pytest.raises(ValueError, match="generator_state"):
        make().load_state_dict(state)


@pytest.mark.parametrize(
    "make",
    [lambda: IndexBatches(20, 4), lambda: TokenBudgetBatches([3] * 20, 9)],
    ids=["index-batches", "token-budget"],
)
def test_a_hand_edited_batches_done_that_its_segment_cannot_have_is_refused(make):
    # Breaks: batches_done is only checked against segment_batches, so a state whose segment starts the
    # epoch (no resume before it) loads with any count, and len() reports batches the epoch never had.
    sampler = make()
    iterator = iter(sampler)
    next(iterator)
    state = sampler.state_dict() | {"batches_done": 50}
    assert state["segment_start"] == 0
    resumed = make()
    with pytest.raises(ValueError, match="batches_done"):
        resumed.load_state_dict(state)


def test_a_foreign_sampler_s_state_is_refused_saying_what_it_is_not():
    # Breaks: a state without a "sampler" key (torchdata's samplers', a hand-made dict) is named "None's".
    foreign = {"samples_yielded": 4, "sampler_iter_state": {"yielded": 4}}
    with pytest.raises(ValueError) as refused:
        IndexBatches(20, 4, shuffle=True).load_state_dict(foreign)
    message = str(refused.value)
    assert "None's" not in message, message
    assert "sampler" in message and "samples_yielded" in message, "the keys it got are named"


# -- elastic, chained ------------------------------------------------------------------------------


def ranks(make, world):
    return [make(rank, world) for rank in range(world)]


def lockstep(samplers, k):
    iterators = [iter(s) for s in samplers]
    taken = []
    for _ in range(k):
        for iterator in iterators:
            batch = next(iterator, None)
            if batch is not None:
                taken.extend(int(i) for i in batch)
    return taken


@pytest.mark.parametrize("worlds", [(2, 3, 1), (4, 1, 3), (3, 2, 2), (1, 4, 4)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_index_batches_resumed_twice_on_changing_world_sizes_deliver_the_epoch_exactly_once(worlds, shuffle):
    n, batch_size = 61, 3

    def make(rank, world):
        return IndexBatches(n, batch_size, shuffle=shuffle, seed=4, rank=rank, world_size=world)

    first, second, third = (ranks(make, w) for w in worlds)
    for sampler in first:
        sampler.set_epoch(2)
    consumed = lockstep(first, 2)
    for sampler in second:
        sampler.load_state_dict(through_disk(first[-1].state_dict()))
    consumed += lockstep(second, 3)
    state = through_disk(second[0].state_dict())
    for sampler in third:
        sampler.load_state_dict(state)
    lengths = [len(s) for s in third]
    runs = [[[int(i) for i in batch] for batch in sampler] for sampler in third]
    assert len({len(run) for run in runs}) == 1, "every rank runs as many steps"
    assert lengths == [state["batches_done"] + len(runs[0])] * len(third), "len() ends with the epoch"
    delivered = consumed + [i for run in runs for batch in run for i in batch]
    missing, _ = exactly_once(delivered, n)
    assert missing == []
    assert len(delivered) - n <= sum(w - 1 for w in worlds), "padding only, as the stated rule allows"


@pytest.mark.parametrize("worlds", [(2, 3, 1), (3, 1, 2), (1, 2, 3)])
def test_token_budget_batches_with_empty_samples_resumed_twice_repeat_and_lose_nothing(worlds):
    lengths = [0 if i % 3 == 0 else (i * 7) % 11 + 1 for i in range(50)]

    def make(rank, world):
        return TokenBudgetBatches(lengths, 24, shuffle=True, seed=2, rank=rank, world_size=world)

    first, second, third = (ranks(make, w) for w in worlds)
    consumed = lockstep(first, 1)
    for sampler in second:
        sampler.load_state_dict(through_disk(first[0].state_dict()))
    consumed += lockstep(second, 1)
    state = through_disk(second[-1].state_dict())
    for sampler in third:
        sampler.load_state_dict(state)
    runs = [list(sampler) for sampler in third]
    assert len({len(run) for run in runs}) == 1
    assert all(sum(lengths[i] for i in batch) > 0 for run in runs for batch in run), "no batch of no tokens"
    assert exactly_once(consumed + [i for run in runs for batch in run for i in batch], 50) == ([], [])


def test_a_generator_driven_resume_resumed_again_is_the_uninterrupted_run_then_and_after():
    n, batch_size = 23, 4
    uninterrupted = IndexBatches(n, batch_size, shuffle=True, generator=generator())
    epochs = [[b.tolist() for b in uninterrupted] for _ in range(3)]
    first = IndexBatches(n, batch_size, shuffle=True, generator=generator())
    iterator = iter(first)
    got = [next(iterator).tolist() for _ in range(2)]
    second = IndexBatches(n, batch_size, shuffle=True, generator=generator())
    second.load_state_dict(through_disk(first.state_dict()))
    iterator = iter(second)
    got += [next(iterator).tolist() for _ in range(2)]
    third = IndexBatches(n, batch_size, shuffle=True, generator=generator())
    third.load_state_dict(through_disk(second.state_dict()))
    got += [b.tolist() for b in third]
    assert got == epochs[0]
    assert [[b.tolist() for b in third] for _ in range(2)] == epochs[1:]


# -- size ------------------------------------------------------------------------------------------


def test_a_state_of_a_huge_dataset_is_as_small_and_loads_without_memory_that_grows_with_n():
    states = []
    for n in (10**3, 10**12):
        sampler = IndexBatches(n, 256, rank=1, world_size=4)
        state = sampler.state_dict()
        if n > 10**3:  # far into the epoch
            state |= {"segment_batches": 10**6, "batches_done": 10**6, "samples_done": 4 * 256 * 10**6}
        resumed = IndexBatches(n, 256, rank=0, world_size=3)
        tracemalloc.start()
        resumed.load_state_dict(through_disk(state))
        length = len(resumed)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        states.append(state)
        assert peak < 64 * 1024, f"loading a state of n={n} took {peak} bytes"
    per_rank = -(-(10**12 - 4 * 256 * 10**6) // 3)
    assert length == 10**6 + -(-per_rank // 256), "the batches before and the rest of the epoch on 3 ranks"
    sizes = [len(through_disk_bytes(state)) for state in states]
    assert max(sizes) < 64 * 1024 and max(sizes) - min(sizes) < 64


def through_disk_bytes(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "make",
    [
        lambda: IndexBatches(np.int64(20), np.int32(3), shuffle=True, seed=np.int64(4)),
        lambda: IndexBatches(20, 3, shuffle=True, generator=generator()),
        lambda: TokenBudgetBatches(torch.arange(1, 21), np.int64(30), seed=np.int64(1)),
        lambda: IndexBatches(0, 3),
    ],
    ids=["numpy-arguments", "generator", "token-budget-numpy", "empty"],
)
@pytest.mark.parametrize("k", [0, 1, 100])
def test_every_state_shape_loads_with_weights_only(make, k):
    sampler = make()
    sampler.set_epoch(np.int64(2))
    lockstep([sampler], k)
    resumed = make()
    resumed.load_state_dict(through_disk(sampler.state_dict()))
    assert resumed.state_dict() == sampler.state_dict()


# -- doctor --resume on factories that do not play along -------------------------------------------


def test_doctor_resume_on_an_iterable_dataset_says_why_in_the_dataset_s_terms(tmp_path, capsys):
    # Breaks: it blames "its batch sampler (BatchSampler)", which the user never gave: an
    # IterableDataset has no sampler; it is its own state (state_dict/load_state_dict) that is missing.
    spec = factory(
        tmp_path,
        "attack_stream",
        """
        import torch
        from torch.utils.data import IterableDataset
        class Stream(IterableDataset):
            def __iter__(self):
                for i in range(40):
                    yield {"id": i, "x": torch.tensor([float(i)])}
        def make():
            return Stream()
        """,
    )
    status, text = doctor(["--resume", "--workers", "1", "--resume-workers", "0", "--dataset", spec], capsys)
    assert status == 2, text
    assert "BatchSampler" not in text, text
    assert "workers 1 -> 0 (the sampler's part of it): NOT VERIFIED: an IterableDataset" in text, text
    # Not asked for, the other worker count is left out, and the note says why in the same terms.
    status, text = doctor(["--resume", "--workers", "1", "--dataset", spec], capsys)
    assert status == 0, text
    assert "BatchSampler" not in text, text
    assert "note: an IterableDataset resumes on the same num_workers only" in text, text


def test_doctor_resume_on_a_factory_that_raises_on_its_second_call_is_not_verified_and_says_so(
    tmp_path, capsys
):
    # Breaks: exit 1 ("the loader resumes wrong") and "the uninterrupted epoch: FAILED: the loader raised
    # UsageError", where the loader did nothing wrong: doctor --resume calls the factory for every loader.
    spec = factory(
        tmp_path,
        "attack_once_only",
        """
        import torch, fastcollate
        from fastcollate import IndexBatches
        calls = 0
        def make():
            global calls
            calls += 1
            if calls > 1:
                raise RuntimeError("the shard server allows one connection")
            data = fastcollate.with_ids([{"x": torch.tensor([float(i)])} for i in range(40)])
            return {"dataset": data, "batch_sampler": IndexBatches(40, 4, shuffle=True, seed=1)}
        """,
    )
    status, text = doctor(["--resume", "--workers", "1", "--dataset", spec], capsys)
    assert status == 2, text
    assert "the shard server allows one connection" in text
    assert "calls the factory" in text or "called again" in text, text


def test_doctor_resume_with_token_budget_batches_on_another_world_size_allows_no_repeats(tmp_path, capsys):
    # Breaks: the allowance for IndexBatches' padding, (W - 1) + (W' - 1), is granted to every sampler,
    # so TokenBudgetBatches (which repeats nothing) passes with 3 samples repeated on 2 -> 3 ranks.
    spec = factory(
        tmp_path,
        "attack_token_repeats",
        """
        import torch, fastcollate
        from fastcollate import TokenBudgetBatches
        LENGTHS = [(i * 7) % 11 + 1 for i in range(60)]
        class RepeatsOnResume(TokenBudgetBatches):
            def for_rank(self, rank, world_size):
                return RepeatsOnResume(self.lengths, self.max_tokens, shuffle=True, seed=self.seed,
                                       rank=rank, world_size=world_size)
            def load_state_dict(self, state):
                super().load_state_dict(state)
                self.resumed = True
            def __iter__(self):
                first, self.resumed = getattr(self, "resumed", False), False
                for batch in super().__iter__():
                    yield batch + batch[:1] if first else batch
                    first = False
        def make():
            data = fastcollate.with_ids([{"x": torch.tensor([float(i)])} for i in range(60)])
            return {"dataset": data, "batch_sampler": RepeatsOnResume(LENGTHS, 20, shuffle=True, seed=1)}
        """,
    )
    status, text = doctor(["--resume-world-size", "2,3", "--workers", "1", "--dataset", spec], capsys)
    assert status == 1, text
    assert "duplicated (3)" in text, text


def test_doctor_resume_with_a_timeout_reports_a_stuck_loader_within_it(tmp_path):
    # Breaks: --timeout is not handed to the resume check: a loader stuck on one sample hangs doctor
    # --resume for ever, where the checklist reports it within the timeout.
    spec = factory(
        tmp_path,
        "attack_hangs",
        """
        import time, torch
        from torch.utils.data import Dataset
        from fastcollate import IndexBatches
        class Hangs(Dataset):
            def __len__(self):
                return 40
            def __getitem__(self, i):
                if int(i) == 37:
                    time.sleep(3600)
                return {"id": int(i), "x": torch.tensor([float(i)])}
        def make():
            return {"dataset": Hangs(), "batch_sampler": IndexBatches(40, 4)}
        """,
    )
    command = [sys.executable, "-m", "fastcollate", "doctor", "--resume", "--timeout", "2"]
    command += ["--workers", "1", "--dataset", spec]
    environment = os.environ | {"PYTHONPATH": str(ROOT)}
    # A session of its own, so that the command and its stuck worker can be ended together.
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=45)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail("doctor --resume --timeout 2 was still waiting on a stuck sample after 45 s")
    assert process.returncode in (1, 2), output
    assert "--timeout 2" in output, output
