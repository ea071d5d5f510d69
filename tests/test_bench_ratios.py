"""The one way every benchmark compares two configurations: the median of per-round ratios inside its own
spread, ``~`` unless the runs are apart, and every ratio marked when the rounds are too small to time."""

from __future__ import annotations

import statistics

from hypothesis import given
from hypothesis import strategies as st

from fastcollate.tools.bench.ratios import (
    MIN_TIMED_BATCHES,
    paired_ratio,
    runs_apart,
    too_small_to_time,
)

rates = st.lists(st.floats(1.0, 1e6), min_size=1, max_size=9)


@given(rates, rates)
def test_the_ratio_is_the_median_of_the_per_round_ratios_and_lies_inside_their_spread(a, b):
    a_by_round, b_by_round = dict(enumerate(a)), dict(enumerate(b))
    ratio = paired_ratio(a_by_round, b_by_round)
    per_round = [x / y for x, y in zip(a, b, strict=False)]  # only the rounds both ran
    assert ratio.rounds == len(per_round)
    assert ratio.median == statistics.median(per_round)
    assert ratio.low <= ratio.median <= ratio.high
    assert (ratio.low, ratio.high) == (min(per_round), max(per_round))


def test_a_ratio_of_medians_outside_the_spread_is_not_what_is_shown():
    # Medians 30 and 10 (3.00), but the rounds give 6.00, 1.50 and 10.00: the round-by-round median is 6.
    ratio = paired_ratio({0: 30, 1: 15, 2: 100}, {0: 5, 1: 10, 2: 10})
    assert ratio.text() == "6.00x (1.50-10.0)"


def test_a_ratio_is_marked_unless_the_runs_are_apart_and_the_rounds_big_enough():
    apart = paired_ratio({0: 300, 1: 310, 2: 290}, {0: 100, 1: 110, 2: 90})
    assert apart.clears_noise and apart.text() == "3.00x (2.82-3.22)"
    overlapping = paired_ratio({0: 300, 1: 100, 2: 290}, {0: 100, 1: 110, 2: 90})
    assert not overlapping.clears_noise and overlapping.text().endswith(" ~")
    one_round = paired_ratio({0: 300}, {0: 100})
    assert one_round.apart is None and one_round.text() == "3.00x (3.00-3.00) ~"
    small = paired_ratio({0: 300, 1: 310, 2: 290}, {0: 100, 1: 110, 2: 90}, too_small="few batches")
    assert small.apart and not small.clears_noise and small.text(spread=False) == "3.00x ~"
    assert small.to_json()["too_small"] == "few batches" and small.to_json()["clears_noise"] is False
    assert paired_ratio({0: 1.0}, {1: 1.0}) is None, "no shared round"


def test_runs_are_apart_only_when_the_slowest_of_one_beats_the_fastest_of_the_other():
    assert runs_apart([111, 121, 123], [90, 100, 110])
    assert runs_apart([60, 70, 89], [90, 100, 110])
    assert not runs_apart([110, 120, 130], [90, 100, 110])  # touching at 110 is not apart
    assert runs_apart([500], [90, 100]) is None


def test_rounds_too_small_to_time_are_named_with_the_reason():
    assert too_small_to_time([20, MIN_TIMED_BATCHES]) is None
    few = too_small_to_time([20, MIN_TIMED_BATCHES - 1])
    assert few.startswith(f"too small to time: {MIN_TIMED_BATCHES - 1} timed batches a round"), few
    assert too_small_to_time([]).startswith("too small to time: 0 timed batches")


def test_from_8_rounds_every_round_on_one_side_of_1_clears_the_noise_though_one_slow_round_overlaps():
    b = {r: 100.0 for r in range(8)}
    a = {r: 300.0 for r in range(8)}
    a[0], b[1] = 150.0, 200.0  # one slow round of a, one fast one of b: the runs overlap (150 < 200)
    ratio = paired_ratio(a, b)
    assert ratio.apart is False and ratio.low > 1 and ratio.clears_noise
    del a[7]  # 7 rounds: the same shape is not enough
    assert not paired_ratio(a, b).clears_noise
    b[2] = 400.0  # one round on the other side of 1
    assert not paired_ratio(a, b).clears_noise


def test_rates_that_are_not_positive_finite_numbers_are_left_out():
    ratio = paired_ratio({0: 300, 1: float("nan"), 2: 310, 3: float("inf"), 4: 0, 5: -1.0, 6: None},
                         {r: 100.0 for r in range(7)})
    assert ratio.rounds == 2 and ratio.text() == "3.05x (3.00-3.10)"
    assert paired_ratio({0: float("nan")}, {0: 1.0}) is None
