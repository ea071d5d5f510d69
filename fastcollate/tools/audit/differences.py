"""How a delivered epoch's ids differ from a reference's: missing, unexpected, duplicated (with counts)
and changed targets, vectorised, with no Python per sample.

Two ways to the same differences. Ids that fill a range densely (dataset indices: the usual case) go
through bitmaps over that range: no sort, and few large allocations, which on a small machine cost more
than the arithmetic (faulting in a fresh 80 MB array takes a good fraction of a second). Sparse ids
(string codes, arbitrary integers) go through a sort.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .digests import pair_codes
from .epoch import Epoch

__all__ = ["Differences", "copies_by_source", "dense_span", "find_differences"]


class Differences(NamedTuple):
    """How a delivered id array differs from its reference's, before any allowance is made."""

    expected: int  # distinct reference ids
    delivered_unique: int  # distinct delivered ids
    missing: np.ndarray
    unexpected: np.ndarray
    duplicated_ids: np.ndarray
    duplicated_counts: np.ndarray
    reference_repeats: int  # surplus copies in the reference itself
    changed: np.ndarray | None  # ids whose digests differ; None when not compared


def dense_span(reference: np.ndarray | int, ids: np.ndarray) -> tuple[int, int] | None:
    """``(low, span)`` covering every id when that range is at most about twice the ids, else None."""
    lows, highs = [], []
    for array in (ids, reference if isinstance(reference, np.ndarray) else None):
        if array is not None and array.size:
            lows.append(int(array.min()))
            highs.append(int(array.max()))
    if isinstance(reference, int) and reference > 0:
        lows.append(0)
        highs.append(reference - 1)
    if not lows:
        return 0, 0
    low, span = min(lows), max(highs) - min(lows) + 1
    size = reference if isinstance(reference, int) else reference.size
    return (low, span) if span <= 2 * (ids.size + size) + 4096 else None


def find_differences(
    reference: np.ndarray | int,
    reference_digests: np.ndarray | None,
    ids: np.ndarray,
    digests: np.ndarray | None,
) -> Differences:
    """How ``ids`` differ from ``reference`` (an id array, or N for ``0..N-1``); changed targets too
    when both digest arrays are given (aligned by id, so they may come in any order)."""
    span = dense_span(reference, ids)
    if span is not None:
        return _differences_dense(reference, reference_digests, ids, digests, *span)
    return _differences_sorted(reference, reference_digests, ids, digests)


def _differences_dense(
    reference: np.ndarray | int,
    reference_digests: np.ndarray | None,
    ids: np.ndarray,
    digests: np.ndarray | None,
    low: int,
    span: int,
) -> Differences:
    def slots(array: np.ndarray) -> np.ndarray:
        return array - low if low else array  # no copy for ids that start at 0

    got_at = slots(ids)
    in_got = np.zeros(span, bool)
    in_got[got_at] = True
    in_ref = np.zeros(span, bool)
    if isinstance(reference, int):
        ref_at = None
        in_ref[-low : reference - low] = True
        reference_repeats = 0
    else:
        ref_at = slots(reference)
        in_ref[ref_at] = True
        reference_repeats = reference.size - int(np.count_nonzero(in_ref))
    delivered_unique = int(np.count_nonzero(in_got))
    duplicated_ids = duplicated_counts = np.zeros(0, np.int64)
    if delivered_unique < ids.size:
        counts = np.bincount(got_at, minlength=span)
        repeated = np.flatnonzero(counts > 1)
        duplicated_ids, duplicated_counts = repeated + low, counts[repeated]
    changed = None
    if digests is not None and reference_digests is not None and ref_at is not None:
        by_ref = np.zeros(span, np.uint64)
        by_ref[ref_at] = reference_digests
        by_got = np.zeros(span, np.uint64)
        by_got[got_at] = digests  # a repeated id keeps one copy's digest here: the others follow
        changed = np.flatnonzero(in_ref & in_got & (by_ref != by_got)) + low
        if duplicated_ids.size:  # every copy of a repeated id against the reference
            is_repeated = np.zeros(span, bool)
            is_repeated[duplicated_ids - low] = True
            rows = np.flatnonzero(is_repeated[got_at])
            at = got_at[rows]
            differs = in_ref[at] & (digests[rows] != by_ref[at])
            changed = np.union1d(changed, ids[rows][differs])
    return Differences(
        int(np.count_nonzero(in_ref)),
        delivered_unique,
        np.flatnonzero(in_ref & ~in_got) + low,
        np.flatnonzero(in_got & ~in_ref) + low,
        duplicated_ids,
        duplicated_counts,
        reference_repeats,
        changed,
    )


class _Index(NamedTuple):
    unique: np.ndarray  # sorted distinct ids
    counts: np.ndarray | None  # times each was delivered; None when every id came once


def _index(ids: np.ndarray) -> _Index:
    """Distinct ids with counts: one (SIMD) sort, no Python per sample."""
    ordered = np.sort(ids)
    if ordered.size < 2 or not np.any(ordered[1:] == ordered[:-1]):
        return _Index(ordered, None)
    head = np.ones(ordered.size, bool)
    np.not_equal(ordered[1:], ordered[:-1], out=head[1:])
    starts = np.flatnonzero(head)
    del head
    counts = np.diff(np.append(starts, ordered.size))
    return _Index(ordered[starts], counts)


def _member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """``values`` found in ``sorted_set``, as a mask (``np.isin`` without its re-sorting). Fast when
    ``values`` is sorted too or ``sorted_set`` is small: a random probe into a large set misses cache."""
    if sorted_set.size == 0:
        return np.zeros(values.shape, bool)
    position = np.searchsorted(sorted_set, values)
    position[position == sorted_set.size] = 0
    return sorted_set[position] == values


def _difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sorted distinct ids of ``a`` that ``b`` (sorted, distinct) lacks."""
    if a.size == b.size and np.array_equal(a, b):
        return a[:0]
    return a[~_member(a, b)]


def _differences_sorted(
    reference: np.ndarray | int,
    reference_digests: np.ndarray | None,
    ids: np.ndarray,
    digests: np.ndarray | None,
) -> Differences:
    reference = np.arange(reference, dtype=np.int64) if isinstance(reference, int) else reference
    ref, got = _index(reference), _index(ids)
    duplicated_ids = duplicated_counts = np.zeros(0, np.int64)
    if got.counts is not None:
        repeated = got.counts > 1
        duplicated_ids, duplicated_counts = got.unique[repeated], got.counts[repeated]
    changed = None
    if digests is not None and reference_digests is not None:
        changed = _changed_sorted(reference, reference_digests, ids, digests, ref.unique)
    return Differences(
        int(ref.unique.size),
        int(got.unique.size),
        _difference(ref.unique, got.unique),
        _difference(got.unique, ref.unique),
        duplicated_ids,
        duplicated_counts,
        0 if ref.counts is None else int(np.sum(ref.counts - 1)),
        changed,
    )


def _changed_sorted(
    reference: np.ndarray,
    reference_digests: np.ndarray,
    ids: np.ndarray,
    digests: np.ndarray,
    known: np.ndarray,
) -> np.ndarray:
    """Ids (among ``known``, the reference's) delivered at least once with another digest than the
    reference's. Each (id, digest) pair becomes one word, and the two sorted word sets are compared:
    plain sorts, no argsort to align digests by id; ids are looked up only for the pairs that differ."""
    pairs = pair_codes(ids, digests)
    odd = _difference(np.sort(pairs), np.sort(pair_codes(reference, reference_digests)))
    if odd.size == 0:
        return np.zeros(0, np.int64)
    odd = np.unique(odd)
    if odd.size * 8 < ids.size:
        rows = np.flatnonzero(_member(pairs, odd))  # few differ: probe a small set
    else:
        values, order = torch.sort(torch.from_numpy(pairs))
        rows = order.numpy()[_member(values.numpy(), odd)]
    candidates = np.unique(ids[rows])
    return candidates[_member(candidates, known)]


def copies_by_source(
    epoch: Epoch, duplicated_ids: np.ndarray, counts: np.ndarray
) -> list[np.ndarray]:
    """For each duplicated id (sorted), the worker (or rank) of each copy, in delivery order."""
    if duplicated_ids.size * 8 < epoch.ids.size:
        rows = np.flatnonzero(_member(epoch.ids, duplicated_ids))  # few duplicates: probe a small set
        rows = rows[np.argsort(epoch.ids[rows], kind="stable")]
    else:
        order = np.argsort(epoch.ids, kind="stable")
        rows = order[_member(epoch.ids[order], duplicated_ids)]
    return np.split(epoch.workers[rows], np.cumsum(counts)[:-1])
