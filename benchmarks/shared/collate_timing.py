"""How the collate cases are timed: every contender once a round, in a shuffled order (``time_case``),
and the machine, build and commit a run's JSON records (``machine``). collate_ratios.py and
packed_neighbours.py time with them."""

from __future__ import annotations

import datetime as dt
import gc
import hashlib
import os
import platform
import random
import resource
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

import fastcollate

from .collate_cases import Case

REPO = Path(__file__).resolve().parents[3]  # the checkout (git describes the commit that ran)


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True)
            return done.stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"


    module = Path(fastcollate._C.__file__)
    return {
        "fastcollate_path": str(Path(fastcollate.__file__).parent),
        "extension_sha256_16": hashlib.sha256(module.read_bytes()).hexdigest()[:16],
        "extension_mtime": dt.datetime.fromtimestamp(module.stat().st_mtime, dt.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "numpy": np.__version__,
        "fastcollate": fastcollate.__version__,
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty_paths": [line.split(maxsplit=1)[1] for line in git("status", "--porcelain").splitlines()],
        "torch_parallel_backend": torch.__config__.parallel_info().splitlines()[-1].strip()
        if torch.__config__.parallel_info() else "",
        # glibc's mmap threshold moves fresh-allocation contenders by up to 2x: say which settings ran.
        "malloc": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
        or "glibc defaults",
    }


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_case(case: Case, rounds: int, warmup: int, seed: int = 0, gc_generation: int = 0,
              fresh: bool = False, faults: dict[str, list[int]] | None = None) -> dict[str, list[float]]:
    """Every contender once per round, in a shuffled order. ``fresh``: each call gets the samples made
    again just before it (untimed), as a worker's collate_fn gets them from ``__getitem__``. ``faults``,
    if given, gets each timed call's minor page faults (the process's, read just outside the timed span,
    so that they cover the call)."""
    names = list(case.contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    samples = case.samples
    order = random.Random(seed)
    for r in range(-warmup, rounds):
        order.shuffle(names)
        gc.collect(gc_generation)
        for name in names:
            fn = case.contenders[name]
            if fresh:
                samples = None  # freed first, as a worker's last batch of samples is
                samples = case.build()
            gc.disable()
            try:
                faults_before = minor_faults() if faults is not None else 0
                start = time.perf_counter_ns()
                out = fn(samples)
                elapsed = time.perf_counter_ns() - start
                faulted = minor_faults() - faults_before if faults is not None else 0
                del out  # the batch is consumed: the ring slot is free for the next call
            finally:
                gc.enable()
            if r >= 0:
                times[name].append(elapsed / 1e9)
                if faults is not None:
                    faults.setdefault(name, []).append(faulted)
    return times
