"""The array_ratios contenders: per-sample datasets with default_collate and assemble, the batched-index
idiom, Arrays gathered by assemble (tabular, images, tokens, packed documents, with workers), and the
floors (index_select into reused buffers, torch.cat), each an Epoch of batches."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

import fastcollate
from fastcollate import Arrays, Contract, Field, TokenWindows
from fastcollate.tools.bench.malloc import samples_on_the_heap

from .collate_contenders import cat_arange_packed, flattening_collator, have_transformers, packed_contract
from .rounds import Epoch, endless, loader_epoch


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
    arrays = Arrays(columns, index_as="id")
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
    windows = TokenWindows(data, length=block, step=1, index_as="id")  # ids, as the baseline yields
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
    """Packed causal-LM batches (collate_contenders.packed_contract: DataCollatorWithFlattening's keys) of the
    same shuffled documents, 16..2048 int64 tokens each: per-sample datasets with the collator, with
    torch.cat + arange, and with assemble; and the corpus as Arrays' Ragged columns, packed from values
    and offsets with no sample made."""
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
    arrays = Arrays({"input_ids": tokens, "labels": tokens})
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
    arrays = Arrays(columns, index_as="id")
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
    arrays = Arrays({"input_ids": fastcollate.Ragged(values, offsets)})
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
        arrays = Arrays(columns, index_as="id")
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
