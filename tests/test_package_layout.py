"""The package's shape: its parts by concern, the tools loaded only when named, and the old module names
kept as the moved modules themselves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fastcollate"


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_fastcollate_loads_none_of_its_tools():
    loaded = run(
        "import sys, fastcollate; print(sorted(m for m in sys.modules if m.startswith('fastcollate.tools')"
        " or m in ('fastcollate.audit', 'fastcollate.bench', 'fastcollate.lightning')))"
    )
    assert loaded == "[]"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("fastcollate.audit", "fastcollate.tools.audit"),
        ("fastcollate.bench", "fastcollate.tools.bench"),
        ("fastcollate.bench.ratios", "fastcollate.tools.bench.ratios"),
        ("fastcollate.errors", "fastcollate.collate.errors"),
        ("fastcollate.tree", "fastcollate.collate.tree"),
        ("fastcollate.transforms", "fastcollate.transfer.transforms"),
        ("fastcollate.worker_slots", "fastcollate.transfer.worker_slots"),
        ("fastcollate.terminal", "fastcollate.tools.terminal"),
        ("fastcollate.gather", "fastcollate.collate.gather"),
    ],
)
def test_an_old_module_name_is_the_moved_module_itself_with_its_own_spec(old, new):
    shown = run(
        f"import importlib; old = importlib.import_module({old!r}); new = importlib.import_module({new!r}); "
        "print(old is new, old.__name__, old.__spec__.name)"
    )
    assert shown == f"True {new} {new}"


def test_a_name_that_never_was_a_module_is_still_not_found():
    with pytest.raises(ModuleNotFoundError, match="fastcollate.nothing_here"):
        __import__("fastcollate.nothing_here")
    with pytest.raises(ModuleNotFoundError, match="fastcollate.audit.nothing_here"):
        __import__("fastcollate.audit.nothing_here")
