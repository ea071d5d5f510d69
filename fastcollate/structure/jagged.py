"""Packed fields as ``torch.nested`` jagged tensors (``Packing(nested=True)``): a view over the packed row,
with ``cu_seq_lens`` as its offsets, no copy. DeviceLoader splits one into its values and offsets for the
batch's one copy and makes the view again on the device (``split`` and ``join``)."""

from __future__ import annotations

from typing import Any

import torch

from .._torch_compat import jagged_max_seqlen

__all__ = ["is_jagged", "join", "nest", "split"]


def is_jagged(value: Any) -> bool:
    """A nested tensor of the jagged layout (values and offsets)."""
    return isinstance(value, torch.Tensor) and value.is_nested and value.layout == torch.jagged


def nest(
    batch: Any, parent: str, keys: list[str], offsets_key: str, max_length_key: str | None = None
) -> Any:
    """Replaces each packed row ``batch[parent][key]`` (``[1, total, ...]``) by the jagged tensor over it
    whose offsets are ``batch[parent][offsets_key]``: once a batch, whatever its size. With the batch's
    longest sample under ``max_length_key`` (a Python int), the tensor carries it, so that an operation
    that needs it (SDPA on a GPU) does not read the offsets back from the device."""
    mapping = batch
    for part in parent.split(".") if parent else ():
        mapping = mapping[part]
    offsets = mapping[offsets_key]
    longest = mapping.get(max_length_key) if max_length_key else None
    for key in keys:
        mapping[key] = torch.nested.nested_tensor_from_jagged(mapping[key][0], offsets, max_seqlen=longest)
    return batch


def split(leaves: list[Any]) -> tuple[list[Any], list[tuple[int, int, int, int | None]]]:
    """``leaves`` with each jagged tensor's values appended, and its offsets too unless they are already a
    leaf (``cu_seq_lens``: then the two stay one tensor on the device), its own place left as None; and
    (place, values' index, offsets' index, max_seqlen) for each, for ``join``."""
    out = list(leaves)
    where: dict[int, int] = {}  # a tensor leaf's id -> its first place
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and not is_jagged(leaf):
            where.setdefault(id(leaf), i)
    places = []
    for index, leaf in enumerate(leaves):
        if is_jagged(leaf):
            offsets = leaf.offsets()
            values_at = len(out)
            out.append(leaf.values())
            offsets_at = where.get(id(offsets))
            if offsets_at is None:
                offsets_at = where[id(offsets)] = len(out)
                out.append(offsets)
            places.append((index, values_at, offsets_at, jagged_max_seqlen(leaf)))
            out[index] = None
    return out, places


def join(leaves: list[Any], places: list[tuple[int, int, int, int | None]], count: int) -> list[Any]:
    """The first ``count`` leaves, with each jagged tensor made again from its (moved) values and offsets,
    carrying its max_seqlen still."""
    out = leaves[:count]
    for index, values, offsets, longest in places:
        out[index] = torch.nested.nested_tensor_from_jagged(
            leaves[values], leaves[offsets], max_seqlen=longest
        )
    return out
