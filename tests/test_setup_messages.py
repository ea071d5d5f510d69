"""What the build says when torch is missing (where it is not installed, and where pip's isolated build hides
it), and what importing fastcollate says when its compiled core is missing: which folder was imported, the
installed fastcollate that folder hides, and how to get past it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
import torch

from fastcollate import _ext

ROOT = Path(__file__).resolve().parent.parent
NOT_INSTALLED = (
    "[fastcollate build] torch is not installed, and fastcollate compiles against the torch it runs with: "
    "install it first (`pip install torch setuptools wheel ninja`; a CUDA build of torch: "
    "https://pytorch.org/get-started/locally/), then build beside it with "
    "`pip install -v --no-build-isolation .` (-v shows the progress)"
)
HIDDEN = (
    "[fastcollate build] torch is installed, but pip's isolated build cannot see it, and fastcollate "
    "compiles against the torch it runs with: build with `pip install -v --no-build-isolation .` "
    "(setuptools, wheel and ninja installed; -v shows the progress)"
)


def project_copy(at: Path) -> Path:
    """What pip reads of the checkout before the build compiles anything."""
    at.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, at / name)
    return at


@pytest.fixture(scope="module")
def venv_without_torch(tmp_path_factory) -> Path:
    """A fresh venv, as a new user makes one: pip and setuptools (ensurepip's, no download), no torch."""
    folder = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True, capture_output=True, timeout=300)
    python = folder / "bin" / "python"
    found = subprocess.run([str(python), "-c", "import setuptools, torch"], capture_output=True, text=True)
    assert "No module named 'torch'" in found.stderr, found.stderr  # setuptools is there, torch is not
    return python


def test_without_torch_setup_py_stops_on_one_line_saying_to_install_torch_first(venv_without_torch, tmp_path):
    done = subprocess.run([str(venv_without_torch), "setup.py", "--version"],
                          cwd=project_copy(tmp_path / "p"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == NOT_INSTALLED and done.stdout == ""  # no traceback, nothing before it


@pytest.mark.parametrize("route", [["."], ["-e", "."]], ids=["install", "editable"])
def test_pip_without_torch_shows_the_line(venv_without_torch, tmp_path, route):
    """What the user reported: `pip install --no-build-isolation .` in a fresh venv, now with the line."""
    done = subprocess.run(
        [str(venv_without_torch), "-m", "pip", "install", "--no-index", "--no-build-isolation", *route],
        cwd=project_copy(tmp_path / "p"), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode != 0
    assert NOT_INSTALLED in " ".join((done.stdout + done.stderr).split())  # pip indents the build's lines
    assert "Traceback" not in done.stdout + done.stderr


def pip_build_environment(at: Path) -> dict[str, str]:
    """The environment pip runs an isolated build in: PYTHONNOUSERSITE, and a PYTHONPATH whose
    sitecustomize takes this interpreter's site-packages (torch's) off sys.path and puts the build's own
    requirements (setuptools) on it."""
    requirements = at / "requirements"
    requirements.mkdir(parents=True)
    packages = Path(sysconfig.get_paths()["purelib"])
    for name in ("setuptools", "_distutils_hack"):
        (requirements / name).symlink_to(packages / name)
    kept = f"[p for p in sys.path if p != {str(packages)!r}] + [{str(requirements)!r}]"
    (at / "sitecustomize.py").write_text(f"import sys\nsys.path[:] = {kept}\n")
    return {**os.environ, "PYTHONNOUSERSITE": "1", "PYTHONPATH": str(at)}


def test_with_torch_installed_an_isolated_build_is_told_to_build_without_isolation(tmp_path):
    isolated = pip_build_environment(tmp_path / "build-env")
    hidden = subprocess.run([sys.executable, "-c", "import setuptools, torch"], env=isolated,
                            capture_output=True, text=True)
    assert "No module named 'torch'" in hidden.stderr, hidden.stderr
    done = subprocess.run([sys.executable, "setup.py", "--version"], cwd=project_copy(tmp_path / "p"),
                          env=isolated, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == HIDDEN


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def names(requirements: list[str]) -> set[str]:
    return {re.match(r"[\w.-]+", requirement).group() for requirement in requirements}


def test_the_build_requires_no_torch_so_isolation_cannot_fetch_another():
    requires = pyproject()["build-system"]["requires"]
    assert "torch" not in names(requires) and {"setuptools", "wheel", "ninja"} <= names(requires)


def test_all_brings_every_feature_and_test_brings_all_and_the_bench():
    extras = pyproject()["project"]["optional-dependencies"]
    features = set(extras) - {"all", "bench", "test"}
    assert features == {"hf", "resume", "ray", "lightning"}
    (everything,) = extras["all"]
    assert everything.startswith("fastcollate[") and set(everything[12:-1].split(",")) == features
    assert "fastcollate[all,bench]" in extras["test"]


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
