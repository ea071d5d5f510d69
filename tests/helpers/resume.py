"""What the resume tests share: a dataset whose sample i is i, a state's trip through torch.save and
torch.load(weights_only=True), as a checkpoint takes it, and ``doctor`` run on a factory file."""

from __future__ import annotations

import hashlib
import io
import textwrap
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


def assert_every_sample(counts, kind: str, allowance: int, what: str, n: int) -> None:
    """Every one of the ``n`` samples came (``counts``: id -> deliveries); TokenBudgetBatches' (``kind``
    "tokens") once each, IndexBatches' with at most ``allowance`` repeats (its padding)."""
    missing = sorted(set(range(n)) - set(counts))
    repeats = sum(counts.values()) - len(counts)
    assert not missing, f"{what}: {len(missing)} samples never delivered: {missing}"
    if kind == "tokens":
        assert repeats == 0, f"{what}: {repeats} repeats"
    else:
        assert repeats <= allowance, f"{what}: {repeats} repeats, over the allowance of {allowance}"


WRONG_WHEN_RESUMED = """
class {name}({base}):
    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.misplaced = {wrong_when}

    def __iter__(self):
        misplaced, self.misplaced = getattr(self, "misplaced", False), False
        for number, batch in enumerate(super().__iter__()):
            if misplaced and number == 0:
                {action}
            yield batch
"""


def wrong_when_resumed(base: str, wrong_when: str, action: str, name: str = "Wrong") -> str:
    """The source of a factory's sampler class ``name``, a ``base`` wrong after some checkpoints:
    ``wrong_when`` (an expression of the ``state`` it loads) decides which, ``action`` (a statement) is
    what it does to its first batch after them (``continue`` skips it, ``yield batch`` repeats it)."""
    return WRONG_WHEN_RESUMED.format(name=name, base=base, wrong_when=wrong_when, action=action)


def state_after(sampler, batches: int) -> dict:
    """``sampler``'s state after it handed out its first ``batches`` batches of the epoch."""
    taken = iter(sampler)
    for _ in range(batches):
        next(taken)
    return sampler.state_dict()


def through_disk(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def doctor(argv, capsys):
    """``python -m fastcollate doctor`` with ``argv``, in this process: its exit status and what it
    printed."""
    from fastcollate.tools.audit.doctor import main

    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out + captured.err


def factory(tmp_path, name, source):
    """A factory module holding ``source`` (dedented) in ``tmp_path``: its ``make``, as --dataset takes it.
    The module's name is ``name`` and a digest of the source: a factory file is imported by its name,
    once a process, so two sources must not share one."""
    source = textwrap.dedent(source)
    path = tmp_path / f"{name}_{hashlib.blake2b(source.encode(), digest_size=4).hexdigest()}.py"
    path.write_text(source)
    return f"{path}:make"
