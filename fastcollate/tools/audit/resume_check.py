"""``doctor --resume``: proves from the sample ids that a loader resumed from a checkpoint delivers the
epoch exactly once.

An uninterrupted epoch is the reference. Then a loader runs to a batch drawn at random, its state goes
through ``torch.save`` as a checkpoint would, and a fresh loader resumes from it: once with the same
``num_workers`` (the loader's own ``load_state_dict``) and once with another (the batch sampler's part of
the state, ``fastcollate.sampler_state``). What the first loader delivered and what the resumed one did
must together be the reference's samples, once each. With ``world_sizes=(W, W')``, W rank loaders (in
this process, stepping in lockstep) take the checkpoint and W' resume it.
"""

from __future__ import annotations

import dataclasses
import io
import random
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import IterableDataset

from ...data.sampler_state import sampler_state
from .checks import compare
from .epoch import Epoch
from .ledger import Ledger
from .record_sheet import EXIT_OK, EXIT_PROBLEM, EXIT_UNVERIFIED
from .report import AuditReport
from .tracing import Stuck, timed

__all__ = ["LoaderMaker", "ResumeCheck", "Unresumable"]

LoaderMaker = Callable[[int, int, int], Any]
"""``make_loader(num_workers, rank, world_size)``: a fresh loader (fresh sampler), for one rank."""


class Unresumable(Exception):
    """The loader cannot be checkpointed or resumed at all: the reason, for the report."""


@dataclasses.dataclass
class ResumeRun:
    """One resume: from which setting to which, and what the ids showed (or why it could not run)."""

    what: str
    report: AuditReport | None = None
    unverified: str | None = None

    problems: list[str] = dataclasses.field(default_factory=list)  # beyond the ids: uneven ranks

    @property
    def status(self) -> int:
        if self.unverified is not None:
            return EXIT_UNVERIFIED
        return EXIT_OK if self.report is not None and self.report.ok and not self.problems else EXIT_PROBLEM


class ResumeCheck:
    """Runs the resumes on the loaders ``make_loader`` makes and returns the report.

    Args:
        make_loader: a fresh loader for ``(num_workers, rank, world_size)``; it must have
            ``state_dict``/``load_state_dict`` (a ``StatefulDataLoader``).
        workers: the first loader's workers; ``other_workers`` the second resume's.
        id_key: the batches' id field.
        seed: draws the checkpoint's batch.
        world_sizes: ``(W, W')`` to resume W ranks' checkpoint on W' ranks; None for one process.
        allowed_repeats, allowed_dropped: what the sampler's rule lets an elastic resume repeat or
            drop (its padding and ``drop_last``), reported apart from real losses and repeats.
        timeout: seconds to wait for one batch (0: forever); a batch later than that is a failure.
        out: where progress lines go.
    """

    def __init__(
        self,
        make_loader: LoaderMaker,
        *,
        workers: int,
        other_workers: int,
        id_key: str = "id",
        seed: int = 0,
        world_sizes: tuple[int, int] | None = None,
        allowed_repeats: int = 0,
        allowed_dropped: int = 0,
        timeout: float = 0,
        out: Callable[[str], Any] = print,
    ) -> None:
        self.make_loader = make_loader
        self.workers, self.other_workers = workers, other_workers
        self.id_key = id_key
        self.seed = seed
        self.world_sizes = world_sizes
        self.allowed_repeats, self.allowed_dropped = allowed_repeats, allowed_dropped
        self.timeout = timeout
        self.out = out
        self.weights_only_note: str | None = None

    def run(self) -> dict:
        """The report as a dict: ``exit_status`` 0 (every resume delivered the epoch once), 1 (a resume
        lost or repeated samples, named, or the loader failed) or 2 (the loader cannot be checkpointed,
        or its epoch is too short to try)."""
        world, world_after = self.world_sizes or (1, 1)
        try:
            reference = self._uninterrupted(world)
        except Unresumable as error:
            return self._finish([], None, str(error))
        except (Exception, Stuck) as error:  # the loader itself fails: no resume can be judged
            failed = self._said(ResumeRun("the uninterrupted epoch", problems=[self._failure(error)]))
            return self._finish([failed], None, None)
        if reference.batches // world < 2:
            return self._finish(
                [],
                None,
                f"the epoch has {reference.batches // world} batches a rank: a "
                "checkpoint needs one before it and one after",
            )
        batch = random.Random(self.seed).randint(1, reference.batches // world - 1)
        self.out(
            f"resume check: a checkpoint after batch {batch} of {reference.batches // world}"
            + (f" on each of {world} ranks" if world > 1 else "")
            + f" (--seed {self.seed})"
        )
        if self.world_sizes:
            ranks = f"{_ranks(world)} -> {_ranks(world_after)}, workers {self.workers}"
            plans = [(ranks, self.workers)]
        else:
            plans = [
                (f"workers {self.workers} -> {self.workers} (the loader's own state)", self.workers),
                (
                    f"workers {self.workers} -> {self.other_workers} (the sampler's part of it)",
                    self.other_workers,
                ),
            ]
        runs = [self._resume(what, reference, batch, world, world_after, after) for what, after in plans]
        return self._finish(runs, batch, None)

    # -- the runs ---------------------------------------------------------------------------------

    def _uninterrupted(self, world: int) -> Epoch:
        ledger = Ledger(self.id_key)
        ledger.begin_epoch()
        for rank in range(world):
            for item in timed(self.make_loader(self.workers, rank, world), self.timeout):
                _record(ledger, item)
        return ledger.end_epoch()

    def _resume(
        self, what: str, reference: Epoch, batch: int, world: int, world_after: int, workers_after: int
    ) -> ResumeRun:
        ledger = Ledger(self.id_key)
        ledger.begin_epoch()
        try:
            states = self._checkpoint(ledger, batch, world)
            steps = []
            for rank in range(world_after):
                loader = self.make_loader(workers_after, rank, world_after)
                same = world == world_after and workers_after == self.workers
                self._load(loader, states[rank % world], same)  # any rank's state will do
                steps.append(0)
                for item in timed(loader, self.timeout):
                    _record(ledger, item)
                    steps[-1] += 1
        except Unresumable as error:
            ledger.end_epoch(complete=False)
            return self._said(ResumeRun(what, unverified=str(error)))
        except (Exception, Stuck) as error:
            ledger.end_epoch(complete=False)
            return self._said(ResumeRun(what, problems=[self._failure(error)]))
        report = compare(
            reference,
            ledger.end_epoch(),
            order="any",
            allowed_repeats=self.allowed_repeats,
            allowed_dropped=self.allowed_dropped,
            what=what,
            source_kind="rank",
        )
        run = ResumeRun(what, report=report)
        if len(set(steps)) > 1:
            run.problems.append(
                f"the ranks ran different numbers of steps after the resume ({steps}): DDP would hang"
            )
        return self._said(run)

    def _checkpoint(self, ledger: Ledger, batch: int, world: int) -> list[dict]:
        """``world`` loaders take ``batch`` batches each, in lockstep; their states, saved and loaded."""
        loaders = [self.make_loader(self.workers, rank, world) for rank in range(world)]
        iterators = [timed(loader, self.timeout) for loader in loaders]
        for _ in range(batch):
            for iterator in iterators:
                item = next(iterator, None)
                if item is not None:
                    _record(ledger, item)
        states = [self._saved_and_loaded(_state_of(loader)) for loader in loaders]
        del iterators  # the job is gone, and its workers with it
        return states

    def _load(self, loader: Any, state: dict, same: bool) -> None:
        if same:
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

    def _failure(self, error: BaseException) -> str:
        """An exception in one line: its class and its message's first line (a contract's error names
        the sample and the field, never its values)."""
        if isinstance(error, Stuck):
            return f"no batch came within --timeout {self.timeout:g} s"
        lines = str(error).strip().splitlines()
        return f"the loader raised {type(error).__name__}: {lines[0] if lines else ''}"

    # -- the report -------------------------------------------------------------------------------

    def _said(self, run: ResumeRun) -> ResumeRun:
        if run.unverified is not None:
            self.out(f"  {run.what}: NOT VERIFIED: {run.unverified}")
            return run
        report = run.report
        if report is None:
            self.out(f"  {run.what}: FAILED: {'; '.join(run.problems)}")
        elif run.status == EXIT_OK:
            repeats = sum(report.padded.values()) - len(report.padded)
            extra = f", and {repeats} repeated by the sampler's padding" if repeats else ""
            extra += f", {len(report.dropped)} left out by drop_last" if report.dropped else ""
            self.out(f"  {run.what}: OK, every one of {report.expected} samples delivered once{extra}")
        else:
            self.out(f"  {run.what}: FAILED")
            for line in [*run.problems, *str(report).splitlines()[1:]]:
                self.out(f"    {line.strip()}")
        return run

    def _finish(self, runs: list[ResumeRun], batch: int | None, unverified: str | None) -> dict:
        if unverified is not None:
            self.out(f"resume check: NOT VERIFIED: {unverified}")
            status = EXIT_UNVERIFIED
        else:
            statuses = {run.status for run in runs}
            status = EXIT_PROBLEM if EXIT_PROBLEM in statuses else max(statuses)
            verdict = {EXIT_OK: "OK", EXIT_PROBLEM: "FAILED", EXIT_UNVERIFIED: "NOT VERIFIED"}[status]
            self.out(f"resume check: {verdict} (exit status {status})")
        return {
            "check": "resume",
            "checkpoint_batch": batch,
            "world_sizes": list(self.world_sizes) if self.world_sizes else None,
            "unverified": unverified,
            "runs": [
                {
                    "what": run.what,
                    "unverified": run.unverified,
                    "problems": run.problems,
                    "report": run.report.to_dict() if run.report is not None else None,
                }
                for run in runs
            ],
            "weights_only": self.weights_only_note,
            "exit_status": status,
        }


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


def _ranks(count: int) -> str:
    return f"{count} rank{'s' if count != 1 else ''}"
