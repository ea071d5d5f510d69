"""Contracts: declared fields checked in C++ before any byte is copied, conversions only when declared."""

import math
import pickle

import numpy as np
import pytest
import torch

from fastcollate import Arrays, Contract, ContractError, Field, assemble, with_ids
from fastcollate.collate.errors import ContractEmptyError, ContractValueError

RECORDS_CONTRACT = Contract(
    fields={
        "id": Field(kind="number", dtype=torch.int64),
        "x": Field(dtype=torch.float32, shape=(3, 16, 16)),
        "y": Field(kind="number", dtype=torch.int64, range=(0, 10)),
    }
)


def seed_records():
    """The seeds' worked example: four records, the fourth image has one channel."""
    records = [{"id": 100 + i, "x": torch.rand(3, 16, 16), "y": i} for i in range(3)]
    records.append({"id": 103, "x": torch.rand(1, 16, 16), "y": 3})
    return records


def test_fourth_record_with_one_channel_is_named_before_stacking():
    from fastcollate.transfer.staging import main_process_ring

    before = main_process_ring().stats()
    with pytest.raises(ContractError) as caught:
        assemble.using(RECORDS_CONTRACT)(seed_records())
    error = caught.value
    assert (error.sample_id, error.field) == (103, "x")
    assert error.expected == "shape [3, 16, 16]" and error.got == "shape [1, 16, 16]"
    assert "expand_from" in str(error)  # says what to do
    after = main_process_ring().stats()
    assert after.reuses + after.slot_allocations == before.reuses + before.slot_allocations  # nothing stacked


def test_declared_one_to_three_channel_conversion_keeps_all_four_ids():
    contract = Contract(
        fields={
            **RECORDS_CONTRACT.fields,
            "x": Field(dtype=torch.float32, shape=(3, 16, 16), expand_from=((1, 16, 16),)),
        }
    )
    records = seed_records()
    batch = assemble.using(contract)(records)
    assert batch["x"].shape == (4, 3, 16, 16)
    assert batch["id"].tolist() == [100, 101, 102, 103]
    for channel in range(3):
        assert torch.equal(batch["x"][3, channel], records[3]["x"][0])
    assert torch.equal(batch["x"][0], records[0]["x"])


def test_a_correctly_shaped_record_with_an_out_of_range_label_is_rejected_by_id():
    records = [{"id": 100 + i, "x": torch.rand(3, 16, 16), "y": i} for i in range(4)]
    records[2]["y"] = 10
    with pytest.raises(ValueError) as caught:
        assemble.using(RECORDS_CONTRACT)(records)
    assert (caught.value.sample_id, caught.value.field) == (102, "y")
    assert "[0, 10)" in caught.value.expected


def test_tensor_targets_are_range_checked_and_nan_is_out_of_range():
    contract = Contract(
        fields={"id": Field(kind="number"), "t": Field(dtype=torch.float32, shape=(2,), range=(0, 1))}
    )
    good = [{"id": i, "t": torch.tensor([0.0, 0.5])} for i in range(3)]
    assert assemble.using(contract)(good)["t"].shape == (3, 2)
    bad = [dict(s) for s in good]
    bad[1]["t"] = torch.tensor([0.2, float("nan")])
    with pytest.raises(ValueError) as caught:
        assemble.using(contract)(bad)
    assert caught.value.sample_id == 1 and "NaN" in caught.value.got


def test_mixed_dtypes_are_an_error_under_a_contract_unless_a_cast_is_declared():
    records = [{"id": i, "x": torch.zeros(2, dtype=torch.float32)} for i in range(3)]
    records[1]["x"] = torch.zeros(2, dtype=torch.float64)
    strict = Contract(fields={"id": Field(kind="number"), "x": Field(dtype=torch.float32, shape=(2,))})
    with pytest.raises(TypeError) as caught:
        assemble.using(strict)(records)
    assert caught.value.sample_id == 1 and "cast_from" in str(caught.value)
    lenient = Contract(
        fields={
            "id": Field(kind="number"),
            "x": Field(dtype=torch.float32, shape=(2,), cast_from=(torch.float64,)),
        }
    )
    assert assemble.using(lenient)(records)["x"].dtype == torch.float32


def test_undeclared_and_missing_fields_are_errors():
    contract = Contract(fields={"id": Field(kind="number"), "x": Field(dtype=torch.float32, shape=(2,))})
    extra = [{"id": i, "x": torch.zeros(2), "z": 1} for i in range(2)]
    with pytest.raises(KeyError) as caught:
        assemble.using(contract)(extra)
    assert caught.value.field == "z"
    missing = [{"id": i} for i in range(2)]
    with pytest.raises(KeyError) as caught:
        assemble.using(contract)(missing)
    assert caught.value.field == "x"


def test_padded_tokens_get_a_mask_and_lengths_padded_on_the_right():
    contract = Contract(
        fields={"id": Field(kind="number"), "tokens": Field(dtype=torch.int64, shape=("T",), pad=-1)}
    )
    lengths = [3, 1, 5, 0]
    records = [{"id": i, "tokens": torch.arange(1, n + 1)} for i, n in enumerate(lengths)]
    batch = assemble.using(contract)(records)
    assert batch["tokens"].shape == (4, 5)
    assert batch["tokens"][1].tolist() == [1, -1, -1, -1, -1]
    assert batch["tokens_mask"].dtype == torch.bool
    assert batch["tokens_mask"].tolist() == [[j < n for j in range(5)] for n in lengths]
    assert batch["tokens_lengths"].tolist() == lengths
    assert list(batch) == ["id", "tokens", "tokens_mask", "tokens_lengths"]


def test_padding_boxes_with_fixed_trailing_dims_and_a_shared_named_dim():
    contract = Contract(
        fields={
            "id": Field(kind="number"),
            "boxes": Field(dtype=torch.float32, shape=("N", 4), pad=0.0, mask="box_mask", lengths=None),
            "labels": Field(dtype=torch.int64, shape=("N",), pad=-100, range=(0, 5)),
        }
    )
    counts = [2, 0, 3]
    records = [
        {"id": i, "boxes": torch.rand(n, 4), "labels": torch.arange(n) % 5} for i, n in enumerate(counts)
    ]
    batch = assemble.using(contract)(records)
    assert batch["boxes"].shape == (3, 3, 4) and batch["labels"].shape == (3, 3)
    assert "boxes_lengths" not in batch
    assert batch["box_mask"].tolist() == [[j < n for j in range(3)] for n in counts]
    assert torch.equal(batch["boxes"][2], records[2]["boxes"])
    assert batch["labels"][0].tolist() == [0, 1, -100]
    records[1]["labels"] = torch.arange(2)  # N disagrees with boxes in the same sample
    with pytest.raises(RuntimeError) as caught:
        assemble.using(contract)(records)
    assert caught.value.sample_id == 1 and caught.value.field == "labels"


def test_padding_two_named_dims_and_a_non_contiguous_sample():
    contract = Contract(
        fields={"id": Field(kind="number"), "m": Field(dtype=torch.float32, shape=("H", "W"), pad=0.0)}
    )
    # Sample 1 is [1, 2] and strided.
    records = [{"id": 0, "m": torch.ones(2, 3)}, {"id": 1, "m": torch.ones(2, 2)[:, :1].t()}]
    batch = assemble.using(contract)(records)
    assert batch["m"].shape == (2, 2, 3)
    assert records[1]["m"].stride() == (1, 2) and records[1]["m"].shape == (1, 2)
    assert batch["m_lengths"].tolist() == [[2, 3], [1, 2]]
    assert batch["m_mask"][1].tolist() == [[True, True, False], [False, False, False]]
    assert batch["m"][1].tolist() == [[1, 1, 0], [0, 0, 0]]


def test_named_dims_without_pad_must_agree_across_the_batch():
    contract = Contract(fields={"id": Field(kind="number"), "v": Field(dtype=torch.float32, shape=("T",))})
    assert assemble.using(contract)([{"id": i, "v": torch.zeros(4)} for i in range(2)])["v"].shape == (2, 4)
    with pytest.raises(RuntimeError) as caught:
        assemble.using(contract)([{"id": 0, "v": torch.zeros(4)}, {"id": 1, "v": torch.zeros(5)}])
    assert caught.value.sample_id == 1 and "pad" in str(caught.value)


def test_text_and_number_fields_are_type_checked():
    contract = Contract(fields={"id": Field(kind="text"), "y": Field(kind="number", dtype=torch.int64)})
    with pytest.raises(TypeError) as caught:
        assemble.using(contract)([{"id": "a", "y": 1}, {"id": "b", "y": 1.5}])
    assert caught.value.sample_id == "b" and caught.value.field == "y"
    with pytest.raises(TypeError):
        assemble.using(contract)([{"id": "a", "y": 1}, {"id": 5, "y": 1}])


def test_a_number_field_takes_0_d_tensors_as_default_collate_stacks_them_and_checks_their_rules():
    y = Field(kind="number", dtype=torch.int32, range=(0, 5))
    contract = Contract({"id": Field(kind="number"), "y": y})
    samples = [{"id": i, "y": torch.tensor(i, dtype=torch.int32)} for i in range(3)]
    batch = assemble.using(contract)(samples)
    assert batch["y"].dtype == torch.int32 and batch["y"].tolist() == [0, 1, 2]
    with pytest.raises(TypeError, match=r"expected torch.int32, got torch.int64") as caught:
        assemble.using(contract)([*samples, {"id": 3, "y": torch.tensor(3)}])
    assert caught.value.sample_id == 3
    with pytest.raises(ContractValueError, match=r"values in \[0, 5\), got a value at or above the upper"):
        assemble.using(contract)([*samples, {"id": 3, "y": torch.tensor(7, dtype=torch.int32)}])
    with pytest.raises(ContractError, match=r"expected a number: a Python int \(declared torch.int32\), or a "
                                            r"tensor of shape \[\], got a tensor of shape \[2\]") as caught:
        assemble.using(contract)([*samples, {"id": 3, "y": torch.zeros(2, dtype=torch.int32)}])
    assert caught.value.field == "y"


def test_a_python_number_out_of_range_is_worded_by_the_range_rule():
    contract = Contract({"id": Field(kind="number"), "y": Field(kind="number", range=(0, 5))})
    below = r"expected a value in \[0, 5\), got a value below the range"
    with pytest.raises(ContractValueError, match=below) as caught:
        assemble.using(contract)([{"id": 0, "y": 1}, {"id": 1, "y": -1}])
    assert caught.value.sample_id == 1 and "flat position" not in str(caught.value)


def test_keeps_values_says_which_casts_keep_every_value():
    from fastcollate._ext import _C

    integers = [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64]
    floats = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
    for source in integers:
        low = torch.iinfo(source)
        magnitude = low.bits - (low.min < 0)
        for target in integers:
            high = torch.iinfo(target)
            assert _C.keeps_values(source, target) == (high.min <= low.min and low.max <= high.max)
        for target in floats:  # an integer is exact within the mantissa, its implicit bit included
            mantissa = 1 - int(math.log2(torch.finfo(target).eps))
            assert _C.keeps_values(source, target) == (magnitude <= mantissa), (source, target)
        assert not _C.keeps_values(source, torch.bool) and _C.keeps_values(torch.bool, source)
    for source in floats:
        assert not any(_C.keeps_values(source, target) for target in integers)
        assert _C.keeps_values(source, torch.float64)
    assert not _C.keeps_values(torch.float64, torch.float32)
    assert not _C.keeps_values(torch.float16, torch.bfloat16)


def test_infer_prints_compares_and_enforces_its_own_sample():
    sample = {"id": 3, "image": torch.zeros(1, 28, 28), "label": 4, "meta": {"name": "a", "w": 0.5}}
    contract = Contract.infer(sample)
    text = str(contract)
    assert "image" in text and "torch.float32 [1, 28, 28]" in text and "meta.name" in text
    assert contract == Contract.infer(dict(sample))
    other = Contract.infer({**sample, "image": torch.zeros(3, 28, 28)})
    assert contract != other and contract.diff(other) == [
        "image: tensor torch.float32 [1, 28, 28] != tensor torch.float32 [3, 28, 28]"
    ]
    batch = assemble.using(contract)([sample, sample])
    assert batch["image"].shape == (2, 1, 28, 28) and batch["meta"]["name"] == ["a", "a"]


def test_contract_assembler_pickles_for_spawned_workers():
    assembler = assemble.using(RECORDS_CONTRACT)
    clone = pickle.loads(pickle.dumps(assembler))
    records = [{"id": 100 + i, "x": torch.rand(3, 16, 16), "y": i} for i in range(2)]
    assert torch.equal(clone(records)["x"], assembler(records)["x"])


@pytest.mark.parametrize(
    "bad",
    [
        dict(shape=(3, -1)),
        dict(range=(5, 1)),
        dict(pad=0, shape=(3,)),
        dict(mask="m"),
        dict(kind="number", shape=(2,)),
        dict(kind="text", dtype=torch.int64),
        dict(kind="image"),
    ],
)
def test_inconsistent_field_declarations_are_refused(bad):
    with pytest.raises(ValueError):
        Field(**bad)


@pytest.mark.parametrize("container", [tuple, list])
def test_a_padded_field_in_a_tuple_or_list_sample_is_refused_not_batched_without_its_mask(container):
    # A sequence's batch is a sequence of the same length: the mask and lengths would have no place.
    tokens = Field(dtype=torch.int64, shape=("T",), pad=0)
    contract = Contract({"0": tokens, "1": Field(kind="number")}, id=None)
    samples = [container((torch.arange(n), n)) for n in (2, 3)]
    with pytest.raises(ContractError) as caught:
        assemble.using(contract)(samples)
    assert caught.value.field == "0"
    assert f"a padded field in a {container.__name__}" in str(caught.value)
    assert "Make the sample a dict" in str(caught.value)


def test_a_padded_field_cannot_shadow_a_declared_one():
    with pytest.raises(ValueError):
        Contract(fields={"t": Field(dtype=torch.int64, shape=("T",), pad=0), "t_mask": Field(kind="number")})


def test_with_ids_attaches_the_dataset_index():
    dataset = [{"x": torch.zeros(2)}, {"x": torch.zeros(3)}, (torch.zeros(1), 5)]
    tagged = with_ids(dataset)
    assert tagged[0]["id"] == 0 and tagged[2].id == 2 and tagged[2].sample[1] == 5
    with pytest.raises(ContractError) as caught:
        assemble([tagged[0], tagged[1]])
    assert caught.value.sample_id == 1
    batch = assemble([tagged[2], tagged[2]])
    assert batch.id.tolist() == [2, 2] and batch.sample[1].tolist() == [5, 5]


def test_native_specs_carry_each_declaration_through_the_field_spec_attributes():
    contract = Contract(
        fields={
            "x": Field(dtype=torch.float16, shape=(3, "T"), pad=-1.0, range=(-2, 2)),
            "label": Field(kind="number"),
        }
    )
    x, label = sorted(contract.native_specs(), key=lambda spec: spec.path != "x")
    assert (x.path, x.kind, x.has_dtype, x.dtype) == ("x", "tensor", True, torch.float16)
    assert (x.has_shape, x.shape, x.dim_names) == (True, [3, -1], ["", "T"])
    assert (x.has_range, x.low, x.high, x.padded, x.pad_value) == (True, -2.0, 2.0, True, -1.0)
    assert (label.path, label.kind, label.has_dtype, label.has_shape) == ("label", "number", False, False)
    assert (label.has_range, label.padded) == (False, False)


def test_field_spec_has_flags_drop_what_they_declared_and_kind_is_checked():
    from fastcollate import _C

    spec = _C.FieldSpec()
    spec.dtype = torch.int8  # setting a value declares it
    spec.low, spec.high = 0.0, 5.0
    assert spec.has_dtype and spec.has_range and (spec.low, spec.high) == (0.0, 5.0)
    spec.has_dtype = False
    spec.has_range = False
    assert not spec.has_dtype and not spec.has_range and (spec.low, spec.high) == (0.0, 0.0)
    with pytest.raises(RuntimeError, match="'tensor', 'number' or 'text'"):
        spec.kind = "image"
    assert spec.kind == "tensor"


def padded_tokens(mask_dtype=torch.bool, **options):
    return Field(dtype=torch.int64, shape=("T",), pad=0, mask_dtype=mask_dtype, **options)


def test_the_mask_is_bool_unless_a_mask_dtype_is_declared():
    assert Field(dtype=torch.int64, shape=("T",), pad=0).mask_dtype == torch.bool
    records = [{"tokens": torch.arange(1, n + 1)} for n in (3, 1, 4)]
    expected = [[j < n for j in range(4)] for n in (3, 1, 4)]
    for mask_dtype in (torch.bool, torch.int64, torch.int32, torch.uint8, torch.float32, torch.bfloat16):
        batch = assemble.using(Contract({"tokens": padded_tokens(mask_dtype)}, id=None))(records)
        assert batch["tokens_mask"].dtype == mask_dtype
        assert batch["tokens_mask"].tolist() == [[float(v) if mask_dtype.is_floating_point else int(v)
                                                  for v in row] for row in expected]
        assert batch["tokens"][1].tolist() == [1, 0, 0, 0]


def test_an_integer_mask_over_two_named_dims_and_a_non_contiguous_sample():
    # The ATen path (strided sample, two named dims) writes the mask's 1s as a copy, not a fill.
    contract = Contract({"m": Field(dtype=torch.float32, shape=("H", "W"), pad=0.0, mask_dtype=torch.int16)},
                        id=None)
    records = [{"m": torch.ones(2, 3)}, {"m": torch.ones(2, 2)[:, :1].t()}]
    batch = assemble.using(contract)(records)
    assert batch["m_mask"].dtype == torch.int16
    assert batch["m_mask"].tolist() == [[[1, 1, 1], [1, 1, 1]], [[1, 1, 0], [0, 0, 0]]]


def bert_like_contract(**token_type_options):
    shared = dict(mask="attention_mask", mask_dtype=torch.int64, lengths=None)
    return Contract(
        {
            "input_ids": padded_tokens(**shared),
            "token_type_ids": padded_tokens(**{**shared, **token_type_options}),
            "labels": Field(kind="number", dtype=torch.int64),
        },
        id=None,
    )


def test_two_padded_fields_over_the_same_named_dims_share_one_mask():
    lengths = [3, 5, 1]
    records = [{"input_ids": torch.arange(1, n + 1), "token_type_ids": torch.ones(n, dtype=torch.int64),
                "labels": i % 2} for i, n in enumerate(lengths)]
    batch = assemble.using(bert_like_contract())(records)
    assert list(batch) == ["input_ids", "attention_mask", "token_type_ids", "labels"]
    assert batch["attention_mask"].dtype == torch.int64
    assert batch["attention_mask"].tolist() == [[int(j < n) for j in range(5)] for n in lengths]
    assert batch["token_type_ids"][0].tolist() == [1, 1, 1, 0, 0]
    # Built once: the batch buffer holds one mask less than with a mask per field.
    from fastcollate import _C

    def planned_bytes(contract):
        return _C.Collator("id", contract.native_specs(), True).plan(records).nbytes

    alignment = 64  # every field starts at a multiple of 64 bytes (csrc/memory/copy_kernels.h)
    mask_bytes = -(-batch["attention_mask"].nbytes // alignment) * alignment
    assert planned_bytes(bert_like_contract(mask="other")) - planned_bytes(bert_like_contract()) == mask_bytes
    # Fields under different containers put their masks in different dicts: not shared.
    ids = dict(dtype=torch.int64, pad=0, mask="mask")
    nested = Contract({"a.ids": Field(shape=("A",), **ids), "b.ids": Field(shape=("B",), **ids)}, id=None)
    out = assemble.using(nested)([{"a": {"ids": torch.arange(2)}, "b": {"ids": torch.arange(4)}}] * 2)
    assert out["a"]["mask"].shape == (2, 2) and out["b"]["mask"].shape == (2, 4)


@pytest.mark.parametrize(
    ("other", "why"),
    [
        (Field(dtype=torch.int64, shape=("S",), pad=0, mask="attention_mask", lengths=None), "named dims"),
        (Field(dtype=torch.int64, shape=("T",), pad=0, mask="attention_mask", lengths=None), "mask dtypes"),
    ],
    ids=["other_named_dim", "bool_mask"],
)
def test_a_shared_mask_key_with_masks_that_could_differ_is_refused_naming_both_fields(other, why):
    with pytest.raises(ValueError, match=why) as caught:
        Contract({"input_ids": padded_tokens(mask="attention_mask", mask_dtype=torch.int64, lengths=None),
                  "token_type_ids": other})
    assert "'input_ids'" in str(caught.value) and "'token_type_ids'" in str(caught.value)


def test_shared_masks_need_the_named_dims_in_the_same_order_and_never_collide_with_lengths():
    image = dict(dtype=torch.float32, pad=0.0, mask="valid")
    with pytest.raises(ValueError, match="same order"):
        Contract({"a": Field(shape=("H", "W"), **image), "b": Field(shape=("W", "H"), **image)})
    Contract({"a": Field(shape=("H", "W"), **image), "b": Field(shape=("H", 3, "W"), **image)})  # allowed
    with pytest.raises(ValueError, match="'a' .mask. and 'b' .lengths."):
        Contract({"a": padded_tokens(mask="n"), "b": padded_tokens(lengths="n")})


def test_the_native_collator_checks_a_shared_mask_itself():
    from fastcollate import _C

    specs = bert_like_contract().native_specs()
    assert [spec.mask_dtype for spec in specs if spec.padded] == [torch.int64, torch.int64]
    specs[1].mask_dtype = torch.bool  # what Contract refuses, passed straight to the Collator
    shared = "'input_ids' and 'token_type_ids' share the mask key 'attention_mask'"
    with pytest.raises(ValueError, match=shared):
        _C.Collator("id", specs, True)


@pytest.mark.parametrize(
    "bad",
    [
        dict(mask_dtype=torch.int64),  # no pad: no mask
        dict(shape=("T",), pad=0, mask_dtype=torch.complex64),
        dict(shape=("T",), pad=0, mask_dtype=torch.qint8),
        dict(shape=("T",), pad=0, mask_dtype="int64"),
    ],
    ids=["without_pad", "complex", "quantized", "not_a_dtype"],
)
def test_a_mask_dtype_must_be_bool_integer_or_floating_and_needs_pad(bad):
    with pytest.raises(ValueError, match="mask"):
        Field(**bad)


def test_describe_names_what_differs_from_the_mask_defaults():
    plain = "tensor torch.int64 [T] padded right with 0"
    assert Field(dtype=torch.int64, shape=("T",), pad=0).describe() == plain
    hf = padded_tokens(mask="attention_mask", mask_dtype=torch.int64, lengths=None)
    assert hf.describe() == f"{plain} mask 'attention_mask' mask dtype torch.int64 no lengths"
    a, b = Contract({"x": padded_tokens()}), Contract({"x": padded_tokens(mask_dtype=torch.int64)})
    assert a.diff(b) == ["x: tensor torch.int64 [T] padded right with 0 != "
                         "tensor torch.int64 [T] padded right with 0 mask dtype torch.int64"]


def test_a_sample_that_expands_must_still_agree_on_its_named_dims():
    # boxes [2, 1] expands to [2, 4]: its N is 2, so labels of length 3 in the same sample disagree.
    contract = Contract(
        {
            "boxes": Field(dtype=torch.float32, shape=("N", 4), pad=0.0, expand_from=((2, 1),)),
            "labels": Field(dtype=torch.int64, shape=("N",), pad=-100),
        },
        id=None,
    )
    good = {"boxes": torch.zeros(2, 1), "labels": torch.zeros(2, dtype=torch.int64)}
    assert assemble.using(contract)([good, good])["boxes"].shape == (2, 2, 4)
    bad = {"boxes": torch.zeros(2, 1), "labels": torch.zeros(3, dtype=torch.int64)}
    with pytest.raises(RuntimeError, match="share a named dim") as caught:
        assemble.using(contract)([good, bad])
    assert caught.value.field == "labels"


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        (dict(pad=1 + 2j), "real number"),
        (dict(pad="0"), "real number"),
        (dict(pad=2**53 + 1), "beyond 2\\*\\*53"),
        (dict(pad=np.int64(-(2**60))), "beyond 2\\*\\*53"),
        (dict(pad=2.5, dtype=torch.int64), "not a value"),
        (dict(pad=float("inf"), dtype=torch.int32), "not a value"),
    ],
    ids=["complex", "string", "beyond_2_53", "numpy_beyond_2_53", "fraction_for_int", "inf_for_int"],
)
def test_a_pad_the_batch_could_not_hold_exactly_is_refused_when_declared(declared, message):
    # The pad crosses to C++ as a double: 2**53 + 1 would arrive as 2**53, 2.5 as int64 would become 2.
    with pytest.raises(ValueError, match=message):
        Field(shape=("T",), **declared)


def test_pads_of_numpy_scalars_and_exact_large_integers_are_written_as_declared():
    samples = [{"id": i, "x": torch.arange(n)} for i, n in enumerate((1, 3))]
    for pad in (np.int64(-7), 2**53, -(2**53), np.float32(4.0)):
        field = Field(dtype=torch.int64, shape=("T",), pad=pad)
        contract = Contract({"id": Field(kind="number"), "x": field})
        batch = assemble.using(contract)(samples)
        assert batch["x"][0, 1:].tolist() == [int(pad), int(pad)]


def test_a_fractional_pad_for_an_inferred_integer_dtype_is_refused_at_the_first_batch():
    samples = [{"id": i, "x": torch.arange(n)} for i, n in enumerate((1, 3))]
    with pytest.raises(ContractValueError, match="pad=2.5") as raised:
        assemble.using(Contract({"id": Field(kind="number"), "x": Field(shape=("T",), pad=2.5)}))(samples)
    assert raised.value.field == "x"


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_a_complex32_field_is_padded():
    x = [torch.full((n,), 1 + 1j, dtype=torch.complex32) for n in (1, 3)]
    samples = [{"id": i, "x": v} for i, v in enumerate(x)]
    contract = Contract({"id": Field(kind="number"), "x": Field(dtype=torch.complex32, shape=("T",), pad=-1)})
    batch = assemble.using(contract)(samples)
    assert batch["x"].dtype == torch.complex32
    assert batch["x"].to(torch.complex64).tolist() == [[1 + 1j, -1, -1], [1 + 1j] * 3]


@pytest.mark.parametrize("gathered", [False, True])
def test_an_empty_batch_is_refused_as_the_batch_with_no_sample_named(gathered):
    dataset = Arrays(x=torch.zeros(4, 2))
    batch = dataset.__getitems__([]) if gathered else []
    with pytest.raises(ContractEmptyError) as refused:
        assemble(batch)
    message = str(refused.value)
    assert message.startswith("the batch, field '<batch>': expected at least one sample, got an empty batch")
    assert "position None" not in message and "with_ids" not in message
    again = pickle.loads(pickle.dumps(refused.value))  # as a DataLoader worker hands it over
    assert type(again) is ContractEmptyError and str(again) == message
