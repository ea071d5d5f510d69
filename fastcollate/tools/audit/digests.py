"""Stable 64-bit digests: of string ids, of each sample's row in a collated field, and of (id, digest)
pairs; and which fields ``--targets all`` digests. Every value here is the same in every process, run
and rank (no salted ``hash``): ledgers recorded elsewhere compare by them, so a change to any formula
here breaks saved and gathered ledgers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ...collate.ids import IdentifiedSample
from ...structure import tree

__all__ = ["digest_fields", "digest_rows", "pair_codes", "string_code", "top_level_fields"]


def string_code(text: str | bytes) -> int:
    """The stable 64-bit code of a string id: the same in every process and on every rank (Python's
    ``hash`` is salted per process)."""
    data = text.encode() if isinstance(text, str) else bytes(text)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


_COEFFICIENTS = np.zeros(0, np.uint64)


def _coefficients(width: int) -> np.ndarray:
    """Odd 64-bit multipliers, the same in every process (fixed seed): digests agree across workers,
    runs and ranks. Odd, so that a change in any one 8-byte word always changes the digest."""
    global _COEFFICIENTS
    if _COEFFICIENTS.size < width:
        size = max(width, 2 * _COEFFICIENTS.size, 64)
        rng = np.random.default_rng(0x5EED_FA57)
        _COEFFICIENTS = (
            rng.integers(0, np.iinfo(np.uint64).max, size=size, dtype=np.uint64, endpoint=True) | 1
        )
    return _COEFFICIENTS[:width]


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: spreads every input bit over the whole digest. In place on a copy, with
    one scratch array: fresh temporaries cost more than the arithmetic on large inputs."""
    h = np.array(h, dtype=np.uint64)  # a copy
    scratch = np.empty_like(h)
    with np.errstate(over="ignore"):
        for shift, multiplier in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None)):
            np.right_shift(h, np.uint64(shift), out=scratch)
            h ^= scratch
            if multiplier is not None:
                h *= np.uint64(multiplier)
    return h


def _seed(text: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little"))


def _combine(h: np.ndarray, other: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return _mix(h * np.uint64(0x9E3779B97F4A7C15) + other)


def digest_rows(value: Any, n: int) -> np.ndarray:
    """A uint64 digest per sample of a collated field: per batch, vectorised over its rows.

    Tensors and arrays are hashed by their bytes (dtype and per-sample shape mixed in); lists of
    strings or numbers element by element; mappings and sequences of fields by combining their leaves.
    """
    # This walks mappings and sequences itself rather than through fastcollate.structure.tree: tree names a
    # namedtuple's children by field, this by index, and the names are mixed into the digest, so the
    # values (which other processes and saved ledgers compare) would change.
    if isinstance(value, np.ndarray) and value.dtype != object:
        value = torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, torch.Tensor):
        return _digest_tensor_rows(value, n)
    if isinstance(value, Mapping):
        h = np.full(n, _seed("mapping"), np.uint64)
        for key in sorted(value, key=str):
            h = _combine(h, _mix(digest_rows(value[key], n) ^ _seed(str(key))))
        return h
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) == n and all(isinstance(v, (str, bytes, int, float, bool)) for v in value):
            # one entry per sample: strings, or numbers a custom collate left as Python values
            return _mix(np.fromiter((string_code(repr(v)) for v in value), np.int64, n).view(np.uint64))
        h = np.full(n, _seed("sequence"), np.uint64)
        for index, item in enumerate(value):
            h = _combine(h, _mix(digest_rows(item, n) ^ _seed(str(index))))
        return h
    raise TypeError(f"cannot digest a {type(value).__name__} per sample")


def _digest_tensor_rows(value: torch.Tensor, n: int) -> np.ndarray:
    if value.dim() == 0 or value.shape[0] != n:
        raise ValueError(f"expected {n} rows, got shape {list(value.shape)}")
    t = value.detach().cpu().contiguous()
    seed = _seed(f"{t.dtype}{list(t.shape[1:])}")
    rows = t.reshape(n, -1).view(torch.uint8).numpy() if t.numel() else np.zeros((n, 0), np.uint8)
    width = rows.shape[1]
    if width % 8:
        rows = np.concatenate([rows, np.zeros((n, 8 - width % 8), np.uint8)], axis=1)
    words = np.ascontiguousarray(rows).view(np.uint64)
    with np.errstate(over="ignore"):
        h = (words * _coefficients(words.shape[1])).sum(axis=1, dtype=np.uint64)
    return _mix(h ^ seed)


def digest_fields(values: Iterable[Any], n: int) -> np.ndarray:
    """One uint64 digest per sample over several collated fields (a ledger's ``target_key``), taken
    one at a time: ``values`` may look each field up as it goes."""
    digests = np.full(n, _seed("targets"), np.uint64)
    for value in values:
        digests = _combine(digests, digest_rows(value, n))
    return digests


def pair_codes(ids: np.ndarray, digests: np.ndarray) -> np.ndarray:
    """One 64-bit code per (id, target digest) pair."""
    return _combine(_mix(ids.view(np.uint64)), digests).view(np.int64)


def top_level_fields(sample: Any, id_key: str) -> list[str]:
    """What ``--targets all`` compares: every field of the sample but its id."""
    if isinstance(sample, IdentifiedSample):
        return ["sample"]  # with_ids' wrapper: the dataset's own sample is the one field
    return [name for name, _ in tree.children(sample) or () if name != id_key]
