"""Hugging Face style batches: a contract whose batch is exactly what ``DataCollatorWithPadding`` makes
(keys, dtypes, values), and what a ``transformers`` model takes. Offline: a word-level tokenizer built
in tests/helpers/tokenizers.py, a tiny randomly initialised BERT, no downloads."""

import random

import pytest
import torch

from fastcollate import Contract, Field, assemble

from .helpers.word_tokenizer import WORDS, token_rows, word_level_tokenizer

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed")


@pytest.fixture(scope="module")
def tokenizer():
    return word_level_tokenizer()


def tokenized_samples(tokenizer, count=12, pairs=False, seed=0):
    """What a tokenizing Dataset's __getitem__ returns: int64 tensors and an int label."""
    samples = []
    for row in token_rows(tokenizer, count=count, seed=seed, pairs=pairs):
        labels = row.pop("labels")
        tensors = {key: torch.tensor(ids, dtype=torch.int64) for key, ids in row.items()}
        samples.append({**tensors, "labels": labels})
    return samples


def hf_contract(tokenizer, token_type_ids=False):
    """input_ids padded with the pad token, token_type_ids with the pad type id, one int64 attention_mask."""
    padded = dict(shape=("T",), mask="attention_mask", mask_dtype=torch.int64, lengths=None)
    fields = {"input_ids": Field(dtype=torch.int64, pad=tokenizer.pad_token_id, **padded)}
    if token_type_ids:
        fields["token_type_ids"] = Field(dtype=torch.int64, pad=tokenizer.pad_token_type_id, **padded)
    fields["labels"] = Field(kind="number", dtype=torch.int64, range=(0, 2))
    return Contract(fields, id=None)


def assert_same_batch(expected, got):
    assert set(got) == set(expected)
    for key in expected:
        assert got[key].dtype == expected[key].dtype, key
        assert torch.equal(got[key], expected[key]), key


@pytest.mark.parametrize("pairs", [False, True], ids=["input_ids", "with_token_type_ids"])
def test_the_batch_equals_data_collator_with_padding_key_for_key(tokenizer, pairs):
    samples = tokenized_samples(tokenizer, pairs=pairs)
    lengths = {len(s["input_ids"]) for s in samples}
    assert len(lengths) > 1  # padding happens
    expected = transformers.DataCollatorWithPadding(tokenizer, return_tensors="pt")(samples)
    got = assemble.using(hf_contract(tokenizer, token_type_ids=pairs))(samples)
    keys = {"input_ids", "attention_mask", "labels"} | ({"token_type_ids"} if pairs else set())
    assert set(expected) == keys
    assert_same_batch(expected, got)
    if pairs:  # non-trivial: the second text's type ids are 1, the padding's 0
        assert got["token_type_ids"].max() == 1


def test_a_tiny_bert_gives_the_same_loss_and_logits_on_both_batches(tokenizer):
    config = transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=64, num_labels=2,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    samples = tokenized_samples(tokenizer, pairs=True)
    reference = transformers.DataCollatorWithPadding(tokenizer, return_tensors="pt")(samples)
    ours = assemble.using(hf_contract(tokenizer, token_type_ids=True))(samples)
    with torch.no_grad():
        expected = model(**reference)
        got = model(**ours)
    assert torch.isfinite(got.loss)
    assert torch.equal(got.logits, expected.logits)
    assert torch.equal(got.loss, expected.loss)


# ---------------------------------------------------------------------------------------------------
# Rows straight from a datasets.Dataset: token ids as Python lists


def dataset_rows(tokenizer, count=12, seed=0, **tokenize):
    """``datasets.Dataset.from_dict(tokenizer(texts))[i]``: each row a dict of Python lists."""
    datasets = pytest.importorskip("datasets", reason="datasets is not installed")
    rng = random.Random(seed)
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(1, 20))) for _ in range(count)]
    columns = dict(tokenizer(texts, **tokenize))
    columns["labels"] = [rng.randrange(2) for _ in range(count)]
    dataset = datasets.Dataset.from_dict(columns)
    rows = [dataset[i] for i in range(count)]
    assert isinstance(rows[0]["input_ids"], list) and isinstance(rows[0]["input_ids"][0], int)
    return rows


def test_dataset_rows_of_lists_give_data_collator_with_padding_s_batch(tokenizer):
    rows = dataset_rows(tokenizer, return_attention_mask=False, return_token_type_ids=False)
    expected = transformers.DataCollatorWithPadding(tokenizer, return_tensors="pt")(rows)
    got = assemble.using(hf_contract(tokenizer))(rows)
    assert set(expected) == {"input_ids", "attention_mask", "labels"}
    assert_same_batch(expected, got)
    tensors = [{**row, "input_ids": torch.tensor(row["input_ids"])} for row in rows]
    assert_same_batch(assemble.using(hf_contract(tokenizer))(tensors), got)


def test_dataset_rows_of_lists_give_data_collator_with_flattening_s_batch(tokenizer):
    """Rows as the tokenizer makes them for a causal LM: input_ids and an attention_mask, no labels. The
    collator makes labels from input_ids and leaves the mask out; so does the contract."""
    rows = dataset_rows(tokenizer, return_token_type_ids=False)
    rows = [{k: v for k, v in row.items() if k != "labels"} for row in rows]
    assert set(rows[0]) == {"input_ids", "attention_mask"}
    tokens = dict(dtype=torch.int64, shape=("T",), pack=True)
    contract = Contract(
        {"input_ids": Field(**tokens), "labels": Field(**tokens, separator=-100, copy_of="input_ids")},
        id=None,
    )
    expected = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(rows)
    got = assemble.using(contract)(rows)
    assert list(got) == list(expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert type(got[key]) is type(value) and got[key] == value, key
