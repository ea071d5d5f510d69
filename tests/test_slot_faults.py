"""The shared slots under faults and limits: a batch sent twice, a message that fails to
pickle, descriptors a worker's programs would inherit, a file-size limit, an address-space limit, a file
shrunk under a batch, two threads starting workers at once. Each falls back or holds on with the right
data, leaks nothing, and says so once where the slots stop serving."""

from __future__ import annotations

import fcntl
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from torch.utils.data import DataLoader

from fastcollate import StagingRing, assemble
from fastcollate._ext import _C
from fastcollate.transfer.staging import staging_in
from fastcollate.transfer.worker_slots import SlotPool, install_reducer
from tests.helpers.fault_datasets import Numbered
from tests.helpers.worker_datasets import SlotDescriptorsInheritable, UnpicklableAt
from tests.test_shared_slots import RECEIVED, claimed, settled_stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# AddressSanitizer (make sanitize) reserves terabytes of address space for its shadow memory: an
# address-space limit cannot be set under it.
UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")
asan_reserves_address_space = pytest.mark.skipif(
    UNDER_ASAN, reason="AddressSanitizer reserves the address space an RLIMIT_AS test limits")


def run_script(script: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs ``script`` in a fresh interpreter (a limit set there stays there), with ``env`` added to the
    environment; its warnings reach stderr as a user's would."""
    code = f"import sys\nsys.path.insert(0, {ROOT!r})\n" + textwrap.dedent(script)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_a_batch_sent_twice_arrives_after_the_first_was_received_and_dropped():
    # A worker's collate that caches sends one batch in two messages. The first holds the slot until it
    # is received; the second must not name the slot (it may arrive after the slot is free again).
    install_reducer()  # this process sends slot tensors as a worker does
    pool = SlotPool.create(4)
    buffer = claimed(pool.native, 4096, 4)
    buffer.fill_(7)
    batch = {"x": buffer.view(torch.float32)}
    first_message = ForkingPickler.dumps(batch)
    second_message = ForkingPickler.dumps(batch)  # sent again, before the first is received
    first = pickle.loads(first_message)
    assert _C.shared_slot_kind(first["x"]) == RECEIVED
    del batch, buffer  # the worker drops its cache
    del first  # the user drops the first batch: the slot is free
    assert pool.native.stats().free == 4
    second = pickle.loads(second_message)
    assert _C.shared_slot_kind(second["x"]) == _C.SLOT_KIND_NONE  # a copy, sent the ordinary way
    assert torch.equal(second["x"].view(torch.uint8), torch.full((4096,), 7, dtype=torch.uint8))


def test_a_message_that_fails_to_pickle_gives_its_slot_back():
    install_reducer()
    pool = SlotPool.create(4)
    buffer = claimed(pool.native, 4096, 4)
    with pytest.raises(TypeError, match="pickle"):
        ForkingPickler.dumps({"x": buffer, "lock": threading.Lock()})  # the tensor first, then the lock
    assert "being written" in pool.native.describe_slot(0)  # not delivered: no message holds it
    del buffer
    stats = pool.native.stats()
    assert stats.free == 4 and stats.delivered == 0


def test_a_batch_a_worker_failed_to_send_leaves_no_slot_held_in_a_persistent_worker():
    collate = assemble.using()
    loader = DataLoader(Numbered(64, shape=(16,)), batch_size=8, num_workers=1, persistent_workers=True,
                        collate_fn=UnpicklableAt(collate, bad=21), timeout=3)
    with pytest.raises(RuntimeError, match="timed out"):
        list(loader)  # the queue's feeder drops the batch it cannot pickle: DataLoader waits for it
    stats = settled_stats(collate, timeout=5)
    assert stats.delivered == 0 and stats.writing == 0, stats
    assert all(_C.shared_slot_kind(b["x"]) == RECEIVED for b in DataLoader(
        Numbered(16, shape=(16,)), batch_size=8, num_workers=1, collate_fn=collate))  # the pool still serves


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_a_program_a_worker_starts_does_not_inherit_the_pool(context):
    batches = list(DataLoader(SlotDescriptorsInheritable(4), batch_size=2, num_workers=1,
                              collate_fn=assemble.using(), multiprocessing_context=context))
    assert all(_C.shared_slot_kind(b["x"]) == RECEIVED for b in batches)  # the worker held the pool
    assert [b["inheritable"].tolist() for b in batches] == [[0, 0], [0, 0]]


def test_the_pools_file_is_sealed_against_shrinking():
    pool = SlotPool.create(4)
    fd = pool.native.fd
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
    buffer = claimed(pool.native, 1 << 20, 4)
    buffer.fill_(3)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)  # what a worker, or a program holding the descriptor, could otherwise do
    assert torch.all(buffer == 3)


def test_the_file_grows_with_the_slots_in_use_not_with_the_capacity():
    pool = SlotPool.create(64)
    held = [claimed(pool.native, 1 << 20, 64) for _ in range(3)]
    stats = pool.native.stats()
    # The header page, then three regions of 1 MiB + 1/16 (not 64 x 256 GiB up front).
    assert stats.file_bytes == 4096 + 3 * ((1 << 20) + (1 << 16))
    del held
    bigger = claimed(pool.native, 2 << 20, 1)  # slot 0 outgrows its region: a new one at the end
    assert pool.native.stats().file_bytes == 4096 + 3 * ((1 << 20) + (1 << 16)) + (2 << 20) + (2 << 16)
    bigger.fill_(1)
    del bigger


def test_a_writer_keeps_few_idle_mappings():
    # Every slot stays held by its batch (delivered, never received), so each claim takes a new slot; the
    # writer's views die once sent. Only the mappings of batches it still holds, and four idle ones, stay.
    install_reducer()
    pool = SlotPool.create(16)
    token = pool.native.token
    messages = []
    for _ in range(10):
        buffer = claimed(pool.native, 64 << 10, 16)
        messages.append(ForkingPickler.dumps(buffer))
        del buffer
    inode = str(os.fstat(pool.native.fd).st_ino)
    mapped = sum(line.split()[4] == inode for line in open("/proc/self/maps"))
    # The header, four idle slot mappings and the last batch's (trimmed at the next claim); eleven before.
    assert mapped == 1 + 4 + 1, mapped
    for message in messages:  # received at last: each slot is lent, then free again
        assert pickle.loads(message).numel() == 64 << 10
    assert pool.native.stats().free == 16 and pool.native.token == token


FILE_SIZE_LIMIT = """
import resource, warnings
import torch
from torch.utils.data import DataLoader, default_collate
from fastcollate import StagingRing, assemble
from fastcollate._ext import _C
from fastcollate.transfer.staging import staging_in
from tests.helpers.fault_datasets import Numbered
from tests.test_assemble_dropin import assert_same

resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))  # the workers inherit it
dataset = Numbered(96, shape=(16384,))  # 64 KiB samples: batches of 512 KiB
collate = assemble.using()
expected = list(DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=default_collate))
in_slots = count = 0
for batch, reference in zip(DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=collate), expected):
    assert_same(batch, reference)  # each batch dropped after: the slots in use stay few
    in_slots += _C.shared_slot_kind(batch["x"]) == _C.SLOT_KIND_RECEIVED
    count += 1
assert count == len(expected) == 12
stats = collate.shared_slot_stats()
print(in_slots, stats.fresh_fallbacks, stats.file_bytes)
"""


def test_under_a_file_size_limit_the_slots_serve_and_past_it_fall_back_visibly():
    # Room for the slots in use: every batch arrives over a slot.
    roomy = run_script(FILE_SIZE_LIMIT.format(limit=32 << 20))
    assert roomy.returncode == 0, roomy.stderr
    in_slots, fallbacks, file_bytes = (int(v) for v in roomy.stdout.split())
    assert in_slots == 12 and fallbacks == 0 and file_bytes <= 32 << 20
    assert "fastcollate" not in roomy.stderr
    # Room for two slots only: the same batches as default_collate, the rest in fresh shared memory, said
    # once per worker with the cause and the fix.
    tight = run_script(FILE_SIZE_LIMIT.format(limit=(1 << 20) + (1 << 19)))
    assert tight.returncode == 0, tight.stderr
    in_slots, fallbacks, file_bytes = (int(v) for v in tight.stdout.split())
    assert in_slots >= 1 and fallbacks >= 1 and in_slots + fallbacks == 12
    assert 1 <= tight.stderr.count("RuntimeWarning: fastcollate: a shared slot could not serve") <= 2
    assert "a file-size limit, ulimit -f" in tight.stderr


ADDRESS_SPACE_LIMIT = """
import resource
import torch
from torch.utils.data import DataLoader, default_collate
from fastcollate import assemble
from tests.helpers.fault_datasets import Numbered
from tests.test_assemble_dropin import assert_same

def limit_address_space(worker_id):
    # What the worker has mapped now, plus room for a few batches in flight.
    size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + {headroom}, resource.RLIM_INFINITY))

dataset = Numbered(12 * 4, shape=(1 << 20,))  # 4 MiB samples: batches of 16 MiB, every one kept
for collate in (default_collate, assemble.using(max_shared_slots=12)):
    kept = list(DataLoader(dataset, batch_size=4, num_workers=1, collate_fn=collate,
                           worker_init_fn=limit_address_space, timeout=60))
    if collate is default_collate:
        expected = kept
        print("default_collate:", len(expected), flush=True)
print("assemble:", len(kept))
for batch, reference in zip(kept, expected):
    assert_same(batch, reference)
"""


@asan_reserves_address_space
def test_under_an_address_space_limit_kept_batches_arrive_as_with_default_collate():
    # Twelve slots, each kept by the consumer. Measured on a 2-core machine: default_collate needs 100-140 MiB
    # of room here; a worker that kept a mapping of every slot it had written failed at 140, 180 and
    # 220 after 5, 7 and 9 batches, so 180 MiB catches that leak. One malloc arena: glibc's per-thread arenas
    # reserve 64 MiB of address space each, at moments that vary run to run.
    done = run_script(ADDRESS_SPACE_LIMIT.format(headroom=180 << 20), timeout=180,
                      env={"MALLOC_ARENA_MAX": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["default_collate:", "12", "assemble:", "12"]


MAPPING_FAILS = """
import resource, warnings
from fastcollate.transfer.worker_slots import SlotPool

pool = SlotPool.create(4)
size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + (16 << 20), resource.RLIM_INFINITY))
for _ in range(2):
    assert pool.claim(64 << 20, None) is None  # no room to map a 64 MiB slot: the batch falls back
stats = pool.native.stats()
print(stats.free, stats.fresh_fallbacks)
"""


@asan_reserves_address_space
def test_a_slot_that_cannot_be_mapped_falls_back_once_said():
    done = run_script(MAPPING_FAILS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["4", "2"]  # the slot given back, both batches counted
    said = "RuntimeWarning: fastcollate: a shared slot could not serve: mapping a slot"
    assert done.stderr.count(said) == 1
    assert "the address space is short, ulimit -v" in done.stderr


def test_two_threads_starting_workers_at_once_share_one_pool(monkeypatch):
    create = SlotPool.create.__func__

    def slow_create(cls, capacity):
        time.sleep(0.3)  # widens the window in which a second thread would make a second pool
        return create(cls, capacity)

    monkeypatch.setattr(SlotPool, "create", classmethod(slow_create))
    collate = assemble.using()
    results: dict[int, object] = {}
    start = threading.Barrier(2)

    def run(index: int) -> None:
        try:
            start.wait()
            batches = list(DataLoader(Numbered(32), batch_size=8, num_workers=1, collate_fn=collate))
            results[index] = sorted(i for b in batches for i in b["id"].tolist())
        except Exception as error:  # noqa: BLE001 - the thread's failure is the test's
            results[index] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results == {0: list(range(32)), 1: list(range(32))}


def test_a_slot_that_cannot_be_page_locked_is_said_once(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: page-locking succeeds there")
    from fastcollate.transfer import worker_slots

    monkeypatch.setattr(worker_slots, "_pin_device", lambda: 0)  # as under DeviceLoader, whose ring is active
    monkeypatch.setattr(worker_slots, "_warned", set())
    pool = SlotPool.create(2)
    ring = StagingRing()
    with staging_in(ring), pytest.warns(RuntimeWarning, match="could not be page-locked") as caught:
        for _ in range(3):
            buffer = claimed(pool.native, 4096, 1)
            token, slot, seq, nbytes, _ = _C.deliver_slot_tensor(buffer)
            del buffer
            received = worker_slots._receive(token, slot, seq, nbytes, torch.uint8, 0, (nbytes,), (1,))
            assert _C.shared_slot_kind(received) == RECEIVED  # received all the same, pageable
            del received
    assert len([w for w in caught if "page-locked" in str(w.message)]) == 1
    # Pageable, so no hazard: not counted for DeviceLoader, which searches batches for uncounted ones.
    assert ring.views_handed_out == 0


def test_a_batch_over_a_slot_is_not_shared_memory_and_share_memory_copies_it_out():
    collate = assemble.using()
    batch = next(iter(DataLoader(Numbered(8, shape=(64,)), batch_size=8, num_workers=1, collate_fn=collate)))
    x = batch["x"]
    assert _C.shared_slot_kind(x) == RECEIVED and not x.is_shared()  # the pinned behaviour (README: Limits)
    expected = x.clone()
    assert collate.shared_slot_stats().lent == 1
    x.share_memory_()  # torch copies it into fresh shared memory: the slot is no longer used
    assert x.is_shared() and _C.shared_slot_kind(x) == _C.SLOT_KIND_NONE and torch.equal(x, expected)
    del batch, x
    assert settled_stats(collate).lent == 0


class _Subclass(torch.Tensor):
    """A tensor subclass (as torchvision's tv_tensors.Image is): torch's own reducer pickles it, and moves
    its storage to fresh shared memory on the way."""


def test_a_failed_message_gives_its_slot_back_after_torch_moved_the_storage_out():
    install_reducer()
    pool = SlotPool.create(4)
    buffer = claimed(pool.native, 4096, 4)
    with pytest.raises(TypeError, match="pickle"):
        ForkingPickler.dumps({"x": buffer, "sub": buffer.as_subclass(_Subclass), "lock": threading.Lock()})
    del buffer
    stats = pool.native.stats()
    assert stats.free == 4 and stats.delivered == 0, stats


def test_a_conjugate_view_of_a_small_field_crosses_by_value():
    install_reducer()
    pool = SlotPool.create(4)
    buffer = claimed(pool.native, 2 << 20, 4)  # a large batch: its small fields cross by value
    values = buffer[:64].view(torch.complex64)
    values.copy_(torch.full((8,), 1 + 2j, dtype=torch.complex64))
    conjugate = values.conj()  # a view with the conjugate bit: no plain bytes to send as they are
    got = pickle.loads(ForkingPickler.dumps(conjugate))
    assert torch.equal(got, torch.full((8,), 1 - 2j, dtype=torch.complex64))
    assert got.untyped_storage().nbytes() == got.nbytes  # its own storage


class _Filled(torch.utils.data.Dataset):
    """4 samples of 1 MiB, each full of its index + 1."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        return {"x": torch.full((1 << 20,), index + 1, dtype=torch.uint8)}


class _ReadsAKeptBatch(torch.utils.data.Dataset):
    """Reads a batch it was given (a replay buffer's, say) in its worker, after the main process let go."""

    kept = None

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        time.sleep(0.3)  # the main process drops its reference, and the slot is written again, meanwhile
        values = self.kept["x"].unique().tolist()
        return {"seen": torch.tensor((values + [0, 0, 0, 0])[:4]),
                "pad": torch.full((1 << 20,), 200, dtype=torch.uint8)}


def test_a_batch_a_forked_worker_inherited_keeps_its_data_after_the_main_process_drops_it():
    collate = assemble.using()
    iterator = iter(DataLoader(_Filled(), batch_size=1, num_workers=1, collate_fn=collate))
    kept = next(iterator)  # all ones, over a slot
    del iterator
    dataset = _ReadsAKeptBatch()
    dataset.kept = kept
    # The worker forks now and inherits the kept batch.
    iterator = iter(DataLoader(dataset, batch_size=1, num_workers=1, collate_fn=collate))
    dataset.kept = None
    del kept  # the slot is free: the new worker writes its batches there
    seen = [next(iterator)["seen"][0].tolist() for _ in range(4)]
    assert seen == [[1, 0, 0, 0]] * 4  # the inherited batch, as default_collate's shared memory keeps it
