"""Property tests: random batches through ``assemble`` (drop-in and with a contract) and the C++ ops.

Every input either collates to exactly ``default_collate``'s result (where that succeeds) or raises a
``ContractError`` that names the sample and the field, and takes no staging slot: no crash, no hang, no
half-written batch handed out. Deliberate differences from default_collate (see the README): an extra
key in a later sample is an error; outputs are contiguous views into one buffer.

``FASTCOLLATE_FUZZ_EXAMPLES`` sets the examples per property (``make fuzz``: 10,000); ``make test`` runs
a few hundred.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import string
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate

from fastcollate import Contract, ContractError, Field, StagingRing, assemble, ops

# the module; fastcollate.assemble is the function
assemble_module = sys.modules["fastcollate.assembler"]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # default_collate's own, on odd inputs

EXAMPLES = int(os.environ.get("FASTCOLLATE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    print_blob=True,
)


# ---------------------------------------------------------------------------------------------------
# Sample specs: a spec describes one field; `build(spec, i)` makes sample i's value for it.


class Pair(NamedTuple):
    a: Any
    b: Any


class Plain(collections.UserDict):
    """A MutableMapping that is not a dict: default_collate copies it and updates the copy."""


class FrozenMap(Mapping):
    """A read-only Mapping whose constructor takes a dict."""

    def __init__(self, data):
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


class Tagged(torch.Tensor):
    pass


TORCH_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.uint16, torch.uint32, torch.uint64,
    torch.float8_e4m3fn,
]
NUMPY_DTYPES = ["float32", "float64", "float16", "int8", "uint8", "int16", "int32", "int64", "bool",
                "complex64", "uint16", "uint32", "uint64"]
NUMPY_BAD_DTYPES = ["U3", "S2", "O", "datetime64[D]", ">f4", "longdouble", "V4"]
LAYOUTS = ["contiguous", "transposed", "sliced", "expanded", "channels_last", "conj", "neg", "requires_grad",
           "subclass", "sparse", "nested", "meta"]

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=4).map(tuple)
keys = st.one_of(
    st.sampled_from(["id", "x", "y", "image", "label", "meta", "0", "a.b"]),
    st.text(string.ascii_letters + string.digits + "_'\". ,:", min_size=1, max_size=6),
    st.integers(-3, 3),
)

tensor_leaf = st.tuples(st.just("tensor"), st.sampled_from(TORCH_DTYPES), shapes,
                        st.sampled_from(LAYOUTS + ["contiguous"] * 6))
ndarray_leaf = st.tuples(st.just("ndarray"), st.sampled_from(NUMPY_DTYPES + NUMPY_BAD_DTYPES[:2]), shapes,
                         st.sampled_from(["C", "C", "F", "sliced", "negative", "bigendian"]))
number_leaf = st.one_of(
    st.tuples(st.just("int"), st.sampled_from(["small", "small", "big", "huge"])),
    st.tuples(st.just("float"), st.sampled_from(["plain", "plain", "nan", "inf", "tiny"])),
    st.tuples(st.just("bool")),
    st.tuples(st.just("npscalar"), st.sampled_from(["int64", "float32", "float64", "bool", "int8", "str"])),
)
other_leaf = st.one_of(
    st.tuples(st.just("str")), st.tuples(st.just("bytes")), st.tuples(st.just("none")),
    st.tuples(st.just("set")), st.tuples(st.just("object")),
    st.tuples(st.just("ndarray"), st.sampled_from(NUMPY_BAD_DTYPES), shapes, st.just("C")),
)
leaf = st.one_of(tensor_leaf, tensor_leaf, ndarray_leaf, number_leaf, number_leaf, other_leaf)


def containers(children):
    return st.one_of(
        st.tuples(st.sampled_from(["dict", "dict", "ordered", "plain", "frozen"]),
                  st.lists(st.tuples(keys, children), min_size=0, max_size=4, unique_by=lambda kv: kv[0])),
        st.tuples(st.sampled_from(["list", "tuple"]), st.lists(children, min_size=0, max_size=3)),
        st.tuples(st.just("pair"), st.tuples(children, children)),
    )


spec_strategy = st.recursive(leaf, containers, max_leaves=6)


def _tensor(dtype, shape, layout, generator, i):
    numel = int(np.prod(shape)) if shape else 1
    if dtype.is_floating_point and dtype.itemsize >= 2 and dtype != torch.float8_e4m3fn:
        base = torch.randn(numel, generator=generator, dtype=torch.float64) * 10
        if numel and i % 3 == 1:
            base[0] = float("nan")  # NaN targets travel unchanged
        value = base.to(dtype)
    elif dtype.is_complex:
        value = torch.randn(numel, generator=generator, dtype=torch.complex128).to(dtype)
    elif dtype == torch.bool:
        value = torch.randint(0, 2, (numel,), generator=generator).bool()
    elif dtype == torch.float8_e4m3fn:
        value = torch.randint(-8, 8, (numel,), generator=generator).to(torch.float32).to(dtype)
    else:
        low = 0 if dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64) else -100
        value = torch.randint(low, 100, (numel,), generator=generator).to(dtype)
    value = value.reshape(shape)
    if layout == "transposed" and value.dim() >= 2:
        value = value.transpose(0, -1).contiguous().transpose(0, -1)
    elif layout == "sliced" and value.dim() >= 1:
        doubled = torch.stack([value, value], dim=-1)
        value = doubled[..., 0]
    elif layout == "expanded" and value.dim() >= 1 and value.shape[0] > 0:
        value = value[:1].expand(value.shape)
    elif layout == "channels_last" and value.dim() == 4:
        value = value.contiguous(memory_format=torch.channels_last)
    elif layout == "conj" and value.is_complex():
        value = value.conj()
    elif layout == "neg" and value.is_complex():
        value = torch._neg_view(value)
    elif layout == "requires_grad" and value.is_floating_point() and dtype != torch.float8_e4m3fn:
        value = value.detach().requires_grad_(True)
    elif layout == "subclass":
        value = value.as_subclass(Tagged)
    elif layout == "sparse" and dtype in (torch.float32, torch.float64, torch.int64):
        value = value.to_sparse()
    elif layout == "nested" and dtype == torch.float32 and value.dim() >= 1:
        value = torch.nested.nested_tensor([value])
    elif layout == "meta":
        value = torch.empty(shape, dtype=dtype, device="meta")
    return value


def made_anew(key: Any) -> Any:
    """An equal key as a new object (as json.loads makes one per record): a one-character str and a small
    int stay the one object Python keeps for them."""
    if isinstance(key, str):
        return key.encode().decode()
    if isinstance(key, int):
        return int(str(key))
    return key


def build(spec, i: int, seed: int) -> Any:
    """Sample ``i``'s value for ``spec``; deterministic in (spec, i, seed)."""
    kind = spec[0]
    generator = torch.Generator().manual_seed(seed * 1009 + i)
    if kind == "tensor":
        return _tensor(spec[1], spec[2], spec[3], generator, i)
    if kind == "ndarray":
        dtype, shape, order = spec[1], spec[2], spec[3]
        rng = np.random.default_rng(seed * 1009 + i)
        if dtype in ("U3", "S2"):
            return np.full(shape, "ab", dtype=dtype)
        if dtype == "O":
            return np.empty(shape, dtype=object)
        values = rng.integers(0, 50, size=shape)
        array = values.astype(np.dtype(dtype)) if dtype != "datetime64[D]" else values.astype("datetime64[D]")
        if order == "F":
            array = np.asfortranarray(array)
        elif order == "sliced" and array.ndim >= 1:
            array = np.repeat(array, 2, axis=-1)[..., ::2]
        elif order == "negative" and array.ndim >= 1 and array.shape[-1] > 1:
            array = array[..., ::-1]
        elif order == "bigendian" and array.dtype.kind in "fiu" and array.dtype.itemsize > 1:
            array = array.astype(array.dtype.newbyteorder(">"))
        return array
    if kind == "int":
        return {"small": i - 3, "big": 2**62 + i, "huge": 2**70 + i}[spec[1]]
    if kind == "float":
        return {"plain": i / 7 - 1, "nan": float("nan"), "inf": float("-inf") if i % 2 else float("inf"),
                "tiny": 5e-324 * i}[spec[1]]
    if kind == "bool":
        return i % 2 == 0
    if kind == "npscalar":
        return np.str_("s") if spec[1] == "str" else np.dtype(spec[1]).type(i % 2)
    if kind == "str":
        return f"s{i}"
    if kind == "bytes":
        return bytes([i % 256]) * 3
    if kind == "none":
        return None
    if kind == "set":
        return {i}
    if kind == "object":
        return object()
    if kind in ("dict", "ordered", "plain", "frozen"):
        # Every second sample's keys are equal objects made anew, as parsed records' are.
        items = [(made_anew(key) if i % 2 else key, build(child, i, seed + 7 * n))
                 for n, (key, child) in enumerate(spec[1])]
        types = {"dict": dict, "ordered": collections.OrderedDict, "plain": Plain, "frozen": FrozenMap}
        mapping_type = types[kind]
        return mapping_type(items)
    if kind == "list":
        return [build(child, i, seed + 7 * n) for n, child in enumerate(spec[1])]
    if kind == "tuple":
        return tuple(build(child, i, seed + 7 * n) for n, child in enumerate(spec[1]))
    if kind == "pair":
        return Pair(*(build(child, i, seed + 7 * n) for n, child in enumerate(spec[1])))
    raise AssertionError(spec)


# Mutations: sample k gets a spec that differs from the others at one place.

def paths(spec, prefix=()):
    yield prefix
    kind = spec[0]
    if kind in ("dict", "ordered", "plain", "frozen"):
        for n, (_, child) in enumerate(spec[1]):
            yield from paths(child, prefix + (n,))
    elif kind in ("list", "tuple", "pair"):
        for n, child in enumerate(spec[1]):
            yield from paths(child, prefix + (n,))


def replace_at(spec, path, make):
    if not path:
        return make(spec)
    kind, children = spec[0], list(spec[1])
    n = path[0]
    if kind in ("dict", "ordered", "plain", "frozen"):
        key, child = children[n]
        children[n] = (key, replace_at(child, path[1:], make))
    else:
        children[n] = replace_at(children[n], path[1:], make)
    return (kind, tuple(children) if kind == "pair" else children)


@st.composite
def mutation(draw, spec):
    """A function from the batch's spec to sample k's spec (or None for no mutation)."""
    if draw(st.integers(0, 3)) == 0:
        return None
    path = draw(st.sampled_from(list(paths(spec))))
    op = draw(st.sampled_from(["leaf", "reshape", "retype", "drop", "add", "grow"]))
    new_leaf = draw(leaf)
    new_key = draw(keys)

    def make(node):
        kind = node[0]
        if op == "reshape" and kind in ("tensor", "ndarray"):
            shape = node[2] + (1,) if not node[2] or node[2][-1] != 1 else node[2][:-1] + (2,)
            return (kind, node[1], shape, node[3])
        if op == "retype" and kind == "tensor":
            return (kind, torch.float64 if node[1] != torch.float64 else torch.int32, node[2], node[3])
        if op == "drop" and kind in ("dict", "ordered", "plain", "frozen") and node[1]:
            return (kind, node[1][1:])
        is_mapping = kind in ("dict", "ordered", "plain", "frozen")
        if op == "add" and is_mapping and all(k != new_key for k, _ in node[1]):
            return (kind, list(node[1]) + [(new_key, ("int", "small"))])
        if op == "grow" and kind in ("list", "tuple"):
            return (kind, list(node[1]) + [("int", "small")])
        return new_leaf

    return lambda base: replace_at(base, path, make)


@st.composite
def batches(draw, with_ids=False):
    spec = draw(spec_strategy)
    if with_ids:
        spec = ("dict", [("id", ("int", "small")), ("payload", spec)])
    size = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**16))
    mutate = draw(mutation(spec))
    k = draw(st.integers(0, size - 1))
    specs = [spec] * size
    if mutate is not None:
        specs[k] = mutate(spec)
    note(f"specs: {specs}")
    batch = [build(s, i, seed) for i, s in enumerate(specs)]
    return batch, (k if mutate is not None and specs[k] != spec else None)


# ---------------------------------------------------------------------------------------------------
# The oracle.

def same(ours, theirs, path="batch"):
    """Equal structure, types, dtypes, shapes and values (NaN equal to NaN)."""
    assert type(ours) is type(theirs), f"{path}: {type(ours).__name__} != {type(theirs).__name__}"
    if ours is theirs:  # handed back as it came (inside a list of strings)
        return
    if isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype, f"{path}: dtype {ours.dtype} != {theirs.dtype}"
        assert ours.shape == theirs.shape, f"{path}: shape {ours.shape} != {theirs.shape}"
        assert ours.device == theirs.device and ours.requires_grad == theirs.requires_grad, path
        if theirs.device.type == "meta":
            return
        a, b = ours.detach().as_subclass(torch.Tensor), theirs.detach().as_subclass(torch.Tensor)
        wide_unsigned = a.dtype in (torch.uint16, torch.uint32, torch.uint64)
        if wide_unsigned or a.dtype.is_floating_point and a.itemsize == 1:
            a, b = a.to(torch.float64), b.to(torch.float64)
        if a.is_complex():
            a, b = (torch.view_as_real(t.resolve_conj().resolve_neg()) for t in (a, b))
        same_floats = a.is_floating_point() and torch.allclose(a, b, equal_nan=True, rtol=0, atol=0)
        assert torch.equal(a, b) or same_floats, f"{path}: values differ"
    elif isinstance(theirs, Mapping):
        assert list(ours.keys()) == list(theirs.keys()), f"{path}: keys differ"
        for key in theirs:
            same(ours[key], theirs[key], f"{path}.{key}")
    elif isinstance(theirs, Sequence) and not isinstance(theirs, (str, bytes)):
        assert len(ours) == len(theirs), f"{path}: lengths differ"
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            same(a, b, f"{path}[{index}]")
    elif isinstance(theirs, np.ndarray):  # inside a list of strings, handed back as it came
        assert ours is theirs or np.array_equal(ours, theirs), path
    else:
        both_nan = ours != ours and theirs != theirs
        assert ours is theirs or ours == theirs or both_nan, f"{path}: {ours!r} != {theirs!r}"


def slots_taken(stats):
    return stats.reuses + stats.slot_allocations + stats.overflow_allocations


def check_contract_error(error: ContractError, batch, mutated: int | None):
    text = str(error)
    assert error.field and repr(error.field) in text, f"the field is not named: {text}"
    assert error.position is not None and 0 <= error.position < len(batch), text
    assert f"batch position {error.position}" in text, text
    first = batch[error.position]
    if isinstance(first, Mapping) and isinstance(first.get("id"), int):
        assert error.sample_id == first["id"] and f"id={first['id']!r}" in text, text
    if mutated is not None:
        # Only sample `mutated` differs from the others: it is the one named, unless every sample is bad
        # (then sample 0 is), or sample 0 is the odd one (then sample 1 is named against it).
        assert error.position in {0, mutated} | ({1} if mutated == 0 else set()), text
    # It survives pickling (workers) and DataLoader's re-raise as type(error)(text).
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is type(error) and (clone.field, clone.position, clone.sample_id) == (
        error.field, error.position, error.sample_id)
    reraised = type(error)(f"Caught {type(error).__name__} in DataLoader worker process 0.\n"
                           f"Original Traceback (most recent call last):\n  ...\n{type(error).__module__}."
                           f"{type(error).__name__}: {text}\n")
    names = ("field", "position", "sample_id")
    assert [getattr(reraised, n) for n in names] == [getattr(error, n) for n in names], \
        f"re-raised fields lost: {reraised.field!r} {reraised.position!r} {reraised.sample_id!r} from {text}"


def run_both(batch, assembler, ring, mutated):
    try:
        expected, expected_error = default_collate(batch), None
    except Exception as error:  # noqa: BLE001 - any error default_collate raises is the reference
        expected, expected_error = None, error
    before = slots_taken(ring.stats())
    try:
        got = assembler(batch)
    except ContractError as error:
        note(f"assemble: {error!r}; default_collate: {expected_error!r}")
        assert slots_taken(ring.stats()) == before, "a failed batch took a staging slot"
        check_contract_error(error, batch, mutated)
        if expected_error is None:
            # Deliberate refusals: a key sample 0 lacks (default_collate drops it silently), and a sample
            # that is not a mapping (a sequence) where sample 0 is an empty one (default_collate never
            # looks at it, having no key to read).
            assert (isinstance(error, KeyError) and "sample 0 lacks it" in error.expected) or (
                isinstance(error, TypeError) and error.expected in ("a mapping (like sample 0)",
                                                                    "a sequence (like sample 0)")
            ), f"assemble refused what default_collate accepts: {error}"
        return
    except Exception as error:  # noqa: BLE001
        raise AssertionError(
            f"assemble raised a non-ContractError {error!r} (default_collate: {expected_error!r})"
        ) from error
    assert expected_error is None, f"assemble accepted what default_collate rejects ({expected_error!r})"
    same(got, expected)


@pytest.fixture(scope="module")
def ring():
    return StagingRing(max_slots=2)


@FUZZ
@given(data=batches())
def test_dropin_matches_default_collate_or_names_the_sample(data, ring):
    batch, mutated = data
    run_both(batch, assemble.using(ring=ring), ring, mutated)


@FUZZ
@given(data=batches(with_ids=True))
def test_errors_name_the_sample_by_id(data, ring):
    batch, mutated = data
    run_both(batch, assemble.using(ring=ring), ring, mutated)


@FUZZ
@given(data=batches())
def test_in_a_worker_the_batch_goes_to_shared_memory_with_the_same_result(data, monkeypatch_worker):
    batch, mutated = data
    with monkeypatch_worker:
        ring = StagingRing(max_slots=1)
        run_both(batch, assemble.using(ring=ring), ring, mutated)


class _PretendWorker:
    """Makes ``assemble`` believe it runs in a DataLoader worker (shared-memory output)."""

    def __enter__(self):
        self._saved = assemble_module.get_worker_info
        assemble_module.get_worker_info = lambda: object()

    def __exit__(self, *exc):
        assemble_module.get_worker_info = self._saved


@pytest.fixture(scope="module")
def monkeypatch_worker():
    return _PretendWorker()


# ---------------------------------------------------------------------------------------------------
# Contracts: a declared contract, batches that fit it or break it at one sample.

contract_tensor = st.tuples(
    st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                     torch.int8, torch.uint8, torch.bool, torch.uint16]),
    st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple),
    st.lists(st.booleans(), min_size=3, max_size=3),  # which dims are named
    st.one_of(st.none(), st.sampled_from([0, -1, 7, 1e10, float("nan"), True])),  # pad
    st.booleans(),  # a range
)


@st.composite
def contracted_batches(draw):
    n_fields = draw(st.integers(1, 4))
    fields, makers = {}, {}
    lengths_by_name = {}
    size = draw(st.integers(1, 5))
    for f in range(n_fields):
        path = draw(st.sampled_from([f"f{f}", f"meta.f{f}", f"{f}"]))
        path = f"g{f}." + path if path in fields or any(p.startswith(path + ".") for p in fields) else path
        kind = draw(st.sampled_from(["tensor", "tensor", "number", "text"]))
        if kind == "number":
            dtype = draw(st.sampled_from([torch.int64, torch.float64, torch.bool, torch.int8, torch.float16,
                                          torch.uint8, torch.float32]))
            rng = draw(st.one_of(st.none(), st.just((0, 10))))
            fields[path] = Field(kind="number", dtype=dtype, range=rng)
            makers[path] = ("number", dtype)
        elif kind == "text":
            fields[path] = Field(kind="text")
            makers[path] = ("text",)
        else:
            dtype, shape, named, pad, ranged = draw(contract_tensor)
            # Padded fields share dim names (T0 in two fields must agree within a sample); an unpadded
            # named dim is the same across the batch, and its own.
            dims = tuple((f"T{d}" if pad is not None else f"U{f}_{d}") if named[d] else size_
                         for d, size_ in enumerate(shape))
            if pad is not None and not any(isinstance(d, str) for d in dims):
                pad = None
            casts = draw(st.sampled_from([(), (torch.float32,), (torch.int64,)]))
            casts = tuple(c for c in casts if c != dtype)
            try:
                field = Field(dtype=dtype, shape=dims, pad=pad, cast_from=casts,
                              range=(0, 50) if ranged and dtype != torch.bool else None)
            except ValueError:
                continue
            fields[path] = field
            for d in dims:
                if isinstance(d, str) and d.startswith("T"):
                    lengths_by_name.setdefault(d, [draw(st.integers(0, 3)) for _ in range(size)])
                elif isinstance(d, str):
                    lengths_by_name.setdefault(d, [draw(st.integers(0, 3))] * size)
            makers[path] = ("tensor", dtype, dims, casts)
    # Every drawn field may be one its Field refuses (a NaN pad on an integer dtype, say): no contract then.
    assume(fields)
    try:
        contract = Contract(fields=fields, id=None)
    except ValueError:
        assume(False)
    # Containers: every path prefix must be a mapping; a path that is a prefix of another cannot be a leaf.
    assume(not any(other.startswith(p + ".") for p in fields for other in fields))
    seed = draw(st.integers(0, 2**16))
    bad = draw(st.one_of(st.none(), st.tuples(st.integers(0, size - 1), st.sampled_from(list(fields)),
                                               st.sampled_from(["dtype", "shape", "range", "type", "missing",
                                                                "extra", "none", "nan"]))))
    batch = []
    for i in range(size):
        sample: dict = {}
        for path, maker in makers.items():
            value = _contract_value(maker, i, seed, lengths_by_name)
            if bad is not None and bad[0] == i and bad[1] == path:
                broken = _break(maker, value, bad[2], i)
                if broken is value:  # this break does not apply to this field: nothing is wrong
                    bad = None
                value = broken
            if value is _MISSING:
                continue
            node = sample
            *parents, last = path.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
        if bad is not None and bad[0] == i and bad[2] == "extra":
            sample["unexpected"] = 1
        batch.append(sample)
    note(f"contract: {contract}\nbad: {bad}")
    return contract, batch, bad


_MISSING = object()


def _contract_value(maker, i, seed, lengths_by_name):
    generator = torch.Generator().manual_seed(seed + i)
    if maker[0] == "number":
        dtype = maker[1]
        if dtype == torch.bool:
            return i % 2 == 0
        if dtype.is_floating_point:
            return float(i % 10) + 0.5
        return int(i % 10)
    if maker[0] == "text":
        return f"t{i}"
    _, dtype, dims, casts = maker
    shape = tuple(lengths_by_name[d][i] if isinstance(d, str) else d for d in dims)
    source = casts[0] if casts and i % 2 else dtype
    values = torch.randint(0, 50, shape, generator=generator)
    return values.to(source)


def _break(maker, value, how, i):
    """Sample i's value for the field, broken as ``how`` says; ``value`` itself when that does not apply."""
    if how == "missing":
        return _MISSING
    if how == "none":
        return None
    if maker[0] != "tensor":
        if how == "type":
            return [value]
        if how == "range" and maker[0] == "number" and maker[1] != torch.bool:
            return 10**6 if not maker[1].is_floating_point else 1e6
        return value
    if how == "dtype" and maker[1] != torch.complex64:
        return value.to(torch.complex64)
    if how == "shape":
        return value.unsqueeze(0).expand(2, *value.shape)
    if how == "range" and value.is_floating_point() and value.numel():
        return value + 1000
    if how == "nan" and value.is_floating_point() and value.numel():
        value = value.clone()
        value.view(-1)[0] = float("nan")
        return value
    if how == "type":
        # Not value.tolist(): a tensor field that declares its dtype and shape takes a list of numbers.
        return f"{value.shape} as text"
    return value


def reference_contract_batch(contract, batch):
    """What the contract says the batch is: fields stacked (or padded) and cast, in Python."""
    out: dict = {}
    for path, field in contract.fields.items():
        values = []
        for sample in batch:
            node = sample
            for part in path.split("."):
                node = node[part]
            values.append(node)
        if field.kind == "text":
            result = {path: values}
        elif field.kind == "number":
            result = {path: torch.tensor(values, dtype=field.dtype)}
        elif field.pad is None:
            result = {path: torch.stack([v.to(field.dtype) for v in values])}
        else:
            named = [d for d, size in enumerate(field.shape) if isinstance(size, str)]
            longest = [max([v.shape[d] for v in values], default=0) for d in range(len(field.shape))]
            padded = torch.full((len(values), *longest), field.pad, dtype=field.dtype)
            mask = torch.zeros((len(values), *[longest[d] for d in named]), dtype=torch.bool)
            for i, v in enumerate(values):
                padded[(i, *[slice(0, s) for s in v.shape])] = v.to(field.dtype)
                mask[(i, *[slice(0, v.shape[d]) for d in named])] = True
            lengths = torch.tensor([[v.shape[d] for d in named] for v in values], dtype=torch.int64)
            parent = path.rpartition(".")[0]
            prefix = parent + "." if parent else ""
            result = {path: padded, prefix + contract.mask_key(path): mask}
            if contract.lengths_key(path):
                result[prefix + contract.lengths_key(path)] = lengths if len(named) > 1 else lengths[:, 0]
        out.update(result)
    return out


def flatten(batch, prefix="", out=None):
    out = {} if out is None else out
    for key, value in batch.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flatten(value, path + ".", out)
        else:
            out[path] = value
    return out


def _fits(value, dtype):
    """Whether ``dtype`` holds ``value`` (c10's rule: infinities and NaN fit floating types)."""
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point:
        return value != value or abs(value) == float("inf") or abs(value) <= torch.finfo(dtype).max
    return value == value and torch.iinfo(dtype).min <= value <= torch.iinfo(dtype).max


def _pad_fits(field):
    return field.pad is None or _fits(field.pad, field.dtype)


@FUZZ
@given(case=contracted_batches())
def test_contract_accepts_what_fits_and_names_what_does_not(case, ring):
    contract, batch, bad = case
    collate = assemble.using(contract, ring=ring)
    before = slots_taken(ring.stats())
    try:
        got = collate(batch)
    except ContractError as error:
        note(repr(error))
        assert slots_taken(ring.stats()) == before, "a failed batch took a staging slot"
        check_contract_error(error, batch, None)
        if "pad value" in error.expected:
            assert not _pad_fits(contract.fields[error.field]), repr(error)
        elif bad is not None and bad[2] != "extra":
            assert error.position == bad[0] and (error.field == bad[1] or error.field.startswith(bad[1] + ".")
                                                 or bad[1].startswith(error.field)), repr(error)
        else:
            # No sample broken: the only reason left is a pad value the dtype cannot hold.
            assert bad is not None or not all(_pad_fits(f) for f in contract.fields.values()), repr(error)
        return
    except Exception as error:  # noqa: BLE001
        raise AssertionError(f"a contract batch raised a non-ContractError {error!r}") from error
    must_refuse = ("dtype", "shape", "type", "missing", "extra", "none")
    if bad is not None and bad[2] == "range":
        field = contract.fields[bad[1]]
        ranged = field.range is not None or field.kind == "number" and not _fits(1e6, field.dtype)
        must_refuse = ("range",) if ranged else must_refuse
    if bad is not None and bad[2] == "nan":
        field = contract.fields[bad[1]]
        # NaN must not become an integer (C++ leaves that undefined); as a bool it is True (nonzero), as
        # torch casts, and a float stays NaN: those are refused only under a range.
        holds_nan = field.dtype.is_floating_point or field.dtype == torch.bool
        must_refuse = ("nan",) if field.range is not None or not holds_nan else must_refuse
    if bad is not None and bad[2] in must_refuse:
        raise AssertionError(f"the broken sample was accepted: {bad}")
    for field in contract.fields.values():
        assert _pad_fits(field) or field.pad is None, "an unrepresentable pad value was accepted"
    expected = reference_contract_batch(contract, batch)
    flat = flatten(got)
    assert list(sorted(flat)) == list(sorted(expected)), (sorted(flat), sorted(expected))
    for path in expected:
        same(flat[path], expected[path], path)


# ---------------------------------------------------------------------------------------------------
# Huge dims: a stride-0 expand() claims any size for no memory. A batch whose byte count does not fit in
# 64 bits is refused before anything is allocated, in the main process and in a worker alike.

def huge_shapes():
    """Per-sample shapes of 2**62 elements (or 2**63 - 1) in one to three dims: any batch of two is past
    2**63 bytes, while one sample's element count still fits in int64."""
    split = st.lists(st.integers(0, 62), min_size=0, max_size=2).map(sorted)
    as_dims = split.map(lambda cuts: [2 ** (b - a) for a, b in zip([0, *cuts], [*cuts, 62], strict=True)])
    return st.one_of(as_dims, st.just([2**63 - 1]), as_dims.map(lambda dims: [1, *dims, 1]))


@FUZZ
@given(
    dims=huge_shapes(),
    dtype=st.sampled_from([torch.uint8, torch.float32, torch.float64, torch.complex64]),
    count=st.integers(2, 5),
    nested=st.booleans(),
    in_worker=st.booleans(),
)
def test_huge_dims_are_refused_by_name_before_any_allocation(dims, dtype, count, nested, in_worker):
    leaf = torch.zeros(1, dtype=dtype).expand(*dims)
    batch = [{"id": i, "big": leaf} if nested else leaf for i in range(count)]
    ring = StagingRing(max_slots=1)
    with contextlib.ExitStack() as stack:
        if in_worker:
            stack.enter_context(_PretendWorker())
        with pytest.raises(ContractError) as caught:
            assemble.using(ring=ring)(batch)
    assert isinstance(caught.value, RuntimeError)  # where default_collate's torch.stack fails
    assert caught.value.field == ("big" if nested else "<sample>") and caught.value.position == 0
    assert slots_taken(ring.stats()) == 0


# ---------------------------------------------------------------------------------------------------
# The dispatcher ops: right inputs give torch's result, wrong ones a RuntimeError, never a crash.

@FUZZ
@given(
    dtype=st.sampled_from(TORCH_DTYPES[:11]),
    row=st.lists(st.integers(0, 4), max_size=3).map(tuple),
    count=st.integers(0, 5),
    wrong=st.sampled_from([None, "shape", "dtype", "count", "out_strided", "alias"]),
    strided=st.booleans(),
)
def test_stack_into_matches_torch_stack_or_refuses(dtype, row, count, wrong, strided):
    samples = [_tensor(dtype, row, "transposed" if strided and i % 2 else "contiguous",
                       torch.Generator().manual_seed(i), i) for i in range(count)]
    out = torch.zeros((count, *row), dtype=dtype)
    if wrong == "shape" and count:
        samples[-1] = torch.zeros((*row, 2), dtype=dtype)
    elif wrong == "dtype" and count:
        samples[-1] = samples[-1].to(torch.float64 if dtype != torch.float64 else torch.float32)
    elif wrong == "count":
        out = torch.zeros((count + 1, *row), dtype=dtype)
    elif wrong == "out_strided" and out.dim() >= 2 and out.shape[0] > 1 and out.shape[1] > 1 and out.numel():
        out = out.transpose(0, 1).contiguous().transpose(0, 1)
    elif wrong == "alias" and count and out.numel():
        samples[0] = out[0]
    else:
        wrong = None
    if wrong is None:
        ops.stack_into(samples, out)
        if count:
            same(out, torch.stack(samples))
        return
    with pytest.raises(RuntimeError):
        ops.stack_into(samples, out)


@FUZZ
@given(
    dtype=st.sampled_from([torch.float32, torch.int64, torch.uint8, torch.bool, torch.float16, torch.int32]),
    lengths=st.lists(st.integers(0, 5), min_size=0, max_size=5),
    inner=st.lists(st.integers(0, 3), max_size=2).map(tuple),
    extra=st.integers(0, 2),
    value=st.sampled_from([0, -1, 3, 1e10, float("nan")]),
    wrong=st.sampled_from([None, None, "long", "inner", "mask", "lengths", "dtype", "alias", "mask_alias"]),
)
def test_pad_into_matches_pad_sequence_or_refuses(dtype, lengths, inner, extra, value, wrong):
    samples = [torch.arange(n * int(np.prod(inner or (1,)))).reshape(n, *inner).to(dtype) for n in lengths]
    longest = max(lengths, default=0) + extra
    out = torch.empty((len(lengths), longest, *inner), dtype=dtype)
    mask = torch.empty((len(lengths), longest), dtype=torch.bool)
    lens = torch.empty(len(lengths), dtype=torch.int64)
    if wrong == "long" and lengths:
        out = torch.empty((len(lengths), max(lengths) - 1 if max(lengths) else 0, *inner), dtype=dtype)
        wrong = "long" if max(lengths) else None
        mask = torch.empty((len(lengths), out.shape[1]), dtype=torch.bool)
    elif wrong == "inner" and lengths:
        samples[0] = torch.zeros((lengths[0], *inner, 2), dtype=dtype)
    elif wrong == "mask":
        mask = torch.empty((len(lengths), longest + 1), dtype=torch.bool)
    elif wrong == "lengths":
        lens = torch.empty(len(lengths), dtype=torch.int32)
    elif wrong == "dtype" and lengths:
        samples[0] = samples[0].to(torch.float64)
    elif wrong == "alias" and lengths and lengths[0] and out[0].numel():
        samples[0] = out[0, : lengths[0]]
    elif wrong == "mask_alias" and dtype == torch.bool and mask.numel():
        out = mask.view(*mask.shape, *([1] * len(inner))).expand(out.shape) if not inner else out
        wrong = "mask_alias" if not inner else None
    else:
        wrong = None
    try:  # the op converts the pad value as torch.full does (-1 wraps to 255 in uint8; 300 is no int8)
        pad = torch.full((), value, dtype=dtype)
        representable = True
    except (RuntimeError, OverflowError):
        representable = False
    if wrong is None and representable:
        ops.pad_into(samples, value, out, mask, lens)
        assert lens.tolist() == lengths
        for i, n in enumerate(lengths):
            same(out[i, :n], samples[i], f"row {i}")
            assert mask[i, :n].all() and not mask[i, n:].any()
            if n < longest and out[i, n:].numel():
                pad = torch.tensor(value).to(dtype)
                assert torch.equal(out[i, n:], pad.expand_as(out[i, n:])) or (value != value), f"pad row {i}"
        return
    with pytest.raises(RuntimeError):
        ops.pad_into(samples, value, out, mask, lens)


@FUZZ
@given(
    shape=st.tuples(st.integers(0, 3), st.integers(1, 4), st.integers(0, 5), st.integers(0, 5)),
    channels=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    channels_last=st.booleans(),
    rank=st.sampled_from([4, 4, 4, 3]),
)
def test_normalize_images_matches_the_reference_or_refuses(shape, channels, dtype, channels_last, rank):
    images = torch.randint(0, 256, shape[:rank], dtype=torch.uint8)
    mean, std = torch.rand(channels), torch.rand(channels) + 0.5
    if rank != 4 or channels != shape[1]:
        with pytest.raises(RuntimeError):
            ops.normalize_images(images, mean, std, dtype, channels_last)
        return
    out = ops.normalize_images(images, mean, std, dtype, channels_last)
    reference = ((images.float() / 255 - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)).to(dtype)
    torch.testing.assert_close(out, reference, atol=1e-2, rtol=1e-2)
