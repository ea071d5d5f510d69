import os
import sys

import pytest
import torch


def cuda_available() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # no driver
        return False


CUDA = cuda_available()

# make fuzz sets it: the tests marked fuzz, heavier variants of checks make test runs lighter, run too.
FUZZ = os.environ.get("FASTCOLLATE_FUZZ") == "1"

# The modules whose tests ask for local_ray: one Ray serves them while they run one after another.
RAY_MODULES: set[str] = set()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU: none is visible on this machine")
    fuzz_only = pytest.mark.skip(reason="a heavier variant of a check make test runs: make fuzz runs it")
    for item in items:
        if "needs_cuda" in item.keywords and not CUDA:
            item.add_marker(skip)
        if "fuzz" in item.keywords and not FUZZ:
            item.add_marker(fuzz_only)
        if "local_ray" in item.fixturenames:
            RAY_MODULES.add(item.module.__name__)


def cpu_and_cuda():
    return ("cpu", pytest.param("cuda", marks=pytest.mark.needs_cuda))


@pytest.fixture
def brief_busy_sample(monkeypatch):
    """bench and profile sample how busy the machine is (cpus_busy_now) for 0.5 s before anything else,
    even bad input; for a module whose tests read no figure of it, a 10 ms sample spares each in-process
    run the wait."""
    from fastcollate.tools.bench import machine

    sample = machine.cpus_busy_now
    monkeypatch.setattr(machine, "cpus_busy_now", lambda seconds=0.01: sample(seconds))


@pytest.fixture
def local_ray():
    """A local Ray shared by the tests that ask for it: 2 CPUs, no dashboard, its workers' logs kept off
    the output. ray.init takes seconds, so the first such test starts it and it stays up while the next
    test to run is in a module that uses it; it is shut down before any other test, so that the
    shared-memory counts and the CPUs of the other tests see no Ray."""
    ray = pytest.importorskip("ray", reason="ray is not installed")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    return ray


def pytest_runtest_teardown(item, nextitem):
    if nextitem is not None and getattr(nextitem.module, "__name__", None) in RAY_MODULES:
        return
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
