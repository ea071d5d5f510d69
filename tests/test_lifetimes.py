"""Lifetimes over many epochs: host memory (RSS of the main process and of persistent workers, shared
memory, staging-ring slots) and file descriptors stay flat after the first epoch, with persistent
workers and without, under fork and spawn, through DeviceLoader.

``FASTCOLLATE_EPOCHS`` sets the epochs (``make fuzz``: 20); ``make test`` runs a few.
"""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch
from torch.utils.data import DataLoader

from fastcollate import Arrays, DeviceLoader, StagingRing, assemble
from fastcollate.tools.bench.malloc import fixed_mmap_threshold
from tests.helpers.fault_datasets import Numbered, child_pids

EPOCHS = max(3, int(os.environ.get("FASTCOLLATE_EPOCHS", "3")))
SAMPLE = (3, 96, 96)  # 108 KiB of float32: an epoch of 32 samples is 3.4 MiB, so a leak shows in RSS
RSS_SLACK = 6 * 2**20  # allocator noise allowed over all later epochs together; one leaked epoch exceeds it
PAGE = os.sysconf("SC_PAGE_SIZE")
# Under AddressSanitizer (make sanitize) freed memory sits in its quarantine: RSS says nothing there.
UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")


def rss(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as handle:
        return int(handle.read().split()[1]) * PAGE


HELPERS = (b"resource_tracker", b"forkserver", b"torch_shm_manager")  # one per process, for its lifetime


def children() -> set[int]:
    """This process's children, less multiprocessing's and torch's per-process helpers."""
    workers = set()
    for pid in child_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read()  # read once: a second read() of the file gives b""
            if not any(helper in command for helper in HELPERS):
                workers.add(pid)
        except OSError:
            pass  # already gone
    return workers


def measure(loader, ring: StagingRing | None, expected_workers: int) -> dict:
    gc.collect()
    deadline = time.monotonic() + 20
    # The workers of the last epoch may still be exiting.
    while len(children()) > expected_workers and time.monotonic() < deadline:
        time.sleep(0.05)
        gc.collect()
    kids = children()
    ring_stats = ring.stats() if ring is not None else None
    slots = loader.collate_fn.shared_slot_stats() if loader.num_workers else None
    return {
        "rss": rss(),
        "workers_rss": sum(rss(pid) for pid in kids) if expected_workers else 0,
        "workers": len(kids),
        "fds": len(os.listdir("/proc/self/fd")),
        "shm": len(os.listdir("/dev/shm")),
        "ring": (ring_stats.slots, ring_stats.bytes_held, ring_stats.slot_allocations, ring_stats.in_use)
        if ring_stats else None,
        # Slots used and their memory, and none left held once the epoch's batches are dropped.
        "slots": (slots.slots_used, slots.bytes_held, slots.lent, slots.writing, slots.delivered)
        if slots else None,
    }


def run_epochs(loader, ring, expected_workers):
    device_loader = DeviceLoader(loader, device="cpu", depth=2)
    seen = []
    for _epoch in range(EPOCHS):
        ids = []
        for batch in device_loader:
            assert torch.equal(batch["x"][:, 0, 0, 0], batch["id"].to(torch.float32))
            ids.extend(batch["id"].tolist())
        del batch
        assert sorted(ids) == list(range(len(loader.dataset)))
        seen.append(measure(loader, ring, expected_workers))
    return seen


def assert_flat(seen: list[dict]) -> None:
    first, later = seen[0], seen[1:]
    for key in ("fds", "shm", "workers", "ring", "slots"):
        assert all(m[key] == first[key] for m in later), f"{key} after each epoch: {[m[key] for m in seen]}"
    if UNDER_ASAN:
        return
    growth = max(m["rss"] for m in later) - first["rss"]
    assert growth < RSS_SLACK, f"main RSS grew {growth / 2**20:.1f} MiB: {[m['rss'] >> 20 for m in seen]} MiB"
    worker_growth = max(m["workers_rss"] for m in later) - first["workers_rss"]
    assert worker_growth < RSS_SLACK, (
        f"workers' RSS grew {worker_growth / 2**20:.1f} MiB: {[m['workers_rss'] >> 20 for m in seen]} MiB")


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "fresh-workers"])
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_memory_and_descriptors_stay_flat_over_epochs_with_workers(context, persistent):
    # Spawning fresh workers each epoch costs an interpreter start apiece: one worker keeps make test short.
    workers = 1 if context == "spawn" and not persistent else 2
    loader = DataLoader(Numbered(32, shape=SAMPLE), batch_size=8, num_workers=workers,
                        collate_fn=assemble.using(),
                        multiprocessing_context=context, persistent_workers=persistent, timeout=60,
                        worker_init_fn=fixed_mmap_threshold)
    seen = run_epochs(loader, None, workers if persistent else 0)
    assert_flat(seen)
    assert seen[-1]["slots"][2:] == (0, 0, 0)  # no slot lent, being written or in flight
    if persistent:
        del loader  # the persistent workers go with their loader
        gc.collect()
        deadline = time.monotonic() + 20
        while children() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not children()


@pytest.mark.slow
def test_memory_and_ring_stay_flat_over_epochs_in_the_main_process():
    fixed_mmap_threshold()
    ring = StagingRing(max_slots=4)
    loader = DataLoader(Numbered(32, shape=SAMPLE), batch_size=8, num_workers=0,
                        collate_fn=assemble.using(ring=ring))
    seen = run_epochs(loader, ring, 0)
    assert_flat(seen)
    slots, bytes_held, allocations, in_use = seen[-1]["ring"]
    # Held at once: DeviceLoader's 2 staged, the batch handed out and the consumer's previous one.
    assert in_use == 0 and slots <= 4 and allocations == slots


@pytest.mark.slow
def test_the_ring_serves_a_long_run_without_allocating():
    """Thousands of batches of varying size through one bounded ring: the slots are allocated at the
    start (and grown to the largest batch), then only reused."""
    ring = StagingRing(max_slots=2)
    collate = assemble.using(ring=ring)
    allocations = None
    for step in range(2000):
        batch = collate([{"id": i, "x": torch.full((1 + (step * 7) % 13, 16), float(i))} for i in range(8)])
        assert batch["x"][3, 0, 0].item() == 3.0
        del batch
        if step == 200:
            allocations = ring.stats().slot_allocations
    stats = ring.stats()
    assert stats.slot_allocations == allocations and stats.overflow_allocations == 0 and stats.slots == 1


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_gathered_arrays_stay_flat_over_epochs(workers):
    """fastcollate.Arrays gathered by index: into the ring at workers=0, into shared slots with workers."""
    fixed_mmap_threshold()
    x = torch.zeros(32, *SAMPLE)
    x[:, 0, 0, 0] = torch.arange(32, dtype=torch.float32)
    ring = StagingRing(max_slots=4) if workers == 0 else None
    loader = DataLoader(Arrays(x=x, index_as="id"), batch_size=8, shuffle=True, num_workers=workers,
                        collate_fn=assemble.using(ring=ring), persistent_workers=workers > 0,
                        worker_init_fn=fixed_mmap_threshold if workers else None)
    seen = run_epochs(loader, ring, workers)
    assert_flat(seen)
    if workers:
        assert seen[-1]["slots"][2:] == (0, 0, 0)  # no slot lent, being written or in flight
    else:
        assert seen[-1]["ring"][3] == 0  # no ring slot in use
