"""The GPU benchmark behind docs/results' GPU figures: DeviceLoader against the default path, in one run.

    python -m benchmarks.gpu_bench --out DIR [--quick]

Measured side by side on one GPU, same batches (uint8 3x224x224 images, batch 256):
- samples/s of a transfer-bound loop (light model) and a compute-bound loop (heavier model) for three
  paths, workers 0, 2, 4: DataLoader(pin_memory=True) + .to(non_blocking=True); assemble + DeviceLoader
  with shared slots (a worker's batch arrives in a slot this process page-locked once: no host copy);
  and, with workers, the same with shared slots off (fresh shared memory, packed into a pinned slot);
- host copies per batch (DeviceLoader's host_packs) and slot registrations after warm-up;
- DeviceLoader's host-to-device GB/s (its copy events) against a bare pinned copy_ of the same bytes
  (``fastcollate.tools.bench.pinned_copy``: the measurement ``python -m fastcollate bench`` reports too);
- the pipelined step time against max(copy time, compute time);
- pinned bytes held (DeviceLoader's ring, and the shared slots page-locked for it) against their bound:
  depth x batch bytes for the ring, plus (2w+4) x batch bytes with w workers (the default
  max_shared_slots: every slot a worker may use is page-locked once, with 1/16 headroom), and pinned
  allocations after warm-up;
- the time of DeviceLoader's Normalize on one batch, beside the copy's (both on the copy stream);
- data already in arrays (fastcollate.Arrays, IndexBatches, workers=0): gathered into DeviceLoader's
  pinned slot and copied in one H2D, against ``X[idx].pin_memory().to()``, with host copies per batch.
Every repetition's values are kept under "runs"; tables show medians. The JSON is written after every
configuration, and a configuration that fails is recorded there while the others still run.
Without a GPU it runs the same loops on the CPU with tiny sizes (to check the script end to end) and
reports the GPU figures as null.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

import fastcollate
from fastcollate import DeviceLoader, Normalize
from fastcollate.tools.bench.pinned_copy import pinned_copy_gbps

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class Images(Dataset):
    """uint8 images from a small pool of distinct random ones (so workers do real stacking work)."""

    def __init__(self, n: int, size: int, pool: int = 32, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.pool = torch.randint(0, 256, (pool, 3, size, size), dtype=torch.uint8, generator=generator)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        return {"id": index, "image": self.pool[index % len(self.pool)], "label": index % 1000}


def light_model() -> nn.Module:
    """Little compute per byte: the loop is bound by getting the batch onto the device."""
    return nn.Sequential(nn.Conv2d(3, 8, 8, stride=8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 10))


def heavy_model() -> nn.Module:
    """Enough compute per batch that the copy can hide behind it."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, padding=1), nn.ReLU()]
    for _ in range(4):
        layers += [nn.Conv2d(64, 64, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_default(dataset, model, workers, batch_size, steps, warmup, device):
    """DataLoader(pin_memory=True) + .to(non_blocking=True) on the current stream, normalize on device."""
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=default_collate,
                        pin_memory=device.type == "cuda", persistent_workers=False)
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
    seen = 0
    start = None
    for step, batch in enumerate(loader):
        if step == warmup:
            sync(device)
            start = time.perf_counter()
        images = batch["image"].to(device, non_blocking=True)
        images = (images.float() / 255 - mean) / std
        model(images)
        if step >= warmup:
            seen += images.shape[0]
        if step == warmup + steps - 1:
            break
    sync(device)
    return seen / (time.perf_counter() - start)


class StepClock:
    """Step times on the consumer's stream. On a GPU, an event is recorded after each step's work and
    read once the loop has synchronised: host time between ``next()`` calls would measure how far the
    host runs ahead of the GPU, not the step. Without a GPU, host time."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def step_ms(self) -> list[float]:
        """Consecutive intervals between marks (call after synchronising)."""
        pairs = zip(self.marks, self.marks[1:], strict=False)  # n marks, n - 1 intervals
        if self.cuda:
            return [a.elapsed_time(b) for a, b in pairs]
        return [(b - a) * 1e3 for a, b in pairs]


def slot_bound(workers: int) -> int:
    """The shared slots a run's workers may use: the default max_shared_slots (worker_slots.claim)."""
    return 2 * workers + 4 if workers else 0


def extra_warmup_steps(workers: int) -> int:
    """The most steps warm-up is extended by, waiting for the slot registrations to stop growing."""
    return 2 * slot_bound(workers)


def run_device_loader(dataset, model, workers, batch_size, steps, warmup, device, depth=2, shared_slots=True):
    collate = fastcollate.Assembler(shared_slots=shared_slots)  # its own pool: registrations counted from 0
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=collate)
    device_loader = DeviceLoader(loader, device=device, depth=depth, record_copy_events=device.type == "cuda",
                                 transforms={"image": Normalize(MEAN, STD)})
    seen = 0
    start = None
    clock = StepClock(device)
    warm_allocations = None
    warm_slots = None
    # Warm-up lasts `warmup` steps, and then until no slot was page-locked for slot_bound steps (at most
    # extra_warmup_steps more): a slot first used later is registered once then, which is not a cost per
    # batch. What is left is counted against the slots first written after warm-up (see below).
    timed_from = None
    quiet, last_registrations = 0, -1
    settle = slot_bound(workers) if shared_slots and device.type == "cuda" else 0  # else none are page-locked
    for step, batch in enumerate(device_loader):
        if timed_from is None and step >= warmup:
            slots = collate.shared_slot_stats()
            registrations = slots.registrations if slots else 0
            quiet = quiet + 1 if registrations == last_registrations else 0
            last_registrations = registrations
            if quiet >= settle or step >= warmup + extra_warmup_steps(workers):
                timed_from = step
                sync(device)
                start = time.perf_counter()
                warm_allocations = device_loader.stats()["pinned_allocations"]
                warm_slots = slots
                clock.mark()
        model(batch["image"])
        if timed_from is not None:
            seen += batch["image"].shape[0]
            clock.mark()
            if step == timed_from + steps - 1:
                break
    sync(device)
    elapsed = time.perf_counter() - start
    stats = device_loader.stats()
    slots = collate.shared_slot_stats()
    copy_ms = []
    if device_loader.copy_events is not None:
        copy_ms = [s.elapsed_time(e) for s, e in list(device_loader.copy_events)[timed_from:]]
    device_loader.close()
    # Registrations after warm-up beyond one for each slot first written after it: a slot page-locked
    # again (remapped), or on every batch, shows here; a slot first used late does not.
    registrations_after = new_slots_after = 0
    if slots is not None and warm_slots is not None:
        registrations_after = slots.registrations - warm_slots.registrations
        new_slots_after = slots.slots_used - warm_slots.slots_used
    return {
        "samples_per_s": seen / elapsed,
        "step_ms": clock.step_ms(),
        "copy_ms": copy_ms,
        "pinned_bytes": stats["pinned_bytes"],
        "pinned_allocations_after_warmup": stats["pinned_allocations"] - (warm_allocations or 0),
        "host_packs_per_batch": stats["host_packs"] / max(stats["batches"], 1),
        "warmup_steps": timed_from,
        "slot_registrations_after_warmup": max(0, registrations_after - new_slots_after),
        "slot_registrations_after_warmup_raw": registrations_after,
        "slots_first_used_after_warmup": new_slots_after,
        # Page-locked now: the ring's slots and the shared slots' mappings (registered for DeviceLoader).
        "pinned_bytes_with_slots": stats["pinned_bytes"] + (slots.registered_bytes if slots else 0),
        "pinned_bound_bytes": None,  # set by the caller, which knows the batch's bytes
        "shared_slots": slots.__dict__ if slots else None,
        "stats": stats,
    }


def run_arrays(device: torch.device, quick: bool, steps: int) -> dict:
    """Data already in arrays, gathered by index straight into DeviceLoader's pinned slot and copied in
    one H2D a batch, against the batched-index idiom (``X[idx]``, then ``pin_memory()`` and
    ``.to(non_blocking=True)``), workers=0, in one run. Host copies per batch after the gather: 0 expected."""
    rows, count = (4096, 256) if quick else (1_000_000, 4096)
    cases = {
        "tabular": ({"x": torch.randn(rows, 64), "label": torch.randint(0, 10, (rows,))},
                    64 if quick else 4096),
        "images": ({"image": torch.randint(0, 256, (count, 3, 32 if quick else 224, 32 if quick else 224),
                                           dtype=torch.uint8), "label": torch.randint(0, 1000, (count,))},
                   16 if quick else 256),
    }
    pin = device.type == "cuda"
    out = {}
    for name, (columns, batch) in cases.items():
        n = len(next(iter(columns.values())))
        arrays = fastcollate.Arrays(columns, index_as="id")
        loader = DataLoader(arrays, batch_sampler=fastcollate.IndexBatches(n, batch, shuffle=True, seed=0),
                            collate_fn=fastcollate.assemble)
        device_loader = DeviceLoader(loader, device=device)
        result: dict = {}
        for contender in ("idiom", "arrays"):
            it = iter(device_loader) if contender == "arrays" else None
            order = torch.randperm(n)
            for step in range(steps + 3):
                if step == 3:
                    sync(device)
                    start = time.perf_counter()
                if contender == "arrays":
                    got = next(it, None)
                    if got is None:  # an epoch ended: the next one
                        it = iter(device_loader)
                        got = next(it)
                else:
                    index = order[(step * batch) % (n - batch):][:batch]
                    got = {k: (c[index].pin_memory() if pin else c[index]).to(device, non_blocking=True)
                           for k, c in columns.items()}
                del got
            sync(device)
            result[f"{contender}_samples_per_s"] = steps * batch / (time.perf_counter() - start)
        stats = device_loader.stats()
        device_loader.close()
        result["arrays_over_idiom"] = result["arrays_samples_per_s"] / result["idiom_samples_per_s"]
        result["host_packs_per_batch"] = stats["host_packs"] / max(stats["batches"], 1)
        result["direct_from_slot_per_batch"] = stats["direct_from_slot"] / max(stats["batches"], 1)
        out[name] = result
        print(f"  arrays {name}: gathered + DeviceLoader {result['arrays_samples_per_s']:9.0f}/s, "
              f"idiom + pin + .to() {result['idiom_samples_per_s']:9.0f}/s, "
              f"ratio {result['arrays_over_idiom']:.2f}, host copies "
              f"per batch {result['host_packs_per_batch']:.2f}")
    return out


def gpu_ms(work, device: torch.device, repeat: int = 10, warmup: int = 2) -> list[float]:
    """Times ``work()`` ``repeat`` times: CUDA events on a GPU, host time on the CPU."""
    times = []
    for _ in range(repeat + warmup):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            work()
            times.append((time.perf_counter() - t0) * 1e3)
    return times[warmup:]


def compute_ms(model, batch_size, size, device) -> list[float]:
    images = torch.randn(batch_size, 3, size, size, device=device)
    return gpu_ms(lambda: model(images), device)


def normalize_ms(batch_size, size, device) -> list[float]:
    """DeviceLoader's Normalize on one batch: it runs on the copy stream, ahead of the next copy."""
    images = torch.randint(0, 256, (batch_size, 3, size, size), dtype=torch.uint8, device=device)
    normalize = Normalize(MEAN, STD)
    return gpu_ms(lambda: normalize(images), device)


def median(values):
    return statistics.median(values) if values else None


def summarize(runs: list[dict], bare: list[float], compute: dict, normalize: list[float], workers: list[int],
              batch_bytes: int, gpu: bool) -> dict:
    """The figures against their targets, from the runs so far (medians)."""
    ok = [r for r in runs if "error" not in r]

    def pick(loop, w, key):
        return [r[key] for r in ok if r["loop"] == loop and r["workers"] == w]

    speedup = {str(w): median([o / d for o, d in zip(pick("transfer_bound", w, "samples_per_s"),
                                                        pick("transfer_bound", w, "default_samples_per_s"),
                                                        strict=False)])
               for w in workers}
    with_workers = [w for w in workers if w > 0]
    over_fresh = {str(w): median([o / f for o, f in zip(pick("transfer_bound", w, "samples_per_s"),
                                                       pick("transfer_bound", w, "fresh_shm_samples_per_s"),
                                                       strict=False)])
                  for w in with_workers}
    copy_ms = [c for r in ok for c in r["copy_ms"]]
    loader_gbps = [batch_bytes / (c / 1e3) / 1e9 for c in copy_ms if c > 0]
    top = max(workers)
    step_ms = median([median(s) for s in pick("compute_bound", top, "step_ms") if s])
    copy_median = median(copy_ms)
    compute_median = median(compute.get("compute_bound", []))
    return {
        "speedup_vs_default": speedup,
        "speedup_of_shared_slots_vs_fresh_shm": over_fresh,
        "host_packs_per_batch_with_shared_slots": max((r["host_packs_per_batch"] for r in ok), default=None),
        "slot_registrations_after_warmup": max((r["slot_registrations_after_warmup"] for r in ok),
                                               default=None),
        "h2d_efficiency": (median(loader_gbps) / median(bare)) if gpu and loader_gbps and bare else None,
        "h2d_gbps": {"device_loader": median(loader_gbps), "bare_pinned_copy": median(bare)}
        if gpu else None,
        "step_over_max_copy_compute": (step_ms / max(copy_median, compute_median))
        if gpu and step_ms and copy_median and compute_median else None,
        "step_ms": {"pipelined": step_ms, "copy": copy_median, "normalize": median(normalize),
                    "compute": compute_median, "workers": top},
        # The ring's bound (depth x batch) plus, with workers, the slots' ((2w+4) x batch).
        "pinned_bytes_over_bound": max(r["pinned_bytes_with_slots"] / r["pinned_bound_bytes"] for r in ok)
        if gpu and ok else None,
        "pinned_allocs_after_warmup": max(r["pinned_allocations_after_warmup"] for r in ok)
        if gpu and ok else None,
        "failed_configurations": len(runs) - len(ok),
    }


TARGETS = {"speedup_vs_default": ">= 1.5 at each worker count",
           "speedup_of_shared_slots_vs_fresh_shm": "> 1 at each worker count",
           "host_packs_per_batch_with_shared_slots": "== 0 (on a GPU)",
           "slot_registrations_after_warmup": "== 0",
           "h2d_efficiency": ">= 0.9",
           "step_over_max_copy_compute": "<= 1.1",
           "pinned_bytes_over_bound": "<= 1.1 (bound: depth x batch bytes, plus (2w+4) x batch bytes of "
                                      "page-locked shared slots with w workers)",
           "pinned_allocs_after_warmup": "== 0", "failed_configurations": "== 0"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the script end to end")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--time-budget", type=float, default=None, metavar="S",
                        help="start no configuration after S seconds (those left are recorded as skipped)")
    args = parser.parse_args(argv)
    began = time.monotonic()

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    quick = args.quick or not gpu
    size, batch_size = (32, 16) if quick else (224, 256)
    steps, warmup, repeat = (4, 2, 1) if quick else (30, 5, args.repeat)
    workers = [w for w in args.workers if w <= (os.cpu_count() or 1)]
    if not workers:
        parser.error(f"no worker count in {args.workers} fits this machine's {os.cpu_count()} CPUs")
    # Room for the longest warm-up (run_device_loader may extend it).
    dataset = Images(n=batch_size * (steps + warmup + extra_warmup_steps(max(workers)) + 2), size=size)
    batch_bytes = batch_size * 3 * size * size + 2 * batch_size * 8
    torch.backends.cudnn.benchmark = True
    models = {"transfer_bound": light_model().to(device), "compute_bound": heavy_model().to(device)}
    if device.type == "cuda":
        models = {name: model.to(memory_format=torch.channels_last) for name, model in models.items()}

    device_name = torch.cuda.get_device_name() if gpu else "cpu (no GPU)"
    date = datetime.date.today().isoformat()
    name = (device_name.replace(" ", "-").replace("(", "").replace(")", "") + "-" + date).lower()
    path = args.out / f"{name}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    skipped: list[dict] = []
    print(f"device: {device_name if gpu else 'cpu (no GPU: tiny sizes, GPU figures null)'}")
    print(f"batch {batch_size} x uint8 3x{size}x{size}; {steps} timed steps after {warmup} warm-up; "
          f"{repeat} repetitions")

    reference_errors: dict[str, str] = {}

    def reference(name: str, measure, default):
        """A reference measurement; a failure is recorded (and written) instead of ending the run."""
        try:
            return measure()
        except Exception as error:  # noqa: BLE001  (recorded in the JSON)
            reference_errors[name] = f"{type(error).__name__}: {error}"
            print(f"  {name}: FAILED {reference_errors[name]}")
            return default

    with torch.inference_mode():
        # The references first: cheap, and the ratios need them whatever happens later.
        bare = []
        if gpu:
            # The ceiling DeviceLoader's copies meet: the same measurement as the bench's raw pinned copy.
            bare = reference("bare_pinned_copy", lambda: pinned_copy_gbps(batch_bytes, device), [])
        compute = {loop: reference(f"compute_{loop}",
                                   lambda m=model: compute_ms(m, batch_size, size, device), [])
                   for loop, model in models.items()}
        normalize = reference("normalize", lambda: normalize_ms(batch_size, size, device), [])
        arrays = reference("arrays", lambda: run_arrays(device, quick, steps), {})

        def write() -> dict:
            result = {
                "device": device_name,
                "torch": torch.__version__,
                "fastcollate": fastcollate.__version__,
                "date": date,
                "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                            "python": sys.version.split()[0]},
                "config": {"batch_size": batch_size, "image": [3, size, size], "dtype": "uint8",
                           "steps": steps,
                           "warmup_steps": warmup, "repetitions": repeat, "workers": workers, "depth": 2,
                           "step_timing": "CUDA events on the consumer stream" if gpu else "host clock"},
                **summarize(runs, bare, compute, normalize, workers, batch_bytes, gpu),
                "targets": TARGETS,
                "runs": runs,
                "reference_errors": reference_errors,
                "skipped_for_time": skipped,
                "bare_pinned_copy_gbps_runs": bare,
                "compute_ms_runs": compute,
                "normalize_ms_runs": normalize,
                "arrays": arrays,
            }
            # Whole or not at all: a kill by gpu_check's timeout mid-write must leave the last complete
            # JSON (the temporary file is removed by gpu_check if one is left).
            partial = path.with_name(path.name + ".partial")
            partial.write_text(json.dumps(result, indent=2))
            os.replace(partial, path)
            return result

        write()  # the references alone, before any configuration runs
        took: dict[int, float] = {}  # the longest configuration so far, by worker count
        for repetition in range(repeat):
            for loop, model in models.items():
                for w in workers:
                    config = {"repetition": repetition, "loop": loop, "workers": w}
                    # Not started if it would end past the budget (as long as the longest with as many
                    # workers took): a configuration cut by gpu_check's timeout is lost.
                    if args.time_budget is not None and \
                            time.monotonic() - began + took.get(w, 0.0) > args.time_budget:
                        skipped.append(config)
                        continue
                    config_began = time.monotonic()
                    # Interleaved: the default path, then DeviceLoader, at each setting. A failure is
                    # recorded and the others still run.
                    try:
                        default_rate = run_default(dataset, model, w, batch_size, steps, warmup, device)
                        ours = run_device_loader(dataset, model, w, batch_size, steps, warmup, device)
                        # Without workers both assemble paths are the main process's ring: one run.
                        fresh = run_device_loader(dataset, model, w, batch_size, steps, warmup, device,
                                                  shared_slots=False) if w else ours
                    except Exception as error:  # noqa: BLE001  (recorded in the JSON, and the run goes on)
                        runs.append({**config, "error": f"{type(error).__name__}: {error}"})
                        print(f"  rep {repetition} {loop:<14} workers={w}: FAILED {runs[-1]['error']}")
                        write()
                        continue
                    took[w] = max(took.get(w, 0.0), time.monotonic() - config_began)
                    ours["pinned_bound_bytes"] = (2 + (slot_bound(w) if w else 0)) * batch_bytes
                    runs.append({**config, "default_samples_per_s": default_rate,
                                 **{k: v for k, v in ours.items() if k != "stats"},
                                 "device_loader_stats": ours["stats"],
                                 "fresh_shm_samples_per_s": fresh["samples_per_s"],
                                 "fresh_shm_host_packs_per_batch": fresh["host_packs_per_batch"]})
                    print(f"  rep {repetition} {loop:<14} workers={w}: default {default_rate:9.0f}/s  "
                          f"DeviceLoader {ours['samples_per_s']:9.0f}/s "
                          f"(slots off {fresh['samples_per_s']:9.0f}/s)  "
                          f"ratio {ours['samples_per_s'] / default_rate:5.2f}  "
                          f"host copies/batch {ours['host_packs_per_batch']:.2f}")
                    write()
    result = write()

    print("\nsummary (medians; targets in brackets):")
    for key in TARGETS:
        print(f"  {key}: {result[key]}  [{TARGETS[key]}]")
    print(f"  step_ms: {result['step_ms']}")
    if skipped:
        print(f"  {len(skipped)} configurations skipped: past the time budget of {args.time_budget} s")
    print(f"wrote {path}")
    return 1 if result["failed_configurations"] or reference_errors else 0


if __name__ == "__main__":
    sys.exit(main())
