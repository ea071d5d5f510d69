"""Loader-only samples/s with DataLoader workers, side by side in one run: ``default_collate``,
``assemble`` with shared slots off (fresh shared memory per batch, as ``default_collate`` in a worker
has) and on, at 0, 1 and 2 workers; and the performance targets judged on the ratios.

    python -m benchmarks.worker_ratios [--datasets predecoded fashion fields] [--workers 0 1 2]
                                       [--rounds 7] [--batches 12] [--json PATH]

Method: one persistent DataLoader per (contender, workers), all made up front (fork, prefetch_factor 2,
one torch thread in every process). A round runs one epoch of ``--batches`` batches on every loader, in
a freshly shuffled order (seeded), dropping each batch at once; the first round is a warm-up (kept in the
JSON, left out of the medians). glibc's mmap threshold is fixed at 64 MiB in the main process and every
worker, for all contenders alike (``samples_on_the_heap``): left dynamic, whether a 150 KB sample clone
is a fresh mmap depends on what ran before; fixed high, the dataset's clones cost the same everywhere
and what differs is the loader's path. Per epoch: samples/s (wall clock, from ``iter()`` to the last
batch) and the main
process's CPU time per batch (``time.process_time``: with workers, what receiving a batch costs it).
A ratio is the median of the per-round paired ratios, with their min-max, marked ``~`` unless the two
cells' runs are apart (``fastcollate.tools.bench.ratios``); a cell is named fastest only when its
runs are apart from every other cell's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import textwrap
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import fastcollate
from benchmarks.shared.report_header import header_line, report_header
from benchmarks.shared.rounds import quartiles
from fastcollate._ext import _C
from fastcollate.tools.bench.malloc import samples_on_the_heap
from fastcollate.tools.bench.presets import PRESETS
from fastcollate.tools.bench.ratios import NOT_DIFFERENT, paired_ratio, runs_apart, too_small_to_time
from fastcollate.tools.terminal import fit_to_terminal

CONTENDERS = ("default_collate", "assemble, slots off", "assemble, slots on")


def collate_for(contender: str, preset) -> object:
    if contender == "default_collate":
        return preset.default_collate
    contract = preset.contract() if preset.contract else None
    return fastcollate.Assembler(contract, shared_slots=contender.endswith("on"))


def epoch(loader: DataLoader) -> tuple[float, float, int, int]:
    """(wall seconds, main-process CPU seconds, samples, batches) of one epoch; raises if a sample was
    lost or duplicated."""
    ids: list[int] = []
    batches = 0
    cpu = time.process_time()
    start = time.perf_counter()
    for batch in loader:
        ids += batch["id"].tolist()
        batches += 1
        del batch
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    if sorted(ids) != list(range(len(loader.dataset))):
        raise AssertionError(f"an epoch delivered {len(ids)} ids, not each of the {len(loader.dataset)} once")
    return wall, cpu, len(ids), batches


def run_dataset(name: str, workers: list[int], rounds: int, batches: int, seed: int) -> dict:
    preset = PRESETS[name]
    dataset = preset.make_dataset(batches * preset.batch_size, seed)
    loaders = {}
    for contender in CONTENDERS:
        for count in workers:
            if count == 0 and contender == "assemble, slots off":
                continue  # without workers the slots play no part: the same path as "slots on"
            loaders[(contender, count)] = DataLoader(
                dataset,
                batch_size=preset.batch_size,
                collate_fn=collate_for(contender, preset),
                num_workers=count,
                persistent_workers=count > 0,
                worker_init_fn=samples_on_the_heap if count else None,
                prefetch_factor=2 if count else None,
            )
    order = random.Random(seed)
    runs = []
    for round_index in range(rounds + 1):
        keys = list(loaders)
        order.shuffle(keys)
        for contender, count in keys:
            wall, cpu, samples, done = epoch(loaders[(contender, count)])
            runs.append(
                {
                    "round": round_index,
                    "warmup": round_index == 0,
                    "contender": contender,
                    "workers": count,
                    "seconds": wall,
                    "main_cpu_seconds": cpu,
                    "samples": samples,
                    "batches": done,
                    "samples_per_s": samples / wall,
                    "main_cpu_ms_per_batch": 1e3 * cpu / max(done, 1),
                }
            )
        print(f"  {name}: round {round_index}/{rounds}{' (warm-up)' if round_index == 0 else ''}", flush=True)
    slots = {}
    # What one slot must hold: the batch's bytes as assemble lays them out (aligned fields).
    batch_bytes = _C.Collator("id", [], False).plan([dataset[i] for i in range(preset.batch_size)]).nbytes
    for (contender, count), loader in loaders.items():
        stats = (
            loader.collate_fn.shared_slot_stats()
            if isinstance(loader.collate_fn, fastcollate.Assembler)
            else None
        )
        if stats is not None and contender.endswith("on"):
            slots[count] = stats.__dict__
    del loaders
    return {
        "dataset": name,
        "description": preset.description,
        "batch_size": preset.batch_size,
        "batch_tensor_bytes": batch_bytes,
        "runs": runs,
        "slot_stats": slots,
    }


def summarize(result: dict) -> list[str]:
    runs = [r for r in result["runs"] if not r["warmup"]]
    by = {}
    for r in runs:
        by.setdefault((r["contender"], r["workers"]), {})[r["round"]] = r
    workers = sorted({w for _, w in by})
    median = {
        key: statistics.median(r["samples_per_s"] for r in rounds.values()) for key, rounds in by.items()
    }
    cpu = {
        key: statistics.median(r["main_cpu_ms_per_batch"] for r in rounds.values())
        for key, rounds in by.items()
    }

    too_small = too_small_to_time(r["batches"] for r in runs)

    result["ratios"] = {}

    def paired(a: tuple, b: tuple) -> str:
        """The ratio's text, kept in the JSON too (what the demo's summary reads)."""
        ratio = _paired(by, a, b, too_small)
        if ratio is None:
            return "- (not both measured)"
        result["ratios"][f"{a[0]} at workers={a[1]} / {b[0]} at workers={b[1]}"] = ratio.to_json()
        return ratio.text()

    lines = [
        f"{result['dataset']}: {result['description']}, batch {result['batch_size']}",
        "  samples/s (median)   " + "".join(f"{f'workers={w}':>22}" for w in workers),
    ]
    for contender in CONTENDERS:
        cells = "".join(
            f"{median[(contender, w)]:>14,.0f} {cpu[(contender, w)]:5.2f}ms" if (contender, w) in median
            else f"{'(as slots on)':>22}" for w in workers
        )
        lines.append(f"  {contender:<21}{cells}")
    lines.append("  (each cell: samples/s, then the main process's CPU time per batch; at workers=0 the")
    lines.append("  slots play no part, so assemble is measured once)")
    on = "assemble, slots on"
    for w in workers:
        if w == 0:
            continue
        lines.append(f"  workers={w}: slots on / default_collate {paired((on, w), ('default_collate', w))}")
        lines.append(f"             slots on / slots off {paired((on, w), ('assemble, slots off', w))}")
        if (on, 0) in median:
            lines.append(f"             slots on / assemble at workers=0 {paired((on, w), (on, 0))}")
    if too_small:
        lines.append(fit_to_terminal(f"  {NOT_DIFFERENT} on every ratio: {too_small}"))
    result["verdict"] = fastest(by, median, too_small)
    lines.append(textwrap.fill(result["verdict"], 100, initial_indent="  ", subsequent_indent="           "))
    for w, stats in sorted(result["slot_stats"].items()):
        if w == 0 or not stats["slots_used"]:
            continue
        held = stats["bytes_held"] / (stats["slots_used"] * result["batch_tensor_bytes"])
        lines.append(
            f"  workers={w}: {stats['slots_used']} slots used, bytes held {held:.3f}x slots x batch bytes, "
            f"{stats['fresh_fallbacks']} fresh fallbacks"
        )
    result["medians"] = {f"{c} @ workers={w}": v for (c, w), v in median.items()}
    result["main_cpu_ms_per_batch"] = {f"{c} @ workers={w}": v for (c, w), v in cpu.items()}
    return lines


def _paired(by: dict, a: tuple, b: tuple, too_small: str | None):
    """Cell ``a`` over cell ``b`` (None when either was not measured)."""
    if a not in by or b not in by:
        return None
    return paired_ratio(*({k: r["samples_per_s"] for k, r in by[key].items()} for key in (a, b)), too_small)


def fastest(by: dict, median: dict, too_small: str | None = None) -> str:
    """The cell with the best median, named as fastest only if its runs are apart from (above) every
    other cell's: its slowest run faster than their fastest."""
    best = max(median, key=median.get)
    rates = {key: [run["samples_per_s"] for run in rounds.values()] for key, rounds in by.items()}
    rivals = [key for key in rates if key != best and not runs_apart(rates[best], rates[key])]
    name = f"{best[0]} at workers={best[1]}"
    ratio = _paired(by, best, ("default_collate", best[1]), too_small)
    if best[0] != "default_collate" and ratio is not None:
        name += f", {ratio.text(spread=False)} default_collate there"
    rate = f"{median[best]:,.0f} samples/s"
    if any(runs_apart(rates[best], rates[key]) is None for key in rates if key != best):
        return f"fastest: cannot tell with one round (best median: {name}, {rate})"
    if too_small:
        return f"fastest: cannot tell, too small to time (best median: {name}, {rate})"
    if not rivals:
        return f"fastest: {name} ({rate}; its runs apart from every other cell's over {len(by[best])} rounds)"
    listed = ", ".join(f"{c} at workers={w}" for c, w in rivals)
    return f"fastest: none beyond noise (the best median, {name}, {rate}, overlaps {listed})"


def draw_chart(report: dict, path: Path) -> None:
    """One panel a dataset: median samples/s of each contender at each worker count; the legend under
    the panels, over no bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    figure, axes = plt.subplots(
        1, len(results), figsize=(6 * len(results), 3.9), squeeze=False, layout="constrained"
    )
    for axis, result in zip(axes[0], results, strict=True):
        workers = sorted({int(key.rsplit("=", 1)[1]) for key in result["medians"]})
        width = 0.8 / len(CONTENDERS)
        for k, contender in enumerate(CONTENDERS):
            values = [result["medians"].get(f"{contender} @ workers={w}", 0) for w in workers]
            axis.bar([w + (k - 1) * width for w in workers], values, width, label=contender)
        axis.set_xticks(workers, [f"workers={w}" for w in workers])
        axis.set_ylabel("samples/s (median)")
        axis.set_title(f"{result['dataset']}, batch {result['batch_size']}", fontsize=10)
    figure.legend(*axes[0][0].get_legend_handles_labels(), loc="outside lower center",
                  ncol=len(CONTENDERS), fontsize=8)
    figure.suptitle("DataLoader workers: shared slots on and off against default_collate\n"
                    "(at workers=0 the slots play no part: assemble is measured once)", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def receive_cost_ms(name: str, repeats: int = 200) -> dict:
    """The main process's cost of receiving one batch over a shared slot, alone: unpickling the message a
    worker sends (``ForkingPickler``, as DataLoader's queue does) into tensors over the slot, then dropping
    them. The slot is written in this process (as a worker would) before each untimed send."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from fastcollate.transfer.worker_slots import SlotPool, install_reducer

    preset = PRESETS[name]
    dataset = preset.make_dataset(preset.batch_size, 0)
    samples = [dataset[i] for i in range(preset.batch_size)]
    collator = _C.Collator("id", [], False)
    pool = SlotPool.create(4)
    install_reducer()  # this process now sends slot tensors as a worker does
    times = []
    for _ in range(repeats):
        plan = collator.plan(samples)
        batch = plan.execute(pool.native.claim(plan.nbytes, 1)[0], small_fields_apart=False)
        message = ForkingPickler.dumps((0, batch))
        del batch
        start = time.perf_counter()
        received = pickle.loads(message)
        del received
        times.append(time.perf_counter() - start)
    return {
        "dataset": name,
        "repeats": repeats,
        "median_ms": 1e3 * statistics.median(times),
        "p25_p75_ms": [1e3 * q for q in quartiles(times)],
        "message_bytes": len(message),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--datasets", nargs="+", default=["predecoded", "fashion", "fields"], choices=sorted(PRESETS)
    )
    parser.add_argument("--workers", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, default=12, help="batches per epoch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--chart", type=Path, help="draw the samples/s of every cell into this PNG")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1 (the warm-up round is extra)")
    torch.set_num_threads(1)
    samples_on_the_heap()
    header = report_header()
    print(header_line(header))
    print(
        "glibc mmap threshold fixed at 64 MiB in every process (samples are reused heap memory); fork;\n"
        f"one torch thread; {args.rounds} rounds of {args.batches} batches after one warm-up; rates are\n"
        "medians; ratios: the median (min-max) of the per-round ratios, ~ where the runs overlap",
        flush=True,
    )
    report = {
        **header,
        "results": [],
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for name in args.datasets:
        result = run_dataset(name, args.workers, args.rounds, args.batches, args.seed)
        lines += summarize(result)
        report["results"].append(result)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
    print("\n".join(lines))
    if args.chart:
        draw_chart(report, args.chart)
        print(f"wrote {args.chart}")
    for name in args.datasets:
        cost = receive_cost_ms(name)
        report.setdefault("receive_cost", []).append(cost)
        print(
            f"receiving one {name} batch in the main process (unpickle the {cost['message_bytes']}-byte\n"
            f"  message into views of its slot, then drop them): median {cost['median_ms']:.3f} ms "
            f"(p25-p75 {cost['p25_p75_ms'][0]:.3f}-{cost['p25_p75_ms'][1]:.3f}) over {cost['repeats']}"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
