"""A factory for padded text, as ``bench``, ``profile`` and ``doctor`` take it:

    python -m fastcollate doctor --dataset examples/padded_text.py:make
    python -m fastcollate bench --quick --dataset examples/padded_text.py:make
    python -m fastcollate profile --dataset examples/padded_text.py:make
    python -m fastcollate doctor --resume --dataset examples/padded_text.py:make_resumable
    python -m fastcollate doctor --resume-world-size 2,3 --dataset examples/padded_text.py:make_resumable

Token lists of varying length, as a tokenizer gives them, padded by the contract to the batch's
longest with an attention mask. ``default_collate`` cannot batch them: the bench and the profiler say
so and leave it out; a factory that also returns ``"collate"`` (e.g. transformers'
``DataCollatorWithPadding``) has that one timed as the baseline.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from fastcollate import Contract, Field, IndexBatches


class TokenLists(Dataset):
    """``size`` samples of 8 to 128 token ids (lists of ints), each with its id and a 0/1 label."""

    def __init__(self, size: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(8, 129, size)
        self.labels = rng.integers(0, 2, size)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict:
        rng = np.random.default_rng((self.seed, index))  # the same tokens in every worker, every epoch
        tokens = rng.integers(1, 30_000, int(self.lengths[index])).tolist()
        return {"id": int(index), "input_ids": tokens, "label": int(self.labels[index])}


def make(size: int = 512, seed: int = 0) -> dict:
    contract = Contract(
        {
            "id": Field(kind="number"),
            "input_ids": Field(
                dtype=torch.int64,
                shape=("T",),
                pad=0,
                mask="attention_mask",
                mask_dtype=torch.int64,
                lengths=None,
            ),
            "label": Field(kind="number", dtype=torch.int64, range=(0, 2)),
        }
    )
    return {"dataset": TokenLists(size, seed), "contract": contract, "batch_size": 16}


def make_resumable(size: int = 512, seed: int = 0) -> dict:
    """The same, batched by ``IndexBatches``: a checkpoint resumes it on any worker count or world size."""
    made = make(size, seed)
    made["batch_sampler"] = IndexBatches(size, made.pop("batch_size"), shuffle=True, seed=seed)
    return made
