"""How every benchmark here compares two configurations timed in the same interleaved rounds.

The ratio printed is the median of the per-round ratios (each round times both, close in time, so a slow
spell of the machine weighs on both sides of one ratio), with their min-max: a ratio of the two medians
can fall outside that spread, and then the spread does not describe the number shown.

A ratio counts as a difference when the two configurations' runs are apart: the slowest run of one faster
than the fastest run of the other (then every per-round ratio is on one side of 1 as well). If both are
one path, n runs each fall apart by chance with probability 2 / C(2n, n) (1 in 10 at 3 runs, 1 in 126 at
5). With many rounds one slow spell keeps two runs from being apart however far their rounds are, so from
``MIN_ROUNDS_ONE_SIDE`` rounds on, every per-round ratio on one side of 1 counts too: by chance, for one
path, 2 / 2^n (1 in 128 at 8). Neither test assumes a shape for the noise. Otherwise the ratio is
marked ``~``.

Rounds too small to time mark every ratio ``~`` whatever its spread, with the reason: with few batches
a round, start-up and the prefetch queue's fill and drain decide the rate, the same way in every round,
so the spread cannot show it (a 2,048-sample data set gave 1.84x for a pass-through, 0.77x at 8,192). A
short round alone is no such reason: its noise shows in the spread.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Hashable, Iterable, Mapping, Sequence

__all__ = [
    "MIN_ROUNDS_ONE_SIDE",
    "MIN_TIMED_BATCHES",
    "NOT_DIFFERENT",
    "PairedRatio",
    "paired_ratio",
    "runs_apart",
    "too_small_to_time",
]

NOT_DIFFERENT = "~"
MIN_TIMED_BATCHES = 10
MIN_ROUNDS_ONE_SIDE = 8


def runs_apart(a: Sequence[float], b: Sequence[float]) -> bool | None:
    """Whether the slowest run of either is faster than the fastest of the other. None when either has
    fewer than two runs: one run has no spread to judge by."""
    if len(a) < 2 or len(b) < 2:
        return None
    return min(a) > max(b) or min(b) > max(a)


@dataclasses.dataclass(frozen=True)
class PairedRatio:
    """``a`` over ``b``: the median of their per-round ratios, and the lowest and highest of those."""

    median: float
    low: float
    high: float
    rounds: int
    apart: bool | None  # runs_apart of the two configurations' rates
    too_small: str | None = None  # why the run cannot tell any difference, whatever the spread

    @property
    def clears_noise(self) -> bool:
        if self.too_small is not None:
            return False
        one_side = self.rounds >= MIN_ROUNDS_ONE_SIDE and (self.low > 1 or self.high < 1)
        return bool(self.apart) or one_side

    def text(self, spread: bool = True) -> str:
        """``1.84x (1.52-2.10)``, then `` ~`` unless it clears the noise."""
        shown = f"{_figure(self.median)}x"
        if spread:
            shown += f" ({_figure(self.low)}-{_figure(self.high)})"
        return shown + ("" if self.clears_noise else f" {NOT_DIFFERENT}")

    def to_json(self) -> dict[str, object]:
        return {**dataclasses.asdict(self), "clears_noise": self.clears_noise}

    @classmethod
    def from_json(cls, kept: dict[str, object]) -> PairedRatio:
        """The ratio :meth:`to_json` kept (its derived ``clears_noise`` left out)."""
        return cls(**{field.name: kept[field.name] for field in dataclasses.fields(cls)})


def paired_ratio(
    a: Mapping[Hashable, float], b: Mapping[Hashable, float], too_small: str | None = None
) -> PairedRatio | None:
    """``a`` over ``b``, each a rate (or a time, inverted by the caller) keyed by round; rounds only one of
    them ran, or where either is not a positive finite number, are left out. None when no round is left."""
    rounds = [r for r in a if r in b and _usable(a[r]) and _usable(b[r])]
    if not rounds:
        return None
    ratios = [a[r] / b[r] for r in rounds]
    return PairedRatio(
        median=float(statistics.median(ratios)),
        low=min(ratios),
        high=max(ratios),
        rounds=len(rounds),
        apart=runs_apart([a[r] for r in rounds], [b[r] for r in rounds]),
        too_small=too_small,
    )


def _figure(value: float) -> str:
    """Three significant figures at most, two decimals below 10: 1.84, 12.3, 144."""
    if round(value, 2) < 10:
        return f"{value:.2f}"
    return f"{value:.1f}" if round(value, 1) < 100 else f"{value:.0f}"


def _usable(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def too_small_to_time(timed_batches: Iterable[int]) -> str | None:
    """Why rounds of these sizes cannot be compared (one reason, for a line under the table), or None.
    Judged on the smallest round of any configuration: that one decides its ratios."""
    batches = min(timed_batches, default=0)
    if batches < MIN_TIMED_BATCHES:
        return (
            f"too small to time: {batches} timed batches a round (fewer than {MIN_TIMED_BATCHES}), so "
            "start-up and the prefetch queue decide the rate; use more samples or steps"
        )
    return None
