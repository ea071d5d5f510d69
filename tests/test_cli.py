"""The command line as a user meets it: ``--version``, the ``fastcollate`` console script, and the
answers argparse and the dispatcher give to a command line they cannot read. Each runs in a subprocess,
as the user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import fastcollate

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, command: list[str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout's package, also for the console script
    return subprocess.run(
        [*(command or [sys.executable, "-m", "fastcollate"]), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_version_prints_the_package_version_and_exits_0():
    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"fastcollate {fastcollate.__version__}\n"


def test_the_console_script_is_declared_and_answers_like_python_dash_m():
    # Read as text: tomllib is 3.11's, and the package supports 3.10.
    scripts = (ROOT / "pyproject.toml").read_text().split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    assert 'fastcollate = "fastcollate.__main__:main"' in scripts.splitlines()
    script = Path(sys.executable).parent / "fastcollate"
    if not script.exists():
        pytest.skip(f"the package is not installed in this environment (no {script})")
    assert run_cli("--version", command=[str(script)]).stdout == f"fastcollate {fastcollate.__version__}\n"


def test_argparse_keeps_its_own_answer_for_a_preset_that_does_not_exist():
    result = run_cli("bench", "--preset", "nosuch")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("usage: python -m fastcollate bench")
    assert "error: argument --preset: invalid choice: 'nosuch'" in result.stderr.splitlines()[-1]


def test_an_unknown_command_exits_2_with_the_usage():
    result = run_cli("nosuch")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("unknown command 'nosuch'") and "commands:" in result.stderr
