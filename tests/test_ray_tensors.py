"""Tensor extension columns (Ray Data's fixed-shape and ragged tensors, Arrow's fixed_shape_tensor) through
fastcollate.ray.ArrowCollate and Arrays.from_arrow, with no Ray running: each batch equals what the
expression makes of the same values given as plain Arrow columns, gathered natively from the storage's
buffers; what no batch holds is refused, naming the column and row."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from fastcollate import Arrays, Contract, Field, Packing
from fastcollate.ray import ArrowCollate

from .test_ray_collate import assert_parity, expression, gathered_natively

tensor_types = pytest.importorskip("ray.data._internal.tensor_extensions.arrow")
from ray.data._internal.tensor_extensions.arrow import (  # noqa: E402  (after the import check)
    ArrowTensorArray,
    ArrowTensorType,
    ArrowTensorTypeV2,
)

from tests.helpers.batches import assert_same_batch  # noqa: E402


def fixed_tensors(kind, array: np.ndarray):
    """``array`` (rows first) as a fixed-shape tensor column of ``kind``: Ray's v1 or v2, or Arrow's."""
    flat = pa.array(array.reshape(-1))
    shape, rows = array.shape[1:], len(array)
    if kind == "arrow":
        return pa.FixedShapeTensorArray.from_numpy_ndarray(array)
    size = int(np.prod(shape))
    if kind == "ray_v1":
        offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * size)
        return ArrowTensorType(shape, flat.type).wrap_array(pa.ListArray.from_arrays(offsets, flat))
    offsets = pa.array(np.arange(rows + 1, dtype=np.int64) * size)
    return ArrowTensorTypeV2(shape, flat.type).wrap_array(pa.LargeListArray.from_arrays(offsets, flat))


def plain_fixed(array: np.ndarray):
    """The same rows as plain nested fixed-size lists: the oracle's column."""
    values = pa.array(array.reshape(-1))
    for size in reversed(array.shape[1:]):
        values = pa.FixedSizeListArray.from_arrays(values, size)
    return values


def ragged_rows(lengths, inner=(), seed=0, dtype=np.int32):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1000, (n, *inner)).astype(dtype) for n in lengths]


def ragged_tensors(rows):
    """Rows of other first dims as Ray's map_batches returns them: ArrowVariableShapedTensorType."""
    return ArrowTensorArray.from_numpy(np.array(rows + [None], dtype=object)[:-1])


def plain_ragged(rows):
    """The same rows as a plain list column (of fixed-size lists for rows of more than one dim)."""
    inner = rows[0].shape[1:]
    values = pa.array(np.concatenate([row.reshape(-1) for row in rows]))
    for size in reversed(inner):
        values = pa.FixedSizeListArray.from_arrays(values, size)
    offsets = np.concatenate([[0], np.cumsum([len(row) for row in rows])])
    return pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), values)


def sliced_in_chunks(columns: dict, cuts=((3, 9), (15, 7))):
    """Two zero-copy slices of the table of ``columns``, as Ray hands a batch that spans two blocks."""
    table = pa.table(columns)
    return pa.concat_tables([table.slice(start, length) for start, length in cuts])


@pytest.mark.parametrize("kind", ["ray_v1", "ray_v2", "arrow"])
def test_fixed_shape_tensors_are_rows_of_their_shape_as_the_same_fixed_size_lists(kind):
    images = np.random.default_rng(1).standard_normal((24, 2, 3, 4)).astype(np.float32)
    labels = np.arange(24)
    table = sliced_in_chunks({"image": fixed_tensors(kind, images), "label": labels})
    plain = sliced_in_chunks({"image": plain_fixed(images), "label": labels})
    collate = ArrowCollate()
    assert gathered_natively(collate, table)
    batch = collate(table)
    assert_same_batch(batch, expression(plain))
    assert torch.equal(batch["image"], torch.from_numpy(np.concatenate([images[3:12], images[15:22]])))


def test_ray_from_numpy_columns_read_as_arrays_hold_the_arrays_rows():
    images = np.arange(5 * 3 * 2, dtype=np.int16).reshape(5, 3, 2)
    arrays = Arrays.from_arrow(pa.table({"image": ArrowTensorArray.from_numpy(images)}))
    assert torch.equal(arrays[4]["image"], torch.from_numpy(images[4]))


def test_ragged_tensors_of_one_dim_are_padded_and_packed_as_list_columns():
    rows = ragged_rows([3, 7, 1, 12, 5, 9, 2, 4, 8, 6] * 2, seed=2)
    cuts = ((2, 8), (11, 6))
    table = sliced_in_chunks({"input_ids": ragged_tensors(rows), "labels": ragged_tensors(rows)}, cuts)
    plain = sliced_in_chunks({"input_ids": plain_ragged(rows), "labels": plain_ragged(rows)}, cuts)
    padded = Contract(
        {"input_ids": Field(shape=("T",), pad=0), "labels": Field(shape=("S",), pad=-100)}, id=None
    )
    tokens = dict(dtype=torch.int64, shape=("T",), pack=True, cast_from=(torch.int32,))
    packed = Contract(
        {"input_ids": Field(**tokens), "labels": Field(**tokens, separator=-100)}, packing=Packing(), id=None
    )
    for contract in (padded, packed):
        collate = ArrowCollate(contract)
        assert gathered_natively(collate, table)
        assert_same_batch(collate(table), expression(plain, contract))


def test_ragged_tensors_of_two_dims_are_ragged_along_their_first():
    rows = ragged_rows([4, 1, 6, 3, 2, 5, 7, 2, 3, 1] * 2, inner=(3,), seed=3, dtype=np.float32)
    table = sliced_in_chunks({"points": ragged_tensors(rows)}, ((1, 9), (12, 5)))
    plain = sliced_in_chunks({"points": plain_ragged(rows)}, ((1, 9), (12, 5)))
    contract = Contract({"points": Field(shape=("N", 3), pad=0.0)}, id=None)
    assert_parity(plain, contract)
    assert_same_batch(ArrowCollate(contract)(table), expression(plain, contract))
    assert ArrowCollate(contract)(table)["points"].shape == (14, 7, 3)


def test_ragged_tensors_whose_later_dims_vary_are_refused_naming_the_row():
    rows = [np.zeros((2, 3), np.float32), np.zeros((4, 3), np.float32), np.zeros((1, 5), np.float32)]
    table = pa.table({"points": ragged_tensors(rows)})
    message = r"column 'points' holds ragged tensors whose dims after the first vary: row 2 has shape \(1, 5"
    with pytest.raises(TypeError, match=message):
        ArrowCollate()(table)
    with pytest.raises(TypeError, match=message):
        Arrays.from_arrow(table)


def test_ragged_tensors_of_other_later_dims_in_two_record_batches_are_refused_naming_both():
    first = pa.table({"points": ragged_tensors([np.zeros((2, 3), np.float32), np.zeros((1, 3), np.float32)])})
    wider = [np.zeros((2, 4), np.float32), np.zeros((3, 4), np.float32)]
    second = pa.table({"points": ragged_tensors(wider)})
    collate = ArrowCollate(Contract({"points": Field(shape=("N", 3), pad=0.0)}, id=None))
    collate(first)
    with pytest.raises(TypeError, match="column 'points' holds ragged tensors of other dims after the first"):
        collate(pa.concat_tables([first, second]))


def test_a_null_tensor_is_refused_naming_its_row_in_the_batch():
    images = np.ones((6, 2, 2), np.float32)
    tensors = fixed_tensors("ray_v2", images)
    storage = tensors.storage
    with_null = pa.LargeListArray.from_arrays(
        storage.offsets, storage.values, mask=pa.array([False, False, False, False, True, False])
    )
    collate = ArrowCollate()
    collate(pa.table({"image": tensors}))
    table = pa.table({"image": tensors.type.wrap_array(with_null)}).slice(1, 5)
    with pytest.raises(ValueError, match=r"column 'image' has a missing value \(null\) in row 3 of the"):
        collate(table)


def test_fixed_shape_tensors_stored_in_another_dim_order_are_refused_saying_how_to_store_them():
    transposed = np.arange(24, dtype=np.float32).reshape(4, 2, 3).transpose(0, 2, 1)
    table = pa.table({"image": pa.FixedShapeTensorArray.from_numpy_ndarray(transposed)})
    with pytest.raises(TypeError, match=r"column .image. .*\(permutation \[1, 0\]\).*C-contiguous"):
        ArrowCollate()(table)


def test_a_corrupt_fixed_shape_tensor_column_is_named_with_its_row():
    values = pa.array(np.arange(10, dtype=np.float32))
    storage = pa.LargeListArray.from_arrays(pa.array([0, 4, 8, 10], pa.int64()), values)
    table = pa.table({"image": ArrowTensorTypeV2((2, 2), pa.float32()).wrap_array(storage)})
    with pytest.raises(ValueError, match=r"column 'image' .* holds 2 values in row 2, where its shape"):
        ArrowCollate()(table)


@pytest.mark.parametrize("later", ["ray_v2", "ray_v1", "arrow"])
def test_ragged_tensors_stored_with_one_shape_in_a_later_block_stay_ragged(later):
    contract = Contract({"input_ids": Field(shape=("T",), pad=0)}, id=None)
    collate = ArrowCollate(contract)
    rows = ragged_rows([3, 5, 2, 6], seed=4)
    collate(pa.table({"input_ids": ragged_tensors(rows)}))
    one_shape = np.stack(ragged_rows([4, 4, 4], seed=5))
    table = pa.table({"input_ids": fixed_tensors(later, one_shape)}).slice(1, 2)
    assert gathered_natively(collate, table)
    plain = pa.table({"input_ids": plain_ragged(list(one_shape[1:]))})
    assert_same_batch(collate(table), expression(plain, contract))
    assert_same_batch(
        collate(pa.table({"input_ids": ragged_tensors(rows)})),
        expression(pa.table({"input_ids": plain_ragged(rows)}), contract),
    )


def test_a_tensor_column_whose_dtype_changed_between_blocks_is_refused_naming_both_types():
    collate = ArrowCollate(Contract({"input_ids": Field(shape=("T",), pad=0)}, id=None))
    collate(pa.table({"input_ids": ragged_tensors(ragged_rows([3, 5], dtype=np.int32))}))
    with pytest.raises(TypeError, match="column 'input_ids' was .*int32.* in the first batch and is .*int64"):
        collate(pa.table({"input_ids": ragged_tensors(ragged_rows([3, 5], dtype=np.int64))}))


def lent_by(collate, table) -> dict:
    """``collate``'s batch of ``table`` after a first table of its schema was planned: only a later one is
    handed out as it lies."""
    collate(table.slice(0, 1))
    return collate(table)


def lies_in(tensor, buffer) -> bool:
    return buffer.address <= tensor.data_ptr() < buffer.address + buffer.size


def test_a_large_tensor_column_in_one_chunk_is_lent_and_keeps_its_table_alive_a_label_is_copied():
    import gc
    import weakref

    rows = np.random.default_rng(0).standard_normal((1024, 100), dtype=np.float32)  # 400 KB a table
    stored = weakref.ref(rows)
    table = pa.table({"x": ArrowTensorArray.from_numpy(rows), "label": pa.array(np.arange(1024))})
    expected = expression(table.slice(24, 1000))
    batch = lent_by(ArrowCollate(), table.slice(24, 1000))
    assert_same_batch(batch, expected)
    assert batch["x"].data_ptr() == rows[24:].ctypes.data  # a view of the table's buffer, not a copy
    # The label is small: a copy, so that a loop keeping labels keeps none of the tables.
    assert not lies_in(batch["label"], table.column("label").chunk(0).buffers()[1])
    del table, rows
    gc.collect()
    assert stored() is not None  # the view holds the table's memory
    assert_same_batch(batch, expected)
    del batch
    gc.collect()
    assert stored() is None


def test_columns_are_lent_where_rays_collate_lends_them_and_copied_elsewhere():
    n = 1 << 15  # 128 KiB of float32 numbers: past the size a column is copied under
    numbers = np.arange(n, dtype=np.float32)
    lists = np.arange(n * 4, dtype=np.float32)
    table = pa.table(
        {
            "numbers": pa.array(numbers),  # Ray lends a column of numbers
            "lists": pa.FixedSizeListArray.from_arrays(pa.array(lists), 4),  # Ray copies fixed-size lists
        }
    )
    read = {"a": "numbers", "again": "numbers", "lists": "lists"}
    batch = lent_by(ArrowCollate(columns=read), table)
    assert_same_batch(batch, expression(table, columns=read))
    assert batch["a"].data_ptr() == numbers.ctypes.data
    assert not lies_in(batch["again"], table.column("numbers").chunk(0).buffers()[1])  # one view a memory
    assert not lies_in(batch["lists"], table.column("lists").chunk(0).values.buffers()[1])
    batch["lists"].add_(1)  # a loop writing into its batch leaves the table as it was
    assert table.column("lists").chunk(0).values.to_numpy()[:3].tolist() == [0.0, 1.0, 2.0]


def test_a_batch_lent_from_a_table_holds_none_of_the_columns_it_does_not_read():
    import gc
    import weakref

    rows = np.random.default_rng(3).standard_normal((1024, 100), dtype=np.float32)
    unread = np.arange(1 << 20, dtype=np.float64)[:1024].copy()
    unread_ref = weakref.ref(unread)
    table = pa.table({"x": ArrowTensorArray.from_numpy(rows), "other": pa.array(unread)})
    batch = lent_by(ArrowCollate(columns=["x"]), table)
    assert batch["x"].data_ptr() == rows.ctypes.data
    del table, unread
    gc.collect()
    assert unread_ref() is None
    assert list(batch) == ["x"]


def test_a_column_at_an_address_its_dtype_does_not_align_is_copied():
    n = 1 << 15
    raw = np.zeros(n * 8 + 1, dtype=np.uint8)
    raw[1:].view(np.float64)[:] = np.arange(n)  # float64 values starting one byte past an aligned address
    column = pa.Array.from_buffers(pa.float64(), n, [None, pa.py_buffer(raw)[1:]])
    table = pa.table({"v": column})
    batch = lent_by(ArrowCollate(), table)
    assert batch["v"].data_ptr() % 8 == 0
    assert torch.equal(batch["v"], torch.arange(n, dtype=torch.float64))


@pytest.mark.parametrize("why", ["in two chunks", "cast by the contract", "the first table of its schema"])
def test_a_large_column_is_copied_where_it_cannot_be_lent(why):
    rows = np.random.default_rng(1).standard_normal((1024, 100), dtype=np.float32)
    columns = {"x": ArrowTensorArray.from_numpy(rows)}
    table, collate = pa.table(columns), ArrowCollate()
    if why == "in two chunks":
        table = sliced_in_chunks(columns, cuts=((0, 600), (600, 424)))
        collate(pa.table(columns).slice(0, 1))
    elif why == "cast by the contract":
        widened = Field(dtype=torch.float64, shape=(100,), cast_from=(torch.float32,))
        collate = ArrowCollate(Contract({"x": widened}))
        collate(table.slice(0, 1))
    batch = collate(table)
    assert_same_batch(batch, expression(table, collate.contract))
    assert not lies_in(batch["x"], table.column("x").chunk(0).storage.buffers()[-1])


def test_tables_lent_keep_the_contract_of_the_first():
    from fastcollate import ContractError

    rows = np.random.default_rng(2).standard_normal((1024, 100), dtype=np.float32)
    table = pa.table({"x": ArrowTensorArray.from_numpy(rows), "label": pa.array(np.arange(1024))})
    kept = Contract(
        {"x": Field(dtype=torch.float32, shape=(100,)), "label": Field(dtype=torch.int64, shape=())}
    )
    collate = ArrowCollate(kept)
    for start in (0, 300, 600):  # the first table is planned; the later ones come out as they lie
        part = table.slice(start, 400)
        batch = collate(part)
        assert_same_batch(batch, expression(part, kept))
        assert (batch["x"].data_ptr() == rows[start:].ctypes.data) == (start > 0)
    broken = ArrowCollate(Contract({"x": Field(dtype=torch.float32, shape=(99,))}))
    for _ in range(2):  # refused each time: a table that broke a rule never lets the next one skip them
        with pytest.raises(ContractError, match="'x'"):
            broken(table.slice(0, 400))
