"""Embedded data sets for ``python -m fastcollate bench`` and ``profile``: generated, deterministic from a
seed, no download. Every sample is a dict with an int ``"id"`` (its index) and an int ``"target"``.

Classes are module-level and hold no open files when pickled, so spawned DataLoader workers work. The
presets that name them for ``--preset`` are ``fastcollate.tools.bench.presets``.
"""

from __future__ import annotations

import os
import tempfile
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ...collate.contract import Contract, Field

__all__ = [
    "FashionLike",
    "ImageNetLike",
    "ManyFields",
    "PreDecoded",
    "TokenSequences",
    "cache_dir",
    "pad_tokens_collate",
]


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/fastcollate``, else ``~/.cache/fastcollate``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastcollate"


def _sample_rng(seed: int, index: int) -> np.random.Generator:
    # One stream per (seed, index): a sample is the same whichever worker makes it, in whatever order.
    return np.random.default_rng((seed, index))


# --------------------------------------------------------------------------------------------------
# FashionMNIST-like: 28x28 grayscale uint8, 10 classes, with the seed study's transforms.


def _generate_fashion(size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size, dtype=np.int64)
    yy, xx = np.mgrid[0:28, 0:28].astype(np.float32) / 27.0 * 2.0 - 1.0
    templates = np.empty((10, 28, 28), np.float32)
    for c in range(10):  # an ellipse per class, with a class-specific stripe texture
        ax, ay = rng.uniform(0.35, 0.9, 2)
        inside = (xx / ax) ** 2 + (yy / ay) ** 2 <= 1.0
        stripes = 0.75 + 0.25 * np.sin((c + 1) * 3.0 * yy + c)
        templates[c] = inside * stripes
    images = np.empty((size, 28, 28), np.uint8)
    for start in range(0, size, 8192):  # in chunks: the float intermediate would be 4x the data
        stop = min(start + 8192, size)
        n = stop - start
        scale = rng.uniform(150.0, 255.0, (n, 1, 1)).astype(np.float32)
        noise = rng.normal(0.0, 12.0, (n, 28, 28)).astype(np.float32)
        images[start:stop] = np.clip(templates[labels[start:stop]] * scale + noise, 0, 255).astype(np.uint8)
    return images, labels


def _save_atomically(path: Path, array: np.ndarray) -> None:
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
        np.save(f, array)
        tmp = f.name
    os.replace(tmp, path)  # concurrent makers each write a whole file; the last rename wins


def load_fashion_arrays(size: int, seed: int, cache: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The generated images ``[size, 28, 28]`` uint8 and labels ``[size]`` int64.

    Cached under :func:`cache_dir` (memory-mapped, so workers share the page cache) when writable;
    otherwise generated in memory (about a second for 60,000).
    """
    if cache:
        folder = cache_dir()
        stem = f"fashionlike-v1-seed{seed}-n{size}"
        images_path, labels_path = folder / f"{stem}-images.npy", folder / f"{stem}-labels.npy"
        try:
            if not (images_path.exists() and labels_path.exists()):
                folder.mkdir(parents=True, exist_ok=True)
                images, labels = _generate_fashion(size, seed)
                _save_atomically(images_path, images)
                _save_atomically(labels_path, labels)
            return np.load(images_path, mmap_mode="r"), np.load(labels_path, mmap_mode="r")
        except (OSError, ValueError):
            pass  # unwritable or damaged cache: fall through to memory
    return _generate_fashion(size, seed)


def fashion_study_transform() -> Callable:
    """The seed study's transforms: RandomResizedCrop(28, scale=(0.75, 1.0)), RandomRotation(15), ToTensor."""
    try:
        from torchvision import transforms as T
    except ImportError as error:  # pragma: no cover - torchvision is in requirements.txt
        raise RuntimeError(
            "the fashion preset applies torchvision transforms: pip install torchvision "
            "(or use --preset fields / tokens, which need only torch)"
        ) from error
    return T.Compose([T.RandomResizedCrop(28, scale=(0.75, 1.0)), T.RandomRotation(15), T.ToTensor()])


class FashionLike(Dataset):
    """60,000 generated grayscale 28x28 images in 10 classes, shaped like FashionMNIST.

    A sample is ``{"id": int, "image": float32 [1, 28, 28] in [0, 1], "target": int}`` after the seed
    study's transforms (or ``uint8 [1, 28, 28]`` with ``transform=None``).

    Args:
        size: number of samples.
        seed: the generator's seed: same seed, same images and labels.
        transform: applied to the PIL image; ``"study"`` for :func:`fashion_study_transform`.
        cache: keep the generated arrays under :func:`cache_dir`.
    """

    pixels_per_sample = 28 * 28

    def __init__(
        self,
        size: int = 60_000,
        seed: int = 0,
        transform: Callable | str | None = "study",
        cache: bool = True,
    ) -> None:
        self.size = size
        self.seed = seed
        self.transform = fashion_study_transform() if transform == "study" else transform
        self.cache = cache
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None

    def _load(self) -> tuple[np.ndarray, np.ndarray]:
        if self._arrays is None:
            self._arrays = load_fashion_arrays(self.size, self.seed, self.cache)
        return self._arrays

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        images, labels = self._load()
        pixels = np.array(images[index])  # a copy: the cache is a read-only memory map
        if self.transform is None:
            image = torch.from_numpy(pixels).unsqueeze(0)
        else:
            from PIL import Image

            image = self.transform(Image.fromarray(pixels))
        return {"id": int(index), "image": image, "target": int(labels[index])}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_arrays"] = None  # a worker maps the cache itself rather than receive 47 MB by pipe
        return state


# --------------------------------------------------------------------------------------------------
# ImageNet-like: uint8 3x224x224, crop and flip from a bank of 256x256 images.


class ImageNetLike(Dataset):
    """Generated uint8 ``[3, 224, 224]`` images in 1,000 classes, with a light transform.

    A sample is ``{"id": int, "image": uint8 [3, 224, 224], "target": int}``: a 224 crop of one of
    ``bank`` generated 256x256 images, flipped horizontally for half the ids. Images stay uint8 so
    they cross the bus as bytes; the bench normalizes them on the device.

    Args:
        size: number of samples.
        seed: same seed, same samples.
        bank: number of distinct base images (kept in memory: 192 KiB each).
    """

    pixels_per_sample = 224 * 224

    def __init__(self, size: int = 20_000, seed: int = 0, bank: int = 32) -> None:
        self.size = size
        self.seed = seed
        self.bank_size = bank
        self._bank: torch.Tensor | None = None

    def _load(self) -> torch.Tensor:
        if self._bank is None:
            rng = np.random.default_rng(self.seed)
            coarse = rng.integers(0, 256, (self.bank_size, 3, 32, 32), dtype=np.uint8)
            smooth = np.repeat(np.repeat(coarse, 8, axis=2), 8, axis=3)  # blocky, not white noise
            noise = rng.integers(0, 32, smooth.shape, dtype=np.uint8)
            self._bank = torch.from_numpy(smooth + noise)
        return self._bank

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        bank = self._load()
        rng = _sample_rng(self.seed, index)
        base, dy, dx, flip = (int(v) for v in rng.integers(0, (self.bank_size, 33, 33, 2)))
        image = bank[base, :, dy : dy + 224, dx : dx + 224]
        image = image.flip(-1) if flip else image.contiguous()
        return {"id": int(index), "image": image, "target": int(index * 7919 % 1000)}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_bank"] = None
        return state


class PreDecoded(Dataset):
    """Images already decoded, as FFCV and DALI keep them: ``{"id", "image": uint8 [3, 224, 224],
    "target"}``, each image a clone of one of ``bank`` generated ones (its own 150 KB storage, as a
    decoded image is). The loader's only work is moving bytes: the regime where collate dominates.
    """

    def __init__(self, size: int = 10_240, seed: int = 0, bank: int = 16) -> None:
        self.size = size
        self.seed = seed
        self.bank_size = bank
        self._bank: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self._bank is None:
            rng = np.random.default_rng(self.seed)
            self._bank = torch.from_numpy(rng.integers(0, 256, (self.bank_size, 3, 224, 224), dtype=np.uint8))
        image = self._bank[index % self.bank_size].clone()
        return {"id": int(index), "image": image, "target": int(index * 7919 % 1000)}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_bank"] = None
        return state


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# --------------------------------------------------------------------------------------------------
# Variable-length token sequences.


class TokenSequences(Dataset):
    """Token sequences of varying length: ``{"id": int, "tokens": int64 [T], "target": int}``.

    Lengths are drawn once from ``seed`` (uniform in ``[min_len, max_len]``), tokens per sample.
    :meth:`length_of` gives a sample's real length, for tokens per second without reading batches.

    Args:
        size: number of samples.
        seed: same seed, same samples.
        min_len: shortest sequence.
        max_len: longest sequence.
        vocab: token ids are in ``[1, vocab)``; 0 is the padding id.
    """

    def __init__(
        self, size: int = 50_000, seed: int = 0, min_len: int = 16, max_len: int = 512, vocab: int = 32_000
    ) -> None:
        self.size = size
        self.seed = seed
        self.min_len = min_len
        self.max_len = max_len
        self.vocab = vocab
        self.lengths = np.random.default_rng(seed).integers(min_len, max_len + 1, size, dtype=np.int64)

    def __len__(self) -> int:
        return self.size

    def length_of(self, ids: np.ndarray) -> np.ndarray:
        return self.lengths[np.asarray(ids, dtype=np.int64)]

    def __getitem__(self, index: int) -> dict[str, Any]:
        rng = _sample_rng(self.seed, index)
        tokens = rng.integers(1, self.vocab, int(self.lengths[index]), dtype=np.int64)
        return {"id": int(index), "tokens": torch.from_numpy(tokens), "target": int(index % 2)}


def tokens_contract() -> Contract:
    """What ``assemble`` enforces for :class:`TokenSequences`: tokens padded with 0, a mask and lengths."""
    return Contract(
        {
            "id": Field(kind="number", dtype=torch.int64),
            "tokens": Field(dtype=torch.int64, shape=("T",), pad=0),
            "target": Field(kind="number", dtype=torch.int64, range=(0, 2)),
        }
    )


def pad_tokens_collate(samples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The usual Python way to batch variable-length tokens (pad_sequence + a mask), with the keys
    ``assemble.using(tokens_contract())`` produces: the baseline the tokens preset compares against."""
    tokens = [s["tokens"] for s in samples]
    lengths = torch.tensor([len(t) for t in tokens], dtype=torch.int64)
    padded = torch.nn.utils.rnn.pad_sequence(tokens, batch_first=True, padding_value=0)
    mask = torch.arange(padded.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    return {
        "id": torch.tensor([s["id"] for s in samples], dtype=torch.int64),
        "tokens": padded,
        "tokens_mask": mask,
        "tokens_lengths": lengths,
        "target": torch.tensor([s["target"] for s in samples], dtype=torch.int64),
    }


# --------------------------------------------------------------------------------------------------
# Dicts of many small fields.


class ManyFields(Dataset):
    """Samples with many small fields, the case where collate is all per-leaf overhead.

    ``{"id", "target", "f00".."f{tensors-1}": float32 [width], "s00".."s{scalars-1}": float,
    "meta": {"count": int, "score": float}}``.

    Args:
        size: number of samples.
        seed: same seed, same samples.
        tensors: number of small tensor fields.
        scalars: number of Python float fields.
        width: elements per tensor field.
    """

    def __init__(
        self, size: int = 50_000, seed: int = 0, tensors: int = 12, scalars: int = 4, width: int = 8
    ) -> None:
        self.size = size
        self.seed = seed
        self.tensors = tensors
        self.scalars = scalars
        self.width = width
        self._bank: torch.Tensor | None = None

    def _load(self) -> torch.Tensor:
        if self._bank is None:
            rng = np.random.default_rng(self.seed)
            self._bank = torch.from_numpy(
                rng.standard_normal((1024, self.tensors + 1, self.width), np.float32)
            )
        return self._bank

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self._load()[index % 1024]
        sample: dict[str, Any] = {"id": int(index), "target": int(index * 31 % 10)}
        for k in range(self.tensors):
            sample[f"f{k:02d}"] = row[k].clone()  # its own storage, as a real dataset's would be
        extras = row[self.tensors].tolist()
        for k in range(self.scalars):
            sample[f"s{k:02d}"] = float(extras[k % self.width]) + index * 1e-6
        sample["meta"] = {"count": int(index % 97), "score": float(extras[0])}
        return sample

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_bank"] = None
        return state


def fingerprint(values: np.ndarray) -> int:
    """A short checksum of an int array, for the record (same ids and targets, same fingerprint)."""
    return zlib.crc32(np.ascontiguousarray(values, dtype=np.int64).tobytes())
