"""``python -m fastcollate doctor module:factory``: the loader checklist, run on a dataset.

Representative samples one by one, then one process (the reference), then a few workers for two
epochs: the report says whether the faster setting delivers the same samples and targets, which stage
failed on which sample if one did, and how long each setting took. It never prints a sample's content.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from . import audit, tree
from .assemble import assemble
from .audit.report import abbreviated
from .contract import Contract
from .errors import ContractError, sample_id
from .factory import load_factory
from .ids import TARGET_KEYS, IdentifiedSample, with_ids

__all__ = ["Failure", "main", "run_doctor"]

TRANSFORM_ATTRIBUTES = ("transform", "target_transform", "transforms")
"""torchvision's convention: switching these off leaves the raw access."""

EXIT_OK, EXIT_PROBLEM, EXIT_UNVERIFIED = 0, 1, 2
TIMEOUT_ADVICE = (
    "a timeout makes a wait visible; it repairs nothing (an unavailable source or a stuck worker stays "
    "so). Keep the last step above, and reduce the inputs (that sample alone, --workers 1) rather than "
    "raising --timeout."
)


# --------------------------------------------------------------------------------------------------
# What failed, where


@dataclasses.dataclass
class Failure:
    """A stage that failed on a sample.

    Attributes:
        stage: ``"raw access"``, ``"transform"``, ``"collate"``, ``"transfer"`` or ``"timeout"``.
        sample: which sample, as known before it was decoded (``"index 3"``, ``"id 'a7'"``,
            ``"position 12 of worker 1's stream"``).
        error: the exception's type; its message only where it cannot quote the sample (ContractError
            messages never do) or with ``--show-errors``.
        where: the innermost frame that raised (``file:line in function``).
        field: the field path, for collate failures.
        worker: the worker (``audit.MAIN_PROCESS`` for the main process), when known.
        sample_id: the sample's id or index, when known.
        last_steps: at a timeout, each process's last known step.
    """

    stage: str
    sample: str
    error: str
    where: str = ""
    field: str | None = None
    worker: int | None = None
    sample_id: Any = None
    last_steps: list[str] = dataclasses.field(default_factory=list)

    def lines(self) -> list[str]:
        if self.stage == "timeout":
            out = [f"stuck at {self.sample}"]
        else:
            out = [
                f"{self.stage} failed at {self.sample}" + (f", field {self.field!r}" if self.field else "")
            ]
        if self.worker is not None:
            out[0] += (
                " in the main process" if self.worker == audit.MAIN_PROCESS else f" in worker {self.worker}"
            )
        out.append(f"error: {self.error}")
        if self.where:
            out.append(f"raised at {self.where}")
        out += [f"last step known: {step}" for step in self.last_steps]
        return out

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["sample_id"] = (
            self.sample_id if isinstance(self.sample_id, (int, str, type(None))) else repr(self.sample_id)
        )
        return data


def _error_text(error: BaseException, show: bool) -> str:
    if isinstance(error, ContractError) or show:
        return f"{type(error).__name__}: {error}"
    return f"{type(error).__name__} (message withheld: it may quote the sample; --show-errors prints it)"


def _where(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


class _StageFailed(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.stage)
        self.failure = failure


class _Stuck(BaseException):
    """Raised by the alarm: a BaseException so that a dataset's ``except Exception`` cannot swallow it."""


# --------------------------------------------------------------------------------------------------
# Tracing: each process's last step, recorded before the step runs


_IDLE, _ACCESS, _COLLATE = 0.0, 1.0, 2.0


class _Board:
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


def _transform_owner(dataset: Any) -> Any | None:
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


class _TracedMap(Dataset):
    """A map-style dataset that marks each index before reading it and returns a ``Failure`` instead
    of raising, naming the stage: a ``transform`` attribute is switched off to tell raw access from
    the transform."""

    def __init__(self, dataset: Dataset, board: _Board, show_errors: bool, ids_are_indices: bool) -> None:
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
                error=_error_text(error, self.show_errors),
                where=_where(error),
                worker=_worker(),
                sample_id=index,
            )

    def _stage_of(self, index: int) -> str:
        owner = _transform_owner(self.dataset)
        if owner is None:
            return "raw access"
        with _transforms_off(owner):
            try:
                self.dataset[index]
            except Exception:
                return "raw access"
        return "transform"


class _TracedStream(IterableDataset):
    """An iterable dataset that marks each stream position before reading it and yields a ``Failure``
    (then stops) instead of raising."""

    def __init__(self, dataset: IterableDataset, board: _Board, show_errors: bool, id_key: str) -> None:
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
                error=_error_text(error, self.show_errors),
                where=_where(error),
                worker=_worker(),
            )


def _worker() -> int:
    info = get_worker_info()
    return audit.MAIN_PROCESS if info is None else info.id


class _TracedCollate:
    """``assemble`` that marks the collate step, tags the batch with its worker, and returns a
    ``Failure`` (the sample's id and field, from ContractError) instead of raising."""

    def __init__(self, board: _Board, id_key: str, show_errors: bool) -> None:
        self.board = board
        self.id_key = id_key
        self.show_errors = show_errors

    def __call__(self, samples: list) -> audit.WorkerTagged:
        worker = _worker()
        for sample in samples:
            if isinstance(sample, Failure):
                return audit.WorkerTagged(worker, sample)
        self.board.mark(_COLLATE, -1)
        try:
            batch = assemble(samples)
        except ContractError as error:
            who = (
                f"id {error.sample_id!r}"
                if error.sample_id is not None
                else f"batch position {error.position}"
            )
            return audit.WorkerTagged(
                worker,
                Failure(  # no `where`: it would point into assemble
                    stage="collate",
                    sample=who,
                    error=_error_text(error, True),
                    field=error.field,
                    worker=worker,
                    sample_id=error.sample_id,
                ),
            )
        except Exception as error:
            ids = [sample_id(s, self.id_key) for s in samples]
            return audit.WorkerTagged(
                worker,
                Failure(
                    stage="collate",
                    sample=f"the batch of ids {ids}",
                    error=_error_text(error, self.show_errors),
                    where=_where(error),
                    worker=worker,
                ),
            )
        self.board.mark(_IDLE, -1)
        return audit.WorkerTagged(worker, batch)


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """Raises ``_Stuck`` in the main thread after ``seconds``: DataLoader's own timeout needs workers."""
    usable = (
        seconds > 0 and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return

    def stuck(signum, frame):
        raise _Stuck()

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _timed(iterable: Any, seconds: float) -> Iterator[Any]:
    """``iterable``'s items, each fetched under ``_alarm(seconds)``."""
    iterator = iter(iterable)
    while True:
        with _alarm(seconds):
            try:
                item = next(iterator)
            except StopIteration:
                return
        yield item


# --------------------------------------------------------------------------------------------------
# The checklist


@dataclasses.dataclass
class Row:
    """One line of the record sheet."""

    setting: str
    checked: str
    time: str
    conclusion: str
    ok: bool | None  # None: not run, or nothing to conclude


@dataclasses.dataclass
class _Run:
    epochs: list[audit.Epoch]
    failure: Failure | None = None
    notes: list[str] = dataclasses.field(default_factory=list)


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, Mapping):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        return type(value)(*(_to_device(v, device) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _signature(batch: Any, path: str = "") -> dict[str, str]:
    """Each tensor field's dtype and per-sample shape: what must not change from batch to batch."""
    if isinstance(batch, torch.Tensor):
        return {path or "<batch>": f"{batch.dtype} {list(batch.shape[1:])}"}
    out: dict[str, str] = {}
    if isinstance(batch, Mapping):
        items = batch.items()
    elif isinstance(batch, tuple) and hasattr(type(batch), "_fields"):
        items = zip(type(batch)._fields, batch, strict=True)
    elif isinstance(batch, (list, tuple)):
        items = enumerate(batch)
    else:
        return out
    for key, value in items:
        out.update(_signature(value, f"{path}.{key}" if path else str(key)))
    return out


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _seconds(epoch: audit.Epoch) -> str:
    text = _duration(epoch.wait_seconds)
    if epoch.first_batch_seconds is not None:
        text += f" (first batch {_duration(epoch.first_batch_seconds)}"
        rate = epoch.steady_samples_per_second
        text += f", then {rate:,.0f} samples/s)" if rate else ")"
    return text


def _rate(epoch: audit.Epoch) -> float | None:
    rate = epoch.steady_samples_per_second
    if rate is None and epoch.wait_seconds > 0:
        rate = len(epoch) / epoch.wait_seconds
    return rate


class Doctor:
    """Runs the checklist on one dataset and builds the report.

    Args:
        dataset: a map-style or iterable Dataset whose samples ``assemble`` accepts.
        batch_size: the batch size of every setting.
        workers: the "few workers" setting.
        timeout: seconds to wait for one batch before reporting the last step known (0: forever).
        id_key: the samples' id field; map-style samples without one get their index (``with_ids``).
        targets: the fields compared between settings; None picks ``y``/``label``/``target``... itself.
        persistent_workers: the workers setting keeps its workers between the two epochs.
        show_errors: print exception messages, which may quote a sample's content.
        out: where progress lines go.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int = 8,
        workers: int = 2,
        timeout: float = 60.0,
        id_key: str = "id",
        targets: Sequence[str] | None = None,
        persistent_workers: bool = False,
        show_errors: bool = False,
        out: Any = print,
    ) -> None:
        self.dataset = dataset
        self.iterable = isinstance(dataset, IterableDataset)
        self.batch_size = batch_size
        self.workers = workers
        self.timeout = timeout
        self.id_key = id_key
        self.targets = list(targets) if targets is not None else None
        self.persistent_workers = persistent_workers
        self.show_errors = show_errors
        self.out = out
        self.rows: list[Row] = []
        self.steps: list[dict] = []
        self.notes: list[str] = []
        self.ids_are_indices = False
        self.stream_ids: list | None = None
        self.shapes_vary = False
        self.failure: Failure | None = None
        self.data_problems: list[str] = []
        self.unverified: str | None = None

    # -- the whole checklist ----------------------------------------------------------------------

    def run(self) -> dict:
        """Runs every step (stopping at the first failure) and returns the report as a dict."""
        kind = "iterable" if self.iterable else "map-style"
        size = "" if self.iterable else f", {len(self.dataset)} samples"  # type: ignore[arg-type]
        self.say(
            f"fastcollate doctor: {type(self.dataset).__name__} ({kind}{size}), batch {self.batch_size}, "
            f"{self.workers} workers, timeout {self.timeout:g} s"
        )
        reference = None
        if self.step_samples():
            reference = self.step_reference()
        if reference is not None:
            self.step_workers(reference)
        return self.finish()

    def say(self, line: str = "") -> None:
        self.out(line)

    # -- 1. representative samples ----------------------------------------------------------------

    def step_samples(self) -> bool:
        self.say("\n1. Representative samples (first, middle, last), opened one by one")
        board = _Board(0)
        started = time.perf_counter()
        try:
            picked = self._pick_samples(board)
        except _Stuck:
            unit = "stream position" if self.iterable else "index"
            picked = Failure(
                "timeout",
                board.stuck_at(unit),
                f"no sample within --timeout {self.timeout:g} s",
                last_steps=board.last_steps(unit),
            )
        if isinstance(picked, Failure):
            return self._failed("samples one by one", "raw access, transform", picked, started)
        if self.unverified:
            self.say(f"   cannot verify: {self.unverified}")
            self.rows.append(Row("samples one by one", "ids", "-", self.unverified, False))
            return False
        contracts = []
        for where, sample in picked:
            try:
                contract = Contract.infer(sample, id=self.id_key)
            except TypeError as error:  # its message names the field and its type, never the value
                failure = Failure("collate", where, f"TypeError: {error}", field=None)
                return self._failed("samples one by one", "contract", failure, started)
            contracts.append(contract)
            if len(contracts) == 1:
                self.say(f"   {where}: contract inferred")
                self.say("     " + str(contract).replace("\n", "\n     "))
            else:
                diff = contracts[0].diff(contract)
                self.say(f"   {where}: " + ("same contract" if not diff else "differs: " + "; ".join(diff)))
        owner = None if self.iterable else _transform_owner(self.dataset)
        separable = (
            f"transform stage separable ({type(owner).__name__}.transform switched off for raw access)"
            if owner is not None
            else "transform stage not separable (no `transform` attribute): raw access includes it"
        )
        self.say(f"   {separable}")
        samples = [sample for _, sample in picked]
        try:
            batch = assemble(samples)
        except ContractError as error:
            failure = Failure(
                "collate",
                f"id {error.sample_id!r}",
                _error_text(error, True),
                field=error.field,
                sample_id=error.sample_id,
            )
            return self._failed("samples one by one", "access, contract, collate", failure, started)
        self.say(f"   collate of the {len(samples)} together: ok")
        del batch
        self._pick_targets(picked[0][1])
        elapsed = time.perf_counter() - started
        varying = any(contracts[0].diff(c) for c in contracts[1:])
        self.rows.append(
            Row(
                "samples one by one",
                "access, contract, collate",
                _duration(elapsed),
                "contracts differ (see above)" if varying else "consistent contract; they stack",
                True,
            )
        )
        self.steps.append(
            {
                "step": 1,
                "samples": [w for w, _ in picked],
                "contract": str(contracts[0]),
                "contract_differences": [contracts[0].diff(c) for c in contracts[1:]],
                "transform": separable,
                "targets": self.targets,
            }
        )
        return True

    def _pick_samples(self, board: _Board) -> list[tuple[str, Any]] | Failure:
        if self.iterable:
            return self._pick_from_stream(board)
        size = len(self.dataset)  # type: ignore[arg-type]
        if size == 0:
            self.unverified = "the dataset is empty"
            return []
        indices = sorted({0, size // 2, size - 1})
        picked = []
        for index in indices:
            traced = _TracedMap(self.dataset, board, self.show_errors, self.ids_are_indices)
            with _alarm(self.timeout):
                sample = traced[index]
            if isinstance(sample, Failure):
                return sample
            if index == 0 and sample_id(sample, self.id_key) is None:
                self.dataset = with_ids(self.dataset, self.id_key)
                self.ids_are_indices = True
                note = f"samples carry no {self.id_key!r}: their dataset index is their id (with_ids)"
                self.notes.append(note)
                self.say(f"   note: {note}")
                sample = self.dataset[index]
            picked.append(
                (
                    f"index {index}"
                    + (f" (id {sample_id(sample, self.id_key)!r})" if not self.ids_are_indices else ""),
                    sample,
                )
            )
        return picked

    def _pick_from_stream(self, board: _Board) -> list[tuple[str, Any]] | Failure:
        traced = _TracedStream(self.dataset, board, self.show_errors, self.id_key)  # type: ignore[arg-type]
        first = last = None
        count = 0
        self.stream_ids = []
        for sample in _timed(traced, self.timeout):
            if isinstance(sample, Failure):
                return sample
            self.stream_ids.append(sample_id(sample, self.id_key))
            if first is None:
                first = sample
                if sample_id(sample, self.id_key) is None:
                    self.unverified = (
                        f"the stream's samples carry no {self.id_key!r} field: an IterableDataset "
                        "must yield one (a stream position is no id: each worker has its own)"
                    )
                    return []
            last = sample
            count += 1
        if count == 0:
            self.unverified = "the stream is empty"
            return []
        picked = [(f"stream position 0 (id {sample_id(first, self.id_key)!r})", first)]
        if count > 2:
            for position, sample in enumerate(_timed(traced, self.timeout)):  # a partial pass for the middle
                if isinstance(sample, Failure):
                    return sample
                if position == count // 2:
                    picked.append(
                        (f"stream position {position} (id {sample_id(sample, self.id_key)!r})", sample)
                    )
                    break
        if count > 1:
            picked.append((f"stream position {count - 1} (id {sample_id(last, self.id_key)!r})", last))
        return picked

    def _pick_targets(self, sample: Any) -> None:
        if self.targets is not None:
            self.targets = [t for t in self.targets if t != "none"]
            if self.targets == ["all"]:
                self.targets = _top_level_fields(sample, self.id_key)
        else:
            self.targets = _guess_targets(sample)
        if self.targets:
            self.say(
                f"   targets compared between settings: {', '.join(map(repr, self.targets))}"
                + (" (--targets to change)" if self.targets else "")
            )
        else:
            note = (
                "no target field recognised (y, label, target...): ids only are compared; "
                "--targets KEY names one"
            )
            self.notes.append(note)
            self.say(f"   note: {note}")

    # -- 2. the reference -------------------------------------------------------------------------

    def step_reference(self) -> audit.Epoch | None:
        setting = f"workers=0, shuffle=False, batch {self.batch_size}"
        self.say(f"\n2. Reference: {setting}")
        started = time.perf_counter()
        run = self._run(workers=0, epochs=1, transfer=True)
        if run.failure is not None:
            return self._failed(setting, "ids, shapes, targets", run.failure, started)
        epoch = run.epochs[0]
        # the dataset's ids: its indices, or the ones step 1 read off the stream one by one
        expected = len(self.dataset) if self.ids_are_indices else self.stream_ids  # type: ignore[arg-type]
        report = audit.check(epoch, expected, what="reference against the dataset")
        problems = report.problems()
        if not self.iterable and not self.ids_are_indices and len(epoch) != len(self.dataset):  # type: ignore[arg-type]
            problems.append(f"{len(epoch)} samples delivered for len(dataset) = {len(self.dataset)}")  # type: ignore[arg-type]
        for note in run.notes:
            self.say(f"   note: {note}")
        if run.notes:
            self.shapes_vary = True
            self.notes.append(
                "shapes or dtypes vary from batch to batch (step 2): declare a fastcollate.Contract "
                "if they must not, or padding if they may"
            )
        self.say(f"   {len(epoch)} samples in {epoch.batches} batches, {_seconds(epoch)}")
        if problems:
            self.data_problems.append(f"the reference: {', '.join(problems)}")
            self.say("   " + str(report).replace("\n", "\n   "))
        else:
            self.say(f"   every id delivered once ({report.expected} ids)")
        conclusion = "correct reference" if not problems else "reference itself wrong: " + ", ".join(problems)
        if run.notes:
            conclusion += "; shapes vary across batches"
        self.rows.append(Row(setting, "ids, shapes, targets", _seconds(epoch), conclusion, not problems))
        self.steps.append(
            {
                "step": 2,
                "setting": setting,
                "samples": len(epoch),
                "batches": epoch.batches,
                "seconds": epoch.wait_seconds,
                "first_batch_seconds": epoch.first_batch_seconds,
                "report": report.to_dict(),
                "notes": run.notes,
            }
        )
        transfer = "skipped: no GPU" if not _cuda() else "every batch copied to the GPU"
        self.rows.append(
            Row(
                "transfer (reference batches)",
                "host to device copy",
                "-",
                transfer,
                True if _cuda() else None,
            )
        )
        return None if problems else epoch

    # -- 3 and 4. a few workers, two epochs -------------------------------------------------------

    def step_workers(self, reference: audit.Epoch) -> None:
        setting = f"workers={self.workers}, same batch, order, transforms"
        self.say(f"\n3. {setting}" + (", persistent_workers" if self.persistent_workers else ""))
        started = time.perf_counter()
        run = self._run(workers=self.workers, epochs=2)
        order: audit.Order = "any" if self.iterable else "same"
        if self.iterable:
            self.notes.append(
                "an IterableDataset's batches interleave its workers' streams: order not compared"
            )
        reports = []
        for number, epoch in enumerate(run.epochs, start=1):
            what = f"workers={self.workers}, epoch {number}, against the reference"
            report = audit.compare(reference, epoch, order=order, what=what)
            reports.append(report)
            if number == 2:
                self.say("\n4. Same setting, second epoch")
            self.say(f"   {len(epoch)} samples in {epoch.batches} batches, {_seconds(epoch)}")
            self.say("   " + str(report).replace("\n", "\n   "))
            if not report.ok:
                self.data_problems.append(f"workers={self.workers} epoch {number}: {_summary(report)}")
        ref_rate = _rate(reference)
        if run.epochs:
            first = run.epochs[0]
            self.rows.append(
                Row(
                    f"workers={self.workers}",
                    "same ids and targets as the reference",
                    _seconds(first),
                    _conclusion(reports[0], _speed(first, ref_rate)),
                    reports[0].ok,
                )
            )
        if len(run.epochs) > 1:
            second = run.epochs[1]
            self.rows.append(
                Row(
                    f"workers={self.workers}, second epoch",
                    "nothing missing or duplicated",
                    _seconds(second),
                    _conclusion(reports[1], _startup(run.epochs[0], second, self.persistent_workers)),
                    reports[1].ok,
                )
            )
        self.steps.append(
            {
                "step": 3,
                "setting": setting,
                "epochs": [
                    {
                        "epoch": n,
                        "samples": len(e),
                        "batches": e.batches,
                        "seconds": e.wait_seconds,
                        "first_batch_seconds": e.first_batch_seconds,
                        "steady_samples_per_second": e.steady_samples_per_second,
                        "report": r.to_dict(),
                    }
                    for n, (e, r) in enumerate(zip(run.epochs, reports, strict=True), start=1)
                ],
            }
        )
        if run.failure is not None:
            epoch_number = len(run.epochs) + 1
            self._failed(
                f"workers={self.workers}, epoch {epoch_number}", "ids and targets", run.failure, started
            )

    # -- running a setting ------------------------------------------------------------------------

    def _run(self, workers: int, epochs: int, transfer: bool = False) -> _Run:
        board = _Board(workers)
        if self.iterable:
            traced: Dataset = _TracedStream(self.dataset, board, self.show_errors, self.id_key)  # type: ignore[arg-type]
        else:
            traced = _TracedMap(self.dataset, board, self.show_errors, self.ids_are_indices)
        loader = DataLoader(
            traced,
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=workers,
            collate_fn=_TracedCollate(board, self.id_key, self.show_errors),
            timeout=self.timeout if workers else 0,
            persistent_workers=self.persistent_workers and workers > 0,
        )
        ledger = audit.Ledger(self.id_key, target_key=self.targets or None)
        run = _Run(epochs=[])
        device = torch.device("cuda") if transfer and _cuda() else None
        for _ in range(epochs):
            shape: dict[str, str] | None = None
            try:
                for number, batch in enumerate(ledger.watch(self._deliver(loader, workers, board))):
                    signature = _signature(batch)
                    if shape is None:
                        shape = signature
                    elif signature != shape and len(run.notes) < 5:
                        changed = sorted(
                            k for k in set(shape) | set(signature) if shape.get(k) != signature.get(k)
                        )
                        run.notes.append(
                            f"batch {number} differs from batch 0 in "
                            + ", ".join(f"{k!r} ({shape.get(k)} -> {signature.get(k)})" for k in changed)
                        )
                    if device is not None:
                        self._transfer(batch, device)
            except _StageFailed as failed:
                run.failure = failed.failure
                break
            except (_Stuck, Exception) as error:
                run.failure = self._failure_of(error, board)
                break
            run.epochs.append(ledger.last)
        del loader  # shuts persistent workers down
        return run

    def _failure_of(self, error: BaseException, board: _Board) -> Failure:
        """What a setting's loop ended on, with each process's last step: a timeout (the alarm in one
        process, DataLoader's own with workers), a worker that died, or an error outside the traced
        steps (the sampler, a worker_init_fn)."""
        unit = "stream position" if self.iterable else "index"
        if isinstance(error, _Stuck) or (isinstance(error, RuntimeError) and "timed out" in str(error)):
            stage, error_text, where = "timeout", f"no batch within --timeout {self.timeout:g} s", ""
        elif isinstance(error, RuntimeError) and "DataLoader worker" in str(error):
            stage, error_text, where = "worker", _error_text(error, True).splitlines()[0], ""
        else:
            stage, error_text, where = "loader", _error_text(error, self.show_errors), _where(error)
        return Failure(stage, board.stuck_at(unit), error_text, where, last_steps=board.last_steps(unit))

    def _deliver(self, loader: DataLoader, workers: int, board: _Board) -> Iterator[audit.WorkerTagged]:
        """The loader's batches, turning a traced ``Failure`` into an exception at the step it ended."""
        iterator = iter(loader)
        try:
            yield from self._checked(iterator, self.timeout if workers == 0 else 0)
        except RuntimeError as error:
            if "timed out" in str(error):
                # A stuck worker would hold DataLoader's shutdown for its 5 s status interval before
                # being terminated anyway: end it now.
                for process in getattr(iterator, "_workers", []):
                    process.terminate()
            raise

    @staticmethod
    def _checked(iterator: Iterator, timeout: float) -> Iterator[audit.WorkerTagged]:
        for item in _timed(iterator, timeout):
            if isinstance(item.batch, Failure):
                if item.batch.worker is None:
                    item.batch.worker = item.worker
                raise _StageFailed(item.batch)
            yield item

    def _transfer(self, batch: Any, device: torch.device) -> None:
        try:
            _to_device(batch, device)
            torch.cuda.synchronize(device)
        except Exception as error:
            ids = tree.lookup(batch, self.id_key)
            ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
            raise _StageFailed(
                Failure(
                    "transfer", f"the batch of ids {ids}", _error_text(error, self.show_errors), _where(error)
                )
            ) from None

    # -- the record sheet -------------------------------------------------------------------------

    def _failed(self, setting: str, checked: str, failure: Failure, started: float) -> None:
        self.failure = failure
        for line in failure.lines():
            self.say(f"   {line}")
        if failure.stage == "timeout":
            self.say(f"   {TIMEOUT_ADVICE}")
        elapsed = time.perf_counter() - started
        what = "stuck" if failure.stage == "timeout" else f"{failure.stage} failed"
        self.rows.append(
            Row(setting, checked, _duration(elapsed), f"FAILED: {what} at {failure.sample}", False)
        )
        return None

    def finish(self) -> dict:
        verdict, status = self._verdict()
        self.say("\n5. Record sheet")
        widths = [
            max(len(getattr(r, f)) for r in self.rows + [_HEADER]) for f in ("setting", "checked", "time")
        ]
        for row in [_HEADER] + self.rows:
            cells = [row.setting.ljust(widths[0]), row.checked.ljust(widths[1]), row.time.ljust(widths[2])]
            self.say("   " + " | ".join(cells + [row.conclusion]))
            if row is _HEADER:
                self.say("   " + "-+-".join("-" * w for w in widths) + "-+-" + "-" * 10)
        for note in self.notes:
            self.say(f"   note: {note}")
        self.say(f"\nVerdict: {verdict}")
        return {
            "dataset": type(self.dataset).__name__,
            "kind": "iterable" if self.iterable else "map-style",
            "batch_size": self.batch_size,
            "workers": self.workers,
            "timeout": self.timeout,
            "ids": "dataset indices (with_ids)" if self.ids_are_indices else f"the samples' {self.id_key!r}",
            "targets": self.targets,
            "steps": self.steps,
            "table": [dataclasses.asdict(r) for r in self.rows],
            "notes": self.notes,
            "failure": self.failure.to_dict() if self.failure else None,
            "verdict": verdict,
            "ok": status == EXIT_OK,
            "exit_status": status,
        }

    def _verdict(self) -> tuple[str, int]:
        if self.failure is not None:
            text = f"FAIL: {self.failure.stage} failed at {self.failure.sample}"
            if self.failure.stage == "timeout":
                text = f"FAIL: stuck at {self.failure.sample} ({self.failure.error})"
            if self.failure.field:
                text += f", field {self.failure.field!r}"
            if self.failure.stage == "timeout":
                text += f". {TIMEOUT_ADVICE}"
            elif self.failure.worker is not None and self.failure.worker >= 0:
                text += (
                    ". It happens only with workers: look at what the workers receive (open files, "
                    "connections, locks, per-process state) and the start method"
                )
            else:
                text += ". Fix it with workers=0 first: the traceback is readable there."
            return text, EXIT_PROBLEM
        if self.data_problems:
            return (
                "FAIL: data lost, duplicated or changed: "
                + "; ".join(self.data_problems)
                + ". Do not adopt this setting.",
                EXIT_PROBLEM,
            )
        if self.unverified:
            return f"NOT VERIFIED: {self.unverified}", EXIT_UNVERIFIED
        return (
            f"OK: workers={self.workers} delivers the same samples"
            + (" and targets" if self.targets else "")
            + " as workers=0, in both epochs"
            + ("; but shapes vary from batch to batch (see the notes)" if self.shapes_vary else ""),
            EXIT_OK,
        )


_HEADER = Row("setting", "checked", "observed time", "conclusion", None)


def _cuda() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


def _speed(epoch: audit.Epoch, reference_rate: float | None) -> str:
    rate = _rate(epoch)
    if not rate or not reference_rate:
        return ""
    ratio = rate / reference_rate
    verdict = "a real gain" if ratio >= 1.1 else "an overhead" if ratio < 0.9 else "no gain"
    return f"x{ratio:.2f} the reference's samples/s after start-up: {verdict}"


def _startup(first: audit.Epoch, second: audit.Epoch, persistent: bool) -> str:
    if first.first_batch_seconds is None or second.first_batch_seconds is None:
        return ""
    text = (
        f"first batch {_duration(second.first_batch_seconds)} "
        f"(epoch 1: {_duration(first.first_batch_seconds)})"
    )
    rate1, rate2 = first.steady_samples_per_second, second.steady_samples_per_second
    if rate1 and rate2:
        text += f", then {rate2:,.0f} samples/s (epoch 1: {rate1:,.0f})"
    text += "; workers kept" if persistent else "; workers restarted"
    return text


def _summary(report: audit.AuditReport) -> str:
    """``1 missing (id 7), 1 duplicated (id 6)``: the problems with their first ids."""
    parts = []
    for name, ids in (
        ("missing", report.missing),
        ("duplicated", list(report.duplicated)),
        ("unexpected", report.unexpected),
        ("with changed targets", report.changed_targets),
    ):
        if ids:
            parts.append(f"{len(ids)} {name} (id{'s' if len(ids) > 1 else ''} {abbreviated(ids, 3)})")
    if report.order == "same" and report.order_differs:
        parts.append("order differs")
    return ", ".join(parts)


def _conclusion(report: audit.AuditReport, detail: str) -> str:
    head = "same data" if report.ok else "DATA DIFFERS: " + ", ".join(report.problems())
    return head + (f"; {detail}" if detail else "")


def _top_level_fields(sample: Any, id_key: str) -> list[str]:
    if isinstance(sample, Mapping):
        return [str(k) for k in sample if k != id_key]
    if isinstance(sample, IdentifiedSample):
        return ["sample"]
    if isinstance(sample, tuple) and hasattr(type(sample), "_fields"):
        return [f for f in type(sample)._fields if f != id_key]
    return [str(i) for i in range(len(sample))] if isinstance(sample, (list, tuple)) else []


def _guess_targets(sample: Any) -> list[str]:
    if isinstance(sample, Mapping):
        return [name for name in TARGET_KEYS if name in sample][:1]
    if isinstance(sample, IdentifiedSample):
        inner = sample.sample
        if isinstance(inner, (list, tuple)) and len(inner) >= 2:
            return [f"sample.{len(inner) - 1}"]  # (input, target), the torchvision convention
        return []
    if isinstance(sample, tuple) and hasattr(type(sample), "_fields"):
        return [name for name in TARGET_KEYS if name in type(sample)._fields][:1]
    return []


# --------------------------------------------------------------------------------------------------
# Command line


def load_dataset(spec: str) -> Dataset:
    """``module:factory`` (or ``path/to/file.py:factory``, see ``load_factory``): the factory's
    dataset. A factory is a callable returning a Dataset; a Dataset object there is taken as it is."""
    target = load_factory(spec)
    dataset = target if isinstance(target, Dataset) or not callable(target) else target()
    if not isinstance(dataset, Dataset) and not (
        hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    ):
        raise TypeError(f"{spec} gave a {type(dataset).__name__}, not a Dataset")
    return dataset


def run_doctor(dataset: Dataset, **options: Any) -> dict:
    """Runs the checklist on ``dataset`` (options as ``Doctor``'s) and returns the report as a dict;
    ``report["exit_status"]`` is 0 (same data), 1 (lost, duplicated, changed, or a stage failed) or 2
    (could not verify)."""
    return Doctor(dataset, **options).run()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fastcollate doctor",
        description="Check that a dataset's loader delivers every sample, once, unchanged, with a few "
        "workers as with none; name the failing sample and stage otherwise. Exit status: 0 same data, "
        "1 data lost/duplicated/changed or a stage failed, 2 could not verify.",
    )
    parser.add_argument(
        "factory", help="module:factory, a callable returning a map-style or iterable Dataset"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="batch size of every setting (default 8)")
    parser.add_argument("--workers", type=int, default=2, help="the 'few workers' setting (default 2)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait for a batch before reporting the last step known (default 60; 0: none)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    parser.add_argument(
        "--id-key",
        default="id",
        help="the samples' id field (default 'id'; map-style samples without it are named by index)",
    )
    parser.add_argument(
        "--targets",
        action="append",
        metavar="KEY",
        help="field compared between settings (repeatable; 'all' for every field, 'none'); "
        "default: the first of y, label, labels, target, targets",
    )
    parser.add_argument(
        "--persistent-workers", action="store_true", help="keep workers between the two epochs"
    )
    parser.add_argument(
        "--show-errors",
        action="store_true",
        help="print exception messages (they may quote a sample's content)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.batch_size < 1 or args.workers < 1 or args.timeout < 0:
        print("doctor: --batch-size and --workers must be at least 1, --timeout at least 0", file=sys.stderr)
        return EXIT_UNVERIFIED
    try:
        dataset = load_dataset(args.factory)
    except Exception as error:
        print(f"doctor: cannot load {args.factory}: {_error_text(error, True)}", file=sys.stderr)
        return EXIT_UNVERIFIED
    report = run_doctor(
        dataset,
        batch_size=args.batch_size,
        workers=args.workers,
        timeout=args.timeout,
        id_key=args.id_key,
        targets=args.targets,
        persistent_workers=args.persistent_workers,
        show_errors=args.show_errors,
    )
    report["factory"] = args.factory
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=2, default=str)
    return int(report["exit_status"])


if __name__ == "__main__":
    sys.exit(main())
