"""DeviceLoader: the iteration contract (on the CPU here), and on a GPU the copy, overlap and lifetimes."""

import gc
import subprocess
import sys
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, default_collate

from fastcollate import _C, Assembler, ContractError, DeviceLoader, Normalize, StagingRing, assemble
from fastcollate.structure import tree
from fastcollate.transfer.device_loader import device_fields
from fastcollate.transfer.hidden_tensors import copy_out_hidden, tensors_inside
from fastcollate.transfer.small_fields import LARGE_BATCH_BYTES, SMALL_FIELD_BYTES
from tests.conftest import CUDA
from tests.helpers.worker_datasets import BadFourth, Records
from tests.test_assemble_dropin import assert_same
from tests.test_faults import run_until_error
from tests.test_shared_slots import claimed


def loader(n=40, batch_size=8, **kwargs):
    kwargs.setdefault("collate_fn", assemble)
    return DataLoader(Records(n), batch_size=batch_size, **kwargs)


def test_cpu_device_passes_batches_through_unchanged():
    expected = list(loader(collate_fn=default_collate))
    got = list(DeviceLoader(loader(), device="cpu"))
    assert len(got) == len(expected) == 5
    for a, b in zip(got, expected, strict=True):
        assert_same(a, b)


def test_len_reiteration_and_exhaustion():
    device_loader = DeviceLoader(loader(n=20), device="cpu", depth=3)
    assert len(device_loader) == 3
    first = [b["id"].tolist() for b in device_loader]
    second = [b["id"].tolist() for b in device_loader]
    assert first == second == [list(range(0, 8)), list(range(8, 16)), list(range(16, 20))]
    iterator = iter(device_loader)
    for _ in range(3):
        next(iterator)
    for _ in range(2):  # exhausted stays exhausted
        with pytest.raises(StopIteration):
            next(iterator)


def test_an_iterable_without_len_has_no_len():
    device_loader = DeviceLoader(iter([{"a": torch.zeros(2)}]), device="cpu")
    with pytest.raises(TypeError):
        len(device_loader)


def test_the_wrapped_loaders_attributes_read_through():
    dataset = Records(10)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=0)
    source = DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=0, collate_fn=assemble)
    device_loader = DeviceLoader(source, device="cpu")
    assert device_loader.dataset is dataset
    assert device_loader.sampler is sampler
    assert device_loader.batch_sampler is source.batch_sampler
    assert (device_loader.batch_size, device_loader.num_workers) == (2, 0)
    assert len(device_loader) == len(source) == 3  # 5 of the 10 ids on this rank, 2 a batch


def test_a_loader_without_the_attribute_says_so_and_getattr_defaults_still_work():
    device_loader = DeviceLoader([{"a": torch.zeros(2)}], device="cpu")
    with pytest.raises(AttributeError, match=r"DeviceLoader: the wrapped loader \(list\) has no 'sampler'"):
        device_loader.sampler  # noqa: B018
    assert getattr(device_loader, "batch_sampler", None) is None  # what Lightning's hooks ask
    device_loader.set_epoch(3)  # nothing to tell: no error


def distributed_ids(device_loader, epoch):
    device_loader.set_epoch(epoch)
    return [i for batch in device_loader for i in batch["id"].tolist()]


def test_set_epoch_reaches_the_distributed_sampler():
    dataset = Records(16)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=0)
    device_loader = DeviceLoader(DataLoader(dataset, batch_size=3, sampler=sampler, collate_fn=assemble),
                                 device="cpu")
    epochs = [distributed_ids(device_loader, epoch) for epoch in (0, 1, 0)]
    expected = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=0)
    expected.set_epoch(1)
    assert epochs[1] == list(expected)
    assert epochs[0] == epochs[2] != epochs[1]  # the order follows the epoch, and only the epoch


class CountingSampler(DistributedSampler):
    calls = 0

    def set_epoch(self, epoch):
        CountingSampler.calls += 1
        super().set_epoch(epoch)


def test_set_epoch_reaches_a_batch_samplers_sampler_once_and_a_loaders_own():
    dataset = Records(16)
    sampler = CountingSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=0)
    batch_sampler = BatchSampler(sampler, 4, drop_last=False)
    batches = DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=assemble)
    assert not hasattr(batches.sampler, "set_epoch")  # DataLoader's own SequentialSampler
    device_loader = DeviceLoader(batches, device="cpu")
    CountingSampler.calls = 0
    device_loader.set_epoch(2)
    assert (CountingSampler.calls, sampler.epoch) == (1, 2)
    outer = DeviceLoader(device_loader, device="cpu")  # a loader with set_epoch of its own is told itself
    outer.set_epoch(5)
    assert (CountingSampler.calls, sampler.epoch) == (2, 5)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loaders_error_arrives_unchanged_after_the_batches_before_it(workers):
    source = DataLoader(BadFourth(24), batch_size=2, num_workers=workers, collate_fn=assemble)
    delivered: list = []
    error = run_until_error(DeviceLoader(source, device="cpu", depth=2), delivered)
    assert [batch["id"].tolist() for batch in delivered] == [[0, 1]]  # sample 3 is in the second batch
    assert isinstance(error, ContractError) and error.sample_id == 3 and error.field == "image"


def test_close_and_context_manager():
    with DeviceLoader(loader(), device="cpu") as device_loader:
        next(iter(device_loader))
    with pytest.raises(RuntimeError, match="after close"):
        iter(device_loader)
    device_loader.close()  # closing twice is harmless


def test_persistent_workers_and_a_second_epoch():
    source = loader(num_workers=2, persistent_workers=True)
    device_loader = DeviceLoader(source, device="cpu")
    epochs = [[i for b in device_loader for i in b["id"].tolist()] for _ in range(2)]
    assert epochs[0] == epochs[1] == list(range(40))


def test_transforms_run_after_the_copy():
    normalize = Normalize(mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), dtype=torch.float16)
    for batch, raw in zip(DeviceLoader(loader(), device="cpu", transforms={"image": normalize}),
                          loader(collate_fn=default_collate), strict=True):
        assert batch["image"].dtype == torch.float16
        torch.testing.assert_close(batch["image"].float(), (raw["image"].float() / 255 - 0.5) / 0.25,
                                   atol=2e-3, rtol=2e-3)
        assert batch["name"] == raw["name"]


def test_transform_errors_are_clear():
    with pytest.raises(KeyError, match="pixels"):
        next(iter(DeviceLoader(loader(), device="cpu", transforms={"pixels": lambda x: x})))
    tuples = [(torch.zeros(2), 1)]
    with pytest.raises(TypeError, match="mapping"):
        next(iter(DeviceLoader(tuples, device="cpu", transforms={"x": lambda x: x})))
    with pytest.raises(TypeError, match="uint8"):
        Normalize((0.5,), (0.5,))(torch.zeros(1, 1, 2, 2))
    with pytest.raises(ValueError):
        Normalize((0.5, 0.5), (0.5,))


def test_bad_arguments():
    with pytest.raises(ValueError):
        DeviceLoader([], device="cpu", depth=0)
    with pytest.raises(ValueError):
        DeviceLoader([], device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            DeviceLoader([], device="cuda")


def test_profiler_sees_batch_wait_and_h2d_transfer():
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in DeviceLoader(loader(n=16), device="cpu"):
            pass
    names = {event.name for event in prof.events()}
    assert {"batch_wait", "h2d_transfer"} <= names


def test_pack_puts_tensors_at_aligned_offsets_in_one_slot():
    ring = StagingRing(max_slots=2)
    tensors = [torch.arange(5, dtype=torch.int16), torch.randn(3, 4).t(),
               torch.tensor(2.5, dtype=torch.float64)]
    buffer, offsets = ring.pack(tensors)
    assert ring.owns(buffer) and all(offset % 64 == 0 for offset in offsets)
    for tensor, offset in zip(tensors, offsets, strict=True):
        view = buffer[offset: offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        assert torch.equal(view, tensor)
    assert not ring.owns(torch.zeros(3))


# ---- Lifetimes DeviceLoader guards, on the CPU (a CompletionFlag or a ring stands in for CUDA) ------


@dataclass
class Wrapped:
    """A custom batch class: one leaf to tree.flatten, so DeviceLoader does not move what it holds."""

    images: torch.Tensor
    meta: dict


class Slotted:
    __slots__ = ("pair",)

    def __init__(self, pair):
        self.pair = pair


def samples(n, side=16, value=0):
    return [{"id": i, "image": torch.full((3, side, side), value + i, dtype=torch.uint8)} for i in range(n)]


def test_tensors_inside_a_custom_leaf_are_found_and_the_program_is_not_searched():
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    leaf = Wrapped(images=a, meta={"nested": [Slotted((b, "x")), {"c": c}], "fn": print, "mod": torch,
                                   "cls": Wrapped})
    found = tensors_inside(leaf)
    assert sorted(id(t) for t in found) == sorted(id(t) for t in (a, b, c))
    assert tensors_inside("a name") == [] and tensors_inside(types) == []


def test_a_tensor_hidden_in_a_custom_leaf_leaves_the_page_locked_slot():
    # A worker-side wrapper returns a dataclass; its tensors reach the user as they
    # are. Over a slot DeviceLoader recycles, the user's .to("cuda", non_blocking=True) could still be
    # reading it by DMA when the slot gets the next batch. A pageable ring stands in for DeviceLoader's
    # pinned one (a worker's page-locked shared slot is recycled the same way), and a CompletionFlag for
    # the CUDA event after DeviceLoader's own copy.
    ring = StagingRing(max_slots=1)
    batch = assemble.using(ring=ring)(samples(4, value=3))
    hidden = Wrapped(images=batch["image"], meta={"ids": [batch["id"]]})
    leaves, _ = tree.flatten({"wrapped": hidden, "name": "kept", "count": 4})
    slot = torch.empty(0, dtype=torch.uint8).set_(batch["image"].untyped_storage())
    copy = _C.CompletionFlag()
    assert ring.hold_until_flag_set(slot, copy)  # DeviceLoader's copy of the fields it found

    assert copy_out_hidden(leaves, ring.owns) == 2
    assert not ring.owns(hidden.images) and not ring.owns(hidden.meta["ids"][0])
    assert torch.equal(hidden.images[:, 0, 0, 0], torch.arange(3, 7, dtype=torch.uint8))
    assert hidden.meta["ids"][0].tolist() == [0, 1, 2, 3]

    del batch, slot, leaves
    assert ring.stats().in_use == 1  # only DeviceLoader's own copy holds the slot now
    copy.set()
    assert ring.stats().in_use == 0  # the user's batch does not: the slot is recycled...
    assemble.using(ring=ring)(samples(4, value=100))
    assert ring.stats().reuses == 1
    assert hidden.images[0, 0, 0, 0].item() == 3  # ...and what the user holds is not overwritten


def test_a_leaf_without_tensors_over_recycled_memory_is_left_as_it_is():
    kept = torch.arange(4)
    leaves = ["name", 3, None, Wrapped(images=kept, meta={})]
    assert copy_out_hidden(leaves, lambda tensor: False) == 0
    assert leaves[3].images is kept and leaves[3].images.data_ptr() == kept.data_ptr()


def test_small_fields_of_a_large_batch_get_storage_of_their_own():
    # The device side of item 7: after the one copy, ids and labels are cloned out of the batch's
    # buffer, so keeping them does not keep the images. A pageable ring slot stands in for the device
    # buffer; its in_use says whether anything still references it.
    images = torch.randint(0, 256, (32, 3, 128, 128), dtype=torch.uint8)  # 1.5 MiB: a large batch
    ids, labels = torch.arange(32), torch.arange(32) % 10
    host = [images, ids, labels]
    packed, offsets = StagingRing(max_slots=1).pack(host)
    nbytes = max(offset + t.nbytes for t, offset in zip(host, offsets, strict=True))
    assert nbytes >= LARGE_BATCH_BYTES and ids.nbytes <= SMALL_FIELD_BYTES < images.nbytes
    device = StagingRing(max_slots=1)
    device_bytes = device.acquire(nbytes)
    device_bytes.copy_(packed[:nbytes])
    fields, clones = device_fields(device_bytes, host, offsets)
    assert all(torch.equal(got, want) for got, want in zip(fields, host, strict=True))
    assert [id(t) for t in clones] == [id(fields[1]), id(fields[2])]
    assert device.owns(fields[0]) and not device.owns(fields[1]) and not device.owns(fields[2])
    kept = fields[1:]
    del fields, clones, device_bytes
    assert device.stats().in_use == 0  # the kept ids and labels do not hold the batch's buffer
    assert kept[0].tolist() == list(range(32))

    small = [images[:2].contiguous(), ids[:2]]  # a small batch: its fields stay views
    packed, offsets = StagingRing(max_slots=1).pack(small)
    fields, clones = device_fields(packed, small, offsets)
    assert clones == [] and all(f.untyped_storage().data_ptr() == packed.data_ptr() for f in fields)


class FlagEvent:
    """Stands in for the CUDA event DeviceLoader records after a copy: done once the flag is set."""

    def __init__(self) -> None:
        self.flag = _C.CompletionFlag()

    def query(self) -> bool:
        return self.flag.is_set()

    def synchronize(self) -> None:
        while not self.flag.is_set():
            time.sleep(0.001)


def test_a_device_loader_dropped_without_close_frees_a_shared_slot_only_after_its_copy():
    # DeviceLoader keeps a worker's shared slot (its received batch) until the copy
    # reading it has run. Dropped without close(), it must still wait, or the slot is free at once and a
    # sibling loader's worker may write there while the DMA reads it.
    pool = _C.SharedSlots.create(2)
    written = claimed(pool, 4096, 2)
    written.fill_(5)
    token, slot, seq, nbytes, _ = _C.deliver_slot_tensor(written)
    received = pool.receive(slot, seq, nbytes, torch.uint8, 0, [4096], [1], -1)
    del written
    device_loader = DeviceLoader([], device="cpu")
    copied = FlagEvent()
    device_loader._unpooled.append((copied, received))  # as _stage keeps a slot while its copy runs
    del received
    lent_when_the_copy_ended = []

    def copy_ends():
        lent_when_the_copy_ended.append(pool.stats().lent)
        copied.flag.set()

    finisher = threading.Timer(0.3, copy_ends)
    finisher.start()
    started = time.monotonic()
    del device_loader
    waited = time.monotonic() - started
    finisher.join()
    assert lent_when_the_copy_ended == [1], "the slot was freed before the copy reading it ended"
    assert waited >= 0.25
    stats = pool.stats()
    assert stats.lent == 0 and stats.free == 2


def test_close_waits_for_nothing_more_and_detaches_the_wait():
    device_loader = DeviceLoader([], device="cpu")
    done = FlagEvent()
    done.flag.set()
    device_loader._unpooled.append((done, torch.zeros(1)))
    device_loader.close()
    assert device_loader.stats()["unpooled_in_flight"] == 0 and not device_loader._finalizer.alive


# ---- On a GPU -------------------------------------------------------------------------------------

needs_cuda = pytest.mark.needs_cuda


def checksum(batch):
    return (batch["id"].double() * 1000003 + batch["image"].double().flatten(1).sum(1)).sum().item()


@needs_cuda
@pytest.mark.parametrize("workers", [0, 2])
def test_every_batch_arrives_intact_under_stress(workers):
    # Many small copies racing long kernels: each device batch must equal its host twin exactly.
    source = DataLoader(Records(2048), batch_size=4, num_workers=workers, collate_fn=assemble)
    reference = DataLoader(Records(2048), batch_size=4, collate_fn=default_collate)
    busy = torch.randn(2048, 2048, device="cuda")
    for batch, host in zip(DeviceLoader(source, depth=3), reference, strict=True):
        busy = busy @ busy  # long kernel on the consumer stream
        busy = busy / busy.norm()
        assert batch["image"].is_cuda and batch["name"] == host["name"]
        assert checksum({k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}) == checksum(host)


@needs_cuda
def test_no_slot_is_reused_while_its_copy_is_pending():
    ring = StagingRing(max_slots=1, pinned=True)
    stream = torch.cuda.Stream()
    first = ring.acquire(1 << 20)
    first.fill_(7)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # the DMA starts late: the slot is still to be read
        on_device = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        on_device.copy_(first, non_blocking=True)
    assert ring.hold_until_stream_done(first, stream)
    del first  # nothing references the slot any more, but its copy has not run
    second = ring.acquire(1 << 20)  # the only slot: it must wait for the copy, not hand it out now
    second.fill_(9)
    torch.cuda.synchronize()
    assert ring.stats().waits_for_copies == 1 and ring.stats().overflow_allocations == 0
    assert int(on_device.min()) == int(on_device.max()) == 7


@needs_cuda
def test_no_pinned_allocation_after_warm_up_and_pinned_bytes_bounded():
    device_loader = DeviceLoader(loader(n=256, batch_size=32), depth=2)
    iterator = iter(device_loader)
    for _ in range(3):
        next(iterator)
    warm = device_loader.stats()["pinned_allocations"]
    for _ in iterator:
        pass
    stats = device_loader.stats()
    assert stats["pinned_allocations"] == warm
    batch_bytes = 32 * (3 * 8 * 8 + 64 * 4)  # an upper bound of one packed batch, fields aligned
    assert stats["pinned_bytes"] <= device_loader.depth * batch_bytes


@needs_cuda
def test_device_memory_is_flat_across_epochs():
    device_loader = DeviceLoader(loader(n=256, batch_size=32), depth=2)
    allocated = []
    for _ in range(5):
        for batch in device_loader:
            del batch
        torch.cuda.synchronize()
        gc.collect()
        allocated.append(torch.cuda.memory_allocated())
    assert allocated[-1] <= allocated[1]


@needs_cuda
def test_copies_overlap_compute():
    source = DataLoader(Records(256), batch_size=32, collate_fn=assemble)
    device_loader = DeviceLoader(source, depth=2, record_copy_events=True)
    compute = []
    weights = torch.randn(4096, 4096, device="cuda")
    for _batch in device_loader:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(4):
            weights = torch.tanh(weights @ weights)
        end.record()
        compute.append((start, end))
    torch.cuda.synchronize()
    origin = compute[0][0]
    copies = [(origin.elapsed_time(s), origin.elapsed_time(e)) for s, e in device_loader.copy_events]
    kernels = [(origin.elapsed_time(s), origin.elapsed_time(e)) for s, e in compute]
    inside = sum(any(ks <= cs and ce <= ke for ks, ke in kernels) for cs, ce in copies[2:])
    assert inside >= len(copies[2:]) // 2


@needs_cuda
def test_default_collate_batches_are_staged_too():
    expected = list(loader(collate_fn=default_collate))
    device_loader = DeviceLoader(loader(collate_fn=default_collate, num_workers=2))
    for a, b in zip(device_loader, expected, strict=True):
        assert torch.equal(a["image"].cpu(), b["image"]) and a["name"] == b["name"]
    assert device_loader.stats()["host_packs"] == len(expected)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("shape, misaligned", [((4, 3, 16, 16), False),  # 4 pixels a thread, vector load
                                               ((5, 3, 15, 17), False),  # a plane of 255 pixels: scalar tail
                                               ((2, 3, 16, 16), True),   # input off a 4-byte boundary
                                               ((3, 1, 64, 2050), False)])  # a plane of several blocks
def test_normalize_on_the_gpu_matches_the_cpu(dtype, channels_last, shape, misaligned):
    count = torch.Size(shape).numel()
    flat = torch.randint(0, 256, (count + 1,), dtype=torch.uint8)
    images = (flat[1:] if misaligned else flat[:count]).view(shape)
    channels = shape[1]
    normalize = Normalize((0.485, 0.456, 0.406)[:channels], (0.229, 0.224, 0.225)[:channels], dtype=dtype,
                          channels_last=channels_last)
    on_gpu = images.cuda() if not misaligned else flat.cuda()[1:].view(shape)
    assert (on_gpu.data_ptr() % 4 != 0) == misaligned
    got = normalize(on_gpu)
    assert got.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    tolerance = 2e-3 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu(), normalize(images), atol=tolerance, rtol=tolerance)


class Constant(torch.utils.data.Dataset):
    """Sample i: its id and a 3 x side x side uint8 image filled with i % 251 (sums say which sample)."""

    def __init__(self, n: int, side: int) -> None:
        self.n, self.side = n, side

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        return {"id": index, "image": torch.full((3, self.side, self.side), index % 251, dtype=torch.uint8)}


SLEEP_CYCLES = 50_000_000  # about 25 ms of GPU time: far longer than collating the next batch


def lag_then_add_one(images):
    """A transform that runs late on the copy stream: the next batch's copy queues behind it, and its
    own output is written only after the sleep."""
    torch.cuda._sleep(SLEEP_CYCLES)
    return images + 1


def read_at_once(device_loader, lag_consumer: bool):
    """Per-sample image sums and ids, computed on the consumer's stream as each batch arrives (no
    synchronisation), then brought back once everything ran."""
    sums, ids = [], []
    for batch in device_loader:
        if lag_consumer:
            torch.cuda._sleep(SLEEP_CYCLES)  # the reads below run late on the consumer's stream
        images = batch["image"]
        sums.append(images.reshape(images.shape[0], -1).sum(1))
        ids.append(batch["id"].clone())  # a copy: a view would keep the batch's device memory alive
        del batch, images
    torch.cuda.synchronize()
    return torch.cat(sums).cpu(), torch.cat(ids).cpu()


@needs_cuda
@pytest.mark.parametrize("lagging", ["copy_stream", "consumer"])
def test_batches_stay_intact_when_the_copy_stream_or_the_consumer_lags(lagging):
    """Fails without any one of DeviceLoader's three guards:
    - the consumer's wait on the batch's event: the consumer would read the transform's output before
      it is written (copy stream lagging);
    - the slot's hold until its copy ran: the next batch would be collated into the one slot while the
      copy behind the lagging transform still has to read it (copy stream lagging);
    - record_stream: the allocator would give a dropped batch's device memory to the next copy while the
      lagging consumer's reads of it are still queued (consumer lagging)."""
    side, n = 128, 24 * 16  # 24 batches of 16 x 48 KiB
    source = DataLoader(Constant(n, side), batch_size=16, collate_fn=assemble)
    transforms = {"image": lag_then_add_one} if lagging == "copy_stream" else None
    device_loader = DeviceLoader(source, depth=1, transforms=transforms)
    sums, ids = read_at_once(device_loader, lag_consumer=lagging == "consumer")
    assert ids.tolist() == list(range(n))
    added = 1 if lagging == "copy_stream" else 0
    assert torch.equal(sums, (ids % 251 + added) * 3 * side * side)


# Timing of the shared-slot guard test below, in ms. Its reasoning needs
#   COPY_LAG < STEP < WORKER < STEP + COPY_LAG  and  WORKER < 2 * STEP,
# each with 40 ms to spare.
STEP_MS, WORKER_MS, COPY_LAG_MS = 120, 160, 80


class PacedConstant(Constant):
    """Constant, where the first sample of each batch of 16 takes WORKER_MS: a worker's batch is written
    into a slot WORKER_MS after DataLoader sent it the batch's indices."""

    def __getitem__(self, index: int) -> dict:
        if index % 16 == 0:
            time.sleep(WORKER_MS / 1e3)
        return super().__getitem__(index)


def sleep_cycles(ms: float) -> int:
    """The torch.cuda._sleep argument that keeps a stream busy for about ``ms`` on this GPU (clock rates
    differ between GPUs, so measured rather than assumed)."""
    torch.cuda._sleep(1_000_000)  # the first launch pays for loading the kernel
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return int(ms * 20_000_000 / start.elapsed_time(end))


@needs_cuda
def test_a_workers_shared_slot_is_kept_until_its_copy_ran():
    """The guard that keeps a worker's shared slot until DeviceLoader's copy of it has run
    (DeviceLoader._unpooled), with every batch from one of two slots (max_shared_slots=2, 2 workers,
    prefetch_factor=1: two batches in flight). Cannot run without a GPU; reasoned here.

    Each step of the loop below: (1) it queues a sleep of COPY_LAG on DeviceLoader's copy stream; (2)
    next() releases the slots whose copies ran, receives batch j (DataLoader then sends batch j+2's
    indices to the worker that wrote j), and queues j's copy behind the sleep: the copy reads j's slot
    from COPY_LAG after the step began; (3) the next step starts STEP after next() returned. A worker
    writes batch j+2 into the lowest free slot WORKER after the step that received j.

    With the guard: batch j's slot is held until the first step after its copy ran, step j+1
    (COPY_LAG < STEP), so when batch j+2 is written (WORKER > STEP) only batch j+1's slot is held, and
    the other one is free: every batch comes from a slot, none from fresh shared memory.

    Without it (a received batch's slot freed as soon as its copy is queued), both slots are free when
    batch j+2 is written, STEP + (WORKER - STEP) after j was received, and the lowest one is taken:
    the one of batch j+1 (each batch takes it), whose copy reads it until STEP + COPY_LAG > WORKER
    after j was received. So batch j+1 arrives on the device with batch j+2's bytes, and the sums below
    fail for most batches.

    The first two batches are written at once, into both slots: the release in (2) frees both (their
    copies ran in the first step) before the next two are written."""
    side, batch_size, batches = 128, 16, 20
    collate = Assembler(max_shared_slots=2)
    source = DataLoader(PacedConstant(batch_size * batches, side), batch_size=batch_size, num_workers=2,
                        prefetch_factor=1, collate_fn=collate)
    device_loader = DeviceLoader(source, depth=1)
    lag = sleep_cycles(COPY_LAG_MS)
    sums, ids = [], []
    iterator = iter(device_loader)
    while True:
        with torch.cuda.stream(device_loader._copy_stream):
            torch.cuda._sleep(lag)  # the copy next() queues reads its slot COPY_LAG_MS from now
        try:
            batch = next(iterator)
        except StopIteration:
            break
        returned = time.monotonic()
        images = batch["image"]
        sums.append(images.reshape(images.shape[0], -1).sum(1))
        ids.append(batch["id"].clone())
        del batch, images
        time.sleep(max(0.0, STEP_MS / 1e3 - (time.monotonic() - returned)))
    torch.cuda.synchronize()
    stats, slots = device_loader.stats(), collate.shared_slot_stats()
    assert stats["direct_from_slot"] == stats["batches"] == batches and slots.fresh_fallbacks == 0, (
        f"not every batch came from a shared slot ({stats}; {slots}): the timing this test relies on "
        "did not hold, so it did not test the guard")
    ids = torch.cat(ids).cpu()
    assert ids.tolist() == list(range(batch_size * batches))
    assert torch.equal(torch.cat(sums).cpu(), (ids % 251) * 3 * side * side), \
        "a batch reached the device with bytes a worker wrote into its slot while its copy was pending"
    # Page-locked now: the two slots, each mapped with 1/16 headroom (the bound (2w+4) x batch bytes
    # with the default max_shared_slots; 2 x here).
    batch_bytes = batch_size * (3 * side * side + 8)
    assert slots.slots_used == 2 and 0 < slots.registered_bytes <= 2 * (batch_bytes * 17 // 16 + 2 * 4096)
    device_loader.close()


class Labelled(Constant):
    def __getitem__(self, index: int) -> dict:
        return {**super().__getitem__(index), "label": index % 10}


@needs_cuda
@pytest.mark.parametrize("workers", [0, 2])
def test_ids_and_labels_kept_for_an_epoch_hold_only_their_own_device_memory(workers):
    # Were a batch's small fields views of its one device copy, keeping the ids and labels (for
    # metrics) would keep every batch's images on the device too.
    side, batch_size, batches = 128, 32, 12  # 1.5 MiB a batch: ids and labels are small fields of it
    source = DataLoader(Labelled(batch_size * batches, side), batch_size=batch_size, num_workers=workers,
                        collate_fn=assemble.using())
    device_loader = DeviceLoader(source, depth=2)
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    kept = []
    for batch in device_loader:
        kept += [batch["id"], batch["label"]]
        assert batch["image"].is_cuda and batch["id"].is_cuda
        del batch
    torch.cuda.synchronize()
    gc.collect()
    held = torch.cuda.memory_allocated() - before
    own = sum((t.nbytes + 511) // 512 * 512 for t in kept)  # the caching allocator rounds to 512 bytes
    assert held <= own, f"{len(kept)} ids and labels ({own} bytes, rounded) hold {held} bytes on the device"
    stats = device_loader.stats()
    # At workers=0 they are cloned out of the one copy; from workers they arrive by value beside the
    # slot and cross as their own small copies, while the images still cross from the slot in one.
    assert stats["small_field_clones"] + stats["small_fields_apart"] == len(kept)
    assert stats["host_packs"] == 0 and stats["direct_from_slot"] == batches
    assert torch.equal(torch.cat(kept[::2]).cpu(), torch.arange(batch_size * batches))
    device_loader.close()


def collate_into_a_custom_leaf(samples):
    """A worker-side wrapper: the batch's images, and a custom object holding a view of them and the ids."""
    batch = assemble(samples)
    return {"image": batch["image"], "extra": Wrapped(images=batch["image"][:2], meta={"ids": batch["id"]})}


@needs_cuda
@pytest.mark.parametrize("workers", [0, 2])
def test_tensors_in_a_custom_leaf_never_reach_the_user_page_locked(workers):
    # Over a recycled page-locked slot, the user's own non_blocking copy of them could still be reading
    # when the slot gets the next batch.
    source = DataLoader(Constant(64, 32), batch_size=8, num_workers=workers,
                        collate_fn=collate_into_a_custom_leaf)
    device_loader = DeviceLoader(source, depth=2)
    count = 0
    for batch in device_loader:
        extra = batch["extra"]
        assert batch["image"].is_cuda and not extra.images.is_cuda
        for tensor in (extra.images, extra.meta["ids"]):
            assert not tensor.is_pinned() and _C.shared_slot_kind(tensor) == _C.SLOT_KIND_NONE
            assert not device_loader._ring.owns(tensor)
        assert torch.equal(extra.images, batch["image"][:2].cpu())
        assert extra.meta["ids"].tolist() == list(range(8 * count, 8 * count + 8))
        count += 1
    assert device_loader.stats()["hidden_pinned_copies"] == 2 * count == 16
    device_loader.close()


def keeps_the_first_batch(loader):
    """A source that holds on to its first host batch (as a logging wrapper might), so the ring's one
    slot stays taken and every later batch goes through a fresh buffer outside the ring."""
    first = None
    for batch in loader:
        first = batch if first is None else first
        yield batch


@needs_cuda
def test_a_fresh_buffer_past_the_ring_lives_until_its_copy_ran():
    side, n = 128, 12 * 16
    source = keeps_the_first_batch(DataLoader(Constant(n, side), batch_size=16, collate_fn=assemble))
    device_loader = DeviceLoader(source, depth=1, transforms={"image": lag_then_add_one})
    sums, ids, held = [], [], []
    with pytest.warns(ResourceWarning, match="staging slots"):
        for batch in device_loader:
            held.append(device_loader.stats()["unpooled_in_flight"])  # the next copy waits behind the sleep
            sums.append(batch["image"].reshape(16, -1).sum(1))
            ids.append(batch["id"].clone())
            del batch
    torch.cuda.synchronize()
    ids = torch.cat(ids).cpu()
    assert ids.tolist() == list(range(n))
    assert torch.equal(torch.cat(sums).cpu(), (ids % 251 + 1) * 3 * side * side)
    assert max(held) >= 1
    device_loader.close()
    assert device_loader.stats()["unpooled_in_flight"] == 0


@needs_cuda
def test_transforms_may_return_cpu_tensors_tuples_and_dicts():
    transforms = {"image": lambda x: (x.float(), x.cpu()),
                  "label": lambda x: {"on_host": x.cpu(), "twice": x * 2}}
    moved = DeviceLoader(loader(), transforms=transforms)
    for batch, host in zip(moved, loader(collate_fn=default_collate), strict=True):
        image, on_host = batch["image"]
        assert image.is_cuda and not on_host.is_cuda and torch.equal(on_host, host["image"])
        assert not batch["label"]["on_host"].is_cuda
        assert torch.equal(batch["label"]["twice"].cpu(), host["label"] * 2)


@needs_cuda
def test_a_failed_pin_says_what_to_do_and_leaves_no_cuda_error_behind():
    ring = StagingRing(max_slots=1, pinned=True)
    with pytest.raises(RuntimeError, match="ulimit -l"):
        ring.acquire(1 << 50)  # a petabyte: the runtime refuses at once
    assert ring.stats().slots == 0
    assert ring.acquire(1 << 20).numel() == 1 << 20  # the refused size is not what later slots get
    # Left set, the runtime's error would surface at the next launch check anywhere: our kernel's here.
    Normalize((0.5,) * 3, (0.5,) * 3)(torch.zeros(1, 3, 4, 4, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()


needs_two_gpus = pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

ON_THE_SECOND_GPU = """
import torch
from torch.utils.data import DataLoader
from fastcollate import DeviceLoader, assemble
from tests.helpers.worker_datasets import Records
for batch in DeviceLoader(DataLoader(Records(64), batch_size=8, collate_fn=assemble), device="cuda:1"):
    assert batch["image"].device == torch.device("cuda:1")
torch.cuda.synchronize(1)
print("context on GPU 0:", torch._C._cuda_hasPrimaryContext(0))
"""


@needs_cuda
@needs_two_gpus
def test_on_the_second_gpu_no_context_is_made_on_the_first():
    # The pinned slots are allocated, and the copy events made, with cuda:1 current: without that the
    # events fail on cuda:1's stream and a context (about 0.5 GB) appears on GPU 0.
    done = subprocess.run([sys.executable, "-c", ON_THE_SECOND_GPU], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    assert "context on GPU 0: False" in done.stdout


class _MissingFile(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        if index == 2:
            open(f"/nonexistent/sample-{index}.png")  # the dataset's own error, raised in this process
        return {"x": torch.zeros(2)}


def test_a_dataset_error_without_workers_is_raised_as_it_is_and_at_once():
    # Errors like ConnectionError or FileNotFoundError can mean a lost DataLoader worker; without
    # workers it is the dataset's own, and no note about workers (nor a wait for one to exit) is added.
    loader = DeviceLoader(DataLoader(_MissingFile(), batch_size=4, collate_fn=assemble), device="cpu")
    started = time.monotonic()
    with pytest.raises(FileNotFoundError) as caught:
        list(loader)
    assert time.monotonic() - started < 4.0  # the lost-worker path waits 5 s for a worker to exit
    assert getattr(caught.value, "__notes__", []) == []


def collate_in_two_parts(samples):
    """A main-process collate that calls assemble twice: under DeviceLoader both parts land in its pinned
    ring, in two slots."""
    images = assemble([{"image": sample["image"]} for sample in samples])
    labels = assemble([{"id": sample["id"], "label": sample["label"]} for sample in samples])
    return {**images, **labels}


@needs_cuda
def test_small_fields_in_a_second_pinned_slot_are_packed_not_sent_apart():
    # Only pageable small fields (those a worker sent by value) may cross on their own: a copy from a
    # second pinned slot would still read it after the call returned, with nothing holding that slot.
    side, batch_size = 128, 32  # 1.5 MiB batches
    source = DataLoader(Labelled(batch_size * 4, side), batch_size=batch_size,
                        collate_fn=collate_in_two_parts)
    device_loader = DeviceLoader(source, depth=2)
    for batch in device_loader:
        assert batch["image"].is_cuda and batch["label"].is_cuda
    stats = device_loader.stats()
    assert stats["small_fields_apart"] == 0 and stats["host_packs"] == stats["batches"] == 4
    device_loader.close()
