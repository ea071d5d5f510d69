"""The collate alone, on the tables Ray hands an ArrowBatchCollateFn (no Ray running): fastcollate.ray's
ArrowCollate against the expression it equals (assemble over Arrays.from_arrow of each table) and a lean
hand-written collate (columns to numpy, one torch.stack), the best a user writes by hand.

    python benchmarks/ray_collate.py [--rounds 9] [--batches 20] [--threads 1] [--json PATH]

Tables: 100 float32 columns and an int64 label, 4096 rows, as a zero-copy slice at row 1000 of an
8192-row table ("sliced") and as two chunks of 3000 and 1096 rows ("two_chunks"). Method: every contender
makes its batch of each table once, checked (ArrowCollate equal to the expression), untimed; then rounds,
each running every contender over --batches batches in a freshly shuffled order (seeded), each batch
dropped at once. A contender's figure is the median over rounds of its median ms a batch; a ratio is the
median of the per-round paired ratios, their min-max beside (fastcollate.tools.bench.ratios).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time

import numpy as np
import pyarrow as pa
import torch

from fastcollate.ray import ArrowCollate
from fastcollate.tools.bench.ratios import paired_ratio

COLUMNS = 100
ROWS = 4096


def tables() -> dict[str, pa.Table]:
    rng = np.random.default_rng(0)
    data = {f"f{i}": pa.array(rng.standard_normal(2 * ROWS, dtype=np.float32)) for i in range(COLUMNS)}
    data["label"] = pa.array(rng.integers(0, 10, 2 * ROWS))
    whole = pa.table(data)
    return {
        "sliced": whole.slice(1000, ROWS),
        "two_chunks": pa.concat_tables([whole.slice(0, 3000), whole.slice(5000, ROWS - 3000)]),
    }


def lean(table: pa.Table) -> dict[str, torch.Tensor]:
    features = [table.column(f"f{i}").to_numpy() for i in range(COLUMNS)]
    x = torch.stack([torch.from_numpy(np.ascontiguousarray(f)) for f in features], 1)
    return {"x": x, "label": torch.from_numpy(table.column("label").to_numpy())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    collate = ArrowCollate()
    contenders = {"arrow_collate": collate, "expression": collate.expression, "lean": lean}
    results: dict = {"threads": args.threads, "rounds": args.rounds, "batches": args.batches, "cases": {}}
    shuffle = random.Random(0)
    for case, table in tables().items():
        got, want = collate(table), collate.expression(table)
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want), case
        lean(table)
        per_round: dict[str, dict[int, float]] = {name: {} for name in contenders}
        for round_number in range(args.rounds):
            order = list(contenders)
            shuffle.shuffle(order)
            for name in order:
                times = []
                for _ in range(args.batches):
                    start = time.perf_counter()
                    contenders[name](table)
                    times.append(time.perf_counter() - start)
                per_round[name][round_number] = statistics.median(times) * 1e3
        medians = {name: statistics.median(ms.values()) for name, ms in per_round.items()}
        rates = {name: {r: 1 / ms for r, ms in by_round.items()} for name, by_round in per_round.items()}
        ratios = {
            f"arrow_collate/{other}": dataclasses.asdict(paired_ratio(rates["arrow_collate"], rates[other]))
            for other in ("expression", "lean")
        }
        results["cases"][case] = {"median_ms": medians, "speedup": ratios, "per_round_ms": per_round}
        shown = ", ".join(f"{name} {ms:.3f} ms" for name, ms in medians.items())
        speedups = ", ".join(
            f"{k} {v['median']:.2f}x ({v['low']:.2f}-{v['high']:.2f})" for k, v in ratios.items()
        )
        print(f"{case}: {shown}; {speedups}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
