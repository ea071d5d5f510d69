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
