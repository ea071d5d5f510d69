"""Loader-only samples/s of the loaders people use, each with ``default_collate`` and with ``assemble``,
side by side in one run: DataLoader in the main process and with 2 worker processes, an SPDL pipeline
with 2 threads, and a torchdata.nodes thread ``ParallelMapper`` with 2 threads; the performance targets
judged on the ratios.

    python -m benchmarks.peer_ratios [--presets predecoded fashion fields] [--rounds 7] [--batches 15]
                                     [--malloc both|default|fixed] [--json PATH]

Method. Every contender gets the same batches (one shuffled permutation per round, seeded), the same
batch size and a prefetch depth of 2 batches: DataLoader's ``prefetch_factor=2``, SPDL's sink buffer of
2, torchdata's ``Prefetcher(prefetch_factor=2)``. In the thread pipelines each of the 2 threads fetches a
whole batch and collates it (what a DataLoader worker does), so the collate runs on both threads at
once. One torch thread in every thread and process. A round runs one epoch on every contender in a
freshly shuffled order, dropping each batch at once; the first round is a warm-up (kept in the JSON, left
out of the medians). A ratio is the median of the per-round paired ratios, their min-max beside, ``~``
unless the runs are apart (``fastcollate.tools.bench.ratios``). A peer that is not installed is skipped, and
the output says so.

glibc's malloc settings move these figures by up to 2x (a 150 KB sample clone, or a 38 MB
default_collate output, is a fresh mmap or recycled heap depending on what ran before), so both are run,
each in its own process: ``default`` (glibc as users run it) and ``fixed`` (the mmap threshold fixed at
64 MiB in every process, as worker_ratios.py runs). The targets are judged on ``default``.

``--phases`` also times, inside the threads, what each batch's time goes to (fetching the samples, the
collate, and the part of each that waited rather than ran), against the same work on one thread; and
each part alone (the dataset's fetch; assemble and default_collate over samples made once), on 1 and on
2 plain threads, so that what does not scale with a second thread is named.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

import fastcollate
from benchmarks.shared.report_header import header_line, report_header
from fastcollate.tools.bench.malloc import samples_on_the_heap
from fastcollate.tools.bench.presets import PRESETS
from fastcollate.tools.bench.ratios import NOT_DIFFERENT, PairedRatio, paired_ratio, too_small_to_time
from fastcollate.tools.terminal import fit_to_terminal

THREADS = 2
PREFETCH = 2
LOADERS = (
    "DataLoader, main process",
    "DataLoader, 2 processes",
    "SPDL, 2 threads",
    "torchdata.nodes, 2 threads",
)
COLLATES = ("default_collate", "assemble")


def peer_versions() -> dict[str, str | None]:
    versions = {}
    for name in ("spdl-core", "torchdata"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def collate_for(name: str, preset) -> Callable:
    if name == "default_collate":
        return preset.default_collate
    return fastcollate.Assembler(preset.contract() if preset.contract else None)


class Timed:
    """Wraps a batch's fetch-and-collate with per-phase timers: wall and this thread's CPU time."""

    def __init__(self) -> None:
        self.records: list[tuple[float, float, float, float]] = []
        self.lock = threading.Lock()

    def __call__(self, dataset, collate: Callable) -> Callable:
        def stage(indices):
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            samples = [dataset[i] for i in indices]
            wall1, cpu1 = time.perf_counter(), time.thread_time()
            batch = collate(samples)
            wall2, cpu2 = time.perf_counter(), time.thread_time()
            with self.lock:
                self.records.append((wall1 - wall0, cpu1 - cpu0, wall2 - wall1, cpu2 - cpu1))
            return batch

        return stage

    def summary(self) -> dict[str, float]:
        names = ("fetch_wall_ms", "fetch_cpu_ms", "collate_wall_ms", "collate_cpu_ms")
        return {name: 1e3 * statistics.median(r[k] for r in self.records) for k, name in enumerate(names)}


class Contender:
    """One loader with one collate: ``epoch(batches)`` iterates it over those index lists once."""

    def __init__(self, loader: str, collate: str, preset, dataset, malloc_fixed: bool, timed: Timed | None):
        self.loader, self.collate_name = loader, collate
        self.collate = collate_for(collate, preset)
        self.stage = (timed or fastcollate.fetch_batches)(dataset, self.collate)
        self.executor = ThreadPoolExecutor(THREADS) if loader.startswith("SPDL") else None
        self.batches: list[list[int]] = []
        if loader.startswith("DataLoader"):
            workers = 0 if "main" in loader else 2
            self.data_loader = DataLoader(
                dataset,
                batch_sampler=_Replay(self),
                collate_fn=self.collate,
                num_workers=workers,
                persistent_workers=workers > 0,
                prefetch_factor=PREFETCH if workers else None,
                worker_init_fn=_heap_in_worker if (workers and malloc_fixed) else None,
            )

    def epoch(self, batches: list[list[int]]) -> Iterator:
        self.batches = batches
        if self.loader.startswith("DataLoader"):
            yield from self.data_loader
        elif self.loader.startswith("SPDL"):
            from spdl.pipeline import PipelineBuilder

            pipeline = (
                PipelineBuilder()
                .add_source(batches)
                .pipe(self.stage, concurrency=THREADS, executor=self.executor, output_order="input")
                .add_sink(PREFETCH)
                .build(num_threads=1, max_failures=0)
            )
            with pipeline.auto_stop():
                yield from pipeline
        else:
            from torchdata import nodes

            node = nodes.ParallelMapper(
                nodes.IterableWrapper(batches),
                map_fn=self.stage,
                num_workers=THREADS,
                method="thread",
                in_order=True,
            )
            yield from nodes.Loader(nodes.Prefetcher(node, prefetch_factor=PREFETCH))

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()
        self.data_loader = None


class _Replay:
    """A batch sampler that yields the contender's current epoch's index lists (workers get them from
    the main process's sampler, as usual)."""

    def __init__(self, contender: Contender) -> None:
        self.contender = contender

    def __iter__(self):
        return iter(self.contender.batches)

    def __len__(self) -> int:
        return len(self.contender.batches)


def _heap_in_worker(worker_id: int) -> None:
    samples_on_the_heap(worker_id)
    torch.set_num_threads(1)


def run_epoch(contender: Contender, batches: list[list[int]]) -> tuple[float, int]:
    ids: list[int] = []
    start = time.perf_counter()
    for batch in contender.epoch(batches):
        ids += batch["id"].tolist()
        del batch
    wall = time.perf_counter() - start
    expected = sorted(i for indices in batches for i in indices)
    if sorted(ids) != expected:
        raise AssertionError(
            f"{contender.loader} with {contender.collate_name}: {len(ids)} ids delivered, "
            f"not each of the {len(expected)} once"
        )
    return wall, len(ids)


def scaling(dataset, preset, batch_size: int, repeats: int = 5, per_thread: int = 12) -> dict:
    """Samples/s of each part of a batch's work alone, on 1 and 2 threads (interleaved repeats)."""
    batches = [list(range(k * batch_size, (k + 1) * batch_size)) for k in range(4)]
    made = [[dataset[i] for i in indices] for indices in batches]
    assembler = collate_for("assemble", preset)
    parts = {
        "the dataset's fetch": lambda k: [dataset[i] for i in batches[k % 4]],
        "assemble, samples made once": lambda k: assembler(made[k % 4]),
        "default_collate, samples made once": lambda k: preset.default_collate(made[k % 4]),
    }
    rates: dict[str, dict[int, list[float]]] = {name: {1: [], 2: []} for name in parts}

    def loop(part, offset: int) -> None:
        for k in range(per_thread):
            out = part(offset + k)
            del out

    for _ in range(repeats):
        for name, part in parts.items():
            for threads in (1, 2):
                pool = [threading.Thread(target=loop, args=(part, t)) for t in range(threads)]
                start = time.perf_counter()
                for thread in pool:
                    thread.start()
                for thread in pool:
                    thread.join()
                rates[name][threads].append(threads * per_thread * batch_size / (time.perf_counter() - start))
    return {name: {str(t): statistics.median(v) for t, v in by.items()} for name, by in rates.items()}


def run_preset(
    name: str,
    rounds: int,
    batches: int,
    seed: int,
    malloc_fixed: bool,
    phases: bool,
    available: dict[str, bool],
) -> dict:
    preset = PRESETS[name]
    dataset = preset.make_dataset(batches * preset.batch_size, seed)
    contenders = {}
    timers: dict[tuple[str, str], Timed] = {}
    for loader in LOADERS:
        if not available[loader]:
            continue
        for collate in COLLATES:
            timed = Timed() if phases and "thread" in loader and collate == "assemble" else None
            if timed:
                timers[(loader, collate)] = timed
            contenders[(loader, collate)] = Contender(loader, collate, preset, dataset, malloc_fixed, timed)
    if phases:  # the same work on one thread, in the main process: the baseline of the phases
        timers[("one thread", "assemble")] = Timed()
    generator = torch.Generator().manual_seed(seed)
    order = random.Random(seed)
    runs = []
    for round_index in range(rounds + 1):
        epoch = [
            list(b)
            for b in BatchSampler(
                RandomSampler(dataset, generator=generator), preset.batch_size, drop_last=True
            )
        ]
        keys = list(contenders)
        order.shuffle(keys)
        for key in keys:
            wall, samples = run_epoch(contenders[key], epoch)
            runs.append(
                {
                    "round": round_index,
                    "warmup": round_index == 0,
                    "loader": key[0],
                    "collate": key[1],
                    "seconds": wall,
                    "batches": len(epoch),
                    "samples": samples,
                    "samples_per_s": samples / wall,
                }
            )
        if phases:
            stage = timers[("one thread", "assemble")](dataset, contenders[(LOADERS[0], "assemble")].collate)
            for indices in epoch:
                stage(indices)  # the batch is dropped at once, as the loaders' consumers drop theirs
        print(f"  {name}: round {round_index}/{rounds}{' (warm-up)' if round_index == 0 else ''}", flush=True)
    for contender in contenders.values():
        contender.close()
    return {
        "preset": name,
        "description": preset.description,
        "batch_size": preset.batch_size,
        "runs": runs,
        "phases": {
            f"{loader}, {collate}": timed.summary()
            for (loader, collate), timed in timers.items()
            if timed.records
        },
        "scaling": scaling(dataset, preset, preset.batch_size) if phases else {},
    }


def summarize(result: dict, malloc: str, judge: bool) -> list[str]:
    by: dict[tuple[str, str], dict[int, float]] = {}
    for r in result["runs"]:
        if not r["warmup"]:
            by.setdefault((r["loader"], r["collate"]), {})[r["round"]] = r["samples_per_s"]
    median = {key: statistics.median(rounds.values()) for key, rounds in by.items()}
    result["medians"] = {f"{loader}, {collate}": value for (loader, collate), value in median.items()}

    # Runs recorded before their batch count was: every batch is full (drop_last).
    timed = [r["batches"] if "batches" in r else r["samples"] // result["batch_size"]
             for r in result["runs"] if not r["warmup"]]
    too_small = too_small_to_time(timed)

    def ratio(a, b) -> PairedRatio:
        # A rate that is not a positive finite number cannot be timed at all: the run is broken.
        paired = paired_ratio(by[a], by[b], too_small)
        if paired is None:
            raise ValueError(f"no round measured both {a} and {b} with a usable rate")
        return paired

    def spread(key) -> str:
        values = sorted(by[key].values())
        return f"[{values[0] / 1e3:.1f}..{values[-1] / 1e3:.1f}]"

    lines = [
        f"{result['preset']}: {result['description']}, batch {result['batch_size']}; malloc: {malloc}",
        *([fit_to_terminal(f"  {NOT_DIFFERENT} on every ratio: {too_small}")] if too_small else []),
        f"  {'samples/s, median [range]':<30}{'default_collate':>22}{'assemble':>22}"
        f"{'assemble / default':>22}",
    ]
    for loader in LOADERS:
        cells = "".join(
            f"{f'{median[(loader, c)] / 1e3:.1f}k {spread((loader, c))}':>22}"
            if (loader, c) in median
            else f"{'(not installed)':>22}"
            for c in COLLATES
        )
        gain = ""
        if (loader, "assemble") in median and (loader, "default_collate") in median:
            gain = ratio((loader, "assemble"), (loader, "default_collate")).text()
        lines.append(f"  {loader:<30}{cells}{gain:>22}")
    best = {c: max((key for key in median if key[1] == c), key=median.get) for c in COLLATES}
    lines.append(
        f"  best assemble: {best['assemble'][0]} ({median[best['assemble']] / 1e3:.1f}k); best "
        f"default_collate: {best['default_collate'][0]} ({median[best['default_collate']] / 1e3:.1f}k)"
    )
    best_ratio = ratio(best["assemble"], best["default_collate"]).text()
    lines.append(f"  best assemble / best default_collate: {best_ratio}")
    main = (LOADERS[0], "assemble")
    for loader in LOADERS[2:]:
        if (loader, "assemble") in median:
            over_main = ratio((loader, "assemble"), main).text()
            lines.append(f"  {loader}, assemble / main process, assemble: {over_main}")
    for name, p in result["phases"].items():
        lines.append(
            f"  per batch in {name}: fetch {p['fetch_wall_ms']:.2f} ms (ran {p['fetch_cpu_ms']:.2f}), "
            f"collate {p['collate_wall_ms']:.2f} ms (ran {p['collate_cpu_ms']:.2f})"
        )
    for part, rates in result.get("scaling", {}).items():
        lines.append(
            f"  alone: {part}: {rates['1'] / 1e3:.1f}k samples/s on 1 thread, {rates['2'] / 1e3:.1f}k on 2 "
            f"({rates['2'] / rates['1']:.2f}x)"
        )
    if judge:
        lines += judge_targets(result["preset"], median, ratio)
    return lines


def judge_targets(preset: str, median: dict, ratio) -> list[str]:
    if preset != "predecoded":
        return [f"  (no target on {preset})"]
    lines = []

    def verdict(label: str, value: float, target: float) -> None:
        lines.append(
            f"  target: {label} {value:.2f}x >= {target}x: {'met' if value >= target else 'NOT MET'}"
        )

    for loader in LOADERS[2:]:
        if (loader, "assemble") in median:
            verdict(
                f"{loader}: assemble / its default_collate",
                ratio((loader, "assemble"), (loader, "default_collate")).median,
                2.0,
            )
            verdict(
                f"{loader}: assemble / main process (threads add)",
                ratio((loader, "assemble"), (LOADERS[0], "assemble")).median,
                1.3,
            )
    best_a = max((k for k in median if k[1] == "assemble"), key=median.get)
    best_d = max((k for k in median if k[1] == "default_collate"), key=median.get)
    verdict("best assemble / best default_collate", ratio(best_a, best_d).median, 3.0)
    return lines


def run_setting(args, malloc: str) -> dict:
    """One malloc setting, in this process."""
    torch.set_num_threads(1)
    if malloc == "fixed":
        samples_on_the_heap()
    versions = peer_versions()
    available = {
        LOADERS[0]: True,
        LOADERS[1]: True,
        LOADERS[2]: versions["spdl-core"] is not None,
        LOADERS[3]: versions["torchdata"] is not None,
    }
    report = {"malloc": malloc, "results": []}
    for name in args.presets:
        report["results"].append(
            run_preset(name, args.rounds, args.batches, args.seed, malloc == "fixed", args.phases, available)
        )
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--presets",
        nargs="+",
        default=["predecoded", "fashion", "fields"],
        choices=["predecoded", "fashion", "fields", "imagenet"],
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, default=15, help="batches per epoch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--malloc", choices=["both", "default", "fixed"], default="both")
    parser.add_argument(
        "--phases", action="store_true", help="time each batch's fetch and collate in the threads"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-targets", action="store_true")
    parser.add_argument(
        "--setting-out", type=Path, help=argparse.SUPPRESS
    )  # a child's report (--malloc both)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1 (the warm-up round is extra)")
    if args.setting_out:  # a child run of --malloc both: one setting, its report to a file
        args.setting_out.write_text(json.dumps(run_setting(args, args.malloc)))
        return 0
    versions = peer_versions()
    # Each setting runs in a child process of its own: this one's malloc is neither.
    header = report_header(malloc="each setting's own (settings[].malloc)")
    print(header_line(header))
    print(", ".join(f"{k} {v or 'not installed (skipped)'}" for k, v in versions.items()))
    print(
        textwrap.fill(
            f"{THREADS} threads or processes, prefetch depth {PREFETCH}, one torch thread each; "
            f"{args.rounds} rounds of {args.batches} batches after one warm-up, interleaved; ratios: "
            "median (min-max) of the per-round ratios, ~ where the runs overlap; "
            "malloc 'default' is glibc's own, 'fixed' its mmap threshold at 64 MiB",
            100,
        )
    )
    settings = ["default", "fixed"] if args.malloc == "both" else [args.malloc]
    report = {
        **header,
        "peers": versions,
        "threads": THREADS,
        "prefetch": PREFETCH,
        "settings": [],
    }
    lines = []
    for malloc in settings:
        print(f"malloc {malloc}:", flush=True)
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "setting.json"
            child = [
                sys.executable,
                "-m",
                "benchmarks.peer_ratios",
                "--malloc",
                malloc,
                "--setting-out",
                str(out),
                "--rounds",
                str(args.rounds),
                "--batches",
                str(args.batches),
                "--seed",
                str(args.seed),
                "--presets",
                *args.presets,
            ] + (["--phases"] if args.phases else [])
            subprocess.run(child, check=True, env=os.environ, cwd=Path(__file__).resolve().parents[1])
            setting = json.loads(out.read_text())
        for result in setting["results"]:
            lines += summarize(result, malloc, judge=not args.no_targets and malloc == "default")
        report["settings"].append(setting)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
