"""What ``doctor --resume`` says about its resumes: a line for each way of resuming when every checkpoint
passed; else the checkpoints that failed (the first in full, the others in a line each) and why one could
not be checked; then the verdict, with the time the check took. And the same as a dict, for ``--json``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .record_sheet import EXIT_OK, EXIT_PROBLEM, EXIT_UNVERIFIED
from .report import AuditReport

__all__ = ["ResumeRun", "finished", "listed", "plural", "said"]


@dataclasses.dataclass
class ResumeRun:
    """One resume from one checkpoint (``after_batch``; None for the epoch the checkpoints come from):
    what the ids showed, or why it could not run."""

    what: str
    after_batch: int | None
    report: AuditReport | None = None
    unverified: str | None = None
    problems: list[str] = dataclasses.field(default_factory=list)  # beyond the ids: uneven ranks

    @property
    def status(self) -> int:
        if self.unverified is not None:
            return EXIT_UNVERIFIED
        return EXIT_OK if self.report is not None and self.report.ok and not self.problems else EXIT_PROBLEM

    def to_dict(self) -> dict:
        return {
            "what": self.what,
            "after_batch": self.after_batch,
            "unverified": self.unverified,
            "problems": self.problems,
            "report": self.report.to_dict() if self.report is not None else None,
        }


def said(runs: list[ResumeRun], out: Callable[[str], Any]) -> None:
    """One way of resuming, at each checkpoint: a line when every one passed; else the checkpoints that
    failed, the first in full and the others in a line each, and why one could not be checked."""
    what = runs[0].what
    failed = [run for run in runs if run.status == EXIT_PROBLEM]
    unverified = [run for run in runs if run.status == EXIT_UNVERIFIED]
    if not failed and not unverified:
        out(f"  {what}: OK at {plural(len(runs), 'checkpoint')}, {_delivered([run.report for run in runs])}")
        return
    if failed:
        where = [run.after_batch for run in failed if run.after_batch is not None]
        out(f"  {what}: FAILED" + (f" after batch {listed(where)}" if where else ""))
        for number, run in enumerate(failed):
            lines = [*run.problems, *(str(run.report).splitlines()[1:] if run.report is not None else [])]
            if number:  # the first failure in full is enough to read; the others, what they were
                problems = run.report.problems() if run.report is not None else []
                lines = [", ".join([*run.problems, *problems])]
            head = f"after batch {run.after_batch}: " if run.after_batch is not None else ""
            out(f"    {head}{lines[0].strip()}")
            for line in lines[1:]:
                out(f"      {line.strip()}")
    for run in unverified:
        where = f" after batch {run.after_batch}" if run is not runs[0] else ""
        out(f"  {what}: NOT VERIFIED{where}: {run.unverified}")


def finished(
    runs: list[ResumeRun],
    out: Callable[[str], Any],
    *,
    seconds: float,
    unverified: str | None = None,
    positions: list[int] | None = None,
    batches: int | None = None,
    world_sizes: tuple[int, int] | None = None,
    weights_only: str | None = None,
) -> dict:
    """The verdict, said in the last line with the time the check took, and the report as a dict:
    ``exit_status`` 0 (every resume right), 1 (one wrong, or the loader failed) or 2 (not verified)."""
    if unverified is not None:
        status = EXIT_UNVERIFIED
        out(f"resume check: NOT VERIFIED (exit status {status}) in {seconds:.1f} s: {unverified}")
    else:
        statuses = {run.status for run in runs}
        status = EXIT_PROBLEM if EXIT_PROBLEM in statuses else max(statuses)
        verdict = {EXIT_OK: "OK", EXIT_PROBLEM: "FAILED", EXIT_UNVERIFIED: "NOT VERIFIED"}[status]
        out(
            f"resume check: {verdict} (exit status {status}) in {seconds:.1f} s"
            + (f", {plural(len(positions), 'checkpoint')}" if positions else "")
        )
    return {
        "check": "resume",
        "batches_a_rank": batches,
        "checkpoints": positions,
        "world_sizes": list(world_sizes) if world_sizes else None,
        "unverified": unverified,
        "runs": [run.to_dict() for run in runs],
        "weights_only": weights_only,
        "seconds": round(seconds, 3),
        "exit_status": status,
    }


def _delivered(reports: list[AuditReport]) -> str:
    """What every resume of a plan delivered, as the OK line says it: the most any repeated or left out."""
    repeated = max(sum(report.padded.values()) - len(report.padded) for report in reports)
    dropped = max(len(report.dropped) for report in reports)
    text = f"every one of {reports[0].expected} samples delivered once"
    # Accounted repeats: a sampler's padding, or ids the data set itself holds twice.
    text += f", up to {repeated} repeated as accounted for" if repeated else ""
    return text + (f", up to {dropped} left out by drop_last" if dropped else "")


def listed(numbers: list) -> str:
    return ", ".join(map(str, numbers))


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'s' if count != 1 else ''}"
