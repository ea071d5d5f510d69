"""The one converter of a contract into what the C++ walk and gather read: a ``_C.FieldSpec`` per field, with
the contract's defaults resolved (mask and lengths keys, the packing's keys on each packed field)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .declaration_rules import in_mapping

if TYPE_CHECKING:
    from .contract import Contract, Field

__all__ = ["field_specs"]


def field_specs(contract: Contract) -> list:
    """The fields of ``contract`` as the C++ walk reads them."""
    from .._ext import _C

    specs = []
    for path, field in contract.fields.items():
        spec = _C.FieldSpec()
        spec.path = path
        spec.kind = field.kind
        if field.dtype is not None:
            spec.has_dtype = True
            spec.dtype = field.dtype
        spec.cast_from = list(field.cast_from)
        if field.shape is not None:
            spec.has_shape = True
            spec.shape = [d if isinstance(d, int) else -1 for d in field.shape]
            spec.dim_names = [d if isinstance(d, str) else "" for d in field.shape]
        spec.expand_from = [list(s) for s in field.expand_from]
        if field.range is not None:
            spec.has_range = True
            spec.low, spec.high = float(field.range[0]), float(field.range[1])
        if field.pad is not None:
            spec.padded = True
            spec.pad_value = float(field.pad)
            spec.mask_name = contract.mask_key(path)
            spec.mask_dtype = field.mask_dtype
            spec.lengths_name = contract.lengths_key(path) or ""
            spec.pad_to_multiple_of = field.pad_to_multiple_of or 1
            spec.pad_left = field.padding_side == "left"
        if field.pack:
            _packing_spec(contract, spec, field)
        specs.append(spec)
    return specs


def _packing_spec(contract: Contract, spec, field: Field) -> None:
    packing = contract.packing
    spec.packed = True
    if field.separator is not None:
        spec.has_separator = True
        spec.separator = float(field.separator)
    spec.position_ids_name = packing.position_ids or ""
    spec.position_ids_start = packing.position_ids_start
    spec.cu_seq_lens_names = list(packing.cu_seq_lens or ())
    spec.max_length_names = list(packing.max_length or ())
    spec.seq_idx_name = packing.seq_idx or ""
    spec.max_tokens = packing.max_tokens or 0
    spec.drop_names = list(packing.drop)
    if field.copy_of is not None:
        parent = spec.path.rpartition(".")[0]
        spec.copy_of = in_mapping(parent, field.copy_of)
