"""Every rule of a declaration, checked when a ``Field``, ``Packing`` or ``Contract`` is made rather than at
its first batch: each field's own settings, padding's, packing's, and the rules between fields. Those
between fields that the walk also lays batches out by (a shared mask, copies, dropped keys) are the C++
walk's, asked here through ``_C.check_contract``; the per-sample rules are all the walk's
(csrc/collate/contract_rules)."""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .contract import Contract, Field, Packing

__all__ = ["MASK_DTYPES", "check_contract", "check_field", "check_packing"]

_QUANTIZED = (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4)

# A mask holds 1 at real positions and 0 at padding: bool, or a 0/1 integer or floating-point mask for
# models that take one (Hugging Face's attention_mask is int64).
MASK_DTYPES = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)


def check_field(field: Field) -> int | None:
    """Raises the ValueError of the first setting ``field`` gets wrong; returns its pad_to_multiple_of as a
    Python int (None when not set)."""
    if field.kind not in ("tensor", "number", "text"):
        raise ValueError(f"Field kind must be 'tensor', 'number' or 'text', got {field.kind!r}")
    for dim in field.shape or ():
        if not (isinstance(dim, str) and dim) and not (isinstance(dim, int) and dim >= 0):
            raise ValueError(f"shape dims are sizes >= 0 or dim names, got {dim!r} in {field.shape}")
    if field.range is not None:
        low, high = field.range
        if not low < high:
            raise ValueError(f"range must be (low, high) with low < high, got {field.range}")
    multiple = _check_padding(field)
    if field.kind != "tensor" and (field.shape or field.pad is not None or field.expand_from):
        raise ValueError(f"shape, pad and expand_from apply to tensor fields, not {field.kind!r} ones")
    if field.kind == "text" and (field.dtype is not None or field.range is not None):
        raise ValueError("text fields have no dtype or range")
    unordered = field.dtype is not None and (field.dtype.is_complex or field.dtype in _QUANTIZED)
    if unordered and field.kind == "number":
        raise ValueError(f"number fields are bool, integer or floating point, not {field.dtype}")
    if field.dtype is not None and field.range is not None:
        from .._ext import _C

        if not _C.orders(field.dtype):  # the walk's rule for a sample's dtype under a range
            raise ValueError(f"a range bounds real values: {field.dtype} has no order")
    for accepted in field.expand_from:
        _check_expand_from(field, accepted)
    if field.pack:
        _check_pack(field)
        _check_separator(field)
    elif field.separator is not None:
        raise ValueError("separator only applies to packed fields: set pack=True")
    elif field.copy_of is not None:
        raise ValueError("copy_of only applies to packed fields: set pack=True")
    if field.copy_of is not None and (not isinstance(field.copy_of, str) or not field.copy_of
                                      or "." in field.copy_of):
        raise ValueError(f"copy_of is the key of a packed field of the same mapping (no dots), "
                         f"got {field.copy_of!r}")
    return multiple

def _check_separator(field: Field) -> None:
    """At declaration, not at the first batch: the declared dtype must hold the separator (the walk's
    rule, _C.value_fits, as for pad values), and an integer one must be exact as the double it crosses
    to C++ as (|s| <= 2**53)."""
    separator, dtype = field.separator, field.dtype
    if separator is None:
        return
    if isinstance(separator, bool) or not isinstance(separator, numbers.Real):
        raise ValueError(f"separator must be an int or a float, got {separator!r}")
    if dtype is None:
        return
    if dtype == torch.bool:
        raise ValueError("a packed bool field has no separator value: leave separator unset")
    from .._ext import _C

    exact = not isinstance(separator, numbers.Integral) or abs(separator) <= 2**53
    if exact and _C.value_fits(float(separator), dtype):
        return
    if dtype.itemsize > 8:
        why = "its elements are over 8 bytes: leave separator unset"
    elif dtype.is_floating_point or dtype.is_complex:
        why = "a value it cannot hold"
    else:
        info = torch.iinfo(dtype)
        why = f"a separator is a whole number from {max(info.min, -(2**53))} to {min(info.max, 2**53)}"
    raise ValueError(f"separator {separator!r} does not fit the field's dtype {dtype} ({why})")


def _check_pack(field: Field) -> None:
    shape = field.shape or ()
    if not shape or not isinstance(shape[0], str) or any(isinstance(d, str) for d in shape[1:]):
        raise ValueError(f"a packed field's shape names its first dim and only that one, e.g. ('T',), "
                         f"got {field.shape}")
    if field.pad is not None or field.expand_from:
        raise ValueError("a packed field is not padded and does not expand: drop pad and expand_from")


def _check_expand_from(field: Field, accepted: tuple[int, ...]) -> None:
    """Each shape in expand_from must broadcast to ``shape`` (checked here, not on the first batch)."""
    if field.shape is None:
        raise ValueError("expand_from needs a declared shape to expand to")
    if not all(isinstance(d, int) and d >= 0 for d in accepted):
        raise ValueError(f"expand_from shapes are sizes >= 0, got {accepted}")
    named = any(isinstance(d, str) for d in field.shape)
    if named and len(accepted) != len(field.shape):
        raise ValueError(f"expand_from {accepted} must have as many dims as shape {field.shape} "
                         "(it has named dims)")
    offset = len(field.shape) - len(accepted)
    if offset < 0:
        raise ValueError(f"expand_from {accepted} has more dims than shape {field.shape}")
    for index, size in enumerate(accepted):
        target = field.shape[offset + index]
        if isinstance(target, int) and size not in (1, target):
            raise ValueError(f"expand_from {accepted} does not broadcast to shape {field.shape}")


def _check_padding(field: Field) -> int | None:
    """Padding's settings (``pad``, ``mask``, ``mask_dtype``, ``lengths``, ``pad_to_multiple_of``,
    ``padding_side``); returns pad_to_multiple_of as a Python int (None when not set)."""
    if field.pad is not None and not any(isinstance(d, str) for d in field.shape or ()):
        raise ValueError("pad needs at least one named (variable) dim in shape, e.g. shape=('T',)")
    _check_pad_value(field)
    multiple = _check_side_and_multiple(field)
    if field.pad is None and (field.mask is not None or field.lengths or field.mask_dtype != torch.bool):
        raise ValueError("mask, mask_dtype and lengths only apply to padded fields: set pad=<value>")
    if field.mask_dtype not in MASK_DTYPES:
        raise ValueError(f"mask_dtype must be torch.bool, an integer or a floating-point dtype (a mask "
                         f"of 1 and 0), got {field.mask_dtype!r}; e.g. torch.int64 for Hugging Face")
    return multiple


def _check_pad_value(field: Field) -> None:
    """The pad crosses to C++ as a double, as the separator does, so an integer one must be exact there;
    whether it fits the dtype is the walk's to say (the rule of pad values and separators,
    _C.value_fits: -1 does not fit uint8)."""
    pad, dtype = field.pad, field.dtype
    if pad is None:
        return
    if not isinstance(pad, (numbers.Real, np.bool_)):  # numpy's numbers are, complex ones and str are not
        raise ValueError(f"pad must be a real number (a bool, an int or a float), got {pad!r}")
    if isinstance(pad, numbers.Integral) and abs(int(pad)) > 2**53:
        raise ValueError(f"pad {pad!r} is beyond 2**53: an integer pad is exact only up to there")
    takes_fractions = dtype is None or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool
    if not takes_fractions and not float(pad).is_integer():
        raise ValueError(f"pad {pad!r} is not a value of the field's dtype {dtype}")


def _check_side_and_multiple(field: Field) -> int | None:
    """Tokenizers' padding conventions, for padded fields only: a packed row has no padding."""
    multiple, side = field.pad_to_multiple_of, field.padding_side
    if multiple is not None:
        if isinstance(multiple, (bool, np.bool_)) or not isinstance(multiple, numbers.Integral) \
                or not 1 <= multiple <= 2**31:
            raise ValueError(f"pad_to_multiple_of must be an int from 1 to 2**31 (e.g. 8, as "
                             f"DataCollatorWithPadding takes it), got {multiple!r}")
        multiple = int(multiple)
    if side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', as a tokenizer's, got {side!r}")
    declared = [name for name, value in (("pad_to_multiple_of", multiple), ("padding_side='left'", side))
                if value not in (None, "right")]
    if declared and field.pack:
        raise ValueError(f"{' and '.join(declared)} apply to padded fields, and a packed field has no "
                         "padding (its samples are concatenated): drop them, or declare pad=<value> "
                         "instead of pack=True")
    if declared and field.pad is None:
        raise ValueError(f"{' and '.join(declared)} only apply to padded fields: set pad=<value>")
    return multiple


def check_packing(packing: Packing) -> None:
    """Raises the ValueError of the first setting ``packing`` gets wrong."""
    if packing.nested and packing.cu_seq_lens is None:
        raise ValueError("Packing(nested=True) needs cu_seq_lens: they are the nested tensors' offsets")
    tokens = packing.max_tokens
    if tokens is not None and (not isinstance(tokens, int) or tokens < 1):
        raise ValueError(f"Packing.max_tokens must be a positive int or None, got {tokens!r}")
    for name in ("cu_seq_lens", "max_length"):
        value = getattr(packing, name)
        if value is not None and (len(value) != 2 or not all(isinstance(k, str) and k for k in value)):
            raise ValueError(f"Packing.{name} is two keys (q, k) or None, got {value!r}")
    if isinstance(packing.drop, str):
        raise ValueError(f"Packing.drop is a tuple of keys, got the string {packing.drop!r}")
    if not all(isinstance(k, str) and k and "." not in k for k in packing.drop):
        raise ValueError(f"Packing.drop holds keys of the packed fields' mapping (no dots), "
                         f"got {packing.drop!r}")
    start = packing.position_ids_start
    if not isinstance(start, int) or isinstance(start, bool):
        raise ValueError(f"Packing.position_ids_start must be an int, got {start!r}")
    from .._ext import _C

    # The bound of the kernel that writes the positions: a start beyond it would wrap.
    if not -_C.POSITION_IDS_START_BOUND <= start <= _C.POSITION_IDS_START_BOUND:
        raise ValueError(f"Packing.position_ids_start must be within +-2**62, got {start}")


def check_contract(contract: Contract) -> list[str]:
    """Raises the error of the first rule between ``contract``'s fields that it breaks, but for those the
    walk lays batches out by (check_with_the_walk); returns the packed fields' paths."""
    from .contract import Field, Packing

    for path, field in contract.fields.items():
        if not isinstance(field, Field):
            raise TypeError(f"Contract field {path!r} must be a fastcollate.Field, "
                            f"got {type(field).__name__}")
    keys = set(contract.fields)
    added: dict[str, tuple[str, str]] = {}  # key a padded field adds -> (its path, "mask" or "lengths")
    for path, field in contract.fields.items():
        if field.pad is None:
            continue
        parent = path.rpartition(".")[0]
        for role, extra in (("mask", contract.mask_key(path)), ("lengths", contract.lengths_key(path))):
            if extra is None:
                continue
            full = in_mapping(parent, extra)
            if full in keys:
                raise ValueError(f"padded field {path!r} would add {full!r}, which is already a field")
            first, first_role = added.setdefault(full, (path, role))
            # Two masks under one key are the walk's to judge; a key that is also lengths is not.
            if (first, first_role) != (path, role) and "lengths" in (first_role, role):
                raise ValueError(f"padded fields {first!r} ({first_role}) and {path!r} ({role}) would "
                                 f"both add {full!r}: give one of them another key")
    packed = [path for path, field in contract.fields.items() if field.pack]
    if not packed:
        if contract.packing is not None:
            raise ValueError("Contract: packing is given but no field is packed: declare Field(pack=True)")
        return packed
    _check_packed(contract, packed, keys | set(added), contract.packing or Packing())
    return packed


def _check_packed(contract: Contract, packed: list[str], taken: set[str], packing: Packing) -> None:
    """Packed fields are one row in one mapping: the same parent and the same named dim, whose lengths
    then agree within each sample; an attention_mask is never one of them; the keys their Packing adds
    must be free."""
    first = packed[0]
    parent, dim = first.rpartition(".")[0], contract.fields[first].shape[0]
    for path in packed[1:]:
        if path.rpartition(".")[0] != parent or contract.fields[path].shape[0] != dim:
            raise ValueError(f"packed fields {first!r} and {path!r} must sit in the same mapping and "
                             f"name the same first dim ({dim!r}): they are packed into one row")
    for path in packed:
        if path.rpartition(".")[2] == "attention_mask":
            raise ValueError(
                f"{path!r} cannot be a packed field: a packed batch has no padding, and an "
                "attention_mask passed to a model with the batch (model(**batch)) switches off "
                "transformers' detection of packed sequences, so that samples attend across their "
                "boundaries. Leave it out of the contract: Packing.drop leaves it out of the batch"
            )
    for key in packing.keys():
        full = in_mapping(parent, key)
        if full in taken:
            raise ValueError(f"the packed fields would add {full!r}, which is already a field: give "
                             "Packing another key for it, or None")


def check_with_the_walk(specs: list) -> None:
    """The rules between fields that the walk lays batches out by (a shared mask, copies, dropped keys),
    stated once there: asked of the contract's native specs (fastcollate.collate.native_contract)."""
    from .._ext import _C

    _C.check_contract(specs)


def in_mapping(parent: str, key: str) -> str:
    """The path of ``key`` in the mapping at ``parent`` ("" for the sample itself)."""
    return f"{parent}.{key}" if parent else key
