"""What ``python -m fastcollate bench`` measures and shows: a loader-only figure moves with the loader
(and, without a GPU, leaves the device transforms out), and a difference within the runs' spread is
marked as no difference, and a fastest configuration is named only when the noise cannot flip it."""

from __future__ import annotations

import dataclasses
import itertools
import os

import numpy as np
import pytest
import torch

from fastcollate.tools.bench import chart, command, configs, report
from fastcollate.tools.bench import machine as machine_module
from fastcollate.tools.bench.epoch import run_epoch
from fastcollate.tools.bench.presets import PRESETS
from fastcollate.tools.terminal import fit_to_terminal
from tests.helpers.bench_datasets import Slowed
from tests.test_bench import bench_arguments

SLOW_COLLATE_S = 0.05  # per batch: far above a tiny batch's own collate time (well under 5 ms)
SLOW_PRESET_COLLATE_S = 0.1  # per batch: far above two samples of any preset once its bank is made (1-3 ms;
# the check fails only past 50 ms)


def _loader_only_rate(setup: configs.Setup, variant_key: str) -> tuple[float, float]:
    """samples/s and timed seconds of one workers=0 loader-only epoch."""
    variant = next(v for v in configs.VARIANTS if v.key == variant_key)
    run = run_epoch(setup, variant, 0, "loader")
    assert run.error is None, run.error
    return run.samples_per_s, run.seconds


def _slowed(setup: configs.Setup, seconds: float = SLOW_COLLATE_S) -> configs.Setup:
    return dataclasses.replace(
        setup,
        baseline_collate=Slowed(setup.baseline_collate, seconds),
        assemble_fn=Slowed(setup.assemble_fn, seconds),
    )


@pytest.mark.parametrize("variant_key", ["default", "assemble", "device_loader"])
def test_a_slowed_collate_lowers_loader_only_samples_per_s_by_a_large_factor(variant_key):
    setup = configs.resolve(
        bench_arguments(preset=None, dataset="tests.helpers.bench_datasets:tiny", size=None, batch_size=None,
              workers=[0], steps=3, warmup=1, repeat=1, observation="loader")
    )
    _loader_only_rate(setup, variant_key)  # the first epoch in the process pays one-time costs
    fast_rate, _ = _loader_only_rate(setup, variant_key)
    slow_rate, slow_seconds = _loader_only_rate(_slowed(setup), variant_key)
    assert slow_seconds >= 3 * SLOW_COLLATE_S * 0.9, "the timed interval holds every measured collate"
    assert slow_rate < fast_rate / 4, (fast_rate, slow_rate)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_presets_loader_only_figures_move_when_the_loader_slows(preset, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    setup = configs.resolve(
        bench_arguments(preset=preset, size=48, batch_size=2, workers=[0], steps=2, warmup=1, repeat=1,
              observation="loader")
    )
    for variant_key in ("default", "device_loader"):
        _loader_only_rate(setup, variant_key)  # the first epoch pays one-time costs (a lazy image bank)
        fast_rate, _ = _loader_only_rate(setup, variant_key)
        slow_rate, _ = _loader_only_rate(_slowed(setup, SLOW_PRESET_COLLATE_S), variant_key)
        assert slow_rate < fast_rate / 3, (variant_key, fast_rate, slow_rate)


def _setup_with_counting_transform(observation: str = "both") -> configs.Setup:
    return configs.resolve(
        bench_arguments(preset=None,
                        dataset="tests.helpers.bench_datasets:tiny_with_device_transform_and_step", size=None,
                        batch_size=None, workers=[0], steps=2, warmup=1, repeat=1,
                        observation=observation)
    )


@pytest.mark.parametrize("variant_key", ["default", "assemble", "device_loader"])
def test_without_a_gpu_loader_only_leaves_the_device_transforms_out_and_integrated_keeps_them(variant_key):
    setup = _setup_with_counting_transform()
    counter = setup.device_transforms["x"]
    variant = next(v for v in configs.VARIANTS if v.key == variant_key)
    loader_run = run_epoch(setup, variant, 0, "loader")
    assert loader_run.error is None and loader_run.batches >= 3  # + DeviceLoader's untimed tail
    assert counter.calls == 0, "loader-only ran the device transform on the CPU, inside the timed loop"
    integrated_run = run_epoch(setup, variant, 0, "integrated")
    assert integrated_run.error is None
    assert counter.calls == integrated_run.batches >= 3, "integrated is a training step: it keeps them"


def test_on_a_gpu_both_observations_keep_the_device_transforms():
    on_gpu = dataclasses.replace(_setup_with_counting_transform(), device=torch.device("cuda"))
    assert on_gpu.times_device_transforms("loader") and on_gpu.times_device_transforms("integrated")
    assert "left out" not in on_gpu.device_transforms_note()
    without = dataclasses.replace(on_gpu, device_transforms={})
    assert not without.times_device_transforms("integrated")
    assert without.device_transforms_note() == "device transforms: none"


def _entry(variant: str, workers: int, rates: list[float], ranked: bool = True, steps: int = 20) -> dict:
    """A summarized configuration as ``report.summarize`` shapes it, from constructed rates."""
    label = next(v.label for v in configs.VARIANTS if v.key == variant)
    median = float(np.median(rates))
    return {
        "observation": "loader", "variant": variant, "label": label, "transfer": "pin_memory+to",
        "workers": workers, "samples_per_s": median, "samples_per_s_min": min(rates),
        "samples_per_s_max": max(rates), "samples_per_s_rel_spread": (max(rates) - min(rates)) / median,
        "bytes_per_s": median * 100, "wait_ms_p50": 1.0, "wait_ms_p95": 2.0, "h2d_ms_p50": None,
        "startup_s": 0.1, "peak_rss_main_bytes": 1 << 20, "peak_rss_workers_bytes": [], "pss_bytes": 1 << 20,
        "shm_bytes": 0, "pinned_bytes": 0, "ids_match_reference": ranked, "errors": [] if ranked else ["X"],
        "ranked": ranked, "lost": 0, "duplicated": 0, "unexpected": 0, "targets_mismatched": 0,
        "runs": [{"round": i, "samples_per_s": r, "measured_steps": steps, "seconds": 1.0}
                 for i, r in enumerate(rates)],
    }


def test_two_configurations_whose_runs_overlap_are_not_different_and_apart_ones_are():
    default = _entry("default", 0, [90, 100, 110])
    assert report.not_different(default, _entry("assemble", 0, [105, 115, 125]))  # overlap 105-110
    assert report.not_different(default, _entry("assemble", 0, [110, 120, 130]))  # touch at 110: the edge
    assert report.not_different(default, _entry("assemble", 0, [40, 200, 210]))  # one slow run overlaps
    assert not report.not_different(default, _entry("assemble", 0, [111, 121, 123]))  # every run faster
    assert not report.not_different(default, _entry("assemble", 0, [60, 70, 89]))  # every run slower
    assert report.not_different(default, _entry("assemble", 0, [500])) is None, "one run: no spread"


def test_runs_of_one_path_are_marked_apart_about_as_often_as_the_docstring_says():
    # Two configurations that are the same path: 5 runs each, drawn from one noisy distribution. The
    # mark calls them apart with chance 2 / C(10, 5) = 1/126, whatever the noise's shape.
    rng = np.random.default_rng(0)
    trials = 20_000
    apart = sum(
        not report.not_different(_entry("default", 0, list(a)), _entry("assemble", 0, list(b)))
        for a, b in rng.lognormal(8.0, 0.3, size=(trials, 2, 5))
    )
    assert abs(apart / trials - 1 / 126) < 0.003, apart / trials


def test_the_table_marks_a_ratio_within_the_spreads_and_leaves_a_real_difference_unmarked():
    setup = _setup_with_counting_transform("loader")
    entries = [
        _entry("default", 0, [90, 100, 110]),
        _entry("assemble", 0, [100, 105, 110]),  # 1.05, inside the spreads
        _entry("device_loader", 0, [290, 300, 310]),  # 3.00, far outside them
    ]
    report.mark_not_different(entries)
    assert [e["not_different_from_default"] for e in entries] == [None, True, False]
    lines = report.format_table(setup, entries).splitlines()
    rows = {e["label"]: next(line for line in lines if e["label"] in line) for e in entries}
    # The median of the per-round ratios (100/90, 105/100, 110/110), with their min-max
    assert " 1.05x (1.00-1.11) ~ " in rows["assemble + pinned copy"]
    assert " 3.00x (2.82-3.22)  " in rows["assemble + DeviceLoader"]
    assert "~" not in rows["assemble + DeviceLoader"]
    assert "~" not in rows["default_collate + pinned copy"]
    table = report.format_table(setup, entries)
    assert "not a real difference on this machine" in table
    assert "fastest correct: assemble + DeviceLoader, 0 workers: 300 samples/s (median)\n" in table + "\n"


def _fastest_line(entries: list[dict]) -> str:
    report.mark_not_different(entries)
    table = report.format_table(_setup_with_counting_transform("loader"), entries)
    lines = table[table.index("fastest correct:"):].splitlines()
    wrapped = [lines[0]] + list(itertools.takewhile(lambda line: line.startswith("  "), lines[1:]))
    return " ".join(" ".join(wrapped).split())


def test_the_fastest_configuration_is_named_only_when_its_runs_are_apart_from_every_other():
    flagged = _entry("device_loader", 0, [10, 11, 12], ranked=False)
    line = _fastest_line([_entry("default", 0, [90, 100, 110]), _entry("assemble", 0, [95, 104, 113]),
                          flagged])
    assert flagged["not_different_from_default"] is None, "a flagged configuration is not compared"
    assert line == ("fastest correct: none faster beyond noise, every configuration's runs reach the lead "
                    "(best median: assemble + pinned copy, 0 workers (104))"), line


def test_when_the_noise_leaves_a_worker_count_standing_the_verdict_names_it_whichever_median_leads():
    zero = [_entry("default", 0, [40, 50, 60]), _entry("assemble", 0, [45, 52, 58])]
    for leader in ("default", "assemble"):  # the medians at 2 workers swap places: the verdict stays
        two = [_entry("default", 2, [90, 110 if leader == "default" else 100, 115]),
               _entry("assemble", 2, [92, 110 if leader == "assemble" else 100, 118])]
        line = _fastest_line(zero + two)
        assert line.startswith("fastest correct: 2 workers, with any of its 2 configurations (their runs "
                               "overlap: no difference beyond noise; best median: "), line


def test_a_configuration_whose_runs_overlap_the_best_across_worker_counts_is_listed():
    entries = [_entry("default", 0, [40, 50, 95]), _entry("default", 2, [90, 110, 115]),
               _entry("assemble", 2, [20, 30, 40])]
    assert _fastest_line(entries) == (
        "fastest correct: none alone beyond noise; the lead, whose runs overlap: default_collate + "
        "pinned copy, 0 workers (50), default_collate + pinned copy, 2 workers (110)")


def test_the_verdict_depends_on_the_runs_ranges_not_on_which_median_leads():
    # Each configuration's slowest and fastest runs fixed, the medians moved inside them: one verdict.
    verdicts = set()
    for m1, m2 in ((110, 125), (128, 120), (101, 134)):
        entries = [_entry("default", 0, [60, 70, 105]), _entry("default", 2, [100, m1, 130]),
                   _entry("assemble", 2, [115, m2, 135])]
        verdicts.add(_fastest_line(entries).split(" (their runs")[0])
    assert verdicts == {"fastest correct: 2 workers, with any of its 2 configurations"}, verdicts


def test_with_one_run_each_no_configuration_is_named_fastest():
    line = _fastest_line([_entry("default", 0, [100]), _entry("assemble", 0, [101])])
    assert line.startswith("fastest correct: cannot tell with one run each"), line


def test_with_one_run_each_the_table_says_it_cannot_tell_noise_from_a_difference():
    setup = _setup_with_counting_transform("loader")
    entries = [_entry("default", 0, [100]), _entry("assemble", 0, [300])]
    report.mark_not_different(entries)
    table = report.format_table(setup, entries)
    assert "3.00x (3.00-3.00) ~" in table, table
    assert "~ where the two compared share fewer than two timed rounds: no spread, so no difference" in table


def test_runs_too_small_to_time_mark_every_ratio_and_name_no_fastest():
    setup = _setup_with_counting_transform("loader")
    entries = [_entry("default", 0, [90, 100, 110], steps=5), _entry("assemble", 0, [290, 300, 310], steps=5)]
    report.mark_not_different(entries)
    assert entries[1]["not_different_from_default"] is False, "the runs are apart"
    assert entries[1]["ratio_to_default"]["clears_noise"] is False, "but too few batches to tell"
    table = report.format_table(setup, entries)
    assert "3.00x (2.82-3.22) ~" in table, table
    assert "~ on every ratio: too small to time: 5 timed batches a round (fewer than 10)" in table, table
    assert "fastest correct: cannot tell, too small to time (best median: assemble" in table, table


def test_the_header_names_the_unit_where_things_run_the_workers_and_the_device_transforms(capsys):
    setup = _setup_with_counting_transform()
    machine = {"load_average": [2.9, 1.0, 0.5], "cpus_busy_at_start": 0.1, "cpus_usable": 2}
    command.print_plan(setup, machine)
    printed = capsys.readouterr().out
    assert max(len(line) for line in printed.splitlines()) <= 100  # wrapped to the terminal
    out = " ".join(printed.split())  # the words, whatever the wrapping
    assert "busy" not in out  # a load average left by the build that just ended is not the machine's now
    assert "measured: samples/s and bytes/s delivered in the measured steps, median of 1 runs" in out
    assert "ratios: the median of the per-round ratios, their min-max beside (~: not beyond" in out
    assert "DataLoader workers [0] (0: in the main process) on 2 usable CPUs" in out
    assert "device cpu (no GPU)" in out
    assert "device transforms (x: CountingCalls): timed in integrated; left out of loader-only" in out
    on_gpu = dataclasses.replace(setup, device=torch.device("cuda", 0))
    assert "copy, device transforms and model on cuda:0" in command.where_it_runs(on_gpu, machine)


def test_bench_help_says_what_is_measured_where_and_what_the_mark_means():
    text = " ".join(command.build_parser().format_help().split())
    for words in ("Measured: samples/s", "median of --repeat runs",
                  "a ratio is the median of the", "ratios, with their min-max",
                  "runs overlap (from 8 runs on, unless every round's ratio is on one side of 1), or whose "
                  "rounds have fewer than 10 measured batches, is marked ~ (not different",
                  "DataLoader worker processes",
                  "on the GPU, or on the CPU",
                  "loader-only leaves the device transforms out"):
        assert words in text, words


def test_the_chart_title_says_where_the_device_transforms_were_left_out():
    setup = _setup_with_counting_transform()
    assert chart._transforms_left_out(setup) == "; device transforms left out of: loader (no GPU)"
    assert chart._transforms_left_out(dataclasses.replace(setup, device=torch.device("cuda"))) == ""


def test_the_plan_says_the_machine_is_busy_only_when_it_is_measured_busy_now(capsys):
    setup = _setup_with_counting_transform()
    command.print_plan(setup, {"load_average": [0.1, 0.1, 0.1], "cpus_busy_at_start": 1.8, "cpus_usable": 2})
    out = " ".join(capsys.readouterr().out.split())
    assert "the machine was busy at the start (1.8 of 2 CPUs in use by other work" in out
    busy = machine_module.cpus_busy_now(0.2)
    assert busy is not None and 0.0 <= busy <= (os.cpu_count() or 1) + 0.01


def test_the_tables_fit_in_100_columns_and_leave_out_what_cannot_apply_without_a_gpu():
    setup = _setup_with_counting_transform("loader")
    entries = [_entry("default", 2, [90, 100, 110]), _entry("assemble", 2, [100, 105, 110]),
               _entry("device_loader", 2, [290, 300, 310])]
    report.mark_not_different(entries)
    table = fit_to_terminal(report.format_table(setup, entries))
    assert max(len(line) for line in table.splitlines()) <= 100, table
    assert "h2d" not in table and "pinned" not in table.split("(no GPU")[0]  # no column of "no GPU" cells
    assert "(no GPU: the host-to-device and pinned-memory columns do not apply, left out)" in table
    header = next(line for line in table.splitlines() if line.startswith("w  config"))
    assert "samples/s" in header and "x dflt" in header  # the speed table comes first


def test_flagged_rows_two_digit_ratios_and_the_gpu_columns_are_built_within_100_columns():
    # Built narrow, not wrapped: every row stays one line, as long as the widest cells can be.
    flagged = _entry("assemble", 2, [100, 105, 110], ranked=False)
    flagged.update(errors=[], lost=1, duplicated=1)
    entries = [_entry("default", 2, [9, 10, 11]), flagged, _entry("device_loader", 2, [1290, 1300, 1310])]
    entries[2]["transfer"] = "DeviceLoader"
    for entry in entries:
        entry.update(peak_rss_main_bytes=1023 << 20, peak_rss_workers_bytes=[1023 << 20] * 16,
                     pss_bytes=1023 << 30, shm_bytes=1023 << 20, h2d_ms_p50=12.5, pinned_bytes=1023 << 20)
    report.mark_not_different(entries)
    for device in ("cpu", "cuda"):
        setup = dataclasses.replace(_setup_with_counting_transform("loader"), device=torch.device(device))
        table = report.format_table(setup, entries)
        rows = [line for line in table.splitlines() if line[:1].isdigit() or line.startswith(("w ", "- "))]
        assert len(rows) == (10 if device == "cpu" else 15) and max(len(line) for line in rows) <= 100, table
        assert max(len(line) for line in fit_to_terminal(table).splitlines()) <= 100
    assert "130x (119-143)" in table and " FLAGGED" in table and "12.5 *" in table, table
    assert "FLAGGED, not ranked: assemble + pinned copy, 2 workers: lost 1, duplicated 1\n" in table
    flagged.update(errors=["Traceback (most recent call last):\n  ...\nValueError: bad sample 7"] * 3)
    assert "2 workers: ValueError: bad sample 7\n" in report.format_table(setup, entries)  # once, last line
    assert "* DeviceLoader's copy runs on its own stream, overlapping the step" in table


def test_a_flagged_line_gives_each_error_as_its_exception_line_once():
    # CUDA's messages end in advice, a worker's traceback repeats in every run: the exception line says it.
    cuda = ("Traceback (most recent call last):\n  ...\ntorch.AcceleratorError: CUDA error: an illegal "
            "memory access\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
            "Compile with `TORCH_USE_CUDA_DSA`")
    flagged = _entry("assemble", 0, [100, 105, 110], ranked=False)
    flagged["errors"] = [cuda, cuda, "ValueError: sizes differ\n  shape (3,) vs (4,)"]
    entries = [_entry("default", 0, [90, 100, 110]), flagged]
    report.mark_not_different(entries)
    table = report.format_table(_setup_with_counting_transform("loader"), entries)
    assert ("0 workers: torch.AcceleratorError: CUDA error: an illegal memory access; ValueError: sizes "
            "differ") in " ".join(table.split()), table
