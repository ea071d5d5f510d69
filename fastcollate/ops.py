"""Typed wrappers over the dispatcher ops ``torch.ops.fastcollate.*``, and their fake (meta) kernels
so they work under torch.compile and pass ``torch.library.opcheck``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._ext import _C  # noqa: F401  (registers the ops)

__all__ = ["normalize_images", "pad_into", "stack_into"]


def stack_into(samples: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Copies ``samples[i]`` into ``out[i]``; every sample must have out's row shape and dtype."""
    torch.ops.fastcollate.stack_into.default(list(samples), out)


def pad_into(
    samples: Sequence[torch.Tensor],
    value: float,
    out: torch.Tensor,
    mask: torch.Tensor,
    lengths: torch.Tensor,
) -> None:
    """Pads samples along dim 0 on the right with ``value`` into ``out`` ([batch, longest, ...]); sets
    ``mask`` (bool [batch, longest]) True at real positions and ``lengths`` (int64 [batch])."""
    torch.ops.fastcollate.pad_into.default(list(samples), value, out, mask, lengths)


def normalize_images(
    images: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    channels_last: bool = False,
) -> torch.Tensor:
    """uint8 ``[N, C, H, W]`` images to ``dtype``: ``(x / 255 - mean) / std`` per channel."""
    return torch.ops.fastcollate.normalize_images.default(images, mean, std, dtype, channels_last)


@torch.library.register_fake("fastcollate::stack_into")
def _(samples, out):
    return None


@torch.library.register_fake("fastcollate::pad_into")
def _(samples, value, out, mask, lengths):
    return None


@torch.library.register_fake("fastcollate::normalize_images")
def _(images, mean, std, dtype, channels_last):
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(images.shape, dtype=dtype, device=images.device, memory_format=memory_format)
