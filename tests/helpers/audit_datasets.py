"""Small datasets for the audit and doctor tests: clean ones, and ones broken on purpose, each failing
in one known way on known ids. Module-level classes and factories, so that spawned workers and
``python -m fastcollate doctor tests.helpers.audit_datasets:<factory>`` can import them."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


def image(index: int, channels: int = 3) -> torch.Tensor:
    return torch.full((channels, 16, 16), index % 251, dtype=torch.uint8)


class Records(Dataset):
    """``{"id", "x": uint8 [3, 16, 16], "y"}`` records; ``with_id=False`` leaves the id out."""

    def __init__(self, size: int = 12, with_id: bool = True) -> None:
        self.size = size
        self.with_id = with_id

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.size:
            raise IndexError(index)
        record = {"x": image(index), "y": index % 4}
        if self.with_id:
            record["id"] = index
        return record


class OneChannelFourth(Records):
    """The seeds' example: records 0-2 are [3, 16, 16], the 4th (index 3) is [1, 16, 16]."""

    def __getitem__(self, index: int) -> dict:
        record = super().__getitem__(index)
        if index == 3:
            record["x"] = image(index, channels=1)
        return record


class NamedRecords(Records):
    """String ids, as a file-backed dataset would have them."""

    def __getitem__(self, index: int) -> dict:
        record = super().__getitem__(index)
        record["id"] = f"rec-{index:03d}"
        return record


class TargetsChangeInWorkers(Records):
    """Sample 5's target differs when read in a worker (per-process state gone wrong)."""

    def __getitem__(self, index: int) -> dict:
        record = super().__getitem__(index)
        if index == 5 and get_worker_info() is not None:
            record["y"] += 1
        return record


class StaleCacheInWorkers(Records):
    """In a worker, index 7 returns the cached previous record: id 6 twice, id 7 never."""

    def __getitem__(self, index: int) -> dict:
        if index == 7 and get_worker_info() is not None:
            index = 6
        return super().__getitem__(index)


class BrokenFile(Records):
    """Index 5's file cannot be read (raw access fails)."""

    def __getitem__(self, index: int) -> dict:
        if index == 5:
            raise OSError("cannot read /data/secret-patient-0005.png")  # a message that quotes the sample
        return super().__getitem__(index)


class Flip:
    """A transform that fails on one image (a picklable module-level class)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if int(x[0, 0, 0]) == 6:
            raise ValueError("pixel value 6 is not allowed")
        return x.flip(-1)


class WithTransform(Records):
    """torchvision style: ``transform`` applied in ``__getitem__``; it fails on index 6."""

    def __init__(self, size: int = 12) -> None:
        super().__init__(size)
        self.transform = Flip()

    def __getitem__(self, index: int) -> dict:
        record = super().__getitem__(index)
        if self.transform is not None:
            record["x"] = self.transform(record["x"])
        return record


class StuckInWorkers(Records):
    """Reading index 5 in a worker never finishes (a network mount that hangs)."""

    def __getitem__(self, index: int) -> dict:
        if index == 5 and get_worker_info() is not None:
            time.sleep(600)
        return super().__getitem__(index)


class StuckEverywhere(Records):
    """Reading index 2 never finishes, in any process."""

    def __getitem__(self, index: int) -> dict:
        if index == 2:
            time.sleep(600)
        return super().__getitem__(index)


class FailsInWorkers(Records):
    """Index 9 fails only in a worker (a handle opened in the parent, unusable after the fork)."""

    def __getitem__(self, index: int) -> dict:
        if index == 9 and get_worker_info() is not None:
            raise RuntimeError("handle closed")
        return super().__getitem__(index)


class ShapeChangesByBatch(Records):
    """Indices 4-7 are one-channel: each batch of 4 stacks, but the batches differ (and the
    representative samples 0, 8, 15 agree)."""

    def __getitem__(self, index: int) -> dict:
        record = super().__getitem__(index)
        if 4 <= index < 8:
            record["x"] = image(index, channels=1)
        return record


class WholeStream(IterableDataset):
    """The classic bug: every worker yields the whole stream."""

    def __init__(self, size: int = 12) -> None:
        self.size = size

    def __iter__(self):
        for index in range(self.size):
            yield {"id": index, "x": image(index), "y": index % 4}


class ShardedStream(WholeStream):
    """The fix: each worker yields its own share."""

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for index in range(start, self.size, step):
            yield {"id": index, "x": image(index), "y": index % 4}


class ExhaustedStream(ShardedStream):
    """A worker opens its source once and never rewinds it: a second epoch in a kept (persistent)
    worker finds it exhausted. The main process opens a fresh one each time."""

    def __init__(self, size: int = 12) -> None:
        super().__init__(size)
        self._source = None

    def __iter__(self):
        if get_worker_info() is None:
            yield from super().__iter__()
            return
        if self._source is None:
            self._source = super().__iter__()
        yield from self._source


class StreamWithoutIds(IterableDataset):
    def __iter__(self):
        for index in range(4):
            yield {"x": image(index), "y": 0}


# Factories, as ``python -m fastcollate doctor tests.helpers.audit_datasets:<name>`` takes them.


def clean() -> Dataset:
    return Records(12, with_id=False)


def clean_with_ids() -> Dataset:
    return Records(12)


def named() -> Dataset:
    return NamedRecords(12)


def one_channel_fourth() -> Dataset:
    return OneChannelFourth(8)


def targets_change() -> Dataset:
    return TargetsChangeInWorkers(12)


def stale_cache() -> Dataset:
    return StaleCacheInWorkers(12)


def broken_file() -> Dataset:
    return BrokenFile(12)


def failing_transform() -> Dataset:
    return WithTransform(12)


def stuck_in_workers() -> Dataset:
    return StuckInWorkers(12)


def stuck_everywhere() -> Dataset:
    return StuckEverywhere(12)


def fails_in_workers() -> Dataset:
    return FailsInWorkers(12)


def shape_changes_by_batch() -> Dataset:
    return ShapeChangesByBatch(16)


def whole_stream() -> IterableDataset:
    return WholeStream(12)


def sharded_stream() -> IterableDataset:
    return ShardedStream(12)


def exhausted_stream() -> IterableDataset:
    return ExhaustedStream(12)


def stream_without_ids() -> IterableDataset:
    return StreamWithoutIds()


def arrays() -> Dataset:
    """Data already in arrays (fastcollate.Arrays): its batches arrive gathered by index."""
    import fastcollate

    return fastcollate.Arrays(image=torch.stack([image(i) for i in range(24)]), y=torch.arange(24) % 3)
