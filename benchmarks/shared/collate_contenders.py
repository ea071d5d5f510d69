"""The collate cases' contenders beside ``fastcollate.assemble``: the hand-written references people use
today (pad_sequence with a mask, Hugging Face's DataCollatorWithPadding and DataCollatorWithFlattening,
torch.cat with arange) and the plain-copy floors, each producing the batch the case's reference does."""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch.nn.utils.rnn import pad_sequence

import fastcollate
from fastcollate import Contract, Field, assemble

Collate = Callable[[Sequence[Any]], Any]


def checked_assemble(sample: Any, label_range: tuple[int, int]) -> fastcollate.Assembler:
    """``assemble.using(Contract.infer(sample))`` with a range declared on ``label``: every field's dtype
    and shape, plus a value check on the label (the contract-overhead target, case 5)."""
    contract = Contract.infer(sample)
    fields = dict(contract.fields)
    fields["label"] = dataclasses.replace(fields["label"], range=label_range)
    return assemble.using(Contract(fields=fields, id=contract.id))


def pad_sequence_with_mask(batch: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """What people write today for variable-length tokens: ``pad_sequence`` and a mask built in Python.
    Same keys, dtypes and values as ``assemble`` under a ``pad=0`` contract."""
    seqs = [sample["tokens"] for sample in batch]
    tokens = pad_sequence(seqs, batch_first=True, padding_value=0)
    lengths = torch.tensor([len(s) for s in seqs])
    mask = torch.arange(tokens.shape[1])[None] < lengths[:, None]
    return {"tokens": tokens, "tokens_mask": mask, "tokens_lengths": lengths}


HF_REFERENCE = "DataCollatorWithPadding"
HF_PAD_SEQUENCE = "pad_sequence (HF keys)"


def have_transformers() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("transformers", "tokenizers"))


def hf_contract(pad_token_id: int = 0, pad_token_type_id: int = 0) -> Contract:
    """The batch ``DataCollatorWithPadding`` makes, as a contract: input_ids and token_type_ids padded on
    the right, one int64 ``attention_mask`` shared by both (they pad the same dim T), int64 labels."""
    padded = dict(shape=("T",), mask="attention_mask", mask_dtype=torch.int64, lengths=None)
    return Contract(
        {
            "input_ids": Field(dtype=torch.int64, pad=pad_token_id, **padded),
            "token_type_ids": Field(dtype=torch.int64, pad=pad_token_type_id, **padded),
            "labels": Field(kind="number", dtype=torch.int64, range=(0, 2)),
        },
        id=None,
    )


def hf_data_collator() -> Collate:
    """``transformers.DataCollatorWithPadding`` with an offline tokenizer: padding reads only its pad
    token id, padding side and model input names, so a two-word vocabulary is enough."""
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    backend = Tokenizer(WordLevel({"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]",
                                                     unk_token="[UNK]")
    return transformers.DataCollatorWithPadding(tokenizer, return_tensors="pt")


def pad_sequence_hf(batch: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """DataCollatorWithPadding's batch written with ``pad_sequence``: the same keys, dtypes and values,
    the int64 attention_mask from the lengths."""
    input_ids = [sample["input_ids"] for sample in batch]
    lengths = torch.tensor([len(ids) for ids in input_ids])
    padded = pad_sequence(input_ids, batch_first=True, padding_value=0)
    return {
        "input_ids": padded,
        "token_type_ids": pad_sequence([sample["token_type_ids"] for sample in batch], batch_first=True,
                                       padding_value=0),
        "attention_mask": (torch.arange(padded.shape[1])[None] < lengths[:, None]).long(),
        "labels": torch.tensor([sample["labels"] for sample in batch]),
    }


PACKED_REFERENCE = "DataCollatorWithFlattening"
PACKED_CAT = "torch.cat+arange"
PACKED_ARRAYS = "assemble on Arrays"


def packed_contract() -> Contract:
    """``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)``'s batch."""
    tokens = dict(dtype=torch.int64, shape=("T",), pack=True)
    return Contract({"input_ids": Field(**tokens), "labels": Field(**tokens, separator=-100)}, id=None,
                    packing=fastcollate.Packing(seq_idx="seq_idx"))


def flattening_collator() -> Collate:
    import transformers

    return transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)


def cat_arange_packed(batch: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, Any]:
    """The packed batch written by hand with torch ops, no Python per token: the same keys, dtypes and
    values as DataCollatorWithFlattening's."""
    ids = [sample["input_ids"] for sample in batch]
    lengths = torch.tensor([len(x) for x in ids])
    cu_seq_lens = torch.zeros(len(ids) + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=cu_seq_lens[1:])
    starts = cu_seq_lens[:-1].long()
    labels = torch.cat([sample["labels"] for sample in batch])
    labels[starts] = -100
    total = int(cu_seq_lens[-1])
    max_length = int(lengths.max())
    return {
        "input_ids": torch.cat(ids)[None],
        "labels": labels[None],
        "position_ids": (torch.arange(total) - torch.repeat_interleave(starts, lengths))[None],
        "seq_idx": torch.repeat_interleave(torch.arange(len(ids), dtype=torch.int32), lengths)[None],
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max_length,
        "max_length_k": max_length,
    }


class PackedFromArrays:
    """``assemble`` under packed_contract() on the same samples stored as ``Arrays`` columns (``Ragged``
    values and offsets, as a tokenized corpus on disk is): the batch gathered straight from the columns,
    with no sample objects. It ignores the samples it is handed: its batch is the columns' rows 0..n-1."""

    def __init__(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> None:
        lengths = torch.tensor([len(s["input_ids"]) for s in samples])
        offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        columns = {key: fastcollate.Ragged(torch.cat([s[key] for s in samples]), offsets)
                   for key in ("input_ids", "labels")}
        self.batch = fastcollate.Arrays(columns).__getitems__(range(len(samples)))
        self.collate = assemble.using(packed_contract())

    def __call__(self, batch: Any = None) -> Any:
        return self.collate(self.batch)


class ReusedStack:
    """Baseline: ``torch.stack(images, out=reused)``, the images of the batch into one buffer made once."""

    def __init__(self, samples: Sequence[Mapping[str, torch.Tensor]], key: str = "image") -> None:
        self.key = key
        first = samples[0][key]
        self.out = torch.empty((len(samples), *first.shape), dtype=first.dtype)

    def __call__(self, batch: Sequence[Mapping[str, torch.Tensor]]) -> torch.Tensor:
        return torch.stack([sample[self.key] for sample in batch], out=self.out)


class ReusedFlatCopy:
    """Baseline: one contiguous copy of the same number of bytes into a buffer made once.

    ``torch``: ``dst.copy_(src)`` (ATen's copy, parallel over torch's intra-op threads like assemble's);
    ``libc``: one ``memmove`` on the calling thread, through ctypes (no torch dispatch at all).
    """

    def __init__(self, nbytes: int, how: Literal["torch", "libc"] = "torch") -> None:
        self.how = how
        self.nbytes = nbytes
        g = torch.Generator().manual_seed(1)
        self.src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)  # zeros: faulted in now, not in the first call

    def __call__(self, batch: Any = None) -> torch.Tensor:
        if self.how == "torch":
            return self.dst.copy_(self.src)
        ctypes.memmove(self.dst.data_ptr(), self.src.data_ptr(), self.nbytes)
        return self.dst
