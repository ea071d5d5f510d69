"""Attacks on ``fastcollate.lightning.ExactResume``: what a user who resumes Lightning jobs on another number
of devices does, judged by the ids each epoch delivers and by Lightning's own counts.

Most attacks need no DDP: a single-process Trainer whose sampler is made for ``rank=r, world_size=W``
delivers, and counts, what rank r of W would (the samplers never read torch.distributed). A "world" of W
ranks is W such Trainers, each stopped at the same batch; rank 0's checkpoint is the one every rank of
the next world resumes from (every rank's loader state is the same). The union of the ranks' batches,
counted per epoch, must hold every sample of the interrupted epoch that was not consumed
(TokenBudgetBatches exactly once; IndexBatches within the padding allowance: at most W - 1 repeats per
segment of the epoch) and all N samples in every later epoch; Lightning's ``num_training_batches``, the
last ``batch_idx`` and ``global_step`` must agree with what was delivered.

A stop is a preemption: a checkpoint saved at some hook, then an exception that kills ``fit``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar  # noqa: E402
from lightning.pytorch.utilities import CombinedLoader  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from fastcollate import IndexBatches, TokenBudgetBatches  # noqa: E402
from fastcollate.lightning import DeviceLoaderCallback, ExactResume  # noqa: E402
from tests.helpers.resume import Indices, assert_every_sample, state_after  # noqa: E402

N = 61
BATCH_SIZE = 4
MAX_TOKENS = 64
EPOCHS = 3
KINDS = ["index", "tokens"]

pytestmark = [
    pytest.mark.filterwarnings("ignore"),
]


@pytest.fixture(autouse=True)
def quiet_lightning():
    logger = logging.getLogger("lightning")
    level = logger.level
    logger.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logger.setLevel(level)


def token_lengths() -> torch.Tensor:
    return torch.randint(1, 40, (N,), generator=torch.Generator().manual_seed(0))


def make_sampler(kind: str, rank: int, world: int, n: int = N):
    if kind == "index":
        return IndexBatches(n, BATCH_SIZE, shuffle=True, seed=1, rank=rank, world_size=world)
    return TokenBudgetBatches(token_lengths()[:n], MAX_TOKENS, shuffle=True, seed=1, rank=rank,
                              world_size=world)


def make_loader(kind: str, rank: int, world: int, workers: int = 0, n: int = N) -> StatefulDataLoader:
    sampler = make_sampler(kind, rank, world, n)
    return StatefulDataLoader(Indices(n), batch_sampler=sampler, num_workers=workers)


class Preempted(Exception):
    """The job is killed: fit() ends here, after the checkpoint, as a preempted job's would."""


class Net(L.LightningModule):
    """Records every batch training_step gets, per epoch, with its batch_idx."""

    def __init__(self, loaders: Callable[[], Any]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.loaders = loaders
        self.seen: dict[int, list] = collections.defaultdict(list)
        self.idx: dict[int, list] = collections.defaultdict(list)

    def train_dataloader(self):
        return self.loaders()

    def training_step(self, batch, batch_idx):
        self.seen[self.current_epoch].append(_ids(batch))
        self.idx[self.current_epoch].append(batch_idx)
        return self.layer(_first_tensor(batch).float()[:, None]).sum() * 0.0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class ValidatingNet(Net):
    def val_dataloader(self):
        return DataLoader(Indices(8), batch_size=4)

    def validation_step(self, batch, batch_idx):
        return None


class ScheduledNet(Net):
    """The documented OneCycleLR idiom: the schedule's length from trainer.estimated_stepping_batches."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        total = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=int(total) + 64)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _ids(batch) -> Any:
    if isinstance(batch, dict):
        return {key: value.tolist() for key, value in batch.items()}
    return batch.tolist()


def _first_tensor(batch) -> torch.Tensor:
    return next(iter(batch.values())) if isinstance(batch, dict) else batch


class Counts(L.Callback):
    """Lightning's own count of each epoch, at its end: (num_training_batches, last batch_idx + 1), the
    global step, and the tqdm bar's (n, total) when there is one."""

    def __init__(self) -> None:
        self.epochs: dict[int, tuple] = {}
        self.steps: dict[int, int] = {}
        self.bar: dict[int, tuple] = {}

    def on_train_epoch_end(self, trainer, module):
        epoch = trainer.current_epoch
        self.epochs[epoch] = (trainer.num_training_batches, trainer.fit_loop.epoch_loop.batch_idx + 1)
        self.steps[epoch] = trainer.global_step
        bar = getattr(trainer.progress_bar_callback, "train_progress_bar", None)
        if bar is not None and not bar.disable:
            self.bar[epoch] = (bar.n, bar.total)


class Preempt(L.Callback):
    """At the first ``hook`` call where ``when(trainer, *args)`` holds: a checkpoint (unless ``path`` is
    None), then the job dies."""

    def __init__(self, path: str | None, hook: str, when: Callable[..., bool]) -> None:
        self.path, self.when = path, when
        setattr(self, hook, self._maybe)

    def _maybe(self, trainer, module, *args):
        if self.when(trainer, *args):
            if self.path is not None:
                trainer.save_checkpoint(self.path)
            raise Preempted


def after_batch(epoch: int, count: int) -> tuple[str, Callable]:
    """Stop after the ``count``-th batch of ``epoch`` (counted from the epoch's start, before a resume
    too)."""
    return "on_train_batch_end", lambda trainer, outputs, batch, batch_idx: (
        trainer.current_epoch == epoch and batch_idx + 1 == count
    )


@dataclasses.dataclass
class Run:
    seen: dict[int, list]
    counts: dict[int, tuple]
    steps: dict[int, int]
    bar: dict[int, tuple]
    global_step: int
    trainer: Any


def fit(module: Net, *, ckpt: str | None = None, callbacks=(), exact: int = 1, exact_first: bool = True,
        **options) -> Run:
    counts = Counts()
    mine = [ExactResume() for _ in range(exact)]
    callbacks = list(callbacks)
    settings = dict(accelerator="cpu", devices=1, max_epochs=EPOCHS, logger=False, enable_model_summary=False,
                    enable_progress_bar=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                    enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks))
    settings.update(options)
    ordered = mine + callbacks if exact_first else callbacks + mine
    trainer = L.Trainer(callbacks=ordered + [counts], **settings)
    try:
        trainer.fit(module, ckpt_path=ckpt)
    except Preempted:
        pass
    return Run(dict(module.seen), counts.epochs, counts.steps, counts.bar, trainer.global_step, trainer)


@dataclasses.dataclass
class Phase:
    """One job: ``world`` ranks, from the previous phase's checkpoint, until ``stop`` (a (hook, when) pair,
    or None: to the end)."""

    world: int
    stop: tuple[str, Callable] | None = None
    workers: int = 0
    options: dict = dataclasses.field(default_factory=dict)
    callbacks: Callable[[Path], list] = lambda folder: []
    checkpoint: Callable[[Path], str] | None = None  # where the next phase resumes from, if not the stop's
    net: type = Net
    loaders: Callable[[str, int, int, int], Any] | None = None
    kept: int | Callable[[str], int] | None = None  # epoch 0's batches before the checkpoint (None: all)


def run_phases(folder: Path, kind: str, phases: list[Phase]) -> list[list[Run]]:
    done: list[list[Run]] = []
    ckpt = None
    for number, phase in enumerate(phases):
        runs = []
        saved = str(folder / f"phase{number}.ckpt")
        for rank in range(phase.world):
            rank_folder = folder / f"phase{number}-rank{rank}"
            rank_folder.mkdir(parents=True, exist_ok=True)
            callbacks = list(phase.callbacks(rank_folder))
            if phase.stop is not None:
                hook, when = phase.stop
                callbacks.append(Preempt(saved if rank == 0 else None, hook, when))
            make = phase.loaders or make_loader
            module = phase.net(partial(make, kind, rank, phase.world, phase.workers))
            runs.append(fit(module, ckpt=ckpt, callbacks=callbacks, **phase.options))
        # DDP ranks step in lockstep: every simulated rank ran as many batches in each epoch.
        for epoch in runs[0].seen:
            assert len({len(run.seen.get(epoch, [])) for run in runs}) == 1, f"phase {number}, epoch {epoch}"
        ckpt = saved if phase.checkpoint is None else phase.checkpoint(folder / f"phase{number}-rank0")
        kept = phase.kept(ckpt) if callable(phase.kept) else phase.kept
        if kept is not None:  # what ran after the checkpoint is lost with the job
            for run in runs:
                run.seen[0] = run.seen.get(0, [])[:kept]
        done.append(runs)
    return done


def ids(runs: list[Run], epoch: int, key: str | None = None) -> collections.Counter:
    counter: collections.Counter = collections.Counter()
    for run in runs:
        for batch in run.seen.get(epoch, []):
            counter.update(batch[key] if key is not None else batch)
    return counter


def assert_samples(phases: list[list[Run]], kind: str, epochs: int = EPOCHS, key: str | None = None,
                   n: int = N) -> None:
    """The interrupted epoch 0, over every phase, and each later epoch of the last phase."""
    worlds = [len(runs) for runs in phases]
    epoch0 = sum((ids(runs, 0, key) for runs in phases), collections.Counter())
    assert_every_sample(epoch0, kind, sum(w - 1 for w in worlds), f"{kind} {worlds}: epoch 0", n=n)
    for epoch in range(1, epochs):
        what = f"{kind} {worlds}: epoch {epoch}"
        assert_every_sample(ids(phases[-1], epoch, key), kind, worlds[-1] - 1, what, n=n)


def batches_run(phases: list[list[Run]], epoch: int) -> int:
    return sum(len(runs[0].seen.get(epoch, [])) for runs in phases)


def assert_counts(phases: list[list[Run]], accumulate: int = 1) -> None:
    """Lightning's count of each epoch the last phase ended equals the batches its rank ran in it (those
    before the checkpoints too), and the global step equals the optimizer steps those batches make."""
    steps = 0
    for epoch in range(EPOCHS):
        batches = batches_run(phases, epoch)
        steps += -(-batches // accumulate)
        for rank, run in enumerate(phases[-1]):
            if epoch in run.counts:
                assert run.counts[epoch] == (batches, batches), (
                    f"rank {rank}, epoch {epoch}: Lightning counted (num_training_batches, batch_idx + 1) = "
                    f"{run.counts[epoch]}, {batches} batches were run"
                )
                assert run.steps[epoch] == steps, f"rank {rank}, epoch {epoch}: global_step"
    for run in phases[-1]:
        assert run.global_step == steps


def sampler_batches(kind: str, world: int, stop: int, world_after: int) -> list[list[list[int]]]:
    """What each rank of ``world_after`` runs in the rest of epoch 0, loaded with the state after ``stop``
    batches of epoch 0 on ``world`` ranks."""
    state = state_after(make_sampler(kind, 0, world), stop)
    ranks = []
    for rank in range(world_after):
        resumed = make_sampler(kind, rank, world_after)
        resumed.load_state_dict(state)
        ranks.append([list(map(int, batch)) for batch in resumed])
    return ranks


# --------------------------------------------------------------------------------------------------------
# The baseline the attacks start from: one resume on another world size, mid-epoch (passes).


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world,world_after", [(2, 1), (1, 2), (2, 3)])
def test_one_resume_on_another_world_size(tmp_path, kind, world, world_after):
    phases = run_phases(tmp_path, kind, [Phase(world, after_batch(0, 3)), Phase(world_after)])
    assert_samples(phases, kind)
    assert_counts(phases)


def test_the_harness_sees_the_loss_without_the_callback(tmp_path):
    """Control: without ExactResume, the same checks fail (1 -> 2 ranks cuts the resumed epoch short), so
    a check that passes below passes because of the callback."""
    phases = run_phases(tmp_path, "index", [Phase(1, after_batch(0, 3), options={"exact": 0}),
                                            Phase(2, options={"exact": 0})])
    with pytest.raises(AssertionError):
        assert_samples(phases, "index")
        assert_counts(phases)


# --------------------------------------------------------------------------------------------------------
# Preempted twice in one epoch.


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("worlds", [(2, 3, 1), (1, 3, 2)])
def test_preempted_twice_in_one_epoch(tmp_path, kind, worlds):
    first, second, third = worlds
    phases = run_phases(tmp_path, kind, [Phase(first, after_batch(0, 2)), Phase(second, after_batch(0, 4)),
                                         Phase(third)])
    assert_samples(phases, kind)
    assert_counts(phases)


@pytest.mark.parametrize("kind", KINDS)
def test_a_second_checkpoint_right_after_the_resume_before_any_batch(tmp_path, kind):
    """Preempted again as soon as training starts (an HPC requeue signal during the restore): the second
    checkpoint is taken before the resumed run's first batch, then resumed on a third world size."""
    phases = run_phases(tmp_path, kind, [Phase(2, after_batch(0, 3)),
                                         Phase(3, ("on_train_start", lambda trainer: True)),
                                         Phase(1)])
    assert all(not run.seen for run in phases[1])
    assert_samples(phases, kind)
    assert_counts(phases)


@pytest.mark.parametrize("kind", KINDS)
def test_a_second_checkpoint_at_the_first_resumed_batch(tmp_path, kind):
    phases = run_phases(tmp_path, kind, [Phase(2, after_batch(0, 3)), Phase(3, after_batch(0, 4)), Phase(1)])
    assert_samples(phases, kind)
    assert_counts(phases)


@pytest.mark.parametrize("kind", KINDS)
def test_preempted_at_the_last_batch_of_a_resumed_epoch_then_resumed_again(tmp_path, kind):
    resumed_length = len(sampler_batches(kind, 2, 3, 3)[0]) + 3
    phases = run_phases(tmp_path, kind, [Phase(2, after_batch(0, 3)),
                                         Phase(3, after_batch(0, resumed_length)),
                                         Phase(1)])
    assert not phases[2][0].seen.get(0)  # the epoch was through: the last job starts at epoch 1
    assert_samples(phases, kind)
    assert_counts(phases)


# --------------------------------------------------------------------------------------------------------
# A resume from a checkpoint taken during validation (val_check_interval < 1.0).


def during_validation(epoch: int, hook: str) -> tuple[str, Callable]:
    """The first validation of ``epoch`` (after half of it): at its end, or after its first batch."""
    return hook, lambda trainer, *args: trainer.current_epoch == epoch


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hook", ["on_validation_end", "on_validation_batch_end"])
@pytest.mark.parametrize("world,world_after", [(2, 1), (1, 3)])
def test_checkpoint_saved_in_a_validation_hook(tmp_path, kind, hook, world, world_after):
    options = {"val_check_interval": 0.5}
    phases = run_phases(tmp_path, kind, [
        Phase(world, during_validation(0, hook), options=options, net=ValidatingNet),
        Phase(world_after, options=options, net=ValidatingNet),
    ])
    assert phases[0][0].seen[0]
    assert_samples(phases, kind)
    assert_counts(phases)


@pytest.mark.parametrize("kind", KINDS)
def test_model_checkpoint_saved_during_validation_then_killed(tmp_path, kind):
    """ModelCheckpoint(save_last=True) saves last.ckpt at the end of the mid-epoch validation; the job is
    killed at the next batch, before training_step sees it."""
    options = {"val_check_interval": 0.5}
    killed = ("on_train_batch_start", lambda trainer, batch, batch_idx: trainer.current_epoch == 0
              and trainer.fit_loop.epoch_loop.val_loop.batch_progress.total.completed > 0)
    phases = run_phases(tmp_path, kind, [
        Phase(2, killed, options=options, net=ValidatingNet,
              callbacks=lambda folder: [ModelCheckpoint(dirpath=folder, save_last=True)],
              checkpoint=lambda folder: str(folder / "last.ckpt")),
        Phase(1, options=options, net=ValidatingNet),
    ])
    assert len(phases[0][0].seen[0]) == int(len(make_sampler(kind, 0, 2)) * 0.5)  # killed after validation
    assert_samples(phases, kind)
    assert_counts(phases)


# --------------------------------------------------------------------------------------------------------
# limit_train_batches: applied to each new count as Lightning applies it.


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("limit", [6, 0.5])
def test_limit_train_batches_applies_to_the_resumed_count(tmp_path, kind, limit):
    options = {"limit_train_batches": limit}
    world, world_after, stop = 2, 1, 2
    phases = run_phases(tmp_path, kind, [Phase(world, after_batch(0, stop), options=options),
                                         Phase(world_after, options=options)])

    def limited(length: int) -> int:
        return min(length, limit) if isinstance(limit, int) else int(length * limit)

    rest = sampler_batches(kind, world, stop, world_after)
    resumed = limited(stop + len(rest[0]))
    assert phases[1][0].seen[0] == rest[0][: resumed - stop]  # the sampler's own next batches, as many
    fresh = limited(len(make_sampler(kind, 0, world_after)))
    for epoch in range(1, EPOCHS):
        assert len(phases[1][0].seen[epoch]) == fresh
    assert_counts(phases)


def test_a_fractional_limit_that_falls_below_the_batches_already_run(tmp_path):
    """Half of the resumed epoch's 10 batches is fewer than the 7 run before the checkpoint: the epoch
    goes on from the checkpoint's batch index (Lightning would take the count for the epoch's end and
    run the rest as a new pass of the same epoch) and ends when the count says."""
    options = {"limit_train_batches": 0.5}
    phases = run_phases(tmp_path, "index", [Phase(1, after_batch(0, 7), options=options),
                                            Phase(3, options=options)])
    for run in phases[1]:
        assert len(run.seen.get(0, [])) <= len(sampler_batches("index", 1, 7, 3)[0])
        assert run.trainer.lightning_module.idx[0][:1] in ([], [7])  # batch_idx goes on from the checkpoint
    assert_counts(phases)


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_at_the_last_batch_limit_train_batches_allows(tmp_path, kind):
    """Stopped at the limit's last batch (the sampler's epoch is not through): the resumed job starts
    epoch 1, and each epoch runs the limit."""
    options = {"limit_train_batches": 4}
    phases = run_phases(tmp_path, kind, [Phase(2, after_batch(0, 4), options=options),
                                         Phase(1, options=options)])
    assert not phases[1][0].seen.get(0)
    assert [len(phases[1][0].seen[epoch]) for epoch in (1, 2)] == [4, 4]
    assert_counts(phases)


# --------------------------------------------------------------------------------------------------------
# max_steps reached mid-epoch (ModelCheckpoint every_n_train_steps), resumed with a larger max_steps.


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world,world_after", [(2, 1), (1, 2)])
def test_max_steps_reached_mid_epoch_then_a_larger_max_steps(tmp_path, kind, world, world_after):
    phases = run_phases(tmp_path, kind, [
        Phase(world, options={"max_steps": 5},
              callbacks=lambda folder: [ModelCheckpoint(dirpath=folder, every_n_train_steps=5,
                                                        save_last=True)],
              checkpoint=lambda folder: str(folder / "last.ckpt")),
        Phase(world_after, options={"max_steps": 1000}),
    ])
    assert [len(run.seen[0]) for run in phases[0]] == [5] * world
    assert_samples(phases, kind)
    assert_counts(phases)


@pytest.mark.parametrize("kind", KINDS)
def test_max_steps_reached_again_in_the_resumed_epoch(tmp_path, kind):
    """Resumed with a max_steps that ends inside the resumed epoch, then once more without a limit."""
    every = lambda folder: [ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_last=True)]  # noqa: E731
    last = lambda folder: str(folder / "last.ckpt")  # noqa: E731
    phases = run_phases(tmp_path, kind, [
        Phase(2, options={"max_steps": 3}, callbacks=every, checkpoint=last),
        Phase(3, options={"max_steps": 5}, callbacks=every, checkpoint=last),
        Phase(1),
    ])
    assert len(phases[1][0].seen[0]) == 2
    assert_samples(phases, kind)
    assert_counts(phases)


# --------------------------------------------------------------------------------------------------------
# accumulate_grad_batches: the last partial accumulation of a resumed epoch steps, and global_step agrees.


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world,world_after,stop", [(2, 1, 3), (1, 2, 3), (2, 1, 4)])
def test_accumulate_grad_batches_steps_at_the_resumed_epochs_end(tmp_path, kind, world, world_after, stop):
    options = {"accumulate_grad_batches": 3}
    phases = run_phases(tmp_path, kind, [Phase(world, after_batch(0, stop), options=options),
                                         Phase(world_after, options=options)])
    assert_samples(phases, kind)
    assert_counts(phases, accumulate=3)


# --------------------------------------------------------------------------------------------------------
# Loaders that run ahead of training_step: DeviceLoaderCallback's staging, DataLoader workers.


@pytest.mark.parametrize("kind,order,world,world_after", [
    ("index", "exact-first", 1, 2), ("index", "device-first", 1, 2),
    ("tokens", "exact-first", 2, 1), ("tokens", "device-first", 2, 1),
])
def test_device_loader_callback_beside_exact_resume(tmp_path, kind, order, world, world_after):
    options = {"exact_first": order == "exact-first"}
    callbacks = lambda folder: [DeviceLoaderCallback(depth=2)]  # noqa: E731
    phases = run_phases(tmp_path, kind, [
        Phase(world, after_batch(0, 3), options=options, callbacks=callbacks),
        Phase(world_after, options=options, callbacks=callbacks),
    ])
    assert_samples(phases, kind)
    assert_counts(phases)


@pytest.mark.parametrize("kind", KINDS)
def test_device_loader_callback_at_the_same_world_size(tmp_path, kind):
    callbacks = lambda folder: [DeviceLoaderCallback(depth=2)]  # noqa: E731
    phases = run_phases(tmp_path, kind, [Phase(2, after_batch(0, 3), callbacks=callbacks),
                                         Phase(2, callbacks=callbacks)])
    assert_samples(phases, kind)
    assert_counts(phases)


@pytest.mark.parametrize("kind,world,world_after,stop",
                         [("index", 1, 2, 3), ("tokens", 2, 1, 3), ("index", 2, 1, 7)])
def test_two_workers_on_both_sides_of_a_world_size_change(tmp_path, kind, world, world_after, stop):
    """stop=7 of 8: the rest is shorter than the workers' prefetch, so the iterator Lightning makes in
    setup_data has already exhausted the sampler when ExactResume recounts at on_train_start."""
    phases = run_phases(tmp_path, kind, [Phase(world, after_batch(0, stop), workers=2),
                                         Phase(world_after, workers=2)])
    assert_samples(phases, kind)
    assert_counts(phases)


@pytest.mark.parametrize("workers,workers_after", [(0, 2), (2, 0)])
def test_a_changed_num_workers_is_refused_loudly(tmp_path, workers, workers_after):
    """StatefulDataLoader refuses a state taken under another num_workers (an AssertionError from
    torchdata in Lightning's setup_data, which Lightning's teardown then hides behind a RuntimeError of
    its own, "Please call `iter(combined_loader)` first", with the AssertionError as its context): loud,
    never a silent loss."""
    with pytest.raises(Exception) as caught:
        run_phases(tmp_path, "index", [Phase(2, after_batch(0, 3), workers=workers),
                                       Phase(1, workers=workers_after)])
    chain, error = [], caught.value
    while error is not None:
        chain.append(error)
        error = error.__context__
    assert any(isinstance(error, AssertionError) and "State doesn't contain key" in str(error)
               for error in chain)


@pytest.mark.parametrize("kind", ["tokens"])
def test_two_workers_at_the_same_world_size(tmp_path, kind):
    phases = run_phases(tmp_path, kind, [Phase(2, after_batch(0, 3), workers=2), Phase(2, workers=2)])
    assert_samples(phases, kind)
    assert_counts(phases)


def test_uninterrupted_token_budget_epochs_with_workers_and_a_device_loader(tmp_path):
    """Epochs of differing length (TokenBudgetBatches), no resume, loaders running ahead: every epoch
    delivers all N, and Lightning counts each as long as it is."""
    sampler = make_sampler("tokens", 0, 2)
    epoch_lengths = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        epoch_lengths.append(len(sampler))
    assert len(set(epoch_lengths)) > 1  # the epochs do differ in length
    callbacks = lambda folder: [DeviceLoaderCallback(depth=2)]  # noqa: E731
    for workers in (0, 2):
        phases = run_phases(tmp_path / str(workers), "tokens",
                            [Phase(2, workers=workers, callbacks=callbacks)])
        for epoch in range(EPOCHS):
            assert_every_sample(ids(phases[0], epoch), "tokens", 0, f"workers={workers}, epoch {epoch}", n=N)
        assert_counts(phases)


# --------------------------------------------------------------------------------------------------------
# Checkpoints Lightning's ModelCheckpoint takes.


@pytest.mark.parametrize("kind", KINDS)
def test_every_n_train_steps_last_ckpt_with_work_lost_after_it(tmp_path, kind):
    """last.ckpt from every_n_train_steps=2; the job dies after batch 3, so batch 3 is redone from the
    checkpoint (its samples re-cut for the new ranks)."""
    checkpoints = lambda folder: [ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_last=True)]  # noqa: E731
    phases = run_phases(tmp_path, kind, [
        Phase(2, ("on_train_batch_end", lambda trainer, *args: trainer.global_step == 3),
              callbacks=checkpoints, checkpoint=lambda folder: str(folder / "last.ckpt"), kept=2),
        Phase(1),
    ])
    assert_samples(phases, kind)
    assert_counts(phases)


def saved_step(path: str) -> int:
    return torch.load(path, weights_only=False)["global_step"]


@pytest.mark.parametrize("kind,workers,world_after", [("index", 0, 1), ("tokens", 0, 3), ("index", 2, 2)])
def test_checkpoints_written_by_a_thread_async_checkpoint_io(tmp_path, kind, workers, world_after):
    """AsyncCheckpointIO writes each checkpoint in a background thread while training (and the loader)
    go on; the job is killed mid-epoch, and resumes from the last one written. (save_top_k=-1: with top-k
    removal, Lightning's ModelCheckpoint can delete a checkpoint the thread is still committing, a
    FileNotFoundError of Lightning's own, nothing to do with the loader.)"""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    checkpoints = lambda folder: [  # noqa: E731
        ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1, save_last=True)]
    phases = run_phases(tmp_path, kind, [
        Phase(2, ("on_train_batch_end", lambda trainer, *args: trainer.global_step == 6), workers=workers,
              callbacks=checkpoints, options={"plugins": [AsyncCheckpointIO()]},
              checkpoint=lambda folder: str(folder / "last.ckpt"), kept=saved_step),
        Phase(world_after, workers=workers),
    ])
    assert len(phases[0][0].seen[0]) in (5, 6)
    assert_samples(phases, kind)
    if workers == 0:
        assert_counts(phases)


@pytest.mark.parametrize("kind", KINDS)
def test_epoch_end_last_ckpt_of_a_resumed_epoch_then_a_third_world_size(tmp_path, kind):
    """ModelCheckpoint's default (each epoch's end, save_last) in the resumed job; it dies in epoch 1
    and resumes from last.ckpt (end of the resumed epoch 0) on a third world size."""
    checkpoints = lambda folder: [ModelCheckpoint(dirpath=folder, save_last=True)]  # noqa: E731
    phases = run_phases(tmp_path, kind, [
        Phase(2, after_batch(0, 3)),
        Phase(1, after_batch(1, 2), callbacks=checkpoints,
              checkpoint=lambda folder: str(folder / "last.ckpt")),
        Phase(3),
    ])
    for run in phases[1]:
        del run.seen[1]  # redone by the last job
    assert_samples(phases, kind)
    assert_counts(phases)


# --------------------------------------------------------------------------------------------------------
# reload_dataloaders_every_n_epochs, a CombinedLoader of two loaders, a loader without __len__.


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world,world_after", [(2, 1), (1, 2)])
def test_reload_dataloaders_every_epoch(tmp_path, kind, world, world_after):
    options = {"reload_dataloaders_every_n_epochs": 1}
    phases = run_phases(tmp_path, kind, [Phase(world, after_batch(0, 3), options=options),
                                         Phase(world_after, options=options)])
    assert_samples(phases, kind)
    assert_counts(phases)


SHORT = 40  # the second loader's samples


def two_loaders(mode: str, short: int = SHORT):
    def make(kind, rank, world, workers):
        return CombinedLoader({"long": make_loader(kind, rank, world, workers),
                               "short": make_loader(kind, rank, world, workers, n=short)}, mode)
    return make


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world,world_after", [(2, 1), (1, 2)])
def test_a_combined_loader_of_two_stateful_loaders(tmp_path, kind, world, world_after):
    """max_size_cycle: the long loader's epoch is the epoch; the short one's resumed iteration runs out,
    then cycles. Every sample of both comes in the resumed epoch, and of the long one once."""
    loaders = two_loaders("max_size_cycle")
    phases = run_phases(tmp_path, kind, [Phase(world, after_batch(0, 3), loaders=loaders),
                                         Phase(world_after, loaders=loaders)])
    assert_samples(phases, kind, key="long")
    epoch0 = sum((ids(runs, 0, "short") for runs in phases), collections.Counter())
    assert set(epoch0) == set(range(SHORT))
    assert_counts(phases)


@pytest.mark.parametrize("kind", ["index"])
def test_a_combined_loader_whose_short_loader_cycles_past_the_long_ones_resumed_count(tmp_path, kind):
    loaders = two_loaders("max_size_cycle", short=56)
    short_fresh = len(make_sampler(kind, 0, 1, n=56))
    long_resumed = 3 + len(sampler_batches(kind, 2, 3, 1)[0])
    assert short_fresh > long_resumed  # the setting of the attack
    phases = run_phases(tmp_path, kind, [Phase(2, after_batch(0, 3), loaders=loaders),
                                         Phase(1, loaders=loaders)])
    assert_samples(phases, kind, key="long")
    assert_counts(phases)


class Unsized:
    """A stateful loader without __len__ (a wrapper a user writes), exposing the batch sampler so that
    Lightning tells it the epoch."""

    def __init__(self, loader: StatefulDataLoader) -> None:
        self.loader = loader
        self.batch_sampler = loader.batch_sampler

    def __iter__(self):
        return iter(self.loader)

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)


def test_a_stateful_loader_without_len_is_warned_of(tmp_path):
    """Lightning reads a batch ahead of a loader without len(), and its checkpoints hold the loader's
    state one batch on, so a resume skips a batch a rank, on the same world size too: ExactResume,
    which cannot count such a loader, says so."""
    loaders = lambda kind, rank, world, workers: Unsized(make_loader(kind, rank, world, workers))  # noqa: E731
    with pytest.warns(UserWarning, match=r"\(Unsized\) has no len\(\).* a resume skips a batch on each rank"):
        run_phases(tmp_path, "index", [Phase(1, loaders=loaders)])


# --------------------------------------------------------------------------------------------------------
# Where the callback stands among the others; given twice; a checkpoint from a run without it.


def with_bar(folder: Path) -> list:
    return [TQDMProgressBar(refresh_rate=10_000)]


def assert_bar(phases: list[list[Run]], epochs=range(1, EPOCHS)) -> None:
    for epoch in epochs:
        batches = batches_run(phases, epoch)
        assert phases[-1][0].bar[epoch] == (batches, batches), f"epoch {epoch}: the bar's (n, total)"


@pytest.mark.parametrize("kind", KINDS)
def test_the_progress_bar_listed_after_the_callback(tmp_path, kind):
    options = {"enable_progress_bar": True, "exact_first": True}
    phases = run_phases(tmp_path, kind, [Phase(2, after_batch(0, 3), options=options, callbacks=with_bar),
                                         Phase(1, options=options, callbacks=with_bar)])
    assert_samples(phases, kind)
    assert_counts(phases)
    assert_bar(phases)


@pytest.mark.parametrize("kind", KINDS)
def test_the_callback_listed_after_the_progress_bar(tmp_path, kind):
    options = {"enable_progress_bar": True, "exact_first": False}
    phases = run_phases(tmp_path, kind, [Phase(2, after_batch(0, 3), options=options, callbacks=with_bar),
                                         Phase(1, options=options, callbacks=with_bar)])
    assert_samples(phases, kind)  # these hold: only the bar is wrong
    assert_counts(phases)
    assert_bar(phases)


@pytest.mark.parametrize("kind", KINDS)
def test_the_callback_given_twice(tmp_path, kind):
    phases = run_phases(tmp_path, kind, [Phase(2, after_batch(0, 3), options={"exact": 2}),
                                         Phase(3, options={"exact": 2})])
    assert_samples(phases, kind)
    assert_counts(phases)


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_from_a_run_without_the_callback(tmp_path, kind):
    phases = run_phases(tmp_path, kind, [Phase(2, after_batch(0, 3), options={"exact": 0}), Phase(1)])
    assert_samples(phases, kind)
    assert_counts(phases)


# --------------------------------------------------------------------------------------------------------
# Other things users do.


@pytest.mark.parametrize("world,world_after", [(1, 1), (2, 1)])
def test_a_schedule_sized_by_estimated_stepping_batches(tmp_path, world, world_after):
    phases = run_phases(tmp_path, "tokens", [Phase(world, after_batch(0, 3), net=ScheduledNet),
                                             Phase(world_after, net=ScheduledNet)])
    assert_samples(phases, "tokens")
    assert_counts(phases)


@pytest.mark.parametrize("kind", KINDS)
def test_a_loader_state_that_lags_its_snapshot_is_refused_on_another_world_size(tmp_path, kind):
    """snapshot_every_n_steps=2, a checkpoint after an odd batch: torchdata replays the batch since the
    snapshot by skipping one of the resumed cut, right on the same world size only (below)."""
    def loaders(kind, rank, world, workers):
        return StatefulDataLoader(Indices(N), batch_sampler=make_sampler(kind, rank, world), num_workers=2,
                                  snapshot_every_n_steps=2)
    refused = r"taken 1 batches after its last snapshot, on 2 ranks; on 1 .* snapshot_every_n_steps=1"
    with pytest.raises(ValueError, match=refused):
        run_phases(tmp_path, kind, [Phase(2, after_batch(0, 3), loaders=loaders), Phase(1, loaders=loaders)])


@pytest.mark.parametrize("kind", KINDS)
def test_a_loader_state_that_lags_its_snapshot_resumes_on_the_same_world_size(tmp_path, kind):
    # One rank: the refusal compares the state's world size with the Trainer's, which a simulated rank
    # of more does not have.
    def loaders(kind, rank, world, workers):
        return StatefulDataLoader(Indices(N), batch_sampler=make_sampler(kind, rank, world), num_workers=2,
                                  snapshot_every_n_steps=2)
    phases = run_phases(tmp_path, kind, [Phase(1, after_batch(0, 3), loaders=loaders),
                                         Phase(1, loaders=loaders)])
    assert_samples(phases, kind)


@pytest.mark.parametrize("kind", ["index"])
def test_a_snapshot_every_second_step_taken_on_a_snapshot_step(tmp_path, kind):
    def loaders(kind, rank, world, workers):
        return StatefulDataLoader(Indices(N), batch_sampler=make_sampler(kind, rank, world), num_workers=2,
                                  snapshot_every_n_steps=2)
    phases = run_phases(tmp_path, kind, [Phase(2, after_batch(0, 4), loaders=loaders),
                                         Phase(2, loaders=loaders)])
    assert_samples(phases, kind)


def test_a_rest_too_small_for_the_new_ranks_is_refused_loudly(tmp_path):
    """TokenBudgetBatches refuses to cut fewer samples than ranks (its documented ValueError), at the
    resume, never a silent loss."""
    full = len(make_sampler("tokens", 0, 1))
    last = sampler_batches("tokens", 1, full - 1, 1)[0]
    world_after = len(last[0]) + 1 if len(last) == 1 else None
    assert world_after is not None and world_after <= 8
    with pytest.raises(Exception) as caught:
        run_phases(tmp_path, "tokens", [Phase(1, after_batch(0, full - 1)), Phase(world_after)])
    chain, error = [], caught.value
    while error is not None:
        chain.append(error)
        error = error.__context__
    refusals = [str(error) for error in chain if isinstance(error, ValueError)]
    assert any(f"among {world_after} ranks" in refusal for refusal in refusals), refusals


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_loader_object_kept_across_a_killed_fit_and_the_resumed_one(tmp_path, kind):
    """One process: fit is killed, the user builds a new Trainer and resumes with the very module and
    loader object (its sampler still holds the killed run's position)."""
    loader = make_loader(kind, 0, 1)
    module = Net(lambda: loader)
    saved = str(tmp_path / "killed.ckpt")
    hook, when = after_batch(0, 5)
    fit(module, callbacks=[Preempt(saved, hook, when)])
    before = [list(batch) for batch in module.seen[0]]
    module.seen.clear()
    run = fit(module, ckpt=saved)
    phases = [[Run({0: before}, {}, {}, {}, 5, None)], [run]]
    assert_samples(phases, kind)
    assert_counts(phases)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world,world_after", [(1, 1), (2, 1)])
def test_a_checkpoint_at_an_epochs_last_batch_with_workers_reading_ahead(tmp_path, kind, world, world_after):
    """Lightning runs the epoch after such a checkpoint on the iterator it made for the loaded state,
    which the workers ran to its end while prefetching: without ExactResume that epoch delivers nothing,
    on the same world size too."""
    last = len(make_sampler(kind, 0, world))
    phases = run_phases(tmp_path, kind, [Phase(world, after_batch(0, last), workers=2),
                                         Phase(world_after, workers=2)])
    assert_samples(phases, kind)
    assert_counts(phases)
