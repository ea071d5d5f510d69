"""What the resume tests share: a dataset whose sample i is i, and a state's trip through torch.save
and torch.load(weights_only=True), as a checkpoint takes it."""

from __future__ import annotations

import io
import time

import torch
from torch.utils.data import Dataset


class Indices(Dataset):
    """Sample i is i, after ``delay`` seconds (so a worker can be caught mid-epoch): a batch is the
    indices it was made from."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if self.delay:
            time.sleep(self.delay)
        return int(index)


def through_disk(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)
