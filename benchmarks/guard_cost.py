"""What the SIGBUS guard costs a gather: ``ops.gather_into`` (its copy runs inside the guard) against
``torch.index_select`` into a reused buffer (the same rows, no guard), side by side in one run.

    python -m benchmarks.guard_cost [--rounds 15] [--json PATH]

Method: one torch thread; for each batch shape, rounds of N calls of each op, interleaved; reported per
call, the median over rounds, and the ratio gather_into / index_select. The smallest batch shows the fixed
cost per op, the largest a copy of 1 MiB. glibc malloc as it is (the outputs are reused buffers: no
allocation is timed). Run it from two checkouts with benchmarks/before_after.py to see the guard's cost.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import fastcollate  # noqa: F401  (registers the ops)

SHAPES = ((8, 64), (256, 65), (4096, 64))  # rows x float32 columns a batch


def per_call_ns(op, calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        op()
    return (time.perf_counter_ns() - start) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    results = []
    for rows, width in SHAPES:
        source = torch.randn(100_000, width, generator=generator)
        indices = torch.randint(0, 100_000, (rows,), generator=generator)
        gathered, selected = torch.empty(rows, width), torch.empty(rows, width)
        contenders = {
            "gather_into": functools.partial(torch.ops.fastcollate.gather_into, source, indices, gathered),
            "index_select": functools.partial(torch.index_select, source, 0, indices, out=selected),
        }
        calls = 2000 if rows < 1000 else 200
        for op in contenders.values():
            per_call_ns(op, calls // 10)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.rounds):
            for name, op in contenders.items():
                times[name].append(per_call_ns(op, calls))
        assert torch.equal(gathered, selected), "the two ops gathered different rows"
        median = {name: statistics.median(values) for name, values in times.items()}
        results.append({"rows": rows, "width": width, "median_ns": median, "per_round_ns": times,
                        "ratio": median["gather_into"] / median["index_select"]})
        print(f"{rows:>5} x {width} float32: gather_into {median['gather_into'] / 1000:8.2f} us, "
              f"index_select {median['index_select'] / 1000:8.2f} us, ratio {results[-1]['ratio']:.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"benchmark": "guard_cost", "command": " ".join(sys.argv),
                  "python": platform.python_version(), "torch": torch.__version__, "results": results}
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
