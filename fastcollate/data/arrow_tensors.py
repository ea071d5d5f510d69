"""Tensor extension columns as the plain Arrow columns that hold the same values, over the same buffers (no
copy of a value): Ray Data's fixed-shape tensors (``ArrowTensorType``, ``ArrowTensorTypeV2``: a list of each
row's values, the shape in the type), Arrow's own ``fixed_shape_tensor`` (a fixed-size list of them) and
Ray's ragged tensors (``ArrowVariableShapedTensorType``: a struct of each row's values and its shape). They
are told apart by extension name, so nothing here imports Ray.

- a fixed shape ``(d1, ..., dk)`` becomes fixed-size lists nested k deep: rows of that shape;
- a ragged tensor of one dim becomes a ``list`` column, padded or packed by a contract as any other;
- a ragged tensor of n dims whose dims after the first agree in every row becomes a list of fixed-size
  lists: ragged along its first dim, as Hugging Face's ``Array2D(shape=(None, k))``. One whose later dims
  vary is refused, naming the row, since no batch of tensors holds it without padding every dim.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["alike", "is_tensor_type", "is_ragged", "plain_array", "plain_table", "row_dims"]

RAY_FIXED = frozenset({"ray.data.arrow_tensor", "ray.data.arrow_tensor_v2"})
ARROW_FIXED = "arrow.fixed_shape_tensor"
RAY_RAGGED = "ray.data.arrow_variable_shaped_tensor"


def is_tensor_type(kind: Any) -> bool:
    """Whether ``kind`` (an Arrow type) is a tensor extension this module reads."""
    name = getattr(kind, "extension_name", None)
    return name in RAY_FIXED or name in (ARROW_FIXED, RAY_RAGGED)


def is_ragged(kind: Any) -> bool:
    """Whether ``kind`` is Ray's ragged tensor type."""
    return getattr(kind, "extension_name", None) == RAY_RAGGED


def row_dims(kind: Any) -> list[int]:
    """Each row's dims in a column of tensor type ``kind``, as its type gives them: -1 for every dim of a
    ragged tensor, whose rows each store their own. What ``_C.ArrowGather`` reads a tensor column's storage
    by (its metadata says the same, in a form of each library's own)."""
    return [-1] * kind.ndim if is_ragged(kind) else [int(dim) for dim in kind.shape]


def alike(first: Any, now: Any) -> bool:
    """Whether tensor types ``first`` and ``now`` hold one column's rows: Ray stores a block of ragged rows
    that happen to share one shape (a block of one row, say) as fixed-shape tensors of that shape."""
    if not (is_tensor_type(first) and is_tensor_type(now)):
        return False
    return _value_type(first) == _value_type(now) and _ndim(first) == _ndim(now)


def _value_type(kind: Any) -> Any:
    return kind.storage_type["data"].type.value_type if is_ragged(kind) else kind.storage_type.value_type


def _ndim(kind: Any) -> int:
    return kind.ndim if is_ragged(kind) else len(kind.shape)


def plain_table(table: Any, names: list[str], who: str, ragged: frozenset[str] = frozenset()) -> Any:
    """``table`` with its tensor extension columns ``names`` as plain columns (see the module); those in
    ``ragged`` as ragged rows even where this table stores them with one shape."""
    import pyarrow as pa

    for name in names:
        at = table.schema.get_field_index(name)
        column = table.column(at)
        chunks, start = [], 0
        for chunk in column.chunks:
            chunks.append(plain_array(chunk, f"{who}: column {name!r}", start, name in ragged))
            start += len(chunk)
        kinds = {chunk.type for chunk in chunks}
        if len(kinds) > 1:
            raise TypeError(
                f"{who}: column {name!r} holds ragged tensors of other dims after the first in one record "
                f"batch than in another ({' and '.join(map(str, kinds))}): only the first dim of a row may "
                "vary. Give every row one shape after its first dim in map_batches (pad or crop), or flatten "
                "each row"
            )
        kind = kinds.pop() if kinds else _plain_type(column.type)
        table = table.set_column(at, name, pa.chunked_array(chunks, type=kind))
    return table


def plain_array(array: Any, where: str, start: int = 0, ragged: bool = False) -> Any:
    """One chunk of a tensor extension column as a plain Arrow array; ``start`` is its first row in the
    table, for the row an error names; ``ragged``: fixed-shape tensors as ragged rows that share a length."""
    kind = array.type
    storage = array.storage
    rows = len(storage)
    mask = storage.is_null() if storage.null_count else None
    if kind.extension_name in RAY_FIXED:
        shape = tuple(kind.shape)
        size = int(np.prod(shape))
        offsets = storage.offsets.to_numpy()
        if (np.diff(offsets) != size).any():
            row = int(np.flatnonzero(np.diff(offsets) != size)[0])
            raise ValueError(
                f"{where} ({kind}) holds {int(offsets[row + 1] - offsets[row])} values in row {start + row}, "
                f"where its shape {shape} holds {size}: the column is corrupt; make it again"
            )
        values = storage.values.slice(int(offsets[0]), rows * size)
        return _as_ragged(values, shape, rows, mask) if ragged else _rows(values, shape, rows, mask)
    if kind.extension_name == ARROW_FIXED:
        shape = tuple(kind.shape)
        permutation = kind.permutation
        if permutation is not None and list(permutation) != list(range(len(shape))):
            raise TypeError(
                f"{where} ({kind}) stores each tensor's values in another order than its dims "
                f"(permutation {list(permutation)}), which no view of its buffer reads: store them in order "
                "(FixedShapeTensorArray.from_numpy_ndarray of a C-contiguous array)"
            )
        size = storage.type.list_size
        values = storage.values.slice(storage.offset * size, rows * size)
        return _as_ragged(values, shape, rows, mask) if ragged else _rows(values, shape, rows, mask)
    return _ragged(storage, kind.ndim, where, start, mask)


def _rows(values: Any, shape: tuple[int, ...], rows: int, mask: Any) -> Any:
    """Flat ``values`` as ``rows`` rows of ``shape``: fixed-size lists nested one a dim."""
    import pyarrow as pa
    import pyarrow.compute  # noqa: F401  (pa.compute)

    if not shape:  # a tensor of no dim: one number a row
        return values if mask is None else pa.compute.if_else(mask, pa.scalar(None, values.type), values)
    for depth in reversed(range(1, len(shape))):
        values = _fixed_size_lists(values, shape[depth], rows * int(np.prod(shape[:depth])), None)
    return _fixed_size_lists(values, shape[0], rows, mask)


def _fixed_size_lists(values: Any, size: int, count: int, mask: Any) -> Any:
    """``count`` fixed-size lists of ``size`` of ``values``. Lists of no value (a zero-size dim) are made
    from their buffers: pyarrow's from_arrays refuses a size of 0, since no values tell their count."""
    import pyarrow as pa
    import pyarrow.compute  # noqa: F401  (pa.compute)

    if size:
        return pa.FixedSizeListArray.from_arrays(values, size, mask=mask)
    validity = None if mask is None else pa.compute.invert(mask).buffers()[1]
    return pa.Array.from_buffers(pa.list_(values.type, 0), count, [validity], children=[values])


def _as_ragged(values: Any, shape: tuple[int, ...], rows: int, mask: Any) -> Any:
    """Flat ``values`` of ``rows`` rows of ``shape`` as a list column ragged along the first dim, as _ragged
    lays Ray's ragged tensors out."""
    import pyarrow as pa

    offsets = pa.array(np.arange(rows + 1, dtype=np.int64) * shape[0])
    return pa.LargeListArray.from_arrays(offsets, _rows(values, shape[1:], rows * shape[0], None), mask=mask)


def _ragged(storage: Any, ndim: int, where: str, start: int, mask: Any) -> Any:
    """Ray's ragged tensors (a struct of ``data``, each row's values, and ``shape``) as a list column, of
    rows of the dims after the first when there are more."""
    import pyarrow as pa
    import pyarrow.compute  # noqa: F401  (pa.compute)

    data = storage.field("data")
    if ndim <= 1:
        if mask is None:
            return data
        mask = pa.compute.or_(mask, data.is_null())
        return pa.LargeListArray.from_arrays(data.offsets, data.values, mask=mask)
    dims = storage.field("shape").flatten().to_numpy().reshape(len(storage), ndim)
    inner = dims[0, 1:] if len(dims) else np.zeros(ndim - 1, dtype=np.int64)
    varies = np.flatnonzero((dims[:, 1:] != inner).any(axis=1))
    if len(varies):
        row = int(varies[0])
        raise TypeError(
            f"{where} holds ragged tensors whose dims after the first vary: row {start + row} has shape "
            f"{tuple(dims[row].tolist())} where row {start} has {tuple(dims[0].tolist())}. Only the first "
            "dim of a row may vary (it is padded or packed): give the rows one shape after their first dim "
            "in map_batches (pad or crop), or flatten each row"
        )
    offsets = data.offsets.to_numpy()
    first = int(offsets[0])
    starts = np.zeros(len(dims) + 1, dtype=np.int64)
    np.cumsum(dims[:, 0], out=starts[1:])
    flat = data.values.slice(first, int(offsets[-1]) - first)
    values = _rows(flat, tuple(inner.tolist()), int(starts[-1]), None)
    if mask is not None:
        mask = pa.compute.or_(mask, data.is_null())
    return pa.LargeListArray.from_arrays(pa.array(starts), values, mask=mask)


def _plain_type(kind: Any) -> Any:
    """The plain type a column of tensor extension ``kind`` becomes (for a column of no chunk)."""
    import pyarrow as pa

    if kind.extension_name == RAY_RAGGED:
        return pa.large_list(kind.storage_type["data"].type.value_type)
    value = kind.storage_type.value_type
    for size in reversed(kind.shape):
        value = pa.list_(value, size)
    return value
