"""Packed batches from fastcollate.Arrays: ragged token columns packed straight from their values and
offsets (fastcollate.gather), with no sample objects. Each batch must equal what the per-sample walk packs
from the same samples, key for key, in the same order, dtype for dtype; what the column-wise path does not
cover, and every refusal, goes the per-sample way, with its errors."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from fastcollate import Arrays, Contract, Field, IndexBatches, Packing, Ragged, assemble, ops
from fastcollate._torch_compat import jagged_max_seqlen
from fastcollate.collate.errors import ContractSizeError, ContractTypeError, ContractValueError

from .helpers.batches import assert_same_batch
from .helpers.broken_columns import assert_same_outcome, broken_columns
from .helpers.chunks import chunked, cuts
from .helpers.gathered import gathered_plan


def ragged(lengths, dtype=torch.int64, inner=(), seed=0, high=100):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, high, (sum(lengths), *inner), generator=generator).to(dtype)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return Ragged(values, offsets)


def token_arrays(lengths, token_type_ids=False, dtype=torch.int64, seed=0):
    """A tokenized corpus as columns: input_ids, labels (a copy, as for a causal LM), and optionally
    BERT-style token_type_ids, each a Ragged column over the same offsets."""
    ids = ragged(lengths, dtype, seed=seed)
    columns = {"input_ids": ids, "labels": Ragged(ids.values.clone(), ids.offsets)}
    if token_type_ids:
        columns["token_type_ids"] = ragged(lengths, dtype, seed=seed + 1, high=2)
    return Arrays(columns, index_as="id")


def packed_contract(keys=("input_ids", "labels"), dtype=torch.int64, separator=-100, **packing):
    fields = {"id": Field(kind="number")}
    for key in keys:
        fields[key] = Field(dtype=dtype, shape=("T",), pack=True,
                            separator=separator if key == "labels" else None)
    return Contract(fields, packing=Packing(**packing))


def walked(dataset, indices, contract):
    """What the per-sample walk makes of the same samples."""
    return assemble.using(contract)([dataset[i] for i in indices])


def gathered(dataset, indices, contract):
    batch = dataset.__getitems__(indices)
    assert gathered_plan(batch, contract, "id") is not None, "gathered, not walked"
    return assemble.using(contract)(batch)


@pytest.mark.parametrize("token_type_ids", [False, True], ids=["llama-style", "bert-style"])
@pytest.mark.parametrize("options", [
    {},
    {"seq_idx": "seq_idx", "position_ids_start": 2},
    {"position_ids": None, "max_length": None},
    {"cu_seq_lens": ("offsets_q", "offsets_k"), "max_length": ("longest_q", "longest_k")},
], ids=["defaults", "seq_idx-start2", "fewer-keys", "renamed"])
def test_an_arrays_batch_is_packed_column_wise_as_the_walk_packs_it(token_type_ids, options):
    lengths = [5, 1, 0, 17, 3, 9, 2, 2048, 4]
    dataset = token_arrays(lengths, token_type_ids=token_type_ids)
    keys = ("input_ids", "labels", "token_type_ids") if token_type_ids else ("input_ids", "labels")
    contract = packed_contract(keys, **options)
    indices = [3, 0, 2, 7, 1, 1, 8]  # an empty sample, a repeated one, the longest
    ours = gathered(dataset, indices, contract)
    assert_same_batch(ours, walked(dataset, indices, contract))
    if "cu_seq_lens" not in options:
        expected = np.concatenate([[0], np.cumsum([lengths[i] for i in indices])])
        assert ours["cu_seq_lens_q"].tolist() == expected.tolist()


def test_an_arrays_batch_equals_data_collator_with_flattening_key_for_key():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    dataset = token_arrays([7, 3, 12, 1, 30])
    indices = [4, 0, 3, 2]
    ours = gathered(dataset, indices, packed_contract(seq_idx="seq_idx"))
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    samples = [dataset[i] for i in indices]
    theirs = collator([{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples])
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key


def test_uint16_tokens_are_cast_on_the_way_and_the_separator_written_in_the_field_s_dtype():
    dataset = token_arrays([4, 6, 2], dtype=torch.uint16)
    fields = {"id": Field(kind="number")}
    for key in ("input_ids", "labels"):
        fields[key] = Field(dtype=torch.int64, shape=("T",), pack=True, cast_from=(torch.uint16,),
                            separator=-100 if key == "labels" else None)
    contract = Contract(fields)
    ours = gathered(dataset, [2, 0, 1], contract)
    assert_same_batch(ours, walked(dataset, [2, 0, 1], contract))
    assert ours["labels"][0, 0] == -100 and ours["labels"].dtype == torch.int64


def test_a_packed_column_with_fixed_dims_after_the_token_dim_keeps_them():
    values = ragged([2, 1, 3], torch.float32, inner=(3,))
    dataset = Arrays(embeddings=values, index_as="id")
    contract = Contract({"id": Field(kind="number"),
                         "embeddings": Field(dtype=torch.float32, shape=("T", 3), pack=True, separator=0)})
    ours = gathered(dataset, [0, 1, 2], contract)
    assert ours["embeddings"].shape == (1, 6, 3)
    assert_same_batch(ours, walked(dataset, [0, 1, 2], contract))


def test_a_packed_column_whose_rows_have_the_wrong_fixed_dims_is_named():
    dataset = Arrays(embeddings=ragged([2, 1], torch.float32, inner=(4,)), index_as="id")
    contract = Contract({"id": Field(kind="number"),
                         "embeddings": Field(dtype=torch.float32, shape=("T", 3), pack=True)})
    with pytest.raises(ContractSizeError) as raised:
        assemble.using(contract)(dataset.__getitems__([1, 0]))
    assert raised.value.field == "embeddings" and raised.value.sample_id == 1


def test_a_packed_column_of_the_wrong_dtype_is_named_with_the_cast_that_would_take_it():
    dataset = token_arrays([3, 2], dtype=torch.int32)
    with pytest.raises(ContractTypeError, match="cast_from") as raised:
        assemble.using(packed_contract())(dataset.__getitems__([1, 0]))
    assert raised.value.field == "input_ids"


def test_nested_packed_columns_are_jagged_views_of_the_gathered_row():
    dataset = token_arrays([3, 5, 1, 4])
    contract = packed_contract(nested=True)
    ours = gathered(dataset, [1, 3, 0], contract)
    assert_same_batch(ours, walked(dataset, [1, 3, 0], contract))
    ids = ours["input_ids"]
    assert ids.is_nested and ids.values().shape == (12,)
    assert ids.offsets().data_ptr() == ours["cu_seq_lens_q"].data_ptr(), "no copy of the offsets"
    assert jagged_max_seqlen(ids) == 5


def test_a_range_is_checked_on_the_samples_own_tokens_and_names_the_sample_and_position():
    dataset = token_arrays([4, 3, 5])
    dataset.columns["input_ids"].values[4 + 3 + 2] = 1000  # sample 2, its third token
    fields = dict(packed_contract().fields)
    fields["input_ids"] = Field(dtype=torch.int64, shape=("T",), pack=True, range=(0, 100))
    contract = Contract(fields)
    with pytest.raises(ContractValueError) as gathered_error:
        assemble.using(contract)(dataset.__getitems__([0, 1, 2]))
    with pytest.raises(ContractValueError) as walked_error:
        walked(dataset, [0, 1, 2], contract)
    assert gathered_error.value.sample_id == 2 and gathered_error.value.position == 2
    assert str(gathered_error.value) == str(walked_error.value)
    # The separator replaces a label's first token only after the check: a range on labels sees -100.
    fields["labels"] = Field(dtype=torch.int64, shape=("T",), pack=True, separator=-100, range=(0, 100))
    fields["input_ids"] = Field(dtype=torch.int64, shape=("T",), pack=True)
    batch = gathered(token_arrays([4, 3]), [0, 1], Contract(fields))
    assert batch["labels"][0, 0] == -100


@pytest.mark.parametrize("refusal", ["lengths differ", "over max_tokens", "no token"])
def test_refused_batches_go_the_per_sample_way_and_get_its_errors(refusal):
    if refusal == "lengths differ":
        dataset = Arrays(input_ids=ragged([3, 4, 5]), labels=ragged([3, 2, 5], seed=1), index_as="id")
        contract, error, sample = packed_contract(), ContractSizeError, 1
    elif refusal == "over max_tokens":
        dataset = token_arrays([6, 6, 6])
        contract, error, sample = packed_contract(max_tokens=10), ContractSizeError, 1
    else:
        dataset = token_arrays([0, 0, 3])
        contract, error, sample = packed_contract(), ContractValueError, None
    batch = dataset.__getitems__([0, 1]) if refusal == "no token" else dataset.__getitems__([0, 1, 2])
    assert gathered_plan(batch, contract, "id") is None
    with pytest.raises(error) as raised:
        assemble.using(contract)(batch)
    if sample is not None:
        assert raised.value.sample_id == sample
    with pytest.raises(error) as walked_error:
        assemble.using(contract)(list(batch))
    assert str(raised.value) == str(walked_error.value)


def test_a_padded_field_naming_the_packed_dim_or_fixed_length_rows_go_the_per_sample_way():
    rows = Arrays(input_ids=torch.arange(12).reshape(4, 3), index_as="id")
    contract = Contract(
        {"id": Field(kind="number"), "input_ids": Field(dtype=torch.int64, shape=("T",), pack=True)}
    )
    batch = rows.__getitems__([2, 0])
    assert gathered_plan(batch, contract, "id") is None
    assert assemble.using(contract)(batch)["input_ids"].tolist() == [[6, 7, 8, 0, 1, 2]]


@pytest.mark.parametrize("workers", [0, 2])
def test_index_batches_through_workers_pack_every_sample_once(workers):
    lengths = [(7 * i) % 23 + 1 for i in range(64)]
    dataset = token_arrays(lengths)
    contract = packed_contract(seq_idx="seq_idx")
    sampler = IndexBatches(len(dataset), batch_size=16, shuffle=True, seed=5)
    collate = assemble.using(contract)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=workers, collate_fn=collate)
    seen = []
    for batch in loader:
        ids = batch["id"].tolist()
        seen += ids
        assert_same_batch(batch, walked(dataset, ids, contract))
    assert sorted(seen) == list(range(64))


# make fuzz runs each property FASTCOLLATE_FUZZ_EXAMPLES times (10,000); make test 60.
EXAMPLES = int(os.environ.get("FASTCOLLATE_FUZZ_EXAMPLES", "60"))
DTYPES = [torch.int64, torch.int32, torch.uint16, torch.uint8, torch.float32, torch.bfloat16]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.one_of(st.integers(0, 40), st.just(1), st.just(2048)), min_size=1, max_size=12),
    dtypes=st.lists(st.sampled_from(DTYPES), min_size=1, max_size=3),
    separators=st.lists(st.one_of(st.none(), st.integers(0, 100)), min_size=3, max_size=3),
    start=st.integers(0, 3),
    seq_idx=st.booleans(),
    picks=st.lists(st.integers(0, 2**16), min_size=1, max_size=16),
    data=st.data(),
)
def test_any_gathered_packed_batch_equals_the_walk_s(  # noqa: PLR0913 (hypothesis draws each)
    lengths, dtypes, separators, start, seq_idx, picks, data
):
    indices = [p % len(lengths) for p in picks]
    if sum(lengths[i] for i in indices) == 0:
        lengths[indices[0]] = 1
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    columns, fields = {}, {"id": Field(kind="number")}
    for k, (dtype, separator) in enumerate(zip(dtypes, separators, strict=False)):
        column = Ragged(torch.randint(0, 100, (int(offsets[-1]),)).to(dtype), offsets)
        columns[f"f{k}"] = chunked(column, data.draw(cuts(len(lengths))))
        fields[f"f{k}"] = Field(dtype=dtype, shape=("T",), pack=True, separator=separator)
    dataset = Arrays(columns, index_as="id")
    packing = Packing(position_ids_start=start, seq_idx="seq_idx" if seq_idx else None)
    contract = Contract(fields, packing=packing)
    assert_same_batch(gathered(dataset, indices, contract), walked(dataset, indices, contract))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(broken_columns(packed=True))
def test_one_rule_broken_in_one_packed_row_fails_the_same_gathered_or_walked(case):
    assert_same_outcome(case)


# ---------------------------------------------------------------------------------------------------
# The two ops on their own


def test_gather_packed_into_checks_cu_seq_lens_against_the_rows():
    values, offsets = torch.arange(10), torch.tensor([0, 3, 4, 10])

    def pack(indices, cu_seq_lens, total):
        out = torch.empty(total, dtype=torch.int64)
        cu = torch.tensor(cu_seq_lens, dtype=torch.int32)
        ops.gather_packed_into(values, offsets, torch.tensor(indices), cu, out)
        return out.tolist()

    assert pack([2, 1], [0, 6, 7], 7) == [4, 5, 6, 7, 8, 9, 3]
    with pytest.raises(RuntimeError, match="has length 6 but cu_seq_lens gives it 5"):
        pack([2, 1], [0, 5, 7], 7)
    with pytest.raises(RuntimeError, match="must start at 0"):
        pack([2], [1, 7], 6)
    with pytest.raises(RuntimeError, match="out must be contiguous of shape"):
        pack([2], [0, 6], 7)
    with pytest.raises(IndexError, match="out of range"):
        pack([3], [0, 6], 6)


def test_packed_positions_into_writes_position_ids_and_seq_idx_or_either():
    cu_seq_lens = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    positions, samples = torch.empty(1, 5, dtype=torch.int64), torch.empty(1, 5, dtype=torch.int32)
    ops.packed_positions_into(cu_seq_lens, 3, positions, samples)
    assert positions.tolist() == [[3, 4, 3, 4, 5]] and samples.tolist() == [[0, 0, 2, 2, 2]]
    ops.packed_positions_into(cu_seq_lens, 0, None, samples)
    with pytest.raises(RuntimeError, match="must not decrease"):
        ops.packed_positions_into(torch.tensor([0, 3, 2], dtype=torch.int32), 0, None, None)
    with pytest.raises(RuntimeError, match="position_ids must be a contiguous Long"):
        ops.packed_positions_into(cu_seq_lens, 0, torch.empty(5, dtype=torch.int32), None)


def test_opcheck_gather_packed_into_and_packed_positions_into():
    cu_seq_lens = torch.tensor([0, 4, 6], dtype=torch.int32)
    torch.library.opcheck(torch.ops.fastcollate.gather_packed_into.default,
                          (torch.arange(6), torch.tensor([0, 2, 6]), torch.tensor([1, 0]), cu_seq_lens,
                           torch.empty(6, dtype=torch.int64)))
    outs = (torch.empty(1, 6, dtype=torch.int64), torch.empty(1, 6, dtype=torch.int32))
    torch.library.opcheck(torch.ops.fastcollate.packed_positions_into.default, (cu_seq_lens, 1, *outs))


# ---------------------------------------------------------------------------------------------------
# Edges of packing by column: each case must give the walk's batch, or the walk's error


def test_a_float_column_cast_to_integers_goes_to_the_walk_which_refuses_nan_and_overflow():
    values = torch.tensor([1.5, float("nan"), 1e20, 2.0], dtype=torch.float64)
    dataset = Arrays(input_ids=Ragged(values, np.array([0, 1, 4])), index_as="id")
    for field in (Field(dtype=torch.int64, shape=("T",), pack=True, cast_from=(torch.float64,)),
                  Field(dtype=torch.int64, shape=("T",), pad=0, cast_from=(torch.float64,))):
        contract = Contract({"id": Field(kind="number"), "input_ids": field})
        assert gathered_plan(dataset.__getitems__([0, 1]), contract, "id") is None
        with pytest.raises(ContractValueError, match="can hold") as raised:
            assemble.using(contract)(dataset.__getitems__([0, 1]))
        assert raised.value.sample_id == 1


@pytest.mark.parametrize(("dtype", "separator"), [
    (torch.uint16, -100), (torch.uint8, 300), (torch.float16, 70000), (torch.int8, 1000),
    (torch.complex128, 1),
])
def test_a_separator_the_column_s_own_dtype_cannot_hold_is_the_walk_s_error(dtype, separator):
    # No dtype declared: the field's dtype is the column's, known only at the batch.
    dataset = Arrays(labels=Ragged(torch.ones(4, dtype=dtype), np.array([0, 2, 4])), index_as="id")
    labels = Field(shape=("T",), pack=True, separator=separator)
    contract = Contract({"id": Field(kind="number"), "labels": labels})
    with pytest.raises(ContractValueError, match="separator value") as raised:
        assemble.using(contract)(dataset.__getitems__([0, 1]))
    assert raised.value.field == "labels"


@pytest.mark.parametrize(("source", "target"), [(torch.uint16, torch.int64), (torch.bool, torch.uint16),
                                                (torch.uint32, torch.int64), (torch.uint8, torch.float16)])
def test_an_unsigned_or_bool_column_cast_with_a_range_is_packed(source, target):
    values = torch.tensor([1, 0, 1, 1, 0]).to(source)
    dataset = Arrays(input_ids=Ragged(values, np.array([0, 2, 5])), index_as="id")
    field = Field(dtype=target, shape=("T",), pack=True, cast_from=(source,), range=(0, 2))
    contract = Contract({"id": Field(kind="number"), "input_ids": field})
    assert_same_batch(gathered(dataset, [1, 0], contract), walked(dataset, [1, 0], contract))


@pytest.mark.parametrize(("dtype", "value", "bounds"), [
    (torch.uint8, 5, (0, 256)), (torch.int8, 5, (-1000, 1000)), (torch.bfloat16, 100.0, (0, 100.1)),
    (torch.int64, 2**24, (0, 2**24 + 0.5)), (torch.int64, 5, (-(2**70), 2**70)),
    (torch.uint16, 5, (0, 2**64)),
])
@pytest.mark.parametrize("how", ["pack", "pad"])
def test_ranges_are_compared_in_double_as_the_walk_compares_them(dtype, value, bounds, how):
    dataset = Arrays(x=Ragged(torch.full((3,), value).to(dtype), np.array([0, 1, 3])), index_as="id")
    declared = dict(pack=True) if how == "pack" else dict(pad=0)
    field = Field(dtype=dtype, shape=("T",), range=bounds, **declared)
    contract = Contract({"id": Field(kind="number"), "x": field})
    assert_same_batch(gathered(dataset, [0, 1], contract), walked(dataset, [0, 1], contract))


def test_a_value_just_past_the_bound_in_double_is_refused_as_the_walk_refuses_it():
    dataset = Arrays(x=Ragged(torch.tensor([2**62], dtype=torch.int64), np.array([0, 1])), index_as="id")
    contract = Contract({"id": Field(kind="number"), "x": Field(dtype=torch.int64, shape=("T",), pack=True,
                                                                 range=(0, 2**62 + 1))})
    with pytest.raises(ContractValueError) as gathered_error:
        assemble.using(contract)(dataset.__getitems__([0]))
    with pytest.raises(ContractValueError) as walked_error:
        walked(dataset, [0], contract)
    assert str(gathered_error.value) == str(walked_error.value)


@pytest.mark.parametrize("declared", [("T",), ("T", 3)])
def test_packed_rows_of_other_fixed_dims_get_the_walk_s_message(declared):
    dataset = Arrays(x=ragged([2, 1], inner=(4,)), index_as="id")
    field = Field(dtype=torch.int64, shape=declared, pack=True)
    contract = Contract({"id": Field(kind="number"), "x": field})
    with pytest.raises(ContractSizeError) as gathered_error:
        assemble.using(contract)(dataset.__getitems__([0, 1]))
    with pytest.raises(ContractSizeError) as walked_error:
        walked(dataset, [0, 1], contract)
    assert str(gathered_error.value) == str(walked_error.value)
    assert "shape [2, 4]" in str(gathered_error.value)


def test_the_gather_ops_refuse_an_out_that_is_their_own_source():
    values = torch.arange(7)
    with pytest.raises(RuntimeError, match="single memory location"):
        ops.gather_packed_into(values, torch.tensor([0, 3, 7]), torch.tensor([1, 0]),
                               torch.tensor([0, 4, 7], dtype=torch.int32), values)
    rows = torch.arange(12).reshape(4, 3)
    with pytest.raises(RuntimeError, match="single memory location"):
        ops.gather_into(rows, torch.tensor([3, 2, 1, 0]), rows)


def test_ragged_offsets_that_are_not_integers_are_refused():
    with pytest.raises(TypeError, match="offsets must be integers"):
        Arrays(x=Ragged(torch.arange(10), np.array([0.0, 3.5, 10.0])), index_as="id")
