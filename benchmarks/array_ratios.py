"""Data that already sits in arrays, side by side in one run: per-sample datasets with default_collate
and with assemble, the batched-index idiom users know (a BatchSampler as the sampler, X[idx]),
fastcollate.Arrays gathered by assemble, and a bare index_select into a reused buffer (the floor).

    python benchmarks/array_ratios.py [--cases tabular images tokens workers packed] [--rounds 7]
                                      [--json PATH]

Method: every contender of a case makes the same batches (checked equal once, untimed), in rounds; a
round runs each contender once over --batches batches, in a freshly shuffled order (seeded), and each
batch is dropped at once. The first round is a warm-up (kept in the JSON, out of the medians).
Contenders that go through a DataLoader use workers=0 (the ``workers`` case compares 0 and 2 workers).
A ratio is the median of the per-round paired ratios, their min-max beside, ``~`` unless the runs are
apart (``fastcollate.bench.ratios``). glibc's
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
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

try:
    import fastcollate
except ImportError:  # run from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fastcollate

from fastcollate import Arrays, Contract, Field, TokenWindows
from fastcollate.tools.bench.malloc import samples_on_the_heap
from fastcollate.tools.bench.ratios import NOT_DIFFERENT, paired_ratio, too_small_to_time
from fastcollate.tools.terminal import fit_to_terminal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report_header import header_line, report_header  # noqa: E402  (a sibling script, not a package)

Epoch = Callable[[int], Iterator]  # batches -> an iterator over that many batches


class Rows(Dataset):
    """The per-sample dataset over the same tensors: one dict per index."""

    def __init__(self, columns: dict[str, torch.Tensor]) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i: int) -> dict:
        return {"id": i, **{name: column[i] for name, column in self.columns.items()}}


class Idiom(Dataset):
    """The batched-index idiom: ``__getitem__`` takes a whole list of indices (the DataLoader's sampler is
    a BatchSampler and batch_size=None), and fancy-indexes every column."""

    def __init__(self, columns: dict[str, torch.Tensor]) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, indices: list[int]) -> dict:
        index = torch.as_tensor(indices)
        return {"id": index, **{name: column[index] for name, column in self.columns.items()}}


def sampler(n: int, batch: int, seed: int) -> BatchSampler:
    return BatchSampler(RandomSampler(range(n), generator=torch.Generator().manual_seed(seed)), batch, False)


def endless(epochs: Callable[[], Iterator]) -> Epoch:
    """The next ``batches`` batches of an iterator kept across rounds, a new epoch begun when one ends:
    a round measures batches as training meets them, with the per-epoch work (a permutation of every
    index) spread over the epoch's batches, not charged to the first few."""
    state = {"it": epochs()}

    def run(batches: int) -> Iterator:
        for _ in range(batches):
            try:
                yield next(state["it"])
            except StopIteration:
                state["it"] = epochs()
                yield next(state["it"])

    return run


def loader_epoch(loader: DataLoader) -> Epoch:
    return endless(lambda: iter(loader))


def floor_epoch(columns: dict[str, torch.Tensor], n: int, batch: int, seed: int) -> Epoch:
    """index_select of every column into buffers reused from batch to batch, indices cut from one
    permutation an epoch: the gather alone, with nothing around it."""
    buffers = {name: torch.empty((batch, *c.shape[1:]), dtype=c.dtype) for name, c in columns.items()}
    generator = torch.Generator().manual_seed(seed)

    def epoch() -> Iterator:
        order = torch.randperm(n, generator=generator)
        for k in range(0, n - batch + 1, batch):
            index = order[k : k + batch]
            yield {
                "id": index,
                **{name: torch.index_select(c, 0, index, out=buffers[name]) for name, c in columns.items()},
            }

    return endless(epoch)


def array_contenders(columns: dict[str, torch.Tensor], batch: int, seed: int) -> dict:
    n = len(next(iter(columns.values())))
    per_sample = Rows(columns)
    arrays = Arrays(columns)
    contenders = {
        "per-sample + default_collate": loader_epoch(
            DataLoader(per_sample, batch_sampler=sampler(n, batch, seed))
        ),
        "per-sample + assemble": loader_epoch(
            DataLoader(per_sample, batch_sampler=sampler(n, batch, seed), collate_fn=fastcollate.assemble)
        ),
        "batched-index idiom": loader_epoch(
            DataLoader(Idiom(columns), sampler=sampler(n, batch, seed), batch_size=None)
        ),
        "Arrays + assemble, sampler lists": loader_epoch(
            DataLoader(arrays, batch_sampler=sampler(n, batch, seed), collate_fn=fastcollate.assemble)
        ),
        "Arrays + assemble, IndexBatches": loader_epoch(
            DataLoader(
                arrays,
                batch_sampler=fastcollate.IndexBatches(n, batch, shuffle=True, seed=seed),
                collate_fn=fastcollate.assemble,
            )
        ),
        "index_select into a reused buffer": floor_epoch(columns, n, batch, seed),
    }
    return contenders


def tabular(rows: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(rows, 64, generator=generator),
        "label": torch.randint(0, 10, (rows,), generator=generator),
    }


def images(count: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "image": torch.randint(0, 256, (count, 3, 224, 224), dtype=torch.uint8, generator=generator),
        "label": torch.randint(0, 1000, (count,), generator=generator),
    }


def with_threads(threads: int, epoch: Epoch) -> Epoch:
    def run(batches: int) -> Iterator:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            yield from epoch(batches)
        finally:
            torch.set_num_threads(before)

    return run


def token_contenders(path: Path, block: int, batch: int, seed: int) -> dict:
    data = np.memmap(path, dtype=np.uint16, mode="r")
    windows = TokenWindows(data, length=block, step=1)
    contract = Contract(
        {
            "id": Field(kind="number"),
            "input_ids": Field(dtype=torch.int64, shape=(block,), cast_from=(torch.uint16,)),
            "labels": Field(dtype=torch.int64, shape=(block,), cast_from=(torch.uint16,)),
        }
    )
    collate = fastcollate.assemble.using(contract)

    def nanogpt(batches: int) -> Iterator:
        generator = torch.Generator().manual_seed(seed)
        for _ in range(batches):
            # nanoGPT's train.py get_batch, as written there (the memmap made again per batch), without
            # its pin_memory (no GPU here).
            data = np.memmap(path, dtype=np.uint16, mode="r")
            ix = torch.randint(len(data) - block, (batch,), generator=generator)
            x = torch.stack([torch.from_numpy((data[i : i + block]).astype(np.int64)) for i in ix])
            y = torch.stack([torch.from_numpy((data[i + 1 : i + 1 + block]).astype(np.int64)) for i in ix])
            yield {"id": ix, "input_ids": x, "labels": y}

    def gathered(batches: int) -> Iterator:
        generator = torch.Generator().manual_seed(seed)
        for _ in range(batches):
            ix = torch.randint(len(windows), (batch,), generator=generator)
            yield collate(windows.__getitems__(ix))

    return {"nanoGPT get_batch": nanogpt, "TokenWindows + assemble": gathered}


class Documents(Dataset):
    """A tokenized corpus as a Dataset hands it to a packing collator: one document a sample, its
    input_ids and labels (the same tokens, as for a causal LM) views of the flat token column."""

    def __init__(self, values: torch.Tensor, offsets: torch.Tensor) -> None:
        self.values, self.offsets = values, offsets.tolist()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict:
        tokens = self.values[self.offsets[i] : self.offsets[i + 1]]
        return {"input_ids": tokens, "labels": tokens}


def documents_corpus(documents: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed cases' corpus, the same in every run: values and offsets of ``documents`` documents of
    16..2048 int64 tokens."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 2049, (documents,), generator=generator)
    offsets = torch.zeros(documents + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    values = torch.randint(0, 32000, (int(offsets[-1]),), generator=generator)
    return values, offsets


def packed_contenders(documents: int, batch: int, seed: int) -> dict:
    """Packed causal-LM batches (collate_cases.packed_contract: DataCollatorWithFlattening's keys) of the
    same shuffled documents, 16..2048 int64 tokens each: per-sample datasets with the collator, with
    torch.cat + arange, and with assemble; and the corpus as Arrays' Ragged columns, packed from values
    and offsets with no sample made."""
    from collate_cases import cat_arange_packed, flattening_collator, have_transformers, packed_contract

    values, offsets = documents_corpus(documents)
    per_sample = Documents(values, offsets)
    collates: dict = {"torch.cat+arange": cat_arange_packed}
    collates["assemble"] = fastcollate.assemble.using(packed_contract())
    if have_transformers():
        collates = {"DataCollatorWithFlattening": flattening_collator(), **collates}
    contenders = {
        f"per-sample + {name}": loader_epoch(
            DataLoader(per_sample, batch_sampler=sampler(documents, batch, seed), collate_fn=collate)
        )
        for name, collate in collates.items()
    }
    tokens = fastcollate.Ragged(values, offsets)
    arrays = Arrays({"input_ids": tokens, "labels": tokens}, id_key=None)
    contenders["Arrays + assemble, IndexBatches"] = loader_epoch(
        DataLoader(
            arrays,
            batch_sampler=fastcollate.IndexBatches(documents, batch, shuffle=True, seed=seed),
            collate_fn=fastcollate.assemble.using(packed_contract()),
        )
    )
    return contenders


def one_batch_at_a_time(batches_of: Callable[[int], dict], count: int) -> Epoch:
    """An epoch over ``count`` prepared batches, one call of ``batches_of(k)`` each, taken in turn across
    rounds (each batch's rows are fresh: not the cache's from the round before)."""
    taken = iter(range(2**62))

    def run(batches: int) -> Iterator:
        for _ in range(batches):
            yield batches_of(next(taken) % count)

    return run


def per_batch_tabular_contenders(columns: dict[str, torch.Tensor], batch: int, seed: int) -> dict:
    """One batch's cost, with nothing around it: ``assemble(arrays.__getitems__(indices))`` against
    index_select of each column into reused buffers, over the same random indices."""
    n = len(next(iter(columns.values())))
    generator = torch.Generator().manual_seed(seed)
    indices = [torch.randint(0, n, (batch,), generator=generator) for _ in range(4096)]
    as_numpy = [index.numpy() for index in indices]
    arrays = Arrays(columns)
    buffers = {name: torch.empty((batch, *c.shape[1:]), dtype=c.dtype) for name, c in columns.items()}

    def selected(k: int) -> dict:
        index = indices[k]
        selects = {name: torch.index_select(c, 0, index, out=buffers[name]) for name, c in columns.items()}
        return {"id": index, **selects}

    return {
        "Arrays + assemble, one batch": one_batch_at_a_time(
            lambda k: fastcollate.assemble(arrays.__getitems__(as_numpy[k])), len(indices)
        ),
        "index_select into reused buffers": one_batch_at_a_time(selected, len(indices)),
    }


def per_batch_packed_contenders(documents: int, batch: int, seed: int) -> dict:
    """One packed batch's cost (input_ids packed, with position_ids, cu_seq_lens and max_length beside):
    ``assemble(arrays.__getitems__(indices))`` against a bare torch.cat of the same rows (their views
    made beforehand, untimed), and torch.cat plus the position ids written into a reused buffer."""
    values, offsets = documents_corpus(documents)
    arrays = Arrays({"input_ids": fastcollate.Ragged(values, offsets)}, id_key=None)
    tokens = Field(dtype=torch.int64, shape=("T",), pack=True)
    contract = Contract({"input_ids": tokens}, id=None, packing=fastcollate.Packing())
    collate = fastcollate.assemble.using(contract)
    picks = torch.Generator().manual_seed(seed)
    indices = [torch.randint(0, documents, (batch,), generator=picks).numpy() for _ in range(1024)]
    rows = [[values[offsets[i] : offsets[i + 1]] for i in index] for index in indices]
    cu_seq_lens = [collate(arrays.__getitems__(index))["cu_seq_lens_q"] for index in indices]
    positions = torch.empty(int(max(cu[-1] for cu in cu_seq_lens)), dtype=torch.int64)

    def cat(k: int) -> dict:
        return {"input_ids": torch.cat(rows[k])[None], "cu_seq_lens_q": cu_seq_lens[k]}

    def cat_and_positions(k: int) -> dict:
        total = int(cu_seq_lens[k][-1])
        torch.arange(total, out=positions[:total])
        return cat(k)

    return {
        "Arrays + assemble, one packed batch": one_batch_at_a_time(
            lambda k: collate(arrays.__getitems__(indices[k])), len(indices)
        ),
        "torch.cat of the same rows": one_batch_at_a_time(cat, len(indices)),
        "torch.cat + position ids": one_batch_at_a_time(cat_and_positions, len(indices)),
    }


def worker_contenders(datasets: dict[str, tuple[dict[str, torch.Tensor], int]], seed: int) -> dict:
    """Arrays + assemble with IndexBatches at 0 and 2 workers, for each named (columns, batch size)."""
    out = {}
    for name, (columns, batch) in datasets.items():
        arrays = Arrays(columns)
        for workers in (0, 2):
            collate = fastcollate.Assembler()
            loader = DataLoader(
                arrays,
                batch_sampler=fastcollate.IndexBatches(len(arrays), batch, shuffle=True, seed=seed),
                collate_fn=collate,
                num_workers=workers,
                persistent_workers=workers > 0,
                worker_init_fn=samples_on_the_heap if workers else None,
            )
            out[f"{name}, workers={workers}"] = loader_epoch(loader)
            out[f"_collate {name} {workers}"] = collate
    return out


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
