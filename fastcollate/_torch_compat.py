"""Every use of torch's private internals, each guarded: when torch changes one, this module is the only
place to look, and each caller gets a stated fallback instead of an AttributeError.

Checked with torch 2.11 and 2.14 (``make test-compat`` runs the suite on a second torch).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "jagged_max_seqlen",
    "loader_workers",
    "new_shared_storage",
    "release_cached_pinned_memory",
    "shut_down_workers",
    "waited_worker",
]


def jagged_max_seqlen(tensor: torch.Tensor) -> int | None:
    """The longest sequence a jagged nested tensor was made with (``max_seqlen=``), without computing it
    from the offsets (which on a GPU would sync); None when it carries none or torch keeps it elsewhere."""
    value = getattr(tensor, "_maybe_max_seqlen", None)
    return value if isinstance(value, int) else None


def loader_workers(iterator: Any) -> list:
    """A DataLoader iterator's worker processes (``_workers``), in worker-id order; [] when it has
    none or torch no longer keeps them there."""
    return list(getattr(iterator, "_workers", None) or [])


def waited_worker(iterator: Any) -> int | None:
    """The id of the worker whose batch a DataLoader iterator is waiting for (``_task_info`` at
    ``_rcvd_idx``), or None when that is not known."""
    try:
        return int(iterator._task_info[iterator._rcvd_idx][0])
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        return None


def shut_down_workers(loader: Any) -> None:
    """Ends the workers of ``loader``'s current iterator now (persistent workers would otherwise live
    until the loader is collected) and forgets that iterator. Without those internals: nothing."""
    iterator = getattr(loader, "_iterator", None)
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()
    if hasattr(loader, "_iterator"):
        loader._iterator = None


def release_cached_pinned_memory() -> None:
    """Returns the pinned blocks torch's host allocator caches to the system (``_host_emptyCache``), so
    that peak pinned memory is measured from zero. Without it: nothing is released."""
    empty_cache = getattr(torch._C, "_host_emptyCache", None)
    if empty_cache is not None:
        empty_cache()


def new_shared_storage(nbytes: int) -> torch.UntypedStorage:
    """An untyped storage of ``nbytes`` in fresh shared memory, what DataLoader workers send batches in
    (``UntypedStorage._new_shared``, the call torch's own collate makes). Without it: an ordinary
    tensor moved to shared memory, one copy of zeros more."""
    make = getattr(torch.UntypedStorage, "_new_shared", None)
    if make is not None:
        return make(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8).share_memory_().untyped_storage()
