"""``python -m fastcollate bench``: default_collate, assemble and assemble + DeviceLoader side by side.

For each observation (loader-only, integrated with a model consuming), each collate/transfer
variant and each worker count, it runs a few epochs over the same fixed subset, times the measured
steps after the warm-up ones, checks that every epoch delivers the reference's ids and targets, and
writes a table, ``results.json`` (every run kept) and a chart. See ``--help``.

The parts: ``configs`` (what runs), ``epoch`` (one run, recorded), ``correctness`` (the reference
check), ``memory`` and ``machine`` (what is read beside the clock), ``pinned_copy`` (the host link's
reference), ``report`` and ``chart`` (what is shown). This module only sequences them.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..cli import output_folder, run_verb
from ..terminal import fit_to_terminal
from .chart import write_chart
from .configs import DEVICE_LOADER_DEPTH, PREFETCH_FACTOR, Setup, resolve
from .correctness import compare_to_reference
from .datasets import fingerprint
from .epoch import EpochRun, run_epoch
from .machine import machine_info, versions
from .pinned_copy import pinned_copy_gbps
from .presets import PRESETS
from .ratios import MIN_ROUNDS_ONE_SIDE, MIN_TIMED_BATCHES
from .report import (
    NOT_DIFFERENT,
    fmt_bytes,
    format_table,
    jsonable,
    mark_not_different,
    summarize,
    verdict,
)

__all__ = ["build_parser", "main"]

Config = tuple[str, str, int]  # (observation, variant key, workers)

LEGEND = (
    "  w: DataLoader workers; pinned copy: pin_memory() then .to(device, non_blocking=True); samples/s: "
    "samples delivered in the measured steps / their seconds (median over runs); x dflt: samples/s over "
    "the baseline collate's at the same workers, the median of the per-round ratios (their min-max); "
    f"{NOT_DIFFERENT}: not beyond the machine's noise: the two's runs overlap (from {MIN_ROUNDS_ONE_SIDE} "
    "runs on, unless every round's ratio is on one side of 1), or the rounds are too small to time; "
    "p50, p95 ms: the wait, "
    "next(loader) time per measured step (with DeviceLoader it includes "
    "issuing the copy and the device transforms where they are timed: asynchronous on a GPU); "
    "start-up: iter() to first batch "
    "(worker start, reported apart); "
    "peak RSS: VmHWM of main + each worker (shared pages counted in each); "
    "PSS: proportional, the honest sum; shm: /dev/shm segments held by main + workers, sampled "
    "after warm-up and over the untimed tail (results.json also has the whole machine's /dev/shm growth)."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fastcollate bench",
        description="Compare default_collate + pin_memory + .to(non_blocking=True), "
        "fastcollate.assemble + the "
        "same transfer, and assemble + DeviceLoader, for several worker counts, on an embedded "
        "data set (no download) or your own. Measured: samples/s (and the preset's bytes, pixels or "
        "tokens per s) over the measured steps, median of --repeat runs; a ratio is the median of the "
        "per-round ratios, with their min-max; a ratio whose two configurations' runs overlap (from "
        f"{MIN_ROUNDS_ONE_SIDE} runs on, unless every round's ratio is on one side of 1), or whose "
        f"rounds have fewer than {MIN_TIMED_BATCHES} measured batches, is marked "
        f"{NOT_DIFFERENT} (not different: two configurations that are one path have apart runs 1 time in "
        "126 at 5 runs each, 1 in 10 at 3, 1 in 3 at 2). Where: the samples are loaded and collated on the "
        "CPU, in the main process "
        "(workers 0) or in DataLoader worker processes; the copy, the device transforms and the model "
        "run on the GPU, or on the CPU without one, where loader-only leaves the device transforms "
        "out (they would be CPU work timed as the loader's) and integrated keeps them.",
        epilog="Every run is kept in results.json; tables show medians, never the best run. A configuration "
        "whose epoch does not deliver the workers=0 reference's ids and targets is flagged, not ranked. "
        "--dataset module:factory (or file.py:factory): factory() (given size=/seed= if it takes them) "
        "returns a Dataset with dict samples (an 'id' key, else with_ids adds one), or a dict with "
        "'dataset' and optionally 'collate' (the baseline), 'contract', 'batch_sampler', 'batch_size', "
        "'step' (callable on a device batch, for the integrated observation), 'device_transforms', "
        "'unit', 'transforms_note'; as profile and doctor take it (docs/measuring.md).",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="fashion",
        help="embedded data set (default: fashion, the seed study's FashionMNIST-like case)",
    )
    source.add_argument("--dataset", metavar="MODULE:FACTORY", help="your own data set")
    parser.add_argument("--size", type=int, help="samples in the embedded data set (default: the preset's)")
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        help="worker counts (default 0 1 2 4, capped at the usable CPUs; --quick: 0 2)",
    )
    parser.add_argument("--batch-size", type=int, help="default: the preset's (fashion: 256)")
    parser.add_argument("--steps", type=int, help="measured batches per run (default 20; --quick 4)")
    parser.add_argument(
        "--warmup", type=int, help="batches per run before timing starts (default 3; --quick 1)"
    )
    parser.add_argument("--repeat", type=int, help="runs per configuration, interleaved (default 5)")
    parser.add_argument(
        "--quick", action="store_true",
        help="few steps and workers: under 2 minutes on 2 cores; 4 steps are too few to time, so every "
        "ratio is marked ~ (a check that it runs, not a measurement)"
    )
    parser.add_argument(
        "--observation",
        choices=("loader", "integrated", "both"),
        default="both",
        help="loader-only, integrated (a model consumes each batch), or both (default)",
    )
    parser.add_argument("--no-model", action="store_true", help="same as --observation loader")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when a GPU is visible)")
    parser.add_argument(
        "--model-width", type=int, help="CNN width (default 32 on a GPU, as the study; 8 on a CPU)"
    )
    parser.add_argument("--seed", type=int, default=0, help="data and model seed (default 0)")
    parser.add_argument(
        "--out", type=Path, help="output folder (default: a new ./bench-out-<time>, which .gitignore skips)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


class _PlainProgress:
    """What ``progress`` shows without tqdm: one line per run on stderr."""

    def __init__(self, total: int, disable: bool | None) -> None:
        self.n = 0
        self.total = total
        self.disable = disable

    def set_postfix_str(self, text: str) -> None:
        if not self.disable:
            print(f"  [{self.n + 1}/{self.total}] {text}", file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        pass


def progress(total: int, disable: bool | None) -> Any:
    """A tqdm bar over ``total`` runs (``disable=None``: only on a terminal), or plain lines without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(total, disable)
    return tqdm(total=total, unit="run", file=sys.stderr, disable=disable, dynamic_ncols=True, leave=False)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_verb("bench", build_parser(), argv, lambda args: run_bench(args, argv))


def run_bench(args: argparse.Namespace, argv: list[str]) -> int:
    """The command, once its options are parsed; bad input raises ``UsageError`` before anything runs."""
    started = time.perf_counter()
    machine = machine_info()  # before the runs: the load average says how busy the machine was
    setup = resolve(args)
    out = output_folder("--out", args.out or Path(f"bench-out-{_dt.datetime.now():%Y%m%d-%H%M%S}"))
    print_plan(setup, machine)

    configs = [(o, v.key, w) for o in setup.observations for v in setup.variants for w in setup.workers]
    runs, reference = run_configs(setup, configs, disable_progress=args.no_progress or None)
    if reference is not None and reference.error:
        print(f"  note: the reference epoch itself failed ({reference.error}): nothing is comparable")

    entries = [summarize(setup, key, runs[key]) for key in configs]
    mark_not_different(entries)
    limits = link_limits(setup, reference, entries)
    table = fit_to_terminal(format_table(setup, entries))
    print(table)
    print()
    print(fit_to_terminal(LEGEND))

    result = {
        "command": "python -m fastcollate bench " + " ".join(argv),
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine,
        "versions": versions(),
        "config": config_record(setup, quick=bool(args.quick)),
        "warmup_steps": setup.warmup,
        "notes": setup.notes,
        "limits": limits,
        "reference": reference_record(reference, setup),
        "configs": entries,
        "verdicts": {o: verdict([e for e in entries if e["observation"] == o]) for o in setup.observations},
        "elapsed_s": time.perf_counter() - started,
        "load_average_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    (out / "results.json").write_text(json.dumps(jsonable(result), indent=1))
    (out / "table.txt").write_text(table.lstrip("\n") + "\n")
    chart_problem = write_chart(setup, entries, out / "chart.png")
    written = "results.json, table.txt" + (", chart.png" if chart_problem is None else "")
    print(f"\nin {time.perf_counter() - started:.0f} s, wrote into {out}/: {written}")
    if chart_problem is not None:
        _say(f"  {chart_problem}")
    flagged = [e for e in entries if not e["ranked"]]
    return 1 if flagged else 0


def _say(text: str) -> None:
    print(fit_to_terminal(text))


def print_plan(setup: Setup, machine: dict[str, Any]) -> None:
    """What is about to run, and the notes (a busy machine among them) the reader should know."""
    epoch_samples = len(setup.indices) if setup.indices is not None else "all"
    _say(f"fastcollate bench: {setup.description}")
    _say(
        f"  measured: samples/s and {setup.unit}/s delivered in the measured steps, median of "
        f"{setup.repeat} runs, interleaved; ratios: the median of the per-round ratios, their min-max "
        f"beside ({NOT_DIFFERENT}: not beyond the machine's noise)"
    )
    _say(f"  where: {where_it_runs(setup, machine)}")
    _say(f"  {setup.device_transforms_note()}")
    _say(f"  transforms: {setup.transforms_note}")
    _say(
        f"  batch {setup.batch_size}; each run is one epoch: {setup.warmup} warm-up batches (excluded from "
        f"timing) + {setup.steps} measured + the batches the configuration holds in flight, untimed "
        f"({PREFETCH_FACTOR} x workers, +{DEVICE_LOADER_DEPTH} with DeviceLoader), so no pipeline runs dry "
        f"while timed; the reference ({setup.variants[0].label}, 0 workers) reads the whole fixed subset of "
        f"{epoch_samples} samples; {setup.repeat} runs per configuration, interleaved; median shown"
    )
    _say(f"  observations: {', '.join(setup.observations)}")
    if "integrated" in setup.observations:
        _say(f"  model: {setup.model_note}")
    busy = machine.get("cpus_busy_at_start")
    if busy is not None and busy > 0.5 * machine["cpus_usable"]:
        setup.notes.append(
            f"the machine was busy at the start ({busy:.1f} of {machine['cpus_usable']} CPUs in use by other "
            "work, measured over 0.5 s just before): expect noisy numbers"
        )
    for note in setup.notes:
        _say(f"  note: {note}")


def where_it_runs(setup: Setup, machine: dict[str, Any]) -> str:
    """What runs on the CPU and what on the device, and the worker counts, in one line."""
    loading = (
        f"loading + collate on the CPU with DataLoader workers {setup.workers} (0: in the main process) "
        f"on {machine['cpus_usable']} usable CPUs"
    )
    if setup.device.type == "cuda":
        return f"{loading}; copy, device transforms and model on {setup.device}"
    return f"{loading}; device {setup.device} (no GPU): no copy, the model on the CPU too"


def run_configs(
    setup: Setup, configs: list[Config], disable_progress: bool | None
) -> tuple[dict[Config, list[EpochRun]], EpochRun | None]:
    """Every configuration ``setup.repeat`` times, in rounds, each run checked against the reference.

    The reference is the first run of the workers=0 default path (the whole subset), or a run of its
    own when the observations leave that configuration out.
    """
    variants = {v.key: v for v in setup.variants}
    first = setup.variants[0]  # the baseline, unless it could not batch the data
    reference_config: Config = ("loader", first.key, 0)
    runs: dict[Config, list[EpochRun]] = {c: [] for c in configs}
    bar = progress(len(configs) * setup.repeat + (0 if reference_config in runs else 1), disable_progress)
    reference = None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*")
        if reference_config not in runs:
            bar.set_postfix_str(f"reference: {first.label}, 0 workers")
            reference = run_epoch(setup, first, 0, "loader", full=True)
            bar.update(1)
        for round_index in range(setup.repeat):
            # Rotate the order, spreading the rounds' starting points over the whole list: the positions
            # balance out (a slow drift favours none) and no configuration runs twice in a row, as
            # reversing every other round made the last of a round run again first in the next (one slow
            # spell of a noisy machine then caught two of its runs and set it apart).
            count = len(configs)
            shift = round_index * count // setup.repeat if setup.repeat <= count else round_index % count
            ordered = configs[shift:] + configs[:shift]
            if reference is None and round_index == 0:
                ordered = [reference_config] + [c for c in ordered if c != reference_config]
            for observation, variant_key, workers in ordered:
                bar.set_postfix_str(
                    f"{observation} {variants[variant_key].label}, {workers} workers, "
                    f"run {round_index + 1}/{setup.repeat}"
                )
                is_reference = reference is None  # the first run: workers=0 default path, whole subset
                run = run_epoch(setup, variants[variant_key], workers, observation, full=is_reference)
                run.round = round_index
                if reference is None:
                    reference = run
                run.check = compare_to_reference(run.delivered, reference.delivered, run.asked_samples)
                runs[(observation, variant_key, workers)].append(run)
                bar.update(1)
    bar.close()
    return runs, reference


def link_limits(setup: Setup, reference: EpochRun | None, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """On a GPU, the host link's reference in this run: a bare pinned copy of one batch's bytes
    (``pinned_copy.pinned_copy_gbps``, every run kept); each entry's copy GB/s is set against it."""
    if setup.device.type != "cuda" or reference is None or not reference.measured_steps:
        return {}
    batch_bytes = int(reference.bytes / reference.measured_steps)
    try:
        pinned_runs = pinned_copy_gbps(batch_bytes, setup.device)
    except Exception:  # no reference this time: the entries keep their own GB/s, unrelated to it
        pinned_runs = []
    pinned = statistics.median(pinned_runs) if pinned_runs else None
    limits = {
        "batch_bytes": batch_bytes,
        "raw_pinned_h2d_GBps": pinned,
        "raw_pinned_h2d_GBps_runs": pinned_runs,
    }
    for e in entries:
        if e["h2d_ms_p50"]:
            e["h2d_GBps"] = batch_bytes / (e["h2d_ms_p50"] * 1e-3) / 1e9
            if pinned:
                e["h2d_vs_raw_pinned"] = e["h2d_GBps"] / pinned
    if pinned:
        print(
            f"  raw pinned copy of one batch ({fmt_bytes(batch_bytes)}): "
            f"{pinned:.1f} GB/s (the host link's reference in this run)"
        )
    return limits


def config_record(setup: Setup, quick: bool) -> dict[str, Any]:
    """The run's set-up as results.json keeps it under ``"config"``."""
    return {
        "data": setup.name,
        "description": setup.description,
        "transforms": setup.transforms_note,
        "device_transforms": {k: repr(v) for k, v in setup.device_transforms.items()},
        "device_transforms_timed": {o: setup.times_device_transforms(o) for o in setup.observations},
        "batch_size": setup.batch_size,
        "epoch_samples": len(setup.indices) if setup.indices is not None else None,
        "steps": setup.steps,
        "repeat": setup.repeat,
        "workers": setup.workers,
        "device": str(setup.device),
        "observations": setup.observations,
        "model": setup.model_note,
        "pin_memory": setup.pin_memory,
        "persistent_workers": True,
        "prefetch_factor": PREFETCH_FACTOR,
        "device_loader_depth": DEVICE_LOADER_DEPTH,
        "tail_batches": setup.tail,
        "seed": setup.seed,
        "unit": setup.unit,
        "quick": quick,
        "order": "rounds over all configurations, the order rotated by len/repeat places a round",
    }


def reference_record(reference: EpochRun | None, setup: Setup) -> dict[str, Any]:
    """The reference epoch as results.json keeps it: its size and the checksums of its ids and targets."""
    delivered = reference.delivered if reference is not None else None
    return {
        "config": f"{setup.variants[0].label}, 0 workers, loader-only, first run",
        "samples": int(delivered.ids.size) if delivered is not None else 0,
        "ids_crc32": fingerprint(delivered.ids) if delivered is not None else None,
        "targets_crc32": fingerprint(delivered.targets)
        if delivered is not None and delivered.targets is not None
        else None,
    }


if __name__ == "__main__":
    sys.exit(main())
