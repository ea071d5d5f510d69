"""The header every ratio benchmark's report starts with (array_ratios, worker_ratios, peer_ratios,
ring_contention): when it ran, the command, the versions, the machine and the malloc settings, written
the same way by each, so that two reports can be told apart by what they ran on."""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

import fastcollate
from fastcollate.tools.bench.malloc import malloc_settings
from fastcollate.tools.terminal import fit_to_terminal

__all__ = ["header_line", "report_header"]


def report_header(malloc: str | None = None) -> dict[str, Any]:
    """The report's opening keys. ``malloc``: the settings in words, when the runs are not this
    process's own (a script running each setting in a child); else this process's settings."""
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fastcollate": fastcollate.__version__,
        "machine": {"cpu": _cpu_model(), "cpus_total": os.cpu_count(), "cpus_usable": _usable_cpus()},
        "malloc": malloc if malloc is not None else malloc_settings(),
    }


def header_line(header: dict[str, Any]) -> str:
    """The header a script prints before its figures, in 100 columns."""
    machine = header["machine"]
    return fit_to_terminal(
        f"python {header['python']}, torch {header['torch']}, fastcollate {header['fastcollate']}; "
        f"{machine['cpu']} ({machine['cpus_usable']} of {machine['cpus_total']} CPUs usable); "
        f"malloc: {header['malloc']}")


def _usable_cpus() -> int | None:
    """The CPUs this process may run on (its affinity): what the figures could use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
