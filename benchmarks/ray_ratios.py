"""Ray Data's last hop, side by side in one run: a batch of rows through ``iter_torch_batches`` with Ray's
default collate, a lean hand-written ``ArrowBatchCollateFn``, a collate that does nothing (Ray's own
per-batch cost, the ceiling), ``assemble(Arrays.from_arrow(table)...)`` and, where this build has it,
``fastcollate.ray.ArrowCollate``; each collate also alone, on the tables Ray hands it.

    python -m benchmarks.ray_ratios [--cases tabular packed tensor] [--rows 65536] [--batch-size 4096]
                                    [--tensor-rows 1048576] [--tensor-batch-sizes 256 4096] [--rounds 7]
                                    [--malloc fixed|default] [--json PATH]

Method. One local Ray (2 CPUs, no dashboard) holds the materialized datasets: tabular, 100 float32
columns and an int64 label; packed, token lists; tensor, ``--tensor-rows`` rows of one column of Ray's
fixed-shape tensors (100 float32 values a row, what ``ray.data.from_numpy`` makes) and an int64 label,
at each of ``--tensor-batch-sizes``. A round runs one pass of ``--batches`` batches (the tensor case:
every row) for every contender, in a freshly shuffled order (seeded); the first round is a warm-up (kept
in the JSON, left out of the medians). Rows/s is wall clock from ``iter_torch_batches`` to the last
batch. The collate-alone figures time each collate on the same tables Ray handed out (captured once:
zero-copy slices of its blocks). A ratio is the median of the per-round ratios, min-max beside, ``~``
unless it clears the noise (``fastcollate.tools.bench.ratios``). One torch thread. glibc's mmap threshold
fixed at 64 MiB in the main process, where Ray calls the collate (``--malloc fixed``, as array_ratios.py
and hf_ratios.py run: a fresh batch-sized buffer is then reused heap memory, not a fresh mapping), or
left as glibc sets it (``--malloc default``): the header and the JSON say which ran.

In the tensor case Ray's default is the collate ``iter_torch_batches`` makes when given none on the CPU
(``DefaultCollateFn(combine_chunks=True)``), passed in so that it also runs alone; and through Ray every
contender's time inside its collate call is kept beside each batch's, so that Ray's own cost a batch
(outside the collate) shows: a collate that does nothing bounds what any collate can gain.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import fastcollate
from benchmarks.shared.report_header import header_line, report_header
from fastcollate.tools.bench.malloc import samples_on_the_heap
from fastcollate.tools.bench.ratios import paired_ratio

FEATURES = 100
CASES = ("tabular", "packed", "tensor")


def _collates() -> dict[str, Callable | None]:
    """Each contender's collate (None: Ray's default), as an ``ArrowBatchCollateFn`` where Ray needs one."""
    from ray.data.collate_fn import ArrowBatchCollateFn

    class Lean(ArrowBatchCollateFn):
        """What a user writes by hand: columns to numpy to torch, one ``torch.stack``."""

        def __call__(self, table):
            names = [name for name in table.column_names if name != "label"]
            x = torch.stack([torch.from_numpy(table.column(n).to_numpy()) for n in names], 1)
            return {"x": x, "label": torch.from_numpy(table.column("label").to_numpy())}

    class Nothing(ArrowBatchCollateFn):
        """Ray's own cost a batch: the collate returns one preallocated tensor."""

        def __init__(self):
            super().__init__()
            self.label = torch.zeros(1, dtype=torch.int64)

        def __call__(self, table):
            return {"label": self.label}

    class Expression(ArrowBatchCollateFn):
        """``assemble(Arrays.from_arrow(table).__getitems__(...))``: an Arrays built per batch."""

        def __call__(self, table):
            arrays = fastcollate.Arrays.from_arrow(table)
            return fastcollate.assemble(arrays.__getitems__(list(range(table.num_rows))))

    contenders: dict[str, Callable | None] = {
        "ray default": None,
        "lean": Lean(),
        "nothing": Nothing(),
        "expression": Expression(),
    }
    try:
        from fastcollate.ray import ArrowCollate
    except ImportError:
        pass
    else:
        contenders["ArrowCollate"] = ArrowCollate()
    return contenders


def packed_contract():
    """DataCollatorWithFlattening's batch: input_ids packed (the table's int32 widened to its int64),
    labels copied from them with -100 at each sequence's first token, position_ids and cu_seq_lens."""
    from fastcollate import Contract, Field, Packing

    tokens = dict(dtype=torch.int64, shape=("T",), pack=True, cast_from=(torch.int32,))
    return Contract(
        {"input_ids": Field(**tokens), "labels": Field(**tokens, copy_of="input_ids", separator=-100)},
        packing=Packing(),
    )


def _packed_dataset(rows: int, seed: int):
    import pyarrow as pa
    import ray

    rng = np.random.default_rng(seed)
    tokens = [rng.integers(1, 32000, int(length), dtype=np.int32) for length in rng.integers(16, 513, rows)]
    return ray.data.from_arrow(
        pa.table({"input_ids": pa.array(tokens, type=pa.list_(pa.int32()))})
    ).materialize()


def _collator_batches(dataset, batch_size: int, batches: int) -> int:
    """The collator path: Ray's tables as rows of token lists, then DataCollatorWithFlattening."""
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    tokens = 0
    for count, table in enumerate(dataset.iter_batches(batch_size=batch_size, batch_format="pyarrow"), 1):
        batch = collator([{"input_ids": ids} for ids in table.column("input_ids").to_pylist()])
        tokens += batch["input_ids"].shape[1]
        if count == batches:
            break
    return tokens


def _packed_through_ray(dataset, collate, batch_size: int, batches: int, pass_tokens: int) -> float:
    """Tokens/s of ``batches`` batches; a collate that packs nothing is credited a pass's ``pass_tokens``."""
    start = time.perf_counter()
    if collate is None:
        tokens = _collator_batches(dataset, batch_size, batches)
    else:
        tokens = 0
        for count, batch in enumerate(
            dataset.iter_torch_batches(batch_size=batch_size, collate_fn=collate), 1
        ):
            tokens += batch["input_ids"].shape[1] if "input_ids" in batch else 0
            if count == batches:
                break
        tokens = tokens or pass_tokens
    return tokens / (time.perf_counter() - start)


def _packed_alone(collate, tables: list) -> float:
    """Tokens/s of a collate on Ray's tables; None: the collator, from the table's rows."""
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    start = time.perf_counter()
    tokens = 0
    for table in tables:
        if collate is None:
            batch = collator([{"input_ids": ids} for ids in table.column("input_ids").to_pylist()])
        else:
            batch = collate(table)
        tokens += batch["input_ids"].shape[1]
    return tokens / (time.perf_counter() - start)


def _tensor_dataset(rows: int, seed: int):
    import pyarrow as pa
    import ray
    from ray.data.extensions import ArrowTensorArray

    rng = np.random.default_rng(seed)
    rows_of_values = rng.standard_normal((rows, FEATURES), dtype=np.float32)
    table = pa.table({"x": ArrowTensorArray.from_numpy(rows_of_values), "label": rng.integers(0, 10, rows)})
    return ray.data.from_arrow(table).materialize()


def _tensor_collates(nothing: Callable) -> dict[str, Callable]:
    """The tensor case's contenders, each timed inside its calls."""
    from ray.data.collate_fn import ArrowBatchCollateFn, DefaultCollateFn

    class Timed(ArrowBatchCollateFn):
        """``collate``, with the seconds spent inside its calls added up."""

        def __init__(self, collate):
            super().__init__()
            self.collate = collate
            self.inside = 0.0
            self.rows = 0

        def __call__(self, table):
            start = time.perf_counter()
            batch = self.collate(table)
            self.inside += time.perf_counter() - start
            self.rows += table.num_rows
            return batch

    contenders = {"ray default": Timed(DefaultCollateFn(combine_chunks=True)), "nothing": Timed(nothing)}
    try:
        from fastcollate.ray import ArrowCollate
    except ImportError:
        pass
    else:
        contenders["ArrowCollate"] = Timed(ArrowCollate())
    return contenders


def _timed_through_ray(dataset, timed, batch_size: int) -> tuple[float, float, float]:
    """Rows/s of one pass through ``iter_torch_batches``; its seconds a batch, and inside the collate."""
    timed.inside, timed.rows = 0.0, 0
    start = time.perf_counter()
    batches = sum(1 for _ in dataset.iter_torch_batches(batch_size=batch_size, collate_fn=timed))
    elapsed = time.perf_counter() - start
    return timed.rows / elapsed, elapsed / batches, timed.inside / batches


def _dataset(rows: int, seed: int):
    import pyarrow as pa
    import ray

    rng = np.random.default_rng(seed)
    columns = {f"f{i}": rng.standard_normal(rows, dtype=np.float32) for i in range(FEATURES)}
    columns["label"] = rng.integers(0, 10, rows)
    return ray.data.from_arrow(pa.table(columns)).materialize()


def _through_ray(dataset, collate, batch_size: int, batches: int) -> float:
    """Rows/s of ``batches`` batches through ``iter_torch_batches``."""
    options = {} if collate is None else {"collate_fn": collate}
    rows = 0
    start = time.perf_counter()
    for count, _batch in enumerate(dataset.iter_torch_batches(batch_size=batch_size, **options), 1):
        rows += batch_size
        if count == batches:
            break
    return rows / (time.perf_counter() - start)


def _tables(dataset, batch_size: int, batches: int) -> list:
    """The tables Ray hands a collate, captured once."""
    return [
        t
        for _, t in zip(
            range(batches), dataset.iter_batches(batch_size=batch_size, batch_format="pyarrow"), strict=False
        )
    ]


def _alone(collate, tables: list) -> float:
    start = time.perf_counter()
    for table in tables:
        collate(table)
    return sum(t.num_rows for t in tables) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--batches", type=int, default=None, help="batches a pass (default: all rows)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--packed-rows", type=int, default=2048, help="token rows of the packed data set")
    parser.add_argument("--packed-batch", type=int, default=16, help="sequences a packed batch")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--tensor-batch-sizes", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--tensor-rows", type=int, default=1 << 20, help="rows of the tensor data set")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--malloc", choices=("fixed", "default"), default="fixed",
                        help="glibc's mmap threshold fixed at 64 MiB in this process, or glibc's defaults")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    import pyarrow.compute as pc
    import ray

    torch.set_num_threads(1)
    if args.malloc == "fixed":
        samples_on_the_heap()
    batches = args.batches or args.rows // args.batch_size
    header = report_header()
    print(header_line(header))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        contenders = _collates()
        cells = []
        if "tabular" in args.cases:
            dataset = _dataset(args.rows, args.seed)
            tables = _tables(dataset, args.batch_size, batches)
            cells += [
                ("tabular", name, where)
                for name in contenders
                for where in ("ray", "alone")
                if not (where == "alone" and contenders[name] is None)
            ]
        if "packed" in args.cases:
            packed = _packed_dataset(args.packed_rows, args.seed)
            packed_batches = args.packed_rows // args.packed_batch
            packed_tables = _tables(packed, args.packed_batch, packed_batches)
            pass_tokens = sum(
                pc.sum(pc.list_value_length(t.column("input_ids"))).as_py() for t in packed_tables
            )
            packed_contenders: dict[str, Callable | None] = {
                "collator": None,
                "nothing": contenders["nothing"],
            }
            if "ArrowCollate" in contenders:
                from fastcollate.ray import ArrowCollate

                packed_contenders["ArrowCollate"] = ArrowCollate(packed_contract())
            cells += [
                ("packed", name, where)
                for name in packed_contenders
                for where in ("ray", "alone")
                if not (where == "alone" and name == "nothing")
            ]
        tensor_cases = {f"tensor {size}": size for size in args.tensor_batch_sizes if "tensor" in args.cases}
        if tensor_cases:
            tensor = _tensor_dataset(args.tensor_rows, args.seed)
            tensor_contenders = _tensor_collates(contenders["nothing"])
            tensor_tables = {
                case: _tables(tensor, size, args.tensor_rows // size) for case, size in tensor_cases.items()
            }
            cells += [
                (case, name, where)
                for case in tensor_cases
                for name in tensor_contenders
                for where in ("ray", "alone")
                if not (where == "alone" and name == "nothing")
            ]
        runs: list[dict] = []
        order = random.Random(args.seed)
        for round_number in range(args.rounds + 1):
            order.shuffle(cells)
            for case, name, where in cells:
                per_batch = {}
                if case == "tabular":
                    collate = contenders[name]
                    rate = (
                        _through_ray(dataset, collate, args.batch_size, batches)
                        if where == "ray"
                        else _alone(collate, tables)
                    )
                elif case in tensor_cases:
                    collate = tensor_contenders[name]
                    if where == "ray":
                        rate, batch_s, inside_s = _timed_through_ray(tensor, collate, tensor_cases[case])
                        per_batch = {"batch_s": batch_s, "inside_s": inside_s}
                    else:
                        rate = _alone(collate, tensor_tables[case])
                else:
                    collate = packed_contenders[name]
                    rate = (
                        _packed_through_ray(packed, collate, args.packed_batch, packed_batches, pass_tokens)
                        if where == "ray"
                        else _packed_alone(collate, packed_tables)
                    )
                runs.append(
                    {
                        "round": round_number, "case": case, "contender": name, "where": where,
                        "per_s": rate, **per_batch,
                    }
                )
    finally:
        ray.shutdown()
    timed = [r for r in runs if r["round"] > 0]  # round 0: the warm-up
    report = {
        **header,
        "cases": args.cases,
        "rows": args.rows,
        "batch_size": args.batch_size,
        "tensor_rows": args.tensor_rows,
        "tensor_batch_sizes": list(tensor_cases.values()),
        "batches": batches,
        "packed_rows": args.packed_rows,
        "packed_batch": args.packed_batch,
        "runs": runs,
        "medians": {},
        "ratios": {},
    }
    comparisons = [
        ("tabular", "ray", "ray default", "rows"),
        ("tabular", "ray", "lean", "rows"),
        ("tabular", "alone", "lean", "rows"),
        ("packed", "ray", "collator", "tokens"),
        ("packed", "alone", "collator", "tokens"),
    ]
    comparisons = [c for c in comparisons if c[0] in args.cases]
    for case in tensor_cases:
        comparisons += [(case, "ray", "ray default", "rows"), (case, "alone", "ray default", "rows")]
    for case, where, against, unit in comparisons:

        def rates(name, case=case, where=where):
            return {
                r["round"]: r["per_s"]
                for r in timed
                if (r["case"], r["where"], r["contender"]) == (case, where, name)
            }

        base = rates(against)
        print(f"{case}, {'through Ray' if where == 'ray' else 'the collate alone'}, against {against}:")
        for name in sorted({r["contender"] for r in timed if r["case"] == case and r["where"] == where}):
            measured = rates(name)
            key = f"{case} {where} {name}"
            report["medians"][key] = statistics.median(measured.values())
            ratio = paired_ratio(measured, base) if name != against else None
            report["ratios"][f"{key} / {against}"] = ratio.to_json() if ratio else None
            shown = ratio.text() if ratio else "1x"
            print(f"  {name:14s} {report['medians'][key] / 1e6:9.2f}M {unit}/s   {shown}")
    report["per_batch_us"] = _per_batch(timed, tensor_cases)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _per_batch(timed: list[dict], cases: dict[str, int]) -> dict[str, dict[str, float]]:
    """Through Ray, each tensor contender's median microseconds a batch: in all, inside its collate, and
    outside it (Ray's own work, and waiting on it). Printed, and returned by "case contender"."""
    medians = {}
    for case in cases:
        print(f"{case}, through Ray, microseconds a batch: in all = inside the collate + outside it")
        for name in sorted({r["contender"] for r in timed if r["case"] == case}):
            kept = [r for r in timed if (r["case"], r["contender"], r["where"]) == (case, name, "ray")]
            whole = statistics.median(r["batch_s"] * 1e6 for r in kept)
            inside = statistics.median(r["inside_s"] * 1e6 for r in kept)
            outside = statistics.median((r["batch_s"] - r["inside_s"]) * 1e6 for r in kept)
            medians[f"{case} {name}"] = {"batch": whole, "inside": inside, "outside": outside}
            print(f"  {name:14s} {whole:7.0f} = {inside:5.0f} + {outside:5.0f}")
    return medians


if __name__ == "__main__":
    sys.exit(main())
