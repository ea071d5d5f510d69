"""pytest-benchmark: the per-batch cost of the nested-batch walk DeviceLoader does for every batch
(flatten, then rebuild around the device tensors): ``fastcollate.structure.tree`` against
``torch.utils._pytree``, which torch.compile and torchdata use.

    pytest benchmarks/test_tree.py --benchmark-group-by=group

pytree would also do the job only for the types it has registered: an unregistered Mapping (a
``UserDict``, Hugging Face's ``BatchEncoding``) is one leaf to it, so its tensors would never be moved
(``test_pytree_leaves_an_unregistered_mapping_whole`` keeps that claim checked).
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils import _pytree as pytree

from fastcollate.structure import tree

_T = torch.zeros(4)
BATCHES = {
    "image-label-id": {"image": _T, "label": _T, "id": _T},
    "padded tokens": {"input_ids": _T, "attention_mask": _T, "meta": {"lengths": _T, "names": ["a", "b"]}},
    "tuple": (_T, _T),
}


def _fastcollate_round_trip(batch):
    leaves, rebuild = tree.flatten(batch)
    return rebuild(leaves)


def _pytree_round_trip(batch):
    leaves, spec = pytree.tree_flatten(batch)
    return pytree.tree_unflatten(leaves, spec)


WALKS = {"fastcollate.structure.tree": _fastcollate_round_trip, "torch.utils._pytree": _pytree_round_trip}


@pytest.mark.parametrize("walk", list(WALKS))
@pytest.mark.parametrize("name", list(BATCHES))
def test_round_trip(benchmark, name, walk):
    benchmark.group = f"tree round trip: {name}"
    batch = BATCHES[name]
    out = benchmark(WALKS[walk], batch)
    assert type(out) is type(batch)
    assert [path for path, _ in tree.leaf_paths(out)] == [path for path, _ in tree.leaf_paths(batch)]


def test_pytree_leaves_an_unregistered_mapping_whole():
    batch = collections.UserDict({"image": _T})
    assert pytree.tree_flatten(batch)[0] == [batch]
    assert tree.flatten(batch)[0] == [_T]
