"""Lightning's batch counts, kept equal to what the training loader delivers: ``ExactResume``.

Lightning counts a training epoch's batches once, in ``FitLoop.setup_data``: its limits from ``len()``
before it loads a checkpoint's loader state, the epoch's length (``trainer.num_training_batches``) right
after, and neither again. A loader whose length changes after the load (a resume on another world size:
the batches run before the checkpoint plus those left, cut for the new ranks) or from one epoch to the
next (``TokenBudgetBatches``) then has its epochs cut short or waited on: samples are lost, silently.
``ExactResume`` counts them again from ``len()`` where the length can have changed.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

# Lightning's own pieces of setup_data, private to it: imported in this one place, and checked where the
# callback starts, so another version fails with a reason instead of counting wrong.
try:
    from lightning.fabric.utilities.data import sized_len
    from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
    from lightning.pytorch.trainer.states import RunningStage
except ImportError:  # pragma: no cover - another Lightning version
    sized_len = _parse_num_batches = RunningStage = None

__all__ = ["ExactResume"]

_LOOP_PARTS = ("_combined_loader", "_data_fetcher", "max_batches", "epoch_progress", "epoch_loop")


class ExactResume(Callback):
    """Keeps Lightning's count of training batches equal to the training loader's ``len()``, so that
    every epoch ends when its batches do: a resumed one, on any world size, and every later one, also
    when epochs differ in length (``TokenBudgetBatches``).

        trainer = lightning.Trainer(strategy="ddp", devices=3, callbacks=[ExactResume()])
        trainer.fit(model, loader, ckpt_path="last.ckpt")  # loader: a StatefulDataLoader

    Lightning takes the count once, before it loads the checkpoint's loader state, and never again. The
    callback counts again when training starts (after the load), when each epoch starts (before the
    progress bar reads the count, when it is listed before it, as the Trainer's ``callbacks`` are), and
    at each batch (an epoch that follows a checkpoint taken at its predecessor's last batch starts
    without ``on_train_epoch_start``). ``limit_train_batches`` applies to each new count as Lightning
    applies it. A loader without ``len()`` is left to Lightning.
    """

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        missing = [part for part in _LOOP_PARTS if not hasattr(trainer.fit_loop, part)]
        if _parse_num_batches is None or missing:
            raise RuntimeError(
                "ExactResume: this Lightning version lacks what the callback recounts with ("
                + (", ".join(f"fit_loop.{part}" for part in missing) or "data_connector._parse_num_batches")
                + "): remove the callback, and resume on the world size the checkpoint was taken on"
            )

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After the load, before the epoch loop compares the batches already run with the count: the
        # loader as the checkpoint left it (a checkpoint at an epoch's last batch counts that epoch, which
        # Lightning then closes).
        _recount(trainer)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _recount(trainer)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        _recount(trainer)


def _recount(trainer: Trainer) -> None:
    """What ``FitLoop.setup_data`` counts, counted again from the loaders' ``len()`` now: the limits, the
    epoch's length, the fetcher's end, and a fractional ``val_check_interval``'s batch."""
    fit_loop = trainer.fit_loop
    combined = fit_loop._combined_loader
    if combined is None:
        return
    lengths = [sized_len(loader) for loader in combined.flattened]
    if None in lengths:
        return
    limit = trainer.limit_train_batches
    limits = [_parse_num_batches(RunningStage.TRAINING, length, limit) for length in lengths]
    if limits == combined.limits and fit_loop.max_batches == sized_len(combined):
        return
    combined.limits = limits
    iterator = getattr(combined, "_iterator", None)  # made at iter() with a copy of the limits
    if iterator is not None:
        iterator.limits = limits
    fit_loop.max_batches = sized_len(combined)  # the limits combined as the loader's mode combines them
    fetcher = fit_loop._data_fetcher
    if fetcher is not None and fetcher.length is not None:
        fetcher.length = fit_loop.max_batches
        # A batch already fetched this epoch was judged last or not against the old count.
        fetcher.done = fetcher.fetched >= fetcher.length
        if fetcher.fetched:
            fit_loop.epoch_loop.batch_progress.is_last_batch = fetcher.done
    interval = trainer.val_check_interval
    if isinstance(interval, float) and getattr(trainer, "_val_check_time_interval", None) is None:
        trainer.val_check_batch = max(1, int(fit_loop.max_batches * interval))
