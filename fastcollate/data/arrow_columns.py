"""Arrays over Arrow: the columns of a ``pyarrow.Table``, an Arrow IPC file or a Hugging Face
``datasets.Dataset``, read where they lie, chunk by chunk (``fastcollate.Chunked``), with no copy of
their values. Only the offsets of list columns are copied (8 bytes a row): a column checks its own.

How Arrow types become columns:

- integers and floating point: a value per row (1-D);
- ``list`` / ``large_list`` (a ``Sequence`` feature): ragged rows, padded or packed by a contract;
- ``fixed_size_list`` (``Sequence(length=k)``, ``List(..., length=k)``) and Hugging Face's ``Array2D`` to
  ``Array5D``: rows of that shape; an ``ArrayXD`` whose first dim is None is ragged along it;
- tensor extensions (Ray Data's fixed-shape and ragged tensors, Arrow's ``fixed_shape_tensor``): read from
  their storage, as fastcollate.data.arrow_tensors lays them out;
- everything else is refused, naming the column: strings and binary (tokenize first), booleans (stored
  as bits: cast to uint8), nulls, structs, and lists within lists of varying length.

The Arrays made here pickle as their source: a dataset's files by path (Hugging Face reopens them), an
IPC file by path, a table by value (with a warning). Worker processes started by spawn therefore map the
files again, and one whose path now holds another file refuses to read it, naming the column. A file
that shrinks under a mapping is named before a read, and a read that faults anyway is named after it.
"""

from __future__ import annotations

import copy
import os
import pickle
import warnings
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from .._ext import _C
from . import arrow_tensors, hf_formats
from .arrays import ARROW_FACTORIES, Arrays, ColumnChoice
from .columns import Chunked, Column, Ragged
from .mapped_files import MappedFileError, WatchedFile

__all__ = ["from_arrow", "from_hf"]


class ArrowArrays(Arrays):
    """Arrays made from Arrow columns, pickled as where they came from (see the module's docstring).
    ``ds[i]`` hands out copies of the rows, as Hugging Face's rows are: a view of a mapped file would kill
    the process when read after the file shrank. Batches are gathered from the files themselves."""

    _source: tuple  # (the function that made it, its source, {key: column}, {its options})
    _refusal: str | None = None  # why this copy cannot read its files (see _rebuilt)
    _index_maps: list[WatchedFile] = []  # the file of a Hugging Face index map, read once when made
    _null_rows: dict[str, np.ndarray] = {}  # by key, the rows that hold a null (none of them is read)

    def __reduce__(self) -> tuple:
        build, source, columns, options = self._source
        by_value = _by_value(source)
        if by_value:
            warnings.warn(
                f"fastcollate.Arrays over {by_value} is pickled by value: each worker started by spawn "
                "receives a copy. Save the dataset to a file (Dataset.save_to_disk, flatten_indices, or an "
                "Arrow IPC file given to from_arrow by its path) to have workers map it instead",
                stacklevel=2,
            )
        identities = [watched.identity for watched in self._watched()]
        # The source pickled apart, unpickled inside _rebuilt: a dataset whose files are gone must not
        # fail where it is unpickled (a worker that cannot start), but on its first read, by name.
        options = {**options, "index_as": self.index_as}  # with_ids may have set it since
        return (_rebuilt, (build, pickle.dumps(source), columns, options, identities, len(self)))

    def _watched(self) -> list[WatchedFile]:
        """Every file this dataset read or reads: its columns' and its index map's."""
        files = [w for c in self.columns.values() for w in c.watched] + self._index_maps
        return list({id(w): w for w in files}.values())

    def _handed_out(self, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self._copied(samples, list(self.columns))  # every row, in a file or not: Arrow's are read-only

    def check_files(self, indices: int | np.ndarray | None = None) -> None:
        if self._refusal is not None:
            raise MappedFileError(self._refusal)
        super().check_files(indices)

    def _read_through(self, rows_of: torch.Tensor) -> None:
        """Sample ``i`` becomes row ``rows_of[i]`` (int64, within the columns) of every column."""
        self.rows_of = rows_of
        self._length = len(rows_of)


def from_hf(
    dataset: Any, columns: ColumnChoice = None, *, index_as: str | None = None, stored_dtypes: bool = False
) -> Arrays:
    """``Arrays.from_hf``: see its docstring."""
    import datasets

    if isinstance(dataset, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise TypeError(
            "Arrays.from_hf: a streaming dataset (IterableDataset) has no rows to read by index, and Arrays "
            "gathers batches by index. Load it without streaming=True to read it where it lies, or keep "
            "streaming and pass fastcollate.assemble as the DataLoader's collate_fn"
        )
    if isinstance(dataset, datasets.DatasetDict):
        raise TypeError(
            f"Arrays.from_hf: a DatasetDict holds splits ({', '.join(map(repr, dataset))}): pass one, "
            "e.g. Arrays.from_hf(dataset['train'])"
        )
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"Arrays.from_hf: expected a datasets.Dataset, got {type(dataset).__name__}")
    format_columns = hf_formats.refuse_what_arrays_cannot_hand_out(dataset)
    table = dataset.data.table
    shown = format_columns
    if not shown or dataset.format.get("output_all_columns"):
        shown = dataset.column_names
    chosen = _chosen(columns, shown, dataset.column_names, "Arrays.from_hf")
    hf_formats.refuse_encoded_media(dataset.features, chosen)
    arrays = _arrays(table, chosen, index_as, "Arrays.from_hf")
    if dataset._indices is not None:  # select, shuffle, shard, train_test_split: rows through a map
        index_map = dataset._indices.column(0)
        rows = index_map.to_numpy().astype(np.int64)
        arrays._read_through(torch.from_numpy(rows))
        outside = _C.first_index_outside(arrays.rows_of, table.num_rows)
        if outside >= 0:
            raise IndexError(
                f"Arrays.from_hf: sample {outside} maps to row {int(rows[outside])} of a table of "
                f"{table.num_rows} rows: the dataset's index map does not fit its table"
            )
        # Read once, here: a process that makes the dataset again (a spawned worker) reads the file again,
        # and must find the file this one read (_rebuilt).
        addresses = [chunk.buffers()[1].address for chunk in index_map.chunks if len(chunk)]
        arrays._index_maps = list({id(w): w for w in WatchedFile.of(addresses).values()}.values())
    _refuse_nulls_read(arrays, "Arrays.from_hf")
    for key, dtype in hf_formats.dtypes_handed_out(dataset, chosen, arrays, stored_dtypes).items():
        arrays.columns[key].dtype = dtype
    # The view as read now: set_format and set_transform change the dataset in place, and a spawned worker
    # makes the Arrays again from what this pickles. A shallow copy keeps the format (those rebind it).
    options = {"index_as": index_as, "stored_dtypes": stored_dtypes}
    arrays._source = (from_hf, copy.copy(dataset), chosen, options)
    return arrays


def from_arrow(
    source: Any,
    columns: ColumnChoice = None,
    *,
    index_as: str | None = None,
    watch: bool = True,
    who: str = "Arrays.from_arrow",
) -> Arrays:
    """``Arrays.from_arrow``: see its docstring. ``watch=False`` watches no file the table's buffers lie in:
    for a table in memory another program writes to all the time (Ray's object store, a shared-memory
    file), which is no dataset's file and whose writes do not move the table's rows. ``who`` begins its
    errors: the caller the user called."""
    import pyarrow as pa

    if isinstance(source, (str, os.PathLike)):
        source = os.path.abspath(source)  # read again by another process, from another directory maybe
        table = _read_ipc(source, who)
    elif isinstance(source, pa.RecordBatch):
        table = pa.Table.from_batches([source])
    elif isinstance(source, pa.Table):
        table = source
    else:
        raise TypeError(
            f"{who}: expected a pyarrow.Table, a RecordBatch or the path of an Arrow IPC file, "
            f"got {type(source).__name__}"
        )
    chosen = _chosen(columns, table.column_names, table.column_names, who)
    arrays = _arrays(table, chosen, index_as, who, watch)
    _refuse_nulls_read(arrays, who)
    arrays._source = (from_arrow, source, chosen, {"index_as": index_as})
    return arrays


def _read_ipc(path: str, who: str) -> Any:
    """The table of the Arrow IPC file at ``path``, memory-mapped: the file format (``.arrow``,
    ``.feather`` v2) or the stream format (what Hugging Face datasets writes). Another kind of file is
    refused, saying which reader opens it."""
    import pyarrow as pa

    source = pa.memory_map(path)
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        pass
    source.seek(0)
    try:
        return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid as error:
        # pyarrow's own words ("Expected to read 827474256 metadata bytes ...") are the stream reader's
        # view of bytes that are no stream: nothing to act on. They stay on the error as its cause.
        raise ValueError(f"{who}: {path} is not an Arrow IPC file. {_reader_of(path)}") from error


def _reader_of(path: str) -> str:
    """What opens the file at ``path``, when it is not Arrow IPC, told from its first bytes and its name."""
    with open(path, "rb") as file:
        head = file.read(4)
    name = path.lower()
    if head in (b"ARRO", b"\xff\xff\xff\xff"):  # the file format's magic, a stream's first message
        kind = ("It begins as an Arrow IPC file does, so it may be cut short or damaged: pyarrow's error is "
                "this one's cause")
    elif head == b"PAR1" or name.endswith((".parquet", ".pq")):
        kind = "It is a Parquet file: read it with pyarrow.parquet.read_table(path) and pass the table"
    elif name.endswith((".json", ".jsonl", ".csv", ".tsv", ".txt")) or head[:1] in (b"{", b"["):
        kind = (
            "It looks like JSON or CSV: load it with datasets.load_dataset('json' or 'csv', "
            "data_files=path), then Arrays.from_hf(dataset['train']), which reads the Arrow cache it writes"
        )
    else:
        kind = "Arrow IPC files are written by pyarrow.ipc.new_file / new_stream and Dataset.save_to_disk"
    return (
        f"{kind}; Arrays.from_arrow maps an IPC file by path (pyarrow.memory_map), or takes a pyarrow.Table"
    )


def _chosen(columns: ColumnChoice, shown: list[str], every: list[str], who: str) -> dict[str, str]:
    """{key: column name} from ``columns`` (None: every column shown), each checked to exist."""
    if columns is None:
        chosen = {name: name for name in shown}
    elif isinstance(columns, Mapping):
        chosen = dict(columns)
    elif isinstance(columns, str):
        raise TypeError(
            f"{who}: columns is a list of names or a {{key: column}} mapping, got the str {columns!r}"
        )
    else:
        chosen = {name: name for name in columns}
    for key, name in chosen.items():
        if not isinstance(key, str) or not isinstance(name, str):
            raise TypeError(f"{who}: columns names keys and columns by str, got {key!r}: {name!r}")
        if name not in every:
            raise KeyError(
                f"{who}: column {name!r} (for key {key!r}) does not exist; the columns are {every}"
            )
    if not chosen:
        raise ValueError(f"{who}: no column chosen")
    return chosen


def _arrays(
    table: Any, chosen: dict[str, str], index_as: str | None, who: str, watch: bool = True
) -> ArrowArrays:
    """Arrays over the ``chosen`` columns of ``table``, watching the files their chunks lie in (unless not
    ``watch``). The rows that hold a null are kept by key in ``_null_rows``, refused once it is known which
    rows are read."""
    made: dict[str, Column] = {}  # one column under two keys is made once
    null_rows: dict[str, np.ndarray] = {}
    for key, name in chosen.items():
        if name not in made:
            pieces, nulls = _pieces(key, table.column(name), who)
            made[name] = Column(key, Chunked(pieces))
            null_rows[name] = nulls
    arrays = ArrowArrays({key: made[name] for key, name in chosen.items()}, index_as=index_as)
    arrays._null_rows = {key: null_rows[name] for key, name in chosen.items() if len(null_rows[name])}
    if not watch:
        return arrays
    chunks = [chunk for column in arrays.columns.values() for chunk in column.chunks]
    at = {id(chunk): chunk.first.data_ptr() for chunk in chunks if chunk.first.numel()}
    watched = WatchedFile.of(list(at.values()))
    for chunk in chunks:  # each chunk its file: a batch checks the files of the chunks it reads
        found = watched.get(at.get(id(chunk)))
        chunk.watched = [found] if found is not None else []
    for column in arrays.columns.values():
        column.watched = list({id(w): w for chunk in column.chunks for w in chunk.watched}.values())
    return arrays


def _pieces(key: str, column: Any, who: str) -> tuple[list[Any], np.ndarray]:
    """The column's chunks as tensors, and the rows (of the column) that hold a null."""
    chunks = [chunk for chunk in column.chunks if len(chunk)] or [column.combine_chunks()]
    starts = np.cumsum([0] + [len(chunk) for chunk in chunks])
    if arrow_tensors.is_tensor_type(column.type):  # Ray's tensors and Arrow's: their storage, as plain lists
        pairs = zip(starts, chunks, strict=False)
        chunks = [arrow_tensors.plain_array(chunk, f"{who}: column {key!r}", start) for start, chunk in pairs]
    nulls = [start + _null_rows(chunk) for start, chunk in zip(starts, chunks, strict=False)]
    with warnings.catch_warnings():
        # Arrow's buffers are read-only: the tensors over them are only ever read (gathered, or indexed).
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        pairs = zip(starts, chunks, strict=False)  # starts has one entry more: the column's end
        pieces = [_tensors(_piece(key, chunk, who, start)) for start, chunk in pairs]
    return pieces, np.concatenate(nulls).astype(np.int64)


def _null_rows(array: Any) -> np.ndarray:
    """The rows of one chunk that hold a null at any level (a null row, or a null value in its lists),
    found level by level from the nulls Arrow counts, so that a chunk without nulls costs nothing."""
    import pyarrow as pa

    if isinstance(array, pa.ExtensionArray):
        array = array.storage
    parents: list[Any] = []  # the list levels above the current one, read only when a null is found
    found = []
    node = array
    while True:
        if node.null_count:
            positions = np.flatnonzero(node.is_null().to_numpy(zero_copy_only=False))
            for parent in reversed(parents):  # back up to the chunk's rows
                if pa.types.is_fixed_size_list(parent.type):
                    positions = positions // parent.type.list_size
                else:
                    offsets = parent.offsets.to_numpy(zero_copy_only=False)
                    positions = np.searchsorted(offsets - offsets[0], positions, "right") - 1
            found.append(positions)
        if pa.types.is_fixed_size_list(node.type):
            parents.append(node)
            node = _fixed_values(node)
        elif pa.types.is_list(node.type) or pa.types.is_large_list(node.type):
            parents.append(node)
            # A sliced chunk's (a contiguous select's) own values: .values holds every row's of its parent
            first, last = node.offsets[0].as_py(), node.offsets[len(node)].as_py()
            node = node.values.slice(first, last - first)
        else:
            break
    return np.unique(np.concatenate(found)) if found else np.empty(0, dtype=np.int64)


def _refuse_nulls_read(arrays: ArrowArrays, who: str) -> None:
    """Refuses a column with a null in a row the dataset reads (its index map's rows, or every row): a
    null in a row a view left out (a filter's) is never read."""
    for key, null_rows in arrays._null_rows.items():
        if arrays.rows_of is None:
            reading = null_rows
        else:
            read = arrays.rows_of.numpy()
            reading = np.flatnonzero(np.isin(read, null_rows))
        if len(reading):
            sample = int(reading[0])
            row = sample if arrays.rows_of is None else int(arrays.rows_of[sample])
            raise ValueError(
                f"{who}: column {key!r} has {len(reading)} missing values (nulls) in the rows the dataset "
                f"reads, the first in sample {sample} (row {row} of the table): a tensor has no null. Fill "
                "or drop them first (Dataset.filter, or pyarrow.compute.fill_null)"
            )


def _tensors(piece: np.ndarray | Ragged) -> torch.Tensor | Ragged:
    if isinstance(piece, Ragged):
        return Ragged(torch.from_numpy(piece.values), torch.from_numpy(piece.offsets))
    return torch.from_numpy(piece)


def _piece(key: str, array: Any, who: str, start: int) -> np.ndarray | Ragged:
    """One Arrow chunk (the column's rows from ``start``) as Arrays reads it: rows (an array whose dim 0 is
    the row) or Ragged, over the chunk's own buffers."""
    import pyarrow as pa

    where = f"{who}: column {key!r}"
    shape = None
    if isinstance(array, pa.ExtensionArray):
        if not type(array.type).__module__.startswith("datasets."):
            raise TypeError(
                f"{where} has the extension type {array.type}, whose layout Arrays does not know: cast it to "
                "its storage or to a list type first"
            )
        shape = array.type.shape  # Hugging Face's Array2D..Array5D: each row's dims (the first may be None)
        array = array.storage
    # Each list level: (offsets, fixed length, rows). Its rows are kept: lists of a zero-size dim hold no
    # value, so their values do not tell how many there are.
    levels: list[tuple[np.ndarray | None, int | None, int]] = []
    node = array
    while (
        pa.types.is_list(node.type)
        or pa.types.is_large_list(node.type)
        or pa.types.is_fixed_size_list(node.type)
    ):
        if pa.types.is_fixed_size_list(node.type):
            levels.append((None, node.type.list_size, len(node)))
            node = _fixed_values(node)
        else:
            fixed = shape[len(levels)] if shape is not None and len(levels) < len(shape) else None
            levels.append((node.offsets.to_numpy(zero_copy_only=True), fixed, len(node)))
            node = node.values
    leaf = _leaf(where, node, array.type)
    for depth in reversed(range(len(levels))):
        offsets, fixed, rows = levels[depth]
        if offsets is None:
            leaf = leaf.reshape(rows, fixed, *leaf.shape[1:])
            continue
        within = leaf[offsets[0] : offsets[-1]]
        if fixed is None and depth == 0:
            return Ragged(within, offsets.astype(np.int64) - offsets[0])
        if fixed is None or (np.diff(offsets) != fixed).any():
            nulls = _null_rows(array)
            if fixed is not None and len(nulls):  # a null list holds no values: the rows are not a grid
                raise ValueError(
                    f"{where} ({array.type}) has a null list in row {start + int(nulls[0])} of the table, "
                    "which leaves its rows without the values its shape declares: fill the nulls, or drop "
                    "their rows and save the dataset again (Dataset.filter, then save_to_disk)"
                )
            raise TypeError(
                f"{where} ({array.type}) holds lists within lists whose lengths are not declared: only a "
                "row's first dim may vary (ragged). Declare the inner lengths with a feature "
                "(Sequence(length=k), Array2D(shape=(None, k))) or flatten the column"
            )
        leaf = within.reshape(rows, fixed, *leaf.shape[1:])
    return leaf


def _leaf(where: str, node: Any, column_type: Any) -> np.ndarray:
    """The values of a column's innermost level, as numpy over their Arrow buffer."""
    import pyarrow as pa

    kind = node.type
    if (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or (pa.types.is_large_binary(kind) or pa.types.is_string_view(kind))
    ):
        raise TypeError(
            f"{where} holds text or bytes ({column_type}), which a batch of tensors cannot: tokenize it "
            "first (Dataset.map, or Ray Data's map_batches), or leave it out (columns=[...])"
        )
    if pa.types.is_boolean(kind):
        raise TypeError(
            f"{where} holds booleans ({column_type}), which Arrow stores as bits, not as the bytes a tensor "
            "reads: cast the column to uint8 (Dataset.cast_column, or pyarrow.compute.cast in map_batches)"
        )
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        raise TypeError(
            f"{where} has type {column_type}, which has no tensor dtype: integers and floating point, and "
            "lists of them, are read"
        )
    if node.null_count:  # nulls in rows that are not read (see _refuse_nulls_read): the values as they lie
        node = pa.Array.from_buffers(node.type, len(node), [None, node.buffers()[1]], offset=node.offset)
    return node.to_numpy(zero_copy_only=True)


def _fixed_values(array: Any) -> Any:
    """The values of a fixed-size list chunk's own rows, nulls' slots included (a slice, no copy; flatten()
    would leave out the values of null rows)."""
    size = array.type.list_size
    return array.values.slice(array.offset * size, len(array) * size)


# An index map this large goes to each spawned worker by value: worth saying.
_LARGE_INDEX_MAP = 64 << 10


def _by_value(source: Any) -> str | None:
    """What of ``source`` pickling copies (rather than naming its files), or None."""
    if isinstance(source, str):
        return None
    if not hasattr(source, "cache_files"):
        return f"a {type(source).__name__}"
    if not source.cache_files:
        return "an in-memory Hugging Face dataset (no cache file)"
    from datasets.table import MemoryMappedTable

    indices = source._indices
    in_memory = indices is not None and not isinstance(indices, MemoryMappedTable)
    if in_memory and indices.nbytes > _LARGE_INDEX_MAP:
        return f"a Hugging Face dataset whose index map (select, shard) is in memory, {indices.nbytes:,} B"
    return None


def _rebuilt(
    build: Any, source: bytes, columns: dict[str, str], options: dict[str, Any], identities: list, length: int
) -> Arrays:
    """``build(source, ...)`` again in this process, refusing files that are none of the files it was made
    from as they were then (see WatchedFile.expect); a dataset that cannot be made again refuses every
    read, naming its columns, rather than failing where it is unpickled (a worker that cannot start)."""
    try:
        source = pickle.loads(source)
        arrays = build(source, columns, **options)
    except Exception as error:
        arrays = ArrowArrays.__new__(ArrowArrays)
        arrays.index_as, arrays.columns, arrays.rows_of = options["index_as"], MappingProxyType({}), None
        arrays._length = length
        arrays._source = (build, None, columns, options)
        arrays._refusal = (
            f"Arrays: columns {', '.join(map(repr, columns))}: the dataset cannot be made again in this "
            "process (a spawned or forkserver worker, or an unpickled copy), which opens its files by path: "
            f"{type(error).__name__}: {error}. Keep a dataset's files in place while it is read, or start "
            "workers by fork"
        )
        return arrays
    by_file: dict[tuple, list] = {}  # a dataset of thousands of files: each compared with its own identities
    for identity in identities:
        by_file.setdefault((identity.device, identity.inode, identity.size), []).append(identity)
    for watched in arrays._watched():
        mine = watched.identity
        watched.expect(by_file.get((mine.device, mine.inode, mine.size), []))
    for index_map in arrays._index_maps:  # read when made: a file that is not the one read before is refused
        why = index_map.unreadable()
        if why is not None:
            arrays._refusal = (
                f"Arrays: columns {', '.join(map(repr, columns))}: the dataset's index map (the rows that "
                f"select, shuffle, shard or train_test_split chose) cannot be trusted: {why}"
            )
    return arrays


ARROW_FACTORIES.update(from_hf=from_hf, from_arrow=from_arrow)
