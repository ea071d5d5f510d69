"""The main-process staging ring: slots reused when free, never while a batch still uses them, bounded."""

import gc
import warnings

import pytest
import torch

from fastcollate import StagingRing, assemble


def images(n=8, value=0):
    return [{"id": i, "x": torch.full((3, 32, 32), value + i, dtype=torch.uint8)} for i in range(n)]


def test_a_dropped_batch_frees_its_slot_for_the_next_one():
    ring = StagingRing(max_slots=2)
    collate = assemble.using(ring=ring)
    batch = collate(images())
    del batch
    for _ in range(5):
        batch = collate(images())
        del batch
    stats = ring.stats()
    assert stats.slot_allocations == 1 and stats.reuses == 5 and stats.slots == 1
    assert stats.overflow_allocations == 0 and stats.in_use == 0


def test_a_kept_batch_is_never_overwritten():
    ring = StagingRing(max_slots=4)
    collate = assemble.using(ring=ring)
    kept = collate(images(value=0))
    snapshot = kept["x"].clone()
    view = kept["x"][2]  # a view alone must keep the slot too
    del kept
    for round_ in range(6):
        collate(images(value=100 + round_))
    assert torch.equal(view, snapshot[2])
    assert ring.stats().in_use == 1


def test_past_the_bound_fresh_buffers_are_used_with_a_warning():
    ring = StagingRing(max_slots=2)
    collate = assemble.using(ring=ring)
    kept = [collate(images(value=i)) for i in range(2)]
    with pytest.warns(ResourceWarning, match="staging slots"):
        extra = collate(images(value=50))
    assert ring.stats().overflow_allocations == 1 and ring.stats().slots == 2
    assert extra["x"][0, 0, 0, 0].item() == 50 and kept[1]["x"][0, 0, 0, 0].item() == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        collate(images())  # warns once per ring, not per batch


def test_a_slot_grows_when_a_larger_batch_arrives_and_is_sized_exactly():
    ring = StagingRing(max_slots=1)
    collate = assemble.using(ring=ring)
    collate(images(4))
    small = ring.stats().bytes_held
    collate(images(16))
    stats = ring.stats()
    assert stats.bytes_held > small and stats.slots == 1
    assert stats.bytes_held < 2 * 16 * 3 * 32 * 32  # aligned, not power-of-two rounded
    collate(images(4))  # the grown slot serves smaller batches
    assert ring.stats().slot_allocations == 2


def test_trim_frees_unused_slots():
    ring = StagingRing(max_slots=3)
    collate = assemble.using(ring=ring)
    kept = collate(images())
    collate(images())
    gc.collect()
    freed = ring.trim()
    assert freed > 0 and ring.stats().slots == 1
    del kept
    assert ring.trim() > 0 and ring.stats().slots == 0


def test_bad_ring_arguments():
    with pytest.raises(RuntimeError):
        StagingRing(max_slots=-1)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="pinned"):
            StagingRing(pinned=True)
