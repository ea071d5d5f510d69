"""Lightning's batch counts, kept equal to what the training loader delivers: ``ExactResume``.

Lightning counts a training epoch's batches once, in ``FitLoop.setup_data``: its limits from ``len()``
before it loads a checkpoint's loader state, the epoch's length (``trainer.num_training_batches``) right
after, and neither again. A loader whose length changes after the load (a resume on another world size:
the batches run before the checkpoint plus those left, cut for the new ranks) or from one epoch to the
next (``TokenBudgetBatches``) then has its epochs cut short or waited on: samples are lost, silently.
``ExactResume`` counts them again from ``len()`` where the length can have changed.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar

# Lightning's own pieces of setup_data, private to it: imported in this one place, and checked where the
# callback starts, so another version fails with a reason instead of counting wrong.
try:
    from lightning.fabric.utilities.data import _set_sampler_epoch, sized_len
    from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
    from lightning.pytorch.trainer.states import RunningStage
except ImportError:  # pragma: no cover - another Lightning version
    _set_sampler_epoch = sized_len = _parse_num_batches = RunningStage = None

__all__ = ["ExactResume"]

_LOOP_PARTS = (
    "_combined_loader",
    "epoch_progress",
    "_data_fetcher",
    "_combined_loader_states_to_load",
    "_load_combined_loader_states",
    "max_batches",
    "epoch_loop",
)


class ExactResume(Callback):
    """Keeps Lightning's count of training batches equal to the training loader's ``len()``, so that
    every epoch ends when its batches do: a resumed one, on any world size, and every later one, also
    when epochs differ in length (``TokenBudgetBatches``).

        trainer = lightning.Trainer(strategy="ddp", devices=3, callbacks=[ExactResume()])
        trainer.fit(model, loader, ckpt_path="last.ckpt")  # loader: a StatefulDataLoader

    Lightning takes the count once, before it loads the checkpoint's loader state, and never again. The
    callback counts again when training starts (after the load), at the first batch after that (an
    epoch that follows a checkpoint taken at its predecessor's last batch starts without
    ``on_train_epoch_start``), and when each epoch starts; it moves itself before the progress bar, which
    reads the count then. ``limit_train_batches`` applies to each new count as Lightning applies it; a
    fraction of a resumed epoch counts at least one batch more than were run before the checkpoint, where
    the loader has one (on fewer ranks, fewer batches are left than the fraction counted before).

    Where Lightning would resume wrong whatever the count, it says so or makes up for it:

    * a checkpoint whose loader state lags its batches (``snapshot_every_n_steps`` above 1) is refused
      on another world size, where the lag cannot be replayed;
    * the loader states a ``setup_data`` run before the restore left unloaded
      (``trainer.estimated_stepping_batches`` in ``configure_optimizers``) are loaded;
    * a stateful loader without ``len()``, whose state Lightning saves one prefetched batch ahead, is
      warned of;
    * after a checkpoint at an epoch's last batch, the next epoch gets an iterator of its own (Lightning
      would run it on the loaded state's, which workers reading ahead have already run out).
    """

    def __init__(self) -> None:
        self._recount_at_next_batch = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        missing = [part for part in _LOOP_PARTS if not hasattr(trainer.fit_loop, part)]
        if _parse_num_batches is None or missing:
            raise RuntimeError(
                "ExactResume: this Lightning version lacks what the callback recounts with ("
                + (", ".join(f"fit_loop.{part}" for part in missing) or "data_connector._parse_num_batches")
                + "): remove the callback, and resume on the world size the checkpoint was taken on"
            )
        callbacks = trainer.callbacks
        bars = [i for i, callback in enumerate(callbacks) if isinstance(callback, ProgressBar)]
        if bars and callbacks.index(self) > bars[0]:  # the bar reads the count at each epoch's start
            callbacks.remove(self)
            callbacks.insert(bars[0], self)

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        fit_loop = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        for state in fit_loop.get("combined_loader", []):
            _refuse_a_lagging_state_on_another_world_size(state, trainer.world_size)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        fit_loop = trainer.fit_loop
        if fit_loop._combined_loader_states_to_load and fit_loop._combined_loader is not None:
            # setup_data ran before the checkpoint was restored and returns early since: load them now.
            fit_loop._load_combined_loader_states()
            iter(fit_loop._data_fetcher)
        _warn_of_unsized_stateful_loaders(trainer)
        # After the load, before the epoch loop compares the batches already run with the count: the
        # loader as the checkpoint left it (a checkpoint at an epoch's last batch counts that epoch, which
        # Lightning then closes). Lightning would take a count at or below the batches already run, in
        # an epoch the checkpoint did not end, for its end, and run the rest as a new pass: a fraction
        # counts at least one batch more.
        progress = fit_loop.epoch_loop.batch_progress
        _recount(trainer, at_least=0 if progress.is_last_batch else progress.current.ready + 1)
        self._recount_at_next_batch = True
        if fit_loop.restarting and progress.is_last_batch and fit_loop._combined_loader is not None:
            # The checkpoint ended its epoch, and Lightning runs the next one on the iterator it made for
            # the loaded state, which a loader that reads ahead (workers) has already run to its end:
            # the next epoch would deliver nothing. Tell the samplers that epoch (as Lightning is about
            # to) and make its iterator.
            for loader in fit_loop._combined_loader.flattened:
                _set_sampler_epoch(loader, fit_loop.epoch_progress.current.processed)
            iter(fit_loop._data_fetcher)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _recount(trainer)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Only the first: a loader of a CombinedLoader that cycles counts its next iteration from then on.
        if self._recount_at_next_batch:
            self._recount_at_next_batch = False
            _recount(trainer, at_least=trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def _recount(trainer: Trainer, at_least: int = 0) -> None:
    """What ``FitLoop.setup_data`` counts, counted again from the loaders' ``len()`` now: the limits, the
    epoch's length, the fetcher's end, and a fractional ``val_check_interval``'s batch. A fractional
    ``limit_train_batches`` counts at least ``at_least`` batches, where a loader has them."""
    fit_loop = trainer.fit_loop
    combined = fit_loop._combined_loader
    if combined is None:
        return
    lengths = [sized_len(loader) for loader in combined.flattened]
    if None in lengths:
        return
    limit = trainer.limit_train_batches
    limits = [_parse_num_batches(RunningStage.TRAINING, length, limit) for length in lengths]
    if isinstance(limit, float):
        limits = [max(count, min(at_least, length)) for count, length in zip(limits, lengths, strict=True)]
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


def _refuse_a_lagging_state_on_another_world_size(state: object, world_size: int) -> None:
    """A StatefulDataLoader's state taken between its snapshots replays the batches since the snapshot
    by skipping as many of the resumed cut: right on the same world size, wrong on another, where the
    batches are cut afresh (``fastcollate.sampler_state`` refuses such a state too)."""
    if not isinstance(state, Mapping) or not state.get("_steps_since_snapshot"):
        return
    sampler = state.get("_snapshot", {}).get("_main_snapshot", {}).get("_index_sampler_state")
    if isinstance(sampler, Mapping) and "sampler" in sampler and sampler.get("world_size") != world_size:
        raise ValueError(
            f"ExactResume: the checkpoint's loader state was taken {state['_steps_since_snapshot']} batches "
            f"after its last snapshot, on {sampler.get('world_size')} ranks; on {world_size} the batches "
            "since the snapshot cannot be replayed, and samples would be repeated or lost. Resume on "
            f"{sampler.get('world_size')} ranks, or make the StatefulDataLoader with "
            "snapshot_every_n_steps=1 (the default) so that every checkpoint resumes anywhere"
        )


def _warn_of_unsized_stateful_loaders(trainer: Trainer) -> None:
    combined = trainer.fit_loop._combined_loader
    for loader in combined.flattened if combined is not None else ():
        if sized_len(loader) is None and callable(getattr(loader, "state_dict", None)):
            warnings.warn(
                f"ExactResume: the training loader ({type(loader).__name__}) has no len(): Lightning then "
                "reads a batch ahead of training_step, and its checkpoints hold the loader's state one "
                "batch on, so a resume skips a batch on each rank. Give it a len() (a batch sampler with "
                "one, such as fastcollate.IndexBatches)",
                UserWarning,
                stacklevel=2,
            )
