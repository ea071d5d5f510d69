"""Data sets for the bench and profile tests: tiny, module-level (so workers can unpickle them), and one
that is deliberately wrong."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


def _sample(i: int) -> dict:
    return {"id": i, "x": torch.full((4,), float(i)), "target": i % 3}


class DropsOneInWorkers(IterableDataset):
    """Streams ids 0..size-1, split between workers, but a worker silently skips ``dropped``:
    correct with num_workers=0, one sample short with any workers. The bench must flag it."""

    def __init__(self, size: int = 96, dropped: int = 5) -> None:
        self.size = size
        self.dropped = dropped

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.size, step):
            if info is not None and i == self.dropped:
                continue
            yield _sample(i)


def drops_one_in_workers() -> DropsOneInWorkers:
    return DropsOneInWorkers()


class Tiny(Dataset):
    """A correct map-style data set of small dict samples."""

    def __init__(self, size: int = 96) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        return _sample(index)


def tiny(size: int = 96) -> dict:
    """The factory form that returns a mapping: a data set and a batch size."""
    return {"dataset": Tiny(size), "batch_size": 16}


class WrongIdInWorkers(Tiny):
    """Map-style, but in a worker sample 3 comes back as sample 4: one lost, one duplicated."""

    def __getitem__(self, index: int) -> dict:
        if get_worker_info() is not None and index == 3:
            index = 4
        return _sample(index)


def wrong_id_in_workers() -> WrongIdInWorkers:
    return WrongIdInWorkers(24)


class RaisesAt(Tiny):
    """Map-style, but sample ``bad`` raises: the bench records the configuration's error and goes on."""

    def __init__(self, size: int = 96, bad: int = 40) -> None:
        super().__init__(size)
        self.bad = bad

    def __getitem__(self, index: int) -> dict:
        if index == self.bad:
            raise ValueError(f"sample {index} is unreadable")
        return _sample(index)


def raises_in_the_third_batch() -> dict:
    return {"dataset": RaisesAt(96, bad=40), "batch_size": 16}


class Slowed:
    """A collate function that sleeps ``seconds`` per batch before collating: a loader made slow on
    purpose, which a loader-only figure must show."""

    def __init__(self, collate, seconds: float) -> None:
        self.collate = collate
        self.seconds = seconds

    def __call__(self, samples):
        time.sleep(self.seconds)
        return self.collate(samples)


class CountingCalls:
    """A device transform that counts its calls and returns its input: where it runs, it shows."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, value):
        self.calls += 1
        return value


def tiny_with_device_transform_and_step() -> dict:
    """Tiny data with a counting device transform on ``x`` and a step that does nothing, so the bench
    runs both observations."""
    return {
        "dataset": Tiny(96),
        "batch_size": 16,
        "device_transforms": {"x": CountingCalls()},
        "step": lambda batch: None,
    }


def own_collate(rows: list) -> dict:
    """A user's own collate, which tells a batch of samples by ``isinstance(rows, list)`` as Hugging Face's
    collators do, and passes every key through."""
    assert isinstance(rows, list), f"a batch of samples is a list, got {type(rows).__name__}"
    return {key: torch.stack([torch.as_tensor(row[key]) for row in rows]) for key in rows[0]}


def arrays_with_own_collate_and_an_id_less_contract() -> dict:
    """Arrays without ids, a user's own collate as the baseline, a contract that declares no id: the
    bench attaches ids for its audit, and every configuration must still deliver every sample once."""
    import fastcollate

    dataset = fastcollate.Arrays(x=torch.arange(64.0), y=torch.arange(64) % 3)
    contract = fastcollate.Contract(
        {"x": fastcollate.Field(shape=()), "y": fastcollate.Field(kind="number")}, id=None
    )
    return {"dataset": dataset, "collate": own_collate, "contract": contract, "batch_size": 8}
