"""Which files a read touches: its samples' rows, the chunks that hold them, and the files those chunks
lie in, found with numpy for a whole batch. A batch then checks the files it reads, not every file of the
dataset: a Hugging Face dataset spans hundreds to thousands of files (``save_to_disk(num_shards=...)``,
``map(num_proc=...)``, ``concatenate_datasets``), and each check is a stat of about 2 us.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["FilesOfRows"]

# Up to this many files a batch stats them all: finding those it touches costs a few numpy calls (6 us for
# 16 rows on the 2-core development machine, where a stat took 2-4.5 us), more than the stats it saves when
# a batch of a few files touches most of them anyway. One sample (check_row) is looked up without numpy.
CHECK_ALL_UP_TO = 4


class _Chunking:
    """Columns chunked alike (one table's columns share their record batches): each chunk's first row,
    and the numbers of the files it reads, -1 where it reads fewer than the widest chunk."""

    def __init__(self, starts: list[int], files: list[tuple[int, ...]]) -> None:
        self.starts = np.asarray(starts, dtype=np.int64)
        self.start_list = starts
        self.file_tuples = files
        width = max(len(numbers) for numbers in files)
        self.files = np.full((len(files), width), -1, dtype=np.int64)
        for chunk, numbers in enumerate(files):
            self.files[chunk, : len(numbers)] = numbers

    def of_rows(self, rows: np.ndarray) -> np.ndarray:
        return self.files[np.searchsorted(self.starts, rows, side="right") - 1].ravel()

    def of_row(self, row: int) -> tuple[int, ...]:
        return self.file_tuples[bisect.bisect_right(self.start_list, row) - 1]


class FilesOfRows:
    """The files of an Arrays' ``columns`` (``Column.on_disk``), each listed once with the first key that
    reads it (named when it is refused), and which of them a row's chunk reads."""

    def __init__(self, columns: Mapping[str, Any]) -> None:
        self.files: list[Any] = []
        self.keys: list[str] = []
        numbers: dict[int, int] = {}
        chunkings: dict[tuple, _Chunking] = {}
        for key, column in columns.items():
            by_chunk = []
            for files in _files_by_chunk(column):
                for file in files:
                    if id(file) not in numbers:
                        numbers[id(file)] = len(self.files)
                        self.files.append(file)
                        self.keys.append(key)
                by_chunk.append(tuple(numbers[id(file)] for file in files))
            if any(by_chunk):
                starts = list(column.starts) if column.parts is not None else [0]
                shape = (tuple(starts), tuple(by_chunk))  # a column under two keys is looked up once
                chunkings.setdefault(shape, _Chunking(starts, by_chunk))
        self._chunkings = list(chunkings.values())
        self._few = len(self.files) <= CHECK_ALL_UP_TO

    def check(self, indices: int | np.ndarray | None, rows_of: torch.Tensor | None) -> None:
        """Checks the files of the samples ``indices`` (a sample, or int64 indices in range; None: every
        file), sample ``i`` being row ``rows_of[i]`` where there is a ``rows_of``."""
        if indices is None:
            self.check_every()
        elif isinstance(indices, np.ndarray):
            self.check_rows(indices if rows_of is None else rows_of.numpy()[indices])
        else:
            self.check_row(indices if rows_of is None else int(rows_of[indices]))

    def check_every(self) -> None:
        self._check(range(len(self.files)))

    def check_rows(self, rows: np.ndarray) -> None:
        """Checks the files the chunks of ``rows`` (int64, within the columns) read, each once (every file,
        when there are a few)."""
        if not len(rows):
            return
        if self._few:
            self.check_every()
            return
        touched = [chunking.of_rows(rows) for chunking in self._chunkings]
        numbers = np.unique(touched[0] if len(touched) == 1 else np.concatenate(touched))
        self._check(numbers[numbers >= 0].tolist())

    def check_row(self, row: int) -> None:
        """Checks the files the chunks of ``row`` read (one sample: no numpy)."""
        self._check(sorted({n for chunking in self._chunkings for n in chunking.of_row(row)}))

    def _check(self, numbers: Iterable[int]) -> None:
        # In the columns' order: the first key that reads a refused file is the one named.
        for number in numbers:
            self.files[number].check(self.keys[number])


def _files_by_chunk(column: Any) -> list[list[Any]]:
    """The files each chunk of ``column`` reads, chunk by chunk (a Chunked column's parts list their own)."""
    if column.parts is None:
        return [column.on_disk()]
    return [part.on_disk() for part in column.parts]
