"""Module-level datasets that break in DataLoader workers, for the fault and lifetime tests (spawn pickles
them by reference), and what those tests measure the process with. Each sample is ``{"id": i, "x": float
tensor full of i}``, so any batch can be checked."""

from __future__ import annotations

import os
import signal
import time

import torch
from torch.utils.data import Dataset, get_worker_info


class Numbered(Dataset):
    """``n`` samples; ``shape`` sets the size of ``x`` (bigger samples make leaks visible in RSS)."""

    def __init__(self, n: int = 64, shape: tuple[int, ...] = (3, 4), delay: float = 0.0) -> None:
        self.n = n
        self.shape = shape
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        if self.delay:
            time.sleep(self.delay)
        return {"id": index, "x": torch.full(self.shape, float(index))}


class _FaultAt(Numbered):
    """Breaks at sample ``bad`` when it is loaded in a worker (the main process can still load it)."""

    def __init__(self, n: int = 64, bad: int = 21, pid_dir: str | None = None, **kwargs) -> None:
        super().__init__(n, **kwargs)
        self.bad = bad
        self.pid_dir = pid_dir

    def __getitem__(self, index: int):
        if self.pid_dir is not None and get_worker_info() is not None:
            open(os.path.join(self.pid_dir, str(os.getpid())), "a").close()  # who took part
        if index == self.bad and get_worker_info() is not None:
            self.fault(index)
        return super().__getitem__(index)

    def fault(self, index: int) -> None:
        raise NotImplementedError


class RaisesAt(_FaultAt):
    """``__getitem__`` raises a ValueError (whose message does not say which sample: many don't)."""

    def fault(self, index: int) -> None:
        raise ValueError("cannot decode this record")


class KillsItselfAt(_FaultAt):
    """The worker loading sample ``bad`` is killed with SIGKILL (as the OOM killer does)."""

    def fault(self, index: int) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


class HangsAt(_FaultAt):
    """The worker loading sample ``bad`` blocks (a dead network mount, a deadlocked decoder)."""

    def fault(self, index: int) -> None:
        time.sleep(3600)


class MalformedAt(_FaultAt):
    """Sample ``bad`` has the wrong shape: assemble's ContractError, raised in the worker."""

    def __getitem__(self, index: int):
        sample = super().__getitem__(index)
        if index == self.bad:
            sample["x"] = sample["x"][:1]
        return sample

    def fault(self, index: int) -> None:
        pass


def child_pids() -> set[int]:
    """The pids of this process's children, every thread's."""
    pids = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as handle:
                pids.update(int(p) for p in handle.read().split())
        except OSError:
            pass  # a thread that just ended
    return pids
