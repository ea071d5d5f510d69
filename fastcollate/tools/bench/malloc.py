"""glibc malloc tuning for measurements and lifetime tests: fixing the mmap threshold, so that what a
dataset's own allocations cost does not depend on what ran before, and saying which settings a process
runs under (a report states it: these settings move fresh-allocation figures by up to 2x).

Each setter is a ``worker_init_fn`` too, and to call in the main process. On a C library other than
glibc they do nothing.
"""

from __future__ import annotations

import os

__all__ = ["fixed_mmap_threshold", "malloc_settings", "samples_on_the_heap"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_NAMES = {_M_TRIM_THRESHOLD: "trim threshold", _M_MMAP_THRESHOLD: "mmap threshold"}
_fixed_here: dict[int, int] = {}  # what this process set, for malloc_settings


def fixed_mmap_threshold(worker_id: int | None = None) -> None:
    """Fixes glibc's mmap threshold at 32 KiB; a ``worker_init_fn``, and to call in the main process.

    glibc otherwise raises the threshold each time a large block is freed, so whether a 150 KB sample
    clone is a fresh mmap (a page fault per 4 KiB) or heap memory depends on what ran before: a
    contender that follows another one gets different memory than it would alone. Fixed, every contender
    (and every lifetime test) sees the same allocator.
    """
    _mallopt((_M_MMAP_THRESHOLD, 32 * 1024))  # below any image sample


def samples_on_the_heap(worker_id: int | None = None) -> None:
    """Fixes glibc's mmap threshold (and trim threshold) high, so sample-sized blocks are reused heap
    memory rather than fresh mappings; a ``worker_init_fn``, and to call in the main process.

    The bench's choice for loader throughput: a dataset's own allocations then cost what a well-tuned
    allocator costs (no page fault per 4 KiB of every sample), for every contender alike, so what differs
    is the loader's path.
    """
    # Blocks below 64 MiB come from the heap; freed heap memory stays there for the next sample.
    _mallopt((_M_MMAP_THRESHOLD, 64 << 20), (_M_TRIM_THRESHOLD, 256 << 20))


def malloc_settings() -> str:
    """The malloc settings this process runs under, in words: what it fixed through this module and any
    ``MALLOC_*`` or ``GLIBC_TUNABLES`` variable in its environment; ``"glibc defaults"`` when neither."""
    parts = [f"{_NAMES[parameter]} {_in_words(value)}" for parameter, value in sorted(_fixed_here.items())]
    parts += [f"{key}={value}" for key, value in sorted(os.environ.items())
              if key.startswith(("MALLOC_", "GLIBC_TUNABLES"))]
    return ", ".join(parts) or "glibc defaults"


def _in_words(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def _mallopt(*settings: tuple[int, int]) -> None:
    """Sets glibc malloc parameters (fixing them also stops glibc adjusting them); nothing elsewhere."""
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return  # not glibc: nothing to fix
    for parameter, value in settings:
        mallopt(parameter, value)
        _fixed_here[parameter] = value
