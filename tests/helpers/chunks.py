"""Columns cut into pieces at random rows, as Arrow stores them: the gathers must give the same batch
whatever the chunking."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from fastcollate import Chunked, Ragged


@st.composite
def cuts(draw, rows: int) -> list[int]:
    """Where a column of ``rows`` rows is cut: sorted row numbers within it (empty pieces included)."""
    return sorted(draw(st.lists(st.integers(0, rows), max_size=5)))


def chunked(column, at: list[int]):
    """``column`` (rows, or a Ragged with offsets from 0) as a Chunked cut at rows ``at``; unchanged when
    there is no cut."""
    if not at:
        return column
    bounds = [0, *at, len(column.offsets) - 1 if isinstance(column, Ragged) else len(column)]
    pieces = []
    for start, stop in zip(bounds, bounds[1:], strict=False):
        if isinstance(column, Ragged):
            offsets = np.asarray(column.offsets)[start : stop + 1]
            pieces.append(Ragged(column.values[int(offsets[0]) : int(offsets[-1])], offsets - offsets[0]))
        else:
            pieces.append(column[start:stop])
    return Chunked(pieces)
