"""The checks of a padded field's declaration (``contract.Field``'s ``pad``, ``mask``, ``mask_dtype``,
``lengths``, ``pad_to_multiple_of`` and ``padding_side``), made when the field is declared, not at its
first batch."""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .contract import Field

# A mask holds 1 at real positions and 0 at padding: bool, or a 0/1 integer or floating-point mask for
# models that take one (Hugging Face's attention_mask is int64).
MASK_DTYPES = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)


def check_padding(field: Field) -> int | None:
    """Raises the ValueError of the first padding setting ``field`` gets wrong; returns its
    pad_to_multiple_of as a Python int (None when not set)."""
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
