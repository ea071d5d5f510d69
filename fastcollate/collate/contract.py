"""Contract: the declared shape of a batch, field by field, enforced by ``assemble.using(contract)``.

A field is a leaf of the sample's structure, named by its path (``"x"``, ``"meta.boxes"``, ``"0"`` for
the first element of a tuple sample). Each declares its dtype, its shape (fixed sizes, or names for
variable dims), the allowed range of its values, how variable dims are padded, and the conversions
that are allowed. Anything undeclared is an error: nothing is converted or dropped silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import torch

from ..structure import tree
from . import declaration_rules, native_contract

__all__ = ["Contract", "Field", "Packing"]

Dim = int | str


@dataclasses.dataclass(frozen=True)
class Field:
    """One declared leaf.

    Args:
        kind: ``"tensor"`` (a tensor or numpy array), ``"number"`` (a Python int, float or bool,
            collated into a 1-D tensor), or ``"text"`` (str or bytes, collated into a list).
        dtype: the batch's dtype for this field. Samples must have it, or one listed in ``cast_from``.
        shape: the per-sample shape: ints are fixed sizes, strings name variable dims. A name shared by
            two fields must have the same size within a sample (``tokens: ("T",)``, ``labels: ("T",)``).
        range: ``(low, high)``: every value must satisfy ``low <= value < high`` (NaN never does).
            For class indices: ``(0, num_classes)``.
        pad: the padding value. When set, named dims are padded on the right (at the end; see
            ``padding_side``) to the batch's longest (see ``pad_to_multiple_of``); the batch gets ``mask``
            (True at real positions, shape ``[batch, *padded named dims]``) and, if named, ``lengths``
            (int64 ``[batch]``, or ``[batch, n_named_dims]``: the real lengths) beside the field.
            Without it, named dims must agree across the batch.
            A real number the dtype holds (a whole one for integer dtypes, within 2**53 of 0; no negative
            one for unsigned dtypes: -1 is refused in uint8, not wrapped to 255).
        mask: the mask's key (default ``"<field>_mask"``); only with ``pad``. Two padded fields may
            name the same mask key when they pad the same named dims (same names, same order) with the
            same ``mask_dtype``: their masks are then equal, and the batch holds it once (BERT's
            ``input_ids`` and ``token_type_ids`` share ``attention_mask``).
        mask_dtype: the mask's dtype (default bool: True at real positions); an integer or
            floating-point dtype gives 1 at real positions and 0 at padding, as Hugging Face models take
            ``attention_mask`` (``torch.int64``). Only with ``pad``.
        lengths: the lengths' key, or None for none (default ``"<field>_lengths"``); only with ``pad``.
        pad_to_multiple_of: only with ``pad``: each named dim is padded to the batch's longest rounded up
            to a multiple of this, as ``DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)`` pads
            (tensor cores, fewer shapes for torch.compile); the mask covers the padded length, 0 at the
            padding. Every named dim of the field is rounded. None (the default) pads to the longest.
        padding_side: only with ``pad``: ``"right"`` (the default: values first, then padding) or
            ``"left"`` (padding first, the values last, mask 0 on the left), as a tokenizer with
            ``padding_side="left"`` pads for batched generation. Every named dim of the field is padded
            on that side. Fields that share a mask share both settings.
        expand_from: other shapes accepted and broadcast to ``shape`` on copy: ``expand_from=((1, 16, 16),)``
            on a ``(3, 16, 16)`` field turns a grayscale image into three identical channels.
        cast_from: other dtypes accepted and converted to ``dtype`` on copy.
        pack: concatenate the field's samples into one row instead of padding them: the batch holds it
            as ``[1, total_tokens, *fixed dims]``, in batch order, beside the keys the contract's
            ``Packing`` names (position ids, ``cu_seq_lens``, ...). Its shape's first dim must be named
            (``("T",)``); every packed field of a contract shares that name and parent mapping.
        separator: only with ``pack``: the value written at each sample's first token (Hugging Face's
            ``DataCollatorWithFlattening`` writes -100 there in ``labels``, so no token predicts the
            first token of the next sample).
        copy_of: only with ``pack``: the key of another packed field of the same mapping whose samples
            this field takes; the samples hold no value of their own for it.
            ``"labels": Field(dtype=torch.int64, shape=("T",), pack=True, separator=-100,
            copy_of="input_ids")`` is the ``labels`` row ``DataCollatorWithFlattening`` makes for samples
            without labels: input_ids' row, -100 at each sample's first token. The copy is checked as a
            field of its own (its dtype, range and cast_from); a copy of a copy is refused.

    A tensor field that declares its dtype and shape also takes, per sample, a list of Python numbers
    (lists of lists for more dims), as tokenizers and ``datasets`` hand out token ids: read in C++ into
    the declared dtype, with the rules of number fields (an int for an integer dtype, not a bool; a bool
    for bool; an int or a float for a floating-point dtype; a value the dtype holds).
    """

    kind: Literal["tensor", "number", "text"] = "tensor"
    dtype: torch.dtype | None = None
    shape: tuple[Dim, ...] | None = None
    range: tuple[float, float] | None = None
    pad: float | int | bool | None = None
    mask: str | None = None
    mask_dtype: torch.dtype = torch.bool
    lengths: str | None = ""
    pad_to_multiple_of: int | None = None
    padding_side: Literal["right", "left"] = "right"
    expand_from: tuple[tuple[int, ...], ...] = ()
    cast_from: tuple[torch.dtype, ...] = ()
    pack: bool = False
    separator: float | int | None = None
    copy_of: str | None = None

    def __post_init__(self) -> None:
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "expand_from", tuple(tuple(s) for s in self.expand_from))
        object.__setattr__(self, "cast_from", tuple(self.cast_from))
        object.__setattr__(self, "pad_to_multiple_of", declaration_rules.check_field(self))

    def describe(self) -> str:
        """One line: ``tensor torch.float32 [3, 16, 16] in [0, 1)``."""
        parts = [self.kind]
        if self.dtype is not None:
            parts.append(str(self.dtype))
        if self.shape is not None:
            parts.append("[" + ", ".join(str(d) for d in self.shape) + "]")
        if self.range is not None:
            parts.append(f"in [{self.range[0]}, {self.range[1]})")
        if self.pad is not None:
            parts.append(f"padded {self.padding_side} with {self.pad!r}")
            if self.pad_to_multiple_of is not None:
                parts.append(f"to a multiple of {self.pad_to_multiple_of}")
            # Only what differs from the defaults, so that contracts that differ there say so in diff().
            if self.mask is not None:
                parts.append(f"mask {self.mask!r}")
            if self.mask_dtype != torch.bool:
                parts.append(f"mask dtype {self.mask_dtype}")
            if self.lengths is None:
                parts.append("no lengths")
            elif self.lengths:
                parts.append(f"lengths {self.lengths!r}")
        if self.expand_from:
            parts.append("expands from " + ", ".join(str(list(s)) for s in self.expand_from))
        if self.cast_from:
            parts.append("casts from " + ", ".join(str(d) for d in self.cast_from))
        if self.pack:
            parts.append("packed" if self.copy_of is None else f"packed, a copy of {self.copy_of!r}")
            if self.separator is not None:
                parts[-1] += f", separator {self.separator!r}"
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Packing:
    """The keys a packed batch holds beside its packed fields (``Field(pack=True)``), in the parent
    mapping of those fields. The defaults are ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``'s
    names and dtypes; ``seq_idx="seq_idx"`` adds its ``return_seq_idx=True``. A key set to None is left out.

    Args:
        position_ids: int64 ``[1, total_tokens]``, counting from ``position_ids_start`` in each sample.
        position_ids_start: the first token's position (RoBERTa-like models start at padding_idx + 1).
        cu_seq_lens: the two keys of the int32 ``[batch + 1]`` offsets, from 0 to total_tokens (one
            tensor under both keys: they are equal, as FlashAttention's q and k offsets are for
            self-attention).
        max_length: the two keys of the longest sample's length, as Python ints (no GPU sync to read).
        seq_idx: int32 ``[1, total_tokens]``, each token's sample index in the batch.
        nested: each packed field as ``torch.nested.nested_tensor_from_jagged(row[0], cu_seq_lens)``
            (shape ``[batch, j, ...]``), a view over the same memory; needs ``cu_seq_lens``.
        max_tokens: a batch of more tokens is refused (a ``ContractSizeError`` naming the sample that
            passes it); None for no budget. Every batch must stay under 2^31 tokens (int32 offsets).
        drop: keys of the packed fields' mapping that the samples carry and the batch leaves out, as
            ``DataCollatorWithFlattening`` leaves them out. By default the tokenizer's
            ``attention_mask``: a packed batch has no padding, and a mask passed to a model with the
            batch (``model(**batch)``) switches off transformers' packed-sequence detection from
            ``position_ids``, so that samples attend across their boundaries. A field declared under
            one of these keys is refused, and ``attention_mask`` is never a packed field.
    """

    position_ids: str | None = "position_ids"
    position_ids_start: int = 0
    cu_seq_lens: tuple[str, str] | None = ("cu_seq_lens_q", "cu_seq_lens_k")
    max_length: tuple[str, str] | None = ("max_length_q", "max_length_k")
    seq_idx: str | None = None
    max_tokens: int | None = None
    nested: bool = False
    drop: tuple[str, ...] = ("attention_mask",)

    def __post_init__(self) -> None:
        for name in ("cu_seq_lens", "max_length"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if not isinstance(self.drop, str):  # a string is refused, not split into keys
            object.__setattr__(self, "drop", tuple(self.drop))
        declaration_rules.check_packing(self)

    def keys(self) -> list[str]:
        """The keys this packing adds, in the order the batch holds them."""
        keys = [self.position_ids, self.seq_idx, *(self.cu_seq_lens or ()), *(self.max_length or ())]
        return [k for k in keys if k]


@dataclasses.dataclass(frozen=True)
class Contract:
    """The declared fields of a batch's samples.

    Args:
        fields: field path to Field. Paths join mapping keys and sequence indices with dots.
        id: the path of the field holding each sample's id (named in errors), or None.
        packing: the keys beside packed fields (``Field(pack=True)``); None for ``Packing()``'s defaults.
    """

    fields: Mapping[str, Field]
    id: str | None = "id"
    packing: Packing | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", dict(self.fields))
        packed = declaration_rules.check_contract(self)
        if packed:
            if self.packing is None:
                object.__setattr__(self, "packing", Packing())
            parent = packed[0].rpartition(".")[0]  # every packed field's: one row in one mapping
            object.__setattr__(self, "_packed", (parent, [path.rpartition(".")[2] for path in packed]))
        declaration_rules.check_with_the_walk(self.native_specs())

    def mask_key(self, path: str) -> str | None:
        field = self.fields[path]
        if field.pad is None:
            return None
        return field.mask or f"{path.rpartition('.')[2]}_mask"

    def lengths_key(self, path: str) -> str | None:
        field = self.fields[path]
        if field.pad is None or field.lengths is None:
            return None
        return field.lengths or f"{path.rpartition('.')[2]}_lengths"

    @classmethod
    def infer(cls, sample: Any, id: str | None = "id") -> Contract:
        """The contract one sample satisfies exactly: every leaf's kind, dtype and shape as they are."""
        fields = {path: _infer_field(value, path) for path, value in tree.leaf_paths(sample)}
        if id is not None and id not in fields:
            id = None
        return cls(fields=fields, id=id)

    def __str__(self) -> str:
        width = max((len(p) for p in self.fields), default=0)
        lines = [f"Contract ({len(self.fields)} fields, id field: {self.id!r})"]
        for path, field in self.fields.items():
            lines.append(f"  {path.ljust(width)}  {field.describe()}")
        if self.packing is not None:
            lines.append(f"  packed beside: {', '.join(self.packing.keys())}")
            if self.packing.drop:
                lines.append(f"  left out of packed batches: {', '.join(self.packing.drop)}")
        return "\n".join(lines)

    def diff(self, other: Contract) -> list[str]:
        """Human-readable differences from ``other``; empty when they are equal."""
        out = []
        for path in self.fields.keys() - other.fields.keys():
            out.append(f"{path}: only in this contract ({self.fields[path].describe()})")
        for path in other.fields.keys() - self.fields.keys():
            out.append(f"{path}: only in the other contract ({other.fields[path].describe()})")
        for path in self.fields.keys() & other.fields.keys():
            if self.fields[path] != other.fields[path]:
                out.append(f"{path}: {self.fields[path].describe()} != {other.fields[path].describe()}")
        if self.id != other.id:
            out.append(f"id field: {self.id!r} != {other.id!r}")
        if self.packing != other.packing:
            out.append(f"packing: {self.packing} != {other.packing}")
        return sorted(out)

    def native_specs(self) -> list:
        """The fields as the C++ walk reads them (fastcollate.collate.native_contract)."""
        return native_contract.field_specs(self)

    def packed_fields(self) -> tuple[str, list[str]] | None:
        """The packed fields' parent path and their keys in it; None when nothing is packed."""
        return getattr(self, "_packed", None)


def _infer_field(value: Any, path: str) -> Field:
    if isinstance(value, torch.Tensor):
        return Field(dtype=value.dtype, shape=tuple(value.shape))
    if isinstance(value, np.ndarray):
        return Field(dtype=torch.from_numpy(np.empty(0, value.dtype)).dtype, shape=value.shape)
    if isinstance(value, bool):
        return Field(kind="number", dtype=torch.bool)
    if isinstance(value, int):
        return Field(kind="number", dtype=torch.int64)
    if isinstance(value, float):
        return Field(kind="number", dtype=torch.float64)
    if isinstance(value, (str, bytes)):
        return Field(kind="text")
    raise TypeError(f"Contract.infer: field {path or '<sample>'!r} is a {type(value).__name__}, "
                    "which a batch cannot hold")
