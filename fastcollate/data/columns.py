"""Columns as the gather reads them: ``Ragged`` (variable-length rows stored flat), ``Chunked`` (a column
in pieces, as Arrow and shard files keep one), and ``Column``, which checks a column once when it is made
and knows the files it lies in."""

from __future__ import annotations

import bisect
import copy
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .mapped_files import MappedFile

__all__ = ["Chunked", "Column", "Ragged"]


class Ragged:
    """A column of variable-length rows stored flat, as tokenized text is: row ``i`` is
    ``values[offsets[i]:offsets[i + 1]]``. ``offsets`` has one entry more than there are rows, starts at
    0 and never decreases."""

    def __init__(self, values: Any, offsets: Any) -> None:
        self.values = values
        self.offsets = offsets


class Chunked:
    """A column stored in pieces that hold its rows in order, read where they are with nothing
    concatenated: the chunks of an Arrow column, or one array (or ``Ragged``) per shard file. Every piece
    is of one kind (arrays, or Ragged), with one dtype and the same dims after the first."""

    def __init__(self, pieces: Sequence[Any]) -> None:
        self.pieces = list(pieces)


class Column:
    """One column as the gather reads it: ``rows`` (a tensor whose dim 0 is the sample, each row
    contiguous), or a ragged pair (``values``, ``offsets``); or, made from ``Chunked``, ``parts``, one
    such column for each piece. ``files`` names those of them that lie in memory-mapped files
    (fastcollate.data.mapped_files): they are read through the column's own mapping, pickle as their file,
    and a file that shrank or was replaced is caught before anything reads it; ``watched`` are the
    files another library mapped (an Arrow file), checked the same way (a Chunked column's: its parts',
    each part listing those it reads). The offsets are the column's own copy: they were checked when the
    column was made, and a caller's array changed later must not change the rows."""

    def __init__(self, name: str, value: Any) -> None:
        self.name = name
        self.rows: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.offsets: torch.Tensor | None = None
        self.files: dict[str, MappedFile] = {}
        self.watched: list[Any] = []
        self.parts: list[Column] | None = None
        self.starts: list[int] = []  # each part's first row
        # The dtype a sample holds when it is not the stored one (a Hugging Face format widens integers to
        # int64): rows handed out are cast to it, and the gather casts while it copies.
        self.dtype: torch.dtype | None = None
        if isinstance(value, Chunked):
            self._take_parts(value.pieces)
            return
        if isinstance(value, Ragged):
            self.values = self._tensor("values", value.values)
            offsets = self._tensor("offsets", value.offsets)
            if self.values.dim() < 1 or not self.values.is_contiguous():
                raise ValueError(
                    f"Arrays: column {name!r}: ragged values must be a contiguous array with a leading "
                    f"dim, got shape {tuple(self.values.shape)}"
                )
            if offsets.dim() != 1 or len(offsets) < 1:
                raise ValueError(
                    f"Arrays: column {name!r}: offsets must be 1-D with one entry more than rows"
                )
            if offsets.dtype == torch.bool or offsets.dtype.is_floating_point or offsets.dtype.is_complex:
                raise TypeError(
                    f"Arrays: column {name!r}: offsets must be integers, got {offsets.dtype} (a row "
                    "starts at a whole position)"
                )
            self.offsets = offsets.to(torch.int64, copy=True).contiguous()
            self.files.pop("offsets", None)  # a copy in memory, no longer the file's
            steps = self.offsets.diff()
            if (
                int(self.offsets[0]) != 0
                or int(self.offsets[-1]) != len(self.values)
                or bool((steps < 0).any())
            ):
                raise ValueError(
                    f"Arrays: column {name!r}: offsets must start at 0, never decrease and end at "
                    f"len(values) ({len(self.values)})"
                )
            return
        rows = self._tensor("rows", value)
        if rows.dim() < 1:
            raise ValueError(f"Arrays: column {name!r} is 0-d: a column needs a leading sample dim")
        if not _rows_contiguous(rows):
            raise ValueError(
                f"Arrays: column {name!r} (shape {tuple(rows.shape)}, strides {rows.stride()}) has rows that "
                "are not contiguous in memory, so a row cannot be copied as one block: pass a contiguous "
                "copy (np.ascontiguousarray or tensor.contiguous()), made once"
            )
        self.rows = rows

    def _take_parts(self, pieces: list[Any]) -> None:
        if not pieces:
            raise ValueError(f"Arrays: column {self.name!r}: Chunked needs at least one piece")
        if any(isinstance(piece, Chunked) for piece in pieces):
            raise TypeError(f"Arrays: column {self.name!r}: a piece of a Chunked column cannot be Chunked")
        self.parts = [Column(self.name, piece) for piece in pieces]
        first = self.parts[0]
        for number, part in enumerate(self.parts):
            if part.ragged != first.ragged or part.first.dtype != first.first.dtype or (
                part.first.shape[1:] != first.first.shape[1:]
            ):
                raise ValueError(
                    f"Arrays: column {self.name!r}: piece {number} ({_described(part)}) differs from piece 0 "
                    f"({_described(first)})"
                )
        starts = np.cumsum([0] + [len(part) for part in self.parts])
        self.starts, self._length = starts[:-1].tolist(), int(starts[-1])
        # Listed once: every batch checks them, and a column may come in thousands of pieces.
        self._part_files = [mapped for part in self.parts for mapped in part.files.values()]

    @property
    def chunks(self) -> list[Column]:
        """The column's pieces, each with ``rows`` or ``values`` and ``offsets``: itself when in one."""
        return self.parts if self.parts is not None else [self]

    @property
    def ragged(self) -> bool:
        return self.chunks[0].rows is None

    @property
    def first(self) -> torch.Tensor:
        """The first piece's rows or values: their dtype and inner dims are every piece's."""
        chunk = self.chunks[0]
        return chunk.values if chunk.rows is None else chunk.rows

    def _tensor(self, role: str, value: Any) -> torch.Tensor:
        mapped = MappedFile.of(value)
        if mapped is not None:
            mapped.check(self.name)
            self.files[role] = mapped
            value = mapped.array
        return _as_tensor(self.name, value, "column" if role == "rows" else role)

    def __len__(self) -> int:
        if self.parts is not None:
            return self._length
        return len(self.offsets) - 1 if self.rows is None else len(self.rows)

    def row(self, index: int) -> torch.Tensor:
        """Row ``index``, a view; the caller has checked the column's files (check_file)."""
        if self.parts is not None:
            part = bisect.bisect_right(self.starts, index) - 1
            return self.parts[part].row(index - self.starts[part])
        if self.rows is not None:
            return self.rows[index]
        return self.values[int(self.offsets[index]) : int(self.offsets[index + 1])]

    def on_disk(self) -> list[Any]:
        """The files this column reads (MappedFile, or a file another library mapped), each with
        ``unreadable()`` and ``check(column)``."""
        return self.watched + (self._part_files if self.parts is not None else list(self.files.values()))

    def check_file(self) -> None:
        """Raises MappedFileError, naming the column, if a file it reads shrank or, in a process that
        mapped it again, is not the file the column was made from."""
        for mapped in self.on_disk():
            mapped.check(self.name)

    def unreadable(self) -> str | None:
        """Why a file this column reads cannot be read now, or None (see MappedFile.unreadable)."""
        return next((why for why in (m.unreadable() for m in self.on_disk()) if why), None)

    def named(self, error: RuntimeError | IndexError) -> RuntimeError | IndexError:
        """An op's error on this column, the column named in place of the op (its words name the row)."""
        op, _, message = str(error).partition(": ")
        return type(error)(f"Arrays: column {self.name!r}: {message if op.endswith('_into') else error}")

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["watched"] = []  # pickled by value, the copy reads its own memory, not another's mapping
        for role in self.files:
            state[role] = None  # mapped again where it is unpickled, not copied through the pipe
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        for role, mapped in self.files.items():
            if mapped.array is not None:
                setattr(self, role, _as_tensor(self.name, mapped.array, role))
            else:  # not mapped here (MappedFile.check says why): the shape and dtype, with no data
                itemsize = np.dtype(mapped.dtype).itemsize
                shape, strides = mapped.shape, tuple(stride // itemsize for stride in mapped.strides)
                dtype = _as_tensor(self.name, np.empty(0, dtype=mapped.dtype), role).dtype
                setattr(self, role, torch.empty_strided(shape, strides, dtype=dtype, device="meta"))


def column_over(name: str, value: Any) -> Column:
    """The column ``name`` over ``value``; a Column already made (one column under two keys) is shared."""
    if isinstance(value, Column):
        shared = copy.copy(value)
        shared.name = name
        return shared
    return Column(name, value)


def _described(column: Column) -> str:
    kind = "ragged" if column.ragged else "rows"
    return f"{kind}, {column.first.dtype}, inner dims {tuple(column.first.shape[1:])}"


def _as_tensor(name: str, value: Any, what: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(f"Arrays: column {name!r}: {what} is on {value.device}; columns live on the CPU")
        return value.resolve_conj().resolve_neg() if (value.is_conj() or value.is_neg()) else value
    if isinstance(value, np.ndarray):
        with warnings.catch_warnings():
            # A read-only memmap: the tensor over it is only ever read (gathered, or indexed for a sample).
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            try:
                return torch.from_numpy(value)
            except (TypeError, ValueError) as error:  # object or big-endian dtypes, negative strides
                raise type(error)(
                    f"Arrays: column {name!r}: torch cannot view this {what} ({value.dtype}, strides "
                    f"{value.strides}): {error}. Pass np.ascontiguousarray(x, dtype=<a native numeric "
                    "dtype>), made once"
                ) from error
    alternatives = " or fastcollate.Ragged" if what == "column" else ""
    raise TypeError(
        f"Arrays: column {name!r}: {what} must be a torch.Tensor or a numpy array (np.memmap included)"
        f"{alternatives}, got {type(value).__name__}"
    )


def _rows_contiguous(rows: torch.Tensor) -> bool:
    if rows.numel() == 0:
        return True  # no bytes to copy (a column of zero rows, or of empty rows)
    expected = 1
    for size, stride in zip(reversed(rows.shape[1:]), reversed(rows.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True
