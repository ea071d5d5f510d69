"""Arrays: a dataset over columns that already hold every sample (tensors, numpy arrays, memory-mapped
files, ragged ``(values, offsets)`` pairs), and the lazy batch its ``__getitems__`` returns.

DataLoader calls ``__getitems__(indices)`` when a dataset has it. The batch that returns is a list of
the samples, made when first read, so ``default_collate`` and any other collate function get what they
always got; ``fastcollate.assemble`` recognizes it and gathers each column by index in C++
(fastcollate.collate.gather) instead of building and walking one object per sample.
"""

from __future__ import annotations

import os
import threading
import types
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .._ext import _C
from .arguments import index_out_of_range
from .columns import Column, column_over
from .mapped_files import MappedFileError, is_read_fault
from .touched_files import FilesOfRows

__all__ = ["ArrayBatch", "Arrays", "renamed_index_as"]

# Which columns of a table: every one, some by name, or {key: column name}.
ColumnChoice = Sequence[str] | Mapping[str, str] | None
# Arrays.from_hf and from_arrow, by name: fastcollate.data.arrow_columns, which subclasses Arrays, puts
# them here when the data package loads it, so this module needs nothing of Arrow.
ARROW_FACTORIES: dict[str, Any] = {}

_UNTRACED = (
    "the column lies in a mapped file that fastcollate does not check (a torch tensor over a mapping, or a "
    "copy-on-write mode='c' np.memmap): pass an np.memmap opened with mode='r' (or 'r+'), whose file is "
    "checked before every read"
)


NOT_GIVEN: Any = object()  # an argument left out, where None means something


def renamed_index_as(who: str, index_as: str | None, id_key: Any) -> str | None:
    """``index_as``, or what was given by its old name, ``id_key``, with a warning that says what changed."""
    if id_key is NOT_GIVEN:
        return index_as
    if index_as is not None:
        raise TypeError(f"{who}: give index_as alone (id_key is its old name)")
    warnings.warn(
        f"{who}: id_key= is now index_as=, the key each sample's index goes under (it never named an id "
        "column: a column is taken as the id by assemble.using(id_key=...)). Left out, no index is added, "
        "for Arrays, from_hf and from_arrow alike",
        FutureWarning,
        stacklevel=3,
    )
    return id_key


def _refuse_index_over_a_column(index_as: str | None, columns: Mapping[str, Any]) -> None:
    if index_as is not None and index_as in columns:
        raise ValueError(
            f"Arrays: index_as={index_as!r} puts each sample's index under a column's key: "
            "leave index_as out to keep the column (assemble.using(id_key=...) takes it as the id), or "
            "give the index another key"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))



class Arrays(Dataset):
    """A map-style dataset over named columns that share a leading sample dim.

    ``Arrays(image=u8, label=labels)``: ``ds[i]`` is ``{"image": u8[i], "label": labels[i]}``
    (tensors, whatever the column's type). With ``fastcollate.assemble`` as the collate function, a
    batch is gathered column by column in C++ straight into the memory it goes out in, with no object
    per sample; any other collate function gets the same samples as from ``ds[i]``.

    Args:
        columns: name to column, in the order the samples hold them (also accepted as keywords). A
            column is a tensor, a numpy array, an ``np.memmap`` (pickled as its file: a spawned worker
            maps it again rather than receiving its bytes), or ``Ragged(values, offsets)``.
        index_as: the key each sample's index goes under, as its id (``index_as="id"``: ``ds[i]["id"]``
            is ``i``); None, the default, adds none. ``fastcollate.with_ids(ds)`` adds it too.
    """

    def __init__(
        self,
        columns: Mapping[str, Any] | None = None,
        /,
        *,
        index_as: str | None = None,
        id_key: Any = NOT_GIVEN,
        **named: Any,
    ) -> None:
        index_as = renamed_index_as("Arrays", index_as, id_key)
        given = {**(columns or {}), **named}
        if not given:
            raise ValueError("Arrays: give at least one column, e.g. Arrays(image=images, label=labels)")
        _refuse_index_over_a_column(index_as, given)
        self.index_as = index_as
        # Read-only: assemble keeps each batch size's layout, which names these columns.
        columns = {name: column_over(name, value) for name, value in given.items()}
        self.columns = types.MappingProxyType(columns)
        lengths = {name: len(column) for name, column in self.columns.items()}
        if len(set(lengths.values())) > 1:
            described = ", ".join(f"{name!r}: {n}" for name, n in lengths.items())
            raise ValueError(f"Arrays: columns must have the same number of rows, got {described}")
        self._length = next(iter(lengths.values()))
        self.rows_of: torch.Tensor | None = None  # sample i is row rows_of[i] of every column, if set

    @classmethod
    def from_hf(
        cls,
        dataset: Any,
        columns: ColumnChoice = None,
        *,
        index_as: str | None = None,
        stored_dtypes: bool = False,
        id_key: Any = NOT_GIVEN,
    ) -> Arrays:
        """The columns of a Hugging Face ``datasets.Dataset``, read where they lie in its Arrow files (no
        copy of their values), sample ``i`` being row ``dataset[i]`` (through ``select``, ``shuffle``,
        ``shard``, ``train_test_split``). ``columns``: None for every column ``dataset[i]`` holds, a list
        of names, or ``{key: column}`` (one column under two keys reads the same bytes). ``list`` columns
        become ragged, fixed-size lists and ``Array2D``..``Array5D`` rows of that shape, scalars 1-D.

        Rows come in the dtypes Hugging Face hands out: with no format, those its collators make of the
        rows (integers as int64, floats as float32, cast as the batch is gathered); with
        ``with_format("torch")`` or ``"numpy"``, the format's. ``stored_dtypes=True`` hands out the
        stored ones instead. ``index_as``: as in :class:`Arrays`.

        Pickled, it is the dataset's (which reopens its files by path), so spawned workers map the files
        again. See fastcollate.data.arrow_columns."""
        index_as = renamed_index_as("Arrays.from_hf", index_as, id_key)
        return ARROW_FACTORIES["from_hf"](dataset, columns, index_as=index_as, stored_dtypes=stored_dtypes)

    @classmethod
    def from_arrow(
        cls, table: Any, columns: ColumnChoice = None, *, index_as: str | None = None, id_key: Any = NOT_GIVEN
    ) -> Arrays:
        """The columns of a ``pyarrow.Table``, or of the Arrow IPC file at a path (memory-mapped, and
        pickled as its path), read where they lie, chunk by chunk, in their stored dtypes. Columns map as
        in :meth:`from_hf`; ``index_as`` as in :class:`Arrays`."""
        index_as = renamed_index_as("Arrays.from_arrow", index_as, id_key)
        return ARROW_FACTORIES["from_arrow"](table, columns, index_as=index_as)

    def indexed_as(self, key: str) -> Arrays:
        """The same dataset over the same columns, each sample with its index under ``key``."""
        _refuse_index_over_a_column(key, self.columns)
        indexed = object.__new__(type(self))  # not copy.copy: subclasses pickle as how they are made again
        indexed.__dict__.update(self.__dict__, index_as=key)
        return indexed

    @property
    def id_key(self) -> str | None:
        """The old name of :attr:`index_as`."""
        return self.index_as

    def __len__(self) -> int:
        return self._length

    def __getstate__(self) -> dict:
        state = {**self.__dict__, "columns": dict(self.columns)}  # a mappingproxy does not pickle
        state.pop("_files_of_rows", None)  # found again from the columns, as they are mapped there
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, columns=types.MappingProxyType(state["columns"]))

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = self._checked(index)
        self.check_files(index)
        return self._handed_out([self._sample(index)])[0]

    def _handed_out(self, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Samples as ``ds[i]`` hands them out: views of the columns in memory, and copies of the rows
        that lie in mapped files, read under the guard that turns a read past a shrunk file's end into
        MappedFileError (a view read later, by default_collate or a model, would die of SIGBUS instead)."""
        return self._copied(samples, [name for name in self.columns if self._sources_of(name)])

    def _copied(self, samples: list[dict[str, Any]], keys: list[str]) -> list[dict[str, Any]]:
        """``samples`` with the rows of ``keys`` copied under the mapped-read guard, in one native call,
        and cast to the dtype their column's samples hold (Column.dtype)."""
        if not keys:
            return samples
        try:
            copies = iter(_C.guarded_copies([sample[key] for sample in samples for key in keys]))
        except RuntimeError as error:
            if is_read_fault(error):
                raise self.read_fault(error) from error
            raise
        casts = [self.columns[key].dtype for key in keys]
        out = []
        for sample in samples:
            copied = dict(sample)
            for key, dtype in zip(keys, casts, strict=True):
                copy = next(copies)
                copied[key] = copy if dtype is None else copy.to(dtype)
            out.append(copied)
        return out

    def _sample(self, index: int) -> dict[str, Any]:
        """Sample ``index`` (in range), its files already checked."""
        sample: dict[str, Any] = {} if self.index_as is None else {self.index_as: index}
        row = index if self.rows_of is None else int(self.rows_of[index])
        for name, column in self.columns.items():
            sample[name] = column.row(row)
        return sample

    def __getitems__(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> ArrayBatch:
        return ArrayBatch.of(self, indices)

    def check_files(self, indices: int | np.ndarray | None = None) -> None:
        """Raises MappedFileError if a memory-mapped column's file shrank or, in a process that mapped
        it again, is not the file the dataset was made from (see Column.check_file). Every read checks
        first: ``ds[i]``, and each batch, gathered or walked. ``indices``: the samples about to be read
        (a sample, or int64 indices in range), whose rows' files alone are checked; None: every file."""
        files = self.__dict__.get("_files_of_rows")
        if files is None:  # found once the columns are final (from_hf watches their files after __init__)
            files = self._files_of_rows = FilesOfRows(self.columns)
        files.check(indices, self.rows_of)

    def read_fault(self, error: RuntimeError, column: str | None = None) -> MappedFileError:
        """The error for a read that faulted (``error``) while a batch was copied, ``column``'s when the
        gather knows it: the file that cannot be read now, else every file the dataset maps."""
        where = f"Arrays: column {column!r}: " if column is not None else "Arrays: "
        files = self._file_columns() if column is None else self._sources_of(column)
        if not files:
            return MappedFileError(f"{where}a read faulted ({error}): {_UNTRACED}")
        reasons = [f"column {c.name!r}: {why}" for c in files if (why := c.unreadable())]
        if not reasons:
            names = ", ".join(repr(c.name) for c in files)
            reasons = [f"the file of {names} was truncated or rewritten during the copy, and has grown back"]
        return MappedFileError(
            f"{where}a read past the end of a mapped file faulted while the batch was copied, and nothing of "
            f"the batch was handed out ({'; '.join(reasons)})"
        )

    def _file_columns(self) -> list[Column]:
        return [column for column in self.columns.values() if column.on_disk()]

    def _sources_of(self, name: str) -> list[Column]:
        """The file-backed columns whose bytes column ``name`` reads."""
        column = self.columns[name]
        return [column] if column.on_disk() else []

    def _checked(self, index: Any) -> int:
        if isinstance(index, torch.Tensor):
            if index.dim() or index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
                # int() would truncate 3.7 to 3, read True as 1, and take [4] as 4: another sample, silently
                raise TypeError(
                    f"Arrays: an index must be an int, got a {index.dtype} tensor of shape "
                    f"{tuple(index.shape)}: index with an integer scalar, or pass a batch to __getitems__"
                )
            index = int(index)
        elif isinstance(index, np.integer):
            index = int(index)
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"Arrays: an index must be an int, got {type(index).__name__}")
        if not -self._length <= index < self._length:
            raise index_out_of_range(index, self._length)
        return index + self._length if index < 0 else index  # counted from the end, as in Python and HF


class _Unread:
    """What an ArrayBatch's list holds until its samples are read through its methods. C code that reads a
    list's items directly, bypassing a subclass's methods, meets this instead of an empty list: whatever
    is done with it, as with a sample, raises saying what to do."""

    __slots__ = ()

    def _refuse(self, *args: Any) -> Any:
        raise RuntimeError(
            "fastcollate.Arrays: a batch's samples were read past the list's own methods (by C code "
            "that indexes a list directly); call list(batch) first to get them"
        )

    # Special methods are looked up on the type, never through __getattr__.
    __getattr__ = __getitem__ = __iter__ = __len__ = __contains__ = _refuse

    def __repr__(self) -> str:
        return "<sample not read yet>"


def _index_array(indices: Any, length: int) -> np.ndarray:
    """``indices`` of any other kind than a sampler's list or an int64 array, as an integer array, refused
    if it is none (``length``: the dataset's, to name an index beyond int64)."""
    array = np.asarray(indices)
    if array.dtype == object and array.ndim == 1 and all(_is_int(i) for i in array):
        # Python ints beyond int64: numpy keeps them as objects
        beyond = next((int(i) for i in array if not -(2**63) <= i < 2**63), None)
        if beyond is not None:
            raise index_out_of_range(beyond, length)
    if array.dtype == np.uint64 and array.size and array.max() > np.iinfo(np.int64).max:
        raise index_out_of_range(int(array.max()), length)
    if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise TypeError(
            f"Arrays: a batch of indices must be a 1-D sequence of ints, got {array.dtype} of "
            f"shape {array.shape}"
        )
    return array


_UNREAD = _Unread()
_FILLING = threading.Lock()  # held only to put the samples in a batch's list, never while making them


def _unlocked_after_fork() -> None:
    # A process forked while another thread held the lock would wait forever on its first read.
    global _FILLING
    _FILLING = threading.Lock()


os.register_at_fork(after_in_child=_unlocked_after_fork)


class ArrayBatch(list):
    """The samples ``indices`` of an Arrays dataset, made on the first read: ``assemble`` gathers the
    columns instead, and never makes them. A list, as DataLoader's batches of samples are: collate
    functions (Hugging Face's, many users') tell a batch of samples from one sample by
    ``isinstance(batch, (list, tuple))``. ``indices`` is an int64 array, checked against the dataset's
    length here."""

    __slots__ = ("dataset", "index_tensor", "indices", "read")

    def __init__(self, samples: Iterable[Any] = ()) -> None:
        # A list of ``samples``, as list(samples) is: code that moves or detaches a batch rebuilds a list
        # as its own type (Lightning's apply_to_collection, accelerate's send_to_device, transformers'
        # nested_detach), over a batch a collate handed on as it got it. Arrays' batches are made by `of`.
        list.__init__(self, samples)
        self.read = True  # whether the list holds the samples (made by a read, maybe changed since)
        self.dataset = self.indices = self.index_tensor = None

    @classmethod
    def of(cls, dataset: Arrays, indices: Sequence[int] | np.ndarray | torch.Tensor) -> ArrayBatch:
        """The batch of samples ``indices`` of ``dataset``, none made yet."""
        batch = list.__new__(cls)
        batch.read = False
        if type(indices) is list:  # a DataLoader sampler's batch: read in one native pass, a copy of its own
            read = _C.indices_of_list(indices)
            if read is not None:
                batch._take_indices(dataset, read.numpy(), read)
                return batch
        if type(indices) is torch.Tensor:
            indices = indices.numpy()
        if type(indices) is np.ndarray and indices.dtype == np.int64 and indices.ndim == 1:
            batch._take_indices(dataset, indices.copy())  # IndexBatches' batches: a copy of its own, as below
            return batch
        batch._checked_indices(dataset, _index_array(indices, len(dataset)))
        return batch
    def _checked_indices(self, dataset: Arrays, indices: np.ndarray) -> None:
        # The batch's own copy: the caller's array changed after this check must not move a read. One
        # native pass checks it, no numpy reductions: a batch costs microseconds, and numpy's machinery
        # run between two gathers costs more than its work.
        self._take_indices(dataset, np.array(indices, dtype=np.int64, order="C", copy=True))

    def _take_indices(
        self, dataset: Arrays, indices: np.ndarray, index_tensor: torch.Tensor | None = None
    ) -> None:
        """Takes ``indices`` (int64, contiguous, the batch's own; ``index_tensor``: a tensor over them, if
        made) after checking them against ``dataset``."""
        self.indices = indices
        self.index_tensor = torch.from_numpy(indices) if index_tensor is None else index_tensor
        # Negative indices count from the end, as in Python and Hugging Face's __getitems__.
        first = _C.wrap_negative_indices(self.index_tensor, len(dataset))
        if first >= 0:
            raise index_out_of_range(int(indices[first]), len(dataset))
        self.dataset = dataset
        # len() is the list's own, right before any read. One placeholder repeated in place: the cheapest
        # way to fill a list of n (extending it from an iterator costs twice as much, at 256 samples).
        list.append(self, _UNREAD)
        list.__imul__(self, len(indices))

    def rows(self) -> ArrayBatch:
        """The batch with its samples made, as ``ds[i]`` hands them out, all at once: the files of their rows
        checked once, not once a sample, and the rows in mapped files copied in one guarded call."""
        if not self.read:
            self.dataset.check_files(self.indices)
            samples = self.dataset._handed_out([self.dataset._sample(int(i)) for i in self.indices])
            with _FILLING:  # threads that read at once all get the samples of the first to fill the list
                if not self.read:
                    list.__setitem__(self, slice(None), samples)
                    self.read = True
        return self

    def __radd__(self, other: Any) -> Any:
        # `rows + batch`: Python asks this first (a subclass of the left operand's type), then falls back
        # to list concatenation, which reads the items past the list's methods: made here, before it.
        # NotImplemented, not a new list: `rows += batch` then still extends `rows` in place.
        self.rows()
        return NotImplemented

    def __reduce__(self) -> tuple:
        return (list, (list(self.rows()),))  # the samples, not the dataset they came from


def _reading_first(name: str) -> Any:
    method = getattr(list, name)

    def read_first(self: ArrayBatch, *args: Any, **kwargs: Any) -> Any:
        return method(self.rows(), *args, **kwargs)

    read_first.__name__ = read_first.__qualname__ = name
    read_first.__doc__ = method.__doc__
    return read_first


# Every list method that reads or changes the items reads the samples first (len() needs none).
for _name in (
    "__getitem__", "__iter__", "__reversed__", "__contains__", "__repr__", "__eq__", "__ne__", "__lt__",
    "__le__", "__gt__", "__ge__", "__add__", "__mul__", "__rmul__", "__iadd__", "__imul__", "__setitem__",
    "__delitem__", "append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "index",
    "count", "copy",
):
    setattr(ArrayBatch, _name, _reading_first(_name))
