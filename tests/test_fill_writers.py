"""The one fill engine (csrc/fill/): a padded field's rows, mask and lengths, and a packed field's row with
its cu_seq_lens, position ids and seq_idx, come out the same through every caller of their writers: the
per-sample walk, the column gather of Arrays, and the dispatcher ops."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastcollate import Arrays, Contract, Field, Packing, Ragged, assemble, ops

from .helpers.batches import assert_same_batch
from .helpers.gathered import gathered_plan


def ragged(lengths, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 100, (sum(lengths),), generator=generator).to(dtype)
    return Ragged(values, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def walked_and_gathered(dataset, indices, contract):
    batch = dataset.__getitems__(indices)
    assert gathered_plan(batch, contract, "id") is not None, "gathered, not walked"
    collate = assemble.using(contract)
    return collate([dataset[i] for i in indices]), collate(batch)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    picks=st.lists(st.integers(0, 2**16), min_size=1, max_size=8),
    pad=st.integers(-100, 100),
    dtype=st.sampled_from([torch.int64, torch.int32, torch.uint8]),
)
def test_a_padded_field_is_padded_alike_by_the_walk_the_column_gather_and_pad_into(
    lengths, picks, pad, dtype
):
    if dtype == torch.uint8:
        pad = abs(pad)
    indices = [p % len(lengths) for p in picks]
    dataset = Arrays(input_ids=ragged(lengths, dtype, seed=len(picks)), index_as="id")
    contract = Contract({"id": Field(kind="number"), "input_ids": Field(dtype=dtype, shape=("T",), pad=pad)})
    walked, gathered = walked_and_gathered(dataset, indices, contract)
    assert_same_batch(gathered, walked)
    samples = [dataset[i]["input_ids"] for i in indices]
    longest = max(len(s) for s in samples)
    out = torch.empty(len(samples), longest, dtype=dtype)
    mask = torch.empty(len(samples), longest, dtype=torch.bool)
    lengths_out = torch.empty(len(samples), dtype=torch.int64)
    ops.pad_into(samples, pad, out, mask, lengths_out)
    assert torch.equal(out, walked["input_ids"])
    assert torch.equal(mask, walked["input_ids_mask"])
    assert torch.equal(lengths_out, walked["input_ids_lengths"])


def test_a_field_padded_in_two_dims_writes_its_corner_mask_and_lengths_through_the_same_writer():
    samples = [{"id": 0, "grid": torch.ones(2, 3)}, {"id": 1, "grid": torch.full((3, 1), 2.0)}]
    contract = Contract({"id": Field(kind="number"),
                         "grid": Field(dtype=torch.float32, shape=("H", "W"), pad=-1.0, padding_side="left")})
    batch = assemble.using(contract)(samples)
    assert batch["grid"].tolist() == [
        [[-1, -1, -1], [1, 1, 1], [1, 1, 1]], [[-1, -1, 2], [-1, -1, 2], [-1, -1, 2]]
    ]
    assert batch["grid_mask"].tolist() == [
        [[False] * 3, [True] * 3, [True] * 3], [[False, False, True]] * 3
    ]
    assert batch["grid_lengths"].tolist() == [[2, 3], [3, 1]]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    picks=st.lists(st.integers(0, 2**16), min_size=1, max_size=8),
    start=st.integers(0, 2),
)
def test_a_packed_field_is_packed_alike_by_the_walk_the_column_gather_and_the_ops(lengths, picks, start):
    indices = [p % len(lengths) for p in picks]
    if sum(lengths[i] for i in indices) == 0:
        lengths[indices[0]] = 1
    column = ragged(lengths, torch.int64, seed=len(picks))
    dataset = Arrays(input_ids=column, index_as="id")
    packed = Field(dtype=torch.int64, shape=("T",), pack=True)
    contract = Contract({"id": Field(kind="number"), "input_ids": packed},
                        packing=Packing(seq_idx="seq_idx", position_ids_start=start))
    walked, gathered = walked_and_gathered(dataset, indices, contract)
    assert_same_batch(gathered, walked)
    cu_seq_lens = walked["cu_seq_lens_q"]
    total = int(cu_seq_lens[-1])
    row = torch.empty(total, dtype=torch.int64)
    offsets = torch.as_tensor(column.offsets)
    ops.gather_packed_into(column.values, offsets, torch.tensor(indices), cu_seq_lens, row)
    positions, seq_idx = torch.empty(1, total, dtype=torch.int64), torch.empty(1, total, dtype=torch.int32)
    ops.packed_positions_into(cu_seq_lens, start, positions, seq_idx)
    assert torch.equal(row, walked["input_ids"][0])
    assert torch.equal(positions, walked["position_ids"])
    assert torch.equal(seq_idx, walked["seq_idx"])
