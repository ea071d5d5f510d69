"""Tracing a loader for the doctor: each process marks its step before running it, so that a failure
names its sample and stage, and a timeout names where each process is stuck.

The traced dataset and collate return a ``Failure`` instead of raising: an exception raised in a
worker reaches the main process as text, without the sample it was reading.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from ...assembler import assemble
from ...collate.errors import ContractError, sample_id
from .failures import Failure, error_text, raised_at
from .workers import WorkerTagged, current_worker

__all__ = [
    "StepBoard",
    "Stuck",
    "TRANSFORM_ATTRIBUTES",
    "TracedCollate",
    "TracedMap",
    "TracedStream",
    "alarm",
    "collated",
    "failing_sample",
    "timed",
    "transform_owner",
]

TRANSFORM_ATTRIBUTES = ("transform", "target_transform", "transforms")
"""torchvision's convention: switching these off leaves the raw access."""

_IDLE, _ACCESS, _COLLATE = 0.0, 1.0, 2.0
"""The steps a process marks on the ``StepBoard`` (floats: they share its tensor)."""


class StepBoard:
    """Each process's last step, in shared memory, so a timeout can say where a worker is stuck.

    Row 0 is the main process, row ``k + 1`` worker ``k``: (step, index or stream position, start time,
    steps taken). Written before each sample is read, so the index is known even if reading never ends.
    """

    def __init__(self, workers: int) -> None:
        self.cells = torch.zeros((workers + 1, 4), dtype=torch.float64).share_memory_()
        self._view = None

    def __getstate__(self) -> dict:
        return {"cells": self.cells}

    def __setstate__(self, state: dict) -> None:
        self.cells, self._view = state["cells"], None

    def mark(self, step: float, where: float) -> None:
        if self._view is None:
            self._view = self.cells.numpy()
        info = get_worker_info()
        row = self._view[0 if info is None else info.id + 1]
        row[0], row[1], row[2] = step, where, time.time()
        row[3] += 1

    def stuck_at(self, unit: str) -> str:
        """The step waited on longest, as ``"index 5 (...) in worker 1"``."""
        active = [
            (started, slot, step, where)
            for slot, (step, where, started, steps) in enumerate(self.cells.tolist())
            if steps and step in (_ACCESS, _COLLATE)
        ]
        if not active:
            started_any = any(steps for _, _, _, steps in self.cells.tolist())
            return (
                "an unknown step"
                if started_any
                else "start-up (no process had begun reading: slow worker start?)"
            )
        _, slot, step, where = min(active)
        who = "the main process" if slot == 0 else f"worker {slot - 1}"
        what = f"{unit} {int(where)} (raw access and transform)" if step == _ACCESS else "collate"
        return f"{what} in {who}"

    def last_steps(self, unit: str) -> list[str]:
        lines = []
        now = time.time()
        for slot, (step, where, started, steps) in enumerate(self.cells.tolist()):
            who = "main process" if slot == 0 else f"worker {slot - 1}"
            if steps == 0:
                continue
            if step == _ACCESS:
                lines.append(
                    f"{who}: reading {unit} {int(where)} (raw access and transform), "
                    f"started {now - started:.1f} s ago"
                )
            elif step == _COLLATE:
                lines.append(f"{who}: collating a batch, started {now - started:.1f} s ago")
            else:
                lines.append(f"{who}: between steps (its last one finished)")
        return lines


def transform_owner(dataset: Any) -> Any | None:
    """The object (the dataset or one it wraps) holding a torchvision-style ``transform``."""
    seen = 0
    while dataset is not None and seen < 8:
        own = vars(dataset) if hasattr(dataset, "__dict__") else {}
        if any(callable(own.get(name)) for name in TRANSFORM_ATTRIBUTES):
            return dataset
        dataset, seen = own.get("dataset"), seen + 1
    return None


@contextlib.contextmanager
def _transforms_off(owner: Any) -> Iterator[None]:
    saved = {name: getattr(owner, name) for name in TRANSFORM_ATTRIBUTES if name in vars(owner)}
    try:
        for name in saved:
            setattr(owner, name, None)
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)


class TracedMap(Dataset):
    """A map-style dataset that marks each index before reading it and returns a ``Failure`` instead
    of raising, naming the stage: a ``transform`` attribute is switched off to tell raw access from
    the transform."""

    def __init__(self, dataset: Dataset, board: StepBoard, show_errors: bool, ids_are_indices: bool) -> None:
        self.dataset = dataset
        self.board = board
        self.show_errors = show_errors
        self.ids_are_indices = ids_are_indices

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        self.board.mark(_ACCESS, index)
        try:
            return self.dataset[index]
        except Exception as error:
            return Failure(
                stage=self._stage_of(index),
                sample=f"index {index}" + (f" (id {index})" if self.ids_are_indices else ""),
                error=error_text(error, self.show_errors),
                where=raised_at(error),
                worker=current_worker(),
                sample_id=index,
            )

    def _stage_of(self, index: int) -> str:
        owner = transform_owner(self.dataset)
        if owner is None:
            return "raw access"
        with _transforms_off(owner):
            try:
                self.dataset[index]
            except Exception:
                return "raw access"
        return "transform"


class TracedStream(IterableDataset):
    """An iterable dataset that marks each stream position before reading it and yields a ``Failure``
    (then stops) instead of raising."""

    def __init__(self, dataset: IterableDataset, board: StepBoard, show_errors: bool, id_key: str) -> None:
        self.dataset = dataset
        self.board = board
        self.show_errors = show_errors
        self.id_key = id_key

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        stream = "the stream" if info is None else f"worker {info.id}'s stream"
        position, last = 0, None
        try:
            iterator = iter(self.dataset)
            while True:
                self.board.mark(_ACCESS, position)
                try:
                    sample = next(iterator)
                except StopIteration:
                    return
                last = sample_id(sample, self.id_key)
                position += 1
                yield sample
        except Exception as error:
            after = f", after id {last!r}" if last is not None else ""
            yield Failure(
                stage="raw access",
                sample=f"position {position} of {stream}{after}",
                error=error_text(error, self.show_errors),
                where=raised_at(error),
                worker=current_worker(),
            )


class TracedCollate:
    """A collate (``assemble`` unless given) that marks the collate step, tags the batch with its
    worker, and returns a ``Failure`` instead of raising: the sample's id and field from a
    ContractError, and for any other error the sample that fails alone or beside the batch's first."""

    def __init__(
        self,
        board: StepBoard,
        id_key: str,
        show_errors: bool,
        collate_fn: Callable[[list], Any] | None = None,
    ) -> None:
        self.board = board
        self.id_key = id_key
        self.show_errors = show_errors
        self.collate_fn = collate_fn or assemble

    def __call__(self, samples: list) -> WorkerTagged:
        worker = current_worker()
        for sample in samples:
            if isinstance(sample, Failure):
                return WorkerTagged(worker, sample)
        self.board.mark(_COLLATE, -1)
        batch = collated(self.collate_fn, samples, self.id_key, self.show_errors)
        if isinstance(batch, Failure):
            batch.worker = worker
        else:
            self.board.mark(_IDLE, -1)
        return WorkerTagged(worker, batch)


def collated(collate_fn: Callable[[list], Any], samples: list, id_key: str, show_errors: bool) -> Any:
    """``collate_fn(samples)``, or the ``Failure`` it ended on: a ContractError's sample and field, or
    for any other error the batch's ids and the one sample ``failing_sample`` narrows it to."""
    try:
        return collate_fn(samples)
    except ContractError as error:
        who = f"id {error.sample_id!r}" if error.sample_id is not None else f"batch position {error.position}"
        return Failure(  # no `where`: it would point into assemble
            stage="collate", sample=who, error=error_text(error, True), field=error.field,
            sample_id=error.sample_id,
        )
    except Exception as error:
        ids = [sample_id(s, id_key) for s in samples]
        culprit = failing_sample(collate_fn, samples)
        named = "" if culprit is None else f"id {ids[culprit[0]]!r} ({culprit[1]}) in "
        return Failure(
            stage="collate",
            sample=f"{named}the batch of ids {ids}",
            error=error_text(error, show_errors),
            where=raised_at(error),
            sample_id=None if culprit is None else ids[culprit[0]],
        )


def failing_sample(collate_fn: Callable[[list], Any], samples: list) -> tuple[int, str] | None:
    """After ``collate_fn`` failed on ``samples``: the position of the sample it fails on alone, or
    else of the first it fails on beside the first sample, and which of the two it was; None when
    neither narrows it down. Runs only after a failure, so a healthy batch pays nothing for it."""
    for position, sample in enumerate(samples):
        try:
            collate_fn([sample])
        except Exception:
            return position, "fails alone"
    for position, sample in enumerate(samples[1:], start=1):
        try:
            collate_fn([samples[0], sample])
        except Exception:
            return position, "does not collate with the batch's first"
    return None


class Stuck(BaseException):
    """Raised by the alarm: a BaseException so that a dataset's ``except Exception`` cannot swallow it."""


@contextlib.contextmanager
def alarm(seconds: float) -> Iterator[None]:
    """Raises ``Stuck`` in the main thread after ``seconds``: DataLoader's own timeout needs workers."""
    usable = (
        seconds > 0 and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return

    def stuck(signum, frame):
        raise Stuck()

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def timed(iterable: Any, seconds: float) -> Iterator[Any]:
    """``iterable``'s items, each fetched under ``alarm(seconds)``."""
    iterator = iter(iterable)
    while True:
        with alarm(seconds):
            try:
                item = next(iterator)
            except StopIteration:
                return
        yield item
