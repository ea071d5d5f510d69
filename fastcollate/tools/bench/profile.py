"""``python -m fastcollate profile``: N training steps under ``torch.profiler`` with the ranges
``batch_wait``, ``h2d_transfer`` and ``compute``, for the default path and for DeviceLoader; writes a
Chrome trace per path and a timeline PNG of where each step's time went (and, on a GPU, the copy and
compute streams, so overlap is visible).

Profiled step times carry the profiler's own overhead: they show where the waits are, they are not
throughput figures. ``python -m fastcollate bench`` measures throughput, with the profiler off.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.data import Subset

from ...transfer.transforms import apply_to_fields
from ..cli import output_folder, run_verb
from ..factory_spec import collate_name
from ..terminal import fit_to_terminal
from .batches import to_device
from .configs import Setup, Variant, resolve
from .loaders import close_loader, open_loader, sync
from .machine import machine_info, usable_cpus, versions
from .presets import PRESETS
from .report import jsonable
from .timeline import NOT_THROUGHPUT, RANGES, count_of, draw_timeline, range_summary, read_trace

__all__ = ["main", "profile_path"]

PATHS = {
    "default": ("{collate} + pin_memory + .to(non_blocking=True)", "default"),
    "device_loader": ("assemble + DeviceLoader", "device_loader"),
}
"""Each ``--paths`` name: its label (``{collate}``: the baseline collate's name) and the bench variant."""


def profile_path(setup: Setup, variant: Variant, workers: int, trace_path: Path) -> dict[str, int]:
    """Runs ``setup.warmup`` unprofiled steps, then ``setup.steps`` profiled ones; exports the trace.

    Returns the steps that ran of each kind, ``{"warmup_steps": w, "profiled_steps": p}``: fewer than
    asked when the data set ran out first (its epoch is not repeated).

    The default path is wrapped in all three ranges here. DeviceLoader emits ``batch_wait`` and
    ``h2d_transfer`` itself (its copy is issued inside ``next()``), so only ``compute`` is added.
    """
    device = setup.device
    dataset = setup.dataset if setup.indices is None else Subset(setup.dataset, setup.indices)
    loader, source = open_loader(setup, variant, workers, dataset, setup.device_transforms,
                                 batches=setup.batches)
    device_loader = variant.transfer == "DeviceLoader"
    step = setup.make_step() if setup.make_step is not None else None
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    iterator = iter(source)
    warmed = profiled = 0
    try:
        for _ in range(setup.warmup):
            batch = _next_batch(iterator, setup, device, device_loader)
            if batch is None:
                break
            if step is not None:
                step(batch)
            warmed += 1
        sync(device)
        prof = profile(activities=activities)
        log = trace_path.parent / PROFILER_LOG
        with profiler_log_kept_in(log):
            prof.start()
        try:
            for _ in range(setup.steps):
                batch = _next_batch(iterator, setup, device, device_loader)
                if batch is None:
                    break
                with record_function("compute"):
                    if step is not None:
                        step(batch)
                del batch
                prof.step()
                profiled += 1
            sync(device)
        finally:
            with profiler_log_kept_in(log):
                prof.stop()
                prof.export_chrome_trace(str(trace_path))
    finally:
        close_loader(loader, source)
    return {"warmup_steps": warmed, "profiled_steps": profiled}


def _next_batch(iterator: Any, setup: Setup, device: torch.device, device_loader: bool) -> Any:
    if device_loader:
        try:
            return next(iterator)  # DeviceLoader records batch_wait and h2d_transfer itself
        except StopIteration:
            return None
    with record_function("batch_wait"):
        try:
            batch = next(iterator)
        except StopIteration:
            return None
    with record_function("h2d_transfer"):
        if device.type != "cpu":
            batch = to_device(batch, device, non_blocking=True)
        batch = apply_to_fields(batch, setup.device_transforms)
    return batch


# --------------------------------------------------------------------------------------------------
# The command.


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fastcollate profile",
        description="Run N steps under torch.profiler with ranges batch_wait / h2d_transfer / compute, "
        "for the "
        "default path and for DeviceLoader; write a Chrome trace per path and a timeline PNG.",
        epilog=NOT_THROUGHPUT + ".",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="fashion",
        help=f"embedded data set (default: fashion, {PRESETS['fashion'].description})",
    )
    source.add_argument("--dataset", metavar="MODULE:FACTORY", help="your own data set (see bench --help)")
    parser.add_argument("--size", type=int, help="samples in the embedded data set (default: the preset's)")
    parser.add_argument(
        "--workers", type=int, help="DataLoader workers (default: 2, capped at the usable CPUs)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        help="default: the preset's ("
        + ", ".join(f"{name} {preset.batch_size}" for name, preset in sorted(PRESETS.items()))
        + "), or a --dataset factory's batch_size (else 256)",
    )
    parser.add_argument("--steps", type=int, default=20, help="profiled steps per path (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="unprofiled steps first (default 5)")
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=sorted(PATHS),
        default=["default", "device_loader"],
        help="the paths profiled, in turn (default: both)",
    )
    parser.add_argument("--no-model", action="store_true", help="no compute: the ranges of the loader alone")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when a GPU is visible)")
    parser.add_argument(
        "--model-width",
        type=int,
        help="width of the preset's model (default 32 on a GPU, 8 on a CPU); a --dataset brings its own step",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the generated data, the sample order and the model (default 0)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="output folder (default: a new ./bench-out-profile-<time>, which .gitignore skips)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_verb("profile", build_parser(), argv, lambda args: run_profile(args, argv))


def run_profile(args: argparse.Namespace, argv: list[str]) -> int:
    """The command, once its options are parsed; bad input raises ``UsageError`` before anything runs."""
    workers = args.workers if args.workers is not None else min(2, usable_cpus())
    setup = resolve(bench_arguments(args, workers))  # checks the options it shares with the bench
    out = output_folder("--out", args.out or Path(f"bench-out-profile-{_dt.datetime.now():%Y%m%d-%H%M%S}"))
    print_plan(setup, workers)
    panels, summary = profile_paths(setup, args.paths, workers, out)
    title = timeline_title(setup, workers, summary)
    steps = [(s["profiled_steps"], s["fewer_because"]) for s in summary.values()]
    problem = draw_timeline(panels, out / "timeline.png", title, steps) if panels else "nothing profiled"
    record = {
        "command": "python -m fastcollate profile " + " ".join(argv),
        "note": NOT_THROUGHPUT,
        "machine": machine_info(),
        "versions": versions(),
        "config": {
            "data": setup.name,
            "batch_size": setup.batch_size,
            "workers": workers,
            "device": str(setup.device),
            # what was asked; what ran is each path's warmup_steps and profiled_steps
            "warmup_steps_asked": setup.warmup,
            "profiled_steps_asked": setup.steps,
            "compute": setup.model_note if setup.make_step is not None else None,
        },
        "timeline_title": title,
        "paths": summary,
    }
    (out / "profile.json").write_text(json.dumps(jsonable(record), indent=1))
    written = ["profile.json", *(["timeline.png"] if problem is None else [])]
    written += [path["trace"] for path in summary.values()]
    say(f"wrote into {out}{os.sep}: {', '.join(written)}")
    if problem is not None:
        say(f"  no timeline: {problem}")
    say(f"  reminder: {NOT_THROUGHPUT}.")
    return 0


def say(text: str) -> None:
    """``text`` on stdout, its lines wrapped to the terminal's width (a path left whole)."""
    print(fit_to_terminal(text))


def range_table(summary: dict[str, Any]) -> list[str]:
    """Each path's ranges as a table, one row a path (as ``--paths`` names it): the median and the 95th
    percentile of each range's duration per profiled step, in ms; ``-`` where a path had none."""
    header = ["path", "steps", *RANGES]
    rows = [header]
    for key, path in summary.items():
        ranges = path["ranges_ms"] if path["profiled_steps"] else {}  # with no step, a wait is no step's
        cells = [f"{ranges[n]['median_ms']:.2f} ({ranges[n]['p95_ms']:.2f})" if n in ranges else "-"
                 for n in RANGES]
        rows.append([key, str(path["profiled_steps"]), *cells])
    if len(rows) == 1:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["median (p95) per profiled step, ms:"]
    for row in rows:
        figures = [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join([row[0].ljust(widths[0]), *figures]))
    return lines


def bench_arguments(args: argparse.Namespace, workers: int) -> argparse.Namespace:
    """The profile's options as ``configs.resolve`` reads the bench's: one worker count, one run."""
    return argparse.Namespace(
        preset=args.preset,
        dataset=args.dataset,
        size=args.size,
        workers=[workers],
        batch_size=args.batch_size,
        steps=args.steps,
        warmup=args.warmup,
        repeat=1,
        quick=False,
        observation="loader" if args.no_model else "both",
        no_model=args.no_model,
        device=args.device,
        model_width=args.model_width,
        seed=args.seed,
    )


def timeline_title(setup: Setup, workers: int, summary: dict[str, Any]) -> str:
    """The chart's title, with the steps each path profiled (as profile.json has them), not those asked."""
    counts = {s["profiled_steps"] for s in summary.values()}
    if len(counts) == 1:
        steps = count_of(counts.pop(), "profiled step")
    else:
        steps = "profiled steps " + ", ".join(f"{s['label']} {s['profiled_steps']}" for s in summary.values())
    if any(s["fewer_because"] for s in summary.values()):
        steps += f" ({setup.steps} asked: the data set ran out)"
    return (
        f"fastcollate profile: {setup.name}, batch {setup.batch_size}, {workers} workers, "
        f"device {setup.device}, {steps}"
    )


def samples_in(setup: Setup) -> int | None:
    """The samples a path reads (the fixed subset, or the whole data set); None for a stream."""
    if setup.indices is not None:
        return len(setup.indices)
    try:
        return len(setup.dataset)  # type: ignore[arg-type]
    except TypeError:
        return None


def fewer_because(setup: Setup, ran: dict[str, int]) -> str | None:
    """Why a path profiled fewer steps than asked (the epoch ended first), or None when all ran."""
    if ran["profiled_steps"] >= setup.steps:
        return None
    batches = ran["warmup_steps"] + ran["profiled_steps"]
    samples = samples_in(setup)
    made = (
        f"{samples} samples at batch {setup.batch_size} make {count_of(batches, 'batch', 'batches')}"
        if samples is not None
        else f"the data set gave {count_of(batches, 'batch', 'batches')}"
    )
    return (
        f"{made}, {ran['warmup_steps']} used by --warmup {setup.warmup}, so "
        f"{ran['profiled_steps']} of --steps {setup.steps} profiled; more samples or a smaller "
        "--batch-size give more"
    )


PROFILER_LOG = "profiler.log"


@contextlib.contextmanager
def profiler_log_kept_in(path: Path) -> Iterator[None]:
    """Sends what the process writes to its stderr (fd 2) to ``path`` meanwhile.

    The profiler's C++ side (kineto) writes its own log lines straight to fd 2: "USDT: ...
    profiler_start", and on a machine without a GPU "ERROR: ... gpuGetDeviceCount failed", which a
    reader takes for our failure. Their level is fixed when torch loads (``KINETO_LOG_LEVEL``), so they
    are kept in a file instead, around the profiler's start, stop and export only: the steps between,
    and their warnings, print as ever.
    """
    sys.stderr.flush()
    kept = os.dup(2)
    try:
        with open(path, "ab") as log:
            os.dup2(log.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(kept, 2)
        os.close(kept)


def print_plan(setup: Setup, workers: int) -> None:
    say(
        f"fastcollate profile: {setup.description}, batch {setup.batch_size}, {workers} workers, "
        f"device {setup.device}"
    )
    say(
        f"  {setup.warmup} unprofiled warm-up steps, then {setup.steps} profiled steps per path; "
        f"activities: CPU{' + CUDA' if setup.device.type == 'cuda' else ''}"
    )
    if setup.make_step is not None:
        say(f"  compute: {setup.model_note}")
    for note in setup.notes:
        say(f"  note: {note}")
    samples = samples_in(setup)
    if samples is not None:  # said before the run, where the data set is known to be too small
        batches = -(-samples // setup.batch_size)
        if batches < setup.warmup + setup.steps:
            warmup = min(batches, setup.warmup)
            ran = {"warmup_steps": warmup, "profiled_steps": batches - warmup}
            say(f"  note: {fewer_because(setup, ran)}")
    say(f"  NOTE: {NOT_THROUGHPUT}.")


def profile_paths(
    setup: Setup, paths: Sequence[str], workers: int, out: Path
) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
    """Each asked path profiled in turn: the timeline's panels, and each path's summary for the JSON."""
    variants = {v.key: v for v in setup.variants}
    panels = []
    summary: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*")
        for key in paths:
            label, variant_key = PATHS[key]
            label = label.format(collate=collate_name(setup.baseline_collate))
            if variant_key not in variants:
                say(f"  skipped {label}: {setup.left_out.get(variant_key, 'not available in this build')}")
                continue
            trace_path = out / f"trace_{key}.json"
            started = time.perf_counter()
            info = profile_path(setup, variants[variant_key], workers, trace_path)
            trace = read_trace(trace_path)
            ranges = range_summary(trace)
            why = fewer_because(setup, info)
            summary[key] = {
                "label": label,
                "trace": trace_path.name,
                "warmup_steps": info["warmup_steps"],
                "profiled_steps": info["profiled_steps"],
                "fewer_because": why,
                "ranges_ms": ranges,
                "gpu_streams": sorted(trace["gpu"]),
            }
            panels.append((label, trace))
            head = count_of(info["profiled_steps"], "profiled step")
            say(f"  {key} ({label}): {head} in {time.perf_counter() - started:.1f} s")
            if why:
                say(f"    fewer than asked: {why}")
    for line in range_table(summary):
        say(f"  {line}")
    log = out / PROFILER_LOG
    if log.exists() and log.stat().st_size:
        lines = len(log.read_bytes().splitlines())
        say(f"  torch.profiler's own log ({lines} lines, e.g. its start and stop markers): {log}")
    return panels, summary


if __name__ == "__main__":
    sys.exit(main())
