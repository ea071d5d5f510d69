"""The one measurement of a bare pinned-to-device copy, the host link's ceiling that the bench and
``benchmarks/gpu_bench.py`` both hold DeviceLoader's copies against (one method, so their figures compare).
"""

from __future__ import annotations

import torch

__all__ = ["pinned_copy_gbps"]


def pinned_copy_gbps(
    nbytes: int, device: torch.device | str, repeats: int = 20, warmup: int = 3
) -> list[float]:
    """GB/s (1e9 bytes a second) of each of ``repeats`` plain ``copy_`` of one pinned buffer of ``nbytes``
    to ``device``, timed with CUDA events on the current stream, after ``warmup`` untimed ones.

    Every run is returned: callers take the median and keep the runs in their JSON.

    Raises:
        ValueError: ``device`` is not a CUDA device, or ``nbytes`` is not positive.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"a pinned copy is measured to a CUDA device, got {device}")
    if nbytes <= 0:
        raise ValueError(f"a pinned copy needs at least one byte, got nbytes={nbytes}")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
    runs = []
    for index in range(warmup + repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dest.copy_(host, non_blocking=True)
        stop.record()
        stop.synchronize()
        if index >= warmup:  # the first copies pay for the link's and the allocator's first use
            runs.append(nbytes / (start.elapsed_time(stop) * 1e-3) / 1e9)
    return runs
