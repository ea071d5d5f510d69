"""The measurement side of fastcollate: ``python -m fastcollate bench`` and ``profile``, and the embedded
data sets and models they run (the ``module:factory`` loader that ``bench`` and ``doctor`` share is
``fastcollate.tools.factory_spec``).

Importing the package imports none of its modules (matplotlib or tqdm load only when a command draws or
shows progress); the rest of fastcollate imports it only to run those two verbs.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fastcollate bench``, as ``fastcollate.bench.main`` was before the package."""
    from .command import main as bench_main

    return bench_main(argv)
