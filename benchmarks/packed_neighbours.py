"""What the contender before a call does to it: the packed case's assemble, torch.cat + arange and the
copy floor, timed in rounds (collate_timing.time_case) beside one neighbour at a time.

    python -m benchmarks.packed_neighbours [--rounds 40] [--threads 1] [--json PATH]

collate_ratios runs DataCollatorWithFlattening (about 85 ms of Python a call) in the same rounds, and
every other contender's time moves with it. The neighbours here tell why: 84 ms of sleep, 84 ms of a busy
Python loop, a 64 MiB fill (the caches' data evicted), and the collator itself. Medians in ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.shared import collate_cases as cases
from benchmarks.shared import collate_contenders as contenders
from benchmarks.shared.collate_timing import machine, time_case

NEIGHBOUR_SECONDS = 0.084  # about one DataCollatorWithFlattening call on the packed batch


def sleep(batch: object) -> None:
    time.sleep(NEIGHBOUR_SECONDS)


def busy(batch: object) -> None:
    end = time.perf_counter() + NEIGHBOUR_SECONDS
    while time.perf_counter() < end:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    case = cases.build_case("packed")
    everyone = dict(case.contenders)
    timed = ["assemble+contract", contenders.PACKED_CAT, cases.FLOOR]
    sweep_buffer = torch.empty(64 << 20, dtype=torch.uint8)
    neighbours = {"none": None, "sleep 84 ms": sleep, "busy 84 ms": busy,
                  "fill 64 MiB": lambda batch: sweep_buffer.fill_(1)}
    if contenders.PACKED_REFERENCE in everyone:
        neighbours[contenders.PACKED_REFERENCE] = everyone[contenders.PACKED_REFERENCE]
    info = machine()
    malloc = info["malloc"] or "glibc defaults"
    print(f"threads={args.threads}, {args.rounds} rounds; medians in ms; malloc: {malloc}")
    header = "".join(f"{name[:18]:>20s}" for name in timed)
    print(f"  {'neighbour':28s}{header}   assemble/floor  cat/assemble")
    results = {}
    for label, neighbour in neighbours.items():
        case.contenders = {name: everyone[name] for name in timed}
        if neighbour is not None:
            case.contenders[label] = neighbour
        times = time_case(case, args.rounds, warmup=5)
        med = {name: statistics.median(times[name]) * 1e3 for name in timed}
        results[label] = {"raw_seconds": times, "median_ms": med}
        print(f"  {label:28s}" + "".join(f"{med[name]:20.3f}" for name in timed)
              + f"   {med['assemble+contract'] / med[cases.FLOOR]:14.2f}"
              + f"  {med[contenders.PACKED_CAT] / med['assemble+contract']:12.2f}")
    if args.json:
        with open(args.json, "w") as f:
            record = {"machine": info, "threads": args.threads, "rounds": args.rounds, "results": results}
            json.dump(record, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
