"""The audit across ``torch.distributed`` ranks: every rank's epoch gathered, and their union checked
against the dataset, up to what ``DistributedSampler`` documents it pads or drops."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from .checks import as_reference, compare, reference_size
from .epoch import Epoch
from .ledger import Ledger
from .report import AuditReport

__all__ = ["SamplerAllowance", "check_distributed", "gather_epochs"]


def check_distributed(
    source: Ledger | Epoch,
    expected: int | Iterable,
    *,
    sampler_drop_last: bool = False,
    drop_last: bool = False,
    batch_size: int | None = None,
    group: Any = None,
) -> AuditReport:
    """Gathers every rank's epoch and checks their union against the dataset: complete, and disjoint
    up to ``DistributedSampler``'s documented padding. Call it on every rank (it is a collective);
    every rank gets the same report. Without an initialized process group it checks this process alone.

    Args:
        source: this rank's ledger (its last epoch) or epoch.
        expected: the dataset's ids, as for ``check``.
        sampler_drop_last: the DistributedSampler's ``drop_last``: it leaves out the tail instead of
            padding with repeats.
        drop_last, batch_size: each rank's DataLoader ``drop_last``: up to ``num_samples % batch_size``
            more ids left out per rank.
        group: the process group (the default one when None).
    """
    epoch = source.last if isinstance(source, Ledger) else source
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    union, world = gather_epochs(epoch, group) if distributed else (_with_rank_zero(epoch), 1)
    reference = as_reference(expected, union)
    size = reference_size(reference)
    allowance = SamplerAllowance.of(size, world, sampler_drop_last, drop_last, batch_size)
    report = compare(
        reference,
        union,
        order="any",
        dataset_size=size,
        allowed_dropped=allowance.dropped,
        allowed_repeats=allowance.padding,
        what=f"{world} ranks together against the dataset",
        source_kind="rank",
    )
    if not distributed:
        report.notes.append("torch.distributed is not initialized: checked this process alone")
    return report


def gather_epochs(epoch: Epoch, group: Any = None) -> tuple[Epoch, int]:
    """Every rank's ids as one epoch whose ``workers`` hold the rank of each, and the world size.
    A collective: every rank of ``group`` must call it."""
    world = torch.distributed.get_world_size(group)
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, {"ids": epoch.ids, "names": epoch.names}, group=group)
    return _union(gathered), world


def _with_rank_zero(epoch: Epoch) -> Epoch:
    return _union([{"ids": epoch.ids, "names": epoch.names}])


def _union(gathered: list[dict]) -> Epoch:
    ids = np.concatenate([np.asarray(p["ids"], np.int64) for p in gathered])
    ranks = np.repeat(np.arange(len(gathered), dtype=np.int16), [len(p["ids"]) for p in gathered])
    names = {k: v for p in gathered for k, v in (p["names"] or {}).items()} or None
    return Epoch(ids=ids, workers=ranks, names=names)


@dataclasses.dataclass(frozen=True)
class SamplerAllowance:
    """What a DistributedSampler (and each rank's DataLoader ``drop_last``) accounts for.

    Attributes:
        padding: repeated deliveries: the sampler pads every rank to ``num_samples``.
        dropped: ids left out: the sampler's own tail (its ``drop_last``) and each rank's loader tail.
    """

    padding: int
    dropped: int

    @classmethod
    def of(
        cls, size: int, world: int, sampler_drop_last: bool, drop_last: bool, batch_size: int | None
    ) -> SamplerAllowance:
        # DistributedSampler: num_samples per rank, padded with repeats up to a multiple of the world
        # size, or (sampler drop_last) cut down to one.
        if sampler_drop_last and size % world:
            per_rank = math.ceil((size - world) / world)
        else:
            per_rank = math.ceil(size / world)
        total = per_rank * world
        loader_dropped = world * (per_rank % batch_size) if drop_last and batch_size else 0
        return cls(padding=max(total - size, 0), dropped=max(size - total, 0) + loader_dropped)
