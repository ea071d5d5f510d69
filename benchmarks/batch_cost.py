"""What one Arrays batch costs, ``assemble(arrays.__getitems__(indices))``, in two checkouts: each round
starts one child process per checkout, each importing its own fastcollate, and sends both every case in
turn (before, after; the next round after, before), so that the machine's drift hits both alike.

    python -m benchmarks.batch_cost --before /path/to/old/checkout [--after .] [--rounds 11]
                                    [--iterations 20000] [--json PATH]

Each checkout needs its extension built in place (``make build`` there, or a copied ``fastcollate/_C*.so``
for a change that touched no C++). Cases: 64 float32 columns, and 3 columns (64 uint8, 16 float32, one
int64), over 20,000 rows, at batch 256; with and without the index as an id; indices as a sampler's list
and as an int64 array (IndexBatches'). Reported per case: the median over rounds of each checkout's
thread CPU time per batch (on a shared machine, other processes stall the wall clock, not the thread's
CPU time), and the median of the rounds' after / before, wall time's beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.shared.report_header import header_line, report_header

# Run inside each checkout: it reads a case per line and answers its times per batch, in microseconds.
CHILD = r"""
import inspect, json, sys, time
import numpy as np, torch
import fastcollate
from fastcollate import Arrays
from fastcollate.tools.bench.malloc import malloc_settings

torch.set_num_threads(1)
rows, batch = 20_000, 256
generator = np.random.default_rng(0)
cases = {
    "64 float columns": {
        f"f{i}": torch.from_numpy(generator.random(rows, dtype=np.float32)) for i in range(64)
    },
    "3 columns": {
        "pixels": torch.from_numpy(generator.integers(0, 255, (rows, 64), dtype=np.uint8)),
        "features": torch.from_numpy(generator.random((rows, 16), dtype=np.float32)),
        "label": torch.from_numpy(generator.integers(0, 10, rows)),
    },
}
# A checkout before index_as names the index id_key, and adds it by default.
index_key = "index_as" if "index_as" in inspect.signature(Arrays.__init__).parameters else "id_key"
datasets = {
    (name, ids): Arrays(columns, **{index_key: "id" if ids else None})
    for name, columns in cases.items() for ids in (False, True)
}
arrays_of_indices = [generator.integers(0, rows, batch) for _ in range(4096)]
lists_of_indices = [indices.tolist() for indices in arrays_of_indices]
print(json.dumps({"malloc": malloc_settings(), "fastcollate": fastcollate.__file__}), flush=True)
for line in sys.stdin:
    name, ids, kind, iterations = json.loads(line)
    arrays = datasets[(name, ids)]
    indices = lists_of_indices if kind == "list" else arrays_of_indices
    for k in range(200):
        fastcollate.assemble(arrays.__getitems__(indices[k]))
    wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
    for k in range(iterations):
        fastcollate.assemble(arrays.__getitems__(indices[k & 4095]))
    cpu, wall = time.thread_time_ns() - cpu, time.perf_counter_ns() - wall
    print(json.dumps([cpu / iterations / 1000, wall / iterations / 1000]), flush=True)
"""

CASES = [(name, ids, kind) for name in ("64 float columns", "3 columns") for ids in (False, True)
         for kind in ("list", "int64 array")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the checkout to compare against")
    parser.add_argument("--after", default=".", help="the checkout measured (default: this one)")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--iterations", type=int, default=20_000, help="batches a round")
    parser.add_argument("--json", type=Path, help="write every round's times here")
    args = parser.parse_args()
    checkouts = {"before": args.before, "after": args.after}
    times: dict[tuple, dict[str, list]] = {case: {"before": [], "after": []} for case in CASES}
    started: dict[str, dict] = {}
    for round_number in range(args.rounds):
        # Fresh processes each round: where a process's heap put 64 columns moves a gather of them by
        # several percent, as one round's luck rather than the whole run's.
        children = {label: _child(path) for label, path in checkouts.items()}
        started = {label: json.loads(child.stdout.readline()) for label, child in children.items()}
        order = ("before", "after") if round_number % 2 == 0 else ("after", "before")
        for case in CASES:
            for label in order:
                children[label].stdin.write(json.dumps([*case, args.iterations]) + "\n")
                children[label].stdin.flush()
                times[case][label].append(json.loads(children[label].stdout.readline()))
        for child in children.values():
            child.stdin.close()
            child.wait()
        print(f"round {round_number + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    header = report_header("; ".join(sorted({start["malloc"] for start in started.values()})))
    print(header_line(header))
    for label, start in started.items():
        print(f"{label}: {start['fastcollate']}")
    print(f"{args.rounds} rounds of {args.iterations} batches, each round in fresh processes; thread CPU "
          "time per batch (wall time beside)")
    results = []
    for case in CASES:
        result = _summary(case, times[case])
        results.append(result)
        print(f"{case[0]:17} ids={str(case[1]):5} indices={case[2]:11}  before {result['before_us']:7.2f} us"
              f"  after {result['after_us']:7.2f} us  after/before {result['after_over_before']:.3f}"
              f"  (wall {result['wall_after_over_before']:.3f})")
    if args.json is not None:
        report = {**header, "checkouts": {"before": args.before, "after": args.after}, "results": results}
        args.json.write_text(json.dumps(report, indent=1))


def _child(checkout: str) -> subprocess.Popen:
    """A process importing ``checkout``'s fastcollate (its folder first on the path), waiting for cases."""
    folder = str(Path(checkout).resolve())
    environment = {**os.environ, "PYTHONPATH": folder}
    return subprocess.Popen([sys.executable, "-c", CHILD], cwd=folder, env=environment,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _summary(case: tuple, times: dict[str, list[list[float]]]) -> dict:
    cpu = {label: [t[0] for t in runs] for label, runs in times.items()}
    wall = {label: [t[1] for t in runs] for label, runs in times.items()}
    name, ids, kind = case
    return {
        "case": name, "ids": ids, "indices": kind,
        "before_us": statistics.median(cpu["before"]), "after_us": statistics.median(cpu["after"]),
        "after_over_before": _paired(cpu), "wall_after_over_before": _paired(wall),
        "rounds": {"thread_cpu_us": cpu, "wall_us": wall},
    }


def _paired(times: dict[str, list[float]]) -> float:
    """The median over rounds of after / before, each round's pair run one right after the other."""
    return statistics.median([a / b for a, b in zip(times["after"], times["before"], strict=True)])


if __name__ == "__main__":
    main()
