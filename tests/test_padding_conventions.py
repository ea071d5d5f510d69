"""Hugging Face's padding conventions on a padded field: ``pad_to_multiple_of`` (the padded length rounded
up, as ``DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)`` pads) and ``padding_side="left"``
(padding first, as a tokenizer with ``padding_side="left"`` pads). The batch is the collator's, key for
key, and the same whether it is walked per sample (tensors, lists of ints) or gathered column by column
(``Arrays`` over ``Ragged``, ``Arrays.from_hf``)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastcollate
from fastcollate import Arrays, Contract, ContractError, Field, Ragged

from .helpers.gathered import gathered_plan
from .helpers.word_tokenizer import token_rows, word_level_tokenizer

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("tokenizers", reason="tokenizers is not installed")

CONVENTIONS = {
    "multiple of 8": {"pad_to_multiple_of": 8},
    "left": {"padding_side": "left"},
    "left, multiple of 8": {"padding_side": "left", "pad_to_multiple_of": 8},
}
SOURCES = ["tensors", "lists of ints", "Arrays over Ragged", "Arrays.from_hf"]


@pytest.fixture(scope="module")
def tokenizers():
    return {side: word_level_tokenizer(padding_side=side) for side in ("right", "left")}


def hf_collator(tokenizers, convention):
    tokenizer = tokenizers[convention.get("padding_side", "right")]
    multiple = convention.get("pad_to_multiple_of")
    return transformers.DataCollatorWithPadding(tokenizer, pad_to_multiple_of=multiple, return_tensors="pt")


def hf_contract(convention, mask_dtype=torch.int64, lengths=None, token_type_ids=False):
    """input_ids padded with [PAD] (0) under ``convention``, one attention_mask, an int64 label. Token ids
    saved by datasets are int32: the contract casts them."""
    padded = dict(shape=("T",), mask="attention_mask", mask_dtype=mask_dtype, cast_from=(torch.int32,),
                  **convention)
    fields = {"input_ids": Field(dtype=torch.int64, pad=0, lengths=lengths, **padded)}
    if token_type_ids:
        fields["token_type_ids"] = Field(dtype=torch.int64, pad=0, lengths=None, **padded)
    fields["labels"] = Field(kind="number", dtype=torch.int64, range=(0, 2))
    return Contract(fields, id=None)


def batch_from(source, rows, tmp_path):
    """The batch of ``rows`` as ``source`` gives it to assemble: samples, or an Arrays batch."""
    keys = [k for k in rows[0] if k != "labels"]
    if source == "lists of ints":
        return rows
    if source == "tensors":
        return [{**{k: torch.tensor(row[k], dtype=torch.int64) for k in keys}, "labels": row["labels"]}
                for row in rows]
    if source == "Arrays over Ragged":
        columns = {}
        for key in keys:
            lengths = [len(row[key]) for row in rows]
            values = torch.tensor([t for row in rows for t in row[key]], dtype=torch.int32)
            columns[key] = Ragged(values, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        arrays = Arrays(**columns, labels=np.array([row["labels"] for row in rows]))
    else:
        datasets = pytest.importorskip("datasets", reason="datasets is not installed")
        features = datasets.Features({**{k: datasets.Sequence(datasets.Value("int32")) for k in keys},
                                      "labels": datasets.Value("int64")})  # declared: rows may all be empty
        columns = {k: [row[k] for row in rows] for k in rows[0]}
        datasets.Dataset.from_dict(columns, features=features).save_to_disk(tmp_path / "ds")
        arrays = Arrays.from_hf(datasets.load_from_disk(str(tmp_path / "ds")))
    return arrays.__getitems__(list(range(len(rows))))


def collate(contract, batch):
    """The batch under ``contract``; an Arrays batch must be gathered, not handed to the walk."""
    if not isinstance(batch, list):
        assert gathered_plan(batch, contract, "id") is not None, "gathered, not walked"
    return fastcollate.assemble.using(contract)(batch)


def assert_same_batch(expected, got):
    assert set(got) == set(expected)
    for key in expected:
        assert got[key].dtype == expected[key].dtype, key
        assert torch.equal(got[key], expected[key]), (key, got[key], expected[key])


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("convention", list(CONVENTIONS))
def test_the_batch_equals_data_collator_with_padding_s_under_the_same_convention(
    tokenizers, convention, source, tmp_path
):
    rows = token_rows(tokenizers["right"])
    longest = max(len(row["input_ids"]) for row in rows)
    assert longest % 8 != 0 and len({len(row["input_ids"]) for row in rows}) > 1  # both conventions show
    expected = hf_collator(tokenizers, CONVENTIONS[convention])(rows)
    got = collate(hf_contract(CONVENTIONS[convention]), batch_from(source, rows, tmp_path))
    assert_same_batch(expected, got)
    if "multiple" in convention:
        assert got["input_ids"].shape[1] == -(-longest // 8) * 8
    if "left" in convention:  # the real tokens end every row: [SEP] is last
        assert (got["input_ids"][:, -1] == tokenizers["left"].sep_token_id).all()


@pytest.mark.parametrize("source", ["tensors", "lists of ints"])
@pytest.mark.parametrize("convention", list(CONVENTIONS))
def test_two_fields_sharing_attention_mask_pad_alike(tokenizers, convention, source, tmp_path):
    """BERT's input_ids and token_type_ids (walked: the gather builds no mask shared by two columns)."""
    rows = token_rows(tokenizers["right"], pairs=True, seed=1)
    expected = hf_collator(tokenizers, CONVENTIONS[convention])(rows)
    contract = hf_contract(CONVENTIONS[convention], token_type_ids=True)
    got = collate(contract, batch_from(source, rows, tmp_path))
    assert_same_batch(expected, got)
    assert got["token_type_ids"].max() == 1  # the second text's, not the padding's


@pytest.mark.parametrize("source", SOURCES)
def test_a_bool_mask_covers_the_padded_length_and_lengths_stay_the_real_ones(tokenizers, source, tmp_path):
    rows = token_rows(tokenizers["right"], count=5, seed=2)
    convention = CONVENTIONS["left, multiple of 8"]
    expected = hf_collator(tokenizers, convention)(rows)
    contract = hf_contract(convention, mask_dtype=torch.bool, lengths="lengths")
    got = collate(contract, batch_from(source, rows, tmp_path))
    assert got["attention_mask"].dtype == torch.bool
    assert torch.equal(got["attention_mask"], expected["attention_mask"].bool())
    assert got["lengths"].tolist() == [len(row["input_ids"]) for row in rows]
    assert got["attention_mask"].shape[1] % 8 == 0 and got["attention_mask"].shape[1] > max(got["lengths"])


ROW_CASES = {
    "lengths already multiples": [[5, 6, 7, 8, 9, 10, 11, 12], [5] * 16],
    "a batch of one": [[2, 5, 3]],
    "an empty row": [[2, 5, 6, 3], [], [2, 3]],
    "every row empty": [[], []],
}


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("case", list(ROW_CASES))
@pytest.mark.parametrize("convention", list(CONVENTIONS))
def test_edge_batches_equal_the_collator_s(tokenizers, convention, case, source, tmp_path):
    rows = [{"input_ids": ids, "labels": n % 2} for n, ids in enumerate(ROW_CASES[case])]
    samples = [{**row, "input_ids": torch.tensor(row["input_ids"], dtype=torch.int64)} for row in rows]
    expected = hf_collator(tokenizers, CONVENTIONS[convention])(samples)
    got = collate(hf_contract(CONVENTIONS[convention], lengths="lengths"), batch_from(source, rows, tmp_path))
    lengths = got.pop("lengths")
    assert_same_batch(expected, got)
    assert lengths.tolist() == [len(ids) for ids in ROW_CASES[case]]
    if case == "lengths already multiples" and "multiple" in convention:
        assert got["input_ids"].shape == (2, 16)


# ---------------------------------------------------------------------------------------------------
# Walked and gathered alike, against a reference built with torch.nn.functional.pad


def reference(rows, pad, multiple, side, mask_dtype, dtype):
    """``rows`` ([length, *inner] each) padded along dim 0 to the longest rounded up to ``multiple``."""
    longest = max(len(row) for row in rows)
    padded = -(-longest // multiple) * multiple if multiple else longest
    values, masks = [], []
    for row in rows:
        missing = padded - len(row)
        before, after = (missing, 0) if side == "left" else (0, missing)
        flat = [0] * 2 * (row.dim() - 1) + [before, after]  # F.pad's last dim first
        values.append(F.pad(row.to(dtype), flat, value=pad))
        masks.append(F.pad(torch.ones(len(row), dtype=torch.int64), [before, after]).to(mask_dtype))
    return torch.stack(values), torch.stack(masks)


@st.composite
def padded_columns(draw):
    rows = draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(0, 20), min_size=rows, max_size=rows))
    inner = tuple(draw(st.lists(st.integers(1, 3), max_size=1)))
    source = draw(st.sampled_from([torch.int64, torch.int16, torch.float32]))
    dtype = draw(st.sampled_from([source, torch.int64 if source == torch.int16 else source]))
    values = torch.randint(0, 50, (sum(lengths), *inner)).to(source)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    multiple = draw(st.one_of(st.none(), st.integers(1, 16)))
    side = draw(st.sampled_from(["right", "left"]))
    mask_dtype = draw(st.sampled_from([torch.bool, torch.int64, torch.float32]))
    field = Field(dtype=dtype, shape=("T", *inner), pad=-100, cast_from=(source,), mask_dtype=mask_dtype,
                  range=(0, 50), pad_to_multiple_of=multiple, padding_side=side)
    indices = draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=12))
    return Ragged(values, offsets), field, indices


EXAMPLES = int(os.environ.get("FASTCOLLATE_FUZZ_EXAMPLES", "100"))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(padded_columns())
def test_walked_and_gathered_batches_are_one_reference_batch(case):
    tokens, field, indices = case
    dataset = Arrays(tokens=tokens)
    contract = Contract({"tokens": field}, id=None)
    gathered = collate(contract, dataset.__getitems__(indices))
    walked = collate(contract, [dataset[i] for i in indices])
    rows = [dataset[i]["tokens"] for i in indices]
    values, mask = reference(
        rows, -100, field.pad_to_multiple_of, field.padding_side, field.mask_dtype, field.dtype
    )
    expected = {"tokens": values, "tokens_mask": mask, "tokens_lengths": torch.tensor([len(r) for r in rows])}
    for batch in (gathered, walked):
        assert list(batch) == list(expected)
        for key in expected:
            assert batch[key].dtype == expected[key].dtype, key
            assert torch.equal(batch[key], expected[key]), key


def test_every_named_dim_is_padded_to_its_multiple_on_the_declared_side():
    """Several named dims: each rounded to the multiple, the sample in the corner the side says (the walk;
    the gather pads one ragged dim)."""
    images = [torch.arange(h * w, dtype=torch.float32).reshape(h, w) + 1 for h, w in [(2, 5), (3, 1), (1, 1)]]
    images[1] = images[1].t().contiguous().t()  # a strided sample takes ATen's copy
    contract = Contract(
        {"image": Field(dtype=torch.float64, shape=("H", "W"), pad=-1, cast_from=(torch.float32,),
                        pad_to_multiple_of=4, padding_side="left")},
        id=None,
    )
    batch = fastcollate.assemble.using(contract)([{"image": image} for image in images])
    assert batch["image"].shape == (3, 4, 8) and batch["image_mask"].shape == (3, 4, 8)
    for image, padded, mask in zip(images, batch["image"], batch["image_mask"], strict=True):
        h, w = image.shape
        assert torch.equal(padded, F.pad(image.double(), (8 - w, 0, 4 - h, 0), value=-1))
        assert torch.equal(mask, F.pad(torch.ones(h, w, dtype=torch.bool), (8 - w, 0, 4 - h, 0)))
    assert batch["image_lengths"].tolist() == [[2, 5], [3, 1], [1, 1]]


def test_a_value_out_of_range_in_a_left_padded_row_is_named_alike_gathered_or_walked():
    """The padding (-1 here) is no value of the sample's: only the sample's own positions are checked, at
    the end of its row."""
    values = torch.tensor([1, 2, 3, 4, 5, 60, 7])
    dataset = Arrays(tokens=Ragged(values, np.array([0, 1, 4, 7])), index_as="id")
    contract = Contract({"id": Field(kind="number"),
                         "tokens": Field(shape=("T",), pad=-1, range=(0, 50), padding_side="left",
                                         pad_to_multiple_of=4)})
    good = collate(contract, dataset.__getitems__([0, 1]))
    assert good["tokens"].tolist() == [[-1, -1, -1, 1], [-1, 2, 3, 4]]
    errors = []
    for batch in (dataset.__getitems__([1, 2]), [dataset[1], dataset[2]]):
        with pytest.raises(ContractError) as caught:
            fastcollate.assemble.using(contract)(batch)
        errors.append(caught.value)
    gathered, walked = errors
    assert (gathered.sample_id, gathered.position, gathered.field) == (2, 1, "tokens"), str(gathered)
    assert str(gathered) == str(walked)
    assert "at or above the upper bound at flat position 1" in str(gathered)  # 60, not the padding


# ---------------------------------------------------------------------------------------------------
# Declaration


@pytest.mark.parametrize("multiple", [0, -8, 2.0, "8", True, 2**31 + 1])
def test_a_multiple_that_is_no_int_from_1_is_refused_at_declaration(multiple):
    expected = rf"pad_to_multiple_of must be an int from 1 to 2\*\*31.*got {multiple!r}"
    with pytest.raises(ValueError, match=expected):
        Field(shape=("T",), pad=0, pad_to_multiple_of=multiple)


def test_a_numpy_int_multiple_is_taken_as_an_int():
    field = Field(shape=("T",), pad=0, pad_to_multiple_of=np.int64(8))
    assert type(field.pad_to_multiple_of) is int and field.pad_to_multiple_of == 8
    assert "padded right with 0 to a multiple of 8" in field.describe()


@pytest.mark.parametrize("side", ["Left", "both", None, "l"])
def test_a_padding_side_other_than_right_or_left_is_refused_at_declaration(side):
    with pytest.raises(ValueError, match=rf"padding_side must be 'right' or 'left'.*got {side!r}"):
        Field(shape=("T",), pad=0, padding_side=side)


@pytest.mark.parametrize(
    ("setting", "named"),
    [({"pad_to_multiple_of": 8}, "pad_to_multiple_of"), ({"padding_side": "left"}, "padding_side='left'")],
)
def test_a_convention_without_pad_or_with_pack_is_refused_at_declaration(setting, named):
    with pytest.raises(ValueError, match=rf"^{named} only apply to padded fields: set pad=<value>"):
        Field(shape=("T",), **setting)
    packed = rf"^{named} apply to padded fields, and a packed field has no padding"
    with pytest.raises(ValueError, match=packed):
        Field(shape=("T",), pack=True, **setting)


@pytest.mark.parametrize(
    ("first", "second", "differing"),
    [
        ({"pad_to_multiple_of": 8}, {}, "pad_to_multiple_of 8 and None"),
        ({"pad_to_multiple_of": 8}, {"pad_to_multiple_of": 16}, "pad_to_multiple_of 8 and 16"),
        ({"padding_side": "left"}, {}, "padding_side 'left' and 'right'"),
    ],
)
def test_two_fields_sharing_a_mask_must_pad_to_the_same_multiple_on_the_same_side(first, second, differing):
    shared = dict(shape=("T",), pad=0, mask="attention_mask")
    with pytest.raises(ValueError, match="share the mask key 'attention_mask'") as caught:
        Contract({"input_ids": Field(**shared, **first), "token_type_ids": Field(**shared, **second)})
    assert differing in str(caught.value) and "give one field its own mask=<key>" in str(caught.value)
    Contract({"input_ids": Field(**shared, **first), "token_type_ids": Field(**shared, **first)})  # agreeing


def test_the_native_side_refuses_a_shared_mask_whose_fields_disagree():
    """The rule is the walk's, stated once: specs made any other way meet it too."""
    from fastcollate._ext import _C

    specs = Contract({"a": Field(shape=("T",), pad=0, mask="m"), "b": Field(shape=("T",), pad=0, mask="m")},
                     id=None).native_specs()
    specs[1].pad_left = True
    with pytest.raises(ValueError, match="share the mask key 'm', but .* padding_side 'right' and 'left'"):
        _C.Collator("id", specs, True)


def test_a_contract_describes_and_diffs_the_conventions():
    right = Contract({"t": Field(shape=("T",), pad=0)}, id=None)
    left = Contract({"t": Field(shape=("T",), pad=0, padding_side="left", pad_to_multiple_of=8)}, id=None)
    assert "padded left with 0 to a multiple of 8" in str(left)
    assert left.diff(right) == [
        "t: tensor [T] padded left with 0 to a multiple of 8 != tensor [T] padded right with 0"
    ]
