"""assemble as a drop-in for default_collate: same structure, types, dtypes and values.

The cases follow PyTorch's own default_collate tests (test/test_dataloader.py, TestCollate /
TestDefaultCollate*): their semantics, written here for assemble.
"""

import collections
import json
import re
from collections import namedtuple
from collections.abc import Mapping, Sequence

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

import fastcollate
from fastcollate import Contract, ContractError, Field, assemble


def assert_same(ours, theirs, path="batch"):
    assert type(ours) is type(theirs), f"{path}: {type(ours).__name__} != {type(theirs).__name__}"
    if isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype, f"{path}: dtype {ours.dtype} != {theirs.dtype}"
        assert ours.shape == theirs.shape, f"{path}: shape {ours.shape} != {theirs.shape}"
        assert torch.equal(ours, theirs) or (
            ours.is_floating_point() and torch.allclose(ours, theirs, equal_nan=True)
        ), f"{path}: values differ"
    elif isinstance(theirs, Mapping):
        assert list(ours.keys()) == list(theirs.keys()), f"{path}: keys differ"
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{path}.{key}")
    elif isinstance(theirs, Sequence) and not isinstance(theirs, (str, bytes)):
        assert len(ours) == len(theirs), f"{path}: lengths differ"
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{path}[{index}]")
    else:
        assert ours == theirs, f"{path}: {ours!r} != {theirs!r}"


def check(batch):
    expected = default_collate(batch)
    got = assemble(batch)
    assert_same(got, expected)
    return got


Point = namedtuple("Point", ["x", "y"])


class UserDict(collections.UserDict):
    pass


class MyList(list):
    pass


class TupleOnlyFromArgs(Sequence):
    """A Sequence whose constructor does not take an iterable: default_collate falls back to a list."""

    def __init__(self, a, b):
        self._items = (a, b)

    def __getitem__(self, index):
        return self._items[index]

    def __len__(self):
        return 2


def test_tensor_leaves_stack_like_default_collate():
    check([torch.randn(3, 4) for _ in range(5)])


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
              torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]
)
def test_every_tensor_dtype_is_kept(dtype):
    samples = [torch.arange(6).reshape(2, 3).to(dtype) for _ in range(4)]
    got = check(samples)
    assert got.dtype == dtype


def test_zero_dim_tensors_become_a_vector():
    got = check([torch.tensor(float(i)) for i in range(7)])
    assert got.shape == (7,)


def test_zero_size_tensors():
    check([torch.empty(0, 3) for _ in range(4)])


def test_python_numbers_become_int64_float64_and_bool_tensors():
    assert check([1, 2, 3]).dtype == torch.int64
    assert check([1.5, 2.0, 3.25]).dtype == torch.float64
    assert check([True, False]).dtype == torch.bool


def test_mixed_python_numbers_follow_torch_tensor_inference():
    check([1, 2.5, 3])  # default_collate: torch.tensor -> float32
    check([1.5, 2, 3])  # float first: float64
    check([True, 1, 0])


def test_strings_and_bytes_stay_lists():
    assert check(["a", "b", "c"]) == ["a", "b", "c"]
    assert check([b"a", b"b"]) == [b"a", b"b"]


def test_a_list_of_strings_comes_back_as_the_same_list_object():
    batch = ["a", "b"]
    expected = default_collate(batch)
    ours = assemble(batch)
    assert expected is batch  # torch's rule: collate_str_fn returns the batch itself
    assert ours is batch and type(ours) is type(expected)


@pytest.mark.parametrize(
    "batch",
    [np.array(["a", "b", "c"]), np.array([b"a", b"b"]), np.array(["a", "b"], dtype=object)],
    ids=["str", "bytes", "object"],
)
def test_a_numpy_array_of_strings_comes_back_as_the_same_array_object(batch):
    expected = default_collate(batch)
    ours = assemble(batch)
    assert expected is batch
    assert ours is batch and type(ours) is type(expected) is np.ndarray


def test_nested_dicts_lists_tuples_and_namedtuples():
    batch = [
        {
            "id": i,
            "image": torch.full((2, 2), float(i)),
            "meta": {"name": f"s{i}", "boxes": torch.ones(3, 4) * i, "pair": (i, float(i))},
            "points": [Point(torch.tensor(i), i * 2.0), Point(torch.tensor(-i), 0.5)],
        }
        for i in range(6)
    ]
    got = check(batch)
    assert isinstance(got["meta"]["pair"], list)  # default_collate turns tuples into lists
    assert isinstance(got["points"][0], Point)


def test_mapping_and_sequence_subclasses_keep_their_type():
    check([UserDict({"a": torch.zeros(2), "b": 1}) for _ in range(3)])
    check([MyList([torch.zeros(2), 1]) for _ in range(3)])
    check([TupleOnlyFromArgs(torch.zeros(1), 2) for _ in range(3)])


def test_numpy_arrays_and_scalars():
    check([np.arange(6, dtype=np.float32).reshape(2, 3) for _ in range(4)])
    check([np.int16(3), np.int16(4)])
    check([np.float32(1.5), np.float32(2.5)])
    check([np.array(1.0), np.array(2.0)])
    check([np.bool_(True), np.bool_(False)])


def test_numpy_memmap(tmp_path):
    path = tmp_path / "data.bin"
    array = np.memmap(path, dtype=np.float64, mode="w+", shape=(4, 3))
    array[:] = np.arange(12).reshape(4, 3)
    array.flush()
    view = np.memmap(path, dtype=np.float64, mode="r", shape=(4, 3))
    check([view[i] for i in range(4)])


@pytest.mark.parametrize("bad", [np.array(["a", "b"]), np.array([b"a"]), np.array([object(), object()])])
def test_numpy_string_and_object_arrays_raise_type_error(bad):
    with pytest.raises(TypeError):
        default_collate([bad, bad])
    with pytest.raises(TypeError) as caught:
        assemble([bad, bad])
    assert isinstance(caught.value, ContractError)


def test_non_contiguous_and_channels_last_inputs():
    base = torch.randn(4, 3, 8, 8)
    check([base[i].transpose(1, 2) for i in range(4)])  # non-contiguous views
    check([base[i, :, ::2] for i in range(4)])  # strided
    images = [torch.randn(1, 3, 5, 5).contiguous(memory_format=torch.channels_last)[0] for _ in range(3)]
    check(images)
    check([torch.randn(2, 3, 5, 5).contiguous(memory_format=torch.channels_last) for _ in range(3)])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_multi_threaded_copy_of_many_fields_and_huge_rows(threads):
    # Past 1 MiB the copy is split across threads, rows over 1 MiB into pieces, and past 8 MiB it uses
    # streaming stores: every byte must land once, beside rows that need an ATen copy (non-contiguous)
    # and fields too small to split, whatever the alignment of sources, rows and pieces.
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        huge = [torch.randint(0, 255, (5 * 2**20 + 3,), dtype=torch.uint8, generator=g) for _ in range(3)]
        images = [torch.rand(3, 64, 64, generator=g) for _ in range(3)]
        images[1] = images[1].transpose(1, 2)  # this row goes through ATen
        batch = [
            {"huge": huge[i], "image": images[i], "small": torch.full((3,), float(i)), "id": i}
            for i in range(3)
        ]
        check(batch)
        check([torch.rand(300, 1000, generator=g) for _ in range(8)])  # 1.2 MB rows: one piece each
        # 12 MB of rows of an odd length, read from odd addresses (views into one buffer) and written
        # back to back (so most start off a 16-byte boundary).
        flat = torch.randint(0, 255, (41 * 300_011,), dtype=torch.uint8, generator=g)
        check([flat[i * 300_011 + 1 : i * 300_011 + 1 + 300_007] for i in range(40)])
    finally:
        torch.set_num_threads(previous)


def test_conjugate_and_negative_views_are_resolved():
    check([torch.randn(3, dtype=torch.complex64).conj() for _ in range(4)])


def test_mixed_dtypes_promote_as_default_collate_does():
    check([torch.ones(2, dtype=torch.int32), torch.ones(2, dtype=torch.float32)])


def test_tensors_that_require_grad_are_left_to_default_collate():
    batch = [torch.randn(3, requires_grad=True) for _ in range(3)]
    got = assemble(batch)
    assert got.requires_grad and torch.equal(got.detach(), torch.stack([b.detach() for b in batch]))


def test_tensor_subclasses_keep_default_collate_semantics():
    class Tagged(torch.Tensor):
        pass

    batch = [torch.randn(2).as_subclass(Tagged) for _ in range(3)]
    got = assemble(batch)
    assert torch.equal(got.as_subclass(torch.Tensor), default_collate(batch).as_subclass(torch.Tensor))


def test_output_tensors_are_contiguous_and_share_one_buffer():
    batch = [{"a": torch.randn(3), "b": torch.randn(2, 2), "c": i} for i in range(4)]
    got = assemble(batch)
    storages = {got[k].untyped_storage().data_ptr() for k in ("a", "b", "c")}
    assert len(storages) == 1  # one block: the whole batch can move as one copy
    assert all(got[k].is_contiguous() for k in ("a", "b", "c"))


def test_sizes_that_differ_raise_a_runtime_error_naming_sample_and_field():
    batch = [{"id": f"img-{i}", "x": torch.zeros(3, 4)} for i in range(4)]
    batch[2]["x"] = torch.zeros(3, 5)
    with pytest.raises(RuntimeError) as caught:
        assemble(batch)
    error = caught.value
    assert isinstance(error, ContractError)
    assert (error.sample_id, error.field, error.position) == ("img-2", "x", 2)
    assert "[3, 4]" in error.expected and "[3, 5]" in error.got
    assert "img-2" in str(error) and "'x'" in str(error)


def test_without_ids_the_error_names_the_position_and_says_how_to_add_ids():
    batch = [torch.zeros(2), torch.zeros(2), torch.zeros(3)]
    with pytest.raises(ContractError) as caught:
        assemble(batch)
    assert caught.value.sample_id is None and caught.value.position == 2
    assert "batch position 2" in str(caught.value) and "with_ids" in str(caught.value)


def test_errors_never_include_sample_values():
    secret = 987654.25
    batch = [{"id": i, "x": torch.full((2,), secret)} for i in range(3)]
    batch[1]["x"] = torch.full((3,), secret)
    with pytest.raises(ContractError) as caught:
        assemble(batch)
    assert "987654" not in str(caught.value)


def test_unsupported_leaf_raises_type_error_naming_the_field():
    batch = [{"id": i, "x": None} for i in range(3)]
    with pytest.raises(TypeError):
        default_collate(batch)
    with pytest.raises(TypeError) as caught:
        assemble(batch)
    assert caught.value.field == "x" and caught.value.sample_id == 0


def test_a_missing_key_raises_key_error_naming_the_sample():
    batch = [{"id": i, "x": torch.zeros(1), "y": 1} for i in range(3)]
    del batch[2]["y"]
    with pytest.raises(KeyError) as caught:
        assemble(batch)
    assert caught.value.sample_id == 2 and caught.value.field == "y"


def test_an_extra_key_is_an_error_not_silently_dropped():
    batch = [{"id": i, "x": torch.zeros(1)} for i in range(3)]
    batch[1]["z"] = 5
    assert "z" not in default_collate(batch)  # what we refuse to do: lose data silently
    with pytest.raises(KeyError) as caught:
        assemble(batch)
    assert caught.value.sample_id == 1 and caught.value.field == "z"


def records_with_keys_made_anew(count=4):
    """Dicts as json.loads hands them out record by record: equal keys, a new str object in each sample."""
    records = [json.loads(f'{{"id": {i}, "score": {i / 2}, "meta": {{"name": "r{i}", "tokens": [1, 2]}}}}')
               for i in range(count)]
    for record in records:
        # An f-string key ("pixels_0" in every sample, id % 1 being 0): a new str in every sample too.
        record[f"pixels_{record['id'] % 1}"] = torch.full((2, 3), float(record["id"]))
    assert records[0].keys() == records[1].keys()
    assert all(a is not b for a, b in zip(records[0], records[1], strict=True)), "keys must not be shared"
    return records


def test_keys_made_anew_in_every_sample_collate_as_shared_keys_do():
    records = records_with_keys_made_anew()
    got = check(records)
    shared_keys = [{key: record[key2] for key, key2 in zip(records[0], record, strict=True)}
                   for record in records]
    assert_same(got, assemble(shared_keys))
    assert all(a is b for a, b in zip(got, records[0], strict=True))  # the batch's keys are sample 0's


def test_keys_made_anew_in_another_order_are_looked_up():
    records = records_with_keys_made_anew()
    records[2] = dict(reversed(list(records[2].items())))
    check(records)


def test_keys_made_anew_name_the_sample_that_lacks_one_or_has_another():
    records = records_with_keys_made_anew()
    del records[2]["score"]
    with pytest.raises(KeyError) as caught:
        assemble(records)
    assert (caught.value.sample_id, caught.value.field) == (2, "score")
    records = records_with_keys_made_anew()
    records[3]["extra"] = 1
    with pytest.raises(KeyError) as caught:
        assemble(records)
    assert (caught.value.sample_id, caught.value.field) == (3, "extra")
    records = records_with_keys_made_anew()
    records[1]["scorE"] = records[1].pop("score")  # same length and count: only the characters differ
    with pytest.raises(KeyError) as caught:
        assemble(records)
    assert (caught.value.sample_id, caught.value.field) == (1, "score")


class FoldedKey(str):
    """A key equal to any other FoldedKey with the same characters in any case."""

    def __eq__(self, other):
        return isinstance(other, str) and self.lower() == other.lower()

    def __hash__(self):
        return hash(self.lower())


class NeverEqualKey(str):
    """A key equal to nothing but itself, whatever its characters."""

    def __eq__(self, other):
        return self is other

    __hash__ = str.__hash__


def test_str_subclass_keys_are_compared_by_their_own_eq():
    batch = [{FoldedKey("X"): torch.zeros(2), "id": 0}, {FoldedKey("x"): torch.ones(2), "id": 1}]
    got = check(batch)  # equal by FoldedKey.__eq__ only, as default_collate's lookup finds them
    assert type(next(iter(got))) is FoldedKey
    batch = [{NeverEqualKey("x"): torch.zeros(2), "id": 0}, {NeverEqualKey("x"): torch.ones(2), "id": 1}]
    with pytest.raises(KeyError):
        default_collate(batch)
    with pytest.raises(KeyError) as caught:
        assemble(batch)  # the same characters, but not equal: not matched by its characters
    assert (caught.value.sample_id, caught.value.field) == (1, "x")


def test_non_str_keys_made_anew_in_every_sample():
    # Parsed from text in each sample: equal keys, new objects.
    batch = [{int("100000000000000000000"): torch.full((2,), float(i)), ("pair", int("7")): i,
              float("2.5"): float(i)} for i in range(3)]
    assert all(a is not b for a, b in zip(batch[0], batch[1], strict=True))
    check(batch)


def test_sequences_of_different_lengths_raise_runtime_error():
    batch = [[torch.zeros(1), 1], [torch.zeros(1), 1, 2]]
    with pytest.raises(RuntimeError):
        default_collate(batch)
    with pytest.raises(RuntimeError) as caught:
        assemble(batch)
    assert isinstance(caught.value, ContractError) and caught.value.position == 1


PADDED_FIELD = re.compile(
    r"assemble\.using\(fastcollate\.Contract\(\{'(?P<key>[^']+)': "
    r"(?P<field>fastcollate\.Field\(.*\)), \.\.\.\}\)\)"
)


@pytest.mark.parametrize(
    ("batch", "declared"),
    [
        ([{"x": [1, 2, 3]}, {"x": [1]}], 'fastcollate.Field(dtype=torch.int64, shape=("T",), pad=0)'),
        ([{"x": [0.5]}, {"x": [0.5, 1.5]}], 'fastcollate.Field(dtype=torch.float64, shape=("T",), pad=0)'),
        ([{"id": i, "x": torch.ones(3 - i)} for i in range(2)],
         'fastcollate.Field(dtype=torch.float32, shape=("T",), pad=0)'),
        ([{"x": torch.ones(2, 3, dtype=torch.int32)}, {"x": torch.ones(2, 1, dtype=torch.int32)}],
         'fastcollate.Field(dtype=torch.int32, shape=(2, "T"), pad=0)'),
        ([{"x": torch.ones(4, 3)}, {"x": torch.ones(2, 1)}],
         'fastcollate.Field(dtype=torch.float32, shape=("T0", "T1"), pad=0)'),
    ],
    ids=["int-lists", "float-lists", "tensors-with-ids", "tensors-2d", "tensors-two-dims"],
)
def test_a_ragged_field_points_to_the_padded_field_that_takes_it(batch, declared):
    with pytest.raises(Exception) as theirs:
        default_collate(batch)
    with pytest.raises(ContractError) as caught:
        assemble(batch)
    error = caught.value
    # default_collate's class (RuntimeError): code that catches it around default_collate still works.
    assert isinstance(error, RuntimeError) and isinstance(error, type(theirs.value))
    assert (error.field, error.position) == ("x", 1)
    assert error.sample_id == (1 if "id" in batch[0] else None)
    if isinstance(batch[0]["x"], list):
        assert "Each element in list of batch should be of equal size" in str(error)  # default_collate's
    match = PADDED_FIELD.search(str(error))
    assert match and match["field"] == declared, str(error)
    # The declaration it gives pads this very batch.
    field = eval(match["field"], {"fastcollate": fastcollate, "torch": torch})  # noqa: S307 - our own message
    ids = {"id": Field(kind="number")} if "id" in batch[0] else {}
    padded = assemble.using(Contract({match["key"]: field, **ids}, id="id" if ids else None))(batch)
    assert padded["x_lengths"].shape[0] == 2 and not padded["x_mask"].all()


@pytest.mark.parametrize(
    "batch",
    [
        [torch.ones(2), torch.ones(3)],  # the sample itself: a padded field goes in a dict, beside its mask
        [[1, 2, 3], [1]],
        [{"x": torch.ones(2, 3)}, {"x": torch.ones(2)}],  # another rank: no padding makes it fit
        [{"x": ["a", "b"]}, {"x": ["a"]}],  # strings: no padded field takes them
    ],
    ids=["tensor-samples", "list-samples", "other-rank", "strings"],
)
def test_a_misfit_no_padding_takes_suggests_none(batch):
    with pytest.raises(RuntimeError) as caught:
        assemble(batch)
    assert isinstance(caught.value, ContractError) and "Field(" not in str(caught.value)


def test_a_different_type_in_a_later_sample_is_named():
    batch = [{"id": i, "x": torch.zeros(2)} for i in range(3)]
    batch[2]["x"] = [0.0, 0.0]
    with pytest.raises(TypeError) as caught:
        assemble(batch)
    assert caught.value.sample_id == 2 and caught.value.field == "x"


def test_integer_overflow_is_named_and_raises_what_default_collate_raises():
    batch = [{"id": 0, "n": 1}, {"id": 1, "n": 2**70}]
    with pytest.raises(Exception) as theirs:
        default_collate(batch)
    with pytest.raises(ContractError) as caught:
        assemble(batch)
    assert isinstance(caught.value, type(theirs.value))
    assert caught.value.sample_id == 1 and caught.value.field == "n"


def test_empty_batch_raises_index_error_like_default_collate():
    with pytest.raises(IndexError):
        default_collate([])
    with pytest.raises(IndexError) as caught:
        assemble([])
    assert isinstance(caught.value, ContractError)


def test_an_error_leaves_nothing_half_written():
    from fastcollate.transfer.staging import main_process_ring

    ring = main_process_ring()
    before = ring.stats()
    batch = [{"id": i, "x": torch.zeros(1000)} for i in range(4)]
    batch[3]["x"] = torch.zeros(999)
    with pytest.raises(ContractError):
        assemble(batch)
    after = ring.stats()
    # The check failed before any buffer was taken: no slot was handed out.
    assert (after.reuses, after.slot_allocations, after.overflow_allocations) == (
        before.reuses, before.slot_allocations, before.overflow_allocations)


def test_ids_read_from_a_configured_key():
    assembler = assemble.using(id_key="uid")
    batch = [{"uid": f"u{i}", "x": torch.zeros(2)} for i in range(3)]
    batch[1]["x"] = torch.zeros(4)
    with pytest.raises(ContractError) as caught:
        assembler(batch)
    assert caught.value.sample_id == "u1"


def test_contract_error_pickles_with_its_attributes():
    import pickle

    batch = [{"id": 7, "x": torch.zeros(2)}, {"id": 8, "x": torch.zeros(3)}]
    with pytest.raises(ContractError) as caught:
        assemble(batch)
    clone = pickle.loads(pickle.dumps(caught.value))
    assert type(clone) is type(caught.value)
    original = caught.value
    assert (clone.sample_id, clone.field) == (8, "x")
    assert (clone.expected, clone.got) == (original.expected, original.got)
    assert str(clone) == str(caught.value)


@pytest.mark.parametrize(
    ("raised", "kind"),
    [
        (TypeError, "type"), (KeyError, "key"), (IndexError, "empty"), (ValueError, "value"),
        (RuntimeError, "size"), (NotImplementedError, "size"), (OverflowError, "size"),
    ],
)
def test_one_table_gives_each_builtin_error_its_kind_and_class(raised, kind):
    from fastcollate.collate.errors import ERROR_KINDS, kind_of, make_error

    assert kind_of(raised("boom")) == kind
    error = make_error(kind, [{"id": 7}], 0, "x", "this", "that", "", "id")
    assert type(error) is ERROR_KINDS[kind] and isinstance(error, ContractError)
    if kind != "size":  # the fallback kind stands for RuntimeError, not for whatever matched nothing
        assert isinstance(error, raised)
    assert error.sample_id == 7 and error.field == "x"


class _RaisesWhenRead:
    """A sample that torch.as_tensor cannot read: its length raises ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __len__(self) -> int:
        raise self.error

    def __getitem__(self, index: int):
        raise self.error


class _ValueAndKeyError(ValueError, KeyError):
    pass


@pytest.mark.parametrize(
    "error", [np.exceptions.AxisError("axis 2 is out of bounds"), _ValueAndKeyError("both")],
    ids=["numpy AxisError (ValueError and IndexError)", "ValueError and KeyError"],
)
def test_an_error_of_two_builtin_classes_is_a_value_error_on_both_paths(error):
    # The native walk (torch.as_tensor refusing a sample) and the Python table agree: a ValueError that
    # is also an IndexError or a KeyError is a bad value, not an empty batch or a missing key.
    from fastcollate.collate.errors import kind_of

    assert kind_of(error) == "value"
    with pytest.raises(ContractError) as caught:
        assemble([np.zeros(2), _RaisesWhenRead(error)])
    assert type(caught.value).__name__ == "ContractValueError" and caught.value.position == 1


@pytest.mark.parametrize(("later", "raised"), [("x", TypeError), (None, RuntimeError)])
def test_a_torch_refusal_in_the_native_walk_keeps_its_builtin_class(later, raised):
    # After sample 0's numpy array each sample goes through torch.as_tensor, which refuses "x" with a
    # TypeError and None with a RuntimeError: the walk asks fastcollate.collate.errors for the kind.
    with pytest.raises(ContractError) as caught:
        assemble([np.zeros(2), later])
    assert isinstance(caught.value, raised) and caught.value.position == 1
    assert raised.__name__ in caught.value.got
