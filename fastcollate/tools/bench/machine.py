"""The machine and the library versions a measurement comes from, recorded beside every result."""

from __future__ import annotations

import importlib
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fastcollate

__all__ = ["cuda_available", "machine_info", "usable_cpus", "versions"]


def cuda_available() -> bool:
    """Whether a CUDA GPU is visible; False rather than an error on a machine without a driver."""
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), which is what caps useful worker counts."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpus_busy_now(seconds: float = 0.5) -> float | None:
    """How many CPUs' worth of time the whole machine spent busy over the next ``seconds`` (from
    /proc/stat; None where there is none). Measured now, unlike the load average, which still counts a
    build that ended a minute ago (``make demo`` builds just before it measures)."""

    def ticks() -> tuple[int, int]:
        with open("/proc/stat") as handle:
            values = [int(v) for v in handle.readline().split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        return sum(values), idle

    try:
        total, idle = ticks()
        time.sleep(seconds)
        total2, idle2 = ticks()
    except (OSError, ValueError, IndexError):
        return None
    elapsed = total2 - total
    cpus = os.cpu_count() or 1
    return 0.0 if elapsed <= 0 else cpus * (1 - (idle2 - idle) / elapsed)


def machine_info() -> dict[str, Any]:
    """The machine the numbers come from."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": None,
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpus_total": os.cpu_count(),
        "memory_bytes": None,
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "cpus_busy_at_start": cpus_busy_now(),
        "gpu": None,
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_bytes"] = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if cuda_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {
            "name": props.name,
            "memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
            "count": torch.cuda.device_count(),
        }
    return info


def versions() -> dict[str, Any]:
    """Library versions (and the fastcollate checkout's commit when there is one)."""
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda_available() else None,
        "numpy": np.__version__,
        "fastcollate": getattr(fastcollate, "__version__", None),
        "fastcollate_commit": None,
    }
    for name in ("torchvision", "PIL", "matplotlib"):
        try:
            out[name] = importlib.import_module(name).__version__
        except Exception:
            out[name] = None
    try:
        root = Path(fastcollate.__file__).resolve().parent.parent
        out["fastcollate_commit"] = (
            subprocess.run(
                ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except Exception:
        pass
    return out
