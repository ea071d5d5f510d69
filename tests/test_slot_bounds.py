"""The shared slots' bound with several loaders on one collate (fastcollate.transfer.worker_slots): each
loader's workers get their own bound, so a train loader's prefetched batches do not crowd out an eval
loader's, and the pool's bound is still a bound: the sum over the loaders whose workers are alive."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
from torch.utils.data import DataLoader

from fastcollate import Assembler, assemble
from fastcollate._ext import _C
from fastcollate.transfer import worker_slots
from fastcollate.transfer.worker_slots import SlotPool
from tests.helpers.fault_datasets import Numbered

RECEIVED = _C.SLOT_KIND_RECEIVED


def fallbacks_so_far(collate: Assembler) -> int:
    stats = collate.shared_slot_stats()
    return 0 if stats is None else stats.fresh_fallbacks


def train_with_evaluations(collate: Assembler, context: str, epochs: int = 2) -> tuple[DataLoader, ...]:
    """A training loop's schedule: a few train steps, then a whole evaluation, and again; both loaders on
    one collate with persistent workers and the default prefetch. Each batch is dropped when the next
    one comes, as a loop variable is. Every sample is delivered once per epoch, over a slot."""
    common = dict(num_workers=2, persistent_workers=True, collate_fn=collate, multiprocessing_context=context,
                  timeout=60)
    train = DataLoader(Numbered(48), batch_size=4, shuffle=True, **common)
    evaluation = DataLoader(Numbered(20), batch_size=4, **common)
    for _ in range(epochs):
        trained = []
        for step, batch in enumerate(train):
            assert _C.shared_slot_kind(batch["x"]) == RECEIVED
            trained += batch["id"].tolist()
            if step % 4 == 1:
                evaluated = []
                for held in evaluation:
                    assert _C.shared_slot_kind(held["x"]) == RECEIVED
                    evaluated += held["id"].tolist()
                assert sorted(evaluated) == list(range(20))
        assert sorted(trained) == list(range(48))
    return train, evaluation


@pytest.mark.parametrize(
    ("context", "configured"),
    [("fork", False), ("fork", True), ("spawn", True)],
    ids=["fork-assemble", "fork-using", "spawn-using"],
)
def test_train_and_eval_loaders_taking_turns_on_one_collate_never_fall_back(context, configured):
    collate = assemble.using() if configured else assemble
    before = fallbacks_so_far(collate)
    with warnings.catch_warnings():
        # Forked workers inherit the filter, so a fallback there raises through the loader; spawned ones
        # start with Python's defaults, and the pool's counter says what they did.
        warnings.simplefilter("error")
        train, evaluation = train_with_evaluations(collate, context)
    stats = collate.shared_slot_stats()
    assert stats.fresh_fallbacks == before
    assert stats.loaders == 2 and stats.bound == 2 * (2 * 2 + 4)
    del train, evaluation


def test_a_loader_whose_workers_ended_leaves_the_bound():
    collate = assemble.using()
    common = dict(num_workers=2, collate_fn=collate, timeout=60)
    persistent = DataLoader(Numbered(16), batch_size=4, persistent_workers=True, **common)
    assert len(list(persistent)) == 4
    short_lived = DataLoader(Numbered(8), batch_size=4, **common)
    for _batch in short_lived:
        assert collate.shared_slot_stats().loaders == 2
    del _batch
    deadline = time.monotonic() + 20  # the workers of an ended epoch exit when the loader joins them
    while collate.shared_slot_stats().loaders != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = collate.shared_slot_stats()
    assert (stats.loaders, stats.bound) == (1, 2 * 2 + 4)
    del persistent
    gc.collect()


def test_max_shared_slots_bounds_each_loader_and_the_pool_sums_them():
    collate = assemble.using(max_shared_slots=3)
    common = dict(num_workers=1, persistent_workers=True, collate_fn=collate, timeout=60)
    first = DataLoader(Numbered(8), batch_size=4, **common)
    second = DataLoader(Numbered(8), batch_size=4, **common)
    assert len(list(first)) == len(list(second)) == 2
    stats = collate.shared_slot_stats()
    assert (stats.loaders, stats.bound, stats.fresh_fallbacks) == (2, 6, 0)
    del first, second


TWO_LOADERS_KEPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    import torch
    from torch.utils.data import DataLoader
    from fastcollate import assemble
    from fastcollate._ext import _C
    from tests.helpers.fault_datasets import Numbered
    collate = assemble.using(max_shared_slots=2)
    common = dict(batch_size=8, num_workers=1, persistent_workers=True, collate_fn=collate, timeout=60)
    first = DataLoader(Numbered(48, shape=(64,)), **common)
    second = DataLoader(Numbered(48, shape=(64,)), **common)
    kept = [batch for pair in zip(first, second) for batch in pair]
    assert all(torch.equal(b["x"], b["id"].float()[:, None].expand(8, 64)) for b in kept)
    in_slots = sum(_C.shared_slot_kind(b["x"]) == _C.SLOT_KIND_RECEIVED for b in kept)
    stats = collate.shared_slot_stats()
    print(len(kept), in_slots, stats.fresh_fallbacks, stats.bound)
""")


def test_two_loaders_whose_batches_are_all_kept_stop_at_the_sum_of_their_bounds_and_say_so():
    # In a subprocess, so that the workers' warnings reach stderr as they would for a user.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", TWO_LOADERS_KEPT.format(root=root)], capture_output=True, text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    kept, in_slots, fallbacks, bound = (int(v) for v in done.stdout.split())
    assert bound == 4 and kept == 12
    assert 2 <= in_slots <= 4 and fallbacks == kept - in_slots
    assert 1 <= done.stderr.count("fastcollate: all 4 shared slots are held (") <= 2, done.stderr
    assert "2 loaders" in done.stderr and "for each loader" in done.stderr


def test_loaders_whose_bounds_add_up_past_128_slots_each_keep_every_batch_within_their_own():
    collate = assemble.using(max_shared_slots=70)
    common = dict(batch_size=1, num_workers=1, persistent_workers=True, collate_fn=collate, timeout=60)
    first = DataLoader(Numbered(66), **common)
    second = DataLoader(Numbered(66), **common)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the forked workers inherit it: a fallback raises through the loader
        kept = list(first) + list(second)
    assert [int(b["id"]) for b in kept] == list(range(66)) * 2
    assert all(_C.shared_slot_kind(b["x"]) == RECEIVED for b in kept)
    stats = collate.shared_slot_stats()
    assert (stats.loaders, stats.bound, stats.lent, stats.fresh_fallbacks) == (2, 140, 132, 0)
    del kept, first, second


def test_max_shared_slots_past_a_pools_room_is_refused_when_the_collate_is_made():
    with pytest.raises(ValueError, match=r"max_shared_slots must be in \[1, 4096\].*got 5000"):
        assemble.using(max_shared_slots=5000)


REGISTRY_FULL = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {root!r})
    from fastcollate.transfer.worker_slots import REGISTRY_ENTRIES, SlotPool
    pool = SlotPool.create(128)

    def worker_of_its_own_loader(loader):
        # A process that claims one slot as the only worker of `loader` (bound 1) and keeps it.
        ready, said = os.pipe()
        pid = os.fork()
        if pid == 0:
            buffer, cause, detail = pool.native.claim(64, 1, loader, 1)
            os.write(said, b"slot" if buffer is not None else cause.encode())
            time.sleep(120)
            os._exit(0)
        answer = os.read(ready, 16).decode()
        return pid, answer

    workers = [worker_of_its_own_loader(1000 + i) for i in range(REGISTRY_ENTRIES + 1)]
    print(*(answer for _, answer in workers))
    stats = pool.native.stats()
    print(stats.loaders, stats.writing)
    for pid, _ in workers:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    pool.native.reclaim_dead_writers()
    stats = pool.native.stats()
    print(stats.loaders, stats.bound, stats.free)
""")


def test_a_worker_the_registry_has_no_room_for_still_gets_its_loaders_share_and_killed_workers_leave():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", REGISTRY_FULL.format(root=root)], capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    answers, (loaders, writing), after_kill = (line.split() for line in done.stdout.splitlines())
    assert answers == ["slot"] * (64 + 1)  # the one past the registry's 64 entries adds its own bound
    assert (int(loaders), int(writing)) == (64, 65)
    assert [int(v) for v in after_kill] == [0, 0, 128]  # SIGKILLed: their slots and entries taken back


def test_a_refusal_counts_the_slots_below_the_bound_it_used_not_the_whole_pool():
    pool = SlotPool.create(16)
    held = [pool.native.claim(64, 4)[0] for _ in range(4)]  # slots 0-3, as a loader with a larger bound
    buffer, cause, detail = pool.native.claim(64, 2)
    assert buffer is None and cause == "bound"
    assert detail == ("all 2 shared slots are held (0 by batches the main process still holds, 0 by batches "
                      "workers keep, 0 sent and not yet received, 2 being written)")
    del held


def test_bounds_adding_up_past_the_pools_room_say_so_and_advise_fewer_loaders_not_a_larger_bound():
    pool = SlotPool.create(4)
    held = [pool.claim(64, 8) for _ in range(4)]
    worker_slots._warned.discard((os.getpid(), "room"))
    with pytest.warns(RuntimeWarning) as said:
        assert pool.claim(64, 8) is None
    message = str(said[0].message)
    assert message.startswith("fastcollate: all 4 shared slots of the pool (its loaders' bounds add up to 8) "
                              "are held (0 by batches the main process still holds")
    assert "fewer loaders' workers alive at once" in message and "raise" not in message
    assert pool.native.stats().fresh_fallbacks == 1
    del held
