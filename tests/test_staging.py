"""The main-process staging ring: slots reused when free, never while a batch still uses them, bounded."""

import dataclasses
import gc
import threading
import time
import warnings

import numpy as np
import pytest
import torch

import fastcollate
from fastcollate import _C, StagingRing, assemble


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
    with pytest.warns(ResourceWarning, match="staging slots") as caught:
        extra = collate(images(value=50))
    assert caught[0].filename == __file__  # the warning points at whoever called the collate function
    assert ring.stats().overflow_allocations == 1 and ring.stats().slots == 2
    assert extra["x"][0, 0, 0, 0].item() == 50 and kept[1]["x"][0, 0, 0, 0].item() == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        collate(images())  # warns once per ring, not per batch


@pytest.mark.parametrize("path", ["walked", "gathered", "ring.collate_into", "refused after the overflow"])
def test_the_overflow_warning_points_at_the_line_that_collated(path):
    ring = StagingRing(max_slots=1)
    fields = {"id": fastcollate.Field(kind="number"), "x": fastcollate.Field(range=(0, 9))}
    contract = fastcollate.Contract(fields)
    collate = fastcollate.Assembler(contract if path == "refused after the overflow" else None, ring=ring)
    dataset = fastcollate.Arrays(x=np.arange(10), index_as="id")
    kept = collate(dataset.__getitems__([0, 1]))  # holds the only slot
    calls = {
        "walked": lambda: collate([{"id": 0, "x": 1}, {"id": 1, "x": 2}]),
        "gathered": lambda: collate(dataset.__getitems__([2, 3])),
        "ring.collate_into": lambda: ring.collate_into(_C.Collator("id", [], False), [{"x": 1}, {"x": 2}]),
        "refused after the overflow": lambda: collate(dataset.__getitems__([2, 9])),
    }
    line = calls[path].__code__.co_firstlineno
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            calls[path]()
        except fastcollate.ContractError:
            assert path == "refused after the overflow"
    [warning] = [w for w in caught if "staging slots" in str(w.message)]
    assert (warning.filename, warning.lineno) == (__file__, line) and kept is not None


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


def test_ring_stats_carry_every_counter_the_native_ring_lists():
    stats = StagingRing(max_slots=3).stats()
    names = [name for name, _, _ in _C.RingStats.fields]
    assert [field.name for field in dataclasses.fields(stats)] == names
    assert names[:2] == ["slots", "max_slots"] and "waits_for_copies" in names and names[-1] == "pinned"
    assert (stats.max_slots, stats.slots, stats.pinned) == (3, 0, False)
    assert type(stats.pinned) is bool and type(stats.reuses) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.slots = 1


def test_staging_ring_collate_into_writes_a_batch_into_one_of_its_slots():
    ring = StagingRing(max_slots=1)
    collator = _C.Collator("id", [], False)
    batch = ring.collate_into(collator, images(4, value=3))
    assert ring.owns(batch["x"]) and batch["x"].shape == (4, 3, 32, 32)
    assert batch["x"][2, 0, 0, 0].item() == 5 and torch.equal(batch["id"], torch.arange(4))
    assert ring.stats().slot_allocations == 1


def test_the_old_name_staging_ring_assemble_still_collates_and_says_the_new_one():
    ring = StagingRing(max_slots=1)
    with pytest.warns(FutureWarning, match="StagingRing.collate_into"):
        batch = ring.assemble(_C.Collator("id", [], False), images(2, value=3))
    assert ring.owns(batch["x"]) and torch.equal(batch["id"], torch.arange(2))


def test_staging_in_makes_assemble_write_into_the_ring():
    from fastcollate.transfer.staging import active_ring, staging_in

    ring = StagingRing(max_slots=1)
    with staging_in(ring):
        assert active_ring() is ring
        batch = assemble(images(2))
    assert active_ring() is None and ring.owns(batch["x"])


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


# ---- Slots held by an unfinished copy (a CompletionFlag stands in for a CUDA event) ----------------


def test_a_slot_counts_as_in_use_only_while_its_copy_is_unfinished():
    ring = StagingRing(max_slots=1)
    buffer = ring.acquire(4096)
    copy = _C.CompletionFlag()
    assert ring.hold_until_flag_set(buffer, copy)
    del buffer
    assert ring.stats().in_use == 1  # nothing references it, but the copy still reads it
    copy.set()
    assert ring.stats().in_use == 0  # done: asked, not assumed from the copy having been recorded


def test_acquire_waits_for_the_unfinished_copy_of_the_only_slot():
    ring = StagingRing(max_slots=1)
    first = ring.acquire(4096)
    first.fill_(7)
    copy = _C.CompletionFlag()
    ring.hold_until_flag_set(first, copy)
    del first
    finisher = threading.Timer(0.2, copy.set)
    finisher.start()
    started = time.monotonic()
    second = ring.acquire(4096)  # the only slot: wait for its copy, not hand it out or allocate
    waited = time.monotonic() - started
    finisher.join()
    assert copy.is_set() and waited >= 0.15
    stats = ring.stats()
    assert stats.waits_for_copies == 1 and stats.overflow_allocations == 0 and stats.slots == 1
    assert second.numel() == 4096


def test_a_buffer_outside_the_ring_cannot_be_held():
    ring = StagingRing(max_slots=1)
    assert not ring.hold_until_flag_set(torch.zeros(16, dtype=torch.uint8), _C.CompletionFlag())


def test_batches_of_creeping_size_regrow_a_slot_rarely_and_within_headroom():
    ring = StagingRing(max_slots=1)
    sizes = [100_000 + 1_000 * i for i in range(50)]  # padded batches growing by 1% at a time
    for size in sizes:
        ring.acquire(size)
    stats = ring.stats()
    # 1/16 headroom per regrowth: at most log(1.49)/log(1.0625) ~ 6.6 regrowths (exact sizing made 49).
    assert 1 <= stats.regrowths <= 8 and stats.slot_allocations == stats.regrowths + 1
    assert max(sizes) <= stats.bytes_held <= max(sizes) * 17 // 16 + 64


def test_a_short_batch_gets_a_slot_sized_for_the_full_ones():
    ring = StagingRing(max_slots=2)
    full = ring.acquire(50_000)
    short = ring.acquire(1_000)  # the last batch of an epoch, while a full one is still held
    del full, short
    both = [ring.acquire(50_000), ring.acquire(50_000)]  # the next epoch's first two batches
    stats = ring.stats()
    assert len(both) == 2 and stats.slot_allocations == 2 and stats.regrowths == 0
    assert stats.bytes_held == 2 * 50_048  # each aligned, none rounded to a power of two


def test_a_refused_allocation_leaves_the_ring_as_it_was():
    ring = StagingRing(max_slots=2)
    with pytest.raises(RuntimeError, match="out of host memory"):
        ring.acquire(1 << 50)  # a petabyte: past any address space, refused at once
    assert ring.stats().slots == 0
    ring.acquire(4096)  # sized to what it asks, not to the refused request
    assert ring.stats().bytes_held == 4096 and ring.stats().slots == 1


def test_a_slot_whose_storage_python_has_seen_is_still_reused():
    # Since torch 2.10 a storage's Python wrapper lives as long as any C++ reference to the storage:
    # a ring that counted references to one long-lived storage per slot never saw it free again.
    ring = StagingRing(max_slots=1)
    batch = assemble.using(ring=ring)(images())
    storage = batch["x"].untyped_storage()  # as DeviceLoader, pickling or a user's code would
    del storage, batch
    assert ring.stats().in_use == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fresh buffer: the slot is reused
        assemble.using(ring=ring)(images())
    assert ring.stats().reuses == 1 and ring.stats().overflow_allocations == 0


def test_a_batch_outlives_its_ring():
    ring = StagingRing(max_slots=1)
    batch = assemble.using(ring=ring)(images(value=3))
    del ring
    gc.collect()
    assert batch["x"][1, 0, 0, 0].item() == 4  # the slot's memory lives as long as the batch


def test_slot_holding_finds_the_one_slot_a_batch_lies_in_and_nothing_for_tensors_outside_it():
    from fastcollate.transfer.staging import slot_holding

    ring = StagingRing(max_slots=2)
    batch = assemble.using(ring=ring)(images())
    tensors = [batch["x"], batch["id"]] if ring.owns(batch["id"]) else [batch["x"]]
    slot, offsets = slot_holding(tensors, ring.owns)
    for tensor, offset in zip(tensors, offsets, strict=True):
        viewed = slot[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        assert torch.equal(viewed, tensor)
    assert slot_holding([batch["x"], torch.zeros(3)], ring.owns) is None  # one outside the slot
    assert slot_holding([batch["x"][:, :, 1:]], ring.owns) is None  # not contiguous: no byte range of it
    assert slot_holding([torch.zeros(3)], ring.owns) is None
