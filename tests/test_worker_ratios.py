"""benchmarks/worker_ratios.py's verdict, the headline ``make demo`` leads with: a cell is named fastest
only if its runs are apart from every other cell's, so noise cannot flip it between runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.helpers.charts import assert_legend_clear, kept_figures

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "worker_ratios.py"
_spec = importlib.util.spec_from_file_location("worker_ratios", SCRIPT)
worker_ratios = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker_ratios)


def _result(rates: dict[tuple[str, int], list[float]], batches: int = 12) -> dict:
    runs = [
        {"round": r + 1, "warmup": False, "contender": contender, "workers": workers, "samples_per_s": rate,
         "main_cpu_ms_per_batch": 1.0, "batches": batches, "seconds": 1.0}
        for (contender, workers), per_round in rates.items() for r, rate in enumerate(per_round)
    ]
    return {"dataset": "predecoded", "description": "d", "batch_size": 8, "batch_tensor_bytes": 1,
            "runs": runs, "slot_stats": {}}


def _fastest(rates: dict[tuple[str, int], list[float]], batches: int = 12) -> str:
    lines = "\n".join(worker_ratios.summarize(_result(rates, batches)))
    verdict = lines[lines.index("fastest:"):].split("\n  workers=")[0]
    assert max(len(line) for line in verdict.splitlines()) <= 100
    return " ".join(verdict.split())


def test_a_cell_ahead_in_every_round_is_named_with_its_ratio_over_default_collate():
    line = _fastest({
        ("default_collate", 0): [100, 110, 90], ("assemble, slots on", 0): [105, 100, 95],
        ("default_collate", 2): [150, 160, 140], ("assemble, slots off", 2): [140, 150, 160],
        ("assemble, slots on", 2): [450, 500, 480],
    })
    assert line == ("fastest: assemble, slots on at workers=2, 3.12x default_collate there (480 samples/s; "
                    "its runs apart from every other cell's over 3 rounds)"), line


def test_a_best_median_that_lost_a_round_is_not_called_fastest():
    line = _fastest({
        ("default_collate", 2): [150, 160, 140], ("assemble, slots off", 2): [140, 150, 500],
        ("assemble, slots on", 2): [450, 500, 480],
    })
    assert line == ("fastest: none beyond noise (the best median, assemble, slots on at workers=2, 3.12x "
                    "default_collate there, 480 samples/s, overlaps assemble, slots off at workers=2)"), line


def test_the_ratios_are_medians_of_per_round_ratios_inside_their_spread_and_marked_unless_apart():
    result = _result({
        ("default_collate", 2): [150, 160, 140], ("assemble, slots off", 2): [140, 150, 500],
        ("assemble, slots on", 2): [450, 500, 480],
    })
    text = "\n".join(worker_ratios.summarize(result))
    kept = result["ratios"]["assemble, slots on at workers=2 / default_collate at workers=2"]  # the demo's
    assert (kept["median"], kept["low"], kept["high"], kept["clears_noise"]) == (3.125, 3.0, 480 / 140, True)
    assert "slots on / default_collate 3.12x (3.00-3.43)\n" in text + "\n", text  # 450/150, 500/160, 480/140
    assert "slots on / slots off 3.21x (0.96-3.33) ~" in text, text


def test_rounds_too_small_to_time_mark_every_ratio_and_name_no_fastest():
    line = _fastest({("default_collate", 2): [150, 160, 140], ("assemble, slots off", 2): [140, 150, 160],
                     ("assemble, slots on", 2): [450, 500, 480]}, batches=4)
    assert line.startswith("fastest: cannot tell, too small to time (best median: assemble, slots on"), line


@pytest.mark.parametrize("datasets", [1, 3])
def test_the_charts_legend_covers_no_bar(tmp_path, monkeypatch, datasets):
    """The tallest bar first, at workers=0, where a legend inside the panel would sit."""
    rates = {"default_collate": [30000, 5600, 9000], "assemble, slots off": [0, 5500, 8800],
             "assemble, slots on": [17000, 17000, 29000]}
    medians = {f"{contender} @ workers={w}": rate
               for contender, per_workers in rates.items() for w, rate in enumerate(per_workers) if rate}
    results = [{"dataset": f"set {n}", "batch_size": 256, "medians": medians} for n in range(datasets)]
    with kept_figures(monkeypatch) as figures:
        worker_ratios.draw_chart({"results": results}, tmp_path / "chart.png")
        [figure] = figures
        assert_legend_clear(figure)


def test_one_round_names_nothing_and_a_cell_not_measured_is_said_so():
    line = _fastest({("default_collate", 2): [150], ("assemble, slots off", 2): [140],
                     ("assemble, slots on", 2): [450]})
    assert line.startswith("fastest: cannot tell with one round (best median: assemble, slots on at "
                           "workers=2, 3.00x ~ default_collate there"), line
    text = "\n".join(worker_ratios.summarize(_result({("default_collate", 2): [150, 160, 140],
                                                      ("assemble, slots on", 2): [450, 500, 480]})))
    assert "slots on / slots off - (not both measured)" in text, text
