"""pytest-benchmark: one DataLoader epoch per round, for every embedded data set and worker count, with
default_collate + pin_memory + .to(non_blocking=True), assemble + the same transfer, and
assemble + DeviceLoader. Each group holds the three for one data set and worker count, so

    pytest benchmarks --benchmark-group-by=group --benchmark-compare

shows them side by side. Runs on the GPU when one is visible, else on the CPU (no pinning; DeviceLoader
passes batches through). An epoch is ``BATCHES`` batches over a fixed subset, timed from ``iter()`` to the
last batch on the device (synchronized); persistent workers are started and warmed before the first round.
``python -m fastcollate bench`` is the fuller measurement (wait times, memory, id checks, repetitions).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Subset

import fastcollate
from fastcollate.tools.bench.batches import to_device
from fastcollate.tools.bench.loaders import close_loader
from fastcollate.tools.bench.presets import PRESETS
from fastcollate.transfer.transforms import apply_to_fields

CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
WORKERS = [w for w in (0, 1, 2, 4) if w <= max(CPUS, 1)]
BATCHES = 8
ROUNDS = 3
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VARIANTS = ("default_collate", "assemble", "assemble+DeviceLoader")
SIZES = {"fashion": 60_000, "imagenet": 2_000, "tokens": 5_000, "fields": 5_000}

_datasets: dict[str, object] = {}


def _subset(preset: str) -> tuple[Subset, int]:
    spec = PRESETS[preset]
    if preset not in _datasets:
        _datasets[preset] = spec.make_dataset(SIZES[preset], 0)
    dataset = _datasets[preset]
    count = BATCHES * spec.batch_size
    indices = np.random.default_rng(0).permutation(len(dataset))[:count]
    return Subset(dataset, [int(i) for i in indices]), count


def _epoch(source, transforms: dict | None, moved_by_loader: bool) -> int:
    samples = 0
    for batch in source:
        if not moved_by_loader:
            batch = apply_to_fields(to_device(batch, DEVICE, non_blocking=True), transforms or {})
        samples += int(batch["id"].shape[0])
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return samples


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("workers", WORKERS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("preset", list(PRESETS))
def test_loader_epoch(benchmark, preset: str, workers: int, variant: str) -> None:
    spec = PRESETS[preset]
    dataset, count = _subset(preset)
    if variant == "default_collate":
        collate = spec.default_collate
    else:
        collate = fastcollate.assemble.using(spec.contract()) if spec.contract else fastcollate.assemble
    device_loader = variant.endswith("DeviceLoader")
    transforms = spec.device_transforms() if spec.device_transforms else None
    extra = {"persistent_workers": True, "prefetch_factor": 2} if workers else {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*")
        loader = DataLoader(
            dataset,
            batch_size=spec.batch_size,
            shuffle=False,
            num_workers=workers,
            collate_fn=collate,
            pin_memory=DEVICE.type == "cuda" and not device_loader,
            **extra,
        )
        source = (
            fastcollate.DeviceLoader(loader, device=DEVICE, transforms=transforms)
            if device_loader
            else loader
        )
        benchmark.group = f"loader {preset}, {workers} workers, {DEVICE.type}"
        benchmark.extra_info.update(
            preset=preset,
            workers=workers,
            variant=variant,
            device=DEVICE.type,
            samples_per_round=count,
            batch_size=spec.batch_size,
        )
        try:
            assert _epoch(source, transforms, device_loader) == count  # starts the workers, warms the ring
            delivered = benchmark.pedantic(
                _epoch, args=(source, transforms, device_loader), rounds=ROUNDS, iterations=1
            )
        finally:
            close_loader(loader, source)  # the DeviceLoader, if any, and the persistent workers
    assert delivered == count
    if benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["samples_per_s_median"] = count / benchmark.stats.stats.median
