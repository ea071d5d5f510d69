"""``doctor --resume``: proves from the sample ids that a loader resumed from a checkpoint goes on as the
loader it was checkpointed from, at checkpoints all over the epoch.

W rank loaders (W = 1 unless ``world_sizes`` is given; in this process, stepping in lockstep as DDP's
ranks step) run one epoch, and after each chosen batch their states go through ``torch.save`` as a
checkpoint would: after the first batch, after the last one (the epoch done: a resume delivers nothing
more), and others spread over the epoch. From each checkpoint, fresh loaders resume: with the same
``num_workers`` (the loader's own ``load_state_dict``), with another (the batch sampler's part of the
state, ``fastcollate.sampler_state``), or on W' ranks. What the checkpointed loaders delivered before
the checkpoint and what the resumed ones delivered after must be, on the same world size, that epoch
itself, batch for batch; on another, every sample of the data set, repeated and left out only within
the batch sampler's own ``resume_allowance(W, W')``.
"""

from __future__ import annotations

import dataclasses
import io
import random
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from ...data.sampler_state import sampler_state
from .checks import as_reference, compare
from .epoch import Epoch
from .ledger import Ledger
from .report import AuditReport
from .resume_report import ResumeRun, finished, listed, plural, said
from .tracing import Stuck, timed

__all__ = [
    "DEFAULT_CHECKPOINTS",
    "LoaderMaker",
    "ResumeCheck",
    "Unresumable",
    "checkpoint_positions",
    "length_or_none",
]

DEFAULT_CHECKPOINTS = 8
"""Checkpoints a resume check takes in an epoch longer than that."""

LoaderMaker = Callable[[int, int, int], Any]
"""``make_loader(num_workers, rank, world_size)``: a fresh loader (fresh sampler), for one rank."""


Judge = Callable[[Epoch, Epoch, str], AuditReport]
"""``judged(checkpointed, delivered, what)``: the report on what a job interrupted at a checkpoint
delivered (``delivered``), given the epoch the checkpoints were taken in (``checkpointed``)."""


class Unresumable(Exception):
    """The loader cannot be checkpointed or resumed at all: the reason, for the report."""


def checkpoint_positions(batches: int, count: int, seed: int) -> list[int]:
    """The batches after which to checkpoint an epoch of ``batches`` a rank: every one when there are no
    more than ``count``. Else the first, the last (the epoch done), the second, the second-to-last and the
    third (so that a sampler wrong at every second or every third position is caught whatever the seed),
    and the others one in each of equal stretches of the rest, ``seed`` picking where in its stretch."""
    if batches <= count:
        return list(range(1, batches + 1))
    ends = [1, batches, 2, batches - 1, 3][:count]
    middle = range(4, batches - 1)
    picks = count - len(ends)
    draw = random.Random(seed)
    spread = [
        middle[draw.randrange(len(middle) * i // picks, len(middle) * (i + 1) // picks)] for i in range(picks)
    ]
    return sorted({*ends, *spread})


@dataclasses.dataclass(frozen=True)
class Plan:
    """One way to resume: on how many workers and ranks, and whether through the batch sampler's part of
    the state (another worker count or world size) or the loader's own."""

    what: str
    workers: int
    world_size: int
    through_sampler: bool


@dataclasses.dataclass
class Checkpoints:
    """The checkpointed epoch: what its loaders delivered, the states after each chosen batch, and how
    many ids had come by then."""

    epoch: Epoch
    states: dict[int, list[dict]]
    delivered_by: dict[int, int]
    steps: list[int]


class ResumeCheck:
    """Runs the resumes on the loaders ``make_loader`` makes and returns the report.

    Args:
        make_loader: a fresh loader for ``(num_workers, rank, world_size)``; it must have
            ``state_dict``/``load_state_dict`` (a ``StatefulDataLoader``).
        workers: the checkpointed loaders' workers.
        other_workers: the workers of the resume through the batch sampler's part of the state; None
            leaves that resume out (one process) or resumes on ``workers`` (``world_sizes``).
        id_key: the batches' id field.
        seed: picks the checkpoints in the middle of an epoch longer than ``checkpoints``.
        checkpoints: how many checkpoints an epoch gets (all its batches when it has no more).
        world_sizes: ``(W, W')`` to resume W ranks' checkpoints on W' ranks; None for one process.
        dataset_ids: the data set's ids, which a resume across ranks must cover: N for the ids
            ``0..N-1``, or the ids, or a callable giving either, called inside the check (without them
            such a resume is not verified).
        timeout: seconds to wait for one batch (0: forever); a batch later than that is a failure.
        out: where progress lines go.
    """

    def __init__(
        self,
        make_loader: LoaderMaker,
        *,
        workers: int,
        other_workers: int | None,
        id_key: str = "id",
        seed: int = 0,
        checkpoints: int = DEFAULT_CHECKPOINTS,
        world_sizes: tuple[int, int] | None = None,
        dataset_ids: int | Iterable | Callable[[], int | Iterable] | None = None,
        timeout: float = 0,
        out: Callable[[str], Any] = print,
    ) -> None:
        if checkpoints < 2:
            raise ValueError(
                f"checkpoints: at least 2 (after the first batch and after the last), got {checkpoints}"
            )
        self.make_loader = make_loader
        self.workers, self.other_workers = workers, other_workers
        self.id_key = id_key
        self.seed = seed
        self.checkpoints = checkpoints
        self.world_sizes = world_sizes
        self.dataset_ids = dataset_ids
        self.timeout = timeout
        self.out = out
        self.weights_only_note: str | None = None
        self._started = 0.0

    def run(self) -> dict:
        """The report as a dict: ``exit_status`` 0 (every resume went on as the checkpointed loader),
        1 (a resume lost or repeated samples, named, or the loader failed) or 2 (the loader cannot be
        checkpointed, or its epoch is too short to try)."""
        self._started = time.perf_counter()
        world, world_after = self.world_sizes or (1, 1)
        try:
            loaders = [self.make_loader(self.workers, rank, world) for rank in range(world)]
            batches, counted_by = self._batches_a_rank(loaders, world)
            if batches < 2:
                raise Unresumable(
                    f"the epoch has {batches} batches a rank: a checkpoint needs one before it and one after"
                )
            positions = checkpoint_positions(batches, self.checkpoints, self.seed)
            middle = batches > self.checkpoints > 5  # beyond the ends checkpoint_positions always takes
            picked = f" (--seed {self.seed} picked the middle ones)" if middle else ""
            self.out(
                f"resume check: {plural(len(positions), 'checkpoint')}, after batch {listed(positions)} "
                f"of {batches}" + (f" on each of {world} ranks" if world > 1 else "") + picked
            )
            judged = self._judge(loaders[0])
            checkpoints = self._checkpoints(loaders, positions)
        except Unresumable as error:
            return self._finished([], unverified=str(error))
        except (Exception, Stuck) as error:  # the loader itself fails: no resume can be judged
            failed = ResumeRun("the checkpointed epoch", None, problems=[self._failure(error)])
            _let_the_loaders_go(error)
            said([failed], self.out)
            return self._finished([failed])
        runs = []
        ran = checkpoints.steps
        problems = (
            [f"the ranks ran different numbers of steps ({ran}): DDP would hang"] if len(set(ran)) > 1 else []
        )
        if max(ran) != batches:
            problems.append(f"the epoch ran {max(ran)} batches a rank, not the {batches} {counted_by}")
        if problems:
            runs.append(ResumeRun("the checkpointed epoch", None, problems=problems))
            said(runs, self.out)
        taken = [position for position in positions if position in checkpoints.states]
        for plan in self._plans() if taken else []:
            # Every checkpoint, also after one that could not be resumed: a refusal can depend on the
            # checkpoint (TokenBudgetBatches, too few samples left for the ranks), and a wrong resume at
            # another must still show.
            tried = [self._resume(plan, position, checkpoints, judged) for position in taken]
            said(tried, self.out)
            runs += tried
        return self._finished(runs, positions=taken, batches=batches)

    # -- the runs ---------------------------------------------------------------------------------

    def _plans(self) -> list[Plan]:
        workers, other = self.workers, self.other_workers
        if self.world_sizes is None:
            plans = [Plan(f"workers {workers} -> {workers} (the loader's own state)", workers, 1, False)]
            if other is not None:
                plans.append(Plan(f"workers {workers} -> {other} (the sampler's part of it)", other, 1, True))
            return plans
        world, world_after = self.world_sizes
        after = workers if other is None else other
        what = f"{plural(world, 'rank')} -> {plural(world_after, 'rank')}, workers {workers}" + (
            f" -> {after}" if after != workers else ""
        )
        return [Plan(what, after, world_after, world != world_after or after != workers)]

    def _batches_a_rank(self, loaders: list, world: int) -> tuple[int, str]:
        """The batches each rank's epoch holds, and how that is known: the loaders' len() over a map-style
        dataset; else (an IterableDataset, a loader without len()) counted by running an epoch of fresh
        loaders."""
        try:
            if not any(isinstance(getattr(loader, "dataset", None), IterableDataset) for loader in loaders):
                return min(len(loader) for loader in loaders), "its len() says"
        except TypeError:
            pass
        fresh = [self.make_loader(self.workers, rank, world) for rank in range(world)]
        return min(self._lockstep(fresh, None)), "an epoch before it ran"

    def _judge(self, loader: Any) -> Judge:
        """How a resume's ids are judged. On the same world size: against the checkpointed epoch, batch
        for batch. Across ranks, also against the data set, up to what the batch sampler (``loader``'s)
        says a resume may repeat and drop (on the same world size too: a split that repeats or loses
        samples repeats or loses them in the checkpointed epoch as well); a sampler that says nothing is
        held to every sample exactly once."""
        if self.world_sizes is None:
            return _as_checkpointed
        covering = self._covering(loader, *self.world_sizes)
        if self.world_sizes[0] != self.world_sizes[1]:
            return covering

        def both(checkpointed: Epoch, delivered: Epoch, what: str) -> AuditReport:
            report = _as_checkpointed(checkpointed, delivered, what)
            return covering(checkpointed, delivered, what) if report.ok else report

        return both

    def _covering(self, loader: Any, world: int, world_after: int) -> Judge:
        """Against the data set, within the batch sampler's ``resume_allowance(world, world_after)``."""
        batch_sampler = getattr(loader, "batch_sampler", None)
        name = type(batch_sampler).__name__
        stated = getattr(batch_sampler, "resume_allowance", None)
        if callable(stated):
            try:
                allowance = stated(world, world_after)
                repeats, drops = int(allowance.repeats), int(allowance.drops)
            except Exception as error:  # the user's method: whatever it raises or returns is the reason
                raise Unresumable(
                    f"{name}.resume_allowance({world}, {world_after}) gave no ResumeAllowance(repeats=..., "
                    f"drops=...) (fastcollate.data.sampler_state): {type(error).__name__}: {error}"
                ) from error
        else:
            self.out(
                f"  note: {name} has no resume_allowance(world_size, resumed_world_size): held to every "
                "sample exactly once"
            )
            repeats = drops = 0
        ids = self.dataset_ids() if callable(self.dataset_ids) else self.dataset_ids
        if ids is None:
            raise Unresumable(
                "a resume across ranks is checked against the data set's ids, and they are not known: give "
                "dataset_ids (N for the ids 0..N-1)"
            )
        if not isinstance(ids, int):  # the data set's own duplicate ids are its own repeats
            repeats += len(ids) - len(set(ids))
        data_set = as_reference(ids, Epoch(ids=np.zeros(0, np.int64)))
        return lambda checkpointed, delivered, what: compare(
            data_set,
            delivered,
            order="any",
            allowed_repeats=repeats,
            allowed_dropped=drops,
            what=what,
            source_kind="rank",
        )

    def _checkpoints(self, loaders: list, positions: list[int]) -> Checkpoints:
        """One epoch of the rank ``loaders`` in lockstep, their states taken (saved and loaded) after each
        of ``positions``."""
        ledger = Ledger(self.id_key)
        ledger.begin_epoch()
        states: dict[int, list[dict]] = {}
        delivered_by: dict[int, int] = {}

        def take(step: int) -> None:
            if step in positions:
                states[step] = [self._saved_and_loaded(_state_of(loader)) for loader in loaders]
                delivered_by[step] = ledger.recorded

        steps = self._lockstep(loaders, ledger, after_step=take)
        return Checkpoints(ledger.end_epoch(), states, delivered_by, steps)

    def _lockstep(
        self, loaders: list, ledger: Ledger | None, after_step: Callable[[int], None] | None = None
    ) -> list[int]:
        """Steps the rank ``loaders`` together, one batch each a step, as DDP's ranks step, recording
        every batch in ``ledger``; ``after_step(k)`` after the k-th. Returns the batches of each rank."""
        iterators = [timed(loader, self.timeout) for loader in loaders]
        steps = [0] * len(loaders)
        running = set(range(len(loaders)))
        while True:
            for rank in sorted(running):
                item = next(iterators[rank], _END)
                if item is _END:
                    running.discard(rank)
                    continue
                if ledger is not None:
                    _record(ledger, item)
                steps[rank] += 1
            if not running:
                return steps
            if after_step is not None:
                after_step(max(steps))

    def _resume(self, plan: Plan, position: int, checkpoints: Checkpoints, judged: Judge) -> ResumeRun:
        ledger = Ledger(self.id_key)
        ledger.begin_epoch()
        states = checkpoints.states[position]

        def resumed(rank: int) -> Any:
            loader = self.make_loader(plan.workers, rank, plan.world_size)
            self._load(loader, states[rank % len(states)], plan.through_sampler)  # any rank's will do
            return loader

        try:
            if plan.world_size == len(states):  # judged batch for batch: the checkpointed lockstep order
                loaders = [resumed(rank) for rank in range(plan.world_size)]
                steps = self._lockstep(loaders, ledger)
                counted = {length_or_none(loader) for loader in loaders}
            else:  # judged in any order: one rank at a time, so that many ranks hold few files at once
                steps, counted = [], set()
                for rank in range(plan.world_size):
                    loader = resumed(rank)
                    steps += self._lockstep([loader], ledger)
                    counted.add(length_or_none(loader))
        except Unresumable as error:
            ledger.end_epoch(complete=False)
            return ResumeRun(plan.what, position, unverified=str(error))
        except (Exception, Stuck) as error:
            ledger.end_epoch(complete=False)
            _let_the_loaders_go(error)
            return ResumeRun(plan.what, position, problems=[self._failure(error)])
        delivered = _joined(checkpoints.epoch, checkpoints.delivered_by[position], ledger.end_epoch())
        run = ResumeRun(
            plan.what,
            position,
            report=judged(checkpoints.epoch, delivered, f"{plan.what}, after batch {position}"),
        )
        if len(set(steps)) > 1:
            run.problems.append(
                f"the ranks ran different numbers of steps after the resume ({steps}): DDP would hang"
            )
        # A training loop that restores its step count with the state counts the epoch as len(): read
        # after the run, as the loop reads it once the state is loaded.
        counted -= {None}
        if counted and counted != {position + max(steps, default=0)}:
            run.problems.append(
                f"len() says {listed(sorted(counted))} batches a rank for the resumed epoch, but "
                f"{position} ran before the checkpoint and {max(steps, default=0)} after it: a training "
                "loop counting by len() (Lightning's) would end the epoch early or wait for batches"
            )
        return run

    def _load(self, loader: Any, state: dict, through_sampler: bool) -> None:
        if not through_sampler:
            loader.load_state_dict(state)
            return
        if isinstance(getattr(loader, "dataset", None), IterableDataset):
            raise Unresumable(
                "an IterableDataset is resumed from its own state_dict/load_state_dict (or replayed) on the "
                "same num_workers only: each worker reads its own part of the stream"
            )
        batch_sampler = getattr(loader, "batch_sampler", None)
        if not hasattr(batch_sampler, "load_state_dict"):
            raise Unresumable(
                f"its batch sampler ({type(batch_sampler).__name__}) keeps no state, so only the loader's "
                "own state can resume it, and StatefulDataLoader refuses that under another num_workers "
                "or on other ranks"
            )
        try:
            batch_sampler.load_state_dict(sampler_state(state))
        except ValueError as error:
            raise Unresumable(str(error)) from error

    def _saved_and_loaded(self, state: dict) -> dict:
        """``state`` after ``torch.save`` and ``torch.load``, as a checkpoint holds it."""
        buffer = io.BytesIO()
        try:
            torch.save(state, buffer)
        except Exception as error:
            raise Unresumable(
                f"the loader's state cannot be saved with torch.save: {type(error).__name__}: {error}"
            ) from error
        try:
            buffer.seek(0)
            return torch.load(buffer, weights_only=True)
        except Exception as error:
            if self.weights_only_note is None:
                self.weights_only_note = (
                    f"the state loads only with torch.load(weights_only=False): {type(error).__name__}"
                )
                self.out(f"  note: {self.weights_only_note}")
            buffer.seek(0)
            return torch.load(buffer, weights_only=False)

    def _finished(self, runs: list[ResumeRun], **outcome: Any) -> dict:
        seconds = time.perf_counter() - self._started
        return finished(
            runs,
            self.out,
            seconds=seconds,
            world_sizes=self.world_sizes,
            weights_only=self.weights_only_note,
            **outcome,
        )

    def _failure(self, error: BaseException) -> str:
        """An exception in one line: its class and its message's first line (a contract's error names
        the sample and the field, never its values)."""
        if isinstance(error, Stuck):
            return f"no batch came within --timeout {self.timeout:g} s"
        lines = str(error).strip().splitlines()
        return f"the loader raised {type(error).__name__}: {lines[0] if lines else ''}"


_END = object()


def _let_the_loaders_go(error: BaseException) -> None:
    """Drops ``error``'s traceback once its one line is taken. torch re-raises a worker's error from a
    frame that holds it, so the traceback would keep the loaders' iterators in a reference cycle; the
    garbage collector frees such an iterator after its queues, and DataLoader then waits 5 s for each
    worker, never told to stop, before killing it."""
    error.__traceback__ = None


def _as_checkpointed(checkpointed: Epoch, delivered: Epoch, what: str) -> AuditReport:
    """The same ids in the same order as the checkpointed epoch: the repeats its own padding made, and
    only those, are the resume's too."""
    repeats = int(checkpointed.ids.size - np.unique(checkpointed.ids).size)
    return compare(
        checkpointed, delivered, order="same", allowed_repeats=repeats, what=what, source_kind="rank"
    )


def _joined(checkpointed: Epoch, before: int, resumed: Epoch) -> Epoch:
    """The first ``before`` ids the checkpointed loaders delivered, then what the resumed ones did: what a
    job interrupted at that checkpoint delivered."""
    names = {**(checkpointed.names or {}), **(resumed.names or {})}
    return Epoch(
        ids=np.concatenate([checkpointed.ids[:before], resumed.ids]),
        names=names or None,
        complete=resumed.complete,
    )


def length_or_none(loader: Any) -> int | None:
    """``len(loader)``, or None where it has none (an IterableDataset's loader, or raising)."""
    try:
        return len(loader)
    except Exception:  # an IterableDataset's loader, or one without len()
        return None


def _state_of(loader: Any) -> dict:
    if not callable(getattr(loader, "state_dict", None)):
        raise Unresumable(
            f"a {type(loader).__name__} has no state_dict: use torchdata's StatefulDataLoader, which a "
            "checkpoint can hold"
        )
    try:
        return loader.state_dict()
    except Exception as error:
        raise Unresumable(f"the loader's state_dict() raised {type(error).__name__}: {error}") from error


def _record(ledger: Ledger, batch: Any) -> None:
    try:
        ledger.record(batch)
    except KeyError as error:  # no ids in the batch: nothing to prove exactly-once with
        raise Unresumable(error.args[0] if error.args else str(error)) from error
