"""The batched path of fastcollate.Arrays: which columns a batch is gathered from, and how (ids, rows,
ragged rows padded with their mask and lengths, or packed into one row with the keys beside it, a
``copy_of`` field gathered again from its source's column, a packed contract's dropped keys left out).
Chosen once per dataset and contract; each batch is then planned and gathered by ``_C.ColumnGather`` in
C++, straight into the buffer the batch goes out in, with no Python per column or per sample.

The contract's rules are the walk's own (csrc/collate/contract_rules.h), applied per column: dtype
(``cast_from`` casts during the copy), fixed and named dims, pads and separators the dtype can hold, and
ranges, checked on the gathered column. The rows are written by the walk's writers (csrc/fill/). Every
case this path leaves to the per-sample walk, which then gives the batch or the error, is listed with its
reason in :data:`HANDED_TO_THE_WALK`.
"""

from __future__ import annotations

from typing import Any

import torch

from .._ext import _C
from ..data.arrays import Arrays
from .contract import Contract, Field

__all__ = ["gathered_columns", "gatherer"]

#: Every case in which :func:`gatherer` (None: no batch of the dataset), ``ColumnGather.plan`` (None:
#: this batch) or ``ArrowGather.plan`` (None: this table) hands the batch to the per-sample walk, and why.
#: The walk gives the same batch or error either way; these are the cases where its rules need each
#: sample, or where it names the sample that broke one. Each place that hands a batch over names its case
#: (``_handed_over`` here, ``handed_to_the_walk`` in C++); tests/test_gather_handovers.py ties the two.
HANDED_TO_THE_WALK: dict[str, str] = {
    # Per dataset and contract (gatherer, _column, _packs_by_column):
    "a missing or extra key": "the walk names the sample and the key (the id's included)",
    "a padded dim another field names": "its size varies by sample; agreement is checked sample by sample",
    "a copy_of field the samples also hold": "the walk refuses the key, naming sample 0",
    "a dropped id key": "the walk names samples by the id the batch leaves out",
    "an id field other than an int64 number": "the walk applies the field's rules to each id",
    "a shared mask": "the walk builds one mask for the fields that share it, checking they agree",
    "packed fields in a nested mapping": "the column gather lays out the sample's top level only",
    "a packed dim named by an unpacked field": "its size varies by sample",
    "a packed column of fixed-length rows": "the walk names the sample whose shape breaks the declared one",
    "packed rows of other fixed dims": "the walk names the sample's whole shape against the declared one",
    "a text field, or one with expand_from": "a string is not a column, and a broadcast is per sample",
    "a number field on a ragged or multi-dim column": "the walk names the sample that is not one number",
    "a stored dtype that is not the samples'": "the rules are the samples' dtype's; a cast that keeps "
                                                "every value is gathered",
    "a cast from floating point to integers": "the walk refuses NaN, infinities and values out of range",
    "a range with a cast that can change values": "the range is the source's to check, before the cast",
    "a pad on a column of fixed-length rows": "the walk checks each sample's shape",
    "ragged rows under a contract without a pad": "the walk checks each sample's shape",
    "a pad along a dim other than dim 0": "the column gather pads dim 0 alone",
    # Per batch (ColumnGather::plan in csrc/collate/column_gather.cpp):
    "ragged rows of unequal length without a pad": "the walk names the first sample that differs",
    "a packed batch with no token": "the walk raises it for the whole batch",
    "a packed batch past cu_seq_lens' int32 or Packing.max_tokens": "the walk names the sample that crosses",
    "packed fields whose rows differ in length": "the walk names the sample whose fields differ",
    "a pad or separator the dtype cannot hold": "the walk names it after the samples' own rules, in its "
                                                "order of fields",
    "a broken dtype, shape or named dim after a column with a range": "the walk checks each field's values "
                                                                      "before the next field's rules",
    # Per table of fastcollate.ray.ArrowCollate (ArrowGather::plan in csrc/collate/arrow_gather.cpp), to
    # ArrowCollate.expression, the per-sample way:
    "an empty table": "the per-sample way raises the empty batch's error",
    "a column the table lacks": "the per-sample way names the missing column",
    "a column laid out unlike the first table's": "the per-sample way reads it as it lies (another "
                                                  "storage, tensor type or ragged dims), or names what is "
                                                  "wrong with it",
}

_Kind = _C.GatheredKind


def _handed_over(reason: str) -> None:
    """None: the batch goes to the per-sample walk, for ``reason`` (a key of :data:`HANDED_TO_THE_WALK`)."""
    return None


def gatherer(dataset: Arrays, contract: Contract | None, id_key: str) -> Any:
    """The dataset's columns as ``_C.ColumnGather`` gathers them under ``contract``, or None when no batch
    of it goes this way (a case of :data:`HANDED_TO_THE_WALK`)."""
    chosen = gathered_columns(dataset, contract)
    if chosen is None:
        return None
    # Samples are named by the collate's id key, as the walk names them: a sample's id is its index when
    # the dataset's id key is that one.
    by_index = dataset.index_as is not None and dataset.index_as == id_key
    return _C.ColumnGather(
        [column for column, _ in chosen], length=len(dataset), id_key=id_key, ids_are_indices=by_index,
        rows_of=dataset.rows_of,
    )


def gathered_columns(dataset: Arrays, contract: Contract | None) -> list[tuple[Any, str | None]] | None:
    """Each output key of the dataset's batches under ``contract``, in batch order, as a
    ``_C.GatheredColumn`` with the dataset key whose column it reads (None for the ids); None when no batch
    of it is gathered (a case of :data:`HANDED_TO_THE_WALK`)."""
    fields = contract.fields if contract is not None else {}
    dropped = _dropped(contract)
    copies = {key: field.copy_of for key, field in fields.items() if field.copy_of is not None}
    if dataset.index_as in dropped:
        return _handed_over("a dropped id key")
    if any(key in dataset.columns for key in copies):
        return _handed_over("a copy_of field the samples also hold")
    keys = [dataset.index_as] if dataset.index_as is not None else []
    keys += [key for key in dataset.columns if key not in dropped]
    if contract is not None and set(fields) != {*keys, *copies}:
        return _handed_over("a missing or extra key")
    if contract is not None and _shares_a_padded_dim(fields):
        return _handed_over("a padded dim another field names")
    if _packs_by_column(dataset, contract) is None:
        return None
    specs = {spec.path: spec for spec in contract.native_specs()} if contract is not None else {}
    columns = []
    taken: set[str] = set()  # the batch's keys so far, masks and lengths included
    for key in _in_batch_order(keys, copies):
        field = fields.get(key)
        if key == dataset.index_as:
            if field is not None and (
                field.kind != "number" or field.range is not None or field.dtype not in (None, torch.int64)
            ):
                return _handed_over("an id field other than an int64 number")
            columns.append((_C.GatheredColumn(kind=_Kind.IDS, key=key, dtype=torch.int64), None))
            continue
        # A copy is its source's column under its own field, as the walk reads its source's samples.
        source = copies.get(key, key)
        column = _column(dataset.columns[source], key, field, specs.get(key), contract is not None)
        if column is None:
            return None
        if field is not None and field.pad is not None:
            mask = contract.mask_key(key)
            if mask in taken:
                return _handed_over("a shared mask")
            taken.update((mask, contract.lengths_key(key)))
        taken.add(key)
        columns.append((column, source))
    return columns


def _dropped(contract: Contract | None) -> set[str]:
    """The samples' keys a packed contract leaves out of the batch (Packing.drop), at the top level."""
    packed = contract.packed_fields() if contract is not None else None
    if packed is None or packed[0]:
        return set()  # nothing packed, or packed in a nested mapping, which the walk collates
    return set(contract.packing.drop)


def _in_batch_order(keys: list[str], copies: dict[str, str]) -> list[str]:
    """The batch's keys as the walk orders them: the samples', each copy right after its source."""
    ordered = []
    for key in keys:
        ordered.append(key)
        ordered.extend(copy for copy, source in copies.items() if source == key)
    return ordered


def _column(column: Any, key: str, field: Field | None, spec: Any, has_contract: bool) -> Any:
    """How ``column`` is gathered under ``field``, or None when the per-sample path must collate it."""
    source = column.first
    held = column.dtype or source.dtype  # what a sample holds: the stored dtype, or a Hugging Face format's
    # The dtype the copy makes; a dtype the source cannot be cast to is C++'s to refuse (dtype_rule).
    declared = field.dtype if field is not None and field.dtype is not None else held
    if held != source.dtype and field is not None:
        # The contract's rules are the dtype samples hold's, and the copy casts from the stored one in one
        # step: C++ sees the stored dtype, so the samples' one is the walk's to check, unless taken as is or
        # cast from; and the stored one's cast to it must keep every value.
        taken = held in (declared, *field.cast_from)
        if not taken or not (declared == held or _C.keeps_values(source.dtype, held)):
            return _handed_over("a stored dtype that is not the samples'")
        spec.cast_from = [*spec.cast_from, source.dtype]
    if field is not None:
        if field.kind == "text" or field.expand_from:
            return _handed_over("a text field, or one with expand_from")
        if field.kind == "number" and (column.ragged or source.dim() != 1):  # a number per sample: 1-D
            return _handed_over("a number field on a ragged or multi-dim column")
        if held.is_floating_point and not (declared.is_floating_point or declared.is_complex):
            return _handed_over("a cast from floating point to integers")
        if field.range is not None and not _C.keeps_values(source.dtype, declared):
            return _handed_over("a range with a cast that can change values")
    made = {"key": key, "dtype": declared, "field": spec, **_sources(column)}
    if field is not None and field.pack:
        if tuple(field.shape[1:]) != tuple(source.shape[1:]):  # fixed dims only (Field refuses named ones)
            return _handed_over("packed rows of other fixed dims")
        return _C.GatheredColumn(kind=_Kind.PACKED, **made)
    if not column.ragged:
        if field is not None and field.pad is not None:
            return _handed_over("a pad on a column of fixed-length rows")
        return _C.GatheredColumn(kind=_Kind.ROWS, **made)
    if field is None or field.pad is None:
        if has_contract:
            return _handed_over("ragged rows under a contract without a pad")
        return _C.GatheredColumn(kind=_Kind.RAGGED, **made)
    shape = field.shape
    if shape is None or not isinstance(shape[0], str) or any(isinstance(d, str) for d in shape[1:]):
        return _handed_over("a pad along a dim other than dim 0")
    return _C.GatheredColumn(kind=_Kind.RAGGED, **made)


def _sources(column: Any) -> dict[str, list[torch.Tensor]]:
    """The column's chunks as GatheredColumn takes them: rows, or values and offsets."""
    chunks = column.chunks
    if not column.ragged:
        return {"rows": [c.rows for c in chunks]}
    return {"values": [c.values for c in chunks], "offsets": [c.offsets for c in chunks]}


def _packs_by_column(dataset: Arrays, contract: Contract | None) -> bool | None:
    """True when the contract's packed fields (if any) can be packed column by column; None (handed to the
    walk) when nested, when a packed dim is named by a field that is not packed, or when a packed column
    has fixed-length rows. Rows that differ in length between packed fields, and batches the walk refuses
    (no token, more than cu_seq_lens' int32 holds, over Packing.max_tokens), are found per batch, in C++."""
    packed = contract.packed_fields() if contract is not None else None
    if packed is None:
        return True
    parent, keys = packed
    if parent:
        return _handed_over("packed fields in a nested mapping")
    fields = contract.fields
    dim = fields[keys[0]].shape[0]
    if any(not f.pack and dim in (f.shape or ()) for f in fields.values()):
        return _handed_over("a packed dim named by an unpacked field")
    if not all(dataset.columns[fields[key].copy_of or key].ragged for key in keys):
        return _handed_over("a packed column of fixed-length rows")
    return True


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

