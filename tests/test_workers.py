"""assemble inside DataLoader workers (fork and spawn): shared slots or fresh shared memory, identical
batches, named errors; and the copy releasing the GIL."""

import subprocess
import sys
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from fastcollate import Contract, ContractError, assemble
from fastcollate._ext import _C
from tests.helpers.worker_datasets import BadFourth, Records
from tests.test_assemble_dropin import assert_same
from tests.test_faults import run_until_error


def batches(collate, workers, context=None):
    loader = DataLoader(Records(40), batch_size=8, num_workers=workers, collate_fn=collate,
                        multiprocessing_context=context if workers else None)
    return [batch for batch in loader]


@pytest.mark.parametrize("shared_slots", [True, False])
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_give_the_same_batches_as_the_main_process_and_as_default_collate(context, shared_slots):
    reference = batches(default_collate, 0)
    in_main = batches(assemble, 0)
    in_workers = batches(assemble.using(shared_slots=shared_slots), 2, context)
    assert len(reference) == len(in_main) == len(in_workers) == 5
    for expected, a, b in zip(reference, in_main, in_workers, strict=True):
        assert_same(a, expected)
        assert_same(b, expected)
    if shared_slots:  # received over a slot the worker wrote into
        assert all(_C.shared_slot_kind(batch["image"]) == _C.SLOT_KIND_RECEIVED for batch in in_workers)
    else:  # built in fresh shared memory, as default_collate does
        first = in_workers[0]["image"]
        assert first.is_shared() and _C.shared_slot_kind(first) == _C.SLOT_KIND_NONE


def test_a_contract_assembler_works_in_spawned_workers():
    contract = Contract.infer(Records(1)[0])
    got = batches(assemble.using(contract), 2, "spawn")
    assert torch.equal(torch.cat([b["id"] for b in got]), torch.arange(40))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_bad_sample_in_a_worker_is_named_in_the_main_process(workers):
    loader = DataLoader(BadFourth(16), batch_size=8, num_workers=workers, collate_fn=assemble)
    error = run_until_error(loader, [])
    assert isinstance(error, ContractError) and error.sample_id == 3 and error.field == "image"
    assert isinstance(error, RuntimeError)


def test_the_copy_releases_the_gil():
    # 64 MB of samples: the copy takes long enough for another thread to be seen running during it.
    samples = [torch.ones(4, 1024, 1024, dtype=torch.float32) for _ in range(4)]
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0)

    from fastcollate import StagingRing

    collate = assemble.using(ring=StagingRing(max_slots=1))
    collate(samples)  # warm the slot so the timed call is only the copy
    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.05)
    progressed_during = []
    for _ in range(5):
        before = len(ticks)
        start = time.perf_counter()
        batch = collate(samples)
        end = time.perf_counter()
        del batch
        progressed_during.append(sum(start < t < end for t in ticks[before:]))
    stop.set()
    thread.join()
    # With the GIL held for the whole copy, the ticker could not append a single timestamp inside it.
    assert max(progressed_during) > 0


def test_import_without_the_built_core_says_how_to_build():
    # A None entry in sys.modules makes `from . import _C` fail as a missing extension does.
    code = "import sys; sys.modules['fastcollate._C'] = None; import fastcollate"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "make build" in result.stderr and "--no-build-isolation" in result.stderr
