"""The measurement side of fastcollate: ``python -m fastcollate bench`` and ``profile``, the embedded data
sets and models they run, and the ``module:factory`` loader that ``bench`` and ``doctor`` share.

Importing the package imports none of its modules (``fastcollate.audit`` imports ``bench.factory`` alone,
and matplotlib or tqdm load only when a command draws or shows progress).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fastcollate bench``, as ``fastcollate.bench.main`` was before the package."""
    from .command import main as bench_main

    return bench_main(argv)
