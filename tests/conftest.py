import pytest
import torch


def cuda_available() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # no driver
        return False


CUDA = cuda_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU: none is visible on this machine")
    for item in items:
        if "needs_cuda" in item.keywords and not CUDA:
            item.add_marker(skip)


def cpu_and_cuda():
    return ("cpu", pytest.param("cuda", marks=pytest.mark.needs_cuda))


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray for one test module: 2 CPUs, no dashboard, its workers' logs kept off the output; always
    shut down, so that the next module (and the shared-memory counts of the other tests) start clean."""
    ray = pytest.importorskip("ray", reason="ray is not installed")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()
