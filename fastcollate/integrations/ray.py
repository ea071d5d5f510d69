"""fastcollate.ray: the collate of Ray Data's ``iter_torch_batches``. Ray hands the collate one
``pyarrow.Table`` per batch (often a slice of a larger block, often in chunks); ``ArrowCollate`` gathers its
columns where they lie, in one native call a batch, into the buffer the batch goes out in, or, on the host,
hands a large column that needs no gather out as a view of the block, where Ray's own collate does.

The only module of the package that imports Ray, and only for the class Ray's ``iter_torch_batches``
recognises; without Ray, ``ArrowCollate`` is the same callable over any ``pyarrow.Table``.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .._ext import _C
from ..assembler import assemble
from ..collate import gather
from ..collate.contract import Contract
from ..collate.errors import ContractError
from ..data import arrow_columns, arrow_tensors
from ..data.arrays import ColumnChoice
from ..structure import jagged, tree
from ..transfer.device_loader import device_fields
from ..transfer.staging import DEFAULT_MAX_SLOTS, StagingRing, slot_holding

try:
    from ray.data.collate_fn import ArrowBatchCollateFn as _ArrowBatchCollateFn
except ImportError:  # Ray is not installed: the same call, with no Ray class to be
    _ArrowBatchCollateFn = object

__all__ = ["ArrowCollate"]

_WHO = "fastcollate.ray.ArrowCollate"


class _Layout:
    """How the tables of one schema are gathered: an ``_C.ArrowGather`` (which reads tensor extension
    columns from their storage itself), or None when each of them goes the per-sample way (a case of
    fastcollate.collate.gather.HANDED_TO_THE_WALK); and its tensor extension columns, which the per-sample
    way reads as the plain columns of their storage."""

    __slots__ = ("gather", "ragged", "read", "schema", "tensors")

    def __init__(self, schema: Any, gather_columns: Any, tensors: list[str], ragged: frozenset[str]) -> None:
        self.schema = schema
        self.gather = gather_columns
        self.tensors = tensors
        self.ragged = ragged  # tensor columns ragged in the first table: ragged in every one
        # The columns gathered, where the table has others: a batch that views its table's buffers holds
        # only these.
        self.read: list[str] | None = None

    def plain(self, table: Any) -> Any:
        """``table`` with its tensor columns as the plain columns of their storage."""
        return arrow_tensors.plain_table(table, self.tensors, _WHO, self.ragged) if self.tensors else table


class ArrowCollate(_ArrowBatchCollateFn):
    """The batch of a ``pyarrow.Table``, as ``ds.iter_torch_batches(collate_fn=ArrowCollate(contract))``
    wants one: exactly what ``assemble.using(contract)`` makes of
    ``Arrays.from_arrow(table, columns).__getitems__(range(table.num_rows))`` (dense columns stacked,
    fixed-size lists as rows, ``list`` columns padded or packed by the contract), gathered in C++ from
    the table's own buffers. Ray's tensor columns (``ray.data.from_numpy``'s, and the ragged ones
    ``map_batches`` returns for rows of other shapes) are read from their storage: rows of their shape, or
    ragged along their first dim (see fastcollate.data.arrow_tensors).

    Args:
        contract: the contract each batch is checked against and laid out by; None for drop-in mode.
        columns: the table's columns to read: None for every one, a list of names, or ``{key: column}``.
        device: a CUDA device to move each batch to here, in one copy from a page-locked staging buffer;
            None (the default) leaves it in host memory, for ``iter_torch_batches(device=...)`` to move.
            In host memory a column of numbers or tensors over 64 KiB that lies in one chunk, in its stored
            dtype, is a view of the table's buffer (Ray's block), as Ray's own collate hands it out (from
            the second table of a schema on): do not write into it.
            A bare "cuda" is the device current where the collate is made, if CUDA is started there, else
            at its first batch (in one of Ray's threads, whose current device is not the loop's).
            Ray moves only a batch of tensors alone: a packed batch holds ``max_length_q``/``max_length_k``
            as Python ints (what flash attention takes), so Ray leaves it on the host, and its
            ``pin_memory=True`` skips it too. Pass ``device=ray.train.torch.get_device()`` for those.
        max_slots: the staging buffers kept for batches (fastcollate.StagingRing); None for the process's
            default ring (8). A batch in use holds its buffer: Ray's collate threads, its prefetch queue and
            the batches a loop keeps each hold one, and past ``max_slots`` batches get fresh buffers (slower,
            said once by a ResourceWarning).

    Safe to call from several threads at once (Ray's prefetching does). Every table must keep the column
    types of the first: a column whose type changes is refused, naming it. A ragged tensor column stays
    ragged where Ray stores a block of its rows with one shape (a block of one row, say).
    """

    def __init__(
        self,
        contract: Contract | None = None,
        columns: ColumnChoice = None,
        *,
        device: torch.device | str | int | None = None,
        max_slots: int | None = None,
    ) -> None:
        self.contract = contract
        self.columns = columns
        self._requested = _cuda_device_or_none(device)  # what a pickled copy resolves again where it lands
        self.device = _current_if_started(self._requested)
        self.max_slots = _slot_count(max_slots)
        self._pinned: StagingRing | None = None  # made at the first batch moved, where the device is
        own_ring = None if self.max_slots is None else StagingRing(self.max_slots)
        self._assemble = assemble.using(contract, ring=own_ring)
        self._layout: _Layout | None = None
        self._first_types: dict[str, Any] | None = None  # {column: Arrow type} of the first table
        self._lock = threading.Lock()

    def __call__(self, table: Any) -> Any:
        table = _as_table(table)
        try:
            return self._collate(table)
        except ContractError as error:
            # A table's rows are named by row: a table has no dataset to wrap in with_ids.
            id_key = self._assemble.id_key
            unnamed = f"row {error.position} of the table (it has no {id_key!r} column to name rows by)"
            column = self._sources(table).get(str(error.field).split(".")[0])
            raise error.restated(_WHO, unnamed, column) from error

    def _collate(self, table: Any) -> Any:
        plan = self._native_plan(table)
        if self.device is None:
            if plan is None:
                return self.through_arrays(table)
            return plan if type(plan) is dict else self._assemble.deliver(plan)  # dict: the batch as it lies
        ring = self._staging_ring()
        batch = self._assemble.deliver(plan, into=ring) if plan is not None else self.through_arrays(table)
        return _in_one_copy(batch, ring, self.device)

    def _native_plan(self, table: Any) -> Any:
        """The plan of ``table`` gathered in one native call (on the host, possibly the batch itself, as it
        lies in the table: _C.ArrowGather.plan), or None where it goes the long way."""
        layout = self._layout_for(table)
        if layout.gather is None:
            return None
        # Kept on the host, a large column that needs no copy is handed out where it lies, as Ray's own
        # collate does; moved to a device, every column goes through the staging slot its one copy reads.
        on_host = self.device is None
        if on_host and layout.read is not None:
            table = table.select(layout.read)
        return layout.gather.plan(table.__arrow_c_stream__(), in_place=on_host)

    def through_arrays(self, table: Any) -> Any:
        """The batch of ``table`` the slow way, through ``Arrays.from_arrow`` and the per-batch gather: what
        ``__call__`` returns, and what it falls back on for a table it does not gather in one native call.
        Its Arrays watch no file: Ray's blocks lie in its object store, a shared-memory file Ray writes to
        all the time, and those writes do not move a block's rows."""
        table = _as_table(table)
        plain = self._layout_for(table).plain(table)
        arrays = arrow_columns.from_arrow(plain, self.columns, watch=False, who=_WHO)
        return self._assemble(arrays.__getitems__(list(range(table.num_rows))))

    def expression(self, table: Any) -> Any:
        """The old name of :meth:`through_arrays`."""
        warnings.warn(
            "ArrowCollate.expression is now ArrowCollate.through_arrays (the same batch, the slow way)",
            FutureWarning,
            stacklevel=2,
        )
        return self.through_arrays(table)

    def _staging_ring(self) -> StagingRing:
        """The page-locked ring the batches moved to ``device`` are staged in, made at the first one (in the
        process that has the device): a slot is busy from the gather until its copy has run."""
        with self._lock:
            if self._pinned is None:
                if not torch.cuda.is_available():
                    raise RuntimeError(
                        f"{_WHO}: device={str(self.device)!r}, but this process sees no GPU "
                        "(torch.cuda.is_available() is False). Make the collate with device=None here, or "
                        "run it where the GPU is (a Ray Train worker given one: ScalingConfig(use_gpu=True))"
                    )
                if self.device.index is None:  # CUDA was not started where it was made: the current one now
                    self.device = torch.device("cuda", torch.cuda.current_device())
                slots = DEFAULT_MAX_SLOTS if self.max_slots is None else self.max_slots
                self._pinned = StagingRing(slots, pinned=True, device=self.device)
            return self._pinned

    def _layout_for(self, table: Any) -> _Layout:
        layout = self._layout
        if layout is None or not table.schema.equals(layout.schema):
            layout = self._layout_of(table)
        return layout

    def _layout_of(self, table: Any) -> _Layout:
        """The layout of ``table``'s schema, made from ``table`` (its columns checked as Arrays checks them,
        naming an unreadable one), once for each new schema."""
        with self._lock:
            names = self._sources(table)
            types = {
                name: table.schema.field(name).type for name in names.values() if name in table.schema.names
            }
            if self._first_types is None:
                self._first_types = types
            for name, first in self._first_types.items():
                now = types.get(name)
                if now is not None and now != first and not arrow_tensors.alike(first, now):
                    raise TypeError(
                        f"{_WHO}: column {name!r} was {first} in the first batch and is {now} in this one: a "
                        "column keeps one type across batches. Cast it to one type where it is made (in "
                        "map_batches: pyarrow.compute.cast, or numpy's astype)"
                    )
            tensors = sorted(name for name in types if arrow_tensors.is_tensor_type(types[name]))
            ragged = frozenset(
                name for name in tensors if arrow_tensors.is_ragged(self._first_types.get(name))
            )
            layout = _Layout(table.schema, None, tensors, ragged)
            arrays = arrow_columns.from_arrow(layout.plain(table), self.columns, watch=False, who=_WHO)
            chosen = gather.gathered_columns(arrays, self.contract)
            if chosen is not None:
                sources = [names[key] for _, key in chosen]
                layout.gather = _C.ArrowGather(
                    [column for column, _ in chosen],
                    sources,
                    tensor_dims=[
                        arrow_tensors.row_dims(types[name]) if name in tensors else None for name in sources
                    ],
                    schema=table.schema.__arrow_c_schema__(),
                    id_key=self._assemble.id_key,
                    who=_WHO,
                )
                read = list(dict.fromkeys(sources))
                layout.read = read if len(read) < table.num_columns else None
            self._layout = layout
            return layout

    def _sources(self, table: Any) -> dict[str, str]:
        """{key: table column} of the columns read."""
        if self.columns is None:
            return {name: name for name in table.column_names}
        if isinstance(self.columns, Mapping):
            return dict(self.columns)
        return {name: name for name in self.columns}

    def __getstate__(self) -> dict:
        # Layouts and the staging ring are made again where it lands.
        return {"contract": self.contract, "columns": self.columns, "device": self._requested,
                "max_slots": self.max_slots}

    def __setstate__(self, state: dict) -> None:
        self.__init__(
            state["contract"], state["columns"], device=state["device"], max_slots=state["max_slots"]
        )

    def __repr__(self) -> str:
        what = "drop-in" if self.contract is None else f"{len(self.contract.fields)}-field contract"
        moved = "" if self.device is None else f", device={str(self.device)!r}"
        return f"fastcollate.ray.ArrowCollate({what}, columns={self.columns!r}{moved})"


def _cuda_device_or_none(device: Any) -> torch.device | None:
    """The CUDA device ``device`` names, or None for none or the CPU (the batch stays in host memory)."""
    if device is None:
        return None
    try:
        if isinstance(device, bool):  # torch would read True as device 1
            raise TypeError("a bool names no device")
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(
            f"{_WHO}: device={device!r} names no device ({str(error).splitlines()[0]}): pass \"cuda\", "
            "\"cuda:1\", an int, a torch.device, or None to leave batches in host memory"
        ) from None
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        raise ValueError(f"{_WHO}: device={str(device)!r}: a batch goes to a CUDA device or stays on the CPU")
    return device


def _current_if_started(device: torch.device | None) -> torch.device | None:
    """``device``, a bare "cuda" fixed to the current device of the thread making the collate where CUDA is
    started (torch.cuda.set_device starts it): Ray calls the collate from threads of its own, whose current
    device is not the training loop's. Elsewhere (a driver with no GPU) it is fixed at the first batch."""
    if device is None or device.index is not None or not torch.cuda.is_initialized():
        return device
    return torch.device("cuda", torch.cuda.current_device())


def _slot_count(max_slots: Any) -> int | None:
    """``max_slots`` checked: None, or a count of staging buffers of at least one."""
    if max_slots is None:
        return None
    counted = isinstance(max_slots, int | np.integer) and not isinstance(max_slots, bool)
    if not counted or not 1 <= max_slots < 2**62:
        raise ValueError(
            f"{_WHO}: max_slots={max_slots!r}: the staging buffers kept are a count, at least 1 (the batches "
            "held at once: Ray's collate threads, its prefetch queue and the loop's, plus 2), or None for "
            f"the default ({DEFAULT_MAX_SLOTS})"
        )
    return int(max_slots)


def _in_one_copy(batch: Any, ring: StagingRing, device: torch.device) -> Any:
    """``batch`` with its host tensors on ``device``: copied as one buffer, from one page-locked slot of
    ``ring`` (the one the batch was gathered into, or one they are packed into now), on the device's current
    stream. Each field is a view of that one copy, but a small one of a large batch (a label) gets its own
    memory, so that keeping it does not keep the batch. Python values (a packed batch's max_length_q) stay."""
    leaves, rebuild = tree.flatten(batch)
    count = len(leaves)
    leaves, jagged_places = jagged.split(leaves)  # a jagged tensor crosses as its values and offsets
    host = [i for i, leaf in enumerate(leaves) if torch.is_tensor(leaf) and leaf.device.type == "cpu"]
    if not host:
        return batch
    # One tensor under two keys (cu_seq_lens_q and _k) crosses once and stays one tensor.
    tensors = list({id(leaves[i]): leaves[i] for i in host}.values())
    slot, offsets = slot_holding(tensors, ring.owns) or ring.pack(tensors)
    nbytes = max(offset + t.nbytes for t, offset in zip(tensors, offsets, strict=True))
    stream = torch.cuda.current_stream(device)
    device_bytes = torch.empty(nbytes, dtype=torch.uint8, device=device)
    # A ring slot is held until the copy queued on the stream has read it; any other buffer (the ring
    # was full) is copied before this returns.
    in_ring = ring.owns(slot)
    device_bytes.copy_(slot[:nbytes], non_blocking=in_ring)
    if in_ring:
        ring.hold_until_stream_done(slot, stream)
    fields, _ = device_fields(device_bytes, tensors, offsets)
    moved = {id(tensor): field for tensor, field in zip(tensors, fields, strict=True)}
    for i in host:
        leaves[i] = moved[id(leaves[i])]
    return rebuild(jagged.join(leaves, jagged_places, count))


def _as_table(batch: Any) -> Any:
    import pyarrow as pa

    if isinstance(batch, pa.Table):
        return batch
    if isinstance(batch, pa.RecordBatch):
        return pa.Table.from_batches([batch])
    raise TypeError(
        f"{_WHO}: expected a pyarrow.Table (what Ray hands an ArrowBatchCollateFn), got "
        f"{type(batch).__name__}"
    )
