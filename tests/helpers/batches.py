"""Two batches compared as a user would: the same keys in the same order, every tensor of the same dtype,
shape and values (nested ones by their values and offsets), every other value of the same type and
equal."""

from __future__ import annotations

import torch


def assert_same_batch(ours, expected):
    assert list(ours) == list(expected), "the same keys in the same order"
    for key, value in expected.items():
        got = ours[key]
        if isinstance(value, torch.Tensor):
            if value.is_nested:
                assert got.is_nested and torch.equal(got.values(), value.values()), key
                assert torch.equal(got.offsets(), value.offsets()), key
                continue
            assert got.dtype == value.dtype and got.shape == value.shape, key
            assert torch.equal(got, value), key
        else:
            assert type(got) is type(value) and got == value, key
    if "cu_seq_lens_q" in ours:
        assert ours["cu_seq_lens_q"] is ours["cu_seq_lens_k"], "one tensor under both keys, as the walk gives"
