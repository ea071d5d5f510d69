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


class Stream(torch.utils.data.IterableDataset):
    """``n`` samples ``{"id", "x"}``, split between the workers by id."""

    def __init__(self, n: int = 48) -> None:
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers, me = (info.num_workers, info.id) if info is not None else (1, 0)
        for index in range(me, self.n, workers):
            yield {"id": index, "x": torch.full((4, 16), float(index))}


class _FaultAfterAssembling:
    """A collate_fn: ``assemble``, then ``fault`` on the batch that holds sample ``bad``."""

    def __init__(self, assembler, bad: int) -> None:
        self.assembler = assembler
        self.bad = bad

    def __call__(self, samples):
        batch = self.assembler(samples)
        if any(sample["id"] == self.bad for sample in samples):
            batch = self.fault(batch)
        return batch


class KillsItselfAfterAssembling(_FaultAfterAssembling):
    """SIGKILL on the batch that holds sample ``bad`` (the slot is claimed and written, not yet sent: a
    worker dying mid-write, as to the main process it is)."""

    def fault(self, batch):
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


class ChangesTheBatch:
    """A collate_fn wrapping ``assemble`` that changes the batch in the worker: a new tensor, a view of
    the slot, and the first batch kept and sent again (a cache, say) after the next one."""

    def __init__(self, assembler) -> None:
        self.assembler = assembler
        self.kept = None
        self.calls = 0

    def __call__(self, samples):
        batch = self.assembler(samples)
        self.calls += 1
        if self.calls == 2 and self.kept is not None:
            return self.kept  # sent a second time: must arrive intact, the ordinary way
        out = {"id": batch["id"], "doubled": batch["x"] * 2, "first_column": batch["x"][:, :, :1]}
        if self.kept is None:
            self.kept = out
        return out


class SlotDescriptorsInheritable(Dataset):
    """``n`` samples; each says how many descriptors of a fastcollate slot pool this worker holds that a
    program it started would inherit (those without close-on-exec)."""

    def __init__(self, n: int = 8) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        import fcntl
        import os

        inheritable = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
                flags = fcntl.fcntl(int(fd), fcntl.F_GETFD)
            except OSError:
                continue  # the listing's own descriptor, closed already
            if "fastcollate-slots" in target and not flags & fcntl.FD_CLOEXEC:
                inheritable += 1
        return {"id": index, "inheritable": inheritable, "x": torch.zeros(4)}


class UnpicklableAt(_FaultAfterAssembling):
    """A lock (which cannot be pickled) added to the batch that holds sample ``bad``: the worker's queue
    fails to send that batch after pickling its slot tensors."""

    def fault(self, batch):
        import threading

        batch["lock"] = threading.Lock()
        return batch
