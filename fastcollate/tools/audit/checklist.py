"""The doctor's checklist, step by step: representative samples one by one (1), one process, the
reference (2), then a few workers for two epochs (3 and 4), and the record sheet (5, or the number
after the last step run: the checklist stops at the first failure). Each step says what it saw as it
goes; ``Doctor.run`` returns the whole report as a dict.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import Dataset, IterableDataset

from ...assembler import assemble
from ...collate.contract import Contract
from ...collate.errors import sample_id
from ...collate.ids import guess_target_path, with_ids
from ..factory_spec import collate_name
from ..terminal import TERMINAL_COLUMNS, fit_to_terminal
from .checks import check, compare
from .digests import top_level_fields
from .epoch import Epoch
from .failures import Failure
from .record_sheet import (
    EXIT_OK,
    TIMEOUT_ADVICE,
    Findings,
    Row,
    duration,
    epoch_time,
    problem_summary,
    table_lines,
    verdict,
    worker_rows,
)
from .report import AuditReport, Order
from .setting_run import LoaderPlan, SettingRun, cuda_available, run_setting
from .tracing import StepBoard, Stuck, TracedMap, TracedStream, alarm, collated, timed, transform_owner

__all__ = ["Doctor"]

SAMPLES_SETTING = "samples one by one"
_INDENT = "   "  # a step's lines, under its numbered heading


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
        collate_fn: the collate every step runs (the user's loader's); None: ``assemble``, under
            ``contract`` when one is given.
        contract: the samples' declared contract, shown in step 1 instead of one inferred.
        batch_sampler: makes the batches instead of ``batch_size``; the settings' orders not compared.
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
        collate_fn: Callable[[list], Any] | None = None,
        contract: Contract | None = None,
        batch_sampler: Any = None,
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
        self.contract = contract
        self.collate_fn = collate_fn or (assemble.using(contract) if contract is not None else assemble)
        self.batch_sampler = batch_sampler
        self.out = out
        self.rows: list[Row] = []
        self.steps: list[dict] = []
        self.notes: list[str] = []
        self.ids_are_indices = False
        self.stream_ids: list | None = None
        self.findings = Findings()
        self.headings = 0  # steps printed so far: the next heading's number

    # -- the whole checklist ----------------------------------------------------------------------

    def run(self) -> dict:
        """Runs every step (stopping at the first failure) and returns the report as a dict."""
        kind = "iterable" if self.iterable else "map-style"
        size = "" if self.iterable else f", {len(self.dataset)} samples"  # type: ignore[arg-type]
        self.say(
            f"fastcollate doctor: {type(self.dataset).__name__} ({kind}{size}), {self.batching}, collate "
            f"{collate_name(self.collate_fn)}, {self.workers} workers, timeout {self.timeout:g} s"
        )
        reference = None
        if self.step_samples():
            reference = self.step_reference()
        if reference is not None:
            self.step_workers(reference)
        return self.finish()

    def say(self, line: str = "") -> None:
        """``line`` to ``out``, wrapped to the terminal's width (paths and long words kept whole)."""
        self.out(fit_to_terminal(line))

    def heading(self, title: str) -> None:
        """A step's heading, numbered in the order printed: a failure ends the checklist, and the record
        sheet then follows the last step run (no jump from 2 to 5 over the steps skipped)."""
        self.headings += 1
        self.say(f"\n{self.headings}. {title}")

    @property
    def batching(self) -> str:
        """How the settings make their batches, as the report says it."""
        if self.batch_sampler is not None:
            return f"batches from {type(self.batch_sampler).__name__}"
        return f"batch {self.batch_size}"

    @property
    def unit(self) -> str:
        """What a sample's position is called in the messages."""
        return "stream position" if self.iterable else "index"

    def plan(self) -> LoaderPlan:
        """What every loader setting shares, as step 1 left it (ids, targets)."""
        return LoaderPlan(
            dataset=self.dataset,
            iterable=self.iterable,
            batch_size=self.batch_size,
            id_key=self.id_key,
            targets=list(self.targets or ()),
            ids_are_indices=self.ids_are_indices,
            timeout=self.timeout,
            persistent_workers=self.persistent_workers,
            show_errors=self.show_errors,
            collate_fn=self.collate_fn,
            batch_sampler=self.batch_sampler,
        )

    # -- 1. representative samples ----------------------------------------------------------------

    def step_samples(self) -> bool:
        self.heading("Representative samples (first, middle, last), opened one by one")
        started = time.perf_counter()
        picked = self._open_samples()
        if isinstance(picked, Failure):
            self._failed(SAMPLES_SETTING, "raw access, transform", picked, started)
            return False
        if self.findings.unverified:
            self.say(f"   cannot verify: {self.findings.unverified}")
            self.rows.append(Row(SAMPLES_SETTING, "ids", "-", self.findings.unverified, False))
            return False
        contracts = self._infer_contracts(picked)
        if isinstance(contracts, Failure):
            self._failed(SAMPLES_SETTING, "contract", contracts, started)
            return False
        separable = self._transform_separability()
        self.say(f"   {separable}")
        failure = self._collate_together([sample for _, sample in picked])
        if failure is not None:
            self._failed(SAMPLES_SETTING, "access, contract, collate", failure, started)
            return False
        self._pick_targets(picked[0][1])
        varying = any(contracts[0].diff(c) for c in contracts[1:])
        self.rows.append(
            Row(
                SAMPLES_SETTING,
                "access, contract, collate",
                duration(time.perf_counter() - started),
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

    def _open_samples(self) -> list[tuple[str, Any]] | Failure:
        """The first, middle and last samples, each named by where it is; a timeout is a Failure."""
        board = StepBoard(0)
        try:
            return self._pick_from_stream(board) if self.iterable else self._pick_samples(board)
        except Stuck:
            return Failure(
                "timeout",
                board.stuck_at(self.unit),
                f"no sample within --timeout {self.timeout:g} s",
                last_steps=board.last_steps(self.unit),
            )

    def _pick_samples(self, board: StepBoard) -> list[tuple[str, Any]] | Failure:
        size = len(self.dataset)  # type: ignore[arg-type]
        if size == 0:
            self.findings.unverified = "the dataset is empty"
            return []
        picked = []
        for index in sorted({0, size // 2, size - 1}):
            traced = TracedMap(self.dataset, board, self.show_errors, self.ids_are_indices)
            with alarm(self.timeout):
                sample = traced[index]
            if isinstance(sample, Failure):
                return sample
            if index == 0 and sample_id(sample, self.id_key) is None:
                self.dataset = with_ids(self.dataset, self.id_key)
                self.ids_are_indices = True
                self._note(f"samples carry no {self.id_key!r}: their dataset index is their id (with_ids)")
                sample = self.dataset[index]
            named = "" if self.ids_are_indices else f" (id {sample_id(sample, self.id_key)!r})"
            picked.append((f"index {index}{named}", sample))
        return picked

    def _pick_from_stream(self, board: StepBoard) -> list[tuple[str, Any]] | Failure:
        traced = TracedStream(self.dataset, board, self.show_errors, self.id_key)  # type: ignore[arg-type]
        first = last = None
        count = 0
        self.stream_ids = []
        for sample in timed(traced, self.timeout):
            if isinstance(sample, Failure):
                return sample
            self.stream_ids.append(sample_id(sample, self.id_key))
            if first is None:
                first = sample
                if sample_id(sample, self.id_key) is None:
                    self.findings.unverified = (
                        f"the stream's samples carry no {self.id_key!r} field: an IterableDataset "
                        "must yield one (a stream position is no id: each worker has its own)"
                    )
                    return []
            last = sample
            count += 1
        if count == 0:
            self.findings.unverified = "the stream is empty"
            return []
        picked = [(f"stream position 0 (id {sample_id(first, self.id_key)!r})", first)]
        if count > 2:
            for position, sample in enumerate(timed(traced, self.timeout)):  # a partial pass for the middle
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

    def _infer_contracts(self, picked: list[tuple[str, Any]]) -> list[Contract] | Failure:
        """Each picked sample's contract, the first shown and the others as differences from it."""
        if self.contract is not None:
            self.say("   the factory's contract:")
            self.say("     " + str(self.contract).replace("\n", "\n     "))
            return [self.contract]
        contracts = []
        for where, sample in picked:
            try:
                contract = Contract.infer(sample, id=self.id_key)
            except TypeError as error:  # its message names the field and its type, never the value
                return Failure("collate", where, f"TypeError: {error}", field=None)
            contracts.append(contract)
            if len(contracts) == 1:
                self.say(f"   {where}: contract inferred")
                self.say("     " + str(contract).replace("\n", "\n     "))
            else:
                diff = contracts[0].diff(contract)
                self.say(f"   {where}: " + ("same contract" if not diff else "differs: " + "; ".join(diff)))
        return contracts

    def _transform_separability(self) -> str:
        owner = None if self.iterable else transform_owner(self.dataset)
        if owner is not None:
            return f"transform stage separable ({type(owner).__name__}.transform switched off for raw access)"
        return "transform stage not separable (no `transform` attribute): raw access includes it"

    def _collate_together(self, samples: list) -> Failure | None:
        failure = collated(self.collate_fn, samples, self.id_key, self.show_errors)
        if isinstance(failure, Failure):
            return failure
        self.say(f"   collate of the {len(samples)} together: ok")
        return None

    def _pick_targets(self, sample: Any) -> None:
        if self.targets is not None:
            self.targets = [t for t in self.targets if t != "none"]
            if self.targets == ["all"]:
                self.targets = top_level_fields(sample, self.id_key)
        else:
            path = guess_target_path(sample)
            self.targets = [path] if path else []
        if self.targets:
            named = ", ".join(map(repr, self.targets))
            self.say(f"   targets compared between settings: {named} (--targets to change)")
        else:
            self._note(
                "no target field recognised (y, label, target...): ids only are compared; "
                "--targets KEY names one"
            )

    # -- 2. the reference -------------------------------------------------------------------------

    def step_reference(self) -> Epoch | None:
        setting = f"workers=0, {'' if self.batch_sampler is not None else 'shuffle=False, '}{self.batching}"
        self.heading(f"Reference: {setting}")
        started = time.perf_counter()
        run = run_setting(self.plan(), workers=0, epochs=1, transfer=True)
        if run.failure is not None:
            self._failed(setting, "ids, shapes, targets", run.failure, started)
            return None
        epoch = run.epochs[0]
        # the dataset's ids: its indices, or the ones step 1 read off the stream one by one
        expected = len(self.dataset) if self.ids_are_indices else self.stream_ids  # type: ignore[arg-type]
        report = check(epoch, expected, what="reference against the dataset")
        problems = report.problems()
        if not self.iterable and not self.ids_are_indices and len(epoch) != len(self.dataset):  # type: ignore[arg-type]
            problems.append(f"{len(epoch)} samples delivered for len(dataset) = {len(self.dataset)}")  # type: ignore[arg-type]
        self._note_shapes(run)
        self.say(f"   {len(epoch)} samples in {epoch.batches} batches, {epoch_time(epoch)}")
        if problems:
            self.findings.data_problems.append(f"the reference: {', '.join(problems)}")
            self.say("   " + str(report).replace("\n", "\n   "))
        else:
            self.say(f"   every id delivered once ({report.expected} ids)")
        found = "correct reference" if not problems else "reference itself wrong: " + ", ".join(problems)
        if run.notes:
            found += "; shapes vary across batches"
        self.rows.append(Row(setting, "ids, shapes, targets", epoch_time(epoch), found, not problems))
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
        gpu = cuda_available()
        transfer = "every batch copied to the GPU" if gpu else "skipped: no GPU"
        self.rows.append(
            Row("transfer (reference batches)", "host to device copy", "-", transfer, True if gpu else None)
        )
        return None if problems else epoch

    def _note_shapes(self, run: SettingRun) -> None:
        for note in run.notes:
            self.say(f"   note: {note}")
        declared = self.contract is not None and any(
            f.pad is not None or f.pack for f in self.contract.fields.values()
        )
        if run.notes and declared:
            self._note("padded or packed lengths vary from batch to batch, as the contract declares")
        elif run.notes:
            self.findings.shapes_vary = True
            self.notes.append(
                "shapes or dtypes vary from batch to batch (step 2): declare a fastcollate.Contract "
                "if they must not, or padding if they may"
            )

    # -- 3 and 4. a few workers, two epochs -------------------------------------------------------

    def step_workers(self, reference: Epoch) -> None:
        setting = f"workers={self.workers}, same batch, order, transforms"
        self.heading(setting + (", persistent_workers" if self.persistent_workers else ""))
        started = time.perf_counter()
        run = run_setting(self.plan(), workers=self.workers, epochs=2)
        notes = []
        if run.usable_cpus is not None:  # torch's warning, caught in run_setting, said once and here
            notes.append(
                f"{self.workers} workers for {run.usable_cpus} usable CPUs: they take turns on them, so "
                f"this setting can be slower than with {run.usable_cpus}"
            )
            self.say(f"   note: {notes[-1]}")
        reports = self._compare_with_reference(reference, run)
        self.rows += worker_rows(self.workers, reference, run.epochs, reports, self.persistent_workers)
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
                "notes": notes,
            }
        )
        if run.failure is not None:
            epoch_number = len(run.epochs) + 1
            self._failed(
                f"workers={self.workers}, epoch {epoch_number}", "ids and targets", run.failure, started
            )

    def _compare_with_reference(self, reference: Epoch, run: SettingRun) -> list[AuditReport]:
        order: Order = "any" if self.iterable or self.batch_sampler is not None else "same"
        if self.iterable:
            self.notes.append(
                "an IterableDataset's batches interleave its workers' streams: order not compared"
            )
        elif self.batch_sampler is not None:
            self.notes.append(
                f"the factory's {type(self.batch_sampler).__name__} may order each pass anew: order not "
                "compared"
            )
        reports = []
        for number, epoch in enumerate(run.epochs, start=1):
            what = f"workers={self.workers}, epoch {number}, against the reference"
            report = compare(reference, epoch, order=order, what=what)
            reports.append(report)
            if number == 2:
                self.heading("Same setting, second epoch")
            self.say(f"   {len(epoch)} samples in {epoch.batches} batches, {epoch_time(epoch)}")
            self.say("   " + str(report).replace("\n", "\n   "))
            if not report.ok:
                self.findings.data_problems.append(
                    f"workers={self.workers} epoch {number}: {problem_summary(report)}"
                )
        return reports

    # -- the record sheet -------------------------------------------------------------------------

    def _note(self, note: str) -> None:
        self.notes.append(note)
        self.say(f"   note: {note}")

    def _failed(self, setting: str, checked: str, failure: Failure, started: float) -> None:
        self.findings.failure = failure
        for line in failure.lines():
            self.say(f"   {line}")
        if failure.stage == "timeout":
            self.say(f"   {TIMEOUT_ADVICE}")
        elapsed = time.perf_counter() - started
        what = "stuck" if failure.stage == "timeout" else f"{failure.stage} failed"
        self.rows.append(
            Row(setting, checked, duration(elapsed), f"FAILED: {what} at {failure.sample}", False)
        )

    def finish(self) -> dict:
        text, status = verdict(self.findings, self.workers, self.targets)
        self.heading("Record sheet")
        for line in table_lines(self.rows, TERMINAL_COLUMNS - len(_INDENT)):
            self.say(_INDENT + line)
        for note in self.notes:
            self.say(f"   note: {note}")
        self.say(f"\nVerdict: {text}")
        failure = self.findings.failure
        return {
            "dataset": type(self.dataset).__name__,
            "kind": "iterable" if self.iterable else "map-style",
            "batch_size": None if self.batch_sampler is not None else self.batch_size,
            "batch_sampler": type(self.batch_sampler).__name__ if self.batch_sampler is not None else None,
            "collate": collate_name(self.collate_fn),
            "workers": self.workers,
            "timeout": self.timeout,
            "ids": "dataset indices (with_ids)" if self.ids_are_indices else f"the samples' {self.id_key!r}",
            "targets": self.targets,
            "steps": self.steps,
            "table": [dataclasses.asdict(r) for r in self.rows],
            "notes": self.notes,
            "failure": failure.to_dict() if failure else None,
            "verdict": text,
            "ok": status == EXIT_OK,
            "exit_status": status,
        }
