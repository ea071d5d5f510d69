"""Ids stay: ``with_ids`` over any kind of ``Arrays`` (tensors, numpy arrays, memmaps, ragged columns,
``from_hf``, ``from_arrow``, ``TokenWindows``) gives batches that carry each sample's index, through
``assemble`` and ``default_collate``, in the main process and in workers. And ``index_as``, the one
name and default for it, with ``id_key`` still read, warned of."""

import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, default_collate

from fastcollate import Arrays, Ragged, TokenWindows, assemble, with_ids
from fastcollate.data.arrays import ArrayBatch

datasets = pytest.importorskip("datasets", reason="datasets is not installed")
pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed")


def made(kind, n, folder):
    """An Arrays of ``kind`` over ``n`` samples whose column ``x`` holds each sample's index (ragged
    kinds: as the first of its row's values)."""
    x = np.arange(n, dtype=np.int64)
    if kind == "tensor":
        return Arrays(x=torch.from_numpy(x), y=torch.zeros(n, 3))
    if kind == "numpy":
        return Arrays(x=x, y=np.ones((n, 2), dtype=np.float32))
    if kind == "memmap":
        path = folder / f"x{n}.bin"
        x.tofile(path)
        return Arrays(x=np.memmap(path, dtype=np.int64, mode="r", shape=(n,)))
    if kind == "ragged":
        values = np.repeat(x, 2)  # row i: [i, i], of one length so default_collate stacks it too
        return Arrays(x=Ragged(torch.from_numpy(values), torch.arange(0, 2 * n + 1, 2)))
    if kind == "from_arrow":
        return Arrays.from_arrow(pa.table({"x": x, "y": np.zeros(n, dtype=np.float32)}))
    if kind == "from_hf":
        return Arrays.from_hf(datasets.Dataset.from_dict({"x": x.tolist(), "t": [[int(i)] for i in x]}))
    if kind == "from_hf, shuffled":
        dataset = datasets.Dataset.from_dict({"x": x.tolist()}).shuffle(seed=1)
        return Arrays.from_hf(dataset.flatten_indices().sort("x"))
    assert kind == "TokenWindows"
    return TokenWindows(torch.arange(n + 1), length=1)  # window i: input_ids [i]


KINDS = ["tensor", "numpy", "memmap", "ragged", "from_arrow", "from_hf", "from_hf, shuffled", "TokenWindows"]


def first_value(batch, key):
    column = batch[key]
    return column.reshape(len(column), -1)[:, 0].tolist()


def assert_ids_are_the_indices(batch, indices, key="id"):
    assert batch[key].tolist() == list(indices), "each sample's index, in batch order"
    assert first_value(batch, "x" if "x" in batch else "input_ids") == list(indices), "the rows read"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(KINDS),
    n=st.integers(1, 40),
    data=st.data(),
    collate=st.sampled_from(["assemble", "default_collate"]),
    key=st.sampled_from(["id", "sample_id"]),
)
def test_with_ids_over_any_arrays_carries_the_index_on_both_paths(tmp_path, kind, n, data, collate, key):
    dataset = with_ids(made(kind, n, tmp_path), key)
    indices = data.draw(st.lists(st.integers(-n, n - 1), min_size=1, max_size=2 * n))
    wanted = [i % n for i in indices]
    function = assemble.using(id_key=key) if collate == "assemble" else default_collate
    batch = function(dataset.__getitems__(indices))
    assert_ids_are_the_indices(batch, wanted, key)
    assert dataset[indices[0]][key] == wanted[0]


@pytest.mark.parametrize("kind", KINDS)
def test_with_ids_over_any_arrays_carries_the_index_in_workers(tmp_path, kind):
    dataset = with_ids(made(kind, 30, tmp_path))
    for collate in (assemble, default_collate):
        loader = DataLoader(dataset, batch_size=7, shuffle=True, num_workers=2, collate_fn=collate,
                            generator=torch.Generator().manual_seed(0))
        seen = []
        for batch in loader:
            assert first_value(batch, "x" if "x" in batch else "input_ids") == batch["id"].tolist()
            seen += batch["id"].tolist()
        assert sorted(seen) == list(range(30)), collate


def test_with_ids_keeps_the_batched_read_of_any_dataset_that_has_one():
    """A dataset with its own __getitems__ (Hugging Face's): the ids are added to what it reads."""
    dataset = datasets.Dataset.from_dict({"x": list(range(10))})
    identified = with_ids(dataset)
    batch = next(iter(DataLoader(identified, batch_size=4, collate_fn=assemble)))
    assert batch["id"].tolist() == [0, 1, 2, 3] and batch["x"].tolist() == [0, 1, 2, 3]
    assert identified.__getitems__([5, 2]) == [{"x": 5, "id": 5}, {"x": 2, "id": 2}]


def test_with_ids_leaves_a_dataset_s_own_id_column_as_it_is(monkeypatch):
    arrays = Arrays(id=np.array([10, 20, 30]), x=np.arange(3))
    batch = with_ids(arrays).__getitems__([2, 0])
    assert default_collate(batch)["id"].tolist() == [30, 10], "the dataset's own ids win"
    monkeypatch.setattr(ArrayBatch, "rows", lambda self: pytest.fail("a sample was made"))
    batch = with_ids(arrays).__getitems__([2, 0])
    assert assemble(batch)["id"].tolist() == [30, 10], "still gathered by column, as without with_ids"


def test_with_ids_under_another_key_keeps_the_index_the_arrays_already_carries():
    arrays = Arrays(x=np.arange(5), index_as="id")
    batch = default_collate(with_ids(arrays, "sample_id").__getitems__([3, 1]))
    assert batch["id"].tolist() == [3, 1] and batch["sample_id"].tolist() == [3, 1]
    assert arrays.index_as == "id", "the dataset wrapped is left as it was"


def test_an_index_counted_from_the_end_is_the_id_of_the_sample_it_reads():
    """Both keys of a sample name it alike, whichever way it was asked for (Arrays count a negative
    index from the end)."""
    arrays = Arrays(x=np.arange(5), index_as="id")
    identified = with_ids(arrays, "sample_id")
    samples = [identified[-1], identified.__getitems__([-1])[0], identified.__getitems__(np.array([-1]))[0]]
    for sample in samples:
        assert sample["id"] == sample["sample_id"] == 4 and type(sample["sample_id"]) is int


def test_an_index_under_a_column_s_key_is_refused_when_added_later():
    arrays = Arrays(x=np.arange(3) + 100)
    with pytest.raises(ValueError, match=r"index_as='x'.*a column's key"):
        arrays.indexed_as("x")
    assert "id" not in arrays[0] and arrays.indexed_as("id")[2]["id"] == 2


def test_index_as_is_the_one_default_and_id_key_still_works_with_a_warning(tmp_path):
    table = pa.table({"x": np.arange(4)})
    made_by = {
        "Arrays": lambda **kw: Arrays(x=np.arange(4), **kw),
        "Arrays.from_arrow": lambda **kw: Arrays.from_arrow(table, **kw),
        "Arrays.from_hf": lambda **kw: Arrays.from_hf(datasets.Dataset.from_dict({"x": [0, 1, 2, 3]}), **kw),
        "TokenWindows": lambda **kw: TokenWindows(torch.arange(5), length=1, **kw),
    }
    for who, make in made_by.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert "id" not in make()[2], f"{who}: no index unless asked"
            assert make(index_as="id")[2]["id"] == 2, who
        renamed = r"id_key= is now index_as=.*never named an id column"
        with pytest.warns(FutureWarning, match=renamed) as caught:
            assert make(id_key="i")[2]["i"] == 2, who
        assert caught[0].filename == __file__, f"{who}: the warning points at the caller's line"
        with pytest.raises(TypeError, match="give index_as alone"):
            make(index_as="id", id_key="id")


def test_an_index_under_a_column_s_key_is_refused_saying_what_to_do():
    with pytest.raises(ValueError, match=r"index_as='id'.*leave index_as out to keep the column"):
        Arrays(id=np.arange(3), index_as="id")


def test_with_ids_over_arrays_pickles_with_its_key():
    import pickle

    for arrays in (Arrays(x=np.arange(4)), Arrays.from_arrow(pa.table({"x": np.arange(4)}))):
        copied = pickle.loads(pickle.dumps(with_ids(arrays, "k")))
        assert copied[3]["k"] == 3
        assert assemble.using(id_key="k")(copied.__getitems__([1]))["k"].tolist() == [1]
