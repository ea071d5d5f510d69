"""Typed wrappers over the dispatcher ops ``torch.ops.fastcollate.*``, and their fake (meta) kernels
so they work under torch.compile and pass ``torch.library.opcheck``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._ext import _C  # noqa: F401  (registers the ops)

__all__ = [
    "gather_into",
    "gather_packed_into",
    "gather_ragged_into",
    "normalize_images",
    "packed_positions_into",
    "pad_into",
    "stack_into",
]


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


def gather_into(source: torch.Tensor, indices: torch.Tensor, out: torch.Tensor) -> None:
    """``out[b] = source[indices[b]]``, cast to out's dtype; every index is checked before a byte is
    written. Each row of ``source`` must be contiguous; rows may lie any stride apart (windows)."""
    torch.ops.fastcollate.gather_into.default(source, indices, out)


def gather_ragged_into(
    values: torch.Tensor,
    offsets: torch.Tensor,
    indices: torch.Tensor,
    value: float,
    out: torch.Tensor,
    mask: torch.Tensor,
    lengths: torch.Tensor,
) -> None:
    """Rows ``values[offsets[i]:offsets[i + 1]]`` for each index, padded on the right with ``value`` into
    ``out`` ([batch, longest, ...]); ``mask`` is 1 at real positions, ``lengths`` gets each row's length."""
    torch.ops.fastcollate.gather_ragged_into.default(values, offsets, indices, value, out, mask, lengths)


def gather_packed_into(
    values: torch.Tensor,
    offsets: torch.Tensor,
    indices: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The same rows back to back into ``out`` ([total, ...]), row ``b`` at ``cu_seq_lens[b]`` (int32,
    ``batch + 1`` entries from 0, checked against the rows' lengths): a packed batch's column."""
    torch.ops.fastcollate.gather_packed_into.default(values, offsets, indices, cu_seq_lens, out)


def packed_positions_into(
    cu_seq_lens: torch.Tensor,
    start: int,
    position_ids: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
) -> None:
    """From a packed row's ``cu_seq_lens``: ``position_ids`` (int64, counting from ``start`` in each
    sample) and ``seq_idx`` (int32, each token's batch position); either may be None."""
    torch.ops.fastcollate.packed_positions_into.default(cu_seq_lens, start, position_ids, seq_idx)


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


@torch.library.register_fake("fastcollate::gather_into")
def _(source, indices, out):
    return None


@torch.library.register_fake("fastcollate::gather_ragged_into")
def _(values, offsets, indices, value, out, mask, lengths):
    return None


@torch.library.register_fake("fastcollate::gather_packed_into")
def _(values, offsets, indices, cu_seq_lens, out):
    return None


@torch.library.register_fake("fastcollate::packed_positions_into")
def _(cu_seq_lens, start, position_ids, seq_idx):
    return None


@torch.library.register_fake("fastcollate::normalize_images")
def _(images, mean, std, dtype, channels_last):
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(images.shape, dtype=dtype, device=images.device, memory_format=memory_format)
