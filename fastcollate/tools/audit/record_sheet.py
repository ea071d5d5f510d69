"""The doctor's record sheet: one row per setting checked, the figures it shows, and the verdict with
the exit status that follows from what the checklist found."""

from __future__ import annotations

import dataclasses
import textwrap

from .epoch import Epoch
from .failures import Failure
from .report import AuditReport, abbreviated

__all__ = [
    "EXIT_OK",
    "EXIT_PROBLEM",
    "EXIT_UNVERIFIED",
    "MIN_MEASURED_BATCHES",
    "MIN_MEASURED_SECONDS",
    "TIMEOUT_ADVICE",
    "Findings",
    "Row",
    "conclusion",
    "duration",
    "epoch_time",
    "problem_summary",
    "samples_per_second",
    "speed_against",
    "startup_comparison",
    "table_lines",
    "verdict",
    "worker_rows",
]

EXIT_OK, EXIT_PROBLEM, EXIT_UNVERIFIED = 0, 1, 2
MIN_MEASURED_SECONDS = 0.5
MIN_MEASURED_BATCHES = 10  # as the bench's: below, start-up and the prefetch queue decide the rate
"""What each side of a speed comparison needs after start-up before it is called faster or slower:
a scheduling hiccup on a shared machine costs tens of ms, so 10 ms of loading (a 12-sample data set)
gives a ratio that flips from run to run; half a second over several batches holds to the 10% the
verdict uses."""
TIMEOUT_ADVICE = (
    "a timeout makes a wait visible; it repairs nothing (an unavailable source or a stuck worker stays "
    "so). Keep the last step above, and reduce the inputs (that sample alone, --workers 1) rather than "
    "raising --timeout."
)


@dataclasses.dataclass
class Row:
    """One line of the record sheet."""

    setting: str
    checked: str
    time: str
    conclusion: str
    ok: bool | None  # None: not run, or nothing to conclude


_HEADER = Row("setting", "checked", "observed time", "conclusion", None)


@dataclasses.dataclass
class Findings:
    """What the checklist found, from which the verdict follows.

    Attributes:
        failure: the stage that failed, which ends the checklist.
        data_problems: settings that lost, duplicated or changed data, with their first ids.
        unverified: why the data could not be verified (no ids, an empty dataset).
        shapes_vary: batch shapes or dtypes varied within a setting (a warning, not a failure).
    """

    failure: Failure | None = None
    data_problems: list[str] = dataclasses.field(default_factory=list)
    unverified: str | None = None
    shapes_vary: bool = False


def verdict(findings: Findings, workers: int, targets: list[str] | None) -> tuple[str, int]:
    """The verdict line and the exit status."""
    failure = findings.failure
    if failure is not None:
        return _failure_verdict(failure), EXIT_PROBLEM
    if findings.data_problems:
        return (
            "FAIL: data lost, duplicated or changed: "
            + "; ".join(findings.data_problems)
            + ". Do not adopt this setting.",
            EXIT_PROBLEM,
        )
    if findings.unverified:
        return f"NOT VERIFIED: {findings.unverified}", EXIT_UNVERIFIED
    return (
        f"OK: workers={workers} delivers the same samples"
        + (" and targets" if targets else "")
        + " as workers=0, in both epochs"
        + ("; but shapes vary from batch to batch (see the notes)" if findings.shapes_vary else ""),
        EXIT_OK,
    )


def _failure_verdict(failure: Failure) -> str:
    text = f"FAIL: {failure.stage} failed at {failure.sample}"
    if failure.stage == "timeout":
        text = f"FAIL: stuck at {failure.sample} ({failure.error})"
    if failure.field:
        text += f", field {failure.field!r}"
    if failure.stage == "timeout":
        text += f". {TIMEOUT_ADVICE}"
    elif failure.worker is not None and failure.worker >= 0:
        text += (
            ". It happens only with workers: look at what the workers receive (open files, "
            "connections, locks, per-process state) and the start method"
        )
    else:
        text += ". Fix it with workers=0 first: the traceback is readable there."
    return text


_MIN_TIME_WIDTH = 20  # the observed time's column, kept readable however wide the settings are
_SEPARATOR = " | "
_CONCLUSION_INDENT = "  "


def table_lines(rows: list[Row], width: int) -> list[str]:
    """The rows as a table of setting, checked and observed time, each row's conclusion on the lines
    under it, so that no line is wider than ``width``: the time wraps within its column, the conclusion
    across the whole width (at spaces, a word or a path left whole)."""
    widths = [max(len(getattr(r, f)) for r in rows + [_HEADER]) for f in ("setting", "checked")]
    time_width = max(width - sum(widths) - 2 * len(_SEPARATOR), _MIN_TIME_WIDTH)
    lines = []
    for row in [_HEADER] + rows:
        times = _wrapped(row.time, time_width, "") or [""]
        for n, time_text in enumerate(times):
            cells = (row.setting, row.checked) if n == 0 else ("", "")
            line = _SEPARATOR.join([c.ljust(w) for c, w in zip(cells, widths, strict=True)] + [time_text])
            lines.append(line.rstrip())
        lines += _wrapped(row.conclusion, width, _CONCLUSION_INDENT)
        if row is _HEADER:
            time_used = max(len(t) for r in rows + [_HEADER] for t in _wrapped(r.time, time_width, ""))
            lines.append("-+-".join("-" * w for w in [*widths, time_used]))
    return lines


def _wrapped(text: str, width: int, indent: str) -> list[str]:
    return textwrap.wrap(
        text, width, initial_indent=indent, subsequent_indent=indent + "  ", break_long_words=False,
        break_on_hyphens=False,
    )


def duration(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def epoch_time(epoch: Epoch) -> str:
    """The wait on the loader, with the first batch (start-up) and the rate after it apart."""
    text = duration(epoch.wait_seconds)
    if epoch.first_batch_seconds is not None:
        text += f" (first batch {duration(epoch.first_batch_seconds)}"
        rate = epoch.steady_samples_per_second
        text += f", then {rate:,.0f} samples/s)" if rate else ")"
    return text


def samples_per_second(epoch: Epoch) -> float | None:
    """After start-up where there were batches enough to tell, else over the whole wait."""
    rate = epoch.steady_samples_per_second
    if rate is None and epoch.wait_seconds > 0:
        rate = len(epoch) / epoch.wait_seconds
    return rate


def measured(epoch: Epoch) -> tuple[float, int]:
    """The loading time and batches a rate is taken from: after start-up where ``samples_per_second``
    excludes it, else the whole wait."""
    if epoch.steady_samples_per_second is not None and epoch.first_batch_seconds is not None:
        return epoch.wait_seconds - epoch.first_batch_seconds, epoch.batches - 1
    return epoch.wait_seconds, epoch.batches


def _batches(n: int) -> str:
    return f"{n} batch" + ("" if n == 1 else "es")


def speed_against(epoch: Epoch, reference: Epoch) -> str:
    """The setting's samples/s against the reference's, called faster or slower only when both were
    measured long enough (``MIN_MEASURED_SECONDS``, ``MIN_MEASURED_BATCHES``)."""
    rate, reference_rate = samples_per_second(epoch), samples_per_second(reference)
    if not rate or not reference_rate:
        return ""
    (seconds, batches), (ref_seconds, ref_batches) = measured(epoch), measured(reference)
    if min(seconds, ref_seconds) < MIN_MEASURED_SECONDS or min(batches, ref_batches) < MIN_MEASURED_BATCHES:
        return (
            f"speed: too little data to tell ({_batches(batches)} in {duration(seconds)} measured after "
            f"start-up, the reference {_batches(ref_batches)} in {duration(ref_seconds)}; it takes "
            f"{MIN_MEASURED_BATCHES} batches and {MIN_MEASURED_SECONDS:g} s each)"
        )
    ratio = rate / reference_rate
    # One epoch each, so no spread to judge by: a tenth either way is taken for the machine's noise, and
    # beyond it the direction is said, not called a result (python -m fastcollate bench measures that).
    if 0.9 <= ratio < 1.1:
        return f"x{ratio:.2f} ~ the reference's samples/s after start-up: no gain beyond noise"
    direction = "faster" if ratio >= 1.1 else "slower"
    return (f"x{ratio:.2f} the reference's samples/s after start-up: {direction} (one epoch each, not "
            "checked against the machine's noise)")


def startup_comparison(first: Epoch, second: Epoch, persistent: bool) -> str:
    if first.first_batch_seconds is None or second.first_batch_seconds is None:
        return ""
    text = (
        f"first batch {duration(second.first_batch_seconds)} "
        f"(epoch 1: {duration(first.first_batch_seconds)})"
    )
    rate1, rate2 = first.steady_samples_per_second, second.steady_samples_per_second
    if rate1 and rate2:
        text += f", then {rate2:,.0f} samples/s (epoch 1: {rate1:,.0f})"
    text += "; workers kept" if persistent else "; workers restarted"
    return text


def problem_summary(report: AuditReport) -> str:
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


def conclusion(report: AuditReport, detail: str) -> str:
    head = "same data" if report.ok else "DATA DIFFERS: " + ", ".join(report.problems())
    return head + (f"; {detail}" if detail else "")


def worker_rows(
    workers: int, reference: Epoch, epochs: list[Epoch], reports: list[AuditReport], persistent: bool
) -> list[Row]:
    """The few-workers setting's rows: each epoch it completed against the reference, its speed, and
    the second epoch's start-up against the first's."""
    rows = []
    if epochs:
        detail = speed_against(epochs[0], reference)
        rows.append(Row(f"workers={workers}", "ids, targets as the reference", epoch_time(epochs[0]),
                        conclusion(reports[0], detail), reports[0].ok))
    if len(epochs) > 1:
        detail = startup_comparison(epochs[0], epochs[1], persistent)
        rows.append(Row(f"workers={workers}, second epoch", "nothing missing or duplicated",
                        epoch_time(epochs[1]), conclusion(reports[1], detail), reports[1].ok))
    return rows
