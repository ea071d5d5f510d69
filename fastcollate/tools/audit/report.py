"""The audit's verdict: what a delivered epoch got wrong against its reference, for a person to read
(``str``) or a program to keep (``to_dict``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from .workers import MAIN_PROCESS, UNKNOWN_WORKER

__all__ = ["AuditReport", "Order", "abbreviated"]

Order = Literal["same", "shuffled", "any"]


@dataclasses.dataclass
class AuditReport:
    """What a delivered epoch got wrong against a reference (another epoch, or the dataset's ids).

    Ids are shown as the dataset knows them (strings for string ids). ``ok`` is False when anything
    was lost, duplicated, unexpected or changed, or reordered where the same order was expected.

    Attributes:
        what: what was compared (``"workers=2 against workers=0"``).
        expected: distinct ids in the reference.
        delivered: samples delivered, repeats included.
        missing: reference ids never delivered (excluding ``dropped``).
        unexpected: delivered ids the reference does not have.
        duplicated: id -> times delivered, for ids delivered more than once (excluding ``padded``).
        changed_targets: ids delivered (at least once) with a target digest other than the reference's.
        dropped: ids not delivered that ``drop_last`` (or the sampler) accounts for: not a loss.
        padded: ids delivered more than once that a DistributedSampler's padding accounts for.
        order: the order expected: ``"same"``, ``"shuffled"`` or ``"any"``.
        order_differs: whether the delivery order differs from the reference's.
        first_order_difference: ``(position, reference id, delivered id)`` at the first difference.
        duplicate_sources: id -> the workers (or ranks) that delivered each copy, for duplicated ids.
        source_kind: ``"worker"`` or ``"rank"``: what ``duplicate_sources`` names.
        targets_compared: whether target digests were compared.
        notes: diagnoses and accounting a person should read.
    """

    what: str
    expected: int
    delivered: int
    missing: list
    unexpected: list
    duplicated: dict
    changed_targets: list
    dropped: list
    padded: dict
    order: Order
    order_differs: bool
    first_order_difference: tuple[int, Any, Any] | None
    duplicate_sources: dict
    source_kind: str
    targets_compared: bool
    notes: list[str]

    @property
    def ok(self) -> bool:
        return not (
            self.missing
            or self.unexpected
            or self.duplicated
            or self.changed_targets
            or (self.order == "same" and self.order_differs)
        )

    @property
    def duplicate_workers(self) -> dict:
        """id -> worker ids that delivered a copy (empty when workers were not recorded)."""
        return self.duplicate_sources if self.source_kind == "worker" else {}

    @property
    def duplicate_ranks(self) -> dict:
        """id -> ranks that delivered a copy (distributed checks)."""
        return self.duplicate_sources if self.source_kind == "rank" else {}

    def problems(self) -> list[str]:
        """One line per class of problem found; empty when ``ok``."""
        out = []
        if self.missing:
            out.append(f"{len(self.missing)} missing")
        if self.duplicated:
            out.append(f"{len(self.duplicated)} duplicated")
        if self.unexpected:
            out.append(f"{len(self.unexpected)} unexpected")
        if self.changed_targets:
            out.append(f"{len(self.changed_targets)} with changed targets")
        if self.order == "same" and self.order_differs:
            out.append("order differs")
        return out

    def __str__(self) -> str:
        verdict = "OK" if self.ok else "FAILED: " + ", ".join(self.problems())
        lines = [
            f"{self.what}: {verdict}",
            f"  delivered {self.delivered} samples; reference has {self.expected} ids",
        ]
        if self.missing:
            lines.append(f"  missing ({len(self.missing)}): {abbreviated(self.missing)}")
        if self.duplicated:
            shown = []
            for sample, count in list(self.duplicated.items())[:10]:
                sources = self.duplicate_sources.get(sample)
                where = f" ({self.source_kind}s {', '.join(map(_source_name, sources))})" if sources else ""
                shown.append(f"{sample!r} x{count}{where}")
            more = f", ... ({len(self.duplicated) - 10} more)" if len(self.duplicated) > 10 else ""
            lines.append(f"  duplicated ({len(self.duplicated)}): {', '.join(shown)}{more}")
        if self.unexpected:
            lines.append(f"  unexpected ({len(self.unexpected)}): {abbreviated(self.unexpected)}")
        if self.changed_targets:
            changed = self.changed_targets
            lines.append(f"  changed targets ({len(changed)}): {abbreviated(changed)}")
        if self.order_differs and self.order != "any":
            expected = {"same": "the same order was expected", "shuffled": "as shuffling does"}
            where = ""
            if self.first_order_difference is not None:
                position, ref, got = self.first_order_difference
                where = f", first at position {position} (reference id {ref!r}, delivered {got!r})"
            lines.append(f"  order differs{where}: {expected[self.order]}")
        if self.dropped:
            lines.append(
                f"  dropped by drop_last, accounted, not lost ({len(self.dropped)}): "
                f"{abbreviated(self.dropped)}"
            )
        if self.padded:
            lines.append(
                f"  repeated by the sampler's padding, accounted ({len(self.padded)}): "
                f"{abbreviated(list(self.padded))}"
            )
        lines.append("  targets: " + ("compared" if self.targets_compared else "not compared (ids only)"))
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def to_dict(self, limit: int = 100) -> dict:
        """A JSON-ready summary: counts, and at most ``limit`` ids of each kind."""

        def ids(values: Iterable) -> list:
            return [_plain(v) for v in list(values)[:limit]]

        return {
            "what": self.what,
            "ok": self.ok,
            "problems": self.problems(),
            "expected": self.expected,
            "delivered": self.delivered,
            "missing": {"count": len(self.missing), "ids": ids(self.missing)},
            "duplicated": {
                "count": len(self.duplicated),
                "ids": [
                    {
                        "id": _plain(k),
                        "count": int(c),
                        f"{self.source_kind}s": [int(s) for s in self.duplicate_sources.get(k, ())],
                    }
                    for k, c in list(self.duplicated.items())[:limit]
                ],
            },
            "unexpected": {"count": len(self.unexpected), "ids": ids(self.unexpected)},
            "changed_targets": {"count": len(self.changed_targets), "ids": ids(self.changed_targets)},
            "dropped": {"count": len(self.dropped), "ids": ids(self.dropped)},
            "padded": {"count": len(self.padded), "ids": ids(self.padded)},
            "order": self.order,
            "order_differs": self.order_differs,
            "first_order_difference": None
            if self.first_order_difference is None
            else [_plain(v) for v in self.first_order_difference],
            "targets_compared": self.targets_compared,
            "notes": list(self.notes),
        }


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def _source_name(source: int) -> str:
    return {MAIN_PROCESS: "main", UNKNOWN_WORKER: "?"}.get(int(source), str(int(source)))


def abbreviated(values: Sequence, limit: int = 10) -> str:
    """The first ``limit`` values and how many more: ``1, 2, 3, ... (7 more)``."""
    shown = ", ".join(repr(v) for v in list(values)[:limit])
    return shown + (f", ... ({len(values) - limit} more)" if len(values) > limit else "")
