"""Data that already sits in arrays, side by side in one run: per-sample datasets with default_collate
and with assemble, the batched-index idiom users know (a BatchSampler as the sampler, X[idx]),
fastcollate.Arrays gathered by assemble, and a bare index_select into a reused buffer (the floor).

    python -m benchmarks.array_ratios [--cases tabular images tokens workers packed] [--rounds 7]
                                      [--json PATH]

Method: every contender of a case makes the same batches (checked equal once, untimed), in rounds; a
round runs each contender once over --batches batches, in a freshly shuffled order (seeded), and each
batch is dropped at once. The first round is a warm-up (kept in the JSON, out of the medians).
Contenders that go through a DataLoader use workers=0 (the ``workers`` case compares 0 and 2 workers).
A ratio is the median of the per-round paired ratios, their min-max beside, ``~`` unless the runs are
apart (``fastcollate.tools.bench.ratios``). glibc's
mmap threshold is fixed at 64 MiB for every contender (``samples_on_the_heap``): fresh outputs of the
idiom are then reused heap memory, not fresh mappings.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.shared.array_contenders import (
    array_contenders,
    images,
    packed_contenders,
    per_batch_packed_contenders,
    per_batch_tabular_contenders,
    tabular,
    token_contenders,
    with_threads,
    worker_contenders,
)
from benchmarks.shared.report_header import header_line, report_header
from fastcollate.tools.bench.malloc import samples_on_the_heap
from fastcollate.tools.bench.ratios import NOT_DIFFERENT, paired_ratio, too_small_to_time
from fastcollate.tools.terminal import fit_to_terminal


def check_same(contenders: dict, key_sets: tuple[str, ...]) -> list[str]:
    """Every contender's first batch has the same keys, shapes and dtypes (values differ: each contender
    shuffles with its own sampler)."""
    described = {}
    for name, epoch in contenders.items():
        first = next(iter(epoch(1)))
        described[name] = {k: (tuple(first[k].shape), first[k].dtype) for k in key_sets}
    reference = next(iter(described.values()))
    return [f"{name}: {d} != {reference}" for name, d in described.items() if d != reference]


def time_rounds(contenders: dict, batches: int, rounds: int, seed: int) -> list[dict]:
    order = random.Random(seed)
    runs = []
    for round_index in range(rounds + 1):
        names = list(contenders)
        order.shuffle(names)
        for name in names:
            start = time.perf_counter()
            count = drained = 0
            for batch in contenders[name](batches):
                count += len(batch["id"]) if "id" in batch else len(batch["cu_seq_lens_q"]) - 1  # packed
                drained += 1
                del batch
            seconds = time.perf_counter() - start
            runs.append(
                {
                    "round": round_index,
                    "warmup": round_index == 0,
                    "contender": name,
                    "seconds": seconds,
                    "batches": drained,
                    "samples": count,
                    "samples_per_s": count / seconds,
                }
            )
    return runs


def summarize(
    case: str, runs: list[dict], pairs: list[tuple[str, str, str]], names: list[str], targets: bool = True
) -> tuple[list[str], dict]:
    kept = [r for r in runs if not r["warmup"]]
    by: dict[str, dict[int, float]] = {name: {} for name in names}  # printed in the contenders' order
    for r in kept:
        by[r["contender"]][r["round"]] = r["samples_per_s"]
    median = {name: statistics.median(rates.values()) for name, rates in by.items()}
    lines = [f"{case}: {CASE_NOTES[case]}", f"  samples/s, median of {len(next(iter(by.values())))} rounds:"]
    lines += [f"  {name:<38}{median[name]:>14,.0f}" for name in by]
    ratios = {}
    too_small = too_small_to_time(r["batches"] for r in kept)
    if too_small:
        lines.append(fit_to_terminal(f"  {NOT_DIFFERENT} on every ratio: {too_small}"))
    for subject, baseline, target in pairs:
        ratio = paired_ratio(by[subject], by[baseline], too_small)
        if ratio is None:  # no round with a usable rate on both sides
            lines.append(f"  {subject} / {baseline}: - (no round measured both)")
            continue
        ratios[f"{subject} / {baseline}"] = {"ratio": ratio.median, "min": ratio.low, "max": ratio.high,
                                             "clears_noise": ratio.clears_noise, "target": target}
        lines.append(f"  {subject} / {baseline}: {ratio.text()}" + (f"; target {target}" if targets else ""))
    return lines, {"medians": median, "ratios": ratios}


CASE_NOTES = {
    "tabular": "rows x 64 float32 + int64 label, batch 4096, shuffled",
    "images": "pre-decoded uint8 3x224x224 in memory, batch 256, shuffled",
    "tokens": "a uint16 memmap (page cache warm), batch 64 x 1024, random offsets",
    "workers": "Arrays + assemble with IndexBatches, workers 0 and 2",
    "packed": "--documents of 16..2048 int64 tokens, packed as DataCollatorWithFlattening packs, batch 256",
    "tabular_batch": "one batch at a time, nothing around it: 256 random rows of the tabular columns",
    "packed_batch": "one batch at a time, nothing around it: 16 random documents, input_ids packed",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["tabular", "images", "tokens", "workers", "packed", "tabular_batch", "packed_batch"],
        choices=["tabular", "images", "tokens", "workers", "packed", "tabular_batch", "packed_batch"],
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, default=10, help="batches per contender per round")
    parser.add_argument("--rows", type=int, default=1_000_000, help="tabular rows")
    parser.add_argument("--images", type=int, default=4096, help="pre-decoded images in memory")
    parser.add_argument("--tokens", type=int, default=100_000_000, help="tokens in the uint16 memmap")
    parser.add_argument("--documents", type=int, default=4096, help="documents in the packed case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--no-targets", action="store_true", help="leave the performance targets out of the output"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    samples_on_the_heap()
    header = report_header()
    print(header_line(header))
    print(
        f"glibc mmap threshold fixed at 64 MiB; one torch thread unless stated; {args.rounds} rounds of\n"
        f"{args.batches} batches after a warm-up (tokens: {10 * args.batches}); ratios: median (min-max)\n"
        "of the per-round ratios, ~ where the runs overlap",
        flush=True,
    )
    report = {
        **header,
        "cases": {},
    }
    lines: list[str] = []
    idiom, floor = "batched-index idiom", "index_select into a reused buffer"
    for case in args.cases:
        print(f"  {case} ...", flush=True)
        if case == "tabular":
            contenders = array_contenders(tabular(args.rows), 4096, args.seed)
            pairs = [
                ("Arrays + assemble, sampler lists", idiom, ">= 5x"),
                ("per-sample + assemble", "per-sample + default_collate", "(for reference)"),
                ("Arrays + assemble, IndexBatches", idiom, ">= 20x"),
                (floor, "Arrays + assemble, IndexBatches", "<= 3x"),
            ]
            keys = ("id", "x", "label")
        elif case == "images":
            columns = images(args.images)
            contenders = array_contenders(columns, 256, args.seed)
            gathered = "Arrays + assemble, IndexBatches"
            contenders[f"{gathered}, 2 threads"] = with_threads(2, contenders[gathered])
            pairs = [
                (gathered, floor, ">= 0.8x"),
                (f"{gathered}, 2 threads", gathered, ">= 1.3x"),
                (gathered, idiom, "(for reference)"),
            ]
            keys = ("id", "image", "label")
        elif case == "tokens":
            path = Path(tempfile.gettempdir()) / f"fastcollate-tokens-{args.tokens}.u16"
            if not path.exists() or path.stat().st_size != 2 * args.tokens:
                np.random.default_rng(0).integers(0, 50_257, args.tokens, dtype=np.uint16).tofile(path)
            path.read_bytes()  # warm page cache, as the target says
            contenders = token_contenders(path, 1024, 64, args.seed)
            pairs = [("TokenWindows + assemble", "nanoGPT get_batch", ">= 10x")]
            keys = ("id", "input_ids", "labels")
        elif case == "packed":
            contenders = packed_contenders(args.documents, 256, args.seed)
            gathered = "Arrays + assemble, IndexBatches"
            pairs = [(gathered, name, "(for reference)") for name in contenders if name != gathered]
            pairs.append(("per-sample + assemble", "per-sample + torch.cat+arange", "(for reference)"))
            keys = ("cu_seq_lens_q",)  # each contender shuffles its own way: the token totals differ
        elif case == "tabular_batch":
            contenders = per_batch_tabular_contenders(tabular(args.rows), 256, args.seed)
            pairs = [("index_select into reused buffers", "Arrays + assemble, one batch", "<= 2.5x")]
            keys = ("id", "x", "label")
        elif case == "packed_batch":
            contenders = per_batch_packed_contenders(args.documents, 16, args.seed)
            gathered = "Arrays + assemble, one packed batch"
            pairs = [
                ("torch.cat of the same rows", gathered, "<= 1.5x"),
                ("torch.cat + position ids", gathered, "(the floor of the four outputs)"),
            ]
            keys = ("input_ids",)
        else:
            contenders = worker_contenders(
                {"tabular": (tabular(args.rows), 4096), "images": (images(args.images), 256)}, args.seed
            )
            collates = {name: contenders.pop(name) for name in list(contenders) if name.startswith("_")}
            pairs = [
                (f"{name}, workers=2", f"{name}, workers=0", ">= 1.0x") for name in ("tabular", "images")
            ]
            keys = ("id",)
        if case == "workers":  # two datasets: each one's contenders make the same batches
            problems = [
                p
                for name in ("tabular", "images")
                for p in check_same({k: v for k, v in contenders.items() if k.startswith(name)}, keys)
            ]
        else:
            problems = check_same(contenders, keys)
        # Token batches are small (64 windows) and one-batch cases smaller still: more of them a round, so
        # a round lasts about as long as others.
        per_round = {"tokens": 10, "tabular_batch": 100, "packed_batch": 100}.get(case, 1)
        runs = time_rounds(contenders, args.batches * per_round, args.rounds, args.seed)
        case_lines, summary = summarize(case, runs, pairs, list(contenders), targets=not args.no_targets)
        if case == "workers":
            for name in ("tabular", "images"):
                stats = collates[f"_collate {name} 2"].shared_slot_stats()
                summary[f"slot_stats_{name}_workers_2"] = stats.__dict__ if stats is not None else None
                if stats is not None:
                    case_lines.append(
                        f"  {name}, workers=2: {stats.slots_used} shared slots used, "
                        f"{stats.fresh_fallbacks} fresh fallbacks, bytes held "
                        f"{stats.bytes_held / max(stats.slots_used, 1) / 2**20:.2f} MiB a "
                        "slot (gathered into the slot: no host copy after the gather)"
                    )
        case_lines += [f"  MISMATCH {p}" for p in problems]
        lines += case_lines
        report["cases"][case] = {"runs": runs, "problems": problems, **summary}
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1, default=str))
    print("\n".join(lines))
    return 1 if any(c["problems"] for c in report["cases"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
