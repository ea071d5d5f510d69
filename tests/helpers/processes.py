"""Commands run side by side, as multi-process tests need them: each in a session of its own, bounded
together, and killed with everything it started, so a hang fails the test instead of stopping the suite."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: tests/helpers/ is two below it


def run_at_once(commands: dict[str, list[str]], timeout_s: float = 240) -> dict[str, tuple[int, str]]:
    """Starts every command at once (with the repository on PYTHONPATH and one OpenMP thread each) and
    waits for all of them: {name: (exit status, stdout and stderr)}. Past ``timeout_s`` in all, the wait
    raises ``subprocess.TimeoutExpired``; either way nothing a command started outlives this call."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    started = {
        # A session of its own: the processes a command starts (torchrun's ranks, the ranks Lightning's
        # launcher starts) are in its group, and killing the group ends them all.
        name: subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
        for name, command in commands.items()
    }
    deadline = time.monotonic() + timeout_s
    results = {}
    with _sessions_killed(started.values()):
        for name, process in started.items():
            # A child that inherited the pipe holds it open: the output ends when all of them have exited.
            output = process.communicate(timeout=max(deadline - time.monotonic(), 1))[0]
            results[name] = (process.returncode, output)
        return results


def run_side_by_side(
    commands: dict[str, list[str]],
    cwd: str | Path = ROOT,
    env: dict[str, str] | None = None,
    timeout_s: float = 180,
) -> dict[str, subprocess.CompletedProcess]:
    """Starts every command at once, as given (``env``: the whole environment, this one's if None), and
    waits for all of them: {name: its CompletedProcess, stdout and stderr apart}. Each fresh interpreter
    spends seconds of CPU importing torch: side by side they use every core instead of one. Past
    ``timeout_s`` in all, the wait raises ``subprocess.TimeoutExpired``; either way nothing a command
    started outlives this call."""
    # Files, not pipes: a command that writes more than a pipe holds cannot stall while another is read.
    outputs = {name: (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for name in commands}
    started = {
        name: subprocess.Popen(command, cwd=cwd, env=env, stdout=outputs[name][0], stderr=outputs[name][1],
                               text=True, start_new_session=True)
        for name, command in commands.items()
    }
    deadline = time.monotonic() + timeout_s
    results = {}
    try:
        with _sessions_killed(started.values()):
            for name, process in started.items():
                process.wait(timeout=max(deadline - time.monotonic(), 1))
                out, err = outputs[name]
                out.seek(0)
                err.seek(0)
                results[name] = subprocess.CompletedProcess(commands[name], process.returncode, out.read(),
                                                            err.read())
            return results
    finally:
        for files in outputs.values():
            for file in files:
                file.close()


@contextlib.contextmanager
def _sessions_killed(processes) -> Iterator[None]:
    """Kills each process's session (its group: everything it started) on the way out, however the block
    ends."""
    try:
        yield
    finally:
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
