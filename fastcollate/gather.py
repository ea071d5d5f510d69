"""The batched path of fastcollate.Arrays: a batch laid out column by column (ids, rows, ragged rows
padded with their mask and lengths, or packed into one row with the keys beside it), gathered by index in
C++ straight into the buffer the batch goes out in. Python runs once per column, never once per sample.

A contract applies per column, once per batch: dtype (``cast_from`` casts during the copy), fixed and
named dims, and ranges, checked vectorized over the gathered column. What this path does not cover
(``expand_from``, text fields, padding a column that is not ragged, one mask shared by two fields, a
padded dim another field names, a cast from floating point to an integer dtype, a range with a cast that
can change values, a separator or pad value the dtype cannot hold, a packed column of fixed-length rows
or of other fixed dims, a contract the per-sample path would refuse) goes the per-sample way instead,
with the same result: :func:`layout` returns None.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from ._ext import _C  # also registers the ops
from .arrays import ArrayBatch, Arrays, Column
from .contract import Contract, Field, Packing
from .errors import ERROR_KINDS
from .mapped_files import is_read_fault
from .small_fields import needs_own_storage

__all__ = ["Layout", "layout"]

_ALIGN: int = _C.FIELD_ALIGNMENT  # every field starts at a multiple of this, as the per-sample path lays them
_MAX_PACKED_TOKENS = 2**31 - 1  # cu_seq_lens are int32 (FlashAttention's and transformers')


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
    packed: bool = False  # a ragged column's rows back to back, [1, total, ...] (Field(pack=True))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass
class _Packing:
    """The keys beside a batch's packed columns (contract.Packing), from the rows' lengths."""

    spec: Packing
    cu_seq_lens: np.ndarray  # int32 [batch + 1]
    position_ids: _Out | None
    seq_idx: _Out | None
    offsets: _Out | None  # the tensor behind both cu_seq_lens keys
    max_length: int

    def outs(self) -> list[_Out]:
        return [o for o in (self.position_ids, self.seq_idx, self.offsets) if o is not None]


@dataclasses.dataclass
class Layout:
    """A batch's tensors in output order, and the bytes they need."""

    batch: ArrayBatch | None
    outs: list[_Out]
    nbytes: int = 0
    views: int = 0  # tensors of the batch that are views of the buffer (see StagingRing.views_handed_out)
    id_key: str = "id"  # the collate function's, to name samples when the dataset carries no ids
    packing: _Packing | None = None

    def fill(self, buffer: torch.Tensor, small_fields_apart: bool) -> dict[str, Any]:
        """Gathers every column into ``buffer`` (a 1-D uint8 tensor of at least ``nbytes``) and returns the
        batch. With ``small_fields_apart`` a small field of a large batch gets storage of its own
        (fastcollate.small_fields)."""
        indices = torch.from_numpy(self.batch.indices)
        made: dict[str, Any] = {}
        self.views = 0
        packing = self.packing
        if packing is not None:
            # The offsets first: the packed columns are gathered at them.
            made.update({o.key: self._tensor(buffer, o, small_fields_apart) for o in packing.outs()})
            cu_seq_lens = torch.from_numpy(packing.cu_seq_lens)
            if packing.offsets is not None:
                made[packing.offsets.key].copy_(cu_seq_lens)
            torch.ops.fastcollate.packed_positions_into(
                cu_seq_lens,
                packing.spec.position_ids_start,
                made[packing.position_ids.key] if packing.position_ids is not None else None,
                made[packing.seq_idx.key] if packing.seq_idx is not None else None,
            )
        for out in self.outs:
            if out.key in made:
                continue
            tensors = [o for o in (out, out.mask, out.lengths) if o is not None]
            for o in tensors:
                made[o.key] = self._tensor(buffer, o, small_fields_apart)
            target = made[out.key]
            if out.column is None:
                target.copy_(indices)
                continue
            if out.packed:
                self._pack(out, target[0], indices, cu_seq_lens)
                continue
            self._gather(out, target, indices, made)
            if out.field is not None and out.field.range is not None:
                mask = made[out.mask.key] if out.mask is not None else None
                _check_range(target, mask, out, self.batch, self.id_key)
        if packing is not None:
            # In DataCollatorWithFlattening's order, after the fields (as the per-sample walk puts them).
            per_token = (packing.position_ids, packing.seq_idx)
            beside = {o.key: made.pop(o.key) for o in per_token if o is not None}
            if packing.offsets is not None:
                offsets = made.pop(packing.offsets.key)
                beside.update(dict.fromkeys(packing.spec.cu_seq_lens, offsets))
            beside.update(dict.fromkeys(packing.spec.max_length or (), packing.max_length))
            made.update(beside)
        return made

    def _gather(self, out: _Out, target: torch.Tensor, indices: torch.Tensor, made: dict[str, Any]) -> None:
        """A column's rows into ``target``; a ragged column's mask and lengths beside it."""
        column, dataset = out.column, self.batch.dataset
        if column.rows is not None:
            _on_column(dataset, column, torch.ops.fastcollate.gather_into, column.rows, indices, target)
            return
        size = len(indices)
        lengths = made[out.lengths.key] if out.lengths is not None else torch.empty(size, dtype=torch.int64)
        mask = made[out.mask.key] if out.mask is not None else torch.empty(target.shape[:2], dtype=torch.bool)
        pad = out.field.pad if out.field is not None and out.field.pad is not None else 0
        _on_column(
            dataset, column, torch.ops.fastcollate.gather_ragged_into,
            column.values, column.offsets, indices, pad, target, mask, lengths,
        )

    def _pack(self, out: _Out, row: torch.Tensor, indices: torch.Tensor, cu_seq_lens: torch.Tensor) -> None:
        """A packed column: its rows back to back into ``row`` ([total, ...]), the range checked on the
        samples' own values, then the separator written at each non-empty sample's first token."""
        column = out.column
        _on_column(
            self.batch.dataset, column, torch.ops.fastcollate.gather_packed_into,
            column.values, column.offsets, indices, cu_seq_lens, row,
        )
        field = out.field
        if field.range is not None:
            _check_packed_range(row, self.packing.cu_seq_lens, out, self.batch, self.id_key)
        if field.separator is not None:
            starts = self.packing.cu_seq_lens[:-1]
            first_tokens = starts[starts < self.packing.cu_seq_lens[1:]]  # empty samples have none
            _write_tokens(row, torch.from_numpy(first_tokens.astype(np.int64)), field.separator)

    def reusable(self) -> bool:
        """Whether every batch of this size from this dataset has this layout: true without ragged columns
        (whose longest row sets the padded length, whose rows set a packed total), so the layout is
        computed once per batch size."""
        return all(out.column is None or out.column.rows is not None for out in self.outs)

    def _tensor(self, buffer: torch.Tensor, out: _Out, small_fields_apart: bool) -> torch.Tensor:
        if small_fields_apart and needs_own_storage(out.nbytes, self.nbytes):
            return torch.empty(out.shape, dtype=out.dtype)
        self.views += 1
        return buffer[out.offset : out.offset + out.nbytes].view(out.dtype).view(out.shape)


def _on_column(dataset: Arrays, column: Column, op: Any, *args: Any) -> None:
    """Runs a gather op over ``column``: an error names the column (and the file, when a read faulted)."""
    try:
        op(*args)
    except (RuntimeError, IndexError) as error:
        if is_read_fault(error):
            raise dataset.read_fault(error, column.name) from error
        raise column.named(error) from error


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
    packed_rows = _packed_rows(batch, contract)
    if packed_rows is False:
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
        if field is not None and (field.kind == "text" or field.expand_from):
            return None
        if field is not None and field.kind == "number" and (column.rows is None or column.rows.dim() != 1):
            return None  # a number per sample is a 1-D column
        dtype = _dtype(field, source.dtype, key, batch, id_key)
        if source.dtype.is_floating_point and not (dtype.is_floating_point or dtype.is_complex):
            return None  # float to int: the walk refuses NaN, infinities and values the dtype cannot hold
        if field is not None and field.range is not None and not _keeps_values(source.dtype, dtype):
            return None  # a cast that can change values (narrowing): the range is the source's to check
        for value in (field.separator, field.pad) if field is not None else ():
            if value is not None and not _holds(value, dtype):
                return None  # the walk names the value the dtype cannot hold
        if field is not None and field.pack:
            inner = tuple(source.shape[1:])
            if tuple(field.shape[1:]) != inner:  # fixed dims only (Field refuses other named dims)
                return None  # the walk names the sample's whole shape against the declared one
            shape = (1, packed_rows.total, *inner)
            outs.append(_Out(key, shape, dtype, column=column, field=field, packed=True))
            continue
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
    if packed_rows is not None:
        result.packing = packed_rows.beside(contract.packing, size)
        outs += result.packing.outs()
    offset = 0
    for out in outs:
        out.offset = offset
        offset += (out.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    result.nbytes = offset
    return result


@dataclasses.dataclass
class _PackedRows:
    """The rows of a batch's packed columns: where each sample starts, and how many tokens in all."""

    cu_seq_lens: np.ndarray  # int64 [batch + 1]
    lengths: np.ndarray

    @property
    def total(self) -> int:
        return int(self.cu_seq_lens[-1])

    def beside(self, spec: Packing, size: int) -> _Packing:
        total = self.total
        return _Packing(
            spec=spec,
            cu_seq_lens=self.cu_seq_lens.astype(np.int32),
            position_ids=_Out(spec.position_ids, (1, total), torch.int64) if spec.position_ids else None,
            seq_idx=_Out(spec.seq_idx, (1, total), torch.int32) if spec.seq_idx else None,
            offsets=_Out(spec.cu_seq_lens[0], (size + 1,), torch.int32) if spec.cu_seq_lens else None,
            max_length=int(self.lengths.max()) if size else 0,
        )


def _packed_rows(batch: ArrayBatch, contract: Contract | None) -> _PackedRows | bool | None:
    """The packed columns' rows; None when nothing is packed, False when the per-sample path must pack
    them: a column of fixed-length rows, a packed dim another field names, a sample whose packed columns
    differ in length, or a batch the walk refuses (no token, more than cu_seq_lens' int32 holds, over
    Packing.max_tokens). The walk then names the sample and the fields, as for any batch."""
    packed = contract.packed_fields() if contract is not None else None
    if packed is None:
        return None
    parent, keys = packed
    if parent:
        return False
    fields = contract.fields
    dim = fields[keys[0]].shape[0]
    if any(not f.pack and dim in (f.shape or ()) for f in fields.values()):
        return False
    columns = [batch.dataset.columns[key] for key in keys]
    if any(column.rows is not None for column in columns):
        return False
    lengths = _ragged_lengths(columns[0], batch.indices)
    if any(not np.array_equal(_ragged_lengths(column, batch.indices), lengths) for column in columns[1:]):
        return False
    cu_seq_lens = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu_seq_lens[1:])
    total, budget = int(cu_seq_lens[-1]), contract.packing.max_tokens
    if total == 0 or total > _MAX_PACKED_TOKENS or (budget is not None and total > budget):
        return False
    return _PackedRows(cu_seq_lens, lengths)


_SIGNED_OF = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def _write_tokens(row: torch.Tensor, tokens: torch.Tensor, value: int | float) -> None:
    """``row[tokens] = value``. torch has no index_put for uint16/32/64: those rows are written through a
    view as the signed type of the same size, with the value's bits."""
    signed = _SIGNED_OF.get(row.dtype)
    if signed is None:
        row[tokens] = value
        return
    bits = signed.itemsize * 8
    row.view(signed)[tokens] = int(value) - (1 << bits) if value >= 1 << (bits - 1) else int(value)


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


def _holds(value: float, dtype: torch.dtype) -> bool:
    """Whether ``value`` is one of ``dtype``'s (not 1e10 as float16, 300 as int8, 2.5 as int64): the
    walk's rule for separators and pad values."""
    if dtype.itemsize > 8:
        return False  # complex128: the walk writes elements of at most 8 bytes, and says so
    if dtype == torch.bool or dtype.is_complex:
        return True
    if dtype.is_floating_point:
        return not math.isfinite(value) or abs(value) <= torch.finfo(dtype).max
    info = torch.iinfo(dtype)
    return float(value).is_integer() and info.min <= value <= info.max


def _keeps_values(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether casting ``source`` to ``target`` keeps every value (a range checked after the cast then
    holds for the source). torch.promote_types refuses uint16/32/64, so this compares ranges itself."""
    if source == target or source == torch.bool:
        return True  # 0 and 1 are values of every dtype
    if target == torch.bool:
        return False
    if source.is_floating_point or source.is_complex:
        floating = target.is_floating_point or target.is_complex
        return floating and torch.promote_types(source, target) == target
    bits = torch.iinfo(source).bits - (torch.iinfo(source).min < 0)  # the integer's magnitude bits
    if target.is_floating_point or target.is_complex:
        mantissa = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53,
                    torch.complex64: 24, torch.complex128: 53}.get(target, 0)
        return bits <= mantissa
    low, high = torch.iinfo(source), torch.iinfo(target)
    return high.min <= low.min and low.max <= high.max


def _ragged_lengths(column: Column, indices: np.ndarray) -> np.ndarray:
    offsets = column.offsets.numpy()
    return offsets[indices + 1] - offsets[indices]


def _dtype(field: Field | None, source: torch.dtype, key: str, batch: ArrayBatch, id_key: str) -> torch.dtype:
    if field is None or field.dtype is None or field.dtype == source:
        return source
    if source in field.cast_from:
        return field.dtype
    # The walk's words, but a column is converted once, not in a transform.
    raise _error(
        "type",
        batch,
        0,
        key,
        str(field.dtype),
        str(source),
        f"convert the column once, or declare cast_from=({source},) on the field",
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
    low, high = map(float, out.field.range)
    size = len(values)
    values = values.to(torch.float64)  # as the walk compares: bounds are doubles, whatever the dtype
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
        raise _range_error(float(real[position, flat]), position, flat, out, batch, id_key)


def _check_packed_range(
    row: torch.Tensor, cu_seq_lens: np.ndarray, out: _Out, batch: ArrayBatch, id_key: str
) -> None:
    """The range rule over a packed row ([total, ...]), before its separators are written: the error
    names the sample the first bad token belongs to, and the flat position within that sample."""
    low, high = map(float, out.field.range)
    values = row.reshape(-1).to(torch.float64)  # as the walk compares
    bad = (~((values >= low) & (values < high))).nonzero()
    if len(bad):
        flat = int(bad[0])
        per_token = max(values.numel() // max(len(row), 1), 1)
        position = int(np.searchsorted(cu_seq_lens, flat // per_token, side="right")) - 1
        within = flat - int(cu_seq_lens[position]) * per_token
        raise _range_error(float(values[flat]), position, within, out, batch, id_key)


def _range_error(
    value: float, position: int, flat: int, out: _Out, batch: ArrayBatch, id_key: str
) -> Exception:
    low, high = out.field.range
    got = (
        "NaN"
        if value != value
        else "a value below the range"
        if value < low
        else "a value at or above the upper bound"
    ) + f" at flat position {flat}"
    return _error(
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
