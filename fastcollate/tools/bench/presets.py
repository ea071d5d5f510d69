"""The bench's presets: each embedded data set (``fastcollate.tools.bench.datasets``) with how the bench
batches, counts and consumes it, by the name ``--preset`` takes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch.utils.data import Dataset, default_collate

from ...collate.contract import Contract
from ...transfer.transforms import Normalize
from .datasets import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    FashionLike,
    ImageNetLike,
    ManyFields,
    PreDecoded,
    TokenSequences,
    pad_tokens_collate,
    tokens_contract,
)

__all__ = ["PRESETS", "Preset"]


@dataclasses.dataclass(frozen=True)
class Preset:
    """An embedded data set and how the bench batches, counts and consumes it.

    Args:
        name: the ``--preset`` name.
        description: one line for the output.
        make_dataset: ``(size, seed) -> Dataset``.
        size: default number of samples.
        batch_size: default batch size.
        unit: the second unit the table shows: ``"pixels"``, ``"bytes"`` or ``"tokens"``.
        default_collate: the baseline collate function (``default_collate`` unless shapes vary).
        contract: what ``assemble`` enforces (None: drop-in).
        device_transforms: ``{field: callable}`` run on the device batch by every configuration.
        model: the model's name in :mod:`fastcollate.bench.models` for the integrated observation.
        transforms_note: what the samples go through, for the record.
    """

    name: str
    description: str
    make_dataset: Callable[[int, int], Dataset]
    size: int
    batch_size: int
    unit: str
    default_collate: Callable = default_collate
    contract: Callable[[], Contract] | None = None
    device_transforms: Callable[[], dict[str, Callable]] | None = None
    model: str = "none"
    transforms_note: str = ""


def _make_fashion(size: int, seed: int) -> Dataset:
    return FashionLike(size=size, seed=seed)


def _make_imagenet(size: int, seed: int) -> Dataset:
    return ImageNetLike(size=size, seed=seed)


def _make_predecoded(size: int, seed: int) -> Dataset:
    return PreDecoded(size=size, seed=seed)


def _make_tokens(size: int, seed: int) -> Dataset:
    return TokenSequences(size=size, seed=seed)


def _make_fields(size: int, seed: int) -> Dataset:
    return ManyFields(size=size, seed=seed)


def _make_arrays(size: int, seed: int) -> Dataset:
    # Tabular rows already in memory: the batched path (fastcollate.Arrays, gathered by index in C++),
    # where default_collate gets the same batch as per-sample dicts.
    from ...data.arrays import Arrays

    generator = torch.Generator().manual_seed(seed)
    return Arrays(x=torch.randn(size, 64, generator=generator),
                  target=torch.randint(0, 10, (size,), generator=generator))


def _imagenet_device_transforms() -> dict[str, Callable]:
    # The bench runs it after .to() on the default path and as a DeviceLoader transform: every
    # configuration hands the model the same float images, and all of them move uint8.
    return {"image": Normalize(IMAGENET_MEAN, IMAGENET_STD)}


PRESETS: dict[str, Preset] = {
    "fashion": Preset(
        name="fashion",
        description="FashionMNIST-like: 60,000 generated grayscale 28x28 images, 10 classes",
        make_dataset=_make_fashion,
        size=60_000,
        batch_size=256,
        unit="pixels",
        model="fashion_cnn",
        transforms_note=(
            "RandomResizedCrop(28, scale=(0.75, 1.0)), RandomRotation(15), ToTensor (in the loader)"
        ),
    ),
    "imagenet": Preset(
        name="imagenet",
        description="ImageNet-like: generated uint8 3x224x224 images, 1,000 classes",
        make_dataset=_make_imagenet,
        size=20_000,
        batch_size=64,
        unit="bytes",
        device_transforms=_imagenet_device_transforms,
        model="imagenet_cnn",
        transforms_note=(
            "crop 224 of 256 + horizontal flip (in the loader); uint8 -> float normalize on the device"
        ),
    ),
    "predecoded": Preset(
        name="predecoded",
        description="pre-decoded uint8 3x224x224 images (cloned in __getitem__), 1,000 classes",
        make_dataset=_make_predecoded,
        size=10_240,
        batch_size=256,
        unit="bytes",
        device_transforms=_imagenet_device_transforms,
        model="imagenet_cnn",
        transforms_note="none in the loader (decoded already); uint8 -> float normalize on the device",
    ),
    "tokens": Preset(
        name="tokens",
        description="variable-length token sequences (16..512 tokens, int64), padded with 0 and masked",
        make_dataset=_make_tokens,
        size=50_000,
        batch_size=64,
        unit="tokens",
        default_collate=pad_tokens_collate,
        contract=tokens_contract,
        model="token_classifier",
        transforms_note="none; baseline collate is pad_sequence + mask in Python",
    ),
    "arrays": Preset(
        name="arrays",
        description="tabular rows in arrays (fastcollate.Arrays): 64 float32 features + an int64 target",
        make_dataset=_make_arrays,
        size=200_000,
        batch_size=4096,
        unit="bytes",
        model="tabular_mlp",
        transforms_note="none; assemble gathers each column by index, default_collate gets per-sample dicts",
    ),
    "fields": Preset(
        name="fields",
        description="dicts of 19 small fields (12 float32[8] tensors, 4 floats, a nested dict of 2)",
        make_dataset=_make_fields,
        size=50_000,
        batch_size=256,
        unit="bytes",
        model="fields_mlp",
        transforms_note="none",
    ),
}
