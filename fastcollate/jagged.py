"""Packed fields as ``torch.nested`` jagged tensors (``Packing(nested=True)``): a view over the packed row,
with ``cu_seq_lens`` as its offsets, no copy. DeviceLoader splits one into its values and offsets for the
batch's one copy and makes the view again on the device (``split`` and ``join``)."""

from __future__ import annotations

from typing import Any

import torch

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


def split(leaves: list[Any]) -> tuple[list[Any], list[tuple[int, int, int]]]:
    """``leaves`` with each jagged tensor's values and offsets appended, its own place left as None, and
    (place, values' index, offsets' index) for each, for ``join``."""
    out = list(leaves)
    places = []
    for index, leaf in enumerate(leaves):
        if is_jagged(leaf):
            places.append((index, len(out), len(out) + 1))
            out += [leaf.values(), leaf.offsets()]
            out[index] = None
    return out, places


def join(leaves: list[Any], places: list[tuple[int, int, int]], count: int) -> list[Any]:
    """The first ``count`` leaves, with each jagged tensor made again from its (moved) values and offsets."""
    out = leaves[:count]
    for index, values, offsets in places:
        out[index] = torch.nested.nested_tensor_from_jagged(leaves[values], leaves[offsets])
    return out
