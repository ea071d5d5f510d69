"""The batched path of fastcollate.Arrays: a batch laid out column by column (ids, rows, ragged rows
padded with their mask and lengths), gathered by index in C++ straight into the buffer the batch goes
out in. Python runs once per column, never once per sample.

A contract applies per column, once per batch: dtype (``cast_from`` casts during the copy), fixed and
named dims, and ranges, checked vectorized over the gathered column. What this path does not cover
(``expand_from``, text fields, padding a column that is not ragged, one mask shared by two fields, a
padded dim another field names, a range with a cast that can change values, a contract the per-sample
path would refuse) goes the per-sample way instead, with the same result: :func:`layout` returns None.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from ._ext import _C  # also registers the ops
from .arrays import ArrayBatch, Column
from .contract import Contract, Field
from .errors import ERROR_KINDS
from .small_fields import needs_own_storage

__all__ = ["Layout", "layout"]

_ALIGN: int = _C.FIELD_ALIGNMENT  # every field starts at a multiple of this, as the per-sample path lays them


@dataclasses.dataclass
class _Out:
    """One tensor of the batch: where it lies in the buffer and how it is filled."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0
    column: Column | None = None  # None: the ids
    field: Field | None = None
    mask: _Out | None = None  # a ragged column's mask and lengths, filled with it
    lengths: _Out | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass
class Layout:
    """A batch's tensors in output order, and the bytes they need."""

    batch: ArrayBatch | None
    outs: list[_Out]
    nbytes: int = 0
    views: int = 0  # tensors of the batch that are views of the buffer (see StagingRing.views_handed_out)
    id_key: str = "id"  # the collate function's, to name samples when the dataset carries no ids

    def fill(self, buffer: torch.Tensor, small_fields_apart: bool) -> dict[str, Any]:
        """Gathers every column into ``buffer`` (a 1-D uint8 tensor of at least ``nbytes``) and returns the
        batch. With ``small_fields_apart`` a small field of a large batch gets storage of its own
        (fastcollate.small_fields)."""
        self.batch.dataset.check_files()
        indices = torch.from_numpy(self.batch.indices)
        made: dict[str, torch.Tensor] = {}
        self.views = 0
        for out in self.outs:
            if out.key in made:
                continue
            tensors = [o for o in (out, out.mask, out.lengths) if o is not None]
            for o in tensors:
                made[o.key] = self._tensor(buffer, o, small_fields_apart)
            target = made[out.key]
            if out.column is None:
                target.copy_(indices)
            elif out.column.rows is not None:
                torch.ops.fastcollate.gather_into(out.column.rows, indices, target)
            else:
                lengths = (
                    made[out.lengths.key]
                    if out.lengths is not None
                    else torch.empty(len(indices), dtype=torch.int64)
                )
                mask = (
                    made[out.mask.key]
                    if out.mask is not None
                    else torch.empty(target.shape[:2], dtype=torch.bool)
                )
                pad = out.field.pad if out.field is not None and out.field.pad is not None else 0
                torch.ops.fastcollate.gather_ragged_into(
                    out.column.values, out.column.offsets, indices, pad, target, mask, lengths
                )
            if out.field is not None and out.field.range is not None:
                mask = made[out.mask.key] if out.mask is not None else None
                _check_range(target, mask, out, self.batch, self.id_key)
        return made

    def reusable(self) -> bool:
        """Whether every batch of this size from this dataset has this layout: true without ragged columns
        (whose longest row sets the padded length), so the layout is computed once per batch size."""
        return all(out.column is None or out.column.rows is not None for out in self.outs)

    def _tensor(self, buffer: torch.Tensor, out: _Out, small_fields_apart: bool) -> torch.Tensor:
        if small_fields_apart and needs_own_storage(out.nbytes, self.nbytes):
            return torch.empty(out.shape, dtype=out.dtype)
        self.views += 1
        return buffer[out.offset : out.offset + out.nbytes].view(out.dtype).view(out.shape)


def layout(batch: ArrayBatch, contract: Contract | None, id_key: str) -> Layout | None:
    """The batch's layout under ``contract``, or None when the per-sample path must collate it (its
    rules and errors then apply unchanged). Raises the ContractError of the first sample (by batch
    position) that breaks a per-column rule."""
    dataset = batch.dataset
    size = len(batch)
    fields = contract.fields if contract is not None else {}
    keys = ([dataset.id_key] if dataset.id_key is not None else []) + list(dataset.columns)
    if contract is not None and (set(fields) != set(keys) or _shares_a_padded_dim(fields)):
        # A missing or extra key (the id included), or a padded dim another field names too: the
        # per-sample path names the sample and the key, or checks the dim sample by sample.
        return None
    outs: list[_Out] = []
    named: dict[str, tuple[int, str]] = {}  # dim name -> (size, the column that set it)
    for key in keys:
        field = fields.get(key)
        if key == dataset.id_key:
            if field is not None and (
                field.kind != "number" or field.range is not None or field.dtype not in (None, torch.int64)
            ):
                return None
            outs.append(_Out(key, (size,), torch.int64))
            continue
        column = dataset.columns[key]
        source = column.rows if column.rows is not None else column.values
        if field is not None and (field.kind == "text" or field.expand_from or field.pack):
            return None  # packed columns: the per-sample walk packs them (no column-wise packing yet)
        if field is not None and field.kind == "number" and (column.rows is None or column.rows.dim() != 1):
            return None  # a number per sample is a 1-D column
        dtype = _dtype(field, source.dtype, key, batch, id_key)
        if (
            field is not None
            and field.range is not None
            and torch.promote_types(source.dtype, dtype) != dtype
        ):
            return None  # a cast that can change values (narrowing, float to int): check the source's
        if column.rows is not None:
            if field is not None and field.pad is not None:
                return None
            row = tuple(source.shape[1:])
            if field is not None and field.shape is not None:
                _check_shape(field.shape, row, key, named, batch, id_key)
            outs.append(_Out(key, (size, *row), dtype, column=column, field=field))
            continue
        lengths = _ragged_lengths(column, batch.indices)
        inner = tuple(source.shape[1:])
        if field is None or field.pad is None:
            if contract is not None or len(set(lengths.tolist())) > 1:
                return None  # unequal rows without padding: the per-sample path names the first misfit
            outs.append(
                _Out(key, (size, int(lengths[0]) if size else 0, *inner), dtype, column=column, field=field)
            )
            continue
        if (
            field.shape is None
            or not isinstance(field.shape[0], str)
            or any(isinstance(d, str) for d in field.shape[1:])
        ):
            return None
        _check_shape(field.shape[1:], inner, key, named, batch, id_key)
        longest = int(lengths.max()) if size else 0
        out = _Out(key, (size, longest, *inner), dtype, column=column, field=field)
        mask_key, lengths_key = contract.mask_key(key), contract.lengths_key(key)
        if mask_key in {o.key for o in outs}:
            return None  # a mask shared with another field: the per-sample path builds it once
        out.mask = _Out(mask_key, (size, longest), field.mask_dtype)
        if lengths_key is not None:
            out.lengths = _Out(lengths_key, (size,), torch.int64)
        outs += [o for o in (out, out.mask, out.lengths) if o is not None]
    result = Layout(batch, outs, id_key=id_key)
    offset = 0
    for out in outs:
        out.offset = offset
        offset += (out.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    result.nbytes = offset
    return result


def _shares_a_padded_dim(fields: dict[str, Field]) -> bool:
    """Whether a padded field's named dim is named by another field too: its size then varies by sample,
    and agreement is the per-sample path's to check."""
    padded = {d for f in fields.values() if f.pad is not None for d in f.shape or () if isinstance(d, str)}
    seen: set[str] = set()
    for field in fields.values():
        names = {d for d in field.shape or () if isinstance(d, str)}
        if names & padded & seen:
            return True
        seen |= names
    return False


def _ragged_lengths(column: Column, indices: np.ndarray) -> np.ndarray:
    offsets = column.offsets.numpy()
    return offsets[indices + 1] - offsets[indices]


def _dtype(field: Field | None, source: torch.dtype, key: str, batch: ArrayBatch, id_key: str) -> torch.dtype:
    if field is None or field.dtype is None or field.dtype == source:
        return source
    if source in field.cast_from:
        return field.dtype
    name = str(source).removeprefix("torch.")
    raise _error(
        "type",
        batch,
        0,
        key,
        str(field.dtype).removeprefix("torch."),
        name,
        f"convert the column once, or declare cast_from=(torch.{name},)",
        id_key,
    )


def _check_shape(
    declared: tuple, row: tuple[int, ...], key: str, named: dict, batch: ArrayBatch, id_key: str
) -> None:
    """Fixed dims must match; a named dim takes its size from the first column that has it, and every
    other column with it must agree (every row of a column has the same shape, so sample 0 stands for all)."""

    def refuse(expected: str, got: str, hint: str) -> Exception:
        return _error("size", batch, 0, key, expected, got, hint, id_key)

    mismatch = (
        f"shape {list(declared)}",
        f"shape {list(row)}",
        "the column's rows must have the declared shape",
    )
    if len(declared) != len(row):
        raise refuse(*mismatch)
    for want, got in zip(declared, row, strict=True):
        if isinstance(want, str):
            size, owner = named.setdefault(want, (got, key))
            if size != got:
                raise refuse(
                    f"dim {want!r} of size {size} (as in {owner!r})",
                    f"size {got}",
                    "columns sharing a named dim must agree",
                )
        elif want != got:
            raise refuse(*mismatch)


def _check_range(
    values: torch.Tensor, mask: torch.Tensor | None, out: _Out, batch: ArrayBatch, id_key: str
) -> None:
    """The per-sample path's range rule (``low <= v < high``, NaN fails), vectorized over the column; the
    error names the first sample that breaks it. Padding (0 in the ragged column's ``mask``, just
    gathered) is not checked: it is not the sample's."""
    low, high = out.field.range
    size = len(values)
    if values.dtype in (torch.uint16, torch.uint32, torch.uint64):  # torch compares these in few ops
        values = values.to(torch.float64 if values.dtype == torch.uint64 else torch.int64)
    if mask is None:
        real = values.reshape(size, -1)
        inside = (real >= low) & (real < high)
    else:
        real = values.reshape(size, values.shape[1], -1)  # [batch, longest, the rest]
        inside = ((real >= low) & (real < high)) | (mask == 0)[..., None]
        real = real.reshape(size, -1)
    bad = ~inside.reshape(size, -1)
    rows = bad.any(dim=1).nonzero()
    if len(rows):
        position = int(rows[0])
        flat = int(bad[position].nonzero()[0])
        value = float(real[position, flat])
        got = (
            "NaN"
            if value != value
            else "a value below the range"
            if value < low
            else "a value at or above the upper bound"
        ) + f" at flat position {flat}"
        raise _error(
            "value",
            batch,
            position,
            out.key,
            f"values in [{low:g}, {high:g})",
            got,
            "fix the label, or widen the declared range",
            id_key,
        )


def _error(
    kind: str, batch: ArrayBatch, position: int, field: str, expected: str, got: str, hint: str, id_key: str
) -> Exception:
    dataset = batch.dataset
    sample_id = int(batch.indices[position]) if dataset.id_key is not None and len(batch) else None
    return ERROR_KINDS[kind](
        sample_id=sample_id,
        position=position,
        field=field,
        expected=expected,
        got=got,
        hint=hint,
        id_key=dataset.id_key or id_key,
    )
