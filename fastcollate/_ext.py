"""Loads the compiled core, with a message that says how to build it when it is missing."""

from __future__ import annotations

try:
    import torch  # noqa: F401  (libtorch must be loaded before the extension)

    from . import _C
except ImportError as error:  # pragma: no cover - exercised by tests in a subprocess
    raise ImportError(
        "fastcollate's compiled core (fastcollate._C) is not built or does not match this torch "
        f"({error}). Build it from the source checkout with `make build`, or "
        "`pip install --no-build-isolation -e .` with torch already installed."
    ) from error

__all__ = ["_C"]
