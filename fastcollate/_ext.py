"""Loads the compiled core, with a message that says how to build it when it is missing and, when the
fastcollate imported is a source folder without its build, that this folder hides an installed one."""

from __future__ import annotations

import json
import os
import sys
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent


def installed_elsewhere() -> Path | None:
    """Another fastcollate this one shadows: a package folder further down sys.path, or the folder pip
    installed (an editable install's checkout included), when it is not this one."""
    for entry in sys.path:
        folder = Path(entry or os.getcwd()).resolve() / "fastcollate"
        if folder != HERE and (folder / "__init__.py").is_file():
            return folder
    try:
        dist = metadata.distribution("fastcollate")
    except metadata.PackageNotFoundError:
        return None
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    folder = Path(url[len("file://") :]) / "fastcollate" if url.startswith("file://") else None
    folder = folder or Path(dist.locate_file("fastcollate"))
    folder = folder.resolve()
    return folder if folder != HERE and (folder / "__init__.py").is_file() else None


def missing_core(error: ImportError) -> str:
    built = any(HERE.glob("_C*"))
    what = (
        f"fastcollate's compiled core (fastcollate._C) does not match this torch ({error})"
        if built
        else f"fastcollate's compiled core (fastcollate._C) is not built in {HERE} (no _C*.so there)"
    )
    build = (
        "build it in place with `make build` (or `pip install --no-build-isolation -e .`, torch installed)"
    )
    other = installed_elsewhere()
    in_checkout = HERE.parent == Path.cwd().resolve() and (HERE.parent / "setup.py").is_file()
    if other is not None:
        return (
            f"{what}. This is the source folder, found first on sys.path"
            f"{' (the current folder is the checkout)' if in_checkout else ''}, and it shadows the "
            f"fastcollate installed at {other}: run from another folder to import that one, or {build}."
        )
    if in_checkout:
        return (
            f"{what}. The current folder is the checkout, so Python imports its source folder: {build}, or, "
            "with fastcollate installed by `pip install --no-build-isolation .`, run from another folder."
        )
    return f"{what}. From the source checkout, {build}."


try:
    import torch  # noqa: F401  (libtorch must be loaded before the extension)

    from . import _C

    if Path(_C.__file__).resolve().parent != HERE:
        # An editable install's import hook lends a source folder without its build that install's core,
        # which need not match this folder's code: this folder is unbuilt, as if nothing had been found.
        raise ImportError(f"fastcollate._C was found at {_C.__file__}, outside {HERE}")
except ImportError as error:  # pragma: no cover - exercised by tests in a subprocess
    raise ImportError(missing_core(error)) from error

__all__ = ["_C"]
