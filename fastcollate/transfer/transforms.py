"""Transforms DeviceLoader runs on the device after the copy, so images cross the bus as uint8."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .. import ops
from ..structure import tree

__all__ = ["Normalize", "apply_to_fields"]


class Normalize:
    """uint8 ``[N, C, H, W]`` images to ``dtype``: ``(x / 255 - mean) / std`` per channel, one kernel.

    Args:
        mean: per-channel means, in [0, 1] units (e.g. ImageNet's (0.485, 0.456, 0.406)).
        std: per-channel standard deviations, in [0, 1] units.
        dtype: the output dtype (float32, float16 or bfloat16).
        channels_last: write the output in channels-last memory format.
    """

    def __init__(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
    ) -> None:
        if len(mean) != len(std):
            raise ValueError(f"Normalize: mean has {len(mean)} values and std {len(std)}; "
                             "give one per channel")
        if any(s <= 0 for s in std):
            raise ValueError("Normalize: every std must be > 0")
        self.mean = torch.tensor(mean, dtype=torch.float32)
        self.std = torch.tensor(std, dtype=torch.float32)
        self.dtype = dtype
        self.channels_last = channels_last
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise TypeError(f"Normalize expects uint8 [N, C, H, W] images, "
                            f"got {images.dtype} {list(images.shape)}")
        if images.device not in self._on_device:
            self._on_device[images.device] = (self.mean.to(images.device), self.std.to(images.device))
        mean, std = self._on_device[images.device]
        return ops.normalize_images(images, mean, std, self.dtype, self.channels_last)

    def __repr__(self) -> str:
        return (f"Normalize(mean={self.mean.tolist()}, std={self.std.tolist()}, dtype={self.dtype}, "
                f"channels_last={self.channels_last})")


def apply_to_fields(batch: Any, transforms: Mapping[str, Callable[[Any], Any]]) -> Any:
    """``batch`` with ``transforms[key]`` applied to each named top-level field (DeviceLoader's
    ``transforms``); the batch keeps its mapping type. A batch that is not a mapping, or lacks a named
    field, is refused, naming what is missing."""
    if not transforms:
        return batch
    if not isinstance(batch, Mapping):
        raise TypeError(f"DeviceLoader transforms apply to mapping batches (by key), "
                        f"got {type(batch).__name__}")
    missing = transforms.keys() - batch.keys()
    if missing:
        raise KeyError(f"DeviceLoader transforms name fields the batch lacks: {sorted(missing)}")
    values = dict(batch)
    for key, transform in transforms.items():
        values[key] = transform(values[key])
    return tree.rebuild_mapping(batch, values)
