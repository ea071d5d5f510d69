"""fastcollate.ray.ArrowCollate's device and max_slots attacked without Ray: arguments that name nothing are
refused at construction naming the collate; a collate for a GPU built or called where there is none says
why at its first batch and stays usable; its rings are its own, outlive it in the batches they hold, and
stay whole from several threads. Its errors name it, the row of the table and the column. The CUDA tests
check what only a GPU shows: a packed jagged batch, a full ring, a bare "cuda" in another thread."""

from __future__ import annotations

import gc
import pickle
import threading
import warnings

import numpy as np
import pytest
import torch

pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed")

from fastcollate import Contract, ContractError, Field, Packing  # noqa: E402
from fastcollate.ray import ArrowCollate  # noqa: E402

from .helpers.batches import assert_same_batch  # noqa: E402
from .test_ray_collate import (  # noqa: E402
    assert_moved,
    dense_table,
    expression,
    packed_contract,
    token_lists,
)


@pytest.mark.parametrize("device", ["garbage", "CUDA", "cuda:x", "cuda:-1", "", -1, 1.5, True])
def test_a_device_that_names_no_device_is_refused_at_construction_naming_the_collate(device):
    with pytest.raises(ValueError, match=r"^fastcollate\.ray\.ArrowCollate: device=.* names no device"):
        ArrowCollate(device=device)


@pytest.mark.parametrize("device", ["cuda", 0, "cuda:1", torch.device("cuda", 0)])
def test_a_collate_for_a_gpu_called_where_there_is_none_says_why_each_time_and_stays_usable(
    device, monkeypatch
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    table = dense_table(20)
    collate = ArrowCollate(device=device)  # made on a driver without a GPU, for a worker with one
    asked = collate.device
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"ArrowCollate: device='cuda.*sees no GPU"):
            collate(table)
        assert collate._pinned is None and collate.device == asked
    landed = pickle.loads(pickle.dumps(collate))
    assert landed.device == asked and landed._pinned is None
    monkeypatch.undo()
    assert_same_batch(ArrowCollate(device="cpu")(table), expression(table))


def test_a_bare_cuda_is_fixed_where_the_collate_is_made_and_made_again_where_a_pickle_lands(monkeypatch):
    # Ray calls the collate from threads of its own, whose current device is not the training loop's:
    # "cuda" is read where the loop makes the collate, once torch.cuda.set_device has started CUDA there.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    collate = ArrowCollate(device="cuda")
    assert collate.device == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    landed = pickle.loads(pickle.dumps(collate))
    assert landed.device == torch.device("cuda"), "the worker it lands in reads its own current device"


@pytest.mark.parametrize("max_slots", [0, -1, 1.5, 2.0, "3", True, 2**63])
def test_max_slots_that_is_not_a_count_of_at_least_one_is_refused_naming_the_collate(max_slots):
    with pytest.raises(ValueError, match=r"^fastcollate\.ray\.ArrowCollate: max_slots=.*at least 1"):
        ArrowCollate(max_slots=max_slots)


def test_max_slots_of_a_numpy_int_or_a_huge_count_keeps_every_batch_in_a_slot():
    table = dense_table(64)
    for max_slots in (np.int64(3), 2**40):
        collate = ArrowCollate(max_slots=max_slots)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)
            kept = [collate(table) for _ in range(3)]
        assert collate._assemble.ring.stats().slots == 3
        for batch in kept:
            assert_same_batch(batch, expression(table))


def test_pickled_copies_each_have_a_ring_of_their_own():
    table = dense_table(64)
    first, second = (pickle.loads(pickle.dumps(ArrowCollate(max_slots=1))) for _ in range(2))
    kept = first(table)
    with warnings.catch_warnings():
        # The second's one slot is free, whatever the first holds.
        warnings.simplefilter("error", ResourceWarning)
        assert_same_batch(second(table), expression(table))
    assert first._assemble.ring is not second._assemble.ring
    assert_same_batch(kept, expression(table))


def test_batches_kept_after_their_collate_is_gone_keep_their_rows():
    tables = [dense_table(300, seed=s).slice(s, 200) for s in range(4)]
    collate = ArrowCollate(max_slots=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        kept = [collate(table) for table in tables]
    del collate
    gc.collect()
    fresh = ArrowCollate(max_slots=2)
    for table in reversed(tables):  # a new collate's slots must not be the kept batches' memory
        fresh(table)
    for table, batch in zip(tables, kept, strict=True):
        assert_same_batch(batch, expression(table))


def test_four_threads_on_one_slot_each_keep_their_own_tables_batch_and_hear_of_it_once():
    tables = [dense_table(400, seed=s).slice(s, 300 + s) for s in range(5)]
    expected = [expression(t) for t in tables]
    collate = ArrowCollate(max_slots=1)
    kept, lock = [], threading.Lock()

    def run(thread):
        for round_number in range(15):
            which = (thread + round_number) % len(tables)
            batch = collate(tables[which])
            with lock:
                kept.append((which, batch))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len([w for w in caught if issubclass(w.category, ResourceWarning)]) == 1
    assert len(kept) == 60
    for which, batch in kept:
        assert_same_batch(batch, expected[which])


def padded_contract():
    tokens = dict(dtype=torch.int64, shape=("T",), pad=0, cast_from=(torch.int32,))
    x = Field(dtype=torch.float32, kind="number", range=(0, 100))
    return Contract({"x": x, "tokens": Field(**tokens)}, id=None)


@pytest.mark.parametrize("when", ["first", "later", "later_the_long_way"])
def test_a_contract_error_names_the_collate_the_row_and_the_column_of_the_key(when):
    good = pa.table({"x": pa.array(np.arange(4, dtype=np.float32)), "ids": token_lists(4)})
    bad = good.set_column(1, "ids", pa.array([[1.5], [2.0], [3.0], [4.0]], pa.list_(pa.float32())))
    collate = ArrowCollate(padded_contract(), columns={"x": "x", "tokens": "ids"})
    if when != "first":
        collate(good)
        collate._layout.gather = None if when == "later_the_long_way" else collate._layout.gather
        # (a later table of another type is refused as a type change: this one breaks the range in row 2)
        bad = good.set_column(0, "x", pa.array([1, 2, -5, 3], pa.float32()))
    with pytest.raises(ContractError) as refused:
        collate(bad)
    text = str(refused.value)
    row = 0 if when == "first" else 2
    named = f"fastcollate.ray.ArrowCollate: row {row} of the table (it has no 'id' column"
    assert text.startswith(named), text
    assert "with_ids" not in text and "Arrays.from_arrow" not in text
    if when == "first":
        assert "field 'tokens' (column 'ids'): expected torch.int64, got torch.float32" in text
        assert isinstance(refused.value, TypeError) and refused.value.field == "tokens"
    else:
        assert "field 'x': expected" in text and isinstance(refused.value, ValueError)
        assert refused.value.position == row


# --- what only a GPU shows --------------------------------------------------------------------------------


@pytest.mark.needs_cuda
@pytest.mark.parametrize("gathered", [True, False], ids=["gathered", "the_long_way"])
def test_a_jagged_packed_batch_moved_by_the_collate_keeps_its_offsets_as_cu_seq_lens(gathered):
    ids = token_lists(64, seed=7)
    table = pa.table({"input_ids": ids, "labels": ids}).slice(5, 40)
    contract = packed_contract()
    contract = Contract(contract.fields, packing=Packing(nested=True), id=None)
    collate = ArrowCollate(contract, device="cuda")
    if not gathered:
        collate._layout_for(table).gather = None
    batch = collate(table)
    expected = expression(table, contract)
    device = torch.device("cuda", torch.cuda.current_device())
    for key in ("input_ids", "labels"):
        ours, theirs = batch[key], expected[key]
        assert ours.is_nested and ours.device == device, key
        assert torch.equal(ours.values().cpu(), theirs.values()), key
        assert ours.offsets() is batch["cu_seq_lens_q"], "the offsets cross once, as cu_seq_lens"
    assert batch["cu_seq_lens_q"] is batch["cu_seq_lens_k"]
    assert torch.equal(batch["cu_seq_lens_q"].cpu(), expected["cu_seq_lens_q"])


@pytest.mark.needs_cuda
def test_batches_moved_past_a_full_ring_are_copied_before_their_buffer_goes():
    tables = [dense_table(70_000, seed=s).slice(s, 65_000) for s in range(6)]
    collate = ArrowCollate(device="cuda", max_slots=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = [collate(table) for table in tables for _ in range(3)]  # the slot is busy until its copy ran
    assert any(issubclass(w.category, ResourceWarning) for w in caught)
    torch.cuda.synchronize()
    for index, batch in enumerate(kept):
        assert_moved(batch, expression(tables[index // 3]), batch["f32"].device)


@pytest.mark.needs_cuda
def test_a_bare_cuda_made_on_the_loops_device_moves_batches_there_from_another_thread():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs a second CUDA GPU")
    table = dense_table(500)
    made = {}

    def training_loop():  # as Ray Train's worker does: set_device, then make the collate
        torch.cuda.set_device(1)
        made["collate"] = ArrowCollate(device="cuda")

    loop = threading.Thread(target=training_loop)
    loop.start()
    loop.join()
    got = {}
    ray_thread = threading.Thread(target=lambda: got.update(batch=made["collate"](table)))
    ray_thread.start()
    ray_thread.join()
    assert got["batch"]["f32"].device == torch.device("cuda", 1)
