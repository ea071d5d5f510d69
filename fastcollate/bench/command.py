"""``python -m fastcollate bench``: default_collate, assemble and assemble + DeviceLoader side by side.

For each observation (loader-only, integrated with a model consuming), each collate/transfer
variant and each worker count, it runs a few epochs over the same fixed subset, times the measured
steps after the warm-up ones, checks that every epoch delivers the reference's ids and targets, and
writes a table, ``results.json`` (every run kept) and a chart. See ``--help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import importlib
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, default_collate

import fastcollate

from .. import audit, tree
from ..device_loader import DeviceLoader
from ..ids import TARGET_KEYS
from .datasets import PRESETS
from .factory import load_factory
from .models import TrainStep

__all__ = ["main"]

DEFAULT_WORKERS = (0, 1, 2, 4)
PREFETCH_FACTOR = 2  # DataLoader's default, stated in the results
DEVICE_LOADER_DEPTH = 2


# --------------------------------------------------------------------------------------------------
# What runs: variants (collate + transfer), the resolved set-up.


@dataclasses.dataclass(frozen=True)
class Variant:
    """A collate function and a way to the device."""

    key: str
    collate: str
    transfer: str
    label: str


VARIANTS = (
    Variant("default", "default_collate", "pin_memory+to", "default_collate + pin_memory + .to()"),
    Variant("assemble", "assemble", "pin_memory+to", "assemble + pin_memory + .to()"),
    Variant("device_loader", "assemble", "DeviceLoader", "assemble + DeviceLoader"),
)


@dataclasses.dataclass
class Setup:
    """Everything a run needs, resolved from the command line."""

    name: str
    description: str
    dataset: Dataset
    indices: list[int] | None
    batch_size: int
    steps: int
    warmup: int
    repeat: int
    workers: list[int]
    device: torch.device
    observations: list[str]
    variants: list[Variant]
    baseline_collate: Callable
    assemble_fn: Callable
    device_transforms: dict[str, Callable]
    make_step: Callable[[], Callable[[Any], Any]] | None
    model_note: str
    unit: str
    transforms_note: str
    seed: int
    notes: list[str]
    pin_memory: bool
    target_key: str | None = None  # found in the first batch
    tail: int = 0  # untimed batches after the measured ones


# --------------------------------------------------------------------------------------------------
# Machine, versions, process memory.


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
    if _cuda_available():
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
        "cudnn": torch.backends.cudnn.version() if _cuda_available() else None,
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


def _cuda_available() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


def _proc_status_bytes(pid: int | str, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _pss_bytes(pid: int | str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_peak_rss() -> bool:
    """Resets this process's VmHWM (Linux: ``5`` to clear_refs), so a run's peak is its own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _children() -> set[int]:
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


def _shm_held_bytes(pids: Iterable[int]) -> int | None:
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


def _shm_used_bytes() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
        return (st.f_blocks - st.f_bfree) * st.f_frsize
    except OSError:
        return None


def raw_pinned_copy_gbps(nbytes: int, device: torch.device, repeats: int = 10) -> float | None:
    """The host link's reference in this run: one pinned buffer of ``nbytes`` copied to ``device``
    ``repeats`` times, timed with CUDA events; the median, in GB/s (1e9 bytes)."""
    if device.type != "cuda" or nbytes <= 0:
        return None
    try:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
        times = []
        for _ in range(repeats + 2):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dest.copy_(host, non_blocking=True)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        return nbytes / (statistics.median(times[2:]) * 1e-3) / 1e9
    except Exception:
        return None


def _reset_host_pinned_stats() -> None:
    if not (_cuda_available() and torch.cuda.is_initialized()):
        return
    try:
        torch._C._host_emptyCache()
        torch.cuda.reset_peak_host_memory_stats()
    except Exception:
        pass


def _host_pinned_peak() -> tuple[int, int]:
    if not (_cuda_available() and torch.cuda.is_initialized()):
        return 0, 0
    try:
        stats = torch.cuda.host_memory_stats()
        return int(stats.get("allocated_bytes.peak", 0)), int(stats.get("allocations.peak", 0))
    except Exception:
        return 0, 0


# --------------------------------------------------------------------------------------------------
# Moving and reading batches.


def to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """``batch`` with every tensor moved to ``device`` (dicts, lists, tuples and namedtuples kept)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device, non_blocking) for k, v in batch.items()}
        if type(batch) is dict:
            return moved
        try:
            return type(batch)(moved)
        except TypeError:
            return moved
    if isinstance(batch, tuple) and hasattr(type(batch), "_fields"):
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


def tensor_bytes(batch: Any) -> int:
    """Bytes held by the tensors of a batch (metadata only: no copy, no device sync)."""
    if isinstance(batch, torch.Tensor):
        return batch.nelement() * batch.element_size()
    if isinstance(batch, Mapping):
        return sum(tensor_bytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(tensor_bytes(v) for v in batch)
    return 0


class CountingTransform:
    """Wraps a device transform to note the bytes it is given and gives back, call by call, so a
    batch's bytes are counted as they crossed to the device (uint8), not as the model gets them (float).

    Both paths call it once per batch in delivery order (DeviceLoader a few batches ahead), so call
    ``k`` belongs to batch ``k``.
    """

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.calls: list[tuple[int, int]] = []

    def __call__(self, value: Any) -> Any:
        out = self.fn(value)
        self.calls.append((tensor_bytes(value), tensor_bytes(out)))
        return out

    def __repr__(self) -> str:
        return repr(self.fn)


def crossed_bytes(batch: Any, index: int, transforms: Mapping[str, CountingTransform]) -> int:
    """Bytes of batch ``index`` before its device transforms ran."""
    total = tensor_bytes(batch)
    for counter in transforms.values():
        if index < len(counter.calls):
            bytes_in, bytes_out = counter.calls[index]
            total += bytes_in - bytes_out
    return total


def apply_transforms(batch: Any, transforms: Mapping[str, Callable]) -> Any:
    """Applies ``{field: fn}`` to a mapping batch (what DeviceLoader's ``transforms`` does)."""
    if not transforms:
        return batch
    if not isinstance(batch, Mapping):
        raise TypeError("device transforms need mapping batches")
    out = dict(batch)
    for key, fn in transforms.items():
        out[key] = fn(out[key])
    return out


def ids_and_targets(batch: Any, target_key: str | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The batch's id tensor and target tensor (copies: a batch's memory may be a reused slot): a
    mapping's ``"id"`` and ``target_key``, an ``IdentifiedSample``'s ``id`` and last field."""
    ids = targets = None
    if isinstance(batch, Mapping):
        ids = _field(batch, "id")
        targets = _field(batch, target_key) if target_key else None
    elif isinstance(batch, tuple) and hasattr(batch, "id") and hasattr(batch, "sample"):  # IdentifiedSample
        ids = _field(batch, "id")
        if isinstance(batch.sample, (list, tuple)) and len(batch.sample) >= 2:
            targets = _field(batch, f"sample.{len(batch.sample) - 1}")
    ids = ids.detach().clone() if isinstance(ids, torch.Tensor) else None
    if isinstance(targets, torch.Tensor) and targets.dim() >= 1:
        targets = targets.detach().clone()
    else:
        targets = None
    return ids, targets


def _field(batch: Any, path: str) -> Any:
    """``tree.lookup``'s value at ``path``, or None where the batch has none."""
    try:
        return tree.lookup(batch, path)
    except (KeyError, IndexError, TypeError):
        return None


def find_target_key(sample: Any) -> str | None:
    if isinstance(sample, Mapping):
        for key in TARGET_KEYS:
            if key in sample:
                return key
    return None


# --------------------------------------------------------------------------------------------------
# One epoch of one configuration.


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


def _shutdown(loader: DataLoader, source: Any) -> None:
    close = getattr(source, "close", None)
    if source is not loader and callable(close):
        close()
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()  # persistent workers would otherwise live until collected
    loader._iterator = None


def tail_batches(variant: Variant, workers: int) -> int:
    """Batches a configuration can hold in flight past the one being consumed: a DataLoader keeps
    ``prefetch_factor * workers`` outstanding, a DeviceLoader ``depth`` more. Without that many after
    the measured batches, the epoch would end inside the measured interval with its last batches made
    before it began, and the deepest pipeline would look fastest for no reason."""
    return PREFETCH_FACTOR * workers + (DEVICE_LOADER_DEPTH if variant.transfer == "DeviceLoader" else 0)


def run_epoch(
    setup: Setup, variant: Variant, workers: int, observation: str, full: bool = False
) -> dict[str, Any]:
    """One epoch of one configuration: timings, ids and targets, memory. Never raises for the
    configuration's own failure: it is returned as ``"error"``.

    The epoch is the first ``warmup + steps + tail_batches(...)`` batches of the fixed subset (all of
    it with ``full``, as the reference takes it); an iterable data set is read whole.
    """
    device = setup.device
    asked = None
    if setup.indices is None:
        dataset = setup.dataset
    else:
        asked = (
            len(setup.indices)
            if full
            else min(
                len(setup.indices),
                (setup.warmup + setup.steps + tail_batches(variant, workers)) * setup.batch_size,
            )
        )
        dataset = Subset(setup.dataset, setup.indices[:asked])
    collate = setup.baseline_collate if variant.collate == "default_collate" else setup.assemble_fn
    use_device_loader = variant.transfer == "DeviceLoader"
    pin = setup.pin_memory and not use_device_loader
    transforms = {k: CountingTransform(fn) for k, fn in setup.device_transforms.items()}
    step = setup.make_step() if observation == "integrated" and setup.make_step is not None else None

    children_before = _children()
    _reset_host_pinned_stats()
    rss_reset = _reset_peak_rss()
    shm_base = _shm_used_bytes()
    shm_peak = shm_base
    shm_ours: int | None = None

    def sample_shm() -> None:  # untimed points only: after warm-up, after the measured steps
        nonlocal shm_ours
        mapped = _shm_held_bytes([os.getpid(), *sorted(_children() - children_before)])
        if mapped is not None:
            shm_ours = max(shm_ours or 0, mapped)

    loader_kwargs: dict[str, Any] = {}
    if workers > 0:
        loader_kwargs = {"persistent_workers": True, "prefetch_factor": PREFETCH_FACTOR}
    loader = DataLoader(
        dataset,
        batch_size=setup.batch_size,
        shuffle=False,
        num_workers=workers,
        collate_fn=collate,
        pin_memory=pin,
        drop_last=False,
        **loader_kwargs,
    )
    source: Any = loader
    if use_device_loader:
        source = DeviceLoader(
            loader,
            device=device,
            depth=DEVICE_LOADER_DEPTH,
            transforms=transforms or None,
            record_copy_events=device.type == "cuda",
        )

    waits: list[float] = []
    h2d_call: list[float] = []
    h2d_events: list[tuple[Any, Any]] = []
    ids: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    measured_ids: list[torch.Tensor] = []
    measured_samples = 0
    measured_bytes = 0
    startup_s = None
    t_begin = t_end = None
    batches = 0
    target_key = setup.target_key
    error = None
    worker_hwm: dict[int, int] = {}
    pss_total = None
    stats: dict[str, Any] = {}
    t_iter = time.perf_counter()
    try:
        iterator = iter(source)
        last = setup.warmup + setup.steps
        while True:
            if batches == setup.warmup:
                sample_shm()
                _sync(device)
                t_begin = time.perf_counter()
            t0 = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                break
            wait = time.perf_counter() - t0
            if startup_s is None:
                startup_s = time.perf_counter() - t_iter
            measured = setup.warmup <= batches < last
            if not use_device_loader and device.type != "cpu":
                h0 = time.perf_counter()
                if device.type == "cuda":
                    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    batch = to_device(batch, device, non_blocking=True)
                    stop.record()
                    if measured:
                        h2d_events.append((start, stop))
                else:
                    batch = to_device(batch, device, non_blocking=True)
                if measured:
                    h2d_call.append(time.perf_counter() - h0)
            if not use_device_loader:
                batch = apply_transforms(batch, transforms)
            if target_key is None and isinstance(batch, Mapping):
                target_key = find_target_key(batch)
            batch_ids, batch_targets = ids_and_targets(batch, target_key)
            if batch_ids is not None:
                ids.append(batch_ids)
            if batch_targets is not None:
                targets.append(batch_targets)
            if step is not None and batches < last:  # the tail only drains the epoch
                step(batch)
            if measured:
                waits.append(wait)
                n = int(batch_ids.numel()) if batch_ids is not None else _batch_len(batch)
                measured_samples += n
                if batch_ids is not None:
                    measured_ids.append(batch_ids)
                measured_bytes += crossed_bytes(batch, batches, transforms)
            del batch
            batches += 1
            if batches == last:
                _sync(device)
                t_end = time.perf_counter()
            if batches >= last:
                sample_shm()
            used = _shm_used_bytes()
            if used is not None and shm_peak is not None:
                shm_peak = max(shm_peak, used)
        _sync(device)
        if t_end is None and t_begin is not None:
            t_end = time.perf_counter()  # fewer batches than warm-up + steps: measure what there was
        for pid in _children() - children_before:
            hwm = _proc_status_bytes(pid, "VmHWM")
            if hwm is not None:
                worker_hwm[pid] = hwm
        pss_main = _pss_bytes("self")
        pss_total = None if pss_main is None else pss_main + sum(_pss_bytes(p) or 0 for p in worker_hwm)
        if use_device_loader and hasattr(source, "stats"):
            stats = dict(source.stats())
        copy_events = list(getattr(source, "copy_events", None) or []) if use_device_loader else []
        if copy_events:  # one (start, end) pair per batch, in delivery order, on the copy stream
            h2d_events = copy_events[setup.warmup : last]
    except Exception as exc:  # the configuration failed: record it, flag it, keep going
        error = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            _shutdown(loader, source)
        except Exception:
            pass

    main_hwm = _proc_status_bytes("self", "VmHWM")
    pinned_bytes, pinned_allocations = _host_pinned_peak()
    if stats:
        pinned_bytes = int(stats.get("pinned_bytes", pinned_bytes) or 0)
        pinned_allocations = int(stats.get("pinned_allocations", pinned_allocations) or 0)
    seconds = (t_end - t_begin) if (t_begin is not None and t_end is not None) else None
    try:
        _sync(device)
        h2d_ms = [s.elapsed_time(e) for s, e in h2d_events]
    except Exception:  # an event never recorded (the run failed before it): no copy times
        h2d_ms = []
    id_array = torch.cat([i.cpu().reshape(-1) for i in ids]).numpy() if ids else np.empty(0, np.int64)
    target_array = (
        torch.cat([t.cpu().reshape(-1) for t in targets]).numpy()
        if targets and sum(t.numel() for t in targets) == id_array.size
        else None
    )
    measured_id_array = (
        torch.cat([i.cpu().reshape(-1) for i in measured_ids]).numpy()
        if measured_ids
        else np.empty(0, np.int64)
    )
    setup.target_key = target_key
    return {
        "error": error,
        "epoch_s": time.perf_counter() - t_iter,
        "asked_samples": asked,
        "batches": batches,
        "measured_steps": len(waits),
        "samples": measured_samples,
        "seconds": seconds,
        "samples_per_s": (measured_samples / seconds) if seconds else None,
        "bytes": measured_bytes,
        "bytes_per_s": (measured_bytes / seconds) if seconds else None,
        "wait_ms": [w * 1e3 for w in waits],
        "wait_ms_p50": _percentile([w * 1e3 for w in waits], 50),
        "wait_ms_p95": _percentile([w * 1e3 for w in waits], 95),
        "h2d_ms_p50": _percentile(h2d_ms, 50) if h2d_ms else None,
        "h2d_call_ms_p50": _percentile([h * 1e3 for h in h2d_call], 50) if h2d_call else None,
        "startup_s": startup_s,
        "peak_rss_main_bytes": main_hwm if rss_reset else None,
        "peak_rss_workers_bytes": sorted(worker_hwm.values()),
        "pss_bytes": pss_total,
        "shm_bytes": shm_ours,
        "shm_growth_system_bytes": (shm_peak - shm_base)
        if (shm_peak is not None and shm_base is not None)
        else None,
        "pinned_bytes": pinned_bytes,
        "pinned_allocations": pinned_allocations,
        "device_loader_stats": _jsonable(stats) if stats else None,
        "_ids": id_array,
        "_targets": target_array,
        "_measured_ids": measured_id_array,
    }


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        for value in batch.values():
            return _batch_len(value)
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_len(batch[0])
    return 0


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return str(value)


# --------------------------------------------------------------------------------------------------
# Correctness against the reference epoch.


def compare_to_reference(run: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[str, Any]:
    """Same ids, each once, and, where both have them, the same target for each id
    (``fastcollate.audit.compare``).

    A run asked for the first ``asked_samples`` of the subset is held to the reference's first that
    many: the reference (workers=0, in order) delivers the subset in its order. ``duplicated`` counts
    the surplus copies of ids delivered more than once, ``unexpected`` the ids the reference (so
    held) lacks, ``targets_mismatched`` the ids delivered with another target than the reference's.
    """
    asked = run.get("asked_samples")
    targets, reference_targets = run["_targets"], reference["_targets"]
    if targets is not None and reference_targets is not None:  # compared by value, as == does
        common = np.result_type(targets, reference_targets)
        targets, reference_targets = targets.astype(common), reference_targets.astype(common)
    expected = _epoch(reference["_ids"], reference_targets, asked)
    report = audit.compare(expected, _epoch(run["_ids"], targets), order="any")
    duplicated = sum(count - 1 for count in report.duplicated.values())
    return {
        "lost": len(report.missing),
        "duplicated": duplicated,
        "unexpected": len(report.unexpected),
        "targets_mismatched": len(report.changed_targets),
        "lost_ids": report.missing[:10],
        "duplicated_ids": list(report.duplicated)[:10],
        "unexpected_ids": report.unexpected[:10],
        "order_matches": bool(np.array_equal(run["_ids"], reference["_ids"])),
        "match": report.ok,
    }


def _epoch(ids: np.ndarray, targets: np.ndarray | None, limit: int | None = None) -> audit.Epoch:
    """A run's ids and targets (the first ``limit``) as an audit epoch, targets as their digests."""
    ids = np.asarray(ids[:limit], dtype=np.int64)
    digests = None if targets is None else audit.digest_rows(targets[:limit], ids.size)
    return audit.Epoch(ids=ids, digests=digests)


# --------------------------------------------------------------------------------------------------
# Set-up from the command line.


def _user_dataset(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    try:
        factory = load_factory(spec)
    except ValueError:
        raise SystemExit(f"--dataset wants module:factory or path/to/file.py:factory, got {spec!r}") from None
    except AttributeError as error:
        raise SystemExit(f"--dataset {spec}: {error}") from None
    kwargs = {}
    params = inspect.signature(factory).parameters if callable(factory) else {}
    if args.size is not None and "size" in params:
        kwargs["size"] = args.size
    if "seed" in params:
        kwargs["seed"] = args.seed
    made = factory(**kwargs) if callable(factory) and not isinstance(factory, Dataset) else factory
    spec_dict = dict(made) if isinstance(made, Mapping) else {"dataset": made}
    if "dataset" not in spec_dict:
        raise SystemExit(f"--dataset {spec}: the factory returned a mapping without 'dataset'")
    return spec_dict


def resolve(args: argparse.Namespace) -> Setup:
    """The run's set-up, with a note for every choice the reader should know about."""
    notes: list[str] = []
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quick = args.quick
    steps = args.steps if args.steps is not None else (4 if quick else 20)
    warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    repeat = args.repeat if args.repeat is not None else 3
    if args.workers is not None:
        workers = sorted(set(args.workers))
        over = [w for w in workers if w > cpus]
        if over:
            notes.append(f"workers {over} exceed this machine's {cpus} usable CPUs (run as asked)")
    else:
        wanted = (0, 2) if quick else DEFAULT_WORKERS
        workers = [w for w in wanted if w <= cpus]
        if quick and cpus < 2:
            workers = [0, 1]
        capped = [w for w in wanted if w > cpus]
        if capped:
            notes.append(
                f"workers {capped} skipped: this machine has {cpus} usable CPUs "
                f"(--workers {' '.join(map(str, wanted))} runs them anyway)"
            )
    device = torch.device(args.device or ("cuda" if _cuda_available() else "cpu"))
    if device.type == "cuda" and not _cuda_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible on this machine")
    if device.type != "cuda":
        notes.append(
            "no GPU: pin_memory is left off (DataLoader only warns and pins nothing without one), "
            "the transfer columns say 'no GPU' and the model runs on the CPU"
        )
    observations = {"loader": ["loader"], "integrated": ["integrated"], "both": ["loader", "integrated"]}[
        "loader" if args.no_model else args.observation
    ]
    variants = list(VARIANTS)

    width = args.model_width or (32 if device.type == "cuda" else 8)
    if args.dataset:
        user = _user_dataset(args.dataset, args)
        dataset = user["dataset"]
        name = args.dataset
        description = f"user data set from {args.dataset}"
        baseline = user.get("collate", default_collate)
        contract = user.get("contract")
        assemble_fn = fastcollate.assemble.using(contract) if contract is not None else fastcollate.assemble
        device_transforms = dict(user.get("device_transforms") or {})
        user_step = user.get("step")
        make_step = (lambda: user_step) if user_step is not None else None
        model_note = (
            f"user step {getattr(user_step, '__name__', type(user_step).__name__)}" if user_step else ""
        )
        unit = user.get("unit", "bytes")
        transforms_note = user.get("transforms_note", "the data set's own")
        batch_size = args.batch_size or int(user.get("batch_size", 256))
        if not isinstance(dataset, IterableDataset) and not _has_id(dataset):
            dataset = fastcollate.with_ids(dataset)
            notes.append("samples have no 'id': fastcollate.with_ids attached dataset indices")
        if make_step is None and "integrated" in observations:
            observations = [o for o in observations if o != "integrated"]
            notes.append(
                "integrated observation skipped: the factory gave no 'step' (a callable on the batch)"
            )
    else:
        preset = PRESETS[args.preset]
        size = args.size or preset.size
        dataset = preset.make_dataset(size, args.seed)
        name = preset.name
        description = preset.description
        baseline = preset.default_collate
        assemble_fn = (
            fastcollate.assemble.using(preset.contract()) if preset.contract else fastcollate.assemble
        )
        device_transforms = dict(preset.device_transforms() if preset.device_transforms else {})
        unit = preset.unit
        transforms_note = preset.transforms_note
        batch_size = args.batch_size or preset.batch_size
        model_name = preset.model
        seed = args.seed

        def make_step() -> Callable[[Any], Any]:
            return TrainStep(model_name, device, width=width, seed=seed)

        model_note = make_step().describe()
    if not observations:
        raise SystemExit("nothing to run: no observation left (see the notes above)")

    indices = None
    tail = 0
    if not isinstance(dataset, IterableDataset):
        tail = max(tail_batches(v, w) for v in variants for w in workers)
        wanted = (warmup + steps + tail) * batch_size
        if wanted > len(dataset):
            notes.append(
                f"the data set has {len(dataset)} samples, fewer than warm-up + steps + tail need "
                f"({wanted}): the epoch is the whole data set"
            )
            wanted = len(dataset)
        order = np.random.default_rng(args.seed).permutation(len(dataset))[:wanted]
        indices = [int(i) for i in order]
    return Setup(
        name=name,
        description=description,
        dataset=dataset,
        indices=indices,
        batch_size=batch_size,
        steps=steps,
        warmup=warmup,
        repeat=repeat,
        workers=workers,
        device=device,
        observations=observations,
        variants=variants,
        baseline_collate=baseline,
        assemble_fn=assemble_fn,
        device_transforms=device_transforms,
        make_step=make_step if "integrated" in observations else None,
        model_note=model_note,
        unit=unit,
        transforms_note=transforms_note,
        seed=args.seed,
        notes=notes,
        pin_memory=device.type == "cuda",
        tail=tail,
    )


def _has_id(dataset: Dataset) -> bool:
    try:
        sample = dataset[0]
    except Exception:
        return False
    return isinstance(sample, Mapping) and "id" in sample


# --------------------------------------------------------------------------------------------------
# Summaries, table, chart.


def _median(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return float(statistics.median(kept)) if kept else None


def _max(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return max(kept) if kept else None


def summarize(setup: Setup, key: tuple[str, str, int], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's entry: medians over its runs (never the best), every run kept."""
    observation, variant_key, workers = key
    variant = next(v for v in setup.variants if v.key == variant_key)
    rates = [r["samples_per_s"] for r in runs if r["samples_per_s"]]
    errors = [r["error"] for r in runs if r["error"]]
    checks = [r["check"] for r in runs]
    lost = max((c["lost"] for c in checks), default=0)
    duplicated = max((c["duplicated"] for c in checks), default=0)
    unexpected = max((c["unexpected"] for c in checks), default=0)
    mismatched = max((c["targets_mismatched"] for c in checks), default=0)
    ok = not errors and all(c["match"] for c in checks)
    median_rate = _median(rates)
    entry: dict[str, Any] = {
        "observation": observation,
        "variant": variant.key,
        "label": variant.label,
        "collate": variant.collate,
        "transfer": variant.transfer,
        "workers": workers,
        "device": setup.device.type,
        "samples_per_s": median_rate,
        "samples_per_s_min": min(rates) if rates else None,
        "samples_per_s_max": max(rates) if rates else None,
        "samples_per_s_rel_spread": ((max(rates) - min(rates)) / median_rate)
        if rates and median_rate
        else None,
        "bytes_per_s": _median(r["bytes_per_s"] for r in runs),
        "wait_ms_p50": _median(r["wait_ms_p50"] for r in runs),
        "wait_ms_p95": _median(r["wait_ms_p95"] for r in runs),
        "h2d_ms_p50": _median(r["h2d_ms_p50"] for r in runs),
        "h2d_call_ms_p50": _median(r["h2d_call_ms_p50"] for r in runs),
        "startup_s": _median(r["startup_s"] for r in runs),
        "peak_rss_bytes": _max(
            (r["peak_rss_main_bytes"] or 0) + sum(r["peak_rss_workers_bytes"]) for r in runs
        ),
        "peak_rss_main_bytes": _max(r["peak_rss_main_bytes"] for r in runs),
        "peak_rss_workers_bytes": max(
            (r["peak_rss_workers_bytes"] for r in runs), key=lambda v: sum(v), default=[]
        ),
        "pss_bytes": _max(r["pss_bytes"] for r in runs),
        "shm_bytes": _max(r["shm_bytes"] for r in runs),
        "shm_growth_system_bytes": _max(r["shm_growth_system_bytes"] for r in runs),
        "pinned_bytes": _max(r["pinned_bytes"] for r in runs),
        "pinned_allocations": _max(r["pinned_allocations"] for r in runs),
        "ids_match_reference": ok,
        "lost": lost,
        "duplicated": duplicated,
        "unexpected": unexpected,
        "targets_mismatched": mismatched,
        "errors": errors,
        "ranked": ok,
        "tail_batches": tail_batches(variant, workers),
    }
    for unit in ("pixels", "tokens"):
        values = [r.get(f"{unit}_per_s") for r in runs]
        if any(v is not None for v in values):
            entry[f"{unit}_per_s"] = _median(values)
    entry["runs"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs]
    return entry


def _units(setup: Setup, run: dict[str, Any]) -> None:
    """Adds the second unit (pixels or tokens per second) from the measured ids."""
    dataset = setup.dataset
    seconds = run["seconds"]
    if not seconds:
        return
    pixels = getattr(dataset, "pixels_per_sample", None)
    if pixels:
        run["pixels"] = run["samples"] * pixels
        run["pixels_per_s"] = run["pixels"] / seconds
    length_of = getattr(dataset, "length_of", None)
    if callable(length_of) and run["_measured_ids"].size:
        run["tokens"] = int(np.sum(length_of(run["_measured_ids"])))
        run["tokens_per_s"] = run["tokens"] / seconds


def _fmt_rate(value: float | None) -> str:
    if value is None:
        return "-"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.2f}{suffix}"
    return f"{value:.0f}"


def _fmt_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for scale, suffix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if value >= scale:
            return f"{value / scale:.1f} {suffix}"
    return f"{value:.0f} B"


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else (f"{value:.2f}" if value < 10 else f"{value:.1f}")


def format_table(setup: Setup, entries: list[dict[str, Any]]) -> str:
    """The terminal table: one block per observation, medians over runs, flagged configs marked."""
    unit = setup.unit
    unit_key = f"{unit}_per_s"
    lines = []
    titles = {
        "loader": "loader-only: batches prepared (and moved) per second, no model",
        "integrated": f"integrated: the model ({setup.model_note}) consuming every batch",
    }
    for observation in setup.observations:
        block = [e for e in entries if e["observation"] == observation]
        if not block:
            continue
        lines.append("")
        lines.append(titles[observation])
        header = [
            "workers",
            "config",
            "samples/s",
            "spread",
            f"{unit}/s",
            "x default",
            "wait p50 ms",
            "wait p95 ms",
            "h2d ms",
            "start-up s",
            "peak RSS main+workers",
            "PSS",
            "shm",
            "pinned",
            "check",
        ]
        rows = [header]
        baseline = {
            e["workers"]: e["samples_per_s"] for e in block if e["variant"] == "default" and e["ranked"]
        }
        for e in sorted(block, key=lambda e: (e["workers"], [v.key for v in VARIANTS].index(e["variant"]))):
            base = baseline.get(e["workers"])
            speedup = (
                f"{e['samples_per_s'] / base:.2f}" if (base and e["samples_per_s"] and e["ranked"]) else "-"
            )
            spread = e["samples_per_s_rel_spread"]
            if setup.device.type != "cuda":
                h2d = "no GPU"
            elif e["transfer"] == "DeviceLoader":
                h2d = f"{_fmt_ms(e['h2d_ms_p50'])} (copy stream)"
            else:
                h2d = _fmt_ms(e["h2d_ms_p50"])
            workers_rss = e["peak_rss_workers_bytes"]
            rss = _fmt_bytes(e["peak_rss_main_bytes"])
            if workers_rss:
                rss += f" + {len(workers_rss)}x{_fmt_bytes(max(workers_rss))}"
            if e["ids_match_reference"]:
                check = "ids ok"
            elif e["errors"]:
                check = "ERROR (not ranked)"
            else:
                parts = []
                if e["lost"]:
                    parts.append(f"LOST {e['lost']}")
                if e["duplicated"]:
                    parts.append(f"DUPLICATED {e['duplicated']}")
                if e["unexpected"]:
                    parts.append(f"UNEXPECTED {e['unexpected']}")
                if e["targets_mismatched"]:
                    parts.append(f"TARGETS {e['targets_mismatched']}")
                check = "/".join(parts) + " (not ranked)"
            rows.append(
                [
                    str(e["workers"]),
                    e["label"],
                    _fmt_rate(e["samples_per_s"]),
                    "-" if spread is None else f"±{spread * 50:.0f}%",
                    _fmt_rate(e.get(unit_key)),
                    speedup,
                    _fmt_ms(e["wait_ms_p50"]),
                    _fmt_ms(e["wait_ms_p95"]),
                    h2d,
                    "-" if e["startup_s"] is None else f"{e['startup_s']:.2f}",
                    rss,
                    _fmt_bytes(e["pss_bytes"]),
                    _fmt_bytes(e["shm_bytes"]),
                    _fmt_bytes(e["pinned_bytes"]) if setup.device.type == "cuda" else "no GPU",
                    check,
                ]
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for n, row in enumerate(rows):
            lines.append(
                "  ".join(
                    c.ljust(w) if i < 2 or i == len(row) - 1 else c.rjust(w)
                    for i, (c, w) in enumerate(zip(row, widths, strict=True))
                ).rstrip()
            )
            if n == 0:
                lines.append("  ".join("-" * w for w in widths))
        ranked = [e for e in block if e["ranked"] and e["samples_per_s"]]
        if ranked:
            best = max(ranked, key=lambda e: e["samples_per_s"])
            lines.append(
                f"fastest correct: {best['label']}, {best['workers']} workers: "
                f"{_fmt_rate(best['samples_per_s'])} samples/s (median)"
            )
        flagged = [e for e in block if not e["ranked"]]
        for e in flagged:
            why = (
                "; ".join(e["errors"])
                if e["errors"]
                else (
                    f"lost {e['lost']}, duplicated {e['duplicated']}, unexpected {e['unexpected']}, "
                    f"targets mismatched {e['targets_mismatched']}"
                )
            )
            lines.append(f"FLAGGED, not ranked: {e['label']}, {e['workers']} workers: {why}")
    return "\n".join(lines)


def write_chart(setup: Setup, entries: list[dict[str, Any]], path: Path) -> str | None:
    """Throughput by workers per configuration, and next(loader) wait; returns why not, if not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no chart (pip install matplotlib)"
    observations = [o for o in setup.observations if any(e["observation"] == o for e in entries)]
    fig, axes = plt.subplots(len(observations), 2, figsize=(12, 4.2 * len(observations)), squeeze=False)
    colors = {"default": "tab:gray", "assemble": "tab:blue", "device_loader": "tab:green"}
    for row, observation in enumerate(observations):
        ax_rate, ax_wait = axes[row]
        for variant in setup.variants:
            block = sorted(
                (e for e in entries if e["observation"] == observation and e["variant"] == variant.key),
                key=lambda e: e["workers"],
            )
            if not block:
                continue
            xs = [e["workers"] for e in block]
            ys = [e["samples_per_s"] or 0 for e in block]
            lo = [max(0.0, y - (e["samples_per_s_min"] or y)) for y, e in zip(ys, block, strict=True)]
            hi = [max(0.0, (e["samples_per_s_max"] or y) - y) for y, e in zip(ys, block, strict=True)]
            ax_rate.errorbar(
                xs,
                ys,
                yerr=[lo, hi],
                marker="o",
                capsize=3,
                label=variant.label,
                color=colors.get(variant.key),
            )
            for x, y, e in zip(xs, ys, block, strict=True):
                if not e["ranked"]:
                    ax_rate.annotate("FLAGGED", (x, y), color="red", fontsize=8, ha="center", va="bottom")
                    ax_rate.plot([x], [y], marker="x", color="red", markersize=10)
            p50 = [e["wait_ms_p50"] or 0 for e in block]
            p95 = [e["wait_ms_p95"] or 0 for e in block]
            ax_wait.plot(xs, p50, marker="o", color=colors.get(variant.key), label=f"{variant.label} p50")
            ax_wait.plot(
                xs,
                p95,
                marker="^",
                linestyle="--",
                color=colors.get(variant.key),
                label=f"{variant.label} p95",
            )
        ax_rate.set_title(f"{observation}: samples/s (median, bars: min-max over runs)")
        ax_rate.set_xlabel("DataLoader workers")
        ax_rate.set_ylabel("samples/s")
        ax_rate.set_xticks(setup.workers)
        ax_rate.set_ylim(bottom=0)
        ax_rate.legend(fontsize=8)
        ax_wait.set_title(f"{observation}: next(loader) wait, ms (median of per-run p50 / p95)")
        ax_wait.set_xlabel("DataLoader workers")
        ax_wait.set_ylabel("ms")
        ax_wait.set_xticks(setup.workers)
        ax_wait.set_ylim(bottom=0)
        ax_wait.legend(fontsize=7)
    fig.suptitle(
        f"fastcollate bench: {setup.name}, batch {setup.batch_size}, {setup.steps} steps x "
        f"{setup.repeat} runs, {setup.warmup} warm-up excluded, device {setup.device.type}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------------------------------
# The command.


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fastcollate bench",
        description="Compare default_collate + pin_memory + .to(non_blocking=True), "
        "fastcollate.assemble + the "
        "same transfer, and assemble + DeviceLoader, for several worker counts, on an embedded "
        "data set (no download) or your own.",
        epilog="Every run is kept in results.json; tables show medians, never the best run. A configuration "
        "whose epoch does not deliver the workers=0 reference's ids and targets is flagged, not ranked. "
        "--dataset module:factory (or file.py:factory): factory() (given size=/seed= if it takes them) "
        "returns a Dataset with dict samples (an 'id' key, else with_ids adds one), or a dict with "
        "'dataset' and optionally 'collate' (the baseline), 'contract', 'device_transforms', 'step' "
        "(callable on a device batch, for the integrated observation), 'unit', 'batch_size'.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="fashion",
        help="embedded data set (default: fashion, the seed study's FashionMNIST-like case)",
    )
    source.add_argument("--dataset", metavar="MODULE:FACTORY", help="your own data set")
    parser.add_argument("--size", type=int, help="samples in the embedded data set (default: the preset's)")
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        help="worker counts (default 0 1 2 4, capped at the usable CPUs; --quick: 0 2)",
    )
    parser.add_argument("--batch-size", type=int, help="default: the preset's (fashion: 256)")
    parser.add_argument("--steps", type=int, help="measured batches per run (default 20; --quick 4)")
    parser.add_argument(
        "--warmup", type=int, help="batches per run before timing starts (default 3; --quick 1)"
    )
    parser.add_argument("--repeat", type=int, help="runs per configuration (default 3)")
    parser.add_argument(
        "--quick", action="store_true", help="few steps and workers: under 2 minutes on 2 cores"
    )
    parser.add_argument(
        "--observation",
        choices=("loader", "integrated", "both"),
        default="both",
        help="loader-only, integrated (a model consumes each batch), or both (default)",
    )
    parser.add_argument("--no-model", action="store_true", help="same as --observation loader")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when a GPU is visible)")
    parser.add_argument(
        "--model-width", type=int, help="CNN width (default 32 on a GPU, as the study; 8 on a CPU)"
    )
    parser.add_argument("--seed", type=int, default=0, help="data and model seed (default 0)")
    parser.add_argument(
        "--out", type=Path, help="output folder (default: a new ./bench-out-<time>, which .gitignore skips)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _progress(total: int, disable: bool) -> Any:
    try:
        from tqdm import tqdm

        return tqdm(
            total=total, unit="run", file=sys.stderr, disable=disable, dynamic_ncols=True, leave=False
        )
    except ImportError:

        class _Plain:
            def __init__(self) -> None:
                self.n = 0

            def set_postfix_str(self, text: str) -> None:
                if not disable:
                    print(f"  [{self.n + 1}/{total}] {text}", file=sys.stderr, flush=True)

            def update(self, n: int = 1) -> None:
                self.n += n

            def close(self) -> None:
                pass

        return _Plain()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    started = time.perf_counter()
    machine = machine_info()  # before the runs: the load average says how busy the machine was
    setup = resolve(args)
    out = args.out or Path(f"bench-out-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)

    epoch_samples = len(setup.indices) if setup.indices is not None else "all"
    print(f"fastcollate bench: {setup.description}")
    print(f"  transforms: {setup.transforms_note}")
    print(
        f"  batch {setup.batch_size}; each run is one epoch: {setup.warmup} warm-up batches (excluded from "
        f"timing) + {setup.steps} measured + the batches the configuration holds in flight, untimed "
        f"({PREFETCH_FACTOR} x workers, +{DEVICE_LOADER_DEPTH} with DeviceLoader), so no pipeline runs dry "
        f"while timed; the reference (default_collate, 0 workers) reads the whole fixed subset of "
        f"{epoch_samples} samples; {setup.repeat} runs per configuration, interleaved; median shown"
    )
    print(f"  workers {setup.workers}; device {setup.device}; observations: {', '.join(setup.observations)}")
    if "integrated" in setup.observations:
        print(f"  model: {setup.model_note}")
    load = machine["load_average"]
    if load and load[0] > machine["cpus_usable"]:
        setup.notes.append(
            f"the machine was busy at the start (load average {load[0]:.1f} on "
            f"{machine['cpus_usable']} CPUs): expect noisy numbers"
        )
    for note in setup.notes:
        print(f"  note: {note}")

    configs = [(o, v.key, w) for o in setup.observations for v in setup.variants for w in setup.workers]
    variants = {v.key: v for v in setup.variants}
    runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {c: [] for c in configs}
    reference_key = ("loader", "default", 0)
    total = len(configs) * setup.repeat + (0 if reference_key in runs else 1)
    bar = _progress(total, args.no_progress or None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*")
        if reference_key in runs:
            reference = None
        else:
            bar.set_postfix_str("reference: default_collate, 0 workers")
            reference = run_epoch(setup, variants["default"], 0, "loader", full=True)
            bar.update(1)
        for round_index in range(setup.repeat):
            # Alternate the order between rounds: a slow drift of a noisy machine then favours no config.
            ordered = configs if round_index % 2 == 0 else list(reversed(configs))
            if reference is None and round_index == 0:
                ordered = [reference_key] + [c for c in ordered if c != reference_key]
            for observation, variant_key, workers in ordered:
                bar.set_postfix_str(
                    f"{observation} {variants[variant_key].label}, {workers} workers, "
                    f"run {round_index + 1}/{setup.repeat}"
                )
                is_reference = reference is None  # the first run: workers=0 default path, whole subset
                run = run_epoch(setup, variants[variant_key], workers, observation, full=is_reference)
                run["round"] = round_index
                if reference is None:
                    reference = run
                run["check"] = compare_to_reference(run, reference)
                _units(setup, run)
                runs[(observation, variant_key, workers)].append(run)
                bar.update(1)
    bar.close()
    if reference is not None and reference["error"]:
        print(f"  note: the reference epoch itself failed ({reference['error']}): nothing is comparable")

    entries = [summarize(setup, key, runs[key]) for key in configs]
    limits: dict[str, Any] = {}
    if setup.device.type == "cuda" and reference is not None and reference["measured_steps"]:
        batch_bytes = int(reference["bytes"] / reference["measured_steps"])
        limits = {
            "batch_bytes": batch_bytes,
            "raw_pinned_h2d_GBps": raw_pinned_copy_gbps(batch_bytes, setup.device),
        }
        for e in entries:
            if e["h2d_ms_p50"]:
                e["h2d_GBps"] = batch_bytes / (e["h2d_ms_p50"] * 1e-3) / 1e9
                if limits["raw_pinned_h2d_GBps"]:
                    e["h2d_vs_raw_pinned"] = e["h2d_GBps"] / limits["raw_pinned_h2d_GBps"]
        if limits["raw_pinned_h2d_GBps"]:
            print(
                f"  raw pinned copy of one batch ({_fmt_bytes(batch_bytes)}): "
                f"{limits['raw_pinned_h2d_GBps']:.1f} GB/s (the host link's reference in this run)"
            )
    table = format_table(setup, entries)
    print(table)
    print()
    print(
        "  samples/s: samples delivered in the measured steps / their seconds (median over runs; spread: "
        "half the min-max range); wait: next(loader) time per measured step (with DeviceLoader it includes "
        "issuing the copy and the device transforms: asynchronous on a GPU, run in place on a CPU); "
        "start-up: iter() to first batch "
        "(worker start, reported apart); "
        "peak RSS: VmHWM of main + each worker (shared pages counted in each); "
        "PSS: proportional, the honest sum; shm: /dev/shm segments held by main + workers, sampled "
        "after warm-up and over the untimed tail (results.json also has the whole machine's /dev/shm growth)."
    )

    result = {
        "command": "python -m fastcollate bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine,
        "versions": versions(),
        "config": {
            "data": setup.name,
            "description": setup.description,
            "transforms": setup.transforms_note,
            "device_transforms": {k: repr(v) for k, v in setup.device_transforms.items()},
            "batch_size": setup.batch_size,
            "epoch_samples": len(setup.indices) if setup.indices is not None else None,
            "steps": setup.steps,
            "repeat": setup.repeat,
            "workers": setup.workers,
            "device": str(setup.device),
            "observations": setup.observations,
            "model": setup.model_note,
            "pin_memory": setup.pin_memory,
            "persistent_workers": True,
            "prefetch_factor": PREFETCH_FACTOR,
            "device_loader_depth": DEVICE_LOADER_DEPTH,
            "tail_batches": setup.tail,
            "seed": setup.seed,
            "unit": setup.unit,
            "quick": bool(args.quick),
            "order": "rounds over all configurations, reversed every other round",
        },
        "warmup_steps": setup.warmup,
        "notes": setup.notes,
        "limits": limits,
        "reference": {
            "config": "default_collate, 0 workers, loader-only, first run",
            "samples": int(reference["_ids"].size) if reference is not None else 0,
            "ids_crc32": _crc(reference["_ids"]) if reference is not None else None,
            "targets_crc32": _crc(reference["_targets"]) if reference is not None else None,
        },
        "configs": entries,
        "elapsed_s": time.perf_counter() - started,
        "load_average_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    (out / "results.json").write_text(json.dumps(_jsonable(result), indent=1))
    (out / "table.txt").write_text(table.lstrip("\n") + "\n")
    chart_problem = write_chart(setup, entries, out / "chart.png")
    print(
        f"\nwrote {out / 'results.json'}, {out / 'table.txt'}"
        + (f", {out / 'chart.png'}" if chart_problem is None else f" ({chart_problem})")
        + f" in {time.perf_counter() - started:.0f} s"
    )
    flagged = [e for e in entries if not e["ranked"]]
    return 1 if flagged else 0


def _crc(values: np.ndarray | None) -> int | None:
    from .datasets import fingerprint

    return None if values is None else fingerprint(values)


if __name__ == "__main__":
    sys.exit(main())
