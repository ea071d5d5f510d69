"""A packed contract's copy_of fields and dropped keys on Arrays columns: gathered column by column, with
the batch and the errors the per-sample walk gives for the same samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastcollate import Arrays, Contract, Field, Packing, Ragged, assemble
from fastcollate.collate import gather
from fastcollate.collate.errors import ContractError, ContractTypeError, ContractValueError

from .helpers.batches import assert_same_batch
from .helpers.gathered import gathered_plan


def ragged(lengths, dtype=torch.int64, seed=0, high=100):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, high, (sum(lengths),), generator=generator).to(dtype)
    return Ragged(values, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def tokens(**options):
    return Field(dtype=torch.int64, shape=("T",), pack=True, **options)


def labels_copied(labels=None, packing=None):
    """input_ids packed, and labels its copy with -100 at each sample's first token."""
    return Contract(
        {"id": Field(kind="number"), "input_ids": tokens(),
         "labels": labels or tokens(separator=-100, copy_of="input_ids")},
        packing=packing,
    )


def both_ways(dataset, indices, contract):
    """The batch gathered by column (checked to go that way) and walked sample by sample."""
    batch = dataset.__getitems__(indices)
    assert gathered_plan(batch, contract, "id") is not None, "gathered, not walked"
    return assemble.using(contract)(batch), assemble.using(contract)([dataset[i] for i in indices])


def errors_both_ways(dataset, indices, contract, error=ContractError):
    """The error gathering by column raises, and the walk's for the same samples."""
    collate = assemble.using(contract)
    with pytest.raises(error) as gathered:
        collate(dataset.__getitems__(indices))
    with pytest.raises(error) as walked:
        collate([dataset[i] for i in indices])
    return gathered.value, walked.value


def test_a_copy_of_field_is_gathered_from_its_source_s_column_as_the_walk_copies_it():
    lengths = [4, 1, 0, 6, 3]
    dataset = Arrays(input_ids=ragged(lengths), index_as="id")
    gathered, walked = both_ways(dataset, [3, 0, 2, 1], labels_copied())
    assert_same_batch(gathered, walked)
    row = gathered["input_ids"][0]
    assert gathered["labels"][0, [0, 6, 10]].tolist() == [-100] * 3
    assert torch.equal(gathered["labels"][0, 1:6], row[1:6])


def test_a_copy_is_cast_by_its_own_declaration_while_its_source_keeps_its_dtype():
    dataset = Arrays(input_ids=ragged([5, 2, 3], dtype=torch.uint16), index_as="id")
    contract = Contract({
        "id": Field(kind="number"),
        "input_ids": Field(dtype=torch.uint16, shape=("T",), pack=True),
        "labels": tokens(separator=-100, copy_of="input_ids", cast_from=(torch.uint16,)),
    })
    gathered, walked = both_ways(dataset, [2, 0, 1], contract)
    assert_same_batch(gathered, walked)
    assert gathered["input_ids"].dtype == torch.uint16 and gathered["labels"].dtype == torch.int64


def test_a_dropped_attention_mask_is_left_out_column_by_column_as_the_walk_leaves_it():
    lengths = [3, 5, 1, 2]
    dataset = Arrays(input_ids=ragged(lengths), attention_mask=ragged(lengths, high=2), index_as="id")
    contract = Contract({"id": Field(kind="number"), "input_ids": tokens()})
    gathered, walked = both_ways(dataset, [1, 3, 0], contract)
    assert_same_batch(gathered, walked)
    assert "attention_mask" not in gathered


def test_a_copy_beside_a_dropped_key_is_gathered_in_the_walk_s_key_order():
    lengths = [2, 7, 3]
    dataset = Arrays(input_ids=ragged(lengths), attention_mask=ragged(lengths, high=2),
                     token_type_ids=ragged(lengths, seed=1, high=2), index_as="id")
    contract = Contract({"id": Field(kind="number"), "input_ids": tokens(), "token_type_ids": tokens(),
                         "labels": tokens(separator=-100, copy_of="input_ids")},
                        packing=Packing(seq_idx="seq_idx"))
    gathered, walked = both_ways(dataset, [2, 1, 0, 1], contract)
    assert_same_batch(gathered, walked)
    assert list(gathered)[:4] == ["id", "input_ids", "labels", "token_type_ids"]


def test_a_copy_of_the_wrong_dtype_gets_the_walk_s_error():
    dataset = Arrays(input_ids=ragged([3, 4]), index_as="id")
    contract = labels_copied(Field(dtype=torch.int32, shape=("T",), pack=True, copy_of="input_ids"))
    gathered, walked = errors_both_ways(dataset, [1, 0], contract, ContractTypeError)
    assert str(gathered) == str(walked)
    assert gathered.field == "labels"


def test_a_copy_s_range_broken_in_one_sample_names_that_sample_as_the_walk_does():
    values = torch.zeros(9, dtype=torch.int64)
    values[6] = 99  # sample 2's second token
    dataset = Arrays(input_ids=Ragged(values, np.array([0, 3, 5, 9])), index_as="id")
    contract = labels_copied(tokens(separator=-100, copy_of="input_ids", range=(0, 50)))
    gathered, walked = errors_both_ways(dataset, [0, 2, 1], contract, ContractValueError)
    assert str(gathered) == str(walked)
    assert gathered.sample_id == 2 and gathered.field == "labels"


def test_a_copy_the_samples_also_hold_goes_to_the_walk_which_refuses_the_key():
    lengths = [2, 3]
    dataset = Arrays(input_ids=ragged(lengths), labels=ragged(lengths, seed=1), index_as="id")
    batch = dataset.__getitems__([0, 1])
    assert gathered_plan(batch, labels_copied(), "id") is None
    gathered, walked = errors_both_ways(dataset, [0, 1], labels_copied())
    assert str(gathered) == str(walked) and "copy_of" in str(gathered)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=10),
    picks=st.lists(st.integers(0, 2**16), min_size=1, max_size=12),
    separator=st.one_of(st.none(), st.integers(-100, 100)),
    bound=st.one_of(st.none(), st.integers(1, 120)),
    drop=st.booleans(),
)
def test_any_copy_and_drop_gives_the_walk_s_batch_or_error(  # noqa: PLR0913 (hypothesis draws each)
    lengths, picks, separator, bound, drop
):
    indices = [p % len(lengths) for p in picks]
    if sum(lengths[i] for i in indices) == 0:
        lengths[indices[0]] = 1
    columns = {"input_ids": ragged(lengths)}
    if drop:
        columns["attention_mask"] = ragged(lengths, high=2)
    dataset = Arrays(columns, index_as="id")
    copy = tokens(separator=separator, copy_of="input_ids", range=None if bound is None else (0, bound))
    contract = labels_copied(copy, packing=Packing(drop=("attention_mask",) if drop else ()))
    batch = dataset.__getitems__(indices)
    assert gather.gatherer(dataset, contract, "id") is not None, "gathered, not walked"
    try:
        expected = assemble.using(contract)([dataset[i] for i in indices])
    except ContractError as walked:
        with pytest.raises(type(walked)) as gathered:
            assemble.using(contract)(batch)
        assert str(gathered.value) == str(walked)
        return
    assert_same_batch(assemble.using(contract)(batch), expected)
