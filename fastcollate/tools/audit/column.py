"""The ledger's storage: a 1-D array that grows by blocks, sized for tens of millions of ids."""

from __future__ import annotations

import numpy as np

__all__ = ["GrowingColumn"]


class GrowingColumn:
    """A growing 1-D array stored in blocks: appending never moves what is stored, and ``finish``
    builds the final array block by block, so the peak is one copy plus a block, not a doubling
    buffer's 2x (which would take 10 million int64 ids past 200 MB)."""

    FIRST_BLOCK = 4096
    MAX_BLOCK = 1 << 20

    def __init__(self, dtype: np.dtype | type) -> None:
        self.dtype = np.dtype(dtype)
        self.blocks: list[np.ndarray] = []
        self.fill = 0  # items used in the last block
        self.size = 0

    def append(self, values: np.ndarray) -> None:
        values = np.asarray(values).reshape(-1)
        done = 0
        while done < values.size:
            if not self.blocks or self.fill == self.blocks[-1].size:
                grow = self.FIRST_BLOCK if not self.blocks else min(2 * self.blocks[-1].size, self.MAX_BLOCK)
                self.blocks.append(np.empty(grow, self.dtype))
                self.fill = 0
            block = self.blocks[-1]
            take = min(block.size - self.fill, values.size - done)
            block[self.fill : self.fill + take] = values[done : done + take]
            self.fill += take
            done += take
        self.size += values.size

    def finish(self) -> np.ndarray:
        out = np.empty(self.size, self.dtype)
        position = 0
        while self.blocks:
            block = self.blocks.pop(0)  # freed as soon as it is copied
            take = min(block.size, self.size - position)
            out[position : position + take] = block[:take]
            position += take
        self.fill = self.size = 0
        return out
