"""Tensors a batch holds where ``tree.flatten`` does not look (inside a dataclass, a custom batch
class), found as the garbage collector sees them, and moved out of page-locked memory that
DeviceLoader recycles before the batch reaches the user."""

from __future__ import annotations

import gc
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["copy_out_hidden", "tensors_inside"]

# Leaves that hold no tensor: not searched (see tensors_inside).
_PLAIN_LEAVES = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)
# Objects not entered while searching a leaf for tensors: they lead to the whole program (a type to its
# module, a function to its globals), not to the batch.
_NOT_ENTERED = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                types.CodeType, types.FrameType, weakref.ref)
_SEARCH_LIMIT = 100_000  # objects visited per leaf at most


def tensors_inside(leaf: Any, wanted: Callable[[torch.Tensor], bool] | None = None,
                   enough: int | None = None) -> list[torch.Tensor]:
    """The tensors a leaf ``tree.flatten`` does not open (a dataclass, a custom batch class) refers to,
    directly or through its attributes and containers, as the garbage collector sees them: those
    ``wanted`` accepts (all by default), the search ending once ``enough`` are found."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    todo = [leaf]
    while todo and len(seen) < _SEARCH_LIMIT and (enough is None or len(found) < enough):
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            if wanted is None or wanted(item):
                found.append(item)
        elif not isinstance(item, _NOT_ENTERED):
            todo.extend(gc.get_referents(item))
    return found


def copy_out_hidden(leaves: list[Any], page_locked: Callable[[torch.Tensor], bool],
                    hidden: int | None = None) -> int:
    """Moves every tensor hidden in a leaf DeviceLoader does not open out of page-locked memory this
    loader recycles (its ring's slots; workers' shared slots it page-locked), in place; returns how many.
    ``hidden``: how many there are, when known (the search ends once they are found).

    DeviceLoader copies to the device only the tensors ``tree.flatten`` finds, and guards their memory
    until its own copy ran. A tensor inside a custom object reaches the user as it is: if it were over a
    recycled page-locked slot, the user's ``.to("cuda", non_blocking=True)`` would read it by DMA after
    the call returned, and once the user dropped the batch a worker (or the ring) could write the next
    batch into the slot while that DMA still reads it: torch guards only its own pinned allocator's
    blocks that way. Over pageable memory (a plain clone) such a copy is staged by the driver before the
    call returns, as with ``default_collate``'s batches."""
    moved = 0
    for leaf in leaves:
        if isinstance(leaf, (torch.Tensor, *_PLAIN_LEAVES)):
            continue
        left = None if hidden is None else hidden - moved
        for tensor in tensors_inside(leaf, lambda t: t.device.type == "cpu" and page_locked(t), left):
            tensor.data = tensor.clone()  # the same Python object, over memory of its own
            moved += 1
    return moved
