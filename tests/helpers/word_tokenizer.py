"""An offline word-level tokenizer with BERT's layout (no download): the tokenizer Hugging Face batches
are compared against."""

from __future__ import annotations

import random

WORDS = [f"w{i}" for i in range(40)]


def word_level_tokenizer(**options):
    """A ``PreTrainedTokenizerFast`` over ``WORDS``: ``[PAD]`` is 0, pairs get token_type_ids 0 for the
    first text and 1 for the second, as BERT's. ``options`` go to the tokenizer (``padding_side="left"``)."""
    import tokenizers
    import transformers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.processors import TemplateProcessing

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, **{w: 4 + i for i, w in enumerate(WORDS)}}
    backend = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    backend.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        **options,
    )


def token_rows(tokenizer, count=12, seed=0, pairs=False):
    """Tokenized texts as Python lists (input_ids, and token_type_ids for pairs), and a label each."""
    rng = random.Random(seed)

    def text():
        return " ".join(rng.choices(WORDS, k=rng.randint(1, 20)))

    rows = []
    for _ in range(count):
        encoded = tokenizer(text(), text() if pairs else None, return_token_type_ids=pairs,
                            return_attention_mask=False)
        rows.append({**encoded, "labels": rng.randrange(2)})
    return rows
