"""Process memory over one epoch, read from /proc and torch's host allocator: peak RSS of this process and
of each worker it starts, PSS, the /dev/shm segments batches travel in, and pinned host memory.

Linux-only readings; where one cannot be read (another OS, a hardened /proc) it is None, never a guess.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ... import _torch_compat
from .machine import cuda_available

__all__ = [
    "EpochMemory",
    "ProcessMemory",
    "child_pids",
    "host_pinned_peak",
    "proc_status_bytes",
    "pss_bytes",
    "reset_host_pinned_stats",
    "reset_peak_rss",
    "shm_held_bytes",
    "shm_used_bytes",
]


def proc_status_bytes(pid: int | str, key: str) -> int | None:
    """A ``/proc/<pid>/status`` size (``VmHWM``, ``VmRSS``) in bytes."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def pss_bytes(pid: int | str) -> int | None:
    """A process's proportional set size: shared pages split between the processes that map them."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_rss() -> bool:
    """Resets this process's VmHWM (Linux: ``5`` to clear_refs), so a run's peak is its own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def child_pids() -> set[int]:
    """The ids of this process's children (DataLoader workers among them)."""
    me = os.getpid()
    kids = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return kids
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and parentheses
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me:
            kids.add(int(entry))
    return kids


def shm_held_bytes(pids: Iterable[int]) -> int | None:
    """Bytes of the /dev/shm segments these processes map or hold open, each segment once: the batches
    in flight between workers and the main process (a worker keeps a sent batch's descriptor until the
    main process takes it). Reads /proc: a millisecond or so, so it is called outside timed intervals."""
    segments: dict[int, int] = {}
    readable = False
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        readable = True
        for line in maps.splitlines():
            if "/dev/shm/" in line:
                fields = line.split()
                start, end = (int(x, 16) for x in fields[0].split("-"))
                inode = int(fields[4])
                segments[inode] = max(segments.get(inode, 0), end - start)
        for fd in fds:
            try:
                if not os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/"):
                    continue
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            segments[st.st_ino] = max(segments.get(st.st_ino, 0), st.st_blocks * 512)
    return sum(segments.values()) if readable else None


def shm_used_bytes() -> int | None:
    """Bytes in use on the whole machine's /dev/shm (every process's, not only ours)."""
    try:
        st = os.statvfs("/dev/shm")
        return (st.f_blocks - st.f_bfree) * st.f_frsize
    except OSError:
        return None


def reset_host_pinned_stats() -> None:
    """Empties torch's pinned-block cache and its peak counters, so a run's pinned peak is its own."""
    if not (cuda_available() and torch.cuda.is_initialized()):
        return
    try:
        _torch_compat.release_cached_pinned_memory()
        torch.cuda.reset_peak_host_memory_stats()
    except Exception:
        pass


def host_pinned_peak() -> tuple[int, int]:
    """Peak pinned bytes and allocations of torch's host allocator since the last reset."""
    if not (cuda_available() and torch.cuda.is_initialized()):
        return 0, 0
    try:
        stats = torch.cuda.host_memory_stats()
        return int(stats.get("allocated_bytes.peak", 0)), int(stats.get("allocations.peak", 0))
    except Exception:
        return 0, 0


@dataclasses.dataclass
class EpochMemory:
    """What one epoch held, as the bench's JSON names it (None: could not be read)."""

    peak_rss_main_bytes: int | None
    peak_rss_workers_bytes: list[int]
    pss_bytes: int | None
    shm_bytes: int | None
    shm_growth_system_bytes: int | None
    pinned_bytes: int
    pinned_allocations: int


class ProcessMemory:
    """Watches this process and the workers it starts from now on, over one epoch.

    Made before the loader (it resets the peaks and notes the children that exist already), sampled at
    untimed points, read once before the workers shut down and once after.
    """

    def __init__(self) -> None:
        self._children_before = child_pids()
        reset_host_pinned_stats()
        self._rss_reset = reset_peak_rss()
        self._shm_base = shm_used_bytes()
        self._shm_peak = self._shm_base
        self._shm_held: int | None = None
        self._worker_hwm: dict[int, int] = {}
        self._pss: int | None = None

    def _workers(self) -> set[int]:
        return child_pids() - self._children_before

    def sample_held_shm(self) -> None:
        """Notes the /dev/shm our processes hold now (untimed points only: it reads /proc)."""
        held = shm_held_bytes([os.getpid(), *sorted(self._workers())])
        if held is not None:
            self._shm_held = max(self._shm_held or 0, held)

    def sample_system_shm(self) -> None:
        """Notes the machine's /dev/shm use now (a statvfs: cheap enough after every batch)."""
        used = shm_used_bytes()
        if used is not None and self._shm_peak is not None:
            self._shm_peak = max(self._shm_peak, used)

    def read_workers(self) -> None:
        """Reads each worker's peak RSS and everyone's PSS: call while the workers still live."""
        for pid in self._workers():
            hwm = proc_status_bytes(pid, "VmHWM")
            if hwm is not None:
                self._worker_hwm[pid] = hwm
        pss_main = pss_bytes("self")
        self._pss = None if pss_main is None else pss_main + sum(pss_bytes(p) or 0 for p in self._worker_hwm)

    def result(self, device_loader_stats: Mapping[str, Any]) -> EpochMemory:
        """The epoch's memory, once its loader is shut down. DeviceLoader's own pinned counts, when it
        ran, replace the host allocator's: its ring is what the configuration pins."""
        main_hwm = proc_status_bytes("self", "VmHWM")
        pinned_bytes, pinned_allocations = host_pinned_peak()
        if device_loader_stats:
            pinned_bytes = int(device_loader_stats.get("pinned_bytes", pinned_bytes) or 0)
            pinned_allocations = int(device_loader_stats.get("pinned_allocations", pinned_allocations) or 0)
        growth = None
        if self._shm_peak is not None and self._shm_base is not None:
            growth = self._shm_peak - self._shm_base
        return EpochMemory(
            peak_rss_main_bytes=main_hwm if self._rss_reset else None,
            peak_rss_workers_bytes=sorted(self._worker_hwm.values()),
            pss_bytes=self._pss,
            shm_bytes=self._shm_held,
            shm_growth_system_bytes=growth,
            pinned_bytes=pinned_bytes,
            pinned_allocations=pinned_allocations,
        )
