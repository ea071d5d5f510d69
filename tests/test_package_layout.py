"""The package's shape: its parts by concern, the tools loaded only when named, the old module names kept
as the moved modules themselves, each module and C++ source under 500 lines, no module reaching into
another's privates, and benchmarks/ importing its shared parts as a package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.processes import run_side_by_side

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fastcollate"

# Each in a fresh interpreter at the checkout's root, all side by side (fixture ``imports``).
LOADS_NO_TOOLS = (
    "import sys, fastcollate; "
    "tools = lambda: sorted(m for m in sys.modules if m.startswith('fastcollate.tools') "
    "or m in ('fastcollate.audit', 'fastcollate.lightning', 'fastcollate.ray')); "
    "print(tools()); ledger = fastcollate.Ledger; "
    "print(ledger.__module__, fastcollate.audit.Ledger is ledger, "
    "'fastcollate.tools.bench' in sys.modules)"
)
MOVED = {
    "fastcollate.audit": "fastcollate.tools.audit",
    "fastcollate.lightning": "fastcollate.integrations.lightning",
    "fastcollate.ray": "fastcollate.integrations.ray",
    "fastcollate.errors": "fastcollate.collate.errors",
}


def old_and_new(old: str, new: str) -> str:
    return (f"import importlib; old = importlib.import_module({old!r}); "
            f"new = importlib.import_module({new!r}); print(old is new, old.__name__, old.__spec__.name)")


@pytest.fixture(scope="module")
def imports() -> dict[str, str]:
    """What each import check printed: {"tools": ..., old name: ...}."""
    codes = {"tools": LOADS_NO_TOOLS, **{old: old_and_new(old, new) for old, new in MOVED.items()}}
    commands = {name: [sys.executable, "-c", code] for name, code in codes.items()}
    done = run_side_by_side(commands, timeout_s=120)
    failed = {name: run.stderr for name, run in done.items() if run.returncode != 0}
    assert not failed, failed
    return {name: run.stdout.strip() for name, run in done.items()}


def test_import_fastcollate_loads_none_of_its_tools_until_one_is_named(imports):
    before, after = imports["tools"].splitlines()
    assert before == "[]"
    assert after == "fastcollate.tools.audit.ledger True False"


def test_an_unknown_attribute_of_the_package_is_still_an_attribute_error():
    import fastcollate

    with pytest.raises(AttributeError, match="module 'fastcollate' has no attribute 'nothing_here'"):
        fastcollate.nothing_here  # noqa: B018


@pytest.mark.parametrize(("old", "new"), list(MOVED.items()))
def test_an_old_module_name_users_import_is_the_moved_module_itself(old, new, imports):
    assert imports[old] == f"True {new} {new}"


def test_a_name_that_never_was_a_module_is_still_not_found():
    with pytest.raises(ModuleNotFoundError, match="fastcollate.nothing_here"):
        __import__("fastcollate.nothing_here")
    with pytest.raises(ModuleNotFoundError, match="fastcollate.audit.nothing_here"):
        __import__("fastcollate.audit.nothing_here")


def python_files(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py"))


def test_no_module_of_the_package_nor_benchmark_is_over_500_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for path in python_files("fastcollate", "benchmarks")
        if (n := len(path.read_text().splitlines())) > 500
    }
    assert long == {}


def test_no_source_file_of_the_core_is_over_500_lines():
    suffixes = (".cpp", ".h", ".cu", ".cuh")
    sources = sorted(path for path in (ROOT / "csrc").rglob("*") if path.suffix in suffixes)
    assert len(sources) > 20, "the C++ sources moved: this check reads none of them"
    long = {
        str(path.relative_to(ROOT)): n for path in sources if (n := len(path.read_text().splitlines())) > 500
    }
    assert long == {}


def private_imports(path: Path) -> list[str]:
    """Names starting with one underscore that ``path`` imports from another fastcollate module (the
    private top-level modules, _C, _ext, _native_support and _torch_compat, are the package's
    own)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fastcollate")):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__") and alias.name not in (
                    "_C", "_ext", "_native_support", "_torch_compat"
                ):
                    found.append(f"{path.relative_to(ROOT)}: {node.module}.{alias.name}")
    return found


def test_no_module_imports_a_private_name_of_another():
    found = [line for path in python_files("fastcollate", "benchmarks") for line in private_imports(path)]
    assert found == []


def test_arrays_imports_nothing_of_arrow_columns():
    tree = ast.parse((PACKAGE / "data" / "arrays.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any("arrow_columns" in (module or "") for module in imported)


def test_benchmarks_import_their_shared_parts_as_a_package_with_no_path_edits():
    edits = [str(p.relative_to(ROOT)) for p in python_files("benchmarks") if "sys.path" in p.read_text()]
    assert edits == []


SCRIPTS = ["collate_ratios", "packed_neighbours", "array_ratios", "hf_ratios", "worker_ratios", "peer_ratios",
           "ring_contention", "resume_cost", "ray_ratios", "batch_cost"]


@pytest.fixture(scope="module")
def helps() -> dict[str, subprocess.CompletedProcess]:
    """Each script's ``--help``, run as ``python -m benchmarks.NAME`` from the repository's root, all side
    by side."""
    commands = {script: [sys.executable, "-m", f"benchmarks.{script}", "--help"] for script in SCRIPTS}
    return run_side_by_side(commands, cwd=ROOT, timeout_s=120)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_script_runs_as_a_module_of_the_benchmarks_package(script, helps):
    # Its shared parts are benchmarks.shared, found from the root with no path edits.
    done = helps[script]
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:")


def fastcollate_imports(path: Path) -> set[str]:
    """The fastcollate modules ``path`` imports, as absolute names (``fastcollate.transfer.staging``)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.startswith("fastcollate")}


@pytest.mark.parametrize(
    ("room", "below"),
    [("collate", ("fastcollate.transfer", "fastcollate.assembler")),
     ("structure", ("fastcollate.collate", "fastcollate.transfer", "fastcollate.assembler"))],
)
def test_each_room_imports_nothing_of_the_rooms_above_it(room, below):
    # The batch's structure lies below the collate and the transfer; the collate plans and never decides
    # where a batch goes (fastcollate.assembler joins the two).
    reaching_up = sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for path in python_files(f"fastcollate/{room}")
        for name in fastcollate_imports(path)
        if name.startswith(below)
    )
    assert python_files(f"fastcollate/{room}"), "the room exists"
    assert reaching_up == []
