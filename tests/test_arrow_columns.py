"""Arrays.from_hf and Arrays.from_arrow: columns read where they lie in Arrow files, chunk by chunk, with
sample i being dataset[i] through Hugging Face's select, shuffle, shard, splits and concatenation; no copy
of the values; pickled by file; and every bad column, file or index named."""

from __future__ import annotations

import os
import pickle
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

datasets = pytest.importorskip("datasets")
from datasets import Array2D, Dataset, Features, Sequence, Value  # noqa: E402

import fastcollate  # noqa: E402
from fastcollate import Arrays, Contract, Field, Packing, assemble  # noqa: E402
from fastcollate.data.mapped_files import MappedFileError  # noqa: E402

from .helpers.batches import assert_same_batch  # noqa: E402

FEATURES = Features(
    {
        "input_ids": Sequence(Value("int32")),
        "label": Value("int64"),
        "features": Sequence(Value("float32"), length=4),
        "grid": Array2D(shape=(2, 3), dtype="float32"),
        "frames": Array2D(shape=(None, 3), dtype="int16"),
    }
)


def _rows(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "input_ids": [rng.integers(0, 1000, rng.integers(0, 20)).tolist() for _ in range(n)],
        "label": list(range(n)),
        "features": rng.random((n, 4), dtype=np.float32).tolist(),
        "grid": [np.full((2, 3), i, dtype=np.float32) for i in range(n)],
        "frames": [np.full((i % 4 + 1, 3), i, dtype=np.int16) for i in range(n)],
    }


def _written(path, rows: dict, features: Features | None = None, chunk: int = 64) -> Dataset:
    """A dataset of ``rows`` written to Arrow files under ``path`` in chunks of ``chunk`` rows, as
    Hugging Face writes what it loads or maps, memory-mapped from there."""
    samples = [dict(zip(rows, values, strict=True)) for values in zip(*rows.values(), strict=True)]
    dataset = Dataset.from_generator(
        _samples,
        gen_kwargs={"samples": samples},
        features=features,
        writer_batch_size=chunk,
        cache_dir=str(path),
    )
    assert dataset.cache_files
    return dataset


def _samples(samples):
    yield from samples


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A dataset in three files of several chunks each."""
    parts = [_written(tmp_path_factory.mktemp("hf"), _rows(200, seed), FEATURES) for seed in range(3)]
    dataset = datasets.concatenate_datasets(parts)
    assert len(dataset.cache_files) == 3 and dataset.data.table.column("label").num_chunks == 12
    return dataset


def _loaded(path, n: int = 300) -> Dataset:
    return _written(path, _rows(n), FEATURES, chunk=100)


def _same_as_hf(arrays: Arrays, dataset: Dataset, positions) -> None:
    """Sample i is dataset[i], value for value (in the Arrow column's dtype: HF's formats may widen it)."""
    reference = dataset.with_format("numpy")
    for i in positions:
        ours, theirs = arrays[i], reference[i]
        assert set(ours) == set(theirs) & set(arrays.columns), "every column, or those asked for"
        for key in ours:
            expected = torch.from_numpy(np.asarray(theirs[key]))
            assert torch.equal(ours[key], expected.to(ours[key].dtype)), (i, key)


VIEWS = {
    "as saved": lambda d: d,
    "shuffled": lambda d: d.shuffle(seed=3),
    "selected": lambda d: d.select([5, 3, 590, 3]),
    "a contiguous range": lambda d: d.select(range(150, 470)),
    "a shard": lambda d: d.shard(num_shards=4, index=1),
    "a split": lambda d: d.train_test_split(test_size=0.25, seed=0)["test"],
    "sorted": lambda d: d.sort("label", reverse=True),
    "filtered": lambda d: d.filter(lambda row: row["label"] % 3 == 0),
    "concatenated": lambda d: datasets.concatenate_datasets([d.select(range(10, 20)), d.shuffle(seed=1)]),
    "mapped in batches": lambda d: d.map(lambda b: {"label": [x * 2 for x in b["label"]]}, batched=True),
    "formatted": lambda d: d.with_format("numpy"),
}


@pytest.mark.parametrize("view", list(VIEWS))
def test_sample_i_is_dataset_i_through_every_way_of_making_a_dataset(saved, view):
    dataset = VIEWS[view](saved)
    arrays = Arrays.from_hf(dataset)
    assert len(arrays) == len(dataset)
    _same_as_hf(arrays, dataset, sorted({0, len(dataset) // 2, len(dataset) - 1}))
    indices = np.random.default_rng(0).integers(0, len(dataset), 40)
    fixed = Arrays.from_hf(dataset, ["label", "features", "grid"])
    batch = assemble(fixed.__getitems__(indices))
    reference = dataset.with_format("numpy")
    for key in ("label", "features", "grid"):
        expected = torch.from_numpy(np.stack([reference[int(i)][key] for i in indices]))
        assert torch.equal(batch[key], expected.to(batch[key].dtype)), key
    dataset_rows = Arrays.from_hf(dataset)  # per sample, checked against HF above
    padded = Contract(
        {"input_ids": Field(shape=("T",), pad=-1), "frames": Field(shape=("F", 3), pad=7)}, id=None
    )
    gathered = assemble.using(padded)(Arrays.from_hf(dataset, ["input_ids", "frames"]).__getitems__(indices))
    walked = assemble.using(padded)(
        [
            {key: arrays_row[key] for key in ("input_ids", "frames")}
            for arrays_row in (dataset_rows[int(i)] for i in indices)
        ]
    )
    for key in walked:
        assert torch.equal(gathered[key], walked[key]), key


def test_the_columns_are_read_where_arrow_keeps_them(saved):
    allocated = pa.total_allocated_bytes()
    arrays = Arrays.from_hf(saved, {"input_ids": "input_ids", "labels": "input_ids", "grid": "grid"})
    assert pa.total_allocated_bytes() == allocated, "pyarrow allocated: a column was copied"
    chunks = saved.data.table.column("input_ids").chunks
    column = arrays.columns["input_ids"]
    assert len(column.chunks) == len(chunks) > 3
    for ours, theirs in zip(column.chunks, chunks, strict=True):
        start = theirs.values.buffers()[1].address + theirs.values.offset * 4
        assert ours.values.data_ptr() == start + int(theirs.offsets[0]) * 4
    assert column.first.dtype == torch.int32, "the Arrow dtype, not a widened copy"
    labels = arrays.columns["labels"]
    assert labels.chunks[0].values.data_ptr() == column.chunks[0].values.data_ptr(), "one column, two keys"
    grid = saved.data.table.column("grid").chunks[0].storage.values.values
    assert arrays.columns["grid"].chunks[0].rows.data_ptr() == grid.buffers()[1].address + grid.offset * 4


def test_a_packed_batch_equals_hugging_face_s_flattening_collator(saved):
    transformers = pytest.importorskip("transformers")
    contract = Contract(
        {
            "input_ids": Field(dtype=torch.int64, shape=("T",), pack=True, cast_from=(torch.int32,)),
            "labels": Field(
                dtype=torch.int64, shape=("T",), pack=True, separator=-100, cast_from=(torch.int32,)
            ),
        },
        id=None,
        packing=Packing(),
    )
    dataset = saved.filter(lambda row: len(row["input_ids"]) > 0).shuffle(seed=5)
    arrays = Arrays.from_hf(dataset, {"input_ids": "input_ids", "labels": "input_ids"})
    theirs = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    indices = list(range(0, 64, 3))
    ours = assemble.using(contract)(arrays.__getitems__(indices))
    assert_same_batch(ours, theirs([{"input_ids": dataset[i]["input_ids"]} for i in indices]))


def test_pickled_it_names_its_files_and_a_spawned_worker_delivers_every_sample_once(saved):
    dataset = saved.shuffle(seed=2)
    arrays = Arrays.from_hf(dataset, ["label", "input_ids"])
    pickled = pickle.dumps(arrays)
    assert len(pickled) < 64 << 10
    again = pickle.loads(pickled)
    _same_as_hf(again, dataset, [0, 7, len(dataset) - 1])
    contract = Contract({"label": Field(kind="number"), "input_ids": Field(shape=("T",), pad=0)}, id=None)
    loader = DataLoader(
        arrays,
        batch_size=64,
        num_workers=2,
        multiprocessing_context="spawn",
        collate_fn=assemble.using(contract),
        shuffle=True,
    )
    labels = torch.cat([batch["label"] for batch in loader])
    assert sorted(labels.tolist()) == sorted(dataset["label"])


def test_an_in_memory_dataset_pickles_by_value_and_says_so():
    arrays = Arrays.from_hf(Dataset.from_dict({"x": [1, 2, 3]}))
    with pytest.warns(UserWarning, match="in-memory Hugging Face dataset .* pickled by value"):
        again = pickle.loads(pickle.dumps(arrays))
    assert again[2]["x"].item() == 3


def test_a_file_that_shrinks_under_the_dataset_is_named_before_a_read(tmp_path):
    dataset = _loaded(tmp_path / "d")
    arrays = Arrays.from_hf(dataset, ["label", "input_ids"])
    victim = arrays.columns["input_ids"].watched[0].path
    with open(victim, "r+b") as file:
        file.truncate(os.path.getsize(victim) // 2)
    contract = Contract({"label": Field(kind="number"), "input_ids": Field(shape=("T",), pad=0)}, id=None)
    with pytest.raises(MappedFileError, match=r"column '(label|input_ids)': its file .* shrank"):
        assemble.using(contract)(arrays.__getitems__(list(range(len(arrays)))))
    with pytest.raises(MappedFileError, match="shrank"):
        arrays[0]


def test_a_file_replaced_under_its_path_is_refused_where_the_dataset_is_unpickled(tmp_path):
    dataset = _loaded(tmp_path / "d")
    arrays = Arrays.from_hf(dataset, ["label"])
    pickled = pickle.dumps(arrays)
    path = dataset.cache_files[0]["filename"]
    replacement = path + ".new"
    with open(path, "rb") as original, open(replacement, "wb") as copy:
        copy.write(original.read())
    os.replace(replacement, path)  # the same bytes, another file
    again = pickle.loads(pickled)
    with pytest.raises(
        MappedFileError, match="column 'label': its file .* is not one the dataset was made from"
    ):
        again[0]


VARYING = r"column 'x' .* lists within lists whose lengths are not declared"
NULLS = r"column 'x' has 1 missing values \(nulls\)"


def test_a_dataset_that_cannot_be_made_again_refuses_every_read_naming_its_columns(tmp_path):
    dataset = _loaded(tmp_path / "d")
    pickled = pickle.dumps(Arrays.from_hf(dataset, ["label"]))
    os.rename(dataset.cache_files[0]["filename"], tmp_path / "moved.arrow")
    again = pickle.loads(pickled)  # as a spawned worker does: it must start, and say why on its first read
    assert len(again) == len(dataset)
    refused = "columns 'label': the dataset cannot be made again in this process"
    with pytest.raises(MappedFileError, match=refused):
        assemble(again.__getitems__([0, 1]))


def test_what_it_reads_is_fixed_when_it_is_made_and_it_holds_no_descriptor(tmp_path):
    dataset = _loaded(tmp_path / "d")
    columns = {"label": "label"}
    descriptors = len(os.listdir("/proc/self/fd"))
    arrays = Arrays.from_hf(dataset, columns)
    assert len(os.listdir("/proc/self/fd")) == descriptors
    assert arrays.columns["label"].watched, "its file is watched all the same"
    columns["label"] = "input_ids"  # the caller's dict, changed after
    dataset.set_format("numpy", columns=["input_ids"])  # the dataset's format, changed after
    again = pickle.loads(pickle.dumps(arrays))
    assert list(again.columns) == ["label"] and again[5]["label"].item() == 5


def test_a_sample_is_a_copy_and_a_batch_is_gathered_from_the_file(saved):
    arrays = Arrays.from_hf(saved, ["grid"])
    mapped = arrays.columns["grid"].chunks[0].rows
    assert arrays[0]["grid"].data_ptr() != mapped.data_ptr(), "ds[i] outlives a file that shrinks"
    assert torch.equal(arrays[0]["grid"], mapped[0])


def test_a_relative_ipc_path_is_read_again_from_where_it_was_made(tmp_path, monkeypatch):
    table = pa.table({"x": pa.array([1, 2, 3], type=pa.int64())})
    with pa.OSFile(str(tmp_path / "data.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    monkeypatch.chdir(tmp_path)
    pickled = pickle.dumps(Arrays.from_arrow("data.arrow"))
    monkeypatch.chdir("/")
    assert pickle.loads(pickled)[2]["x"].item() == 3


def test_a_large_index_map_in_memory_is_said_to_go_by_value(saved):
    picked = saved.select(list(range(599, -1, -1)) * 20)  # an index map of 96,000 bytes
    with pytest.warns(UserWarning, match="index map .* is in memory, 96,000 B"):
        pickle.dumps(Arrays.from_hf(picked, ["label"]))


@pytest.mark.parametrize(
    ("rows", "columns", "error", "match"),
    [
        (
            {"x": [1, 2]},
            ["y"],
            KeyError,
            r"column 'y' \(for key 'y'\) does not exist; the columns are \['x'\]",
        ),
        ({"text": ["a", "b"]}, None, TypeError, r"column 'text' holds text or bytes .*tokenize it"),
        (
            {"flag": [True, False]},
            None,
            TypeError,
            r"column 'flag' holds booleans .*cast the column to uint8",
        ),
        (
            {"x": [[[1], [2, 3]], [[4]]]},
            None,
            TypeError,
            r"column 'x' .* lists within lists whose lengths are not declared",
        ),
        ({"x": [[[[1]]], [[[2]]]]}, None, TypeError, VARYING),
        ({"x": [1, None, 3]}, None, ValueError, NULLS),
        ({"x": [[1], [None]]}, None, ValueError, NULLS),
        (
            {"pair": [{"a": 1}, {"a": 2}]},
            None,
            TypeError,
            r"column 'pair' has type struct<a: int64>, which has",
        ),
    ],
)
def test_a_column_arrays_cannot_read_is_refused_by_name(rows, columns, error, match):
    with pytest.raises(error, match=match):
        Arrays.from_hf(Dataset.from_dict(rows), columns)


def test_a_streaming_dataset_or_a_dataset_dict_is_refused_with_what_to_do_instead():
    streaming = Dataset.from_dict({"x": [1, 2]}).to_iterable_dataset()
    with pytest.raises(TypeError, match="streaming dataset .* no rows to read by index"):
        Arrays.from_hf(streaming)
    splits = datasets.DatasetDict({"train": Dataset.from_dict({"x": [1]})})
    with pytest.raises(TypeError, match=r"pass one, e.g. Arrays.from_hf\(dataset\['train'\]\)"):
        Arrays.from_hf(splits)


def test_an_index_outside_a_selected_dataset_is_refused_before_any_read(saved):
    arrays = Arrays.from_hf(saved.select([4, 8, 15]))
    with pytest.raises(IndexError, match="index 3 is out of range for a dataset of 3 samples"):
        assemble(arrays.__getitems__([0, 3]))
    with pytest.raises(IndexError, match="index 3 is out of range"):
        arrays[3]


def test_an_ipc_file_a_memory_mapped_table_and_parquet_read_the_same(tmp_path):
    tokens = pa.array([[1, 2, 3], [], [4], [5, 6]], type=pa.list_(pa.int32()))
    table = pa.table({"tokens": tokens, "label": pa.array([0, 1, 2, 3], type=pa.int64())})
    ipc, parquet = tmp_path / "data.arrow", tmp_path / "data.parquet"
    with pa.OSFile(str(ipc), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=3):
            writer.write_batch(batch)
    pq.write_table(table, str(parquet), row_group_size=2)
    mapped = pa.ipc.open_file(pa.memory_map(str(ipc))).read_all()
    contract = Contract({"tokens": Field(shape=("T",), pad=0), "label": Field(kind="number")}, id=None)
    expected = [[0, 0, 0], [5, 6, 0], [1, 2, 3]]
    for source in (ipc, str(ipc), mapped, pq.read_table(str(parquet)), table.to_batches()[0]):
        arrays = Arrays.from_arrow(source)
        if isinstance(source, pa.RecordBatch):
            assert len(arrays) == 4
        batch = assemble.using(contract)(arrays.__getitems__([1, 3, 0]))
        assert batch["tokens"].tolist() == expected and batch["label"].tolist() == [1, 3, 0]
    by_path = Arrays.from_arrow(ipc)
    assert by_path.columns["tokens"].watched, "the file is watched"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(pickle.dumps(by_path)) < 4096
    with pytest.warns(UserWarning, match="a Table is pickled by value"):
        pickle.dumps(Arrays.from_arrow(mapped))


def test_a_path_that_is_no_ipc_file_names_its_reader_and_keeps_pyarrows_words_as_the_cause(tmp_path):
    table = pa.table({"x": list(range(1000))})
    parquet, whole, cut = tmp_path / "data.parquet", tmp_path / "whole.arrow", tmp_path / "cut.arrow"
    pq.write_table(table, str(parquet))
    with pa.OSFile(str(whole), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    for path, reader in ((parquet, "It is a Parquet file: read it with pyarrow.parquet.read_table(path)"),
                         (cut, "It begins as an Arrow IPC file does, so it may be cut short or damaged")):
        with pytest.raises(ValueError) as caught:
            Arrays.from_arrow(str(path))
        message, cause = str(caught.value), caught.value.__cause__
        assert message.startswith(f"Arrays.from_arrow: {path} is not an Arrow IPC file. {reader}"), message
        assert isinstance(cause, pa.ArrowInvalid) and "metadata bytes" in str(cause)
        assert str(cause) not in message and "metadata bytes" not in message


def test_an_extension_type_of_unknown_layout_is_refused():
    ids = pa.ExtensionArray.from_storage(pa.uuid(), pa.array([b"0" * 16, b"1" * 16], pa.binary(16)))
    with pytest.raises(TypeError, match="column 't' has the extension type .* whose layout Arrays does not"):
        Arrays.from_arrow(pa.table({"t": ids}))


def test_random_chunkings_of_an_arrow_column_give_the_batch_of_one_chunk():
    rng = np.random.default_rng(7)
    rows = [rng.integers(0, 50, rng.integers(0, 6)).tolist() for _ in range(200)]
    whole = pa.chunked_array([pa.array(rows, type=pa.list_(pa.int64()))])
    contract = Contract({"t": Field(shape=("T",), pad=-1)}, id=None)
    indices = rng.integers(0, 200, 64)
    expected = assemble.using(contract)(Arrays.from_arrow(pa.table({"t": whole})).__getitems__(indices))
    for _ in range(20):
        cuts = np.sort(rng.integers(0, 201, rng.integers(1, 8)))
        pieces = [whole.slice(a, b - a) for a, b in zip([0, *cuts], [*cuts, 200], strict=True)]
        chunked = pa.chunked_array([c for p in pieces for c in p.chunks], type=whole.type)
        ours = assemble.using(contract)(Arrays.from_arrow(pa.table({"t": chunked})).__getitems__(indices))
        assert_same_batch(ours, expected)


def test_fastcollate_imports_neither_datasets_nor_pyarrow_until_asked():
    import subprocess
    import sys

    code = "import fastcollate, sys; print('datasets' in sys.modules, 'pyarrow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
    assert fastcollate.Arrays.from_hf and fastcollate.Arrays.from_arrow
