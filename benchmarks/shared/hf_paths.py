"""The hf_ratios paths: the Hugging Face datasets it builds, saves and loads back, each path that collates
them (HF's own collate or format, its collate swapped for assemble, Arrays.from_hf with assemble), and
the check that every path's batch is HF's before any is timed."""

from __future__ import annotations

import dataclasses
import gc
import os
import pickle
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fastcollate
from fastcollate import Arrays, Contract, Field

SHARDS = 4  # Arrow files a dataset is saved in: a user's dataset is rarely one file


class BatchMismatch(AssertionError):
    """A path's batch differs from HF's on the same indices: its rate would not measure the same work."""


# ---------------------------------------------------------------------------------------------- datasets


def build_dataset(name: str, rows: int, seed: int):
    """The dataset in memory, made with pyarrow (a Python list per row would take longer than the
    benchmark): ``tokens`` or ``tabular``, as the module docstring describes."""
    import datasets
    import pyarrow as pa
    from datasets import Features, List, Sequence, Value
    from datasets.table import InMemoryTable

    rng = np.random.default_rng(seed)
    if name == "tokens":
        lengths = rng.integers(16, 513, rows)
        offsets = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = rng.integers(0, 32_000, int(offsets[-1]), dtype=np.int32)
        table = pa.table({"input_ids": pa.LargeListArray.from_arrays(offsets, values)})
        features = Features({"input_ids": List(Value("int32"))})
    else:
        features_64 = rng.standard_normal((rows, 64), dtype=np.float32)
        table = pa.table({
            "features": pa.FixedSizeListArray.from_arrays(features_64.ravel(), 64),
            "label": rng.integers(0, 10, rows, dtype=np.int64),
        })
        features = Features({"features": Sequence(Value("float32"), length=64), "label": Value("int64")})
    # datasets' own types (list<int32>, fixed_size_list<float32>[64] with its field names), as a
    # tokenizer's map or a load_dataset would have written them.
    table = InMemoryTable(table.cast(features.arrow_schema))
    return datasets.Dataset(table, info=datasets.DatasetInfo(features=features))


def saved_and_loaded(name: str, rows: int, seed: int, folder: Path, files: int = SHARDS):
    """The dataset as users have it: written with ``save_to_disk`` in ``files`` files (datasets' default
    writer batch size: 1000-row record batches), read back with ``load_from_disk`` (memory-mapped). A
    folder already there from an earlier run with the same rows, seed and files is read as it is."""
    import datasets

    path = folder / f"{name}-{rows}-seed{seed}-{files}shards"
    if not (path / "state.json").exists():
        build_dataset(name, rows, seed).save_to_disk(str(path), num_shards=files)
    return datasets.load_from_disk(str(path))


def describe_dataset(ds) -> dict[str, Any]:
    table = ds.data
    first = table.column(table.column_names[0])
    return {
        "rows": len(ds),
        "features": str(ds.features),
        "files": [f["filename"] for f in ds.cache_files],
        "record_batches": first.num_chunks,
        "bytes": table.nbytes,
    }


# ------------------------------------------------------------------------------------------- the paths


def packed_contract(copy_labels: bool) -> Contract:
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True)'s batch: int64 input_ids and labels
    packed into one row, -100 at each sequence's first label; position_ids, cu_seq_lens_q/k (int32) and
    max_length_q/k beside. ``copy_labels``: the samples hold only input_ids (the dataset's rows, as
    Python lists), labels a copy of them; else the samples hold labels (Arrays' second column)."""
    tokens = dict(dtype=torch.int64, shape=("T",), pack=True, cast_from=(torch.int32,))
    labels = dict(tokens, separator=-100)
    if copy_labels:
        labels["copy_of"] = "input_ids"
    return Contract({"input_ids": Field(**tokens), "labels": Field(**labels)}, id=None,
                    packing=fastcollate.Packing())


@dataclasses.dataclass
class Contender:
    """One path: its dataset and what makes its collate (None: the DataLoader's default one), or why it
    could not be made. Each loader gets a collate of its own: an Assembler's shared slots are sized for
    one loader's workers, and two loaders' batches in flight at once would overflow them."""

    dataset: Any = None
    make_collate: Callable[[], Callable] | None = None
    failed: str | None = None


def failed(error: BaseException) -> str:
    return f"failed: {type(error).__name__}: {error}"


def make_paths(kind: str, ds) -> dict[str, Contender]:
    """The paths of a case of ``kind`` (packed, tabular) over ``ds``."""
    paths: dict[str, Contender] = {}
    if kind == "packed":
        from transformers import DataCollatorWithFlattening

        paths["HF"] = Contender(ds, lambda: DataCollatorWithFlattening(return_flash_attn_kwargs=True))
        copied = packed_contract(copy_labels=True)
        paths["swapped"] = Contender(ds, lambda: fastcollate.assemble.using(copied))
        columns = {"input_ids": "input_ids", "labels": "input_ids"}
        packed = packed_contract(copy_labels=False)
        paths["Arrays"] = arrays_path(ds, lambda: fastcollate.assemble.using(packed), columns=columns)
        paths["stored"] = arrays_path(ds, lambda: fastcollate.assemble.using(packed), columns=columns,
                                      stored_dtypes=True)
    else:
        formatted = ds.with_format("torch")
        paths["HF"] = Contender(formatted, None)
        # fastcollate.assemble is an Assembler() made once: one of its own for each loader.
        paths["swapped"] = Contender(formatted, fastcollate.Assembler)
        paths["Arrays"] = arrays_path(ds, fastcollate.Assembler)
        paths["stored"] = arrays_path(ds, fastcollate.Assembler, stored_dtypes=True)
    return paths


def from_hf_cost(ds, columns: dict[str, str] | None, builds: int = 7) -> dict[str, Any]:
    """What ``Arrays.from_hf`` itself costs over ``ds``: the time to build it (median of ``builds``), the
    memory it takes beside the mapped files (RSS and pyarrow's allocated bytes, over the first build:
    the offsets it copies), against the bytes of the values it reads, and its pickled size."""
    import pyarrow as pa

    def resident() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    gc.collect()
    rss, allocated = resident(), pa.total_allocated_bytes()
    kept = Arrays.from_hf(ds, columns)
    grown = {"rss_bytes": resident() - rss, "pyarrow_allocated_bytes": pa.total_allocated_bytes() - allocated}
    times = []
    for _ in range(builds):
        started = time.perf_counter()
        Arrays.from_hf(ds, columns)
        times.append(time.perf_counter() - started)
    read = {name: ds.data.table.column(name) for name in set((columns or {}).values()) or ds.column_names}
    values = sum(sum(chunk.nbytes for chunk in column.chunks) for column in read.values())
    return {
        "rows": len(ds), "chunks": max(column.num_chunks for column in read.values()),
        "build_seconds": statistics.median(times), "build_seconds_all": times, **grown,
        "column_bytes": values, "pickled_bytes": len(pickle.dumps(kept)),
    }


def cost_line(cost: dict[str, Any]) -> str:
    mib = {key: cost[key] / 2**20 for key in ("rss_bytes", "pyarrow_allocated_bytes", "column_bytes")}
    share = max(mib["rss_bytes"], mib["pyarrow_allocated_bytes"]) / mib["column_bytes"]
    return (
        f"  Arrays.from_hf over {cost['rows']:,} rows in {cost['chunks']} chunks: built in "
        f"{cost['build_seconds'] * 1e3:.1f} ms (median); RSS +{mib['rss_bytes']:.1f} MiB, pyarrow "
        f"+{mib['pyarrow_allocated_bytes']:.1f} MiB ({share:.1%} of the {mib['column_bytes']:.0f} MiB read); "
        f"pickled {cost['pickled_bytes']:,} bytes"
    )


def arrays_path(ds, make_collate: Callable, **from_hf: Any) -> Contender:
    """``Arrays.from_hf(ds, **from_hf)`` with the collate ``make_collate`` makes."""
    try:
        return Contender(Arrays.from_hf(ds, **from_hf), make_collate)
    except Exception as error:
        return Contender(failed=failed(error))


def one_batch(path: Contender, indices: list[int]) -> Any:
    """The batch a DataLoader makes of ``indices``: its fetcher calls ``__getitems__``, then the
    collate (torch's default one where the path names none)."""
    from torch.utils.data import default_collate

    collate = path.make_collate() if path.make_collate else default_collate
    return collate(path.dataset.__getitems__(indices))


def batch_differences(reference: Mapping[str, Any], batch: Any, ignore: tuple[str, ...] = ()) -> list[str]:
    """How ``batch`` differs from ``reference``: keys, then each value's type, dtype, shape and
    contents (tensors compared exactly). Keys in ``ignore`` may be in ``batch`` beyond the reference's:
    an Arrays' id column, its sample indices, which HF's batch has no counterpart of."""
    if not isinstance(batch, Mapping):
        return [f"a {type(batch).__name__}, not a mapping"]
    problems = []
    missing, extra = set(reference) - set(batch), set(batch) - set(reference) - set(ignore)
    if missing or extra:
        problems.append(f"keys: missing {sorted(missing)}, extra {sorted(extra)}")
    for key in reference.keys() & batch.keys():
        want, got = reference[key], batch[key]
        if isinstance(want, torch.Tensor):
            if not isinstance(got, torch.Tensor):
                problems.append(f"{key}: a {type(got).__name__}, not a tensor")
            elif (got.dtype, got.shape) != (want.dtype, want.shape):
                problems.append(f"{key}: {got.dtype} {tuple(got.shape)}, not {want.dtype} "
                                f"{tuple(want.shape)}")
            elif not torch.equal(got, want):
                where = tuple((got != want).nonzero()[0].tolist())
                problems.append(f"{key}: differs first at {list(where)}: {got[where]} != {want[where]}")
        elif type(got) is not type(want) or got != want:
            problems.append(f"{key}: {got!r} ({type(got).__name__}), not {want!r} ({type(want).__name__})")
    return problems


def check_same_batch(name: str, reference: Mapping[str, Any], batch: Any,
                     ignore: tuple[str, ...] = ()) -> None:
    """Raises BatchMismatch, naming every difference, unless ``batch`` equals HF's ``reference``."""
    problems = batch_differences(reference, batch, ignore)
    if problems:
        raise BatchMismatch(f"{name}: its batch is not HF's on the same indices, so its rate would not "
                            "measure the same work:\n  " + "\n  ".join(problems))


def check_paths(paths: dict[str, Contender], indices: list[int]) -> None:
    """Every path that runs makes HF's batch of ``indices`` (BatchMismatch otherwise); a path that
    raises is marked failed and left out of the timing."""
    reference = one_batch(paths["HF"], indices)
    for name, path in paths.items():
        if name == "HF" or path.failed:
            continue
        try:
            batch = one_batch(path, indices)
        except Exception as error:
            path.failed = failed(error)
            continue
        indexed = isinstance(path.dataset, Arrays) and path.dataset.index_as
        ignore = (path.dataset.index_as,) if indexed else ()
        check_same_batch(name, reference, batch, ignore)
