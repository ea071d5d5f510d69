"""What importing fastcollate says when its compiled core is missing: which folder was imported, the
installed fastcollate that folder hides, and how to get past it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from fastcollate import _ext

ROOT = Path(__file__).resolve().parent.parent


def unbuilt_checkout(at: Path) -> Path:
    """A copy of the checkout's package without its compiled core, beside a setup.py."""
    skipped = shutil.ignore_patterns("_C*", "__pycache__")
    shutil.copytree(ROOT / "fastcollate", at / "fastcollate", ignore=skipped)
    (at / "setup.py").write_text("")
    return at / "fastcollate"


def import_fastcollate(cwd: Path, pythonpath: list[Path]) -> subprocess.CompletedProcess:
    # -S: no site hooks, so an editable install of another checkout (its import hook would lend this copy
    # that checkout's build) stays out; torch comes from its folder, put on the path by hand.
    packages = Path(torch.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*pythonpath, packages]))}
    return subprocess.run([sys.executable, "-S", "-c", "import fastcollate"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_an_unbuilt_source_folder_run_from_says_it_shadows_the_installed_package(tmp_path):
    package = unbuilt_checkout(tmp_path / "checkout")
    installed = tmp_path / "site" / "fastcollate"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    done = import_fastcollate(tmp_path / "checkout", [tmp_path / "site"])
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert f"is not built in {package}" in last
    assert "the current folder is the checkout" in last
    assert f"it shadows the fastcollate installed at {installed}" in last
    assert "run from another folder" in last and "make build" in last


def test_an_unbuilt_source_folder_on_the_path_names_the_installed_package_it_hides(tmp_path):
    package = unbuilt_checkout(tmp_path / "checkout")
    installed = tmp_path / "site" / "fastcollate"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = import_fastcollate(elsewhere, [tmp_path / "checkout", tmp_path / "site"])
    last = done.stderr.strip().splitlines()[-1]
    assert f"is not built in {package}" in last
    assert f"it shadows the fastcollate installed at {installed}" in last
    assert "current folder" not in last


@pytest.fixture
def nothing_installed(monkeypatch):
    def not_found(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_ext.metadata, "distribution", not_found)


def test_run_from_an_unbuilt_checkout_with_nothing_installed_it_says_build_in_place(
    tmp_path, monkeypatch, nothing_installed
):
    package = unbuilt_checkout(tmp_path / "checkout")
    monkeypatch.setattr(_ext, "HERE", package)
    monkeypatch.chdir(tmp_path / "checkout")
    monkeypatch.setattr(sys, "path", [""])
    message = _ext.missing_core(ImportError("cannot import name '_C'"))
    assert message.startswith(f"fastcollate's compiled core (fastcollate._C) is not built in {package}")
    assert "The current folder is the checkout, so Python imports its source folder" in message
    assert "`make build`" in message and "run from another folder" in message
    assert "shadows" not in message


def test_a_built_core_that_fails_to_load_is_called_a_mismatch_with_this_torch(
    tmp_path, monkeypatch, nothing_installed
):
    package = unbuilt_checkout(tmp_path / "checkout")
    (package / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    monkeypatch.setattr(_ext, "HERE", package)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "checkout")])
    message = _ext.missing_core(ImportError("undefined symbol: _ZN3c10"))
    assert message == (
        "fastcollate's compiled core (fastcollate._C) does not match this torch (undefined symbol: _ZN3c10). "
        "From the source checkout, build it in place with `make build` (or `pip install --no-build-isolation "
        "-e .`, torch installed)."
    )
