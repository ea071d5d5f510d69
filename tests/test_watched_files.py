"""Arrow files under Arrays.from_hf and from_arrow: content decides, not timestamps (a touched file is read
on, by this process and by one that opens the dataset again by path; a file rewritten with the same size
but its record batches elsewhere is refused by name, with both times as dates), and a read checks the files
of the rows it reads alone, however many files the dataset spans."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest
import torch

datasets = pytest.importorskip("datasets")

import fastcollate  # noqa: E402
from fastcollate import Arrays, Contract, Field, MappedFileError, Packing, assemble  # noqa: E402
from fastcollate.data.arrow_layout import layout_digest  # noqa: E402
from fastcollate.data.mapped_files import WatchedFile  # noqa: E402

from .helpers.processes import ROOT  # noqa: E402

DATE = r"modified \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{9} UTC"
PACKED = Contract(
    {"tokens": Field(shape=("T",), pack=True), "label": Field(kind="number")}, id=None, packing=Packing()
)


def _saved(path, rows: int, files: int, seed: int = 0) -> datasets.Dataset:
    """``rows`` rows of ragged ``tokens`` and a ``label`` (the row's number), saved in ``files`` files
    (save_to_disk splits them evenly: with 10 rows a file, row r lies in file r // 10), loaded mapped."""
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(0, 1000, rng.integers(1, 9)).tolist() for _ in range(rows)]
    features = datasets.Features({"tokens": datasets.Sequence(datasets.Value("int32")),
                                  "label": datasets.Value("int64")})
    built = datasets.Dataset.from_dict({"tokens": tokens, "label": list(range(rows))}, features=features)
    built.save_to_disk(str(path), num_shards=files)
    loaded = datasets.load_from_disk(str(path))
    assert len(loaded.cache_files) == files
    return loaded


def _batch(arrays: Arrays, indices: list[int]) -> dict:
    return assemble.using(PACKED)(arrays.__getitems__(indices))


def _expected(dataset, indices: list[int]) -> dict:
    rows = [dataset[i] for i in indices]
    return {"tokens": torch.tensor([t for row in rows for t in row["tokens"]]),
            "label": torch.tensor([row["label"] for row in rows])}


def _same(batch: dict, expected: dict) -> None:
    assert torch.equal(batch["tokens"][0].long(), expected["tokens"]), "the packed tokens"
    assert torch.equal(batch["label"], expected["label"])


def _touch(path: str, seconds: int = 3600) -> None:
    status = os.stat(path)
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns + seconds * 10**9))


def _rewritten_in_place(path: str, table: pa.Table, chunk: int) -> None:
    """``table`` written over the Arrow stream at ``path`` in record batches of ``chunk`` rows, on the same
    inode, zeros after its end keeping the file's size (and a later time, whatever the clock's grain)."""
    schema = pa.ipc.open_stream(pa.memory_map(path)).schema  # Hugging Face's features with it
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_table(table.cast(schema), max_chunksize=chunk)
    data = sink.getvalue().to_pybytes()
    size = os.path.getsize(path)
    assert len(data) <= size, "the test needs a layout that fits the file"
    with open(path, "r+b") as file:
        file.write(data + bytes(size - len(data)))
    assert os.path.getsize(path) == size
    _touch(path, 7200)


def _read_table(path: str) -> pa.Table:
    with pa.memory_map(path) as source:
        return pa.ipc.open_stream(source).read_all().combine_chunks()  # a copy: the file is rewritten


def test_a_touched_file_is_read_on_by_a_batch_a_sample_and_a_copy_that_opens_it_again(tmp_path):
    dataset = _saved(tmp_path / "d", rows=120, files=3)
    arrays = Arrays.from_hf(dataset)
    pickled_before = pickle.dumps(arrays)  # a worker started before the touch, its files opened after
    for file in dataset.cache_files:
        _touch(file["filename"])
    everything = list(range(120))
    _same(_batch(arrays, everything), _expected(dataset, everything))
    assert arrays[77]["label"].item() == 77 and arrays[77]["tokens"].tolist() == dataset[77]["tokens"]
    assert arrays.__getitems__([5, 115])[1]["label"].item() == 115, "the lazy batch's rows"
    for copy in (pickle.loads(pickled_before), pickle.loads(pickle.dumps(arrays))):
        _same(_batch(copy, [119, 0, 60]), _expected(dataset, [119, 0, 60]))
        assert copy[41]["label"].item() == 41


def test_a_touched_file_has_its_headers_read_once_then_its_new_time_is_remembered(tmp_path, monkeypatch):
    dataset = _saved(tmp_path / "d", rows=40, files=1)
    arrays = Arrays.from_hf(dataset, ["label"])
    (watched,) = arrays.columns["label"].watched
    path = dataset.cache_files[0]["filename"]
    _touch(path)
    reads = []
    counted = lambda *args: reads.append(args) or layout_digest(*args)  # noqa: E731
    monkeypatch.setattr(fastcollate.data.mapped_files, "layout_digest", counted)
    for _ in range(3):
        assert arrays[39]["label"].item() == 39
    assert len(reads) == 1, "the headers are read again once, on the first read after the touch"
    assert watched.identity.mtime_ns == os.stat(path).st_mtime_ns


def test_a_file_rewritten_with_the_same_size_but_other_record_batches_is_refused_by_name_and_dates(tmp_path):
    dataset = _saved(tmp_path / "d", rows=9000, files=6)  # 1,500 rows a file: record batches of 1,000 and 500
    arrays = Arrays.from_hf(dataset)
    pickled = pickle.dumps(arrays)
    path = dataset.cache_files[1]["filename"]
    _rewritten_in_place(path, _read_table(path), chunk=1000)  # its own bytes again, at a later time
    _same(_batch(arrays, [1600, 2999]), _expected(dataset, [1600, 2999]))
    _rewritten_in_place(path, _read_table(path), chunk=1500)  # the same rows in one record batch
    refused = (
        rf"column 'tokens': its file {re.escape(path)} was written since the dataset was made \(then "
        rf"inode \d+ on device \d+, \d+ bytes, {DATE}; now inode \d+ on device \d+, \d+ bytes, {DATE}\), and "
        r"its Arrow message headers differ from then: its record batches and buffers may no longer be where"
    )
    with pytest.raises(MappedFileError, match=refused):
        _batch(arrays, [0, 2500])
    with pytest.raises(MappedFileError, match=refused):
        arrays[1500]
    with pytest.raises(MappedFileError, match=refused):
        _batch(pickle.loads(pickled), [2100])  # opened again by path: the same refusal
    _same(_batch(arrays, [0, 1499, 3000]), _expected(dataset, [0, 1499, 3000]))  # rows of other files


def test_a_file_rewritten_with_the_same_size_but_other_list_lengths_is_refused(tmp_path):
    dataset = _saved(tmp_path / "d", rows=40, files=2)
    arrays = Arrays.from_hf(dataset, ["tokens"])
    path = dataset.cache_files[0]["filename"]
    table = _read_table(path)
    tokens = table.column("tokens").to_pylist()
    tokens[3] = tokens[3][:-1]  # one token fewer: the values' buffer is 4 bytes shorter
    shorter = table.set_column(0, "tokens", pa.array(tokens, pa.list_(pa.int32())))
    _rewritten_in_place(path, shorter, chunk=1000)
    with pytest.raises(MappedFileError, match=rf"its file {re.escape(path)} .*headers differ from then"):
        arrays[3]


def test_a_rewrite_of_another_size_or_inode_is_refused_as_before(tmp_path):
    dataset = _saved(tmp_path / "d", rows=60, files=6)
    arrays = Arrays.from_hf(dataset, ["label"])
    pickled = pickle.dumps(arrays)
    grown, replaced = (file["filename"] for file in dataset.cache_files[:2])  # rows 0..9 and 10..19
    with open(grown, "ab") as file:
        file.write(bytes(8))
    with pytest.raises(MappedFileError, match=rf"its file {re.escape(grown)} was written since the dataset "
                       rf"was made \(then .*{DATE}; now .*{DATE}\): its rows may no longer be"):
        arrays[0]
    with open(replaced, "rb") as original, open(replaced + ".new", "wb") as copy:
        copy.write(original.read())
    os.replace(replaced + ".new", replaced)  # the same bytes, another inode: this mapping reads the old one
    assert arrays[15]["label"].item() == 15
    with pytest.raises(MappedFileError, match=r"its file .* is not one the dataset was made from"):
        pickle.loads(pickled)[15]  # opened again by path: another file


def _files_stated(monkeypatch) -> list[str]:
    stated: list[str] = []
    unreadable = WatchedFile.unreadable
    monkeypatch.setattr(WatchedFile, "unreadable", lambda self: stated.append(self.path) or unreadable(self))
    return stated


@pytest.mark.parametrize("view", ["as saved", "shuffled"])
def test_a_read_checks_the_files_of_its_rows_only_among_many(tmp_path, monkeypatch, view):
    saved = _saved(tmp_path / "d", rows=3000, files=300)  # row r lies in file r // 10
    dataset = saved.shuffle(seed=1) if view == "shuffled" else saved
    rows_of = np.arange(3000) if dataset._indices is None else dataset._indices.column(0).to_numpy()
    arrays = Arrays.from_hf(dataset, {"tokens": "tokens", "again": "tokens", "label": "label"})
    files = [file["filename"] for file in saved.cache_files]
    stated = _files_stated(monkeypatch)
    indices = [7, 2999, 1500, 1501, 1502, 640, 7]
    both = Contract({**PACKED.fields, "again": Field(shape=("T",), pack=True)}, id=None, packing=Packing())
    batch = assemble.using(both)(arrays.__getitems__(indices))
    assert torch.equal(batch["again"], batch["tokens"])
    assert sorted(stated) == sorted({files[rows_of[i] // 10] for i in indices}), "each touched file once"
    stated.clear()
    arrays.__getitems__(indices)[0]  # the lazy batch's rows
    assert sorted(stated) == sorted({files[rows_of[i] // 10] for i in indices})
    stated.clear()
    arrays[1234]
    assert stated == [files[rows_of[1234] // 10]]


def test_a_truncated_file_among_many_is_named_when_a_batch_reads_it_and_not_before(tmp_path):
    dataset = _saved(tmp_path / "d", rows=3000, files=300)
    arrays = Arrays.from_hf(dataset)
    victim = dataset.cache_files[150]["filename"]  # rows 1500..1509
    os.truncate(victim, os.path.getsize(victim) // 2)
    _same(_batch(arrays, [0, 1499, 1510, 2999]), _expected(dataset, [0, 1499, 1510, 2999]))
    shrank = rf"column 'tokens': its file {re.escape(victim)} shrank to \d+ bytes"
    with pytest.raises(MappedFileError, match=shrank):
        _batch(arrays, [0, 1505])
    with pytest.raises(MappedFileError, match=shrank):
        arrays.__getitems__([1509])[0]
    with pytest.raises(MappedFileError, match=shrank):
        arrays[1500]


def test_an_ipc_file_and_an_ipc_stream_touched_are_read_on_and_rewritten_elsewhere_are_refused(tmp_path):
    table = pa.table({"x": pa.array(np.arange(3000, dtype=np.int64))})
    for form, new in (("file", pa.ipc.new_file), ("stream", pa.ipc.new_stream)):
        path = str(tmp_path / f"{form}.arrow")
        with pa.OSFile(path, "wb") as sink, new(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=1000)
        arrays = Arrays.from_arrow(path)
        with open(path, "rb") as file:
            assert layout_digest(file.fileno(), os.path.getsize(path)) is not None, form
        _touch(path)
        assert arrays[2500]["x"].item() == 2500, form
        assert pickle.loads(pickle.dumps(arrays))[1]["x"].item() == 1, form
        size = os.path.getsize(path)
        with pa.OSFile(str(tmp_path / "other"), "wb") as sink, new(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=3000)  # one record batch: fewer headers, a smaller file
        other = (tmp_path / "other").read_bytes()
        # Zeros keep the size: after the stream, before a file's footer (which readers find from the end).
        end = len(other) - 10 - int.from_bytes(other[-10:-6], "little") if form == "file" else len(other)
        with open(path, "r+b") as file:
            file.write(other[:end] + bytes(size - len(other)) + other[end:])
        _touch(path, 7200)
        with pytest.raises(MappedFileError, match=f"{form}.arrow was written since .* headers differ"):
            arrays[0]


def test_a_file_that_is_no_arrow_stream_has_no_layout(tmp_path):
    cases = {"text": b"not an arrow file at all\n", "empty": b"", "short": b"\xff\xff\xff\xff"}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with open(tmp_path / name, "rb") as file:
            assert layout_digest(file.fileno(), len(data)) is None, name


_FAULT = """
    import os, datasets, fastcollate
    from fastcollate import Arrays, Contract, Field, MappedFileError, Packing
    from fastcollate.data import touched_files
    packed = Contract({"tokens": Field(shape=("T",), pack=True), "label": Field(kind="number")}, id=None,
                      packing=Packing())
    dataset = datasets.load_from_disk("d")
    arrays = Arrays.from_hf(dataset, {"tokens": "tokens", "label": "label"})
    victim = dataset.cache_files[7]["filename"]
    os.truncate(victim, 0)
    touched_files.FilesOfRows.check_rows = lambda self, rows: None  # as when it shrinks just after the check
    try:
        fastcollate.assemble.using(packed)(arrays.__getitems__([3, 75, 200]))
        print("returned")
    except MappedFileError as error:
        print("MappedFileError", error)
    print("after", fastcollate.assemble.using(packed)(arrays.__getitems__([3, 200]))["label"].tolist())
"""


def test_a_read_that_faults_anyway_names_the_column_and_the_file_among_many(tmp_path):
    dataset = _saved(tmp_path / "d", rows=300, files=30)
    victim = dataset.cache_files[7]["filename"]  # rows 70..79
    del dataset
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(_FAULT)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
    assert (
        "MappedFileError Arrays: column 'tokens': a read past the end of a mapped file faulted while the "
        "batch was copied, and nothing of the batch was handed out (column 'tokens': its file "
        f"{victim} shrank to 0"
    ) in result.stdout, result.stdout
    assert "after [3, 200]" in result.stdout, "the other files still read"
