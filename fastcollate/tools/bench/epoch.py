"""One epoch of one configuration, recorded: the time of each measured ``next()``, the copies to the
device, the ids and targets delivered, and the memory held. ``run_epoch`` never raises for the
configuration's own failure: the run comes back with its ``error``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Subset

from ...collate.ids import guess_target_path
from ...transfer.transforms import apply_to_fields
from .batches import CountingTransform, batch_len, crossed_bytes, ids_and_targets, to_device
from .configs import Setup, Variant, tail_batches
from .correctness import Delivered
from .loaders import close_loader, open_loader, sync
from .memory import EpochMemory, ProcessMemory
from .report import jsonable

__all__ = ["EpochRecorder", "EpochRun", "run_epoch"]


@dataclasses.dataclass
class EpochRun:
    """One epoch of one configuration, as measured; :meth:`to_json` is its entry under ``runs``.

    ``delivered`` and ``measured_ids`` stay out of the JSON: the check and the second unit read them.
    """

    error: str | None
    epoch_s: float
    asked_samples: int | None
    batches: int
    samples: int
    bytes: int
    seconds: float | None
    wait_ms: list[float]
    h2d_ms: list[float]
    h2d_call_ms: list[float]
    startup_s: float | None
    memory: EpochMemory
    device_loader_stats: dict[str, Any] | None
    delivered: Delivered
    measured_ids: np.ndarray
    second_unit: dict[str, float] = dataclasses.field(default_factory=dict)  # pixels or tokens, and per s
    round: int | None = None
    check: dict[str, Any] | None = None

    @property
    def measured_steps(self) -> int:
        return len(self.wait_ms)

    @property
    def samples_per_s(self) -> float | None:
        return (self.samples / self.seconds) if self.seconds else None

    @property
    def bytes_per_s(self) -> float | None:
        return (self.bytes / self.seconds) if self.seconds else None

    @property
    def wait_ms_p50(self) -> float | None:
        return _percentile(self.wait_ms, 50)

    @property
    def wait_ms_p95(self) -> float | None:
        return _percentile(self.wait_ms, 95)

    @property
    def h2d_ms_p50(self) -> float | None:
        return _percentile(self.h2d_ms, 50)

    @property
    def h2d_call_ms_p50(self) -> float | None:
        return _percentile(self.h2d_call_ms, 50)

    def to_json(self) -> dict[str, Any]:
        """The run as results.json keeps it (the keys it has always had, in their order)."""
        out: dict[str, Any] = {
            "error": self.error,
            "epoch_s": self.epoch_s,
            "asked_samples": self.asked_samples,
            "batches": self.batches,
            "measured_steps": self.measured_steps,
            "samples": self.samples,
            "seconds": self.seconds,
            "samples_per_s": self.samples_per_s,
            "bytes": self.bytes,
            "bytes_per_s": self.bytes_per_s,
            "wait_ms": self.wait_ms,
            "wait_ms_p50": self.wait_ms_p50,
            "wait_ms_p95": self.wait_ms_p95,
            "h2d_ms_p50": self.h2d_ms_p50,
            "h2d_call_ms_p50": self.h2d_call_ms_p50,
            "startup_s": self.startup_s,
            **dataclasses.asdict(self.memory),
            "device_loader_stats": self.device_loader_stats,
        }
        if self.round is not None:
            out["round"] = self.round
        if self.check is not None:
            out["check"] = self.check
        out.update(self.second_unit)
        return out


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


def run_epoch(setup: Setup, variant: Variant, workers: int, observation: str, full: bool = False) -> EpochRun:
    """One epoch of one configuration (see :class:`EpochRecorder`)."""
    return EpochRecorder(setup, variant, workers, observation, full).record()


class EpochRecorder:
    """Runs one epoch of one configuration and records it; :meth:`record` once per recorder.

    The epoch is the first ``warmup + steps + tail_batches(...)`` batches of the fixed subset (all of
    it with ``full``, as the reference takes it); an iterable data set is read whole. Batches
    ``warmup .. warmup + steps`` are measured; the tail after them only drains the pipeline.
    """

    def __init__(self, setup: Setup, variant: Variant, workers: int, observation: str, full: bool = False):
        self.setup = setup
        self.variant = variant
        self.workers = workers
        self.device = setup.device
        self.asked: int | None = None
        self.index_batches = None
        if setup.batches is not None:
            needed = setup.warmup + setup.steps + tail_batches(variant, workers)
            self.index_batches = setup.batches if full else setup.batches[:needed]
            self.asked = sum(len(b) for b in self.index_batches)
        elif setup.indices is not None:
            self.asked = len(setup.indices)
            if not full:
                needed = (setup.warmup + setup.steps + tail_batches(variant, workers)) * setup.batch_size
                self.asked = min(self.asked, needed)
        self.moved_by_loader = variant.transfer == "DeviceLoader"
        self.transforms: dict[str, CountingTransform] = {}
        if setup.times_device_transforms(observation):  # see there: without a GPU loader-only skips them
            self.transforms = {k: CountingTransform(fn) for k, fn in setup.device_transforms.items()}
        self.step = setup.make_step() if observation == "integrated" and setup.make_step is not None else None
        self.last = setup.warmup + setup.steps  # batches before the untimed tail
        self.target_path = setup.target_path
        # What the epoch records, batch by batch.
        self.batches = 0
        self.samples = 0
        self.bytes = 0
        self.waits: list[float] = []
        self.h2d_call: list[float] = []
        self.h2d_events: list[tuple[Any, Any]] = []
        self.ids: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []
        self.measured_ids: list[torch.Tensor] = []
        self.started = 0.0
        self.startup_s: float | None = None
        self.t_begin: float | None = None
        self.t_end: float | None = None

    def record(self) -> EpochRun:
        """Runs the epoch: memory watched from before the loader exists, the loader shut down after."""
        memory = ProcessMemory()
        dataset = self.setup.dataset
        if self.setup.indices is not None:
            dataset = Subset(self.setup.dataset, self.setup.indices[: self.asked])
        loader, source = open_loader(
            self.setup,
            self.variant,
            self.workers,
            dataset,
            self.transforms,
            record_copy_events=self.device.type == "cuda",
            batches=self.index_batches,
        )
        error = None
        stats: dict[str, Any] = {}
        self.started = time.perf_counter()
        try:
            self._iterate(iter(source), memory)
            memory.read_workers()
            stats = self._read_device_loader(source)
        except Exception as exc:  # the configuration failed: record it, flag it, keep going
            error = f"{type(exc).__name__}: {exc}"
        finally:
            try:
                close_loader(loader, source)
            except Exception:
                pass
        return self._result(error, memory.result(stats), stats)

    def _iterate(self, iterator: Any, memory: ProcessMemory) -> None:
        warmup = self.setup.warmup
        while True:
            if self.batches == warmup:
                memory.sample_held_shm()
                sync(self.device)
                self.t_begin = time.perf_counter()
            t0 = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                break
            wait = time.perf_counter() - t0
            if self.startup_s is None:
                self.startup_s = time.perf_counter() - self.started
            self._take(batch, wait)
            del batch
            self.batches += 1
            if self.batches == self.last:
                sync(self.device)
                self.t_end = time.perf_counter()
            if self.batches >= self.last:
                memory.sample_held_shm()  # over the untimed tail, where the pipeline holds the most
            memory.sample_system_shm()
        sync(self.device)
        if self.t_end is None and self.t_begin is not None:
            self.t_end = time.perf_counter()  # fewer batches than warm-up + steps: measure what there was

    def _take(self, batch: Any, wait: float) -> None:
        """One delivered batch: to the device, its ids and targets noted, the model's step, the counts."""
        index = self.batches
        measured = self.setup.warmup <= index < self.last
        if not self.moved_by_loader:
            batch = apply_to_fields(self._to_device(batch, measured), self.transforms)
        if self.target_path is None:
            self.target_path = guess_target_path(batch)
        batch_ids, batch_targets = ids_and_targets(batch, self.target_path)
        if batch_ids is not None:
            self.ids.append(batch_ids)
        if batch_targets is not None:
            self.targets.append(batch_targets)
        if self.step is not None and index < self.last:  # the tail only drains the epoch
            self.step(batch)
        if measured:
            self.waits.append(wait)
            self.samples += int(batch_ids.numel()) if batch_ids is not None else batch_len(batch)
            if batch_ids is not None:
                self.measured_ids.append(batch_ids)
            self.bytes += crossed_bytes(batch, index, self.transforms)

    def _to_device(self, batch: Any, measured: bool) -> Any:
        """The default path's copy: ``.to(non_blocking=True)``, its call time and (on a GPU) its
        events noted for the measured batches."""
        if self.device.type == "cpu":
            return batch
        h0 = time.perf_counter()
        if self.device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            batch = to_device(batch, self.device, non_blocking=True)
            stop.record()
            if measured:
                self.h2d_events.append((start, stop))
        else:
            batch = to_device(batch, self.device, non_blocking=True)
        if measured:
            self.h2d_call.append(time.perf_counter() - h0)
        return batch

    def _read_device_loader(self, source: Any) -> dict[str, Any]:
        """DeviceLoader's stats, and its copy events for the measured batches (they replace none: the
        default path has its own)."""
        if not self.moved_by_loader:
            return {}
        stats = dict(source.stats()) if hasattr(source, "stats") else {}
        copy_events = list(getattr(source, "copy_events", None) or [])
        if copy_events:  # one (start, end) pair per batch, in delivery order, on the copy stream
            self.h2d_events = copy_events[self.setup.warmup : self.last]
        return stats

    def _result(self, error: str | None, memory: EpochMemory, stats: dict[str, Any]) -> EpochRun:
        seconds = None
        if self.t_begin is not None and self.t_end is not None:
            seconds = self.t_end - self.t_begin
        try:
            sync(self.device)
            h2d_ms = [s.elapsed_time(e) for s, e in self.h2d_events]
        except Exception:  # an event never recorded (the run failed before it): no copy times
            h2d_ms = []
        ids = _joined(self.ids)
        every_id_has_a_target = self.targets and sum(t.numel() for t in self.targets) == ids.size
        targets = _joined(self.targets) if every_id_has_a_target else None
        measured_ids = _joined(self.measured_ids)
        self.setup.target_path = self.target_path  # the runs after this one look where it found them
        run = EpochRun(
            error=error,
            epoch_s=time.perf_counter() - self.started,
            asked_samples=self.asked,
            batches=self.batches,
            samples=self.samples,
            bytes=self.bytes,
            seconds=seconds,
            wait_ms=[w * 1e3 for w in self.waits],
            h2d_ms=h2d_ms,
            h2d_call_ms=[h * 1e3 for h in self.h2d_call],
            startup_s=self.startup_s,
            memory=memory,
            device_loader_stats=jsonable(stats) if stats else None,
            delivered=Delivered(ids=ids, targets=targets),
            measured_ids=measured_ids,
        )
        run.second_unit = self._second_unit(run)
        return run

    def _second_unit(self, run: EpochRun) -> dict[str, float]:
        """Pixels or tokens in the measured steps, and per second, where the data set says how many."""
        if not run.seconds:
            return {}
        dataset = self.setup.dataset
        out: dict[str, float] = {}
        pixels = getattr(dataset, "pixels_per_sample", None)
        if pixels:
            out["pixels"] = run.samples * pixels
            out["pixels_per_s"] = out["pixels"] / run.seconds
        length_of = getattr(dataset, "length_of", None)
        if callable(length_of) and run.measured_ids.size:
            out["tokens"] = int(np.sum(length_of(run.measured_ids)))
            out["tokens_per_s"] = out["tokens"] / run.seconds
        return out


def _joined(tensors: list[torch.Tensor]) -> np.ndarray:
    """Per-batch tensors as one flat array, in delivery order (an empty int64 array for none)."""
    if not tensors:
        return np.empty(0, np.int64)
    return torch.cat([t.cpu().reshape(-1) for t in tensors]).numpy()
