"""The module paths fastcollate keeps after its modules moved into subpackages: each old name imports the
module itself (one module under two names, never a copy), through an import hook rather than a file at
the old path, so that git follows every moved file.

``fastcollate.lightning``, ``.audit``, ``.bench``, ``.transforms``, ``.worker_slots``, ``.terminal`` and
``.gather`` are the paths the docs have shown users; ``fastcollate.errors`` is where a program imports the
ContractError subclasses it catches (ContractTypeError, ContractValueError, ...). A submodule under
an old name (``fastcollate.bench.ratios``) is the moved submodule too.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType

MOVED = {
    "fastcollate.lightning": "fastcollate.integrations.lightning",
    "fastcollate.audit": "fastcollate.tools.audit",
    "fastcollate.bench": "fastcollate.tools.bench",
    "fastcollate.transforms": "fastcollate.transfer.transforms",
    "fastcollate.worker_slots": "fastcollate.transfer.worker_slots",
    "fastcollate.terminal": "fastcollate.tools.terminal",
    "fastcollate.gather": "fastcollate.collate.gather",
    "fastcollate.errors": "fastcollate.collate.errors",
}


def moved_to(name: str) -> str | None:
    """Where the module ``name`` lives now, or None when it did not move."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return None


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self._own_specs: dict[str, ModuleSpec] = {}  # by old name, while its import runs

    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        new = moved_to(name) if name.startswith("fastcollate.") else None
        if new is None or importlib.util.find_spec(new) is None:
            return None  # not an old name, or none that was ever a module: "No module named" it, as ever
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        module = importlib.import_module(moved_to(spec.name))
        self._own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system gave the module the old name's spec: it keeps its own, which says where it
        # lives (reload, tracebacks).
        module.__spec__ = self._own_specs.pop(module.__spec__.name)


def install() -> None:
    if not any(isinstance(finder, _OldNames) for finder in sys.meta_path):
        sys.meta_path.insert(0, _OldNames())
