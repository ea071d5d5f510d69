"""Ray's tensor columns gathered from their storage's buffers in C++, with no Ray running: each batch
ArrowCollate gathers natively is the batch of Ray's own default collate (``DefaultCollateFn`` with its
chunks combined: what ``iter_torch_batches`` runs on the CPU) on the same table, for fixed-shape tensors of
each dtype and several shapes, zero-size dims, tables in chunks and slices. A column stored otherwise than
its type says goes the per-sample way, which names its column and row."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from fastcollate import Arrays, Contract, Field
from fastcollate.collate.errors import ContractError
from fastcollate.data import arrow_tensors
from fastcollate.ray import ArrowCollate

from .test_ray_collate import gathered_natively
from .test_ray_tensors import ragged_rows, ragged_tensors, sliced_in_chunks

pytest.importorskip("ray.data.extensions")
from ray.data.collate_fn import DefaultCollateFn  # noqa: E402
from ray.data.extensions import ArrowTensorType, ArrowTensorTypeV2  # noqa: E402

KINDS = ["ray_v1", "ray_v2", "arrow"]


def tensors(kind: str, array: np.ndarray):
    """``array`` (rows first) as a fixed-shape tensor column of ``kind``, zero-size dims included (which
    pyarrow's from_numpy_ndarray and FixedSizeListArray.from_arrays refuse)."""
    flat = pa.array(array.reshape(-1))
    shape, rows = array.shape[1:], len(array)
    size = int(np.prod(shape))
    if kind == "arrow":
        storage = pa.Array.from_buffers(pa.list_(flat.type, size), rows, [None], children=[flat])
        return pa.fixed_shape_tensor(flat.type, shape).wrap_array(storage)
    if kind == "ray_v1":
        offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * size)
        return ArrowTensorType(shape, flat.type).wrap_array(pa.ListArray.from_arrays(offsets, flat))
    offsets = pa.array(np.arange(rows + 1, dtype=np.int64) * size)
    return ArrowTensorTypeV2(shape, flat.type).wrap_array(pa.LargeListArray.from_arrays(offsets, flat))


def image_table(kind: str, images: np.ndarray):
    """A Ray batch of tensors and labels: two zero-copy slices of the table, as a batch across blocks."""
    labels = np.arange(len(images)) % 10
    return sliced_in_chunks({"image": tensors(kind, images), "label": labels})


def rays_default(table) -> dict:
    return DefaultCollateFn(combine_chunks=True, num_workers=0)(table)


def assert_rays_default(batch: dict, table) -> None:
    expected = rays_default(table)
    assert list(batch) == list(expected)
    for key, value in expected.items():
        assert (batch[key].dtype, batch[key].shape) == (value.dtype, value.shape), key
        assert torch.equal(batch[key], value), key


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "dtype", [np.float32, np.float64, np.float16, np.int8, np.uint8, np.int16, np.int32, np.int64]
)
def test_fixed_shape_tensors_of_each_dtype_give_rays_default_batch(kind, dtype):
    images = (np.random.default_rng(1).standard_normal((24, 2, 3)) * 50).astype(dtype)
    table = image_table(kind, images)
    collate = ArrowCollate()
    assert gathered_natively(collate, table)
    assert_rays_default(collate(table), table)


@pytest.mark.parametrize("shape", [(5,), (1, 7), (2, 1, 3), (2, 2, 1, 2)])
def test_fixed_shapes_of_one_to_four_dims_give_rays_default_batch(shape):
    images = np.arange(24 * int(np.prod(shape)), dtype=np.float32).reshape(24, *shape)
    for kind in KINDS:
        table = image_table(kind, images)
        collate = ArrowCollate()
        assert gathered_natively(collate, table), kind
        assert_rays_default(collate(table), table)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (0,), (2, 0, 2)])
def test_zero_size_dims_give_rays_default_shape_and_dtype(kind, shape):
    table = image_table(kind, np.zeros((24, *shape)))
    collate = ArrowCollate()
    assert gathered_natively(collate, table)
    batch = collate(table)
    assert_rays_default(batch, table)
    assert batch["image"].shape == (16, *shape) and batch["image"].dtype == torch.float64
    assert_rays_default(collate.through_arrays(table), table)  # the per-sample way: the same batch
    with pytest.warns(FutureWarning, match="ArrowCollate.through_arrays"):
        assert_rays_default(collate.expression(table), table)  # its old name
    assert Arrays.from_arrow(table)[15]["image"].shape == shape


def test_ragged_tensors_of_zero_size_later_dims_are_padded_along_the_first():
    rows = [np.zeros((n, 0), np.float32) for n in (2, 5, 1, 3)]
    table = pa.table({"points": ragged_tensors(rows)}).slice(1, 3)
    collate = ArrowCollate(Contract({"points": Field(shape=("N", 0), pad=0.0)}, id=None))
    assert gathered_natively(collate, table)
    batch = collate(table)
    assert batch["points"].shape == (3, 5, 0)
    assert batch["points_lengths"].tolist() == [5, 1, 3]


def test_tensor_batches_are_read_from_the_storage_with_no_table_made_in_python(monkeypatch):
    images = np.random.default_rng(2).standard_normal((40, 4, 3)).astype(np.float32)
    rows = ragged_rows([3, 7, 1, 12, 5, 9, 2, 4] * 5, seed=2)
    columns = {"image": tensors("ray_v2", images), "input_ids": ragged_tensors(rows)}
    contract = Contract(
        {"image": Field(shape=(4, 3)), "input_ids": Field(shape=("T",), pad=0)}, id=None
    )
    collate = ArrowCollate(contract)
    collate(pa.table(columns).slice(0, 8))  # the first table of the schema lays the columns out

    def refused(*args, **kwargs):
        raise AssertionError("a batch's table was re-typed in Python")

    monkeypatch.setattr(arrow_tensors, "plain_table", refused)
    batch = collate(sliced_in_chunks(columns, ((9, 13), (25, 11))))
    picked = list(range(9, 22)) + list(range(25, 36))
    assert torch.equal(batch["image"], torch.from_numpy(images[picked]))
    for row, tokens, length in zip(picked, batch["input_ids"], batch["input_ids_lengths"], strict=True):
        assert tokens[:length].tolist() == rows[row].tolist() and not tokens[length:].any()


@pytest.mark.parametrize("kind", ["ray_v2", "arrow"])
def test_a_null_tensor_in_a_later_sliced_batch_is_named_with_its_row(kind):
    images = np.ones((8, 2, 2), np.float32)
    good = tensors(kind, images)
    storage = good.storage
    mask = pa.array([False] * 6 + [True, False])
    if kind == "arrow":
        with_null = pa.FixedSizeListArray.from_arrays(storage.values, 4, mask=mask)
    else:
        with_null = pa.LargeListArray.from_arrays(storage.offsets, storage.values, mask=mask)
    collate = ArrowCollate()
    collate(pa.table({"image": good}))
    later = pa.table({"image": good.type.wrap_array(with_null)})
    table = pa.concat_tables([pa.table({"image": good}).slice(0, 2), later.slice(3, 5)])
    with pytest.raises(ValueError, match=r"column 'image' has a missing value \(null\) in row 5 of the"):
        collate(table)


def test_a_null_ragged_tensor_is_named_with_its_row():
    rows = ragged_rows([3, 1, 4, 2], seed=6)
    good = ragged_tensors(rows)
    storage = good.storage
    nulls = pa.StructArray.from_arrays(
        [storage.field("data"), storage.field("shape")], names=["data", "shape"],
        mask=pa.array([False, False, True, False]),
    )
    collate = ArrowCollate(Contract({"input_ids": Field(shape=("T",), pad=0)}, id=None))
    collate(pa.table({"input_ids": good}))
    with pytest.raises(ValueError, match=r"column 'input_ids' has a missing value \(null\) in row 1 of the"):
        collate(pa.table({"input_ids": good.type.wrap_array(nulls)}).slice(1, 3))


def test_a_corrupt_tensor_column_in_a_later_batch_is_named_with_its_row():
    collate = ArrowCollate()
    collate(pa.table({"image": tensors("ray_v2", np.zeros((4, 2, 2), np.float32))}))
    values = pa.array(np.arange(14, dtype=np.float32))
    storage = pa.LargeListArray.from_arrays(pa.array([0, 4, 8, 10, 14], pa.int64()), values)
    table = pa.table({"image": ArrowTensorTypeV2((2, 2), pa.float32()).wrap_array(storage)})
    assert collate._native_plan(table) is None  # C++ hands the batch over
    with pytest.raises(ValueError, match=r"column 'image' .* holds 2 values in row 2, where its shape"):
        collate(table)


def test_ragged_dims_after_the_first_that_vary_in_a_later_batch_are_named_with_the_row():
    contract = Contract({"points": Field(shape=("N", 3), pad=0.0)}, id=None)
    collate = ArrowCollate(contract)

    def points(*shapes):
        return pa.table({"points": ragged_tensors([np.zeros(shape, np.float32) for shape in shapes])})

    collate(points((2, 3), (1, 3)))
    varying = r"'points' holds ragged tensors whose dims after the first vary: row 2 "
    with pytest.raises(TypeError, match=varying):
        collate(points((2, 3), (4, 3), (1, 5)))
    with pytest.raises(ContractError, match="points"):
        collate(points((2, 4), (3, 4)))


def test_rays_column_of_pickled_objects_is_refused_naming_it():
    from ray.data.extensions import ArrowPythonObjectArray

    objects = ArrowPythonObjectArray.from_objects([{"a": 1}, [1, 2], "x"])
    table = pa.table({"blob": objects, "label": np.arange(3)})
    with pytest.raises(TypeError, match="column 'blob' has the extension type .*pickled_object"):
        ArrowCollate()(table)
