"""Packed batches (``Field(pack=True)``): the batch ``DataCollatorWithFlattening`` makes, key for key,
built by the C++ walk in the main process and in DataLoader workers; its refusals; a property against a
pure-Python packer; and a tiny causal LM whose per-token losses are the same packed and padded."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from fastcollate import Arrays, Contract, DeviceLoader, Field, Packing, Ragged, assemble
from fastcollate._ext import _C
from fastcollate._torch_compat import jagged_max_seqlen
from fastcollate.collate import gather
from fastcollate.collate.errors import (
    ContractKeyError,
    ContractSizeError,
    ContractTypeError,
    ContractValueError,
)
from fastcollate.structure import jagged

transformers = pytest.importorskip("transformers", reason="transformers is not installed")


def token_samples(count=12, token_type_ids=False, seed=0, lengths=None, vocab=50):
    """What a tokenizing Dataset returns: int64 token tensors (labels = input_ids, as for a causal
    LM), an id."""
    rng = random.Random(seed)
    lengths = lengths or [rng.randint(1, 24) for _ in range(count)]
    samples = []
    for i, length in enumerate(lengths):
        ids = torch.tensor([rng.randrange(vocab) for _ in range(length)], dtype=torch.int64)
        sample = {"id": i, "input_ids": ids, "labels": ids.clone()}
        if token_type_ids:  # BERT's pairs: 0 for the first text, 1 for the second
            sample["token_type_ids"] = (torch.arange(length) >= length // 2).to(torch.int64)
        samples.append(sample)
    return samples


def packed_contract(token_type_ids=False, separator=-100, **packing):
    tokens = dict(dtype=torch.int64, shape=("T",), pack=True)
    fields = {
        "id": Field(kind="number"),
        "input_ids": Field(**tokens),
        "labels": Field(**tokens, separator=separator),
    }
    if token_type_ids:
        fields["token_type_ids"] = Field(**tokens)
    return Contract(fields, packing=Packing(**packing))


def flattening(samples, seq_idx=False, position_ids_start=0, separator=-100):
    collator = transformers.DataCollatorWithFlattening(
        return_flash_attn_kwargs=True,
        return_seq_idx=seq_idx,
        position_ids_start=position_ids_start,
        separator_id=separator,
    )
    # The HF collator reads input_ids and labels only: the rest of the sample is not its business.
    return collator([{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples])


def assert_same_as_flattening(ours, theirs):
    for key, expected in theirs.items():
        got = ours[key]
        if isinstance(expected, torch.Tensor):
            assert got.dtype == expected.dtype, key
            assert got.shape == expected.shape, key
            assert torch.equal(got, expected), key
        else:
            assert type(got) is type(expected) and got == expected, key


@pytest.mark.parametrize("token_type_ids", [False, True], ids=["llama-style", "bert-style"])
@pytest.mark.parametrize("seq_idx", [False, True])
@pytest.mark.parametrize("position_ids_start", [0, 2])
@pytest.mark.parametrize("separator", [-100, 7])
def test_the_batch_equals_data_collator_with_flattening_key_for_key(
    token_type_ids, seq_idx, position_ids_start, separator
):
    samples = token_samples(token_type_ids=token_type_ids)
    contract = packed_contract(
        token_type_ids,
        separator=separator,
        position_ids_start=position_ids_start,
        seq_idx="seq_idx" if seq_idx else None,
    )
    ours = assemble.using(contract)(samples)
    theirs = flattening(samples, seq_idx=seq_idx, position_ids_start=position_ids_start, separator=separator)
    assert_same_as_flattening(ours, theirs)
    extra = {"id"} | ({"token_type_ids"} if token_type_ids else set())
    assert set(ours) == set(theirs) | extra
    assert torch.equal(ours["id"], torch.arange(len(samples)))
    if token_type_ids:  # HF's collator drops token_type_ids; here they are packed like input_ids
        expected = torch.cat([s["token_type_ids"] for s in samples])[None]
        assert torch.equal(ours["token_type_ids"], expected)


def test_keys_packing_sets_to_none_are_left_out_and_renamed_ones_used():
    contract = packed_contract(position_ids=None, cu_seq_lens=("cu_q", "cu_k"), max_length=None)
    batch = assemble.using(contract)(token_samples(count=3, lengths=[2, 3, 4]))
    assert set(batch) == {"id", "input_ids", "labels", "cu_q", "cu_k"}
    assert batch["cu_q"].tolist() == [0, 2, 5, 9]


def test_a_cast_token_field_and_a_non_contiguous_one_are_packed_through_aten():
    contract = Contract(
        {
            "id": Field(kind="number"),
            "input_ids": Field(dtype=torch.int64, shape=("T",), pack=True, cast_from=(torch.int32,)),
            "labels": Field(dtype=torch.int64, shape=("T",), pack=True, separator=-100),
        }
    )
    samples = [
        {
            "id": 0,
            "input_ids": torch.tensor([5, 6, 7], dtype=torch.int32),
            "labels": torch.tensor([[1, 2], [3, 4], [5, 6]])[:, 0],
        },
        {"id": 1, "input_ids": torch.tensor([8], dtype=torch.int32), "labels": torch.tensor([9])},
    ]
    batch = assemble.using(contract)(samples)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8]]
    assert batch["labels"].tolist() == [[-100, 3, 5, -100]]


def test_a_packed_field_with_fixed_dims_after_the_token_dim_keeps_them():
    contract = Contract(
        {
            "id": Field(kind="number"),
            "embeddings": Field(dtype=torch.float32, shape=("T", 3), pack=True, separator=0),
        }
    )
    samples = [{"id": i, "embeddings": torch.full((n, 3), float(i + 1))} for i, n in enumerate([2, 1, 3])]
    batch = assemble.using(contract)(samples)
    expected = torch.cat([s["embeddings"] for s in samples])[None]
    expected[0, [0, 2, 3]] = 0
    assert batch["embeddings"].shape == (1, 6, 3)
    assert torch.equal(batch["embeddings"], expected)
    assert batch["cu_seq_lens_q"].tolist() == [0, 2, 3, 6]


class Tokens(Dataset):
    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


@pytest.mark.parametrize("workers", [0, 2])
def test_packed_batches_from_workers_equal_the_collator_s(workers):
    samples = token_samples(count=40, seed=3)
    collate = assemble.using(packed_contract(seq_idx="seq_idx"))
    loader = DataLoader(Tokens(samples), batch_size=8, num_workers=workers, collate_fn=collate)
    batches = list(loader)
    assert len(batches) == 5
    for number, batch in enumerate(batches):
        part = samples[8 * number : 8 * number + 8]
        assert_same_as_flattening(batch, flattening(part, seq_idx=True))
        assert batch["id"].tolist() == [s["id"] for s in part]


def test_a_large_packed_batch_from_workers_keeps_its_small_keys_apart():
    # 1 MiB and more: small fields (cu_seq_lens, ids) get their own storage, the rows stay one buffer.
    samples = token_samples(count=64, lengths=[2048] * 64)
    loader = DataLoader(
        Tokens(samples), batch_size=32, num_workers=2, collate_fn=assemble.using(packed_contract())
    )
    for number, batch in enumerate(loader):
        assert_same_as_flattening(batch, flattening(samples[32 * number : 32 * number + 32]))


# ---------------------------------------------------------------------------------------------------
# Bad input


def test_a_sample_missing_a_packed_field_is_named_with_the_field():
    samples = token_samples(count=4)
    del samples[2]["labels"]
    with pytest.raises(ContractKeyError) as raised:
        assemble.using(packed_contract())(samples)
    assert raised.value.sample_id == 2 and raised.value.field == "labels"
    assert "sample id=2" in str(raised.value)


def test_two_packed_fields_of_different_lengths_are_named_with_their_lengths():
    samples = token_samples(count=4, lengths=[3, 4, 5, 6])
    samples[1]["labels"] = samples[1]["labels"][:3]
    with pytest.raises(ContractSizeError) as raised:
        assemble.using(packed_contract())(samples)
    message = str(raised.value)
    assert raised.value.sample_id == 1 and raised.value.field == "labels"
    assert "T = 4 (as in field input_ids)" in message and "T = 3" in message


def test_a_batch_of_2_to_the_31_tokens_is_refused_before_anything_is_allocated():
    # Stride-0 expands claim 2^30 tokens each without the memory: the check must come before the layout.
    contract = Contract(
        {"id": Field(kind="number"), "input_ids": Field(dtype=torch.int64, shape=("T",), pack=True)}
    )
    huge = torch.zeros(1, dtype=torch.int64).expand(2**30)
    samples = [{"id": 10, "input_ids": huge}, {"id": 11, "input_ids": huge}, {"id": 12, "input_ids": huge}]
    with pytest.raises(ContractSizeError) as raised:
        assemble.using(contract)(samples)
    assert raised.value.sample_id == 11 and raised.value.field == "input_ids"
    assert "2^31 - 1 tokens" in str(raised.value) and "2147483648 tokens" in str(raised.value)


def test_a_batch_of_2_to_the_31_minus_one_tokens_passes_the_check():
    contract = Contract(
        {"id": Field(kind="number"), "input_ids": Field(dtype=torch.uint8, shape=("T",), pack=True)}
    )
    samples = [{"id": 0, "input_ids": torch.zeros(1, dtype=torch.uint8).expand(2**31 - 1)}]
    collator = _C.Collator("id", contract.native_specs(), True)
    # Planned, not refused: the tokens, then 8 bytes of position ids each (nothing is executed).
    assert collator.plan(samples).nbytes >= 9 * (2**31 - 1)


def test_an_empty_sample_stays_in_the_batch_as_a_zero_length_sequence():
    # DataCollatorWithFlattening drops it (and its place in seq_idx); here its id and fixed fields stay,
    # so the audit still sees it, and cu_seq_lens repeats an offset, which varlen attention accepts.
    samples = token_samples(count=4, lengths=[3, 2, 4, 1])
    samples[1]["input_ids"] = samples[1]["labels"] = torch.zeros(0, dtype=torch.int64)
    batch = assemble.using(packed_contract(seq_idx="seq_idx"))(samples)
    kept = [s for i, s in enumerate(samples) if i != 1]
    theirs = flattening(kept, seq_idx=True)
    for key in ("input_ids", "labels", "position_ids", "max_length_q", "max_length_k"):
        assert_same_as_flattening({key: batch[key]}, {key: theirs[key]})
    assert batch["id"].tolist() == [0, 1, 2, 3]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 3, 7, 8]
    assert batch["seq_idx"].tolist() == [[0, 0, 0, 2, 2, 2, 2, 3]]


def test_a_batch_of_empty_samples_only_is_a_value_error_as_with_the_collator():
    samples = token_samples(count=3, lengths=[0, 0, 0])
    with pytest.raises(ValueError, match="every example is empty"):
        flattening(samples)
    with pytest.raises(ContractValueError) as raised:
        assemble.using(packed_contract())(samples)
    assert raised.value.field == "input_ids" and "every sample of the batch empty" in str(raised.value)


def test_a_separator_the_declared_dtype_cannot_hold_is_refused_when_declared():
    with pytest.raises(ValueError, match=r"separator -100 does not fit the field's dtype torch.uint8"):
        Field(dtype=torch.uint8, shape=("T",), pack=True, separator=-100)


@pytest.mark.parametrize("separator", [2**53 + 1, 2**63 - 1, -100.5])
def test_an_integer_separator_that_would_not_cross_exactly_is_refused_when_declared(separator):
    """It crosses to C++ as a double: 2**53 + 1 would be written as 2**53, -100.5 as -100."""
    with pytest.raises(ValueError, match="separator"):
        Field(dtype=torch.int64, shape=("T",), pack=True, separator=separator)


def test_a_separator_the_samples_dtype_cannot_hold_is_refused_naming_the_field():
    # The dtype comes from the data: the C++ walk checks the separator against it.
    contract = Contract({"labels": Field(shape=("T",), pack=True, separator=-100)}, id=None)
    with pytest.raises(ContractValueError, match="separator=-100"):
        assemble.using(contract)([{"labels": torch.ones(3, dtype=torch.uint8)}])


def test_a_packed_field_of_the_wrong_dtype_is_named():
    samples = token_samples(count=3)
    samples[2]["input_ids"] = samples[2]["input_ids"].to(torch.int32)
    with pytest.raises(ContractTypeError) as raised:
        assemble.using(packed_contract())(samples)
    assert raised.value.sample_id == 2 and raised.value.field == "input_ids"


def test_a_0_d_sample_of_a_packed_field_is_named_with_a_hint_that_fits_packing():
    contract = Contract({"id": Field(kind="number"), "x": tokens(pack=True)})
    with pytest.raises(ContractSizeError) as raised:
        assemble.using(contract)([{"id": 0, "x": torch.tensor(3)}])
    assert raised.value.field == "x" and "expand_from" not in str(raised.value)
    assert "tokens along the first dim" in str(raised.value)


def test_a_packed_field_in_a_tuple_sample_is_refused():
    contract = Contract(
        {"0": Field(dtype=torch.int64, shape=("T",), pack=True), "1": Field(kind="number")}, id=None
    )
    with pytest.raises(ContractTypeError, match="packed field in a mapping"):
        assemble.using(contract)([(torch.ones(2, dtype=torch.int64), 0)])


def tokens(shape=("T",), **options):
    return Field(dtype=torch.int64, shape=shape, **options)


@pytest.mark.parametrize(
    ("declare", "message"),
    [
        (lambda: tokens((4,), pack=True), "names its first dim"),
        (lambda: tokens((4, "T"), pack=True), "names its first dim"),
        (lambda: tokens(("T", "U"), pack=True), "names its first dim"),
        (lambda: tokens(separator=-100), "only applies to packed"),
        (lambda: tokens(pack=True, pad=0), "not padded"),
        (lambda: Contract({"x": tokens(pack=True), "y": tokens(("U",), pack=True)}), "same first dim"),
        (lambda: Contract({"x": tokens(pack=True), "m.y": tokens(pack=True)}), "same mapping"),
        (lambda: Contract({"x": tokens(pack=True), "position_ids": Field(kind="number")}), "already a field"),
        (lambda: Contract({"x": tokens()}, packing=Packing()), "no field is packed"),
        (lambda: Packing(cu_seq_lens=("a",)), "two keys"),
        (lambda: Field(dtype=torch.complex128, shape=("T",), pack=True, separator=1), "over 8 bytes"),
        (lambda: Field(dtype=torch.float16, shape=("T",), pack=True, separator=1e6), "float16 .a value it"),
        (lambda: Field(dtype=torch.int8, shape=("T",), pack=True, separator=2.5), "whole number from -128"),
        (lambda: Field(dtype=torch.int64, shape=("T",), pack=True, separator=2**54), "to 9007199254740992"),
    ],
)
def test_declarations_that_cannot_pack_are_refused_when_made(declare, message):
    with pytest.raises(ValueError, match=message):
        declare()


def test_the_contract_describes_its_packing():
    contract = packed_contract(seq_idx="seq_idx")
    text = str(contract)
    assert "packed, separator -100" in text and "seq_idx" in text
    assert contract.diff(packed_contract()) == [f"packing: {contract.packing} != {packed_contract().packing}"]


# ---------------------------------------------------------------------------------------------------
# Hugging Face's conventions: labels as a copy of input_ids, the tokenizer's attention_mask left out


def copying_contract(separator=-100, labels_dtype=torch.int64, **packing):
    """input_ids packed, labels made from them as DataCollatorWithFlattening makes them without labels."""
    return Contract(
        {
            "input_ids": Field(dtype=torch.int64, shape=("T",), pack=True),
            "labels": Field(
                dtype=labels_dtype, shape=("T",), pack=True, separator=separator, copy_of="input_ids"
            ),
        },
        id=None,
        packing=Packing(**packing),
    )


def tokenizer_samples(count=10, seed=0, as_lists=True):
    """What a tokenizer gives a causal LM: input_ids and an attention_mask of ones, no labels."""
    samples = []
    for sample in token_samples(count=count, seed=seed):
        ids = sample["input_ids"].tolist() if as_lists else sample["input_ids"]
        mask = [1] * len(ids) if as_lists else torch.ones_like(ids)
        samples.append({"input_ids": ids, "attention_mask": mask})
    return samples


@pytest.mark.parametrize("as_lists", [True, False], ids=["lists", "tensors"])
@pytest.mark.parametrize("seq_idx", [False, True])
def test_labels_copied_from_input_ids_equal_the_collator_s_for_samples_without_labels(as_lists, seq_idx):
    samples = tokenizer_samples(as_lists=as_lists)
    ours = assemble.using(copying_contract(seq_idx="seq_idx" if seq_idx else None))(samples)
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=seq_idx)
    theirs = collator(samples)
    assert "labels" not in samples[0] and "attention_mask" not in theirs
    assert list(ours) == list(theirs)  # the collator's keys, in its order: no attention_mask
    assert_same_as_flattening(ours, theirs)
    assert (ours["labels"] == -100).sum() == len(samples)


def test_a_copy_without_a_separator_is_the_source_s_row_in_its_own_dtype():
    samples = tokenizer_samples(count=4)
    batch = assemble.using(copying_contract(separator=None, labels_dtype=torch.int32))(samples)
    assert batch["labels"].dtype == torch.int32
    assert torch.equal(batch["labels"], batch["input_ids"].to(torch.int32))
    assert batch["labels"].data_ptr() != batch["input_ids"].data_ptr()


def test_a_copy_is_checked_under_its_own_dtype_naming_the_copy():
    samples = tokenizer_samples(count=3)
    samples[1]["input_ids"][0] = 40000  # an int64 token id, but not an int16 one
    with pytest.raises(ContractValueError) as raised:
        assemble.using(copying_contract(labels_dtype=torch.int16))(samples)
    assert (raised.value.position, raised.value.field) == (1, "labels")
    assert "torch.int16 can hold" in raised.value.expected


def test_samples_that_hold_the_copy_themselves_are_refused_naming_it():
    samples = tokenizer_samples(count=3)
    for sample in samples:
        sample["labels"] = list(sample["input_ids"])
    with pytest.raises(ContractKeyError) as raised:
        assemble.using(copying_contract())(samples)
    assert (raised.value.position, raised.value.field) == (0, "labels")
    assert "a copy of input_ids" in raised.value.expected and "copy_of" in raised.value.hint


def test_a_copy_in_a_nested_mapping_reads_its_sibling_and_nests_with_the_other_packed_fields():
    tokens = dict(dtype=torch.int64, shape=("T",), pack=True)
    contract = Contract(
        {
            "id": Field(kind="number"),
            "text.input_ids": Field(**tokens),
            "text.labels": Field(**tokens, separator=-100, copy_of="input_ids"),
        },
        packing=Packing(nested=True),
    )
    samples = [{"id": i, "text": s} for i, s in enumerate(tokenizer_samples(count=4, as_lists=False))]
    batch = assemble.using(contract)(samples)
    assert "attention_mask" not in batch["text"]
    for sample, labels in zip(samples, batch["text"]["labels"].unbind(), strict=True):
        assert labels.tolist() == [-100, *sample["text"]["input_ids"][1:].tolist()]


def test_an_arrays_batch_under_a_copy_is_gathered_and_a_labels_column_is_refused_as_in_samples():
    values = torch.arange(1, 10)
    offsets = np.array([0, 2, 7, 9])
    columns = {"input_ids": Ragged(values, offsets)}
    contract = Contract(
        {
            "id": Field(kind="number"),
            "input_ids": tokens(pack=True),
            "labels": tokens(pack=True, separator=-100, copy_of="input_ids"),
        }
    )
    dataset = Arrays(columns, index_as="id")
    assert gather.gatherer(dataset, contract, "id") is not None  # the copy is its source's column again
    batch = assemble.using(contract)(dataset.__getitems__([2, 0]))
    assert batch["input_ids"].tolist() == [[8, 9, 1, 2]]
    assert batch["labels"].tolist() == [[-100, 9, -100, 2]]
    labelled = Arrays({**columns, "labels": Ragged(values.clone(), offsets)}, index_as="id")
    assert gather.gatherer(labelled, contract, "id") is None
    with pytest.raises(ContractKeyError) as raised:
        assemble.using(contract)(labelled.__getitems__([0, 1]))
    assert (raised.value.sample_id, raised.value.field) == (0, "labels")


@pytest.mark.parametrize(
    ("declare", "message"),
    [
        (lambda: tokens(copy_of="input_ids"), "copy_of only applies to packed fields"),
        (lambda: tokens(pack=True, copy_of="text.input_ids"), "no dots"),
        (lambda: Contract({"labels": tokens(pack=True, copy_of="input_ids")}), "does not declare"),
        (
            lambda: Contract({"input_ids": tokens(pad=0), "labels": tokens(pack=True, copy_of="input_ids")}),
            "which is not packed",
        ),
        (
            lambda: Contract({"x": tokens(pack=True), "y": tokens(pack=True, copy_of="x"),
                              "z": tokens(pack=True, copy_of="y")}),
            "copies do not chain, name 'x'",
        ),
        (lambda: Contract({"x": tokens(pack=True, copy_of="x")}), "a copy of itself"),
        (
            lambda: Contract({"x": tokens(("T", 2), pack=True), "y": tokens(pack=True, copy_of="x")}),
            "so it has its shape",
        ),
        (
            lambda: Field(dtype=torch.uint8, shape=("T",), pack=True, separator=-100, copy_of="input_ids"),
            "separator -100 does not fit the field's dtype torch.uint8",
        ),
    ],
)
def test_copies_that_cannot_be_made_are_refused_when_declared(declare, message):
    with pytest.raises(ValueError, match=message):
        declare()


def test_the_attention_mask_is_left_out_of_a_packed_batch_and_a_packing_without_the_drop_names_it():
    samples = tokenizer_samples(count=3, as_lists=False)
    labelled = [{**s, "id": i, "labels": s["input_ids"]} for i, s in enumerate(samples)]
    batch = assemble.using(packed_contract())(labelled)
    assert "attention_mask" not in batch
    kept = Contract({"input_ids": tokens(pack=True)}, id=None, packing=Packing(drop=()))
    with pytest.raises(ContractKeyError) as raised:
        assemble.using(kept)(samples)
    assert raised.value.field == "attention_mask"


@pytest.mark.parametrize("drop", [("attention_mask",), ()])
def test_an_attention_mask_declared_packed_is_refused_with_the_reason(drop):
    with pytest.raises(ValueError) as raised:
        Contract(
            {"input_ids": tokens(pack=True), "attention_mask": tokens(pack=True)}, packing=Packing(drop=drop)
        )
    message = str(raised.value)
    assert "'attention_mask' cannot be a packed field" in message
    assert "switches off transformers' detection of packed sequences" in message
    assert "attend across their boundaries" in message


def test_a_field_under_a_dropped_key_is_refused_and_the_drop_is_declared_as_keys():
    with pytest.raises(ValueError, match="Packing.drop leaves it out"):
        Contract({"input_ids": tokens(pack=True), "attention_mask": tokens(pad=0)})
    with pytest.raises(ValueError, match="Packing.drop leaves it out"):
        Contract(
            {"input_ids": tokens(pack=True), "extra": Field(kind="number")}, packing=Packing(drop=("extra",))
        )
    with pytest.raises(ValueError, match="a tuple of keys"):
        Packing(drop="attention_mask")
    with pytest.raises(ValueError, match="no dots"):
        Packing(drop=("a.b",))
    # Padded contracts drop nothing: there the mask is the field's own (Field(mask="attention_mask")).
    padded = Contract({"input_ids": tokens(pad=0, mask="attention_mask", lengths=None)}, id=None)
    with pytest.raises(ContractKeyError):
        assemble.using(padded)([{"input_ids": [1, 2], "attention_mask": [1, 1]}])


def test_the_contract_describes_its_copies_and_the_keys_it_leaves_out():
    text = str(copying_contract())
    assert "packed, a copy of 'input_ids', separator -100" in text
    assert "left out of packed batches: attention_mask" in text
    assert copying_contract().diff(copying_contract(separator=None))


# ---------------------------------------------------------------------------------------------------
# Property: any lengths, any fields, against a pure-Python packer


def reference_pack(samples, keys, separators, start, seq_idx):
    """DataCollatorWithFlattening's rules written out, for any packed keys, empty samples kept."""
    out = {}
    for key in keys:
        pieces = []
        for sample in samples:
            piece = sample[key].clone()
            if separators.get(key) is not None and len(piece):
                piece[0] = separators[key]
            pieces.append(piece)
        out[key] = torch.cat(pieces)[None]
    lengths = [len(s[keys[0]]) for s in samples]
    out["position_ids"] = torch.cat([torch.arange(start, start + n) for n in lengths])[None]
    if seq_idx:
        out["seq_idx"] = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[
            None
        ]
    offsets = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = offsets
    out["max_length_q"] = out["max_length_k"] = max(lengths)
    return out


DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8, torch.float32, torch.bfloat16]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(
        st.one_of(st.integers(1, 40), st.just(1), st.just(2048), st.just(0)), min_size=1, max_size=12
    ),
    dtypes=st.lists(st.sampled_from(DTYPES), min_size=1, max_size=3),
    separators=st.lists(st.one_of(st.none(), st.integers(0, 100)), min_size=3, max_size=3),
    start=st.integers(0, 3),
    seq_idx=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_packed_batch_equals_the_pure_python_packer(lengths, dtypes, separators, start, seq_idx, seed):
    if sum(lengths) == 0:
        lengths = [*lengths[:-1], 1]
    keys = [f"f{k}" for k in range(len(dtypes))]
    generator = torch.Generator().manual_seed(seed)
    samples = [
        {
            "id": i,
            **{
                key: torch.randint(0, 100, (n,), generator=generator).to(dtype)
                for key, dtype in zip(keys, dtypes, strict=True)
            },
        }
        for i, n in enumerate(lengths)
    ]
    fields = {"id": Field(kind="number")}
    for key, dtype, separator in zip(keys, dtypes, separators[: len(keys)], strict=True):
        fields[key] = Field(dtype=dtype, shape=("T",), pack=True, separator=separator)
    contract = Contract(
        fields, packing=Packing(position_ids_start=start, seq_idx="seq_idx" if seq_idx else None)
    )
    ours = assemble.using(contract)(samples)
    expected = reference_pack(
        samples, keys, dict(zip(keys, separators[: len(keys)], strict=True)), start, seq_idx
    )
    assert set(ours) == set(expected) | {"id"}
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key


# ---------------------------------------------------------------------------------------------------
# A tiny causal LM: packed and padded batches give the same per-token losses


def tiny_llama(attn_implementation):
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def per_token_losses(logits, labels):
    """Each position's loss for predicting the next label, where that label is not -100."""
    losses = torch.nn.functional.cross_entropy(
        logits[:-1].float(), labels[1:], reduction="none", ignore_index=-100
    )
    return losses[labels[1:] != -100]


# transformers 5's masking_utils builds a block-causal mask from packed position_ids for eager and SDPA
# (and flex); flash_attention_2 reads cu_seq_lens instead and needs a GPU, so it is not run here.
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_a_tiny_llama_gives_the_same_per_token_losses_packed_and_padded(attn_implementation):
    model = tiny_llama(attn_implementation)
    samples = token_samples(count=6, lengths=[5, 17, 1, 9, 24, 3], seed=5)
    packed = assemble.using(packed_contract())(samples)
    with torch.no_grad():
        logits = model(
            input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False
        ).logits
        ours = per_token_losses(logits[0], packed["labels"][0])
        # Without position ids the row is one long sequence: tokens attend across samples, losses change.
        across = per_token_losses(
            model(input_ids=packed["input_ids"], use_cache=False).logits[0], packed["labels"][0]
        )
        longest = max(len(s["input_ids"]) for s in samples)
        ids = torch.zeros(len(samples), longest, dtype=torch.int64)
        mask = torch.zeros(len(samples), longest, dtype=torch.int64)
        for i, sample in enumerate(samples):
            ids[i, : len(sample["input_ids"])] = sample["input_ids"]
            mask[i, : len(sample["input_ids"])] = 1
        padded_logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    padded = torch.cat(
        [
            per_token_losses(padded_logits[i, : len(s["input_ids"])], s["labels"])
            for i, s in enumerate(samples)
        ]
    )
    assert ours.shape == padded.shape == (sum(len(s["input_ids"]) - 1 for s in samples),)
    torch.testing.assert_close(ours, padded, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(across, padded, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Packing(nested=True): jagged tensors over the packed row


def test_nested_packed_fields_are_jagged_views_of_the_packed_row_and_cu_seq_lens():
    samples = token_samples(count=5, seed=9)
    batch = assemble.using(packed_contract(nested=True))(samples)
    flat = assemble.using(packed_contract())(samples)
    for key in ("input_ids", "labels"):
        nested = batch[key]
        assert nested.is_nested and nested.layout == torch.jagged and nested.shape[0] == 5
        assert torch.equal(nested.values(), flat[key][0])
        # No copy: the offsets are cu_seq_lens themselves, the values a view of the batch's one buffer.
        assert nested.offsets().data_ptr() == batch["cu_seq_lens_q"].data_ptr()
        storage = batch["position_ids"].untyped_storage().data_ptr()
        assert nested.values().untyped_storage().data_ptr() == storage
    for sample, row in zip(samples, batch["input_ids"].unbind(), strict=True):
        assert torch.equal(row, sample["input_ids"])


def test_nested_needs_cu_seq_lens():
    with pytest.raises(ValueError, match="needs cu_seq_lens"):
        Packing(nested=True, cu_seq_lens=None)


@pytest.mark.parametrize("workers", [0, 2])
def test_nested_batches_from_workers_hold_every_sample(workers):
    samples = token_samples(count=24, seed=4)
    collate = assemble.using(packed_contract(nested=True))
    loader = DataLoader(Tokens(samples), batch_size=8, num_workers=workers, collate_fn=collate)
    for number, batch in enumerate(loader):
        part = samples[8 * number : 8 * number + 8]
        assert [row.tolist() for row in batch["input_ids"].unbind()] == [
            s["input_ids"].tolist() for s in part
        ]
        assert batch["input_ids"].offsets().tolist() == batch["cu_seq_lens_q"].tolist()
        # Through the pipe too: the values stay a view of the slot (or ring slot) the batch came in.
        values = batch["input_ids"].values()
        assert values.untyped_storage().data_ptr() == batch["position_ids"].untyped_storage().data_ptr()
        assert _C.shared_slot_kind(values) == _C.shared_slot_kind(batch["position_ids"])


def test_split_and_join_move_a_jagged_tensor_as_its_values_and_offsets():
    batch = assemble.using(packed_contract(nested=True))(token_samples(count=4))
    longest = batch["max_length_q"]
    leaves = [batch["id"], batch["input_ids"], 3]
    split, places = jagged.split(leaves)
    assert split[1] is None and places == [(1, 3, 4, longest)]
    assert split[3].data_ptr() == batch["input_ids"].values().data_ptr()
    moved = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in split]  # "on the device"
    joined = jagged.join(moved, places, len(leaves))
    assert len(joined) == 3 and joined[2] == 3
    assert joined[1].values().data_ptr() == moved[3].data_ptr()
    assert joined[1].offsets().data_ptr() == moved[4].data_ptr()
    assert jagged_max_seqlen(joined[1]) == longest, "carried, not read back from the (device) offsets"
    assert [r.tolist() for r in joined[1].unbind()] == [r.tolist() for r in batch["input_ids"].unbind()]


def test_split_keeps_cu_seq_lens_and_the_jagged_offsets_one_tensor():
    batch = assemble.using(packed_contract(nested=True))(token_samples(count=4))
    leaves = [batch["input_ids"], batch["labels"], batch["cu_seq_lens_q"], batch["cu_seq_lens_k"]]
    split, places = jagged.split(leaves)
    assert [offsets for _, _, offsets, _ in places] == [2, 2], "the leaf itself, not a second copy"
    assert len(split) == 6
    moved = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in split]
    joined = jagged.join(moved, places, len(leaves))
    assert joined[0].offsets() is moved[2] and joined[1].offsets() is moved[2]


def test_device_loader_on_the_cpu_passes_a_nested_batch_through():
    loader = DataLoader(
        Tokens(token_samples(count=8)), batch_size=4, collate_fn=assemble.using(packed_contract(nested=True))
    )
    for batch in DeviceLoader(loader, device="cpu"):
        assert jagged.is_jagged(batch["input_ids"]) and batch["input_ids"].shape[0] == 4


@pytest.mark.needs_cuda
def test_device_loader_moves_a_nested_batch_in_its_one_copy_and_makes_the_view_on_the_device():
    samples = token_samples(count=16, seed=2)
    loader = DataLoader(
        Tokens(samples), batch_size=8, collate_fn=assemble.using(packed_contract(nested=True))
    )
    for number, batch in enumerate(DeviceLoader(loader, device="cuda")):
        nested = batch["input_ids"]
        assert jagged.is_jagged(nested) and nested.is_cuda and nested.offsets().is_cuda
        # The values are a view of the batch's one device copy, as position_ids are.
        assert (
            nested.values().untyped_storage().data_ptr() == batch["position_ids"].untyped_storage().data_ptr()
        )
        part = samples[8 * number : 8 * number + 8]
        assert [r.tolist() for r in nested.unbind()] == [s["input_ids"].tolist() for s in part]


def test_the_usage_s_packed_example_runs_as_written_and_gives_the_collator_s_batches():
    import re
    from pathlib import Path

    usage = (Path(__file__).resolve().parent.parent / "docs" / "usage.md").read_text()
    section = usage.split("## Packed sequences", 1)[1]
    code = next(c for c in re.findall(r"```python\n(.*?)```", section, re.S) if "TokenBudgetBatches" in c)
    names: dict = {}
    exec(code, names)
    delivered = []
    for batch in names["loader"]:
        part = [names["ds"][i] for i in batch["id"].tolist()]
        assert_same_as_flattening(batch, flattening(part, seq_idx=True))
        delivered += batch["id"].tolist()
    assert sorted(delivered) == list(range(len(names["ds"])))
