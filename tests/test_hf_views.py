"""Arrays.from_hf over Hugging Face datasets as users have them: a sample is what ``dataset[i]`` hands out
(its format's dtypes, negative indices), or the dataset is refused naming what Arrays cannot follow (a
transform, encoded media, a null in a row it reads, a file that is not Arrow IPC); index-map files are
checked as data files are, and rows copied one by one out of a file that shrank are an error, never
SIGBUS."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import default_collate

datasets = pytest.importorskip("datasets")
from datasets import Dataset, Features, Sequence, Value  # noqa: E402

from fastcollate import Arrays, Contract, ContractError, Field, assemble  # noqa: E402
from fastcollate.collate import gather  # noqa: E402
from fastcollate.data.mapped_files import MappedFileError  # noqa: E402

from .test_mapped_files import _no_signal, _run  # noqa: E402

FEATURES = Features(
    {
        "input_ids": Sequence(Value("int32")),
        "label": Value("int32"),
        "score": Value("float64"),
        "pair": Sequence(Value("float16"), length=2),
    }
)


def _rows(n: int) -> dict:
    return {
        "input_ids": [list(range(i, i + 3)) for i in range(n)],  # one length: batches stack without a pad
        "label": [i % 7 for i in range(n)],
        "score": [i / 3 for i in range(n)],
        "pair": [[i, -i] for i in range(n)],
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("views") / "data")
    Dataset.from_dict(_rows(50), features=FEATURES).save_to_disk(path)
    return datasets.load_from_disk(path)


def _tensor(value) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = value.astype(value.dtype.newbyteorder("="))  # the values, in the byte order a tensor holds
    return torch.as_tensor(value)


def _same(ours: dict, theirs: dict) -> None:
    """Value for value, and dtype for dtype where Hugging Face hands out arrays (Python objects have none:
    the stored dtype stands)."""
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        expected = _tensor(value)
        if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
            assert ours[key].dtype == expected.dtype, (key, ours[key].dtype, expected.dtype)
        else:
            expected = torch.tensor(value, dtype=ours[key].dtype)
        assert torch.equal(ours[key], expected), key


@pytest.mark.parametrize(
    "form",
    [
        {"type": "torch"},
        {"type": "numpy"},
        {"type": "torch", "dtype": torch.float64},
        {"type": "numpy", "dtype": "float16"},
        {"type": "torch", "columns": ["label", "pair"], "output_all_columns": True},
        {"type": "torch", "dtype": None},  # dtype=None overrides the widening: the stored dtypes
        {"type": "numpy", "dtype": None},
        {"type": "numpy", "dtype": ">i4"},  # big-endian rows: the values in the native order
    ],
    ids=["torch", "numpy", "torch float64", "numpy float16", "torch two columns", "torch None", "numpy None",
         "numpy big-endian"],
)
def test_a_formatted_dataset_hands_out_what_hugging_face_hands_out_key_for_key(saved, form):
    dataset = saved.with_format(**form)
    arrays = Arrays.from_hf(dataset)
    for i in (0, 17, 49, -1, -50):
        _same(arrays[i], dataset[i])
    indices = [3, 9, 40]
    hf_rows = [dataset[i] for i in indices]
    expected = {  # arrays stacked; Python objects as lists, which have no dtype of their own
        key: torch.stack([_tensor(row[key]) for row in hf_rows])
        if isinstance(hf_rows[0][key], (torch.Tensor, np.ndarray, np.generic))
        else [row[key] for row in hf_rows]
        for key in hf_rows[0]
    }
    for batch in (assemble(arrays.__getitems__(indices)), default_collate(arrays.__getitems__(indices))):
        _same(batch, expected)


def test_no_format_hands_out_the_dtypes_hugging_face_s_collators_make_of_its_rows(tmp_path):
    """Rows of Python numbers become int64 and float32 tensors in Hugging Face's collators (and in its
    torch format): Arrays hands out the same, cast as the batch is gathered; stored_dtypes keeps the
    stored ones."""
    features = Features({
        "ids": Sequence(Value("int32")), "mask": Sequence(Value("int8")), "u16": Value("uint16"),
        "half": Sequence(Value("float16"), length=2), "score": Value("float64"),
    })
    rows = {"ids": [[1, 2], [3, 4]], "mask": [[1, 1], [1, 0]], "u16": [7, 65535], "half": [[0.5, 1], [2, 3]],
            "score": [0.25, 1 / 3]}
    dataset = Dataset.from_dict(rows, features=features)
    torch_format = dataset.with_format("torch")
    arrays = Arrays.from_hf(dataset)
    stored = Arrays.from_hf(dataset, stored_dtypes=True)
    for batch in (assemble(arrays.__getitems__([0, 1])), default_collate(arrays.__getitems__([0, 1]))):
        for key in rows:
            expected = torch.stack([torch_format[i][key] for i in (0, 1)])
            assert batch[key].dtype == expected.dtype and torch.equal(batch[key], expected), key
    assert {key: value.dtype for key, value in assemble(stored.__getitems__([1])).items()} == {
        "ids": torch.int32, "mask": torch.int8, "u16": torch.uint16, "half": torch.float16,
        "score": torch.float64,
    }
    assert pickle.loads(pickle.dumps(stored))[0]["ids"].dtype == torch.int32, "kept by a worker's copy"


def test_columns_a_format_leaves_out_come_in_the_dtypes_of_no_format():
    """``with_format(..., columns=[...], output_all_columns=True)`` hands out the other columns as Python
    objects, as with no format: Hugging Face's collators make their numbers int64 and float32."""
    features = Features({"ids": Sequence(Value("int32")), "label": Value("int32"), "score": Value("float64")})
    rows = {"ids": [[1, 2], [3, 4]], "label": [0, 1], "score": [0.25, 1 / 3]}
    dataset = Dataset.from_dict(rows, features=features)
    for kind in ("torch", "numpy"):
        formatted = dataset.with_format(kind, columns=["ids"], output_all_columns=True)
        assert type(formatted[0]["label"]) is int and type(formatted[0]["score"]) is float
        hidden = dataset.with_format(kind, columns=["ids"])  # the others chosen by name
        for arrays in (Arrays.from_hf(formatted), Arrays.from_hf(hidden, ["ids", "label", "score"])):
            for collate in (assemble, default_collate):
                batch = collate(arrays.__getitems__([0, 1]))
                assert batch["label"].dtype == torch.int64 and batch["label"].tolist() == [0, 1], kind
                assert batch["score"].dtype == torch.float32, kind
                assert torch.equal(batch["score"], torch.tensor(rows["score"], dtype=torch.float32)), kind
        stored = Arrays.from_hf(formatted, stored_dtypes=True)
        assert stored[0]["label"].dtype == torch.int32 and stored[0]["score"].dtype == torch.float64


def test_a_contract_over_a_formatted_dataset_checks_the_dtype_samples_hold(saved):
    # The torch format hands out int64 labels: a contract declaring int64 (no cast from the stored int32)
    # takes them, gathered or not, and equals Hugging Face's rows.
    contract = Contract(
        {"label": Field(dtype=torch.int64, shape=(), range=(0, 7)), "score": Field(shape=())}, id=None
    )
    dataset = saved.with_format("torch", columns=["label", "score"])
    arrays = Arrays.from_hf(dataset)
    assert gather.gatherer(arrays, contract, "id") is not None, "gathered, casting as it copies"
    gathered = assemble.using(contract)(arrays.__getitems__([1, 2, 8]))
    walked = assemble.using(contract)(list(arrays.__getitems__([1, 2, 8])))
    for batch in (gathered, walked):
        assert batch["label"].dtype == torch.int64 and batch["label"].tolist() == [1, 2, 1]
        assert batch["score"].dtype == torch.float32
        assert torch.equal(batch["score"], torch.stack([dataset[i]["score"] for i in (1, 2, 8)]))
    # Stored int32 labels are not what samples hold: a contract that takes only int32 is refused, naming
    # the sample, as it is on Hugging Face's own rows.
    int32_only = Contract({"label": Field(dtype=torch.int32, shape=()), "score": Field(shape=())}, id=None)
    with pytest.raises(ContractError, match="field 'label'.*int64"):
        assemble.using(int32_only)(arrays.__getitems__([1, 2]))


@pytest.mark.parametrize(
    "transformed",
    [
        lambda d: d.with_transform(lambda batch: {"label": [x + 10 for x in batch["label"]]}),
        lambda d: (d := d.select(range(50)), d.set_transform(lambda batch: batch))[0],
        lambda d: d.with_format("custom", transform=lambda batch: batch),
    ],
    ids=["with_transform", "set_transform", "set_format custom"],
)
def test_a_dataset_with_a_transform_is_refused_naming_the_transform_and_what_to_do(saved, transformed):
    with pytest.raises(TypeError, match=r"has a transform \(.*lambda.*\).*Dataset\.map first.*assemble"):
        Arrays.from_hf(transformed(saved))


def test_a_format_set_after_from_hf_changes_neither_the_arrays_nor_their_pickled_copies(tmp_path):
    # set_format and set_transform change the dataset in place; Arrays reads the view it was made from, in
    # this process and in each spawned worker, which makes it again from the pickled dataset.
    Dataset.from_dict(_rows(10), features=FEATURES).save_to_disk(str(tmp_path / "data"))
    dataset = datasets.load_from_disk(str(tmp_path / "data"))
    arrays = Arrays.from_hf(dataset, ["label", "pair"], stored_dtypes=True)
    dataset.set_format("torch")
    assert dataset[0]["label"].dtype == torch.int64
    copy = pickle.loads(pickle.dumps(arrays))
    for read in (arrays, copy):
        assert read[0]["label"].dtype == torch.int32 and read[0]["pair"].dtype == torch.float16
        assert assemble(read.__getitems__([1, 2]))["label"].dtype == torch.int32
    dataset.set_transform(lambda batch: {"label": [x + 10 for x in batch["label"]]})  # unpicklable too
    copy = pickle.loads(pickle.dumps(arrays))
    assert copy[3]["label"].item() == 3 and copy[3]["label"].dtype == torch.int32


def test_a_format_that_hands_out_no_tensors_or_other_options_is_refused(saved):
    for kind in ("pandas", "arrow"):
        with pytest.raises(TypeError, match=f"format is '{kind}', whose rows are not tensors"):
            Arrays.from_hf(saved.with_format(kind))
    with pytest.raises(TypeError, match=r"'torch' format has options \['device'\].*DeviceLoader"):
        Arrays.from_hf(saved.with_format("torch", device="cpu"))


def test_a_format_dtype_that_is_no_tensor_dtype_is_refused_when_arrays_are_made(saved):
    for kind, dtype in (("torch", np.float16), ("torch", "float16"), ("numpy", object), ("numpy", "U5")):
        with pytest.raises(TypeError, match=rf"'{kind}' format has dtype=.*, which .*: set the format"):
            Arrays.from_hf(saved.with_format(kind, dtype=dtype))


def test_negative_indices_count_from_the_end_as_in_hugging_face(saved):
    arrays = Arrays.from_hf(saved.with_format("numpy"))
    assert arrays[-1]["label"].item() == saved[-1]["label"] == saved[49]["label"]
    theirs = saved.__getitems__([-1, 0, -50])
    batch = assemble(arrays.__getitems__([-1, 0, -50]))
    assert batch["label"].tolist() == [row["label"] for row in theirs]
    assert batch["input_ids"].tolist() == [row["input_ids"] for row in theirs]
    with pytest.raises(IndexError, match="index -51 is out of range for a dataset of 50 samples"):
        arrays.__getitems__([-50, -51])
    with pytest.raises(IndexError, match="index -51 is out of range"):
        arrays[-51]


def test_a_null_in_a_row_the_view_filtered_out_is_never_read(tmp_path):
    features = Features(
        {"x": Value("int64"), "tokens": Sequence(Value("int64")), "pair": Sequence(Value("int64"), length=2)}
    )
    rows = {
        "x": [1, None, 3, 4, 5],
        "tokens": [[1], [2, None], None, [4, 4], [5]],
        "pair": [[1, 1], [2, 2], [3, 3], None, [5, 5]],
    }
    Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "nulls"))
    dataset = datasets.load_from_disk(str(tmp_path / "nulls"))
    clean = dataset.filter(
        lambda row: None not in (row["x"], row["tokens"], row["pair"]) and None not in row["tokens"]
    )
    arrays = Arrays.from_hf(clean)
    assert len(arrays) == 2
    for i in range(2):
        _same(arrays[i], {key: torch.as_tensor(value) for key, value in clean[i].items()})
    with pytest.raises(ValueError, match=r"column 'tokens' has 1 missing values \(nulls\) in the rows the "
                                         r"dataset reads, the first in sample 1 \(row 2 of the table\)"):
        Arrays.from_hf(dataset.select([0, 2, 4]), ["tokens"])
    with pytest.raises(ValueError, match=r"column 'tokens' has 2 missing values.*sample 1 \(row 1"):
        Arrays.from_hf(dataset, ["tokens"])  # a null value inside row 1's list, and row 2's null list
    with pytest.raises(ValueError, match=r"column 'pair' has 1 missing values.*sample 1 \(row 3"):
        Arrays.from_hf(dataset.select([0, 3]), ["pair"])
    assert Arrays.from_hf(dataset.select([4, 0]), ["x", "pair"])[0]["pair"].tolist() == [5, 5]


def test_a_null_in_a_list_outside_a_contiguous_selection_is_never_read(tmp_path):
    # A contiguous select, shard or unshuffled split slices the table (no index map): the nulls of the
    # lists before and after the slice are none of its rows.
    rows = {"t": [[1, 2], [3, None], [5], [6, 7], [8], [9, None], [10]]}
    features = Features({"t": Sequence(Value("int32"))})
    Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "d"))
    dataset = datasets.load_from_disk(str(tmp_path / "d"))
    for view in (dataset.select(range(2, 5)), dataset.select(range(1)), dataset.select(range(6, 7)),
                 dataset.shard(3, 1, contiguous=True)):
        assert view._indices is None, "a slice of the table"
        arrays = Arrays.from_hf(view)
        assert [arrays[i]["t"].tolist() for i in range(len(arrays))] == view["t"]
    train = dataset.train_test_split(test_size=2, shuffle=False)["train"]  # rows 0 to 4: row 1's null
    with pytest.raises(ValueError, match=r"column 't' has 1 missing values .*sample 1 \(row 1 of the"):
        Arrays.from_hf(train)


def test_a_null_in_an_array2d_column_is_named_as_a_null_not_as_undeclared_lengths(tmp_path):
    grid = [[1, 2], [3, 4]]
    features = Features(
        {"g": datasets.Array2D((2, 2), "int32"), "s": Sequence(Sequence(Value("int32"), length=2))}
    )
    rows = {"g": [grid, grid, None, grid], "s": [grid, grid, grid, [[1, 2], None]]}
    Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "d"))
    dataset = datasets.load_from_disk(str(tmp_path / "d"))
    with pytest.raises(ValueError, match=r"column 'g' .* has a null list in row 2 of the table.*fill"):
        Arrays.from_hf(dataset, ["g"])
    with pytest.raises(ValueError, match=r"column 's' has 1 missing values .*sample 3 \(row 3 of the"):
        Arrays.from_hf(dataset, ["s"])


def test_an_image_or_audio_column_is_refused_as_encoded_media_with_how_to_decode_it():
    png = {"bytes": b"\x89PNG\r\n\x1a\n", "path": None}
    images = Dataset.from_dict(
        {"image": [png], "frames": [[png]], "y": [1]},
        features=Features(
            {"image": datasets.Image(), "frames": Sequence(datasets.Image()), "y": Value("int64")}
        ),
    )
    with pytest.raises(TypeError, match=r"column 'image' .* holds encoded media \(Image\).*Dataset.map"):
        Arrays.from_hf(images)
    with pytest.raises(TypeError, match=r"column 'frames' .* holds encoded media \(Image\)"):
        Arrays.from_hf(images, ["frames"])
    sound = Dataset.from_dict({"audio": [{"bytes": b"RIFF", "path": None}]})
    sound = sound.cast_column("audio", datasets.Audio())
    with pytest.raises(TypeError, match=r"column 'audio' .* holds encoded media \(Audio\)"):
        Arrays.from_hf(sound)
    assert Arrays.from_hf(images, ["y"])[0]["y"].item() == 1  # left out, the rest is read


def test_from_arrow_given_a_parquet_or_json_path_says_which_reader_opens_it(tmp_path):
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"t.parquet is not an Arrow IPC file\. .*Parquet file: read it with "
                                         r"pyarrow.parquet.read_table\(path\)"):
        Arrays.from_arrow(str(tmp_path / "t.parquet"))
    for name, text in (("t.jsonl", '{"x": 1}\n'), ("t.csv", "x\n1\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=r"looks like JSON or CSV: load it with datasets.load_dataset"):
            Arrays.from_arrow(str(tmp_path / name))


def test_an_index_map_file_rewritten_under_a_reopened_dataset_is_refused_naming_it(tmp_path):
    # A spawned worker makes the dataset again from its pickle, reading the split's index map by path: a
    # map another run wrote there since would hand it other rows (test rows into training).
    Dataset.from_dict(_rows(40), features=FEATURES).save_to_disk(str(tmp_path / "data"))
    dataset = datasets.load_from_disk(str(tmp_path / "data"))
    names = {"train_indices_cache_file_name": str(tmp_path / "train.arrow"),
             "test_indices_cache_file_name": str(tmp_path / "test.arrow")}
    train = dataset.train_test_split(test_size=0.5, seed=0, **names)["train"]
    arrays = Arrays.from_hf(train, ["label", "score"])
    pickled = pickle.dumps(arrays)
    again = pickle.loads(pickled)  # the same file: read on, the same rows
    first = list(range(20))
    read = assemble(arrays.__getitems__(first))["score"]
    assert torch.equal(assemble(again.__getitems__(first))["score"], read)
    other = dataset.train_test_split(test_size=0.5, seed=1, load_from_cache_file=False, **names)["train"]
    assert other["score"] != train["score"], "the rewritten map selects other rows"
    rebuilt = pickle.loads(pickled)
    for read in (lambda: rebuilt[0], lambda: assemble(rebuilt.__getitems__([0, 1]))):
        with pytest.raises(MappedFileError, match=r"index map .*cannot be trusted: its file .*train.arrow"):
            read()


_TRUNCATED_UNDER_A_ROW_COPY = """
    import os, datasets, torch
    from torch.utils.data import default_collate
    from fastcollate import Arrays, MappedFileError
    datasets.Dataset.from_dict({"x": [[float(i)] * 2000 for i in range(64)]}).save_to_disk("data")
    dataset = datasets.load_from_disk("data")
    arrays = Arrays.from_hf(dataset)
    arrays.check_files = lambda *_: None  # the file shrinks after the check, while a row is copied
    for file in dataset.cache_files:
        os.truncate(file["filename"], 4096)
    for label, read in (
        ("ds[i]", lambda: arrays[63]),
        ("default_collate", lambda: default_collate(arrays.__getitems__([1, 63]))),
        ("rows", lambda: list(arrays.__getitems__([63]))),
    ):
        try:
            read()
            print(label, "returned")
        except MappedFileError as error:
            print(label, "MappedFileError", error)
"""


def test_a_file_truncated_while_rows_are_copied_one_by_one_is_an_error_never_sigbus(tmp_path):
    out = _no_signal(_run(_TRUNCATED_UNDER_A_ROW_COPY, tmp_path))
    for label in ("ds[i]", "default_collate", "rows"):
        assert f"{label} MappedFileError Arrays: a read past the end of a mapped file faulted" in out, out
    assert "shrank to 4096 bytes" in out, out


def test_rows_of_a_memmap_column_are_handed_out_as_guarded_copies(tmp_path):
    path = tmp_path / "x.bin"
    np.arange(64, dtype=np.float32).tofile(path)
    arrays = Arrays(x=np.memmap(path, dtype=np.float32, mode="r", shape=(16, 4)))
    row = arrays[3]["x"]
    assert row.tolist() == [12.0, 13.0, 14.0, 15.0]
    assert row.untyped_storage().data_ptr() != arrays.columns["x"].rows.untyped_storage().data_ptr()
    os.truncate(path, 0)
    assert row.tolist() == [12.0, 13.0, 14.0, 15.0], "a copy outlives its file"
