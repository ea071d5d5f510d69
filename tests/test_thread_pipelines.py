"""Thread pipelines: any number of threads may call one ``assemble`` at once (SPDL and torchdata.nodes do).

The stress tests run 4 threads x 500 batches through one collate function. Every batch is checked
against its samples (``x`` of sample ``i`` is full of ``i``, so each row's sum names its sample), some
batches are kept while the others run and checked again at the end (a kept batch is never overwritten),
the ring stays within its slots, nothing deadlocks and no batch is lost. Then the same inside a real
SPDL pipeline and a real torchdata.nodes pipeline, DeviceLoader over both, and a collate error raised
inside each, as each passes it on.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import fastcollate
from fastcollate import Contract, DeviceLoader, Field, StagingRing
from fastcollate.collate.errors import ContractSizeError
from fastcollate.transfer.staging import main_process_ring
from tests.test_concurrency import in_threads

THREADS = 4
BATCHES = int(os.environ.get("FASTCOLLATE_STRESS_BATCHES", "500"))  # per thread
KEPT_AT_ONCE = 3  # batches held back while the others run: with THREADS in flight, fewer than the slots


def samples(first: int, count: int, width: int = 24) -> list[dict]:
    return [
        {"id": first + k, "x": torch.full((width,), float(first + k)), "label": (first + k) % 7}
        for k in range(count)
    ]


def intact(batch: dict, width: int = 24) -> list[int]:
    """The batch's ids, after checking every row against its sample (its sum) and every label."""
    ids = batch["id"]
    assert torch.equal(batch["x"].sum(dim=1), ids.to(torch.float32) * width), "a row is not its sample's"
    assert torch.equal(batch["label"], ids % 7), "a label is not its sample's"
    return ids.tolist()


class Keeper:
    """Holds back the last KEPT_AT_ONCE batches any thread offered; checks each again when it lets go."""

    def __init__(self, width: int = 24) -> None:
        self.width = width
        self.held: collections.deque = collections.deque()
        self.checked_again = 0
        self.lock = threading.Lock()

    def offer(self, batch: dict) -> None:
        with self.lock:
            self.held.append(batch)
            if len(self.held) > KEPT_AT_ONCE:
                intact(self.held.popleft(), self.width)  # survived every batch collated meanwhile
                self.checked_again += 1

    def drain(self) -> None:
        with self.lock:
            while self.held:
                intact(self.held.popleft(), self.width)
                self.checked_again += 1


def stress(collate, batch_size: int = 16, width: int = 24) -> tuple[list[int], Keeper]:
    """THREADS threads, BATCHES batches each, through ``collate``: every id delivered, once."""
    delivered: list[int] = []
    lock = threading.Lock()
    keeper = Keeper(width)

    def run(thread: int) -> None:
        mine = []
        for step in range(BATCHES):
            first = (thread * BATCHES + step) * batch_size
            batch = collate(samples(first, batch_size, width))
            mine += intact(batch, width)
            if step % 7 == 0:
                keeper.offer(batch)
            del batch
        with lock:
            delivered.extend(mine)

    in_threads(*[lambda t=t: run(t) for t in range(THREADS)])
    keeper.drain()
    return delivered, keeper


def every_id_once(delivered: list[int], count: int) -> None:
    assert len(delivered) == count, f"{count - len(delivered)} samples lost or duplicated"
    assert sorted(delivered) == list(range(count)), "a sample was lost or delivered twice"


def test_four_threads_through_the_process_assemble_deliver_every_batch_intact_within_the_ring():
    ring = main_process_ring()
    before = ring.stats()
    delivered, keeper = stress(fastcollate.assemble)
    every_id_once(delivered, THREADS * BATCHES * 16)
    assert keeper.checked_again == len(range(0, BATCHES, 7)) * THREADS
    after = ring.stats()
    assert after.slots <= after.max_slots
    # At most THREADS batches in flight plus KEPT_AT_ONCE kept: always a free slot, never a fresh buffer.
    assert after.overflow_allocations == before.overflow_allocations


def test_four_threads_through_one_configured_assembler_with_its_own_ring():
    ring = StagingRing(max_slots=THREADS + KEPT_AT_ONCE + 1)
    contract = Contract(
        {
            "id": Field(kind="number"),
            "x": Field(dtype=torch.float32, shape=(24,)),
            "label": Field(kind="number", range=(0, 7)),
        }
    )
    delivered, _ = stress(fastcollate.assemble.using(contract, ring=ring))
    every_id_once(delivered, THREADS * BATCHES * 16)
    stats = ring.stats()
    assert stats.slots <= THREADS + KEPT_AT_ONCE + 1 and stats.overflow_allocations == 0
    assert stats.reuses >= THREADS * BATCHES - stats.slot_allocations


def test_four_threads_with_batches_large_enough_for_streaming_stores_and_a_parallel_copy():
    """Batches of 8 MiB and more take another copy path (streaming stores, split over torch's threads):
    four callers of it at once, each copy itself spread over two threads."""
    width = 64 * 1024  # 256 KiB a sample, 40 samples: 10 MiB a batch
    previous = torch.get_num_threads()
    # ThreadSanitizer runs it on one (FASTCOLLATE_COPY_THREADS=1): it cannot see an OpenMP region's end.
    torch.set_num_threads(int(os.environ.get("FASTCOLLATE_COPY_THREADS", "2")))
    try:
        ring = StagingRing(max_slots=THREADS + KEPT_AT_ONCE + 1)
        collate = fastcollate.assemble.using(ring=ring)
        delivered = []
        lock = threading.Lock()
        keeper = Keeper(width)

        def run(thread: int) -> None:
            for step in range(12):
                first = (thread * 12 + step) * 40
                batch = collate(samples(first, 40, width))
                ids = intact(batch, width)
                if step % 3 == 0:
                    keeper.offer(batch)
                del batch  # before the next collate: this thread holds one batch at a time
                with lock:
                    delivered.extend(ids)

        in_threads(*[lambda t=t: run(t) for t in range(THREADS)])
        keeper.drain()
    finally:
        torch.set_num_threads(previous)
    every_id_once(delivered, THREADS * 12 * 40)
    assert ring.stats().overflow_allocations == 0


def test_a_ring_smaller_than_the_threads_in_flight_overflows_to_fresh_buffers_never_overwrites():
    ring = StagingRing(max_slots=2)
    with pytest.warns(ResourceWarning, match=r"staging slots.*thread pipeline.*StagingRing\(max_slots="):
        delivered, keeper = stress(fastcollate.assemble.using(ring=ring))
    every_id_once(delivered, THREADS * BATCHES * 16)
    assert ring.stats().slots == 2 and ring.stats().overflow_allocations > 0


def test_a_collate_error_in_one_thread_names_its_sample_and_leaves_the_others_running():
    collate = fastcollate.assemble
    errors: list[BaseException] = []
    delivered: list[int] = []
    lock = threading.Lock()

    def run(thread: int) -> None:
        for step in range(60):
            first = (thread * 60 + step) * 8
            batch = samples(first, 8)
            if thread == 1 and step == 30:
                batch[5]["x"] = torch.zeros(23)
            try:
                ids = intact(collate(batch))
            except ContractSizeError as error:
                errors.append(error)
                continue
            with lock:
                delivered.extend(ids)

    in_threads(*[lambda t=t: run(t) for t in range(THREADS)])
    assert len(errors) == 1
    bad = (1 * 60 + 30) * 8 + 5
    assert f"sample id={bad}" in str(errors[0]) and "field 'x'" in str(errors[0])
    assert sorted(delivered) == sorted(set(range(THREADS * 60 * 8)) - set(range(bad - 5, bad + 3)))


# --------------------------------------------------------------------------------------------------
# Inside the thread pipelines users run: each fetches a batch's samples and collates them on its threads.


def batch_indices(batches: int, batch_size: int) -> list[range]:
    return [range(k * batch_size, (k + 1) * batch_size) for k in range(batches)]


def fetch_and_collate(collate, width: int = 24):
    return lambda indices: collate(samples(indices[0], len(indices), width))


def spdl_pipeline(source, stage, threads: int = THREADS, **build):
    builder = pytest.importorskip("spdl.pipeline").PipelineBuilder
    executor = ThreadPoolExecutor(threads, thread_name_prefix="spdl-test")
    pipeline = (
        builder()
        .add_source(source)
        .pipe(stage, concurrency=threads, executor=executor)
        .add_sink(2)
        .build(num_threads=1, **build)
    )
    return pipeline, executor


def nodes_loader(source, stage, threads: int = THREADS):
    nodes = pytest.importorskip("torchdata.nodes")
    node = nodes.ParallelMapper(
        nodes.IterableWrapper(source), map_fn=stage, num_workers=threads, method="thread", in_order=True
    )
    return nodes.Loader(nodes.Prefetcher(node, prefetch_factor=2))


def test_inside_an_spdl_pipeline_every_batch_arrives_intact():
    pipeline, executor = spdl_pipeline(
        batch_indices(THREADS * BATCHES // 4, 16), fetch_and_collate(fastcollate.assemble), max_failures=0
    )
    keeper = Keeper()
    delivered = []
    with pipeline.auto_stop():
        for k, batch in enumerate(pipeline):
            delivered += intact(batch)
            if k % 7 == 0:
                keeper.offer(batch)
            del batch
    executor.shutdown()
    keeper.drain()
    every_id_once(delivered, THREADS * BATCHES // 4 * 16)
    assert keeper.checked_again > 0


def test_inside_a_torchdata_nodes_pipeline_every_batch_arrives_intact_over_two_epochs():
    loader = nodes_loader(batch_indices(THREADS * BATCHES // 4, 16), fetch_and_collate(fastcollate.assemble))
    keeper = Keeper()
    for _ in range(2):
        delivered = []
        for k, batch in enumerate(loader):
            delivered += intact(batch)
            if k % 7 == 0:
                keeper.offer(batch)
            del batch
        every_id_once(delivered, THREADS * BATCHES // 4 * 16)
    keeper.drain()


def bad_at(bad: int, collate):
    def stage(indices):
        batch = samples(indices[0], len(indices))
        for sample in batch:
            if sample["id"] == bad:
                sample["x"] = torch.zeros(23)
        return collate(batch)

    return stage


def test_a_collate_error_inside_torchdata_nodes_reaches_the_consumer_naming_the_sample_and_field():
    loader = nodes_loader(batch_indices(12, 8), bad_at(45, fastcollate.assemble))
    with pytest.raises(ContractSizeError, match=r"sample id=45 .*field 'x'"):
        for batch in loader:
            intact(batch)


def test_a_collate_error_inside_spdl_stops_the_pipeline_with_max_failures_0_naming_the_sample(caplog):
    """SPDL logs a failed stage and drops its item unless ``max_failures=0``; with it, the pipeline
    stops and the error is in the PipelineFailure it raises."""
    spdl = pytest.importorskip("spdl.pipeline")
    pipeline, executor = spdl_pipeline(batch_indices(12, 8), bad_at(45, fastcollate.assemble), max_failures=0)
    with pytest.raises(spdl.PipelineFailure) as failure, pipeline.auto_stop():
        for batch in pipeline:
            intact(batch)
    executor.shutdown()

    def causes(error: BaseException):
        yield error
        for inner in getattr(error, "exceptions", ()):
            yield from causes(inner)
        if error.__cause__ is not None:
            yield from causes(error.__cause__)

    ours = [e for e in causes(failure.value) if isinstance(e, ContractSizeError)]
    assert ours and "sample id=45" in str(ours[0]) and "field 'x'" in str(ours[0])


def test_with_spdl_defaults_a_failed_collate_is_logged_naming_the_sample_and_its_batch_dropped(caplog):
    """What a user who keeps SPDL's default (``max_failures=-1``) gets: the batch is missing, and the log
    says which sample broke it. fastcollate.audit's ledger would report the missing ids."""
    pipeline, executor = spdl_pipeline(batch_indices(12, 8), bad_at(45, fastcollate.assemble))
    with caplog.at_level(logging.ERROR), pipeline.auto_stop():
        delivered = [i for batch in pipeline for i in intact(batch)]
    executor.shutdown()
    assert sorted(delivered) == [i for i in range(96) if not 40 <= i < 48]
    assert any("sample id=45" in record.getMessage() + str(record.exc_info) for record in caplog.records)


# --------------------------------------------------------------------------------------------------
# DeviceLoader over their iterables (the CPU path here: batches pass through, state reads through).


def test_device_loader_wraps_an_spdl_pipeline():
    pipeline, executor = spdl_pipeline(batch_indices(40, 16), fetch_and_collate(fastcollate.assemble))
    device_loader = DeviceLoader(pipeline, device="cpu", depth=3)
    assert not hasattr(device_loader, "state_dict")  # a Pipeline has none: neither has its DeviceLoader
    with pipeline.auto_stop():
        delivered = [i for batch in device_loader for i in intact(batch)]
    executor.shutdown()
    every_id_once(delivered, 40 * 16)
    assert device_loader.stats()["batches"] == 40


def test_device_loader_over_torchdata_nodes_resumes_at_the_batch_it_last_handed_out():
    """The Loader is ``depth`` batches ahead of the consumer (they are staged): DeviceLoader's state is
    the one it had when the consumer's last batch left it, so resuming loses and repeats nothing."""

    def make():
        return DeviceLoader(
            nodes_loader(batch_indices(30, 8), fetch_and_collate(fastcollate.assemble)), device="cpu", depth=3
        )

    first = make()
    taken = []
    for k, batch in enumerate(first):
        taken += intact(batch)
        if k == 10:
            break
    state = first.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    rest = [i for batch in resumed for i in intact(batch)]
    every_id_once(taken + rest, 30 * 8)


def test_device_loader_has_the_length_and_epochs_of_what_it_wraps_where_that_has_them():
    class Epochs:
        def __init__(self) -> None:
            self.epoch = None

        def __len__(self) -> int:
            return 3

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self):
            return (fastcollate.assemble(samples(8 * k, 8)) for k in range(3))

    wrapped = Epochs()
    device_loader = DeviceLoader(wrapped, device="cpu")
    device_loader.set_epoch(4)
    assert len(device_loader) == 3 and wrapped.epoch == 4
    loader = DeviceLoader(
        nodes_loader(batch_indices(3, 8), fetch_and_collate(fastcollate.assemble)), device="cpu"
    )
    with pytest.raises(TypeError):
        len(loader)  # a torchdata.nodes Loader has no length: neither has its DeviceLoader


def test_four_threads_each_iterating_its_own_device_loader_over_one_assemble():
    results: dict[int, list[int]] = {}

    def run(thread: int) -> None:
        source = (fastcollate.assemble(samples(thread * 10_000 + 8 * k, 8)) for k in range(25))
        results[thread] = [i for batch in DeviceLoader(source, device="cpu", depth=2) for i in intact(batch)]

    in_threads(*[lambda t=t: run(t) for t in range(THREADS)])
    for thread, ids in results.items():
        assert ids == list(range(thread * 10_000, thread * 10_000 + 200))


# --------------------------------------------------------------------------------------------------
# fetch_batches: the map stage, for any map-style dataset.


def test_fetch_batches_hands_an_arrays_dataset_the_whole_index_array_and_gathers_it_in_threads():
    from torch.utils.data import default_collate

    features = torch.arange(4096 * 8, dtype=torch.float32).view(4096, 8)
    dataset = fastcollate.Arrays(x=features, label=torch.arange(4096) % 5, index_as="id")
    sampler = fastcollate.IndexBatches(
        len(dataset), 256, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    batches = list(sampler)  # int64 arrays
    handed: list[str] = []

    def collate(batch):
        handed.append(type(batch).__name__)
        return fastcollate.assemble(batch)

    loader = nodes_loader(batches, fastcollate.fetch_batches(dataset, collate))
    delivered = []
    for indices, batch in zip(batches, loader, strict=True):  # in order (in_order=True)
        reference = default_collate([dataset[int(i)] for i in indices])
        assert batch.keys() == reference.keys()
        for key in reference:
            assert batch[key].dtype == reference[key].dtype and torch.equal(batch[key], reference[key]), key
        delivered += batch["id"].tolist()
    every_id_once(delivered, 4096)
    assert handed == ["ArrayBatch"] * 16  # the lazy batch, gathered column by column: no sample made


def test_fetch_batches_over_a_plain_dataset_matches_a_dataloader_batch_for_batch():
    from torch.utils.data import DataLoader

    from tests.helpers.fault_datasets import Numbered

    dataset = Numbered(96, shape=(4,))
    batches = batch_indices(12, 8)
    pipeline, executor = spdl_pipeline(batches, fastcollate.fetch_batches(dataset), max_failures=0)
    with pipeline.auto_stop():
        got = sorted((batch["id"].tolist(), batch["x"].tolist()) for batch in pipeline)
    executor.shutdown()
    expected = sorted(
        (b["id"].tolist(), b["x"].tolist())
        for b in DataLoader(dataset, batch_size=8, collate_fn=fastcollate.assemble)
    )
    assert got == expected


# --------------------------------------------------------------------------------------------------
# DeviceLoader's state: what a resumed epoch starts from.


def test_a_device_loader_over_a_plain_dataloader_is_not_stateful_so_lightning_checkpoints_it():
    """Lightning's CombinedLoader asks any loader that looks stateful for its state when it saves a
    checkpoint: a DeviceLoader over a DataLoader (which has no state_dict) must not look stateful."""
    from torch.utils.data import DataLoader

    stateful = pytest.importorskip("lightning.fabric.utilities.types")._Stateful
    plain = DeviceLoader(DataLoader(range(8), batch_size=4), device="cpu")
    assert not hasattr(plain, "state_dict") and not hasattr(plain, "load_state_dict")
    assert not isinstance(plain, stateful)
    resumable = DeviceLoader(
        nodes_loader(batch_indices(2, 8), fetch_and_collate(fastcollate.assemble)), device="cpu"
    )
    assert isinstance(resumable, stateful)


class OwnStateLoader:
    """Hands out its own state dict and changes it as it goes on (as a sampler's state may)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.state = {"position": 0}

    def __iter__(self):
        for i in range(self.state["position"], self.n):
            self.state["position"] = i + 1
            yield fastcollate.assemble(samples(i, 1))

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def test_a_loader_that_hands_out_its_own_state_dict_still_resumes_at_the_batch_handed_out():
    first = DeviceLoader(OwnStateLoader(10), device="cpu", depth=3)
    taken = []
    for batch in first:
        taken += intact(batch)
        if len(taken) == 4:
            break  # the loader itself is 3 batches further on
    resumed = DeviceLoader(OwnStateLoader(10), device="cpu", depth=3)
    resumed.load_state_dict(first.state_dict())
    assert taken + [i for batch in resumed for i in intact(batch)] == list(range(10))


@pytest.mark.parametrize("workers", [0, 2], ids=["workers0", "workers2"])
def test_resuming_a_stateful_dataloader_from_the_end_of_an_epoch_starts_the_next_epoch_whole(workers):
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
    from tests.helpers.fault_datasets import Numbered

    def make():
        return DeviceLoader(
            stateful_dataloader(
                Numbered(40, shape=(4,)), batch_size=4, num_workers=workers, collate_fn=fastcollate.assemble
            ),
            device="cpu",
            depth=3,
        )

    first = make()
    assert sorted(i for batch in first for i in batch["id"].tolist()) == list(range(40))
    resumed = make()
    resumed.load_state_dict(first.state_dict())  # taken after the epoch's last batch and its end
    assert sorted(i for batch in resumed for i in batch["id"].tolist()) == list(range(40))


def test_fetch_batches_gives_a_dataset_without_getitems_python_ints_whatever_the_index_type():
    import numpy as np

    keyed = {
        i: {"id": i, "x": torch.full((24,), float(i)), "label": i % 7} for i in range(16)
    }  # keyed by int
    fetch = fastcollate.fetch_batches(keyed)
    for indices in ([3, 4], range(3, 5), np.array([3, 4]), torch.tensor([3, 4]), (i for i in (3, 4))):
        assert intact(fetch(indices)) == [3, 4]


@pytest.mark.needs_cuda
def test_on_a_gpu_device_loader_over_a_thread_pipeline_packs_each_batch_once_and_delivers_it_intact():
    """A batch collated on a pipeline's thread is in the process's pageable ring (the ring is chosen per
    thread): DeviceLoader packs it into its pinned slot once, then one copy to the device."""
    loader = nodes_loader(batch_indices(40, 16), fetch_and_collate(fastcollate.assemble))
    device_loader = DeviceLoader(loader, device="cuda", depth=2)
    kept = []
    for batch in device_loader:
        assert batch["x"].is_cuda
        kept.append(batch)
    torch.cuda.synchronize()
    every_id_once([i for batch in kept for i in intact({k: v.cpu() for k, v in batch.items()})], 40 * 16)
    stats = device_loader.stats()
    assert stats["batches"] == 40 and stats["host_packs"] == 40 and stats["pinned_slots"] <= 2
