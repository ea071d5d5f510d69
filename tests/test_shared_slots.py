"""Slots shared with DataLoader workers (fastcollate.transfer.worker_slots): the same batches as
default_collate under every start method, the switch, what is left behind (slots, descriptors, /dev/shm)
after faults, each write received at most once, and the fallback when every slot is held."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from fastcollate import Assembler, DeviceLoader, assemble
from fastcollate._ext import _C
from fastcollate.transfer.kept_fields import held_by_kept_fields
from fastcollate.transfer.worker_slots import SlotPool
from tests.conftest import CUDA
from tests.helpers.fault_datasets import HangsAt, Numbered
from tests.helpers.worker_datasets import ChangesTheBatch, KillsItselfAfterAssembling, Records, Stream
from tests.test_assemble_dropin import assert_same
from tests.test_faults import TORCH_FD_PROBE, fd_targets

RECEIVED = _C.SLOT_KIND_RECEIVED  # _C.shared_slot_kind of a batch received over a slot
NONE = _C.SLOT_KIND_NONE  # of a tensor in no slot


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def left_in_dev_shm(before: set[str]) -> set[str]:
    """Entries made since ``before`` and still there (multiprocessing's semaphores of other tests come
    and go: an entry that went away is not a leak)."""
    return shm_entries() - before


def new_fds(before: dict[str, str]) -> dict[str, str]:
    """Descriptors open now that were not before, less the probe file DataLoader's SIGCHLD handler can
    leave open when it fires during its descriptor probe (torch's, see test_faults)."""
    return {fd: target for fd, target in fd_targets().items()
            if before.get(fd) != target and not TORCH_FD_PROBE.fullmatch(target)}


def claimed(native, nbytes: int, bound: int) -> torch.Tensor:
    """A writer's buffer over a free slot (the test's pool has one)."""
    buffer, cause, detail = native.claim(nbytes, bound)
    assert buffer is not None, (cause, detail)
    return buffer


def settled_stats(collate: Assembler, timeout: float = 20.0):
    """The pool's stats once no slot is being written or waits to be received (workers exiting)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        stats = collate.shared_slot_stats()
        if (stats.writing == 0 and stats.delivered == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


# Spawned and forkserver workers get the pool the same way, in the Assembler pickled for the process being
# started, and fresh workers get it again each epoch: forkserver's fresh workers show that, spawn's
# persistent ones spawn's start; spawn's fresh ones (4 interpreters) only add time, and make fuzz runs them.
@pytest.mark.parametrize(("context", "persistent"), [
    ("fork", False), ("fork", True), pytest.param("spawn", False, marks=pytest.mark.fuzz), ("spawn", True),
    ("forkserver", False), ("forkserver", True),
], ids=lambda value: {False: "fresh-workers", True: "persistent"}.get(value, value))
def test_batches_arrive_over_slots_as_default_collate_makes_them(context, persistent):
    collate = assemble.using()
    loader = DataLoader(
        Records(40),
        batch_size=8,
        num_workers=2,
        collate_fn=collate,
        multiprocessing_context=context,
        persistent_workers=persistent,
        timeout=60,
    )
    expected = list(DataLoader(Records(40), batch_size=8, collate_fn=default_collate))
    got = []
    for _ in range(2):
        del got[:]  # the last epoch's batches go: holding them too would fill the default bound of 8
        got = list(loader)
        assert len(got) == len(expected)
        for batch, reference in zip(got, expected, strict=True):
            assert_same(batch, reference)
            assert _C.shared_slot_kind(batch["image"]) == RECEIVED
            assert _C.shared_slot_kind(batch["meta"]["vec"]) == RECEIVED
    stats = collate.shared_slot_stats()
    assert stats.lent == 5 and stats.fresh_fallbacks == 0  # the last epoch's batches, still held in `got`
    assert stats.claims == stats.receipts == 10
    assert stats.slots_used <= 2 * 2 + 4
    del got, batch
    stats = settled_stats(collate)
    assert stats.lent == stats.writing == stats.delivered == 0


def test_the_pool_is_a_private_memfd_that_leaves_no_name_behind():
    before = shm_entries()
    collate = assemble.using()
    batches = list(DataLoader(Records(16), batch_size=8, num_workers=2, collate_fn=collate))
    assert all(_C.shared_slot_kind(batch["image"]) == RECEIVED for batch in batches)
    fd = collate._slots.native.fd
    assert os.fstat(fd).st_mode & 0o777 == 0o600
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:fastcollate-slots")
    assert not left_in_dev_shm(before)


def test_the_switch_forces_fresh_shared_memory(monkeypatch):
    off = list(
        DataLoader(Records(16), batch_size=8, num_workers=1, collate_fn=assemble.using(shared_slots=False))
    )
    assert all(_C.shared_slot_kind(b["image"]) == NONE and b["image"].is_shared() for b in off)
    monkeypatch.setenv("FASTCOLLATE_SHARED_SLOTS", "0")
    collate = assemble.using()
    by_env = list(DataLoader(Records(16), batch_size=8, num_workers=1, collate_fn=collate))
    assert all(_C.shared_slot_kind(b["image"]) == NONE and b["image"].is_shared() for b in by_env)
    assert collate.shared_slot_stats() is None  # no pool was made
    for a, b in zip(off, by_env, strict=True):
        assert_same(a, b)


def test_several_loaders_share_one_assembler_at_once():
    # Each loader's workers bring their own bound (2 x workers + 4): the two at once share 8 + 6 slots.
    collate = assemble.using()
    first = DataLoader(Numbered(48), batch_size=8, num_workers=2, collate_fn=collate)
    second = DataLoader(Numbered(48), batch_size=8, num_workers=1, collate_fn=collate, shuffle=True)
    ids = []
    for a, b in zip(first, second, strict=True):
        for batch in (a, b):
            assert torch.equal(batch["x"][:, 0, 0], batch["id"].float())
            assert _C.shared_slot_kind(batch["x"]) == RECEIVED
            ids += batch["id"].tolist()
    assert sorted(ids) == sorted(list(range(48)) * 2)
    assert collate.shared_slot_stats().fresh_fallbacks == 0


FULL_POOL = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    import torch
    from torch.utils.data import DataLoader
    from fastcollate import assemble
    from fastcollate._ext import _C
    from tests.helpers.fault_datasets import Numbered
    collate = assemble.using(max_shared_slots=2)
    loader = DataLoader(Numbered(80, shape=(64,)), batch_size=8, num_workers=2, collate_fn=collate,
                        timeout=60)
    kept = list(loader)
    assert all(torch.equal(b["x"], b["id"].float()[:, None].expand(8, 64)) for b in kept)
    in_slots = sum(_C.shared_slot_kind(b["x"]) == _C.SLOT_KIND_RECEIVED for b in kept)
    print(len(kept), in_slots, collate.shared_slot_stats().fresh_fallbacks)
""")


def test_kept_batches_are_never_overwritten_and_a_full_pool_falls_back_with_one_warning():
    # Every batch is held: the two slots fill and the rest must not wait for them. In a subprocess, so
    # that the workers' warnings reach stderr as they would for a user (pytest records them otherwise).
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", FULL_POOL.format(root=root)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    kept, in_slots, fallbacks = (int(v) for v in done.stdout.split())
    assert kept == 10 and 1 <= in_slots <= 2 and fallbacks == kept - in_slots
    warned = done.stderr.count("fastcollate: all 2 shared slots are held (")
    assert 1 <= warned <= 2, done.stderr  # once per worker that found them full
    assert "by batches the main process still holds" in done.stderr and "max_shared_slots" in done.stderr
    assert "held only by fields" not in done.stderr  # whole batches hold the slots, not fields kept from them


KEPT_IDS = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from torch.utils.data import DataLoader
    from fastcollate import assemble
    from tests.helpers.fault_datasets import Numbered
    collate = assemble.using(max_shared_slots=2)
    loader = DataLoader(Numbered(80, shape=(64,)), batch_size=8, num_workers=2, collate_fn=collate,
                        timeout=60)
    ids = [batch["id"] for batch in loader]
    assert [i for batch in ids for i in batch.tolist()] == list(range(80))
""")


def test_ids_kept_from_each_batch_are_named_as_what_holds_the_slots():
    # The loop keeps each batch's ids and drops the rest: a batch of 2 KiB stays whole in its slot, so the
    # ids alone hold it. The workers' warning says a kept field can; the main process names 'id'.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", KEPT_IDS.format(root=root)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "A field kept from a batch under 1 MiB (an id or a label kept for metrics) holds" in done.stderr
    named = [line for line in done.stderr.splitlines() if "held only by fields" in line]
    assert len(named) == 1, done.stderr  # once, from the main process
    assert "dropped: 'id' (" in named[0] and "'x'" not in named[0], named[0]


def test_a_slot_held_only_by_a_kept_field_is_counted_under_its_key():
    pool = SlotPool.create(4)
    native = pool.native
    samples = [{"id": i, "x": torch.full((16,), float(i))} for i in range(4)]
    plan = _C.Collator("id", [], False).plan(samples)
    written = plan.execute(claimed(native, plan.nbytes, 4), small_fields_apart=False)
    fields = native.written_fields()
    ((slot, seq), laid_out), = fields.items()
    assert [key for _, _, key in laid_out] == ["id", "x"]
    places = [(t.storage_offset() * t.element_size(), t.nbytes) for t in (written["id"], written["x"])]
    assert [(offset, nbytes) for offset, nbytes, _ in laid_out] == places
    token, slot, seq, nbytes, _ = _C.deliver_slot_tensor(written["id"])  # the batch is sent
    received = {key: native.receive(slot, seq, nbytes, t.dtype, t.storage_offset(), list(t.shape),
                                    list(t.stride()), -1) for key, t in written.items()}
    del written
    assert _C.received_slot_of(received["x"]) == (native.token, slot, seq)
    assert _C.received_slot_of(torch.zeros(2)) is None
    assert not held_by_kept_fields(native.token, fields)  # the whole batch alive: the batch holds its slot
    first_id = received["id"][:1]  # a view of a field is that field
    del received
    assert held_by_kept_fields(native.token, fields) == {"id": 1}
    assert not held_by_kept_fields(native.token + 1, fields)  # another pool's slots
    del first_id
    gc.collect()
    assert native.stats().free == 4


def test_a_worker_killed_mid_write_leaves_no_slot_descriptor_or_name_behind():
    # A fork first: every Assembler alive gets its pool then (one descriptor each, for its lifetime).
    list(DataLoader(Numbered(8), batch_size=8, num_workers=1))
    gc.collect()
    fds, names = fd_targets(), shm_entries()
    collate = assemble.using()
    loader = DataLoader(
        Numbered(64),
        batch_size=8,
        num_workers=2,
        timeout=60,
        collate_fn=KillsItselfAfterAssembling(collate, bad=37),
    )
    received = []
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid\(?s?\)? ?\d+"):
        for batch in loader:
            assert torch.equal(batch["x"][:, 0, 0], batch["id"].float())  # never a half-written batch
            received.append(batch)
    assert all(37 not in batch["id"].tolist() for batch in received)
    del loader, batch
    stats = settled_stats(collate)
    assert stats.writing == 0 and stats.delivered == 0
    assert stats.reclaimed >= 1  # the killed worker's claimed slot
    del received
    gc.collect()
    assert settled_stats(collate).lent == 0
    del collate, stats
    gc.collect()
    assert not new_fds(fds) and not left_in_dev_shm(names)


def test_each_write_is_received_at_most_once():
    pool = SlotPool.create(4)
    native = pool.native
    buffer = claimed(native, 64, 4)
    buffer.fill_(7)
    token, slot, seq, nbytes, first = _C.deliver_slot_tensor(buffer)
    assert token == native.token and first == 1
    assert _C.deliver_slot_tensor(buffer)[4] == 0  # delivered already: by this message, or an earlier one
    first = native.receive(slot, seq, nbytes, torch.uint8, 0, [64], [1], -1)
    again = native.receive(slot, seq, nbytes, torch.uint8, 0, [8], [1], -1)  # another tensor of the batch
    assert first.untyped_storage().data_ptr() == again.untyped_storage().data_ptr()
    assert torch.all(first == 7)
    with pytest.raises(RuntimeError, match="reaches past its batch"):
        native.receive(slot, seq, nbytes, torch.float32, 0, [64], [1], -1)
    with pytest.raises(RuntimeError, match="batch #2.*cannot be received"):
        native.receive(slot, seq + 1, nbytes, torch.uint8, 0, [64], [1], -1)  # a sequence number mismatch
    del buffer  # the writer drops its view: the slot is the receiver's alone
    assert _C.deliver_slot_tensor(first) == []  # not a writer's view: sent the ordinary way
    del first, again
    with pytest.raises(RuntimeError, match="received at most once"):
        native.receive(slot, seq, nbytes, torch.uint8, 0, [64], [1], -1)  # the same write delivered twice
    unsent = claimed(native, 64, 4)
    with pytest.raises(RuntimeError, match="being written"):
        native.receive(0, seq + 1, 64, torch.uint8, 0, [64], [1], -1)
    del unsent
    assert native.stats().free == 4


def test_a_batch_a_worker_kept_and_sent_again_arrives_intact():
    collate = assemble.using()
    loader = DataLoader(
        Numbered(48, shape=(2, 3)), batch_size=8, num_workers=1, collate_fn=ChangesTheBatch(collate)
    )
    batches = list(loader)
    ids = [tuple(batch["id"].tolist()) for batch in batches]
    assert ids[1] == ids[0]  # the worker's collate sent its first batch twice, as it chose to
    for batch in batches:
        assert torch.equal(batch["doubled"], 2 * batch["id"].float()[:, None, None].expand(8, 2, 3))
        assert torch.equal(batch["first_column"][:, :, 0], batch["id"].float()[:, None].expand(8, 2))
    assert _C.shared_slot_kind(batches[-1]["first_column"]) == RECEIVED  # a view of the slot, received
    assert _C.shared_slot_kind(batches[-1]["doubled"]) == NONE  # a new tensor, in fresh shared memory


def test_an_iterable_dataset_a_timeout_and_a_loader_deleted_mid_epoch_leave_no_slot_held():
    collate = assemble.using()
    streamed = list(DataLoader(Stream(48), batch_size=8, num_workers=2, collate_fn=collate))
    assert sorted(i for b in streamed for i in b["id"].tolist()) == list(range(48))
    assert all(_C.shared_slot_kind(b["x"]) == RECEIVED for b in streamed)
    del streamed

    iterator = iter(DataLoader(Numbered(400), batch_size=8, num_workers=2, collate_fn=collate))
    partial = [next(iterator) for _ in range(3)]
    del iterator  # deleted mid-epoch: batches in flight are dropped with the workers
    assert settled_stats(collate).lent == len(partial)
    del partial
    assert settled_stats(collate).lent == 0

    # Any timeout will do: what is checked is that the slots settle after it, whichever batch it hit.
    hanging = DataLoader(HangsAt(64, bad=20), batch_size=8, num_workers=2, collate_fn=collate, timeout=1)
    with pytest.raises(RuntimeError, match="timed out"):
        list(hanging)
    del hanging
    stats = settled_stats(collate)
    assert stats.writing == stats.delivered == stats.lent == 0


MAIN_KILLED = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from torch.utils.data import DataLoader
    from fastcollate import assemble
    from tests.helpers.fault_datasets import Numbered
    loader = DataLoader(Numbered(10_000, delay=0.01), batch_size=8, num_workers=2, collate_fn=assemble)
    for step, batch in enumerate(loader):
        if step == 3:
            print("ready", flush=True)
        time.sleep(0.01)
""")


def test_the_main_process_killed_leaves_nothing_in_dev_shm():
    names = shm_entries()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.Popen(
        [sys.executable, "-c", MAIN_KILLED.format(root=root)], stdout=subprocess.PIPE, text=True
    )
    try:
        line = child.stdout.readline()
        while line and line.strip() != "ready":
            line = child.stdout.readline()
        assert line.strip() == "ready"
        workers = [int(pid) for pid in open(f"/proc/{child.pid}/task/{child.pid}/children").read().split()]
        assert workers
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        deadline = time.monotonic() + 30  # a worker notices its parent is gone within a few seconds
        while any(os.path.exists(f"/proc/{pid}") for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(os.path.exists(f"/proc/{pid}") for pid in workers)
    finally:
        if child.poll() is None:
            child.kill()
    assert not left_in_dev_shm(names)  # the slots were a memfd: gone with the last process holding it


@pytest.mark.needs_cuda
def test_on_a_gpu_batches_from_workers_cross_without_a_host_copy():
    collate = assemble.using()
    loader = DataLoader(Records(64), batch_size=8, num_workers=2, collate_fn=collate, persistent_workers=True)
    device_loader = DeviceLoader(loader, device="cuda")
    for _ in range(2):
        for batch in device_loader:
            assert batch["image"].is_cuda
    stats = device_loader.stats()
    assert stats["host_packs"] == 0 and stats["direct_from_slot"] == stats["batches"] == 16
    slots = collate.shared_slot_stats()
    # Each slot mapped and page-locked once (same-sized batches: no remap), within the default bound.
    assert slots.registrations == slots.mappings == slots.slots_used <= 2 * 2 + 4


@pytest.mark.needs_cuda
def test_on_a_gpu_pin_memory_true_pins_a_copy_not_the_slot():
    # A slot page-locked outside DeviceLoader could be rewritten by a worker while a non_blocking copy
    # still reads it (torch's pinned allocator guards only its own blocks): DataLoader pins a copy.
    torch.cuda.init()
    collate = assemble.using()
    loader = DataLoader(Records(32), batch_size=8, num_workers=2, collate_fn=collate, pin_memory=True)
    for batch in loader:
        assert batch["image"].is_pinned()
        assert _C.shared_slot_kind(batch["image"]) == NONE  # torch's pinned copy
    assert collate.shared_slot_stats().registrations == 0


def test_no_cuda_here_means_slots_are_not_page_locked():
    if CUDA:
        pytest.skip("a GPU is visible: the GPU tests cover page-locking")
    collate = assemble.using()
    list(DataLoader(Records(16), batch_size=8, num_workers=1, collate_fn=collate))
    assert collate.shared_slot_stats().registrations == 0


def test_a_slot_that_cannot_be_page_locked_is_received_pageable_on_a_mapping_of_its_own():
    if CUDA:
        pytest.skip("a GPU is visible: page-locking succeeds there (the GPU tests cover it)")
    pool = SlotPool.create(2)
    native = pool.native
    for round_index in range(2):
        buffer = claimed(native, 4096, 1)
        buffer.fill_(round_index + 1)
        token, slot, seq, nbytes, first = _C.deliver_slot_tensor(buffer)
        del buffer
        # As under DeviceLoader: page-locking asked for. Without a driver it fails; the batch still arrives.
        got = native.receive(slot, seq, nbytes, torch.uint8, 0, [nbytes], [1], 0)
        assert torch.all(got == round_index + 1) and _C.shared_slot_kind(got) == RECEIVED
        del got
    stats = native.stats()
    assert stats.registration_failures == 1 and stats.registrations == 0  # tried once, not per batch
    buffer = claimed(native, 4096, 1)
    token, slot, seq, nbytes, first = _C.deliver_slot_tensor(buffer)
    del buffer
    pageable = native.receive(slot, seq, nbytes, torch.uint8, 0, [nbytes], [1], -1)
    assert _C.shared_slot_kind(pageable) == RECEIVED
    # This process wrote the slot too: its writer's mapping, the one page-locking was tried on, and a
    # pageable one apart from it.
    assert native.stats().mappings == 3
