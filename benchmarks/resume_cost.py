"""What a resume costs: the time from a fresh loader and a saved state to the first batch of the resumed
epoch in hand, for a state taken after batch 1, at the middle and before the last batch of an epoch,
for four ways to resume a shuffled epoch with torchdata's ``StatefulDataLoader``, side by side in one run.

    python -m benchmarks.resume_cost [--n 4194304] [--batch-size 256] [--rounds 8] [--workers 0 2]
                                     [--seed 0] [--json PATH]

The contenders (``CONTENDERS``), each a ``StatefulDataLoader`` over a dataset whose sample i is i (one
``torch.as_tensor`` a batch, so the sampler's cost is what is timed):

* ``IndexBatches``: ``fastcollate.IndexBatches(shuffle=True)`` as ``batch_sampler``, resumed by
  ``loader.load_state_dict``.
* ``IndexBatches, sampler's part``: the same, resumed through ``fastcollate.sampler_state``: the
  sampler loads its part of the loader's state and a fresh loader is made over it (the path for
  another ``num_workers``; here it loads the same state as the row above).
* ``replay``: ``torch.utils.data.BatchSampler`` over a user's seeded shuffle that has no
  ``state_dict``. ``StatefulDataLoader`` then fast-forwards the batch sampler's iterator with
  ``itertools.islice`` past the batches consumed: O(batches consumed) in Python. The sampler yields
  from a list, the cheapest replay a user's sampler can have.
* ``RandomSampler``: ``shuffle=True, batch_size=...``, for which ``StatefulDataLoader`` swaps in its
  own stateful ``RandomSampler`` and ``BatchSampler``. Its state is the generator's and a count of
  samples yielded; its resume draws the permutation as a list of n ints (four times over, with
  torchdata 0.11) and steps through it one ``next()`` a sample: O(samples consumed) in Python.

Method. The states are taken once, before the rounds: one loader per contender runs epoch 0 and,
after k batches, its ``state_dict()`` goes through ``torch.save`` and
``torch.load(weights_only=True)`` (its size is reported), and the batch the loader yields next is kept:
the uninterrupted run's batch k. A timed resume makes a fresh loader (and sampler), loads the state,
and takes ``next(iter(loader))``; the batch must equal batch k, or the run stops (a benchmark that
times a wrong resume is worthless). With ``--workers`` above 0, ``IndexBatches`` and ``replay`` are
measured there too: starting the workers is then in every resume. A round times every cell once in a
freshly shuffled order (seeded); the first round is a warm-up (kept in the JSON, left out of the
medians). A ratio is the median of the per-round ratios, min-max beside, ``~`` unless it clears the
noise (the two cells' runs apart or, from 8 rounds, every per-round ratio on one side of 1:
``fastcollate.tools.bench.ratios``). One torch thread; glibc's malloc as it comes.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import io
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils.data import BatchSampler, Dataset, Sampler
from torchdata.stateful_dataloader import Stateful, StatefulDataLoader

import fastcollate
from benchmarks.shared.report_header import header_line, report_header
from fastcollate.tools.bench.ratios import PairedRatio, paired_ratio

POSITIONS = ("first", "middle", "last")


class Ids(Dataset):
    """Sample i is i; a batch is one tensor of its indices, made in one call."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return int(index)

    def __getitems__(self, indices) -> torch.Tensor:
        return torch.as_tensor(indices)


def keep(batch: torch.Tensor) -> torch.Tensor:
    return batch


class SeededShuffle(Sampler[int]):
    """A user's sampler with no state: the same shuffle of ``range(n)`` every time it is iterated, so a
    replay of its first k batches lands on the uninterrupted run's batch k."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed)
        yield from torch.randperm(self.n, generator=generator).tolist()


@dataclasses.dataclass(frozen=True)
class Setup:
    n: int
    batch_size: int
    seed: int

    def loader(self, workers: int, **sampling) -> StatefulDataLoader:
        return StatefulDataLoader(Ids(self.n), collate_fn=keep, num_workers=workers, **sampling)

    def index_batches(self) -> fastcollate.IndexBatches:
        return fastcollate.IndexBatches(self.n, self.batch_size, shuffle=True, seed=self.seed)


@dataclasses.dataclass(frozen=True)
class Contender:
    """``make(setup, workers)``: the loader an uninterrupted run uses; ``resume(setup, workers, state)``:
    a fresh loader that continues from ``state`` (by default ``make``'s, given ``load_state_dict(state)``).
    ``states_of``: the contender whose states it loads."""

    name: str
    make: Callable[[Setup, int], StatefulDataLoader]
    resumes_by: Callable[[Setup, int, dict], StatefulDataLoader] | None = None
    states_of: str | None = None
    with_workers: bool = True  # measured at every --workers count, not only at 0

    @property
    def source(self) -> str:
        return self.states_of or self.name

    def resume(self, setup: Setup, workers: int, state: dict) -> StatefulDataLoader:
        if self.resumes_by is not None:
            return self.resumes_by(setup, workers, state)
        loader = self.make(setup, workers)
        loader.load_state_dict(state)
        return loader


def _index_batches(setup: Setup, workers: int) -> StatefulDataLoader:
    return setup.loader(workers, batch_sampler=setup.index_batches())


def _sampler_part(setup: Setup, workers: int, state: dict) -> StatefulDataLoader:
    sampler = setup.index_batches()
    sampler.load_state_dict(fastcollate.sampler_state(state))
    return setup.loader(workers, batch_sampler=sampler)


def _replay(setup: Setup, workers: int) -> StatefulDataLoader:
    batches = BatchSampler(SeededShuffle(setup.n, setup.seed), setup.batch_size, drop_last=False)
    if isinstance(batches, Stateful):
        raise AssertionError("the replay contender's batch sampler keeps state: it would not replay")
    return setup.loader(workers, batch_sampler=batches)


def _random_sampler(setup: Setup, workers: int) -> StatefulDataLoader:
    generator = torch.Generator()
    generator.manual_seed(setup.seed)
    return setup.loader(workers, batch_size=setup.batch_size, shuffle=True, generator=generator)


CONTENDERS = (
    Contender("IndexBatches", _index_batches),
    Contender(
        "IndexBatches, sampler's part", _index_batches, _sampler_part, "IndexBatches", with_workers=False
    ),
    Contender("replay", _replay),
    Contender("RandomSampler", _random_sampler, with_workers=False),
)


def positions(batches: int) -> dict[str, int]:
    """The batches consumed before each state: after batch 1, half the epoch, all but the last."""
    if batches < 3:
        raise ValueError(f"an epoch of {batches} batches has no middle: use a larger --n")
    return {"first": 1, "middle": batches // 2, "last": batches - 1}


def through_disk(state: dict) -> tuple[dict, int]:
    """The state as a checkpoint gives it back, and its size in bytes."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    size = buffer.tell()
    buffer.seek(0)
    return torch.load(buffer, weights_only=True), size


def take_states(contender: Contender, setup: Setup, workers: int, at: dict[str, int]) -> dict[str, dict]:
    """One uninterrupted epoch of ``contender``'s loader: at each position, the state after k batches,
    its size, and batch k (what the resumed loader must yield first)."""
    taken = {}
    loader = contender.make(setup, workers)
    iterator = iter(loader)
    consumed = 0
    for name, k in sorted(at.items(), key=lambda item: item[1]):
        for _ in range(k - consumed):
            next(iterator)
        state, size = through_disk(loader.state_dict())
        taken[name] = {"k": k, "state": state, "bytes": size, "batch_k": next(iterator)}
        consumed = k + 1
    del iterator, loader
    return taken


def timed_resume(contender: Contender, setup: Setup, workers: int, taken: dict) -> float:
    """Seconds from a fresh loader and the state to the resumed epoch's first batch; raises unless that
    batch is the uninterrupted run's batch k."""
    gc.collect()
    start = time.perf_counter()
    loader = contender.resume(setup, workers, taken["state"])
    iterator = iter(loader)
    batch = next(iterator)
    seconds = time.perf_counter() - start
    del iterator, loader  # workers shut down here, outside the timing
    if not torch.equal(batch, taken["batch_k"]):
        raise AssertionError(
            f"{contender.name} at workers={workers}: the resume after {taken['k']} batches yielded "
            f"{batch[:4].tolist()}... first, not the uninterrupted run's batch {taken['k']} "
            f"({taken['batch_k'][:4].tolist()}...): it does not resume where the state was taken"
        )
    return seconds


def run(setup: Setup, workers: list[int], rounds: int, contenders=CONTENDERS) -> dict:
    batches = -(-setup.n // setup.batch_size)
    at = positions(batches)
    cells = [(c, w) for w in workers for c in contenders if w == 0 or c.with_workers]
    states = {}
    for contender, count in cells:
        if (contender.source, count) not in states:
            started = time.perf_counter()
            source = next(c for c in contenders if c.name == contender.source)
            states[(contender.source, count)] = take_states(source, setup, count, at)
            print(
                f"  states of {contender.source} at workers={count}: {time.perf_counter() - started:.1f} s",
                flush=True,
            )
    order = random.Random(setup.seed)
    runs = []
    for round_index in range(rounds + 1):
        timed = [(c, w, p) for c, w in cells for p in POSITIONS]
        order.shuffle(timed)
        for contender, count, position in timed:
            taken = states[(contender.source, count)][position]
            seconds = timed_resume(contender, setup, count, taken)
            runs.append(
                {
                    "round": round_index,
                    "warmup": round_index == 0,
                    "contender": contender.name,
                    "workers": count,
                    "position": position,
                    "batches_before": taken["k"],
                    "seconds": seconds,
                    "resumed_batch_checked": True,
                }
            )
        print(f"  round {round_index}/{rounds}{' (warm-up)' if round_index == 0 else ''}", flush=True)
    return {
        "cells": [[c.name, w] for c, w in cells],
        "n": setup.n,
        "batch_size": setup.batch_size,
        "batches_per_epoch": batches,
        "positions": at,
        "state_bytes": {
            f"{c.name} @ workers={w}": states[(c.source, w)]["last"]["bytes"]
            if c.states_of is None
            else _part_bytes(states[(c.source, w)]["last"]["state"])
            for c, w in cells
        },
        "runs": runs,
    }


def _part_bytes(loader_state: dict) -> int:
    """What the sampler's part weighs on its own: a checkpoint may keep just that."""
    return through_disk(fastcollate.sampler_state(loader_state))[1]


def summarize(result: dict) -> list[str]:
    """The table: median seconds at each position, last over first and, at the last batch, over the
    IndexBatches resume at the same workers (both paired per round), and the state's size."""
    by: dict[tuple[str, int, str], dict[int, float]] = {}
    for r in result["runs"]:
        if not r["warmup"]:
            by.setdefault((r["contender"], r["workers"], r["position"]), {})[r["round"]] = r["seconds"]
    cells = [(c, w) for c, w in result["cells"] if (c, w, "last") in by]
    result["medians_s"], result["ratios"] = {}, {}
    lines = [
        f"n={result['n']:,}, batch {result['batch_size']}: {result['batches_per_epoch']:,} batches; resumed "
        f"after {', '.join(f'{k:,}' for k in result['positions'].values())} batches",
        f"  {'median seconds to the first batch':<40}{'first':>8}{'middle':>8}{'last':>8}"
        f"{'last / first':>21}{'state':>9}",
    ]
    for contender, count in cells:
        key = f"{contender} @ workers={count}"
        medians = {p: statistics.median(by[(contender, count, p)].values()) for p in POSITIONS}
        result["medians_s"][key] = medians
        ratio = paired_ratio(by[(contender, count, "last")], by[(contender, count, "first")])
        result["ratios"][f"{key}: last / first"] = ratio.to_json()
        if contender != "IndexBatches" and ("IndexBatches", count, "last") in by:
            against = paired_ratio(by[(contender, count, "last")], by[("IndexBatches", count, "last")])
            result["ratios"][f"{key}: last / IndexBatches @ workers={count} last"] = against.to_json()
        name = f"{contender}, workers={count}"
        lines.append(
            f"  {name:<40}"
            + "".join(f"{medians[p]:>8.3f}" for p in POSITIONS)
            + f"{ratio.text():>21}{result['state_bytes'][key]:>8,}B"
        )
    lines.append("  at the last batch, against IndexBatches at the same workers:")
    for name, kept in result["ratios"].items():
        if "/ IndexBatches" in name:
            lines.append(f"    {name.split(':')[0]}: {PairedRatio.from_json(kept).text()}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1 << 22, help="samples in the epoch")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument(
        "--workers",
        nargs="+",
        type=int,
        default=[0, 2],
        help="worker counts; above 0, only IndexBatches and replay are measured",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1 (the warm-up round is extra)")
    if 0 not in args.workers:
        parser.error("--workers must include 0: every contender is measured there")
    torch.set_num_threads(1)
    header = report_header()
    print(header_line(header))
    print(
        f"{args.rounds} rounds after one warm-up; one torch thread; seconds are medians; ratios: the\n"
        "median (min-max) of the per-round ratios, ~ where the runs overlap",
        flush=True,
    )
    started = time.perf_counter()
    result = run(Setup(args.n, args.batch_size, args.seed), sorted(set(args.workers)), args.rounds)
    lines = summarize(result)
    print("\n".join(lines))
    seconds = time.perf_counter() - started
    print(f"whole run: {seconds:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**header, "seconds": seconds, **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
