"""Moving and reading the batches a configuration delivers: to the device, their bytes, their size, and
the ids and targets the reference check compares. Every walk over a batch's nesting is
``fastcollate.structure.tree``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...structure import tree

__all__ = ["CountingTransform", "batch_len", "crossed_bytes", "ids_and_targets", "tensor_bytes", "to_device"]


def to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """``batch`` with every tensor moved to ``device``, its containers rebuilt by ``tree``'s rules."""

    def move(leaf: Any) -> Any:
        return leaf.to(device, non_blocking=non_blocking) if isinstance(leaf, torch.Tensor) else leaf

    return tree.map_leaves(move, batch)


def tensor_bytes(batch: Any) -> int:
    """Bytes held by the tensors of a batch (metadata only: no copy, no device sync)."""
    leaves, _ = tree.flatten(batch)
    return sum(leaf.nelement() * leaf.element_size() for leaf in leaves if isinstance(leaf, torch.Tensor))


def batch_len(batch: Any) -> int:
    """Samples in a batch without ids: the first dimension of its first leaf, 0 when that is no tensor."""
    first = next(tree.leaf_paths(batch), (None, None))[1]  # lazy: the walk stops at the first leaf
    if isinstance(first, torch.Tensor):
        return int(first.shape[0]) if first.dim() else 1
    return 0


class CountingTransform:
    """Wraps a device transform to note the bytes it is given and gives back, call by call, so a
    batch's bytes are counted as they crossed to the device (uint8), not as the model gets them (float).

    Both paths call it once per batch in delivery order (DeviceLoader a few batches ahead), so call
    ``k`` belongs to batch ``k``.
    """

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.calls: list[tuple[int, int]] = []

    def __call__(self, value: Any) -> Any:
        out = self.fn(value)
        self.calls.append((tensor_bytes(value), tensor_bytes(out)))
        return out

    def __repr__(self) -> str:
        return repr(self.fn)


def crossed_bytes(batch: Any, index: int, transforms: Mapping[str, CountingTransform]) -> int:
    """Bytes of batch ``index`` before its device transforms ran."""
    total = tensor_bytes(batch)
    for counter in transforms.values():
        if index < len(counter.calls):
            bytes_in, bytes_out = counter.calls[index]
            total += bytes_in - bytes_out
    return total


def ids_and_targets(batch: Any, target_path: str | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The batch's ``"id"`` tensor and the tensor at ``target_path`` (``ids.guess_target_path``'s), as
    copies: a batch's memory may be a reused slot. None for either that the batch lacks, and for targets
    that are not a tensor of at least one dimension."""
    ids = _field(batch, "id")
    targets = _field(batch, target_path) if target_path else None
    ids = ids.detach().clone() if isinstance(ids, torch.Tensor) else None
    if isinstance(targets, torch.Tensor) and targets.dim() >= 1:
        targets = targets.detach().clone()
    else:
        targets = None
    return ids, targets


def _field(batch: Any, path: str) -> Any:
    """``tree.lookup``'s value at ``path``, or None where the batch has none."""
    try:
        return tree.lookup(batch, path)
    except (KeyError, IndexError, TypeError):  # a batch type whose lookup fails its own way has no field
        return None
