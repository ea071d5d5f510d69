"""Concurrency: two DeviceLoaders in one process, one DataLoader iterated from two threads, one iterator
shared by two threads, and staging rings too small for what is in flight. Every batch is checked
against its content (``x`` is full of the sample's id) and every kept batch again at the end: correct
data or a clear error, never a batch overwritten under its holder, never a deadlock.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

from fastcollate import DeviceLoader, StagingRing, assemble
from tests.conftest import cpu_and_cuda
from tests.helpers.fault_datasets import Numbered

JOIN = 120  # seconds: a thread still running after this is a deadlock


def check(batch) -> list[int]:
    ids = batch["id"]
    x = batch["x"]
    expected = ids.to(x.device, torch.float32).view(-1, *([1] * (x.dim() - 1))).expand_as(x)
    assert torch.equal(x, expected), "a batch's values are not its samples'"
    return ids.tolist()


def in_threads(*targets):
    """Runs each target in its own thread; re-raises the first error; fails on a thread that hangs."""
    errors: list[BaseException] = []

    def guarded(target):
        try:
            target()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(target,)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN)
    assert not any(thread.is_alive() for thread in threads), "a thread hangs: deadlock"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("workers", [0, 2], ids=["workers0", "workers2"])
def test_two_device_loaders_interleaved_in_one_thread(workers):
    a = DeviceLoader(DataLoader(Numbered(40, shape=(4, 4)), batch_size=8, num_workers=workers,
                                collate_fn=assemble),
                     device="cpu", depth=3)
    b = DeviceLoader(DataLoader(Numbered(24, shape=(2, 3, 5)), batch_size=3, num_workers=workers,
                                collate_fn=assemble), device="cpu", depth=1)
    kept_a, kept_b = [], []
    for _ in range(2):
        iterators = [iter(a), iter(b)]
        done = [False, False]
        while not all(done):
            for index, (iterator, kept) in enumerate(zip(iterators, (kept_a, kept_b), strict=True)):
                if not done[index]:
                    try:
                        kept.append(next(iterator))
                    except StopIteration:
                        done[index] = True
    assert [i for batch in kept_a for i in check(batch)] == list(range(40)) * 2  # kept ones were never reused
    assert [i for batch in kept_b for i in check(batch)] == list(range(24)) * 2


@pytest.mark.parametrize("workers", [0, 2], ids=["workers0", "workers2"])
def test_two_device_loaders_in_two_threads(workers):
    """Both collate into the process's staging ring at once (num_workers=0): slots are never shared."""
    results = {}

    def run(name, n, shape, batch_size):
        loader = DataLoader(Numbered(n, shape=shape), batch_size=batch_size, num_workers=workers,
                            collate_fn=assemble)
        kept = []
        for _ in range(3):
            for batch in DeviceLoader(loader, device="cpu", depth=2):
                check(batch)
                kept.append(batch)
        results[name] = kept

    in_threads(lambda: run("a", 48, (3, 8, 8), 6), lambda: run("b", 30, (17,), 5))
    assert [i for batch in results["a"] for i in check(batch)] == list(range(48)) * 3
    assert [i for batch in results["b"] for i in check(batch)] == list(range(30)) * 3


@pytest.mark.parametrize("workers", [0, 2], ids=["workers0", "workers2"])
def test_one_dataloader_iterated_from_two_threads(workers):
    loader = DataLoader(Numbered(64, shape=(5, 5)), batch_size=4, num_workers=workers, collate_fn=assemble)
    results = {}

    def run(name):
        results[name] = [batch for _ in range(2) for batch in loader]

    in_threads(lambda: run("first"), lambda: run("second"))
    for name in ("first", "second"):
        assert [i for batch in results[name] for i in check(batch)] == list(range(64)) * 2, name


@pytest.mark.parametrize("workers", [0, 2], ids=["workers0", "workers2"])
def test_one_device_iterator_shared_by_two_threads_hands_each_batch_out_once(workers):
    loader = DataLoader(Numbered(96, shape=(6,)), batch_size=4, num_workers=workers, collate_fn=assemble)
    iterator = iter(DeviceLoader(loader, device="cpu", depth=2))
    taken: dict[str, list] = {"a": [], "b": []}

    def run(name):
        for batch in iterator:
            check(batch)
            taken[name].append(batch)

    in_threads(lambda: run("a"), lambda: run("b"))
    ids = sorted(i for name in taken for batch in taken[name] for i in check(batch))
    assert ids == list(range(96))  # each batch to exactly one thread, none lost, none twice
    for name in taken:  # and each thread's batches in the loader's order
        firsts = [check(batch)[0] for batch in taken[name]]
        assert firsts == sorted(firsts)


def test_one_plain_dataloader_iterator_shared_by_two_threads_gives_right_data_or_a_clear_error():
    """DataLoader's own iterator is not thread-safe (its sampler is a generator): sharing one may end
    in "generator already executing", but never in a batch with the wrong samples in it."""
    iterator = iter(DataLoader(Numbered(200, shape=(3,)), batch_size=2, collate_fn=assemble))
    taken: list = []
    errors: list = []

    def run():
        try:
            for batch in iterator:
                check(batch)
                taken.append(batch)
        except ValueError as error:  # the generator's own refusal
            errors.append(error)

    in_threads(run, run)
    for error in errors:
        assert "generator already executing" in str(error)
    ids = [i for batch in taken for i in check(batch)]
    assert len(ids) == len(set(ids))


def test_a_ring_too_small_for_the_batches_held_falls_back_to_fresh_buffers_with_a_warning():
    ring = StagingRing(max_slots=1)
    loader = DataLoader(Numbered(40, shape=(8, 8)), batch_size=4, collate_fn=assemble.using(ring=ring))
    with pytest.warns(ResourceWarning, match="staging slots"):
        kept = list(DeviceLoader(loader, device="cpu", depth=4))  # 10 batches held, 1 slot
    assert [i for batch in kept for i in check(batch)] == list(range(40))
    stats = ring.stats()
    assert stats.slots == 1 and stats.overflow_allocations == 9


def test_a_one_slot_ring_shared_by_threads_never_deadlocks_or_mixes_batches():
    ring = StagingRing(max_slots=1)
    collate = assemble.using(ring=ring)
    kept: dict[int, list] = {0: [], 1: []}

    def run(worker):
        for step in range(150):
            base = worker * 10_000 + step * 10
            batch = collate([{"id": base + i, "x": torch.full((32,), float(base + i))} for i in range(6)])
            check(batch)
            if step % 10 == 0:
                kept[worker].append(batch)  # some kept: the slot stays taken, the other thread overflows

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        in_threads(lambda: run(0), lambda: run(1))
    for worker in kept:
        assert len(kept[worker]) == 15
        for batch in kept[worker]:
            check(batch)
    assert ring.stats().slots == 1


def test_samples_replaced_by_another_thread_while_their_batch_is_copied():
    """The copy runs without the GIL: a thread that meanwhile replaces a sample's tensor (a cache being
    refreshed) must not free the tensor being read. Every batch holds the values of one version."""
    samples = [{"id": i, "x": torch.full((128, 1024), float(i))} for i in range(16)]  # 512 KiB each
    stop = threading.Event()

    def replace():
        while not stop.is_set():
            for sample in samples:
                sample["x"] = torch.full((128, 1024), float(sample["id"]))

    replacer = threading.Thread(target=replace)
    replacer.start()
    try:
        collate = assemble.using(ring=StagingRing(max_slots=2))
        for _ in range(60):
            check(collate(samples))
    finally:
        stop.set()
        replacer.join(JOIN)


@pytest.mark.needs_cuda
def test_on_a_gpu_a_consumer_keeping_every_batch_never_deadlocks_the_pinned_ring():
    """Pinned slots wait for their copy rather than overflow: with depth 1 and every device batch kept,
    the loader must still finish (the host batch is dropped once its copy is queued)."""
    loader = DataLoader(Numbered(64, shape=(3, 16, 16)), batch_size=4, collate_fn=assemble)
    device_loader = DeviceLoader(loader, device="cuda", depth=1)
    kept = []

    def run():
        kept.extend(device_loader)

    in_threads(run)
    torch.cuda.synchronize()
    assert [i for batch in kept for i in check(batch)] == list(range(64))
    assert device_loader.stats()["pinned_slots"] <= 1


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_two_device_loaders_on_one_device_in_two_threads(device):
    results = {}

    def run(name, n):
        loader = DataLoader(Numbered(n, shape=(3, 8, 8)), batch_size=4, collate_fn=assemble)
        results[name] = list(DeviceLoader(loader, device=device, depth=2))

    in_threads(lambda: run("a", 48), lambda: run("b", 36))
    if device == "cuda":
        torch.cuda.synchronize()
    assert [i for batch in results["a"] for i in check(batch)] == list(range(48))
    assert [i for batch in results["b"] for i in check(batch)] == list(range(36))
