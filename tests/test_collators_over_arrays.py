"""Any collate function over ``Arrays.from_hf`` gets what it gets over the Hugging Face dataset itself:
Hugging Face's collators, ``default_collate`` and a user's own, through DataLoader with ``batch_size``
and with ``IndexBatches``, on rows stored as a tokenizer stores them (int32 lists). Offline: the
word-level tokenizer of tests/helpers/tokenizers.py."""

import multiprocessing
import random
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from fastcollate import Arrays, IndexBatches, assemble
from fastcollate.data import arrays as arrays_module
from fastcollate.data.arrays import ArrayBatch

from .helpers.word_tokenizer import word_level_tokenizer

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
datasets = pytest.importorskip("datasets", reason="datasets is not installed")


@pytest.fixture(scope="module")
def tokenizer():
    return word_level_tokenizer()


def tokenized(count=23, seed=0, fixed_length=None):
    """A tokenized text dataset as ``Dataset.map(tokenizer)`` stores it: int32 token lists, an int8
    attention mask, an int64 label, a float score."""
    rng = random.Random(seed)
    lengths = [fixed_length or rng.randint(1, 12) for _ in range(count)]
    rows = {
        "input_ids": [[rng.randint(4, 43) for _ in range(n)] for n in lengths],
        "attention_mask": [[1] * n for n in lengths],
        "labels": [rng.randint(0, 2) for _ in lengths],
        "score": [rng.random() for _ in lengths],
    }
    features = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "attention_mask": datasets.List(datasets.Value("int8")),
            "labels": datasets.Value("int64"),
            "score": datasets.Value("float64"),
        }
    )
    return datasets.Dataset.from_dict(rows, features=features)


def assert_same(got, expected, where):
    """Equal as a training step sees them: the same keys, tensors of the same dtype, shape and values,
    other values equal and of the same type."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == expected.dtype and got.shape == expected.shape, where
        assert torch.equal(got, expected), where
    elif isinstance(expected, (dict, transformers.BatchEncoding)):
        assert list(got.keys()) == list(expected.keys()), where
        for key in expected:
            assert_same(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert_same(g, e, f"{where}[{i}]")
    else:
        assert type(got) is type(expected) and got == expected, where


def batches(dataset, collate, sampler):
    if sampler == "batch_size":
        loader = DataLoader(dataset, batch_size=5, shuffle=False, collate_fn=collate)
    else:
        loader = DataLoader(dataset, batch_sampler=IndexBatches(len(dataset), 5, shuffle=True, seed=3),
                            collate_fn=collate)
    return list(loader)


def own_collate(rows):
    """A user's own: tells a batch from a sample by isinstance(list), indexes and iterates it."""
    assert isinstance(rows, list)
    return {
        "lengths": [len(row["input_ids"]) for row in rows],
        "last": torch.tensor([int(rows[i]["input_ids"][-1]) for i in range(len(rows))]),
        "labels": [int(row["labels"]) for row in reversed(rows)],
    }


COLLATORS = {
    "DataCollatorWithPadding": lambda tok: transformers.DataCollatorWithPadding(tok, return_tensors="pt"),
    "DataCollatorWithFlattening": lambda tok: transformers.DataCollatorWithFlattening(
        return_flash_attn_kwargs=True
    ),
    "DataCollatorForLanguageModeling": lambda tok: transformers.DataCollatorForLanguageModeling(
        tok, mlm=False, return_tensors="pt"
    ),
    "DataCollatorForLanguageModeling(mlm)": lambda tok: transformers.DataCollatorForLanguageModeling(
        word_level_tokenizer(mask_token="[MASK]"), mlm=True, mlm_probability=0.3, return_tensors="pt"
    ),
    "own": lambda tok: own_collate,
}


@pytest.mark.parametrize("sampler", ["batch_size", "IndexBatches"])
@pytest.mark.parametrize("name", list(COLLATORS))
def test_a_collator_gets_over_arrays_what_it_gets_over_the_hf_dataset(tokenizer, name, sampler):
    dataset = tokenized()
    if name == "DataCollatorWithFlattening":
        dataset = dataset.remove_columns(["labels", "score"])  # its rows: the tokens of a causal LM
    collate = COLLATORS[name](tokenizer)
    torch.manual_seed(0)  # the masked LM's masking draws from torch's generator
    expected = batches(dataset, collate, sampler)
    torch.manual_seed(0)
    got = batches(Arrays.from_hf(dataset), collate, sampler)
    assert len(got) == len(expected) == 5
    for i, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert_same(ours, theirs, f"{name} batch {i}")


def test_default_collate_over_arrays_stacks_what_the_torch_format_stacks():
    """default_collate takes the rows as they come: over the torch format, tensors it stacks. Arrays'
    rows are tensors in the dtypes that format gives."""
    dataset = tokenized(fixed_length=6)
    expected = batches(dataset.with_format("torch"), default_collate, "IndexBatches")
    for arrays in (Arrays.from_hf(dataset), Arrays.from_hf(dataset.with_format("torch"))):
        got = batches(arrays, default_collate, "IndexBatches")
        for i, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
            assert_same(ours, theirs, f"batch {i}")


def test_assemble_still_gathers_by_column_and_agrees_with_the_collators_dtypes(tokenizer, monkeypatch):
    dataset = tokenized(fixed_length=6)
    arrays = Arrays.from_hf(dataset)
    made = []
    monkeypatch.setattr(ArrayBatch, "rows", lambda self: made.append(self) or [])
    batch = next(iter(DataLoader(arrays, batch_size=5, collate_fn=assemble)))
    assert made == [], "assemble gathered the columns: no sample was made"
    rows = [dataset[i] for i in range(5)]
    padded = transformers.DataCollatorWithPadding(tokenizer, return_tensors="pt")(rows)
    for key in ("input_ids", "attention_mask", "labels"):
        assert batch[key].dtype == padded[key].dtype and torch.equal(batch[key], padded[key]), key
    assert batch["score"].dtype == torch.float32


def test_a_batch_is_a_list_whose_samples_are_made_on_the_first_read():
    arrays = Arrays(x=torch.arange(10.0), y=torch.arange(10))
    batch = arrays.__getitems__([4, 2, 7])
    assert isinstance(batch, list) and len(batch) == 3 and not batch.read
    assert [int(row["y"]) for row in batch] == [4, 2, 7] and batch.read
    assert [float(row["x"]) for row in batch] == [4.0, 2.0, 7.0]
    assert [s["x"].item() for s in batch[::-1]] == [7.0, 2.0, 4.0]
    for read in (list, tuple, sorted_by_y, reversed_list, lambda b: b.copy(), lambda b: b + []):
        fresh = arrays.__getitems__([4, 2, 7])
        assert [int(row["y"]) for row in read(fresh)] in ([4, 2, 7], [2, 4, 7], [7, 2, 4]), read


def sorted_by_y(batch):
    return sorted(batch, key=lambda row: int(row["y"]))


def reversed_list(batch):
    return list(reversed(batch))


def test_samples_changed_in_the_batch_are_what_assemble_collates():
    """A collate that changes the samples in place, then calls assemble: the change is collated, not the
    columns gathered again."""
    arrays = Arrays(x=torch.arange(10.0))
    batch = arrays.__getitems__([1, 2])
    for row in batch:
        row["x"] = row["x"] * 10
    batch.append({"x": torch.tensor(5.0)})
    assert assemble(batch)["x"].tolist() == [10.0, 20.0, 5.0]


@pytest.mark.parametrize(
    "use",
    [lambda row: row.keys(), lambda row: row["x"], lambda row: "x" in row, lambda row: list(row), len],
    ids=["keys()", "[key]", "in", "iterated", "len"],
)
def test_c_code_that_reads_a_list_directly_meets_an_error_not_an_empty_batch(use):
    """C code that indexes a list past its subclass's methods (a pybind11 py::list, heapq, an explicit
    list.__getitem__) reads a placeholder that raises, naming what to do, rather than no samples:
    whatever a collate does with a sample."""
    batch = Arrays(x=torch.arange(3.0)).__getitems__([0, 1])
    placeholder = list.__getitem__(batch, 0)  # what such C code sees before the first read
    with pytest.raises(RuntimeError, match=r"list\(batch\)"):
        use(placeholder)
    assert list(batch)[1]["x"].item() == 1.0 and list.__getitem__(batch, 1)["x"].item() == 1.0


def test_a_list_added_to_a_batch_gets_the_samples():
    """``rows + batch``: Python's list concatenation reads the right operand's items past its methods.
    ``rows += batch`` still extends ``rows`` itself."""
    arrays = Arrays(x=torch.arange(5.0))
    first = {"x": torch.tensor(-1.0)}
    joined = [first] + arrays.__getitems__([3, 1])
    assert type(joined) is list and [row["x"].item() for row in joined] == [-1.0, 3.0, 1.0]
    rows = [first]
    alias = rows
    rows += arrays.__getitems__([2])
    assert alias is rows and [row["x"].item() for row in alias] == [-1.0, 2.0]
    with pytest.raises(TypeError):
        (first,) + arrays.__getitems__([2])  # a tuple and a list do not add, as for any list


def test_code_that_rebuilds_a_batch_as_its_own_type_gets_a_list_of_what_it_gives():
    """Lightning's and accelerate's device moves, and transformers' nested_detach, rebuild a list as
    ``type(batch)(items)``: over a batch a collate returned as it got it (``collate_fn=lambda b: b``)."""
    move_data_to_device = pytest.importorskip("lightning.fabric.utilities.apply_func").move_data_to_device
    arrays = Arrays(x=torch.arange(5.0))
    batch = arrays.__getitems__([4, 0])
    rebuilt = type(batch)(row for row in batch)
    assert rebuilt == batch and rebuilt.read and len(type(batch)()) == 0
    moved = move_data_to_device(arrays.__getitems__([4, 0]), "cpu")
    assert [row["x"].item() for row in moved] == [4.0, 0.0]
    doubled = type(batch)({"x": row["x"] * 2} for row in batch)
    assert assemble(doubled)["x"].tolist() == [8.0, 0.0], "walked: the items given, not the columns"


def test_threads_that_read_one_batch_at_once_get_the_same_samples(monkeypatch):
    """Two first reads at once: each thread makes samples, the first to finish fills the batch, and both
    get its samples (a change one thread makes to a sample is seen by the other and by assemble)."""
    arrays = Arrays(x=torch.arange(5.0))
    batch = arrays.__getitems__([1, 3])
    second_made = threading.Event()
    made = arrays._handed_out
    calls = []

    def slow_first(samples):
        calls.append(samples)
        if len(calls) == 1:
            assert second_made.wait(10), "the second read never made its samples"
        return made(samples)

    monkeypatch.setattr(arrays, "_handed_out", slow_first)
    got = {}

    def read(name):
        got[name] = batch[0]
        if name == "second":
            second_made.set()

    first = threading.Thread(target=read, args=("first",))
    first.start()
    while not calls:
        time.sleep(0.001)
    read("second")
    first.join(10)
    assert len(calls) == 2, "both threads made samples: the race was run"
    assert got["first"] is got["second"] is batch[0]
    got["first"]["x"] = torch.tensor(7.0)
    assert assemble(batch)["x"].tolist() == [7.0, 3.0]


def test_a_process_forked_while_a_thread_fills_a_batch_reads_batches():
    """Fork copies a lock as it is: a worker forked while another thread of the parent was putting samples
    in a batch's list would wait forever on its own first read."""
    arrays = Arrays(x=torch.arange(5.0))
    context = multiprocessing.get_context("fork")
    results = context.SimpleQueue()

    def read_first_sample():
        results.put(arrays.__getitems__([3])[0]["x"].item())

    with arrays_module._FILLING:  # held, as by a thread filling a batch when the worker is forked
        child = context.Process(target=read_first_sample)
        child.start()
    child.join(10)
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0 and results.get() == 3.0, "the forked process read its batch"


def test_a_batch_pickles_as_its_samples():
    import pickle

    batch = Arrays(x=torch.arange(3.0)).__getitems__([2, 0])
    copied = pickle.loads(pickle.dumps(batch))
    assert type(copied) is list and [row["x"].item() for row in copied] == [2.0, 0.0]
