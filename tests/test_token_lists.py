"""Lists of Python numbers in tensor fields, as tokenizers and Hugging Face datasets hand out token ids:
read in C++ into the declared dtype, the batch is the batch of the same values as tensors (padded,
packed, fixed dims, ranges, a property over random lengths and values); each refusal names the sample
and the field; drop-in mode (no contract) keeps default_collate's reading of lists."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, default_collate

from fastcollate import Contract, Field, Packing, assemble
from fastcollate.collate.errors import ContractSizeError, ContractTypeError, ContractValueError


def contract(mode, dtype=torch.int64, shape=("T",), **options):
    """One token field, padded or packed, beside the sample's id."""
    layout = {"padded": {"pad": 0}, "packed": {"pack": True}, "fixed": {}}[mode]
    field = Field(dtype=dtype, shape=shape, **layout, **options)
    packing = Packing(max_length=None) if mode == "packed" else None
    return Contract({"id": Field(kind="number"), "input_ids": field}, packing=packing)


def as_tensors(samples, dtype):
    return [{**s, "input_ids": torch.tensor(s["input_ids"], dtype=dtype)} for s in samples]


def assert_same_batch(got, expected):
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype, key
        assert got[key].shape == value.shape, key
        assert torch.equal(got[key], value), key


def samples_of(*rows):
    return [{"id": 100 + i, "input_ids": row} for i, row in enumerate(rows)]


ROWS = ([5, 6, 7], [8], [], [9, 10])


@pytest.mark.parametrize("mode", ["padded", "packed"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.float32, torch.bfloat16])
def test_a_batch_of_lists_is_the_batch_of_the_same_tensors(mode, dtype):
    samples = samples_of(*ROWS)
    got = assemble.using(contract(mode, dtype))(samples)
    assert_same_batch(got, assemble.using(contract(mode, dtype))(as_tensors(samples, dtype)))
    assert got["input_ids"].dtype == dtype


def test_the_padded_batch_of_lists_holds_the_values_the_pad_and_the_mask():
    batch = assemble.using(contract("padded"))(samples_of(*ROWS))
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0], [0, 0, 0], [9, 10, 0]]
    assert batch["input_ids_lengths"].tolist() == [3, 1, 0, 2]
    assert batch["input_ids_mask"].sum(1).tolist() == [3, 1, 0, 2]


def test_the_packed_batch_of_lists_keeps_an_empty_sample_as_a_zero_length_sequence():
    batch = assemble.using(contract("packed", separator=-100))(samples_of(*ROWS))
    assert batch["input_ids"].tolist() == [[-100, 6, 7, -100, -100, 10]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 4, 4, 6]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1]]


def test_tuples_and_tensors_mix_with_lists_in_one_batch():
    samples = samples_of([1, 2], (3, 4, 5), torch.tensor([6]), [])
    got = assemble.using(contract("padded"))(samples)
    assert got["input_ids"].tolist() == [[1, 2, 0], [3, 4, 5], [6, 0, 0], [0, 0, 0]]


def test_a_batch_of_empty_lists_only_pads_to_zero_length():
    samples = samples_of([], [])
    got = assemble.using(contract("padded"))(samples)
    assert got["input_ids"].shape == (2, 0)
    assert_same_batch(got, assemble.using(contract("padded"))(as_tensors(samples, torch.int64)))


def test_a_fixed_field_takes_lists_of_its_declared_length():
    samples = samples_of([1, 2, 3], [4, 5, 6])
    got = assemble.using(contract("fixed", shape=(3,)))(samples)
    assert_same_batch(got, assemble.using(contract("fixed", shape=(3,)))(as_tensors(samples, torch.int64)))


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_lists_of_lists_fill_a_fixed_trailing_dim(mode):
    samples = samples_of([[1, 2], [3, 4], [5, 6]], [], [[7, 8]])
    tensors = [{**s, "input_ids": torch.tensor(s["input_ids"], dtype=torch.int64).reshape(-1, 2)}
               for s in samples]
    declared = contract(mode, shape=("T", 2))
    got = assemble.using(declared)(samples)
    assert_same_batch(got, assemble.using(declared)(tensors))
    assert got["input_ids"].shape[-1] == 2


def test_lists_pass_the_declared_range_and_a_value_outside_it_is_named_by_its_position():
    declared = contract("padded", range=(0, 10))
    assert assemble.using(declared)(samples_of([0, 9], [5]))["input_ids"].tolist() == [[0, 9], [5, 0]]
    with pytest.raises(ContractValueError) as raised:
        assemble.using(declared)(samples_of([0, 9], [5, 10]))
    error = raised.value
    assert (error.sample_id, error.position, error.field) == (101, 1, "input_ids")
    assert error.expected == "values in [0, 10)" and "flat position 1" in error.got


def test_two_list_fields_that_share_a_named_dim_must_agree_within_a_sample():
    tokens = dict(dtype=torch.int64, shape=("T",), pack=True)
    declared = Contract({"input_ids": Field(**tokens), "labels": Field(**tokens)}, id=None)
    with pytest.raises(ContractSizeError) as raised:
        assemble.using(declared)([{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [3], "labels": []}])
    assert (raised.value.position, raised.value.field) == (1, "labels")
    assert "dim T = 1 (as in field input_ids)" in str(raised.value)


@pytest.mark.parametrize("workers", [0, 2])
def test_lists_from_workers_give_the_main_process_s_batch(workers):
    samples = samples_of(*ROWS, [1] * 40)
    collate = assemble.using(contract("packed"))
    loader = DataLoader(samples, batch_size=3, num_workers=workers, collate_fn=collate)
    expected = [assemble.using(contract("packed"))(samples[i : i + 3]) for i in range(0, len(samples), 3)]
    batches = list(loader)
    assert len(batches) == len(expected)
    for got, want in zip(batches, expected, strict=True):
        assert_same_batch(got, want)


def test_drop_in_mode_reads_lists_as_default_collate_does():
    samples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6]}]
    got, expected = assemble(samples), default_collate(samples)
    assert len(got["input_ids"]) == len(expected["input_ids"]) == 3
    for ours, theirs in zip(got["input_ids"], expected["input_ids"], strict=True):
        assert torch.equal(ours, theirs)


# ---------------------------------------------------------------------------------------------------
# Refusals: each names the sample (its id and batch position) and the field


def refused(error_type, declared, *rows):
    with pytest.raises(error_type) as raised:
        assemble.using(declared)(samples_of(*rows))
    return raised.value


@pytest.mark.parametrize(
    ("dtype", "element", "expected"),
    [
        (torch.int64, 1.0, "a Python int (declared torch.int64)"),
        (torch.int32, True, "a Python int (declared torch.int32)"),  # a bool is no token id
        (torch.bool, 1, "a Python bool (declared torch.bool)"),
        (torch.float32, "7", "a Python float or int (declared torch.float32)"),
        (torch.int64, [3], "a Python int (declared torch.int64)"),  # one level too deep
    ],
)
def test_an_element_of_the_wrong_python_type_is_named_by_its_position(dtype, element, expected):
    good = True if dtype == torch.bool else 1
    error = refused(ContractTypeError, contract("padded", dtype), [good, good], [good, good, element])
    assert (error.sample_id, error.position, error.field) == (101, 1, "input_ids")
    assert error.expected == expected
    assert error.got == f"{type(element).__name__} at flat position 2"


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (torch.uint8, 256),
        (torch.uint8, -1),  # refused, not wrapped to 255
        (torch.int8, -129),
        (torch.int32, 2**31),
        (torch.int64, 2**63),
        (torch.uint64, -1),
        (torch.uint64, 2**64),
        (torch.float16, 70000),
        (torch.float32, 1e39),
        (torch.float64, 10**400),
    ],
)
def test_a_value_the_declared_dtype_cannot_hold_is_named_by_its_position(dtype, value):
    error = refused(ContractValueError, contract("packed", dtype), [1], [1, value])
    assert (error.sample_id, error.position, error.field) == (101, 1, "input_ids")
    assert error.expected == f"a value {dtype} can hold (the declared dtype)"
    assert error.got == "a value outside its range at flat position 1"


@pytest.mark.parametrize(
    ("dtype", "values"),
    [
        (torch.uint8, [0, 255]),
        (torch.int8, [-128, 127]),
        (torch.int64, [-(2**63), 2**63 - 1]),
        (torch.uint64, [0, 2**63, 2**64 - 1]),
        (torch.float16, [65504, -0.5]),
        (torch.bool, [True, False]),
    ],
)
def test_values_at_the_edges_of_the_dtype_are_kept_exactly(dtype, values):
    batch = assemble.using(contract("packed", dtype))(samples_of(values))
    assert batch["input_ids"][0].tolist() == values
    assert batch["input_ids"].dtype == dtype


def test_a_list_for_a_field_without_a_declared_dtype_is_refused_with_what_to_declare():
    declared = Contract({"input_ids": Field(shape=("T",), pad=0)}, id=None)
    with pytest.raises(ContractTypeError) as raised:
        assemble.using(declared)([{"input_ids": torch.tensor([1])}, {"input_ids": [1, 2]}])
    assert (raised.value.position, raised.value.field) == (1, "input_ids")
    assert "dtype" in raised.value.expected and "Field(dtype=torch.int64" in raised.value.hint


def test_a_list_for_a_complex_field_is_refused():
    error = refused(ContractTypeError, contract("fixed", torch.complex64, shape=(2,)), [1, 2])
    assert error.field == "input_ids" and "torch.complex64" in error.got


def test_a_ragged_list_of_lists_is_refused_as_not_rectangular():
    error = refused(ContractSizeError, contract("padded", shape=("T", 2)), [[1, 2]], [[1, 2], [3]])
    assert (error.sample_id, error.field) == (101, "input_ids")
    assert "rectangular" in error.expected and error.got == "1 elements in one of them"


def test_a_flat_list_for_two_declared_dims_is_refused():
    error = refused(ContractSizeError, contract("packed", shape=("T", 2)), [1, 2])
    assert (error.sample_id, error.field) == (100, "input_ids")
    assert "nested 2 deep" in error.expected and error.got.startswith("int at dim 1")


def test_rows_of_the_wrong_fixed_length_are_named_with_the_declared_shape():
    error = refused(ContractSizeError, contract("padded", shape=("T", 2)), [[1, 2]], [[1, 2, 3]])
    assert (error.sample_id, error.field) == (101, "input_ids")
    assert (error.expected, error.got) == ("shape [T, 2]", "shape [1, 3]")


def test_samples_without_ids_are_named_by_batch_position():
    declared = Contract({"input_ids": Field(dtype=torch.uint8, shape=("T",), pack=True)}, id=None)
    with pytest.raises(ContractValueError) as raised:
        assemble.using(declared)([{"input_ids": [1]}, {"input_ids": [1]}, {"input_ids": [300]}])
    assert (raised.value.sample_id, raised.value.position, raised.value.field) == (None, 2, "input_ids")
    assert "batch position 2" in str(raised.value)


# ---------------------------------------------------------------------------------------------------
# Property: any lengths and values, lists against tensors


DTYPES = {
    torch.int64: st.integers(-(2**63), 2**63 - 1),
    torch.int32: st.integers(-(2**31), 2**31 - 1),
    torch.int16: st.integers(-(2**15), 2**15 - 1),
    torch.uint8: st.integers(0, 255),
    torch.bool: st.booleans(),
    torch.float64: st.floats(allow_nan=False),
    torch.float32: st.floats(allow_nan=False, width=32),
    torch.bfloat16: st.integers(-256, 256),  # exact in bfloat16: no rounding to compare
    torch.float16: st.integers(-2048, 2048),
}


@st.composite
def list_batches(draw):
    dtype = draw(st.sampled_from(list(DTYPES)))
    mode = draw(st.sampled_from(["padded", "packed"]))
    rows = draw(st.lists(st.lists(DTYPES[dtype], max_size=30), min_size=1, max_size=10))
    if mode == "packed" and not any(rows):
        rows[0] = [draw(DTYPES[dtype])]
    as_tensor = draw(st.lists(st.booleans(), min_size=len(rows), max_size=len(rows)))
    return dtype, mode, rows, as_tensor


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=list_batches())
def test_any_batch_of_lists_equals_the_batch_of_tensors(case):
    dtype, mode, rows, as_tensor = case
    samples = samples_of(*rows)
    # Some samples tensors already: a batch may mix them.
    mixed = [{**s, "input_ids": torch.tensor(s["input_ids"], dtype=dtype)} if t else s
             for s, t in zip(samples, as_tensor, strict=True)]
    declared = contract(mode, dtype)
    got = assemble.using(declared)(mixed)
    expected = assemble.using(declared)(as_tensors(samples, dtype))
    assert_same_batch(got, expected)
