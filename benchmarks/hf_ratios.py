"""Hugging Face's own data path against fastcollate's, side by side in one run, over ``datasets``
datasets as users have them (saved with ``save_to_disk``, loaded with ``load_from_disk``: memory-mapped
Arrow files in several shards, 1000-row record batches, datasets' default writer batch size).

    python -m benchmarks.hf_ratios [--quick] [--cases packed tabular many_files] [--files 1000]
                                   [--workers 0 2] [--rounds 5] [--data-dir DIR] [--malloc fixed|default]
                                   [--json PATH]

Two datasets, seeded: ``tokens``, 200k rows of ``input_ids`` (list<int32>, 16..512 tokens each); and
``tabular``, 500k rows of 64 float32 ``features`` (``Sequence(Value("float32"), length=64)``) and an
int64 ``label`` (--quick: a tenth of each). Three paths each, all through a DataLoader(batch_size=B,
shuffle=True) that differs only where named:

  packed, batches of 8, 16 and 64 sequences (tokens/s):
    HF       the dataset, ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
    swapped  the same dataset and loader, ``assemble.using(contract)``: the collate swapped only, the
             contract equal to HF's output (labels a copy of input_ids, -100 at each sequence's start)
    Arrays   ``Arrays.from_hf(ds, columns={"input_ids": "input_ids", "labels": "input_ids"})``, the same
             contract with labels an ordinary packed field
  tabular, batches of 256 and 4096 rows (rows/s):
    HF       ``ds.with_format("torch")``, torch's default collate
    swapped  the same, ``assemble``
    Arrays   ``Arrays.from_hf(ds)``, ``assemble``
  and in each, ``stored``: the Arrays path with ``from_hf(..., stored_dtypes=True)``, which gathers the
  stored dtypes (the packed contract then casts int32 to int64 itself): what the default dtypes cost.
  many_files, the packed paths at batches of 16 over ``tokens`` saved in ``--files`` files (1,000: a large
  dataset as ``save_to_disk(num_shards=...)``, ``map(num_proc=...)`` or ``concatenate_datasets`` leave
  it; 1: the single-file baseline), and single rows read one by one, ``ds[i]`` against the packed
  Arrays' ``a[i]`` (the Trainer's length-grouped sampler reads every row with ``ds[i]``): the same
  random indices for both, in interleaved rounds of ``row_reads`` rows. Run when named (``--cases
  many_files``): the default run is the two cases above, whose results the docs show.

Method. Every path is first run on one fixed batch of indices, as a DataLoader runs it
(``collate(dataset.__getitems__(indices))``), and its batch must equal HF's, key for key, in dtype,
shape and value (the run stops with the difference otherwise: ratios compare equal work). A path that
raises instead is reported as failed, and the rest still run. Then, for each batch size and worker
count, the three loaders are made (persistent workers with the platform's start method, so start-up is
not timed; the same seeded shuffle in each, so every path meets the same batches) and timed in rounds: a
round drains a fixed number of batches from each loader, in a freshly shuffled order (seeded), dropping
each batch at once, the loader's iterator kept across rounds. The first round is a warm-up (it also
starts the workers): kept in the JSON, out of the medians. Rates are medians over the rounds (min-max
beside); a ratio is the median of the per-round paired ratios, their min-max beside, ``~`` unless the
runs are apart (``fastcollate.tools.bench.ratios``). One torch thread in every
process; glibc's mmap threshold fixed at 64 MiB in the main process and every worker (``--malloc fixed``,
as array_ratios.py runs) or left as glibc sets it (``--malloc default``): the header says which ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import fastcollate
from benchmarks.shared.hf_paths import (
    SHARDS,
    Contender,
    check_paths,
    cost_line,
    describe_dataset,
    failed,
    from_hf_cost,
    make_paths,
    saved_and_loaded,
)
from benchmarks.shared.report_header import header_line, report_header
from benchmarks.shared.rounds import loader_epoch
from fastcollate.tools.bench.malloc import samples_on_the_heap
from fastcollate.tools.bench.ratios import NOT_DIFFERENT, paired_ratio, too_small_to_time
from fastcollate.tools.terminal import fit_to_terminal

PATHS = ("HF", "swapped", "Arrays", "stored")


@dataclasses.dataclass(frozen=True)
class Case:
    """One dataset's benchmark: what a batch's size counts, the rows (full, --quick), the batch sizes,
    and how much a round drains (``units_per_round`` of them; with workers, at least ``min_batches``
    batches)."""

    dataset: str
    unit: str
    rows: int
    quick_rows: int
    batch_sizes: tuple[int, ...]
    units_per_round: int
    quick_units_per_round: int
    min_batches: int = 40
    kind: str = "packed"  # whose paths it times: NAMES' keys
    files: int = SHARDS  # Arrow files its dataset is saved in (--files sets many_files')
    row_reads: int = 0  # rows read one by one a round, ds[i] against a[i] (--quick: a fifth)


# Rounds of about 1-2 s (tokens) and 5-7 s (tabular rows) for HF's path on 2 cores: the full run in about
# 10 minutes with all its paths, --quick in 2-3.
CASES = {
    "packed": Case("tokens", "tokens", 200_000, 20_000, (8, 16, 64), 1_500_000, 700_000),
    "tabular": Case("tabular", "rows", 500_000, 50_000, (256, 4096), 150_000, 60_000, kind="tabular"),
    "many_files": Case("tokens", "tokens", 200_000, 20_000, (16,), 1_500_000, 700_000, files=1000,
                       row_reads=5_000),
}
NAMES = {
    "packed": {
        "HF": "DataCollatorWithFlattening",
        "swapped": "collate swapped: assemble.using(contract)",
        "Arrays": "Arrays.from_hf + assemble.using(contract)",
        "stored": "the same, stored_dtypes=True",
    },
    "tabular": {
        "HF": 'with_format("torch") + default collate',
        "swapped": "collate swapped: assemble",
        "Arrays": "Arrays.from_hf + assemble",
        "stored": "the same, stored_dtypes=True",
    },
}


# ----------------------------------------------------------------------------------------------- timing


def units_of(kind: str, batch: Mapping[str, Any]) -> int:
    return batch["input_ids"].numel() if kind == "packed" else len(batch["label"])


def time_rounds(kind: str, epochs: dict[str, Callable], batches: int, rounds: int, seed: int,
                failures: dict[str, str]) -> list[dict]:
    """Round 0 (the warm-up) and ``rounds`` more; each drains ``batches`` batches from every live path in
    a shuffled order. A path that raises is recorded in ``failures`` and drops out."""
    order = random.Random(seed)
    runs = []
    for round_index in range(rounds + 1):
        names = [name for name in epochs if name not in failures]
        order.shuffle(names)
        for name in names:
            timed_run(runs, failures, name, round_index, batches,
                      lambda epoch=epochs[name]: sum(units_of(kind, batch) for batch in epoch(batches)))
    return runs


def timed_run(runs: list[dict], failures: dict[str, str], name: str, round_index: int, batches: int,
              work: Callable[[], int]) -> None:
    """Times ``work`` (which returns the units it delivered) as path ``name``'s run in round ``round_index``,
    added to ``runs``; a path that raises is recorded in ``failures`` instead."""
    start = time.perf_counter()
    try:
        units = work()
    except Exception as error:
        failures[name] = failed(error)
        return
    seconds = time.perf_counter() - start
    runs.append({"round": round_index, "warmup": round_index == 0, "path": name, "seconds": seconds,
                 "batches": batches, "units": units, "units_per_s": units / seconds})


def summarize(runs: list[dict], failures: dict[str, str]) -> dict[str, Any]:
    """HF's median rate (min-max over rounds), and each other path's paired ratio to it (the median of
    the per-round ratios, their min-max, and whether it clears the noise); or the path's failure. And the
    rounds in which the paths drained different numbers of tokens or rows: their loaders' shuffles went
    apart, so they met other batches."""
    rates: dict[str, dict[int, float]] = {}
    units: dict[int, set[int]] = {}
    timed = [run for run in runs if not run["warmup"]]
    for run in runs:
        units.setdefault(run["round"], set()).add(run["units"])
        if not run["warmup"] and run["path"] not in failures:
            rates.setdefault(run["path"], {})[run["round"]] = run["units_per_s"]
    out: dict[str, Any] = {"failures": dict(failures),
                           "rounds_of_unequal_work": [k for k, seen in units.items() if len(seen) > 1]}
    if "HF" not in rates:
        return out
    hf = rates["HF"]
    out["HF"] = {"median": statistics.median(hf.values()), "min": min(hf.values()), "max": max(hf.values())}
    too_small = too_small_to_time(run["batches"] for run in timed)
    for name, rate in rates.items():
        if name == "HF":
            continue
        ratio = paired_ratio(rate, hf, too_small)
        if ratio is None:  # no round with a usable rate on both sides: reported as the path's failure
            out["failures"][name] = "no round measured both it and HF's path"
            continue
        out[name] = {"median": statistics.median(rate.values()), "ratio": ratio.median,
                     "ratio_min": ratio.low, "ratio_max": ratio.high, "clears_noise": ratio.clears_noise,
                     "too_small": too_small}
    return out


def time_row_reads(reads: dict[str, Callable[[int], Any]], length: int, rows: int, rounds: int,
                   seed: int) -> dict:
    """Round 0 (the warm-up) and ``rounds`` more; each reads ``rows`` random rows one by one with every
    path of ``reads`` (HF's ``ds[i]``, Arrays' ``a[i]``), the same indices for all, in a shuffled order."""
    order = random.Random(seed)
    runs, failures = [], {}
    for round_index in range(rounds + 1):
        indices = [order.randrange(length) for _ in range(rows)]
        names = [name for name in reads if name not in failures]
        order.shuffle(names)
        for name in names:
            timed_run(runs, failures, name, round_index, rows,
                      lambda read=reads[name], indices=indices: _read_all(read, indices))
    return {"rows_per_round": rows, "runs": runs, **summarize(runs, failures)}


def _read_all(read: Callable[[int], Any], indices: list[int]) -> int:
    for index in indices:
        read(index)
    return len(indices)


def loader(path: Contender, batch: int, workers: int, seed: int, malloc: str) -> DataLoader:
    """HF's loader, the same for every path: shuffled (seeded alike, so every path meets the same
    batches), persistent workers, the platform's start method."""
    return DataLoader(
        path.dataset,
        batch_size=batch,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        collate_fn=path.make_collate() if path.make_collate else None,
        num_workers=workers,
        persistent_workers=workers > 0,
        worker_init_fn=samples_on_the_heap if workers and malloc == "fixed" else None,
    )


def run_group(kind: str, paths: dict[str, Contender], batch: int, workers: int, args, batches: int) -> dict:
    failures = {name: path.failed for name, path in paths.items() if path.failed}
    epochs = {name: loader_epoch(loader(path, batch, workers, args.seed, args.malloc))
              for name, path in paths.items() if not path.failed}
    runs = time_rounds(kind, epochs, batches, args.rounds, args.seed, failures)
    del epochs  # the persistent workers go with their iterators
    gc.collect()
    return {"batch_size": batch, "workers": workers, "batches_per_round": batches, "runs": runs,
            **summarize(runs, failures)}


# ---------------------------------------------------------------------------------------------- report


def rate(value: float) -> str:
    return f"{value / 1e6:.2f}M" if value >= 1e6 else f"{value / 1e3:.1f}k"


def ratio_text(ratio: dict) -> str:
    mark = "" if ratio["clears_noise"] else f" {NOT_DIFFERENT}"
    return f"{ratio['ratio']:5.2f}x ({ratio['ratio_min']:.2f}-{ratio['ratio_max']:.2f}){mark}"


def group_lines(case: str, group: dict) -> list[str]:
    unit, names = CASES[case].unit, NAMES[CASES[case].kind]
    head = f"  batch {group['batch_size']:>5}, workers {group['workers']}:"
    if "HF" not in group:
        return [f"{head} HF {group['failures'].get('HF', 'no rounds')}"]
    hf = group["HF"]
    lines = [f"{head} HF {rate(hf['median'])} {unit}/s ({rate(hf['min'])}-{rate(hf['max'])})"]
    for name in PATHS[1:]:
        if name in group:
            lines.append(f"      {names[name]:<44} {ratio_text(group[name])}")
        else:
            lines.append(f"      {names[name]:<44} {group['failures'].get(name, 'no rounds')}")
    too_small = next((group[name]["too_small"] for name in PATHS[1:] if group.get(name, {}).get("too_small")),
                     None)
    if too_small:
        lines.append(fit_to_terminal(f"      {NOT_DIFFERENT} on every ratio: {too_small}"))
    if group["rounds_of_unequal_work"]:
        lines.append(f"      NOT THE SAME BATCHES: the paths drained different {unit} in rounds "
                     f"{group['rounds_of_unequal_work']}")
    return lines


def row_read_lines(reads: dict) -> list[str]:
    head = f"  rows read one by one, {reads['rows_per_round']:,} a round:"
    if "HF" not in reads:
        return [f"{head} HF ds[i] {reads['failures'].get('HF', 'no rounds')}"]
    hf = reads["HF"]
    lines = [f"{head} HF ds[i] {rate(hf['median'])} rows/s ({rate(hf['min'])}-{rate(hf['max'])}), "
             f"{1e6 / hf['median']:.1f} us a row"]
    if "Arrays" in reads:
        arrays = reads["Arrays"]
        per_row = 1e6 / arrays["median"]
        lines.append(f"      {'Arrays.from_hf a[i]':<44} {ratio_text(arrays)}, {per_row:.1f} us a row")
    else:
        lines.append(f"      {'Arrays.from_hf a[i]':<44} {reads['failures'].get('Arrays', 'no rounds')}")
    return lines


def versions() -> dict[str, str | None]:
    out = {}
    for name in ("datasets", "pyarrow", "transformers", "numpy"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=["packed", "tabular"],
                        help="default: packed and tabular (many_files runs when named)")
    parser.add_argument("--files", type=int, default=CASES["many_files"].files,
                        help="Arrow files of the many_files case's dataset (1: the single-file baseline)")
    parser.add_argument("--quick", action="store_true",
                        help="a tenth of the rows, 3 rounds, shorter rounds: a couple of minutes")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--rounds", type=int, help="timed rounds after the warm-up (default 5, --quick 3)")
    parser.add_argument("--rows", type=int, help="rows of every dataset (default: the case's own)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="instead of each case's own")
    parser.add_argument("--batches", type=int, help="batches a path drains a round (default: by its size)")
    parser.add_argument("--row-reads", type=int,
                        help="many_files: rows read one by one a round (default 5,000, --quick 1,000)")
    parser.add_argument("--data-dir", type=Path,
                        help="keep the saved datasets here and reuse them (default: a temporary folder)")
    parser.add_argument("--malloc", choices=("fixed", "default"), default="fixed",
                        help="glibc's mmap threshold fixed at 64 MiB everywhere, or glibc's defaults")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.quick else 5
    return args


def batches_per_round(case: Case, batch: int, workers: int, args: argparse.Namespace) -> int:
    """The case's units a round (tokens at their mean length); with workers, in at least
    ``min_batches`` batches: a loader's workers prefetch 2 batches each while the other loaders run,
    which its round then gets for free; in 40 batches or more, those are a tenth of the round at most."""
    if args.batches is not None:
        return args.batches
    units = case.quick_units_per_round if args.quick else case.units_per_round
    per_batch = batch * (264 if case.unit == "tokens" else 1)  # 264: the mean of 16..512 tokens
    return max(case.min_batches if workers else 1, round(units / per_batch))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import datasets

    datasets.disable_progress_bars()  # save_to_disk's bars would bury the figures
    torch.set_num_threads(1)
    if args.malloc == "fixed":
        samples_on_the_heap()
    header = report_header()
    report: dict[str, Any] = {
        **header,
        "versions": versions(),
        "start_method": multiprocessing.get_start_method(),
        # Checkouts may share one environment, whose install is another checkout's: say which ran.
        "fastcollate_path": str(Path(fastcollate.__file__).parent),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "datasets": {},
        "cases": {},
    }
    print(header_line(header))
    print(fit_to_terminal(", ".join(f"{k} {v}" for k, v in report["versions"].items())
                          + f"; workers started by {report['start_method']}; one torch thread; {args.rounds} "
                          "rounds after a warm-up; rates: medians (min-max); ratios: the median (min-max) of "
                          f"the per-round ratios, ~ where the runs overlap\nfastcollate from "
                          f"{report['fastcollate_path']}"), flush=True)
    temporary = None if args.data_dir else tempfile.TemporaryDirectory(prefix="fastcollate-hf-")
    folder = args.data_dir or Path(temporary.name)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        for case_name in args.cases:
            case = CASES[case_name]
            if case_name == "many_files":
                case = dataclasses.replace(case, files=args.files)
            rows = args.rows or (case.quick_rows if args.quick else case.rows)
            ds = saved_and_loaded(case.dataset, rows, args.seed, folder, case.files)
            dataset = case.dataset if case.files == SHARDS else f"{case.dataset}, {case.files} files"
            report["datasets"][dataset] = describe_dataset(ds)
            paths = make_paths(case.kind, ds)
            print(fit_to_terminal(f"\n{case_name}: {rows:,} rows of {case.dataset}, {case.files} Arrow "
                                  f"files; {case.unit}/s of HF's path ({NAMES[case.kind]['HF']}), the "
                                  "others' ratios to it"), flush=True)
            columns = {"input_ids": "input_ids", "labels": "input_ids"} if case.kind == "packed" else None
            # rows against full_rows: the demo's summary says when a run was smaller than the docs' table
            result: dict[str, Any] = {"rows": rows, "full_rows": case.rows,
                                      "from_hf": from_hf_cost(ds, columns), "groups": []}
            print(fit_to_terminal(cost_line(result["from_hf"])), flush=True)
            report["cases"][case_name] = result
            for batch in args.batch_sizes or case.batch_sizes:
                indices = random.Random(args.seed).sample(range(len(ds)), batch)
                check_paths(paths, indices)  # raises BatchMismatch: never time unequal work
                for workers in args.workers:
                    batches = batches_per_round(case, batch, workers, args)
                    group = run_group(case.kind, paths, batch, workers, args, batches)
                    result["groups"].append(group)
                    print("\n".join(group_lines(case_name, group)), flush=True)
                    if args.json:
                        args.json.parent.mkdir(parents=True, exist_ok=True)
                        args.json.write_text(json.dumps(report, indent=1, default=str))
            if case.row_reads:
                reads = {"HF": ds.__getitem__}
                if not paths["Arrays"].failed:
                    reads["Arrays"] = paths["Arrays"].dataset.__getitem__
                row_reads = args.row_reads or (case.row_reads // 5 if args.quick else case.row_reads)
                result["row_reads"] = time_row_reads(reads, len(ds), row_reads, args.rounds, args.seed)
                print("\n".join(row_read_lines(result["row_reads"])), flush=True)
            del paths, ds
            gc.collect()
    finally:
        if temporary is not None:
            temporary.cleanup()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
