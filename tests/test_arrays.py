"""fastcollate.Arrays and its batched path: a batch gathered column by column equals what the per-sample
path gives (default_collate's value, dtype and keys), contracts apply per column, bad input names the
column and the index, and DataLoader workers (fork and spawn, a memmap mapped again) deliver every
sample once."""

from __future__ import annotations

import os
import pickle
import signal

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, default_collate

import fastcollate
from fastcollate import Arrays, Contract, ContractError, Field, Ragged, TokenWindows
from fastcollate._ext import _C
from fastcollate.collate import gather
from fastcollate.data.arrays import ArrayBatch

from .helpers.broken_columns import Broken, assert_same_outcome, broken_columns
from .helpers.chunks import chunked, cuts
from .helpers.gathered import gathered_plan

DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool]


def _same(a, b) -> None:
    assert list(a) == list(b), (list(a), list(b))
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), key


@st.composite
def datasets(draw):
    rows = draw(st.integers(1, 40))
    columns = {}
    for n in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=2)))
        values = torch.randint(0, 100, (rows, *shape)).to(dtype)
        as_numpy = draw(st.booleans())
        columns[f"c{n}"] = chunked(values.numpy() if as_numpy else values, draw(cuts(rows)))
    indices = draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=30))
    return Arrays(columns, index_as="id"), indices


# make fuzz runs each property FASTCOLLATE_FUZZ_EXAMPLES times (10,000); make test 150 and 100.
EXAMPLES = int(os.environ.get("FASTCOLLATE_FUZZ_EXAMPLES", "150"))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(datasets())
def test_a_gathered_batch_equals_default_collate_of_the_samples(case):
    dataset, indices = case
    expected = default_collate([dataset[i] for i in indices])
    assert gathered_plan(dataset.__getitems__(indices), None, "id") is not None, "gathered, not walked"
    _same(fastcollate.assemble(dataset.__getitems__(indices)), expected)
    _same(default_collate(dataset.__getitems__(indices)), expected)  # the lazy batch is a Sequence of samples


@st.composite
def ragged_datasets(draw):
    rows = draw(st.integers(1, 30))
    lengths = draw(st.lists(st.integers(0, 6), min_size=rows, max_size=rows))
    inner = tuple(draw(st.lists(st.integers(1, 3), max_size=1)))
    dtype = draw(st.sampled_from([torch.int64, torch.int16, torch.float32]))
    values = torch.randint(0, 50, (sum(lengths), *inner)).to(dtype)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    mask_dtype = draw(st.sampled_from([torch.bool, torch.int64]))
    lengths_key = draw(st.sampled_from(["", None]))
    contract = Contract(
        {
            "id": Field(kind="number"),
            "label": Field(kind="number"),
            "tokens": Field(
                dtype=dtype, shape=("T", *inner), pad=-1, mask_dtype=mask_dtype, lengths=lengths_key
            ),
        }
    )
    tokens = chunked(Ragged(values, offsets), draw(cuts(rows)))
    dataset = Arrays(tokens=tokens, label=chunked(np.arange(rows) % 7, draw(cuts(rows))), index_as="id")
    indices = draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=20))
    return dataset, contract, indices


@settings(
    max_examples=max(100, EXAMPLES * 2 // 3), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(ragged_datasets())
def test_a_ragged_column_is_padded_as_the_per_sample_path_pads_it(case):
    dataset, contract, indices = case
    collate = fastcollate.assemble.using(contract)
    assert gathered_plan(dataset.__getitems__(indices), contract, "id") is not None, "gathered, not walked"
    per_sample = [{**s, "label": int(s["label"])} for s in (dataset[i] for i in indices)]
    _same(collate(dataset.__getitems__(indices)), collate(per_sample))


@pytest.mark.parametrize(
    ("dtype", "pad"), [(torch.int64, 2**53), (torch.uint64, 2**53), (torch.int64, -(2**53))]
)
def test_a_large_integer_pad_is_the_same_gathered_from_a_ragged_column_and_walked(dtype, pad):
    dataset = Arrays(t=Ragged(torch.arange(5).to(dtype), np.array([0, 1, 5])), index_as="id")
    collate = fastcollate.assemble.using(
        Contract({"id": Field(kind="number"), "t": Field(dtype=dtype, shape=("T",), pad=pad)})
    )
    gathered, walked = collate(dataset.__getitems__([0, 1])), collate([dataset[0], dataset[1]])
    assert gathered["t"][0, 1:].tolist() == walked["t"][0, 1:].tolist() == [pad] * 3


def test_a_fractional_pad_for_integer_rows_is_refused_gathered_or_walked():
    dataset = Arrays(t=Ragged(torch.arange(5), np.array([0, 1, 5])), index_as="id")
    contract = Contract({"id": Field(kind="number"), "t": Field(shape=("T",), pad=2.5)})
    collate = fastcollate.assemble.using(contract)
    for batch in (dataset.__getitems__([0, 1]), [dataset[0], dataset[1]]):
        with pytest.raises(ContractError, match="pad=2.5") as caught:
            collate(batch)
        assert caught.value.field == "t"


def test_a_contract_casts_during_the_gather_and_checks_ranges_per_column():
    tokens = np.arange(40, dtype=np.uint16).reshape(10, 4)
    labels = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 12])
    dataset = Arrays(tokens=tokens, label=labels, index_as="id")
    contract = Contract(
        {
            "id": Field(kind="number"),
            "tokens": Field(dtype=torch.int64, shape=(4,), cast_from=(torch.uint16,)),
            "label": Field(kind="number", range=(0, 10)),
        }
    )
    collate = fastcollate.assemble.using(contract)
    batch = collate(dataset.__getitems__([3, 0]))
    assert batch["tokens"].dtype == torch.int64 and batch["tokens"].tolist() == [
        [12, 13, 14, 15],
        [0, 1, 2, 3],
    ]
    with pytest.raises(ContractError) as caught:
        collate(dataset.__getitems__([1, 9, 2]))
    error = caught.value
    assert (error.sample_id, error.position, error.field) == (9, 1, "label"), str(error)
    assert isinstance(error, ValueError) and "values in [0, 10)" in str(error)


def test_a_column_of_the_wrong_dtype_or_shape_is_named_with_the_first_sample():
    dataset = Arrays(image=np.zeros((5, 2, 3), dtype=np.uint16), index_as="id")
    with pytest.raises(ContractError) as caught:
        fastcollate.assemble.using(Contract({"id": Field(kind="number"), "image": Field(dtype=torch.uint8)}))(
            dataset.__getitems__([4, 1])
        )
    assert caught.value.field == "image" and caught.value.sample_id == 4 and "cast_from" in str(caught.value)
    with pytest.raises(ContractError, match="shape") as caught:
        fastcollate.assemble.using(Contract({"id": Field(kind="number"), "image": Field(shape=(3, 3))}))(
            dataset.__getitems__([0])
        )
    assert isinstance(caught.value, RuntimeError) and caught.value.field == "image"


def test_bad_columns_and_indices_are_refused_with_the_column_or_the_index_named():
    with pytest.raises(ValueError, match=r"same number of rows, got 'a': 3, 'b': 4"):
        Arrays(a=np.zeros(3), b=np.zeros(4), index_as="id")
    with pytest.raises(ValueError, match=r"column 'a'.*not contiguous.*np.ascontiguousarray"):
        Arrays(a=np.zeros((4, 3)).T, index_as="id")
    with pytest.raises(ValueError, match="offsets must start at 0"):
        Arrays(t=Ragged(np.zeros(5), np.array([0, 3, 2, 5])), index_as="id")
    with pytest.raises(TypeError, match="column 'a'.*got list"):
        Arrays(a=[1, 2, 3], index_as="id")
    dataset = Arrays(a=np.arange(6), index_as="id")
    with pytest.raises(IndexError, match="index 6 is out of range for a dataset of 6 samples"):
        dataset[6]
    with pytest.raises(IndexError, match="index 9 is out of range for a dataset of 6 samples"):
        dataset.__getitems__([0, 9])
    with pytest.raises(IndexError, match="index -7 is out of range for a dataset of 6 samples"):
        dataset.__getitems__(np.array([-6, -7]))
    with pytest.raises(IndexError, match="index -7 is out of range for a dataset of 6 samples"):
        dataset[-7]


def test_a_tensor_index_that_is_no_integer_scalar_is_refused_not_truncated():
    dataset = Arrays(a=np.arange(6) * 10, index_as="id")
    assert dataset[torch.tensor(4)]["a"].item() == 40
    assert dataset[torch.tensor(-1, dtype=torch.int8)]["a"].item() == 50
    for index, what in [
        (torch.tensor(3.7), "torch.float32 tensor of shape ()"),
        (torch.tensor(True), "torch.bool tensor of shape ()"),
        (torch.tensor([4]), r"torch.int64 tensor of shape \(1,\)"),
    ]:
        with pytest.raises(TypeError, match=f"an index must be an int, got a {what}.*__getitems__"):
            dataset[index]


def test_the_gather_op_checks_every_index_before_writing_a_byte():
    source = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    out = torch.full((3, 2), -7.0)
    with pytest.raises(IndexError, match=r"index 6 \(batch position 2\) is out of range for 6 rows"):
        torch.ops.fastcollate.gather_into(source, torch.tensor([0, 1, 6]), out)
    assert (out == -7).all(), "nothing written"
    values, offsets = torch.arange(5), torch.tensor([0, 2, 5])
    out, mask, lengths = (
        torch.full((2, 3), -7),
        torch.zeros(2, 3, dtype=torch.bool),
        torch.zeros(2, dtype=torch.long),
    )
    with pytest.raises(IndexError, match="out of range for 2 rows"):
        torch.ops.fastcollate.gather_ragged_into(values, offsets, torch.tensor([1, 2]), 0, out, mask, lengths)
    assert (out == -7).all() and not mask.any()


def test_a_memmap_that_shrank_under_the_dataset_raises_instead_of_killing_the_process(tmp_path):
    path = tmp_path / "x.u8"
    np.arange(4096, dtype=np.uint8).tofile(path)
    dataset = Arrays(x=np.memmap(path, dtype=np.uint8, mode="r", shape=(64, 64)), index_as="id")
    assert fastcollate.assemble(dataset.__getitems__([63]))["x"][0, -1] == 4095 % 256
    with open(path, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(RuntimeError, match=r"column 'x'.*shrank to 1000 bytes.*needs 4096"):
        fastcollate.assemble(dataset.__getitems__([0]))


def test_a_memmap_column_pickles_as_its_file_and_maps_again(tmp_path):
    path = tmp_path / "big.f32"
    np.arange(64 * 256, dtype=np.float32).tofile(path)
    dataset = Arrays(x=np.memmap(path, dtype=np.float32, mode="r", shape=(256, 64)), y=np.arange(256),
                     index_as="id")
    sent = pickle.dumps(dataset)
    assert len(sent) < 8 * 1024, "the 64 KiB column crossed as its path, not its bytes"
    again = pickle.loads(sent)
    _same(
        fastcollate.assemble(again.__getitems__([5, 200])),
        fastcollate.assemble(dataset.__getitems__([5, 200])),
    )


@pytest.mark.parametrize(("workers", "context"), [(0, None), (1, "fork"), (2, "fork"), (2, "spawn")])
def test_dataloader_workers_deliver_each_sample_once_with_the_gathered_values(tmp_path, context, workers):
    path = tmp_path / "images.u8"
    images = np.random.default_rng(0).integers(0, 255, (300, 3, 8, 8), dtype=np.uint8)
    images.tofile(path)
    dataset = Arrays(
        image=np.memmap(path, dtype=np.uint8, mode="r", shape=images.shape), label=torch.arange(300) % 10,
        index_as="id",
    )
    collate = fastcollate.Assembler()
    loader = DataLoader(
        dataset,
        batch_size=32,
        shuffle=True,
        num_workers=workers,
        collate_fn=collate,
        multiprocessing_context=context,
        persistent_workers=workers > 0,
    )
    for _ in range(2):
        seen = []
        for batch in loader:
            ids = batch["id"]
            assert torch.equal(batch["image"], torch.from_numpy(images[ids.numpy()]))
            assert torch.equal(batch["label"], ids % 10)
            seen += ids.tolist()
        assert sorted(seen) == list(range(300))
    if workers:
        stats = collate.shared_slot_stats()
        assert stats.slots_used >= 1 and stats.fresh_fallbacks == 0, "gathered into the shared slots"


def test_stock_batch_sampler_lists_and_index_arrays_both_gather():
    dataset = Arrays(x=torch.arange(100.0), index_as="id")
    sampler = BatchSampler(RandomSampler(range(100), generator=torch.Generator().manual_seed(0)), 10, False)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=fastcollate.assemble)
    delivered = torch.cat([b["x"] for b in loader])
    assert sorted(delivered.tolist()) == list(range(100))
    batch = fastcollate.assemble(dataset.__getitems__(np.array([3, 4], dtype=np.int32)))
    assert batch["x"].tolist() == [3.0, 4.0]
    assert isinstance(dataset.__getitems__([1]), ArrayBatch)


def test_token_windows_equal_nanogpt_get_batch_and_pickle_as_their_file(tmp_path):
    path = tmp_path / "train.bin"
    data = np.random.default_rng(0).integers(0, 50_000, 10_000, dtype=np.uint16)
    data.tofile(path)
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    windows = TokenWindows(tokens, length=64, step=1, index_as="id")
    assert len(windows) == len(data) - 64
    starts = np.random.default_rng(1).integers(0, len(windows), 16)
    contract = Contract(
        {
            "id": Field(kind="number"),
            "input_ids": Field(dtype=torch.int64, shape=(64,), cast_from=(torch.uint16,)),
            "labels": Field(dtype=torch.int64, shape=(64,), cast_from=(torch.uint16,)),
        }
    )
    batch = fastcollate.assemble.using(contract)(windows.__getitems__(starts))
    x = torch.stack(
        [torch.from_numpy(data[i : i + 64].astype(np.int64)) for i in starts]
    )  # nanoGPT's get_batch
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + 64].astype(np.int64)) for i in starts])
    assert torch.equal(batch["input_ids"], x) and torch.equal(batch["labels"], y)
    sent = pickle.dumps(windows)
    assert len(sent) < 4096, "the stream crossed as its path"
    again = pickle.loads(sent)
    assert torch.equal(fastcollate.assemble.using(contract)(again.__getitems__(starts))["labels"], y)
    assert len(TokenWindows(tokens, length=64)) == (len(data) - 65) // 64 + 1
    with pytest.raises(ValueError, match="one contiguous 1-D stream"):
        TokenWindows(tokens[::2], length=8)


def test_a_contract_the_column_path_does_not_cover_goes_the_per_sample_way_with_the_same_result():
    dataset = Arrays(image=torch.zeros(4, 1, 2, 2, dtype=torch.uint8), index_as="id")
    contract = Contract(
        {
            "id": Field(kind="number"),
            "image": Field(dtype=torch.uint8, shape=(3, 2, 2), expand_from=((1, 2, 2),)),
        }
    )
    batch = fastcollate.assemble.using(contract)(dataset.__getitems__([0, 1]))
    assert batch["image"].shape == (2, 3, 2, 2)
    with pytest.raises(ContractError, match="'extra'"):
        fastcollate.assemble.using(
            Contract({"id": Field(kind="number"), "image": Field(), "extra": Field()})
        )(dataset.__getitems__([0]))


def test_one_assembler_keeps_a_layout_per_dataset_and_batch_size_and_still_checks_every_batch():
    collate = fastcollate.Assembler(Contract({"id": Field(kind="number"), "x": Field(range=(0, 100))}))
    floats = Arrays(x=np.arange(10, dtype=np.float32), index_as="id")
    ints = Arrays(x=np.arange(10, dtype=np.int16) * 12, index_as="id")
    for _ in range(2):
        assert collate(floats.__getitems__([1, 2]))["x"].dtype == torch.float32
        assert collate(ints.__getitems__([1, 2]))["x"].tolist() == [12, 24]
        assert collate(ints.__getitems__([3]))["x"].tolist() == [36]
    with pytest.raises(ContractError) as caught:  # a layout seen before: the range is still checked
        collate(ints.__getitems__([0, 9]))
    assert caught.value.sample_id == 9 and caught.value.position == 1


class _KilledAfterGather:
    """assemble, then SIGKILL for the batch holding ``victim``: the worker dies holding the slot it gathered
    into, before sending it."""

    def __init__(self, victim: int) -> None:
        self.assembler = fastcollate.Assembler()
        self.victim = victim

    def __call__(self, batch):
        out = self.assembler(batch)
        if self.victim in out["id"].tolist():
            os.kill(os.getpid(), signal.SIGKILL)
        return out


def test_a_worker_killed_after_gathering_into_a_slot_leaves_no_slot_held():
    dataset = Arrays(x=torch.arange(64.0).reshape(64, 1).expand(64, 4096).contiguous(), index_as="id")
    collate = _KilledAfterGather(victim=40)
    loader = DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=collate)
    with pytest.raises(RuntimeError, match="killed by signal|exited unexpectedly"):
        for _ in loader:
            pass
    stats = collate.assembler.shared_slot_stats()
    assert stats is not None and stats.slots_used >= 1, "the batches were gathered into slots"
    assert stats.writing == 0 and stats.delivered == 0, stats  # the dead worker's slot is taken back by pid
    del loader


def test_device_loader_on_the_cpu_passes_gathered_batches_through_unchanged():
    dataset = Arrays(
        image=torch.randint(0, 255, (40, 3, 4, 4), dtype=torch.uint8), label=torch.arange(40) % 3,
        index_as="id",
    )
    loader = DataLoader(dataset, batch_size=16, collate_fn=fastcollate.assemble)
    seen = []
    for batch in fastcollate.DeviceLoader(loader, device="cpu"):
        assert torch.equal(batch["image"], dataset.columns["image"].rows[batch["id"]])
        seen += batch["id"].tolist()
    assert seen == list(range(40))


# --- odd columns and contracts: memmap slices, casts, unsigned ranges, read-only arrays, refused batches ----


def test_slices_of_a_memmap_pickle_as_their_place_in_the_file(tmp_path):
    path = tmp_path / "x.i32"
    np.arange(4000, dtype=np.int32).tofile(path)
    mm = np.memmap(path, dtype=np.int32, mode="r", shape=(1000, 4))
    flat = np.memmap(path, dtype=np.int32, mode="r")
    for column in (mm[800:], mm[::3], mm[:, 1:3], mm[10:20, 2]):
        dataset = Arrays(x=column, index_as="id")
        sent = pickle.dumps(dataset)
        assert len(sent) < 4096, "crossed as its file"
        again = pickle.loads(sent)
        _same(
            fastcollate.assemble(again.__getitems__([0, len(column) - 1])),
            default_collate([dataset[0], dataset[len(column) - 1]]),
        )
    windows = pickle.loads(pickle.dumps(TokenWindows(flat[100:], 8)))
    assert windows[0]["input_ids"].tolist() == list(range(100, 108))


def test_a_ragged_column_cast_on_the_way_is_padded_in_the_output_dtype():
    values, offsets = np.arange(10, dtype=np.uint16), np.array([0, 3, 3, 10])
    dataset = Arrays(t=Ragged(values, offsets), index_as="id")
    for pad in (-100, 70000):
        contract = Contract(
            {
                "id": Field(kind="number"),
                "t": Field(dtype=torch.int64, shape=("T",), pad=pad, cast_from=(torch.uint16,)),
            }
        )
        batch = fastcollate.assemble.using(contract)(dataset.__getitems__([0, 1, 2]))
        assert batch["t"][0].tolist() == [0, 1, 2] + [pad] * 4
        assert batch["t"][1].tolist() == [pad] * 7


def test_a_ragged_memmap_column_is_checked_against_its_file_and_pickles_as_it(tmp_path):
    path = tmp_path / "v.i64"
    np.arange(100_000, dtype=np.int64).tofile(path)
    values = np.memmap(path, dtype=np.int64, mode="r")
    dataset = Arrays(t=Ragged(values, np.arange(0, 100_001, 100)), index_as="id")
    assert len(pickle.dumps(dataset)) < 8192 + 1001 * 8, "values crossed as their file"
    assert torch.equal(pickle.loads(pickle.dumps(dataset))[999]["t"], dataset[999]["t"])
    os.truncate(path, 800)
    with pytest.raises(RuntimeError, match="column 't'.*shrank to 800 bytes"):
        fastcollate.assemble(dataset.__getitems__([999]))


def test_contracts_the_column_path_must_not_loosen_give_the_per_sample_result():
    def both(dataset, contract, indices):
        collate = fastcollate.assemble.using(contract)
        results = []
        for batch in (dataset.__getitems__(indices), [dataset[i] for i in indices]):
            try:
                results.append(("ok", collate(batch)))
            except ContractError as error:
                results.append((type(error).__name__, error.field))
        return results

    narrowing = Contract(
        {"id": Field(kind="number"), "x": Field(dtype=torch.uint8, range=(0, 100), cast_from=(torch.int64,))}
    )
    gathered, per_sample = both(Arrays(x=np.full(8, 300, np.int64), index_as="id"), narrowing, [0, 1])
    assert gathered == per_sample and gathered[0] == "ContractValueError", gathered
    no_id = Contract({"x": Field()})
    gathered, per_sample = both(Arrays(x=np.zeros(4), index_as="id"), no_id, [0, 1])
    assert gathered == per_sample and gathered[0] != "ok"
    shared = Contract({"id": Field(kind="number"), "a": Field(shape=("T",), pad=0), "b": Field(shape=("T",))})
    dataset = Arrays(a=Ragged(np.arange(7), np.array([0, 3, 7])), b=np.zeros((2, 3)), index_as="id")
    gathered, per_sample = both(dataset, shared, [0, 1])
    assert gathered == per_sample and gathered[0] == "ContractSizeError", gathered


def test_ranges_on_unsigned_columns_and_casts_of_complex_columns_work():
    contract = Contract({"id": Field(kind="number"), "x": Field(dtype=torch.uint16, range=(0, 2))})
    with pytest.raises(ContractError, match="values in"):
        dataset = Arrays(x=np.array([0, 1, 5], np.uint16), index_as="id")
        fastcollate.assemble.using(contract)(dataset.__getitems__([2]))
    complex_column = Arrays(z=np.arange(6, dtype=np.complex64), index_as="id")
    contract = Contract(
        {"id": Field(kind="number"), "z": Field(dtype=torch.complex128, cast_from=(torch.complex64,))}
    )
    assert fastcollate.assemble.using(contract)(complex_column.__getitems__([5]))["z"].tolist() == [5 + 0j]


def test_columns_are_read_only_and_odd_arrays_are_named_or_taken():
    dataset = Arrays(x=np.zeros(3), index_as="id")
    with pytest.raises(TypeError):
        dataset.columns["x"] = dataset.columns["x"]
    assert len(Arrays(x=np.zeros((0, 3)), index_as="id")) == 0
    with pytest.raises((TypeError, ValueError), match="column 'b'.*np.ascontiguousarray"):
        Arrays(b=np.arange(4, dtype=">i4"), index_as="id")
    with pytest.raises(IndexError, match="out of range"):
        Arrays(x=np.zeros(3), index_as="id").__getitems__(np.array([2**64 - 1], dtype=np.uint64))


def test_a_batch_refused_after_its_gather_in_a_worker_gives_its_slot_back():
    # The range is checked on the gathered column, after the slot was claimed: the refused batch's slot
    # must come back, epoch after epoch, with no fresh fallback.
    labels = np.arange(64) % 10
    labels[20] = 99
    dataset = Arrays(x=np.zeros((64, 1024), np.float32), y=labels, index_as="id")
    collate = fastcollate.Assembler(
        Contract({"id": Field(kind="number"), "x": Field(), "y": Field(kind="number", range=(0, 10))})
    )
    loader = DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=collate, persistent_workers=True)
    for _ in range(3):
        delivered, refused = 0, 0
        batches = iter(loader)
        while True:
            try:
                batch = next(batches)
                delivered += 1
            except StopIteration:
                break
            except ContractError as error:
                assert error.sample_id == 20 and error.field == "y"
                refused += 1
                # Its frames hold the iterator in a reference cycle, which the garbage collector frees
                # after the iterator's queues: DataLoader would then wait 5 s a worker before killing them.
                error.__traceback__ = None
        del batch
        assert (delivered, refused) == (7, 1)
        stats = collate.shared_slot_stats()
        assert stats.writing == 0 and stats.delivered == 0 and stats.fresh_fallbacks == 0, stats


def test_a_range_on_a_ragged_column_checks_real_positions_only_whatever_the_mask_dtype():
    dataset = Arrays(t=Ragged(np.array([1, 2, 3, 9, 4]), np.array([0, 2, 3, 5])), index_as="id")
    for mask_dtype in (torch.bool, torch.int64, torch.float32):
        contract = Contract({"id": Field(kind="number"),
                             "t": Field(shape=("T",), pad=-5, mask_dtype=mask_dtype, range=(0, 5))})
        collate = fastcollate.assemble.using(contract)
        # -5 pads sample 1 and is out of range: padding is not checked
        assert collate(dataset.__getitems__([0, 1]))["t"].tolist() == [[1, 2], [3, -5]]
        with pytest.raises(ContractError) as caught:
            collate(dataset.__getitems__([0, 2]))
        assert (caught.value.sample_id, caught.value.position) == (2, 1)
        assert "flat position 0" in str(caught.value)


def test_indices_changed_after_getitems_do_not_move_the_gather():
    dataset = Arrays(t=Ragged(np.arange(9), np.array([0, 3, 6, 9])), index_as="id")
    indices = np.array([0, 1], dtype=np.int64)
    batch = dataset.__getitems__(indices)
    indices[1] = 10**12  # the caller's array, changed after the batch checked it
    assert fastcollate.assemble(batch)["t"].tolist() == [[0, 1, 2], [3, 4, 5]]
    tensor = torch.tensor([0, 2])
    batch = dataset.__getitems__(tensor)
    tensor[1] = 3  # one past the end
    assert fastcollate.assemble(batch)["t"].tolist() == [[0, 1, 2], [6, 7, 8]]


def test_the_native_plan_refuses_what_arraybatch_would_not_hand_it():
    dataset = Arrays(t=Ragged(np.arange(9), np.array([0, 3, 6, 9])), index_as="id")
    columns = gather.gatherer(dataset, None, "id")
    with pytest.raises(RuntimeError, match="an empty batch"):
        columns.plan(torch.zeros(0, dtype=torch.int64))
    with pytest.raises(IndexError, match="index 3 .batch position 1. is out of range for 3 rows"):
        columns.plan(torch.tensor([0, 3]))
    unordered = _C.GatheredColumn(
        kind=_C.GatheredKind.RAGGED, key="t", values=[torch.arange(5)], offsets=[torch.tensor([0, 3, 2, 5])],
        dtype=torch.int64,
    )
    columns = _C.ColumnGather([unordered], length=3, id_key="id", ids_are_indices=False)
    spans = r"^Arrays: column 't': row 1 \(batch position 1\) spans offsets 3\.\.2"
    with pytest.raises(IndexError, match=spans):
        columns.plan(torch.tensor([0, 1]))


@pytest.mark.parametrize("declared", [dict(pad=300), dict(pack=True, separator=300)])
def test_a_value_the_dtype_cannot_hold_is_named_after_the_samples_ranges_as_the_walk_names_it(declared):
    rows = Ragged(np.array([1, 2, 3, 100, 4], dtype=np.int8), np.array([0, 2, 4, 5]))
    packing = fastcollate.Packing() if declared.get("pack") else None
    contract = Contract({"t": Field(shape=("T",), range=(0, 10), **declared)}, id=None, packing=packing)
    dataset = Arrays(t=rows)
    collate = fastcollate.Assembler(contract)
    with pytest.raises(ContractError) as gathered:
        collate(dataset.__getitems__([0, 1, 2]))
    with pytest.raises(ContractError) as walked:
        collate([dataset[0], dataset[1], dataset[2]])
    assert str(gathered.value) == str(walked.value) and gathered.value.position == 1


def test_a_range_on_a_complex_column_names_the_first_sample_with_values():
    values = np.array([1 + 1j, 2 + 0j], dtype=np.complex64)
    dataset = Arrays(t=Ragged(values, np.array([0, 0, 2])), index_as="id")
    contract = Contract({"id": Field(kind="number"), "t": Field(shape=("T",), pad=0, range=(0, 10))})
    collate = fastcollate.Assembler(contract)
    with pytest.raises(ContractError) as gathered:
        collate(dataset.__getitems__([0, 1]))
    with pytest.raises(ContractError) as walked:
        collate([dataset[0], dataset[1]])
    named = [(error.value.position, error.value.sample_id) for error in (gathered, walked)]
    assert named == [(1, 1), (1, 1)]


def test_a_refused_batch_in_a_full_ring_still_warns_and_its_kept_error_holds_no_slot():
    ring = fastcollate.StagingRing(max_slots=1)
    dataset = Arrays(a=np.arange(100).reshape(50, 2), index_as="id")
    contract = Contract({"id": Field(kind="number"), "a": Field(shape=(2,), range=(0, 10))})
    collate = fastcollate.Assembler(contract, ring=ring)
    kept = collate(dataset.__getitems__([0, 1]))  # holds the only slot
    with pytest.warns(ResourceWarning, match="staging slots are held"):
        with pytest.raises(ContractError):
            collate(dataset.__getitems__([0, 40]))  # a fresh buffer, then the range refuses it
    del kept
    errors = []
    for _ in range(3):  # the errors (and their tracebacks) are kept: they must not keep the slot
        try:
            collate(dataset.__getitems__([0, 40]))
        except ContractError as error:
            errors.append(error)
    before = ring.stats().overflow_allocations
    collate(dataset.__getitems__([0, 1]))
    assert ring.stats().overflow_allocations == before and len(errors) == 3


@pytest.mark.parametrize("given", [[4, 0, 2], [np.int64(4), 0, 2], [4, 0, True], [4.0, 0, 2], [2**64, 0, 2]])
def test_a_list_of_indices_is_read_as_the_same_batch_whatever_its_elements(given):
    dataset = Arrays(x=np.arange(10) * 10, index_as="id")
    if any(isinstance(i, float) for i in given):
        with pytest.raises(TypeError, match="a batch of indices must be a 1-D sequence of ints"):
            dataset.__getitems__(given)
        return
    if given[0] == 2**64:
        with pytest.raises(IndexError, match=f"index {2**64} is out of range"):
            dataset.__getitems__(given)
        return
    batch = dataset.__getitems__(given)
    given[0] = 9  # the caller's list, changed after: the batch keeps its own indices
    assert batch.indices.dtype == np.int64
    assert fastcollate.assemble(batch)["x"].tolist() == [40, 0, int(given[2]) * 10]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(broken_columns())
def test_one_rule_broken_in_one_row_fails_the_same_gathered_or_walked(case):
    assert_same_outcome(case)


def test_a_gathered_sample_is_named_by_the_collate_s_id_key_as_the_walk_names_it():
    values = torch.tensor([[1.0], [2.0], [9.0]])
    by_index = Arrays(x=values, index_as="id")  # its id key is the collate's: a sample's id is its index
    by_column = Arrays(id=np.array([10, 20, 30]), x=values)  # the ids are a column
    unnamed = Arrays(x=values, index_as="idx")  # its ids are under a key the collate does not read
    contract = {"x": Field(dtype=torch.float32, shape=(1,), range=(0, 5))}
    for dataset, id_field, named in [(by_index, "id", "sample id=2 (batch position 1)"),
                                     (by_column, "id", "sample id=30 (batch position 1)"),
                                     (unnamed, "idx", "sample at batch position 1 (samples carry no 'id'")]:
        collate = fastcollate.assemble.using(Contract({id_field: Field(kind="number"), **contract}))
        assert gathered_plan(dataset.__getitems__([0, 2]), collate.contract, "id") is not None
        for batch in (dataset.__getitems__([0, 2]), [dataset[0], dataset[2]]):
            with pytest.raises(ContractError) as caught:
                collate(batch)
            assert str(caught.value).startswith(named), str(caught.value)


@pytest.mark.parametrize("pad_first", [True, False])
def test_a_pad_the_dtype_cannot_hold_is_named_in_the_walk_s_order_of_fields_gathered_or_walked(pad_first):
    tokens = Ragged(torch.arange(5), np.array([0, 2, 5]))
    labels = torch.tensor([[1], [7]])  # 7 is out of the label's range
    padded = {"t": Field(shape=("T",), pad=2.5)}
    ranged = {"y": Field(dtype=torch.int64, shape=(1,), range=(0, 5))}
    columns = {"t": tokens, "y": labels} if pad_first else {"y": labels, "t": tokens}
    fields = {**padded, **ranged} if pad_first else {**ranged, **padded}
    contract = Contract({"id": Field(kind="number"), **fields})
    case = Broken(Arrays(columns, index_as="id"), contract, [0, 1], "pad", True)
    assert_same_outcome(case)
    with pytest.raises(ContractError) as caught:
        fastcollate.assemble.using(case.contract)(case.dataset.__getitems__([0, 1]))
    assert caught.value.field == ("t" if pad_first else "y")
