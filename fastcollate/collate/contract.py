"""Contract: the declared shape of a batch, field by field, enforced by ``assemble.using(contract)``.

A field is a leaf of the sample's structure, named by its path (``"x"``, ``"meta.boxes"``, ``"0"`` for
the first element of a tuple sample). Each declares its dtype, its shape (fixed sizes, or names for
variable dims), the allowed range of its values, how variable dims are padded, and the conversions
that are allowed. Anything undeclared is an error: nothing is converted or dropped silently.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import torch

from . import padding, tree

__all__ = ["Contract", "Field", "Packing"]

Dim = int | str
_QUANTIZED = (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4)


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
        if self.kind not in ("tensor", "number", "text"):
            raise ValueError(f"Field kind must be 'tensor', 'number' or 'text', got {self.kind!r}")
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(self.shape))
            for dim in self.shape:
                if not (isinstance(dim, str) and dim) and not (isinstance(dim, int) and dim >= 0):
                    raise ValueError(f"shape dims are sizes >= 0 or dim names, got {dim!r} in {self.shape}")
        object.__setattr__(self, "expand_from", tuple(tuple(s) for s in self.expand_from))
        object.__setattr__(self, "cast_from", tuple(self.cast_from))
        if self.range is not None:
            low, high = self.range
            if not low < high:
                raise ValueError(f"range must be (low, high) with low < high, got {self.range}")
        object.__setattr__(self, "pad_to_multiple_of", padding.check_padding(self))
        if self.kind != "tensor" and (self.shape or self.pad is not None or self.expand_from):
            raise ValueError(f"shape, pad and expand_from apply to tensor fields, not {self.kind!r} ones")
        if self.kind == "text" and (self.dtype is not None or self.range is not None):
            raise ValueError("text fields have no dtype or range")
        if self.dtype is not None and (self.dtype.is_complex or self.dtype in _QUANTIZED):
            if self.kind == "number":
                raise ValueError(f"number fields are bool, integer or floating point, not {self.dtype}")
            if self.range is not None:
                raise ValueError(f"a range bounds real values: {self.dtype} has no order")
        for accepted in self.expand_from:
            self._check_expand_from(accepted)
        if self.pack:
            self._check_pack()
            self._check_separator()
        elif self.separator is not None:
            raise ValueError("separator only applies to packed fields: set pack=True")
        elif self.copy_of is not None:
            raise ValueError("copy_of only applies to packed fields: set pack=True")
        if self.copy_of is not None and (not isinstance(self.copy_of, str) or not self.copy_of
                                         or "." in self.copy_of):
            raise ValueError(f"copy_of is the key of a packed field of the same mapping (no dots), "
                             f"got {self.copy_of!r}")

    def _check_separator(self) -> None:
        """At declaration, not at the first batch: the declared dtype must hold the separator (the walk's
        rule, _C.value_fits, as for pad values), and an integer one must be exact as the double it crosses
        to C++ as (|s| <= 2**53)."""
        separator, dtype = self.separator, self.dtype
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

    def _check_pack(self) -> None:
        shape = self.shape or ()
        if not shape or not isinstance(shape[0], str) or any(isinstance(d, str) for d in shape[1:]):
            raise ValueError(f"a packed field's shape names its first dim and only that one, e.g. ('T',), "
                             f"got {self.shape}")
        if self.pad is not None or self.expand_from:
            raise ValueError("a packed field is not padded and does not expand: drop pad and expand_from")

    def _check_expand_from(self, accepted: tuple[int, ...]) -> None:
        """Each shape in expand_from must broadcast to ``shape`` (checked here, not on the first batch)."""
        if self.shape is None:
            raise ValueError("expand_from needs a declared shape to expand to")
        if not all(isinstance(d, int) and d >= 0 for d in accepted):
            raise ValueError(f"expand_from shapes are sizes >= 0, got {accepted}")
        named = any(isinstance(d, str) for d in self.shape)
        if named and len(accepted) != len(self.shape):
            raise ValueError(f"expand_from {accepted} must have as many dims as shape {self.shape} "
                             "(it has named dims)")
        offset = len(self.shape) - len(accepted)
        if offset < 0:
            raise ValueError(f"expand_from {accepted} has more dims than shape {self.shape}")
        for index, size in enumerate(accepted):
            target = self.shape[offset + index]
            if isinstance(target, int) and size not in (1, target):
                raise ValueError(f"expand_from {accepted} does not broadcast to shape {self.shape}")

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
        if self.nested and self.cu_seq_lens is None:
            raise ValueError("Packing(nested=True) needs cu_seq_lens: they are the nested tensors' offsets")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"Packing.max_tokens must be a positive int or None, got {self.max_tokens!r}")
        for name in ("cu_seq_lens", "max_length"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
                if len(value) != 2 or not all(isinstance(k, str) and k for k in value):
                    raise ValueError(f"Packing.{name} is two keys (q, k) or None, got {value!r}")
        if isinstance(self.drop, str):
            raise ValueError(f"Packing.drop is a tuple of keys, got the string {self.drop!r}")
        object.__setattr__(self, "drop", tuple(self.drop))
        if not all(isinstance(k, str) and k and "." not in k for k in self.drop):
            raise ValueError(f"Packing.drop holds keys of the packed fields' mapping (no dots), "
                             f"got {self.drop!r}")
        if not isinstance(self.position_ids_start, int) or isinstance(self.position_ids_start, bool):
            raise ValueError(f"Packing.position_ids_start must be an int, got {self.position_ids_start!r}")
        # int64 positions, up to 2**31 tokens a sample: a start beyond this would wrap.
        if not -(2**62) <= self.position_ids_start <= 2**62:
            raise ValueError(
                f"Packing.position_ids_start must be within +-2**62, got {self.position_ids_start}"
            )

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
        for path, field in self.fields.items():
            if not isinstance(field, Field):
                raise TypeError(f"Contract field {path!r} must be a fastcollate.Field, "
                                f"got {type(field).__name__}")
        keys = set(self.fields)
        added: dict[str, tuple[str, str]] = {}  # key a padded field adds -> (its path, "mask" or "lengths")
        for path, field in self.fields.items():
            if field.pad is None:
                continue
            parent = path.rpartition(".")[0]
            for role, extra in (("mask", self.mask_key(path)), ("lengths", self.lengths_key(path))):
                if extra is None:
                    continue
                full = _in_mapping(parent, extra)
                if full in keys:
                    raise ValueError(f"padded field {path!r} would add {full!r}, which is already a field")
                first, first_role = added.setdefault(full, (path, role))
                # Two masks under one key are check_contract's to judge; a key that is also lengths is not.
                if (first, first_role) != (path, role) and "lengths" in (first_role, role):
                    raise ValueError(f"padded fields {first!r} ({first_role}) and {path!r} ({role}) would "
                                     f"both add {full!r}: give one of them another key")
        self._check_packed(keys, added)
        from .._ext import _C

        # The rules between fields (a shared mask, copies, dropped keys) are the walk's, stated once there.
        _C.check_contract(self.native_specs())

    def _check_packed(self, keys: set[str], added: dict[str, tuple[str, str]]) -> None:
        """Packed fields are one row in one mapping: the same parent and the same named dim, whose
        lengths then agree within each sample; the keys their Packing adds must be free."""
        packed = [path for path, field in self.fields.items() if field.pack]
        if not packed:
            if self.packing is not None:
                raise ValueError("Contract: packing is given but no field is packed: "
                                 "declare Field(pack=True)")
            return
        if self.packing is None:
            object.__setattr__(self, "packing", Packing())
        first = packed[0]
        parent, dim = first.rpartition(".")[0], self.fields[first].shape[0]
        for path in packed[1:]:
            if path.rpartition(".")[0] != parent or self.fields[path].shape[0] != dim:
                raise ValueError(f"packed fields {first!r} and {path!r} must sit in the same mapping and "
                                 f"name the same first dim ({dim!r}): they are packed into one row")
        object.__setattr__(self, "_packed", (parent, [p.rpartition(".")[2] for p in packed]))
        self._check_attention_mask(packed)
        for key in self.packing.keys():
            full = _in_mapping(parent, key)
            if full in keys or full in added:
                raise ValueError(f"the packed fields would add {full!r}, which is already a field: give "
                                 "Packing another key for it, or None")

    def _check_attention_mask(self, packed: list[str]) -> None:
        """An attention_mask is never packed, whatever Packing.drop says."""
        for path in packed:
            if path.rpartition(".")[2] == "attention_mask":
                raise ValueError(
                    f"{path!r} cannot be a packed field: a packed batch has no padding, and an "
                    "attention_mask passed to a model with the batch (model(**batch)) switches off "
                    "transformers' detection of packed sequences, so that samples attend across their "
                    "boundaries. Leave it out of the contract: Packing.drop leaves it out of the batch"
                )

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
        """The fields as the C++ walk reads them."""
        from .._ext import _C

        specs = []
        for path, field in self.fields.items():
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
                spec.mask_name = self.mask_key(path)
                spec.mask_dtype = field.mask_dtype
                spec.lengths_name = self.lengths_key(path) or ""
                spec.pad_to_multiple_of = field.pad_to_multiple_of or 1
                spec.pad_left = field.padding_side == "left"
            if field.pack:
                self._packing_spec(spec, field)
            specs.append(spec)
        return specs

    def packed_fields(self) -> tuple[str, list[str]] | None:
        """The packed fields' parent path and their keys in it; None when nothing is packed."""
        return getattr(self, "_packed", None)

    def _packing_spec(self, spec, field: Field) -> None:
        packing = self.packing
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
            spec.copy_of = _in_mapping(parent, field.copy_of)


def _in_mapping(parent: str, key: str) -> str:
    """The path of ``key`` in the mapping at ``parent`` ("" for the sample itself)."""
    return f"{parent}.{key}" if parent else key


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
