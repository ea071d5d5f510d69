"""Lightning: the Trainer still adds its DistributedSampler, and each batch still reaches the device in
DeviceLoader's one pinned copy.

    from fastcollate.lightning import DeviceLoaderCallback

    loader = DataLoader(fastcollate.with_ids(dataset), batch_size=256, shuffle=True,
                        collate_fn=fastcollate.assemble)
    trainer = lightning.Trainer(strategy="ddp", devices=2, callbacks=[DeviceLoaderCallback(depth=2)])
    trainer.fit(model, loader)

Handing the Trainer a DeviceLoader does not work: Lightning adds its DistributedSampler only to a
``torch.utils.data.DataLoader``, so under DDP every rank would read the whole dataset. The callback
instead wraps every dataloader after Lightning has prepared it (sampler added), in the strategy's
``process_dataloader`` hook; Lightning's own ``transfer_batch_to_device`` then finds the batch on its
device and copies nothing. Lightning is not a dependency of fastcollate: ``pip install lightning``.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError as error:
    raise ImportError(
        "fastcollate.lightning needs Lightning, which is not installed: pip install lightning "
        "(or pip install 'fastcollate[lightning]')"
    ) from error

from ..transfer.device_loader import DeviceLoader
from .lightning_counts import ExactResume

__all__ = ["DeviceLoaderCallback", "ExactResume"]

# What Lightning does to a DataLoader after ``process_dataloader`` (in _process_dataloader) and skips for
# the DeviceLoader it gets instead, done here with Lightning's own helpers. They are private to Lightning,
# so they are imported in this one place, and either may be gone in another version.
try:
    from lightning.fabric.utilities.data import _auto_add_worker_init_fn
except ImportError:
    _auto_add_worker_init_fn = None
try:
    from lightning.pytorch.utilities.combined_loader import _shutdown_workers_and_reset_iterator
except ImportError:
    _shutdown_workers_and_reset_iterator = None

_NO_INSTANCE_HOOK = object()  # the strategy had no process_dataloader of its own: its class's applied


def _seed_workers(dataloader: object, rank: int) -> None:
    """Gives ``dataloader`` Lightning's worker seeding under ``seed_everything(workers=True)`` (which sets
    PL_SEED_WORKERS=1), as the Trainer would have had it not been wrapped: a ``worker_init_fn`` that
    seeds each worker by its id and the rank, set only where the loader has none."""
    if _auto_add_worker_init_fn is not None:
        _auto_add_worker_init_fn(dataloader, rank)
        return
    asked = int(os.environ.get("PL_SEED_WORKERS", 0))
    if asked and hasattr(dataloader, "worker_init_fn") and dataloader.worker_init_fn is None:
        raise RuntimeError(
            "DeviceLoaderCallback: seed_everything(workers=True) asks for seeded DataLoader workers, but "
            "this Lightning version has no lightning.fabric.utilities.data._auto_add_worker_init_fn to "
            "seed them with, and the Trainer cannot see the DataLoader inside the DeviceLoader. Give the "
            "DataLoader worker_init_fn=functools.partial(lightning.fabric.utilities.seed."
            "pl_worker_init_function, rank=trainer.global_rank) yourself, or seed_everything(..., "
            "workers=False)."
        )


def _shut_down_workers(dataloader: object) -> None:
    """Ends a DataLoader's persistent workers, as Lightning does for the loaders it sees at teardown.
    Without Lightning's helper nothing is done: the workers end when the DataLoader is collected."""
    if _shutdown_workers_and_reset_iterator is not None:
        _shutdown_workers_and_reset_iterator(dataloader)


class DeviceLoaderCallback(Callback):
    """Wraps every dataloader the Trainer prepares (train, val, test, predict) in a ``DeviceLoader`` on
    the Trainer's device, after Lightning has added its DistributedSampler.

    Args:
        depth: batches copied ahead of the one being consumed (DeviceLoader's ``depth``).
        transforms: field name to a callable run on the device after the copy (DeviceLoader's
            ``transforms``), e.g. ``{"image": fastcollate.Normalize(mean, std)}``.

    Give the Trainer plain DataLoaders (``collate_fn=fastcollate.assemble`` avoids an extra host copy):
    one already wrapped in a DeviceLoader would get no sampler, and is refused. On the CPU the
    DeviceLoaders pass batches through (transforms still run). The strategy's hook is restored, and the
    DeviceLoaders closed, when the run ends (``teardown``, or ``on_exception``).
    """

    def __init__(
        self,
        depth: int = 2,
        transforms: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    ) -> None:
        if depth < 1:
            raise ValueError(f"DeviceLoaderCallback: depth must be >= 1, got {depth}")
        self.depth = depth
        self.transforms = dict(transforms or {})
        # Set in setup, not here: ddp_spawn pickles the Trainer with its callbacks, and a WeakSet does
        # not pickle.
        self._strategy: Any = None
        self._instance_hook: Any = _NO_INSTANCE_HOOK
        self._made: weakref.WeakSet[DeviceLoader] | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # The Trainer calls setup (trainer/call.py _call_setup_hook) before any loop sets up its data.
        self._finish()  # a run that ended without teardown or on_exception left the hook in place
        strategy = trainer.strategy
        if strategy.root_device.type not in ("cuda", "cpu"):
            raise ValueError(
                f"DeviceLoaderCallback: the Trainer runs on {strategy.root_device}, and DeviceLoader copies "
                "to CUDA devices only (or passes batches through on the CPU): remove the callback there."
            )
        prepare = strategy.process_dataloader  # the strategy's own logic still runs first
        # Weak: a loader Lightning drops (reload_dataloaders_every_n_epochs) frees its pinned slots then,
        # not at the end of the run.
        made: weakref.WeakSet[DeviceLoader] = weakref.WeakSet()

        def process_dataloader(dataloader: object) -> object:
            prepared = prepare(dataloader)
            if isinstance(prepared, DeviceLoader):
                raise TypeError(
                    "DeviceLoaderCallback: the Trainer was given a DeviceLoader. Give it the DataLoader "
                    "itself: Lightning adds its DistributedSampler only to a DataLoader (a DeviceLoader "
                    "would be read whole by every rank), and the callback wraps it after that."
                )
            _seed_workers(prepared, trainer.global_rank)
            device_loader = DeviceLoader(
                prepared, device=strategy.root_device, depth=self.depth, transforms=self.transforms
            )
            made.add(device_loader)
            return device_loader

        self._instance_hook = vars(strategy).get("process_dataloader", _NO_INSTANCE_HOOK)
        strategy.process_dataloader = process_dataloader
        self._strategy, self._made = strategy, made

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._finish()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._finish()  # after an exception the Trainer calls no teardown hook

    def _finish(self) -> None:
        """Restores the strategy's hook, then closes the DeviceLoaders still alive (and ends their
        DataLoaders' persistent workers, which Lightning's teardown no longer reaches)."""
        strategy, self._strategy = self._strategy, None
        if strategy is not None:
            if self._instance_hook is _NO_INSTANCE_HOOK:
                vars(strategy).pop("process_dataloader", None)
            else:
                strategy.process_dataloader = self._instance_hook
            self._instance_hook = _NO_INSTANCE_HOOK
        made, self._made = self._made, None
        for device_loader in list(made or ()):
            device_loader.close()
            _shut_down_workers(device_loader.loader)
