"""One loader setting run for the doctor, under tracing: the epochs it delivered, the failure it ended
on (which sample, which stage, each process's last step), and how batch shapes varied."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from ..._torch_compat import loader_workers
from ...structure import tree
from .epoch import Epoch
from .failures import Failure, StageFailed, error_text, raised_at
from .ledger import Ledger
from .tracing import StepBoard, Stuck, TracedCollate, TracedMap, TracedStream, timed
from .workers import WorkerTagged

__all__ = ["LoaderPlan", "SettingRun", "batch_signature", "copy_to_device", "cuda_available", "run_setting"]

MAX_SHAPE_NOTES = 5
"""Batches whose shapes differ from the first batch's that a run describes; the rest are not noted."""
TOO_MANY_WORKERS = r"This DataLoader will create \d+ worker processes in total"
"""The start of torch's warning when a DataLoader has more workers than the CPUs it may use."""


@dataclasses.dataclass(frozen=True)
class LoaderPlan:
    """What every setting the doctor runs shares: only the number of workers changes between them.

    Attributes:
        dataset: the dataset (wrapped by ``with_ids`` when its samples carry no id).
        iterable: whether it is an IterableDataset.
        batch_size: the batch size.
        id_key: the samples' id field.
        targets: the fields whose digests the ledger records.
        ids_are_indices: the ids are dataset indices (``with_ids``).
        timeout: seconds to wait for one batch (0: forever).
        persistent_workers: keep the workers between epochs.
        show_errors: errors quote their messages.
        collate_fn: the collate every setting runs (the factory's, or ``assemble`` under its contract).
        batch_sampler: the factory's batch sampler, which replaces ``batch_size``; None: in order.
    """

    dataset: Dataset
    iterable: bool
    batch_size: int
    id_key: str
    targets: list[str]
    ids_are_indices: bool
    timeout: float
    persistent_workers: bool
    show_errors: bool
    collate_fn: Callable[[list], Any] | None = None
    batch_sampler: Any = None

    @property
    def unit(self) -> str:
        """What a sample's position is called in the messages."""
        return "stream position" if self.iterable else "index"


@dataclasses.dataclass
class SettingRun:
    """What a setting delivered: one epoch per pass completed, the failure that ended it, and notes on
    batches whose shapes differ from the first's."""

    epochs: list[Epoch]
    failure: Failure | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    usable_cpus: int | None = None  # set when torch warned that the workers outnumber them


def run_setting(plan: LoaderPlan, workers: int, epochs: int, transfer: bool = False) -> SettingRun:
    """Runs ``epochs`` passes with ``workers`` workers, stopping at the first failure; ``transfer``
    copies every batch to the GPU when there is one.

    Torch's warning that the workers outnumber the usable CPUs is kept out of the report: it comes
    once for the DataLoader and once per epoch, mid-report, in torch's words. ``usable_cpus`` carries
    it for the checklist to say once, where the workers are."""
    with _worker_count_warning() as usable:
        run = _run_setting(plan, workers, epochs, transfer)
    run.usable_cpus = usable[0] if usable else None
    return run


@contextlib.contextmanager
def _worker_count_warning() -> Iterator[list[int]]:
    """Catches torch's too-many-workers warning (yielding the CPU count it names, once); any other
    warning is shown as it would have been."""
    usable: list[int] = []
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as recorded:
            caught = recorded
            warnings.filterwarnings("always", message=TOO_MANY_WORKERS)  # even under -W error or ignore
            yield usable
    finally:  # the others are shown once the recording is over (shown inside, they would be recorded)
        for warning in caught:
            text = str(warning.message)
            if not re.match(TOO_MANY_WORKERS, text):
                warnings.showwarning(
                    warning.message, warning.category, warning.filename, warning.lineno, warning.file,
                    warning.line,
                )
            elif not usable:
                named = re.search(r"current system is (\d+)", text)
                usable.append(int(named.group(1)) if named else _cpus())


def _cpus() -> int:
    """The CPUs this process may run on (its affinity, where the platform has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def _run_setting(plan: LoaderPlan, workers: int, epochs: int, transfer: bool) -> SettingRun:
    board = StepBoard(workers)
    if plan.iterable:
        traced: Dataset = TracedStream(plan.dataset, board, plan.show_errors, plan.id_key)  # type: ignore[arg-type]
    else:
        traced = TracedMap(plan.dataset, board, plan.show_errors, plan.ids_are_indices)
    if plan.batch_sampler is not None:
        batching: dict[str, Any] = {"batch_sampler": plan.batch_sampler}
    else:
        batching = {"batch_size": plan.batch_size, "shuffle": False}
    loader = DataLoader(
        traced,
        num_workers=workers,
        collate_fn=TracedCollate(board, plan.id_key, plan.show_errors, plan.collate_fn),
        **batching,
        timeout=plan.timeout if workers else 0,
        persistent_workers=plan.persistent_workers and workers > 0,
    )
    ledger = Ledger(plan.id_key, target_key=plan.targets or None)
    run = SettingRun(epochs=[])
    device = torch.device("cuda") if transfer and cuda_available() else None
    for _ in range(epochs):
        first_signature: dict[str, str] | None = None
        try:
            for number, batch in enumerate(ledger.watch(_deliver(plan, loader, workers))):
                signature = batch_signature(batch)
                if first_signature is None:
                    first_signature = signature
                elif signature != first_signature and len(run.notes) < MAX_SHAPE_NOTES:
                    run.notes.append(_shape_note(number, first_signature, signature))
                if device is not None:
                    _transfer(plan, batch, device)
        except StageFailed as failed:
            run.failure = failed.failure
            break
        except (Stuck, Exception) as error:
            run.failure = _failure_of(plan, error, board)
            break
        run.epochs.append(ledger.last)
    del loader  # shuts persistent workers down
    return run


def batch_signature(batch: Any) -> dict[str, str]:
    """Each tensor field's dtype and per-sample shape: what must not change from batch to batch."""
    return {
        path or "<batch>": f"{leaf.dtype} {list(leaf.shape[1:])}"
        for path, leaf in tree.leaf_paths(batch)
        if isinstance(leaf, torch.Tensor)
    }


def _shape_note(number: int, first: dict[str, str], signature: dict[str, str]) -> str:
    changed = sorted(k for k in set(first) | set(signature) if first.get(k) != signature.get(k))
    return f"batch {number} differs from batch 0 in " + ", ".join(
        f"{k!r} ({first.get(k)} -> {signature.get(k)})" for k in changed
    )


def _failure_of(plan: LoaderPlan, error: BaseException, board: StepBoard) -> Failure:
    """What a setting's loop ended on, with each process's last step: a timeout (the alarm in one
    process, DataLoader's own with workers), a worker that died, or an error outside the traced
    steps (the sampler, a worker_init_fn)."""
    if isinstance(error, Stuck) or (isinstance(error, RuntimeError) and "timed out" in str(error)):
        stage, text, where = "timeout", f"no batch within --timeout {plan.timeout:g} s", ""
    elif isinstance(error, RuntimeError) and "DataLoader worker" in str(error):
        stage, text, where = "worker", error_text(error, True).splitlines()[0], ""
    else:
        stage, text, where = "loader", error_text(error, plan.show_errors), raised_at(error)
    return Failure(stage, board.stuck_at(plan.unit), text, where, last_steps=board.last_steps(plan.unit))


def _deliver(plan: LoaderPlan, loader: DataLoader, workers: int) -> Iterator[WorkerTagged]:
    """The loader's batches, turning a traced ``Failure`` into an exception at the step it ended."""
    iterator = iter(loader)
    try:
        yield from _checked(iterator, plan.timeout if workers == 0 else 0)
    except RuntimeError as error:
        if "timed out" in str(error):
            # A stuck worker would hold DataLoader's shutdown for its 5 s status interval before
            # being terminated anyway: end it now.
            for process in loader_workers(iterator):
                process.terminate()
        raise


def _checked(iterator: Iterator, timeout: float) -> Iterator[WorkerTagged]:
    for item in timed(iterator, timeout):
        if isinstance(item.batch, Failure):
            if item.batch.worker is None:
                item.batch.worker = item.worker
            raise StageFailed(item.batch)
        yield item


def copy_to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor copied to ``device`` (asynchronously where it can be), its
    containers rebuilt with their own types."""
    return tree.map_leaves(
        lambda leaf: leaf.to(device, non_blocking=True) if isinstance(leaf, torch.Tensor) else leaf, batch
    )


def _transfer(plan: LoaderPlan, batch: Any, device: torch.device) -> None:
    try:
        copy_to_device(batch, device)
        torch.cuda.synchronize(device)
    except Exception as error:
        ids = tree.lookup(batch, plan.id_key)
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        text = error_text(error, plan.show_errors)
        raise StageFailed(Failure("transfer", f"the batch of ids {ids}", text, raised_at(error))) from None


def cuda_available() -> bool:
    """Whether a GPU can be used; False, not an exception, when CUDA cannot even be queried."""
    try:
        return torch.cuda.is_available()
    except Exception:
        return False
