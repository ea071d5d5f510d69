"""Module-level datasets for tests that start DataLoader workers (spawn pickles them by reference)."""

import numpy as np
import torch
from torch.utils.data import Dataset


class Records(Dataset):
    """Deterministic mixed records: an image, a label, a name, nested metadata, a numpy field."""

    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        generator = torch.Generator().manual_seed(index)
        return {
            "id": index,
            "image": torch.randint(0, 256, (3, 8, 8), generator=generator, dtype=torch.uint8),
            "label": index % 7,
            "name": f"rec-{index}",
            "meta": {"weight": float(index) / 3, "vec": np.arange(4, dtype=np.float32) * index},
        }


class BadFourth(Records):
    """Sample 3 has one channel instead of three."""

    def __getitem__(self, index: int):
        sample = super().__getitem__(index)
        if index == 3:
            sample["image"] = sample["image"][:1]
        return sample
