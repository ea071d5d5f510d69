"""fastcollate.ray.ArrowCollate over the tables Ray hands a collate (no Ray running): every batch equals
what assemble makes of Arrays.from_arrow over the same table, gathered natively from the table's buffers
(sliced, chunked), padded or packed by a contract; safe from several threads; bad input named."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

# The GPU check collects this file for its CUDA tests, where pyarrow may be missing.
pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed")

from fastcollate import Arrays, Contract, Field, Packing, assemble  # noqa: E402
from fastcollate.ray import ArrowCollate  # noqa: E402

from .helpers.batches import assert_same_batch  # noqa: E402


def expression(table, contract=None, columns=None):
    """The oracle: what ArrowCollate must return for ``table``."""
    return assemble.using(contract)(
        Arrays.from_arrow(table, columns).__getitems__(list(range(table.num_rows)))
    )


def gathered_natively(collate, table):
    """Whether ``collate`` gathers ``table`` in its native call rather than the long way."""
    collate(table)
    return collate._native_plan(table) is not None


def assert_parity(table, contract=None, columns=None, collate=None):
    collate = collate or ArrowCollate(contract, columns)
    assert gathered_natively(collate, table)
    assert_same_batch(collate(table), expression(table, contract, columns))


def dense_table(rows, seed=0):
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "f32": pa.array(rng.standard_normal(rows, dtype=np.float32)),
            "f64": pa.array(rng.standard_normal(rows)),
            "f16": pa.array(rng.standard_normal(rows).astype(np.float16)),
            "i8": pa.array(rng.integers(-100, 100, rows, dtype=np.int8)),
            "u8": pa.array(rng.integers(0, 255, rows, dtype=np.uint8)),
            "i32": pa.array(rng.integers(-9, 9, rows, dtype=np.int32)),
            "label": pa.array(rng.integers(0, 10, rows)),
        }
    )


INT32 = pa.int32()


def token_lists(rows, seed=0, low=1, high=9, offsets=INT32):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(low, high, rows)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    values = pa.array(rng.integers(0, 1000, int(starts[-1]), dtype=np.int32))
    kind = pa.ListArray if offsets == pa.int32() else pa.LargeListArray
    return kind.from_arrays(pa.array(starts, type=offsets), values)


def test_a_zero_copy_slice_of_dense_columns_equals_the_expression():
    assert_parity(dense_table(300).slice(37, 200))


def test_a_table_in_uneven_chunks_with_an_empty_one_equals_the_expression():
    whole = dense_table(500)
    chunked = pa.concat_tables(
        [whole.slice(0, 120), whole.slice(120, 0), whole.slice(300, 90), whole.slice(7, 33)]
    )
    assert chunked.column("f32").num_chunks == 4
    assert_parity(chunked)


def test_fixed_size_lists_nested_two_deep_are_rows_of_their_shape():
    values = pa.array(np.arange(40 * 6, dtype=np.float32))
    grid = pa.FixedSizeListArray.from_arrays(pa.FixedSizeListArray.from_arrays(values, 3), 2)
    table = pa.table({"grid": grid, "label": pa.array(np.arange(40))})
    sliced = pa.concat_tables([table.slice(5, 10), table.slice(30, 7)])
    assert_parity(sliced)
    assert ArrowCollate()(sliced)["grid"].shape == (17, 2, 3)


def test_columns_chosen_by_key_read_their_table_column():
    table = dense_table(64).slice(3, 50)
    assert_parity(table, columns={"x": "f32", "y": "label", "again": "f32"})
    assert_parity(table, columns=["label", "i8"])


def test_a_batch_does_not_read_the_table_after_it_is_made():
    table = dense_table(100)
    batch = ArrowCollate()(table)
    address = table.column("f32").chunks[0].buffers()[1].address
    assert batch["f32"].data_ptr() != address
    del table
    assert torch.equal(batch["label"], expression(dense_table(100))["label"])


def test_a_contract_that_casts_a_column_is_kept_while_gathering():
    contract = Contract({"i32": Field(dtype=torch.int64, cast_from=(torch.int32,)), "f32": Field()}, id=None)
    assert_parity(dense_table(80).slice(10, 60), contract, columns=["i32", "f32"])


@pytest.mark.parametrize("offsets", [pa.int32(), pa.int64()], ids=["list", "large_list"])
def test_token_lists_padded_by_a_contract_equal_the_expression(offsets):
    ids = token_lists(90, offsets=offsets)
    table = pa.table({"input_ids": ids, "label": pa.array(np.arange(90))})
    sliced = pa.concat_tables([table.slice(11, 30), table.slice(60, 25)])
    contract = Contract({"input_ids": Field(shape=("T",), pad=0), "label": Field(kind="number")}, id=None)
    assert_parity(sliced, contract)
    padded_left = Contract(
        {
            "input_ids": Field(shape=("T",), pad=-1, padding_side="left", pad_to_multiple_of=8),
            "label": Field(kind="number"),
        },
        id=None,
    )
    assert_parity(sliced, padded_left)


def test_token_lists_packed_equal_the_expression_key_for_key():
    ids = token_lists(70, seed=3)
    table = pa.table({"input_ids": ids, "labels": ids})
    sliced = pa.concat_tables([table.slice(4, 20), table.slice(41, 16)])
    contract = Contract(
        {
            "input_ids": Field(dtype=torch.int64, shape=("T",), pack=True, cast_from=(torch.int32,)),
            "labels": Field(
                dtype=torch.int64, shape=("T",), pack=True, cast_from=(torch.int32,), separator=-100
            ),
        },
        packing=Packing(seq_idx="seq_idx"),
        id=None,
    )
    batch = ArrowCollate(contract)(sliced)
    assert {"cu_seq_lens_q", "position_ids", "seq_idx"} <= set(batch)
    assert_parity(sliced, contract)


def test_token_lists_of_one_length_stack_without_a_contract():
    ids = token_lists(40, low=5, high=6)
    assert_parity(pa.table({"input_ids": ids}).slice(9, 20))


def test_four_threads_on_one_collate_each_get_their_own_tables_batch():
    tables = [dense_table(257, seed=s).slice(s, 200 + s) for s in range(8)]
    expected = [expression(t) for t in tables]
    collate = ArrowCollate()
    failures = []
    barrier = threading.Barrier(4)

    def run(thread):
        barrier.wait()
        for round_number in range(25):
            which = (thread + round_number) % len(tables)
            try:
                assert_same_batch(collate(tables[which]), expected[which])
            except AssertionError as error:  # noqa: PERF203 - each failure kept with its table
                failures.append((thread, which, error))

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert gathered_natively(collate, tables[0])


def test_a_string_column_is_refused_naming_it_and_the_collate_in_the_first_table_and_a_later_one():
    numbers = pa.table({"x": pa.array(np.arange(4, dtype=np.float32))})
    table = numbers.append_column("text", pa.array(["a", "b", "c", "d"]))
    with pytest.raises(TypeError, match="^fastcollate.ray.ArrowCollate: column 'text' holds text"):
        ArrowCollate()(table)
    collate = ArrowCollate()
    collate(numbers)  # the layout is made again for the new schema: refused the same way
    with pytest.raises(TypeError, match="^fastcollate.ray.ArrowCollate: column 'text' holds text"):
        collate(table)


def test_a_null_in_a_later_table_is_refused_naming_the_column_and_row():
    collate = ArrowCollate()
    collate(pa.table({"x": pa.array([1.0, 2.0, 3.0], pa.float32())}))
    with pytest.raises(ValueError, match=r"column 'x' has a missing value \(null\) in row 4 of the batch"):
        collate(
            pa.concat_tables(
                [
                    pa.table({"x": pa.array([1.0, 2.0, 3.0], pa.float32())}),
                    pa.table({"x": pa.array([5.0, None, 6.0], pa.float32())}),
                ]
            )
        )


def test_a_null_inside_a_later_tables_token_list_is_traced_to_its_row():
    contract = Contract({"ids": Field(shape=("T",), pad=0)}, id=None)
    collate = ArrowCollate(contract)
    collate(pa.table({"ids": pa.array([[1, 2], [3]], pa.list_(pa.int32()))}))
    lists = pa.array([[9, 9, 9], [1, 2], [3, None, 4], [5]], pa.list_(pa.int32()))
    with pytest.raises(ValueError, match="column 'ids' has a missing value .null. in row 1 of the batch"):
        collate(pa.table({"ids": lists}).slice(1, 3))


def test_lists_within_lists_are_refused_naming_the_column():
    nested = pa.array([[[1], [2, 3]], [[4]]], pa.list_(pa.list_(pa.int32())))
    with pytest.raises(TypeError, match="column 'ids' .* holds lists within lists"):
        ArrowCollate(Contract({"ids": Field(shape=("T",), pad=0)}, id=None))(pa.table({"ids": nested}))


def test_a_column_the_contract_names_but_the_table_lacks_is_named():
    contract = Contract({"x": Field(), "label": Field(kind="number")}, id=None)
    with pytest.raises(Exception, match="label"):
        ArrowCollate(contract)(pa.table({"x": pa.array(np.arange(3, dtype=np.float32))}))
    with pytest.raises(KeyError, match="fastcollate.ray.ArrowCollate: column 'label'"):
        ArrowCollate(columns=["x", "label"])(pa.table({"x": pa.array(np.arange(3, dtype=np.float32))}))


def test_a_column_whose_type_changed_between_tables_is_refused_naming_both_types():
    collate = ArrowCollate()
    collate(pa.table({"x": pa.array(np.arange(3, dtype=np.float32)), "y": pa.array([1, 2, 3])}))
    with pytest.raises(TypeError, match="column 'x' was float in the first batch and is double in this one"):
        collate(pa.table({"x": pa.array(np.arange(3, dtype=np.float64)), "y": pa.array([1, 2, 3])}))


def test_something_other_than_a_table_is_refused_saying_what_was_expected():
    with pytest.raises(TypeError, match="expected a pyarrow.Table .* got dict"):
        ArrowCollate()({"x": np.arange(3)})


def test_an_empty_table_is_refused_as_the_expression_refuses_it_naming_the_collate():
    table = dense_table(10).slice(10, 0)
    with pytest.raises(Exception) as ours:
        ArrowCollate()(table)
    with pytest.raises(Exception) as theirs:
        expression(table)
    assert type(ours.value) is type(theirs.value)
    assert str(ours.value) == f"fastcollate.ray.ArrowCollate: {theirs.value}"


def test_it_is_rays_arrow_batch_collate_fn_and_pickles_without_its_layouts():
    import pickle

    from ray.data.collate_fn import ArrowBatchCollateFn

    collate = ArrowCollate(columns=["f32"])
    collate(dense_table(5))
    assert isinstance(collate, ArrowBatchCollateFn)
    copy = pickle.loads(pickle.dumps(collate))
    assert copy._layout is None
    assert_same_batch(copy(dense_table(5)), expression(dense_table(5), columns=["f32"]))


def test_a_table_in_a_file_another_process_keeps_writing_is_collated_on_both_paths(tmp_path):
    import subprocess
    import sys

    ids = token_lists(400, seed=5)
    path = tmp_path / "blocks.arrow"
    written = pa.table({"ids": ids, "labels": ids})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, written.schema) as writer:
        writer.write_table(written)
    table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    assert Arrays.from_arrow(table).columns["ids"].watched, "the table's buffers lie in the mapped file"
    # Two fields padded along one dim go the long way, through Arrays; one field is gathered natively.
    shared = Contract({"ids": Field(shape=("T",), pad=0), "labels": Field(shape=("T",), pad=-100)}, id=None)
    alone = Contract({"ids": Field(shape=("T",), pad=0)}, id=None)
    long_way, native = ArrowCollate(shared), ArrowCollate(alone, columns=["ids"])
    slices = [table.slice(start, 32) for start in range(0, 368, 16)]
    expected = [(expression(t, shared), expression(t, alone, ["ids"])) for t in slices]
    size = path.stat().st_size
    appender = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys\nwith open(sys.argv[1], 'ab', buffering=0) as f:\n"
                "    while True:\n        f.write(b'x')"
            ),
            str(path),
        ]
    )
    try:
        while path.stat().st_size == size:  # the writes have begun
            pass
        for _ in range(3):
            for piece, (long_batch, native_batch) in zip(slices, expected, strict=True):
                assert_same_batch(long_way(piece), long_batch)
                assert_same_batch(native(piece), native_batch)
        grown = path.stat().st_size
    finally:
        appender.kill()
        appender.wait()
    assert long_way._native_plan(slices[0]) is None and native._native_plan(slices[0]) is not None
    assert grown > size + 1000, "the file was written all along"


# --- moved to a device by the collate ---------------------------------------------------------------------


def test_a_device_of_none_or_the_cpu_leaves_the_batch_in_host_memory_and_another_kind_is_refused():
    table = dense_table(50)
    for device in (None, "cpu", torch.device("cpu")):
        collate = ArrowCollate(device=device)
        assert collate.device is None
        assert_same_batch(collate(table), expression(table))
    with pytest.raises(ValueError, match="device='meta'"):
        ArrowCollate(device="meta")


def test_a_collate_with_a_device_pickles_with_it():
    import pickle

    collate = pickle.loads(pickle.dumps(ArrowCollate(columns=["f32"], device="cuda:1")))
    assert collate.device == torch.device("cuda", 1)
    assert "device='cuda:1'" in repr(collate)


def packed_contract():
    return Contract(
        {
            "input_ids": Field(dtype=torch.int64, shape=("T",), pack=True, cast_from=(torch.int32,)),
            "labels": Field(
                dtype=torch.int64, shape=("T",), pack=True, cast_from=(torch.int32,), separator=-100
            ),
        },
        packing=Packing(),
        id=None,
    )


def assert_moved(ours, expected, device):
    """``ours`` is ``expected`` on ``device``: its tensors there, its Python values equal."""
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].device == device, key
    assert_same_batch({k: v.cpu() if torch.is_tensor(v) else v for k, v in ours.items()}, expected)


@pytest.mark.needs_cuda
def test_a_tabular_batch_moved_by_the_collate_is_one_copy_on_the_device():
    table = dense_table(4096).slice(100, 3000)
    collate = ArrowCollate(device="cuda")
    batch = collate(table)
    assert_moved(batch, expression(table), torch.device("cuda", torch.cuda.current_device()))
    large = [t for t in batch.values() if t.nbytes > 4096]
    assert len({t.untyped_storage().data_ptr() for t in large}) == 1, "the large fields are views of one copy"


@pytest.mark.needs_cuda
@pytest.mark.parametrize("gathered", [True, False], ids=["gathered", "the_long_way"])
def test_a_packed_batch_moved_by_the_collate_keeps_its_python_ints_and_one_cu_seq_lens(gathered):
    ids = token_lists(64, seed=5)
    table = pa.table({"input_ids": ids, "labels": ids}).slice(3, 50)
    collate = ArrowCollate(packed_contract(), device="cuda")
    if not gathered:
        collate._layout_for(table).gather = None  # as a table the native call does not cover goes
    batch = collate(table)
    expected = expression(table, packed_contract())
    assert_moved(batch, expected, torch.device("cuda", torch.cuda.current_device()))
    assert type(batch["max_length_q"]) is int
    assert batch["cu_seq_lens_q"] is batch["cu_seq_lens_k"]


@pytest.mark.needs_cuda
def test_four_threads_moving_batches_each_get_their_own_tables_batch():
    tables = [dense_table(1025, seed=s).slice(s, 1000 + s) for s in range(6)]
    expected = [expression(t) for t in tables]
    collate = ArrowCollate(device="cuda")
    kept, failures = [], []

    def run(thread):
        for round_number in range(20):
            which = (thread + round_number) % len(tables)
            batch = collate(tables[which])
            kept.append((which, batch))  # held while later batches reuse the staging slots

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    torch.cuda.synchronize()
    for which, batch in kept:
        try:
            assert_moved(batch, expected[which], batch["f32"].device)
        except AssertionError as error:  # noqa: PERF203 - each failure kept with its table
            failures.append((which, error))
    assert failures == []


def test_max_slots_gives_the_collate_its_own_ring_and_a_full_one_says_to_raise_it():
    import pickle
    import warnings

    table = dense_table(64)
    collate = pickle.loads(pickle.dumps(ArrowCollate(max_slots=2)))
    assert collate.max_slots == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = [collate(table) for _ in range(3)]  # each kept batch holds its slot
    overflow = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert len(overflow) == 1
    assert "all 2 staging slots" in str(overflow[0].message)
    assert "ArrowCollate(max_slots=" in str(overflow[0].message)
    for batch in kept:
        assert_same_batch(batch, expression(table))
