"""fastcollate.ray: the collate of Ray Data's ``iter_torch_batches``. Ray hands the collate one
``pyarrow.Table`` per batch (often a slice of a larger block, often in chunks); ``ArrowCollate`` gathers its
columns where they lie, in one native call a batch, into the buffer the batch goes out in.

The only module of the package that imports Ray, and only for the class Ray's ``iter_torch_batches``
recognises; without Ray, ``ArrowCollate`` is the same callable over any ``pyarrow.Table``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from ._ext import _C
from .collate import gather
from .collate.assemble import assemble
from .collate.contract import Contract
from .data import arrow_columns, arrow_tensors
from .data.arrays import ColumnChoice

try:
    from ray.data.collate_fn import ArrowBatchCollateFn as _ArrowBatchCollateFn
except ImportError:  # Ray is not installed: the same call, with no Ray class to be
    _ArrowBatchCollateFn = object

__all__ = ["ArrowCollate"]

_WHO = "fastcollate.ray.ArrowCollate"


class _Layout:
    """How the tables of one schema are gathered: an ``_C.ArrowGather``, or None when each of them goes the
    per-sample way (a case of fastcollate.collate.gather.HANDED_TO_THE_WALK); and its tensor extension
    columns, read as the plain columns of their storage."""

    __slots__ = ("gather", "ragged", "schema", "tensors")

    def __init__(self, schema: Any, gather_columns: Any, tensors: list[str], ragged: frozenset[str]) -> None:
        self.schema = schema
        self.gather = gather_columns
        self.tensors = tensors
        self.ragged = ragged  # tensor columns ragged in the first table: ragged in every one

    def plain(self, table: Any) -> Any:
        """``table`` with its tensor columns as the plain columns of their storage."""
        return arrow_tensors.plain_table(table, self.tensors, _WHO, self.ragged) if self.tensors else table


class ArrowCollate(_ArrowBatchCollateFn):
    """The batch of a ``pyarrow.Table``, as ``ds.iter_torch_batches(collate_fn=ArrowCollate(contract))``
    wants one: exactly what ``assemble.using(contract)`` makes of
    ``Arrays.from_arrow(table, columns).__getitems__(range(table.num_rows))`` (dense columns stacked,
    fixed-size lists as rows, ``list`` columns padded or packed by the contract), gathered in C++ from
    the table's own buffers. Ray's tensor columns (``ray.data.from_numpy``'s, and the ragged ones
    ``map_batches`` returns for rows of other shapes) are read from their storage: rows of their shape, or
    ragged along their first dim (see fastcollate.data.arrow_tensors).

    Args:
        contract: the contract each batch is checked against and laid out by; None for drop-in mode.
        columns: the table's columns to read: None for every one, a list of names, or ``{key: column}``.

    Safe to call from several threads at once (Ray's prefetching does). Every table must keep the column
    types of the first: a column whose type changes is refused, naming it. A ragged tensor column stays
    ragged where Ray stores a block of its rows with one shape (a block of one row, say).
    """

    def __init__(self, contract: Contract | None = None, columns: ColumnChoice = None) -> None:
        self.contract = contract
        self.columns = columns
        self._assemble = assemble.using(contract)
        self._layout: _Layout | None = None
        self._first_types: dict[str, Any] | None = None  # {column: Arrow type} of the first table
        self._lock = threading.Lock()

    def __call__(self, table: Any) -> Any:
        table = _as_table(table)
        plan = self._native_plan(table)
        if plan is not None:
            return self._assemble.deliver(plan)
        return self.expression(table)

    def _native_plan(self, table: Any) -> Any:
        """The plan of ``table`` gathered in one native call, or None where it goes the long way."""
        layout = self._layout_for(table)
        if layout.gather is None:
            return None
        return layout.gather.plan(layout.plain(table).__arrow_c_stream__())

    def expression(self, table: Any) -> Any:
        """The batch of ``table`` the long way, through Arrays and the per-batch gather: what ``__call__``
        returns, and what it falls back on for a table it does not gather itself. Its Arrays watch no file:
        Ray's blocks lie in its object store, a shared-memory file Ray writes to all the time, and those
        writes do not move a block's rows."""
        table = _as_table(table)
        arrays = arrow_columns.from_arrow(self._layout_for(table).plain(table), self.columns, watch=False)
        return self._assemble(arrays.__getitems__(list(range(table.num_rows))))

    def _layout_for(self, table: Any) -> _Layout:
        layout = self._layout
        if layout is None or not table.schema.equals(layout.schema):
            layout = self._layout_of(table)
        return layout

    def _layout_of(self, table: Any) -> _Layout:
        """The layout of ``table``'s schema, made from ``table`` (its columns checked as Arrays checks them,
        naming an unreadable one), once for each new schema."""
        with self._lock:
            names = self._sources(table)
            types = {
                name: table.schema.field(name).type for name in names.values() if name in table.schema.names
            }
            if self._first_types is None:
                self._first_types = types
            for name, first in self._first_types.items():
                now = types.get(name)
                if now is not None and now != first and not arrow_tensors.alike(first, now):
                    raise TypeError(
                        f"{_WHO}: column {name!r} was {first} in the first batch and is {now} in this one: a "
                        "column keeps one type across batches. Cast it to one type where it is made (in "
                        "map_batches: pyarrow.compute.cast, or numpy's astype)"
                    )
            tensors = sorted(name for name in types if arrow_tensors.is_tensor_type(types[name]))
            ragged = frozenset(
                name for name in tensors if arrow_tensors.is_ragged(self._first_types.get(name))
            )
            layout = _Layout(table.schema, None, tensors, ragged)
            arrays = arrow_columns.from_arrow(layout.plain(table), self.columns, watch=False)
            chosen = gather.gathered_columns(arrays, self.contract)
            if chosen is not None:
                layout.gather = _C.ArrowGather(
                    [column for column, _ in chosen],
                    [names[key] for _, key in chosen],
                    id_key=self._assemble.id_key,
                    who=_WHO,
                )
            self._layout = layout
            return layout

    def _sources(self, table: Any) -> dict[str, str]:
        """{key: table column} of the columns read."""
        if self.columns is None:
            return {name: name for name in table.column_names}
        if isinstance(self.columns, Mapping):
            return dict(self.columns)
        return {name: name for name in self.columns}

    def __getstate__(self) -> dict:
        return {"contract": self.contract, "columns": self.columns}  # layouts are made again where it lands

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["contract"], state["columns"])

    def __repr__(self) -> str:
        what = "drop-in" if self.contract is None else f"{len(self.contract.fields)}-field contract"
        return f"fastcollate.ray.ArrowCollate({what}, columns={self.columns!r})"


def _as_table(batch: Any) -> Any:
    import pyarrow as pa

    if isinstance(batch, pa.Table):
        return batch
    if isinstance(batch, pa.RecordBatch):
        return pa.Table.from_batches([batch])
    raise TypeError(
        f"{_WHO}: expected a pyarrow.Table (what Ray hands an ArrowBatchCollateFn), got "
        f"{type(batch).__name__}"
    )
