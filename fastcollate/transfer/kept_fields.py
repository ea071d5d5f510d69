"""Which fields kept from workers' batches hold the shared slots (fastcollate.transfer.worker_slots).

A batch under ``LARGE_BATCH_BYTES`` stays whole in its slot (fastcollate.transfer.small_fields): each of
its fields is a view of the slot, so keeping one field (ids or labels kept for metrics) keeps the slot.
A worker that finds every slot held sends, with its next message, the keys and places of the fields it
wrote into each slot; the main process, which alone knows which of those tensors are still alive, names
the fields it kept from batches it otherwise dropped, once per process. The batch a worker could not
place is often the one after a batch the loop still holds whole (the loop's variable), so a worker sends
them again after its 2nd, 4th, 8th, ... such batch (REPORTS times at most: each costs the main process a
look at every object), and the main process looks with every worker's fields it was sent.
"""

from __future__ import annotations

import gc
import os
import warnings
from collections import Counter
from typing import Any

import torch

from .._ext import _C
from .small_fields import LARGE_BATCH_BYTES

__all__ = ["held_by_kept_fields", "send_with_next_message", "with_held_fields"]

# (slot, sequence number) -> [(offset, nbytes, key), ...]: a worker's last write into each slot.
Written = dict[tuple[int, int], list[tuple[int, int, str]]]

REPORTS = 8

_pending: dict[int, tuple[int, Written]] = {}  # by pid: a forked child sends its own
_refusals: Counter[int] = Counter()  # a worker's batches that found every slot held, by pid
_sent: dict[int, Written] = {}  # by pool token: what the main process was sent, every worker's
_named: set[int] = set()  # pids of main processes that have said it


def send_with_next_message(native: Any) -> None:
    """In a worker that found every slot of ``native`` (a ``_C.SharedSlots``) held: the fields of the
    batches it wrote there go with its next message (``with_held_fields``), after its 1st, 2nd, 4th, ...
    such batch."""
    pid = os.getpid()
    _refusals[pid] += 1
    count = _refusals[pid]
    if count & (count - 1) == 0 and count.bit_length() <= REPORTS:
        _pending[pid] = (native.token, native.written_fields())


def with_held_fields(message: Any) -> Any:
    """What to pickle for ``message``: the message itself, or the message carrying the fields
    ``send_with_next_message`` left for it, which the main process unwraps as it unpickles."""
    if not _pending:  # every message but one: no getpid call
        return message
    pending = _pending.pop(os.getpid(), None)
    return message if pending is None else _WithHeldFields(message, *pending)


class _WithHeldFields:
    def __init__(self, message: Any, token: int, written: Written) -> None:
        self.message, self.token, self.written = message, token, written

    def __reduce__(self) -> tuple:
        return _received_with_held_fields, (self.message, self.token, self.written)


def _received_with_held_fields(message: Any, token: int, written: Written) -> Any:
    """The main process, unpickling a worker's message: says which kept fields hold slots (once per
    process), and hands back the message as the worker sent it."""
    pid = os.getpid()
    if pid not in _named:
        sent = _sent.setdefault(token, {})
        sent.update(written)
        kept = held_by_kept_fields(token, sent)
        if kept:
            _named.add(pid)
            warnings.warn(_kept_fields_message(kept), RuntimeWarning, stacklevel=2)
    return message


def held_by_kept_fields(token: int, written: Written) -> Counter[str]:
    """For each key kept from batches this process otherwise dropped: how many of the slots in ``written``
    (of the pool ``token``) it alone holds, found among the live tensors as the garbage collector sees
    them. A slot whose batch is alive whole is not counted: the batch holds it, not a kept field."""
    alive: dict[tuple[int, int], set[str]] = {}
    for item in gc.get_objects():
        if not issubclass(type(item), torch.Tensor):  # not isinstance: a proxy's __class__ may run code
            continue
        where = _C.received_slot_of(item)
        if where is None or where[0] != token or (where[1], where[2]) not in written:
            continue
        offset = item.storage_offset() * item.element_size()
        for start, nbytes, key in written[where[1], where[2]]:
            if start <= offset < start + max(nbytes, 1):
                alive.setdefault((where[1], where[2]), set()).add(key)
                break
    kept: Counter[str] = Counter()
    for batch, keys in alive.items():
        if len(keys) < len({key for _, _, key in written[batch]}):
            kept.update(keys)
    return kept


def _kept_fields_message(kept: Counter[str]) -> str:
    named = ", ".join(f"{key!r} ({count} slot{'s' if count != 1 else ''})"
                      for key, count in kept.most_common())
    return (
        "fastcollate: a DataLoader worker found every shared slot held, and some are held only by fields "
        f"this process kept from batches it otherwise dropped: {named}. A field of a batch under "
        f"{LARGE_BATCH_BYTES >> 20} MiB is a view of the batch's whole slot, so keeping it keeps the slot: "
        "keep a copy instead (its .clone(), or .tolist()), and the slot is free once the rest of the batch "
        "is dropped."
    )
