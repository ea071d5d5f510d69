"""The loader a configuration runs, built one way for the bench and the profiler: a DataLoader with the
variant's collate function, behind a DeviceLoader for that variant; and its shutdown."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from ... import _torch_compat
from ...transfer.device_loader import DeviceLoader
from .configs import DEVICE_LOADER_DEPTH, PREFETCH_FACTOR, Setup, Variant

__all__ = ["close_loader", "open_loader", "sync"]


def open_loader(
    setup: Setup,
    variant: Variant,
    workers: int,
    dataset: Dataset,
    transforms: Mapping[str, Callable] | None,
    record_copy_events: bool = False,
    batches: list[list[int]] | None = None,
) -> tuple[DataLoader, Any]:
    """The DataLoader over ``dataset``, and what to iterate: the DataLoader itself, or the DeviceLoader
    around it (given ``transforms``) for a DeviceLoader variant. Workers are persistent, so an epoch's
    start-up is measured once and its end does not wait for workers to exit. ``batches`` (indices into
    ``dataset``) replace ``setup.batch_size`` as the loader's batch sampler."""
    uses_device_loader = variant.transfer == "DeviceLoader"
    extra: dict[str, Any] = {}
    if workers > 0:
        extra = {"persistent_workers": True, "prefetch_factor": PREFETCH_FACTOR}
    if batches is not None:
        extra["batch_sampler"] = batches
    else:
        extra.update(batch_size=setup.batch_size, shuffle=False, drop_last=False)
    loader = DataLoader(
        dataset,
        num_workers=workers,
        collate_fn=setup.baseline_collate if variant.key == "default" else setup.assemble_fn,
        pin_memory=setup.pin_memory and not uses_device_loader,  # DeviceLoader pins into its own ring
        **extra,
    )
    if not uses_device_loader:
        return loader, loader
    source = DeviceLoader(
        loader,
        device=setup.device,
        depth=DEVICE_LOADER_DEPTH,
        transforms=transforms or None,
        record_copy_events=record_copy_events,
    )
    return loader, source


def close_loader(loader: DataLoader, source: Any) -> None:
    """Closes the DeviceLoader (if any) and ends the persistent workers now, rather than when the loader
    is collected, so the next configuration starts on an idle machine."""
    close = getattr(source, "close", None)
    if source is not loader and callable(close):
        close()
    _torch_compat.shut_down_workers(loader)


def sync(device: torch.device) -> None:
    """Waits for the device's queued work, so a timed interval ends when its copies and steps did."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
