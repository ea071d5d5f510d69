"""The staging ring's lock under threads: batches/s of T threads collating through one shared ring,
against a ring per thread (no lock shared), side by side in one run, at T = 1, 2 and 4.

    python -m benchmarks.ring_contention [--threads 1 2 4] [--rounds 7] [--batches 400] [--json PATH]

Two batch shapes: ``small`` (256 samples of 19 small fields, the batch where per-batch costs weigh most
against the bytes) and ``slot-only`` (``ring.acquire`` and drop in a loop, nothing else: the lock alone,
the GIL released while it is taken). The samples are made once and reused, so the figures are the
collate's and the ring's, not a dataset's. One torch thread. Rounds interleave the two rings; medians of
the per-round ratios, spread p25-p75.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

import fastcollate
from benchmarks.shared.report_header import header_line, report_header
from benchmarks.shared.rounds import quartiles
from fastcollate import StagingRing
from fastcollate.tools.bench.presets import PRESETS


def timed_threads(threads: int, work) -> float:
    """Seconds for ``threads`` threads each running ``work(k)`` once, from a common start."""
    start = threading.Barrier(threads + 1)
    done = []

    def run(k: int) -> None:
        start.wait()
        work(k)
        done.append(time.perf_counter())

    pool = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for thread in pool:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in pool:
        thread.join()
    return max(done) - began


def measure(shape: str, threads: int, shared: bool, batches: int, samples: list) -> float:
    """Batches per second, all threads together."""
    rings = (
        [StagingRing(max_slots=8)] * threads if shared else [StagingRing(max_slots=8) for _ in range(threads)]
    )
    collates = [fastcollate.assemble.using(ring=ring) for ring in rings]
    if shape == "slot-only":

        def work(k: int) -> None:
            ring = rings[k]
            for _ in range(batches):
                buffer = ring.acquire(4096)
                del buffer
    else:

        def work(k: int) -> None:
            collate = collates[k]
            for _ in range(batches):
                batch = collate(samples)
                del batch

    work(0)  # warm: the slots exist, the layout is compiled
    return threads * batches / timed_threads(threads, work)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, default=400, help="batches per thread per run")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    header = report_header()
    print(header_line(header))
    dataset = PRESETS["fields"].make_dataset(256, 0)
    samples = [dataset[i] for i in range(256)]
    runs = []
    order = random.Random(0)
    for round_index in range(args.rounds):
        cells = [
            (shape, t, shared)
            for shape in ("small", "slot-only")
            for t in args.threads
            for shared in (True, False)
        ]
        order.shuffle(cells)
        for shape, t, shared in cells:
            batches = args.batches * (20 if shape == "slot-only" else 1)
            runs.append(
                {
                    "round": round_index,
                    "shape": shape,
                    "threads": t,
                    "ring": "shared" if shared else "per thread",
                    "batches_per_s": measure(shape, t, shared, batches, samples),
                }
            )
    print(f"one torch thread; {args.rounds} interleaved rounds; batches/s, all threads together (median)")
    print(
        f"  {'shape':<10}{'threads':>8}{'shared ring':>14}{'ring per thread':>17}{'shared / per thread':>24}"
    )
    summary = []
    for shape in ("small", "slot-only"):
        for t in args.threads:
            cell = {
                ring: [
                    r["batches_per_s"]
                    for r in runs
                    if (r["shape"], r["threads"], r["ring"]) == (shape, t, ring)
                ]
                for ring in ("shared", "per thread")
            }
            ratios = [a / b for a, b in zip(cell["shared"], cell["per thread"], strict=True)]
            low, high = quartiles(ratios)
            medians = {ring: statistics.median(values) for ring, values in cell.items()}
            summary.append(
                {
                    "shape": shape,
                    "threads": t,
                    **medians,
                    "ratio": statistics.median(ratios),
                    "p25": low,
                    "p75": high,
                }
            )
            print(
                f"  {shape:<10}{t:>8}{medians['shared']:>14,.0f}{medians['per thread']:>17,.0f}"
                f"{f'{statistics.median(ratios):.2f}x ({low:.2f}-{high:.2f})':>24}"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {**header, "runs": runs, "summary": summary},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
