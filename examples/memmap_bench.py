"""Your own data in a memory-mapped file, measured by the bench: a factory for
``python -m fastcollate bench --dataset examples/memmap_bench.py:make``.

The file (rows x 64 float32 features, and an int64 label column) is written once into the temporary
folder, then opened read-only with ``np.memmap``: nothing is read into memory until a batch gathers its
rows. ``fastcollate.Arrays`` pickles a memmap column as its place in the file, so a spawned worker maps
the file again instead of receiving the array (forked workers share the mapping).
"""

import os
import tempfile

import numpy as np

import fastcollate

FEATURES = 64


def _file(size: int, seed: int, name: str, dtype, shape: tuple[int, ...], fill) -> np.memmap:
    path = os.path.join(tempfile.gettempdir(), f"fastcollate-example-{name}-{size}-{seed}.bin")
    if not os.path.exists(path) or os.path.getsize(path) != np.dtype(dtype).itemsize * int(np.prod(shape)):
        scratch = f"{path}.{os.getpid()}.part"
        out = np.memmap(scratch, dtype=dtype, mode="w+", shape=shape)
        out[:] = fill(np.random.default_rng(seed))
        out.flush()
        del out
        os.replace(scratch, path)  # atomic: a concurrent run never opens a half-written file
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


def make(size: int = 200_000, seed: int = 0) -> dict:
    features = _file(
        size,
        seed,
        "x",
        np.float32,
        (size, FEATURES),
        lambda rng: rng.standard_normal((size, FEATURES), dtype=np.float32),
    )
    labels = _file(size, seed, "label", np.int64, (size,), lambda rng: rng.integers(0, 10, size))
    return {"dataset": fastcollate.Arrays(x=features, label=labels), "batch_size": 4096, "unit": "bytes"}
