"""Loading a user's ``module:factory`` (or ``path/to/file.py:factory``) spec: the object it names,
as ``bench --dataset`` and ``doctor`` take it from the command line. Apart from both, so that the
audit does not import the bench."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

__all__ = ["load_factory"]


def load_factory(spec: str) -> Any:
    """The object ``spec`` names, not called: what to do with it is the caller's business.

    A module path is imported by name, with the working directory on ``sys.path``; a file path
    (ending in ``.py`` or holding a path separator) puts the file's folder on ``sys.path`` and imports
    the file by its stem, so that forked or spawned workers can import it by name too.

    Args:
        spec: ``module:attribute`` or ``path/to/file.py:attribute``; the attribute may be dotted
            (``module:Class.factory``).

    Raises:
        ValueError: ``spec`` lacks the module or the attribute.
        FileNotFoundError: ``spec`` names a file that does not exist.
        ImportError: the module cannot be imported.
        AttributeError: the module has no such attribute.
    """
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise ValueError(f"expected module:factory or path/to/file.py:factory, got {spec!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        path = os.path.abspath(module_name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no file {module_name}")
        sys.path.insert(0, os.path.dirname(path))
        module_name = os.path.splitext(os.path.basename(path))[0]
    elif os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target
