"""fastcollate.structure.tree: the one nested-batch walk. Its rebuild rules are default_collate's, checked
against torch's own function type for type; its paths are the ones errors, ledgers and the doctor print."""

from __future__ import annotations

import collections
from typing import NamedTuple

import pytest
import torch
from torch.utils.data import default_collate

from fastcollate import DeviceLoader
from fastcollate.structure import tree
from tests.test_fuzz import FrozenMap


class Pair(NamedTuple):
    image: object
    label: object


class Tagged(collections.UserDict):
    """A MutableMapping that is not a dict and carries an attribute (like Hugging Face's BatchEncoding)."""

    def __init__(self, data=None, note="kept"):
        super().__init__(data or {})
        self.note = note


class Strict(FrozenMap):
    """A Mapping whose type refuses a dict: rebuilt as a plain dict, as default_collate does."""

    def __init__(self, *, items):
        super().__init__(items)


class Tokens(list):
    """A list subclass with an attribute: copied and assigned to, so the attribute stays."""

    def __init__(self, items, source="corpus"):
        super().__init__(items)
        self.source = source


def _samples_like(batch):
    """Two samples whose default_collate has ``batch``'s nesting (each tensor leaf a scalar)."""
    return [tree.map_leaves(lambda leaf, k=k: torch.tensor(k), batch) for k in (1, 2)]


CASES = {
    "dict": {"image": torch.zeros(2), "label": torch.ones(2)},
    "ordered dict": collections.OrderedDict(b=torch.zeros(2), a=torch.ones(2)),
    "mutable mapping with attributes": Tagged({"x": torch.zeros(2)}, note="seen"),
    "read-only mapping": FrozenMap({"x": torch.zeros(2)}),
    "mapping refusing a dict": Strict(items={"x": torch.zeros(2)}),
    "namedtuple": Pair(torch.zeros(2), torch.ones(2)),
    "list": [torch.zeros(2), torch.ones(2)],
    "nested": {"pair": Pair(torch.zeros(2), [torch.ones(2), "text"]), "meta": {"n": torch.ones(2)}},
}


@pytest.mark.parametrize("name", list(CASES))
def test_flatten_rebuilds_what_default_collate_builds(name):
    """For every container default_collate makes, flatten's rebuild gives the same types at every level."""
    batch = CASES[name]
    expected_type = dict if isinstance(batch, Strict) else type(batch)
    if name != "nested":  # default_collate makes the reference batch of this nesting
        assert type(default_collate(_samples_like(batch))) is expected_type
    leaves, rebuild = tree.flatten(batch)
    rebuilt = rebuild([leaf * 2 if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])
    assert type(rebuilt) is expected_type
    if isinstance(batch, Tagged):
        assert rebuilt.note == "seen" and rebuilt is not batch
    for (path, old), (new_path, new) in zip(tree.leaf_paths(batch), tree.leaf_paths(rebuilt), strict=True):
        assert path == new_path
        if isinstance(old, torch.Tensor):
            assert torch.equal(new, old * 2)
        else:
            assert new == old


def test_a_tuple_stays_a_tuple_and_a_list_subclass_keeps_its_type_and_attributes():
    rebuilt = tree.map_leaves(lambda leaf: leaf + 1, (1, Tokens([2, 3], source="web")))
    assert type(rebuilt) is tuple and type(rebuilt[1]) is Tokens
    assert list(rebuilt[1]) == [3, 4] and rebuilt[1].source == "web"


def test_sequences_default_collate_does_not_build_pass_through_whole():
    # A UserString's items are UserStrings again: walking it would never end.
    leaves = [collections.UserString("abc"), range(3), memoryview(b"ab"), bytearray(b"xy")]
    batch = {"others": leaves}
    flat, rebuild = tree.flatten(batch)
    assert all(a is b for a, b in zip(flat, leaves, strict=True))
    assert all(a is b for a, b in zip(rebuild(flat)["others"], leaves, strict=True))


def test_strings_and_tensors_are_leaves():
    leaves, _ = tree.flatten({"name": "abc", "data": b"xy", "t": torch.arange(3)})
    assert leaves[:2] == ["abc", b"xy"] and torch.equal(leaves[2], torch.arange(3))


def test_leaf_paths_name_keys_fields_and_indices():
    batch = {"pair": Pair(torch.zeros(1), [torch.ones(1), "text"]), "id": torch.arange(1)}
    paths = [path for path, _ in tree.leaf_paths(batch)]
    assert paths == ["pair.image", "pair.label.0", "pair.label.1", "id"]
    assert [path for path, _ in tree.leaf_paths(torch.zeros(1))] == [""]


def test_lookup_reads_paths_and_names_the_missing_part():
    batch = {"pair": Pair(torch.zeros(1), [torch.ones(1), "text"])}
    assert tree.lookup(batch, "pair.label.1") == "text"
    assert tree.lookup(batch, "pair.0") is batch["pair"].image
    assert tree.lookup(batch, "") is batch
    for path, missing in (("pair.label.2", "2"), ("other", "other"), ("pair.label.1.x", "x")):
        with pytest.raises(KeyError) as raised:
            tree.lookup(batch, path)
        assert raised.value.args == (missing,)


def test_device_loader_keeps_the_batch_types_on_the_cpu_path():
    batches = [CASES["mutable mapping with attributes"], CASES["namedtuple"]]
    out = list(DeviceLoader(batches, device="cpu"))
    assert type(out[0]) is Tagged and out[0].note == "seen" and type(out[1]) is Pair


@pytest.mark.needs_cuda
def test_device_loader_keeps_the_batch_types_on_the_gpu():
    batches = [CASES["nested"], CASES["mutable mapping with attributes"], CASES["mapping refusing a dict"]]
    out = list(DeviceLoader(batches, device="cuda"))
    assert type(out[0]["pair"]) is Pair and out[0]["pair"].image.is_cuda and out[0]["pair"].label[1] == "text"
    assert type(out[1]) is Tagged and out[1].note == "seen" and out[1]["x"].is_cuda
    assert type(out[2]) is dict and out[2]["x"].is_cuda
