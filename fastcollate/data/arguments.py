"""The checks of the data side's arguments, each stated once: the samplers' integers, flags and
distributed split (IndexBatches, TokenBudgetBatches), and Arrays' index range."""

from __future__ import annotations

import operator

import numpy as np


def integer(name: str, value: object, low: int | None = None) -> int:
    """``value`` as an int: ints and numpy integers, not bools, floats or strings; at least ``low``."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an integer, got a bool ({value})")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__} ({value!r})") from None
    if low is not None and number < low:
        raise ValueError(f"{name}: must be at least {low}, got {number}")
    return number


def flag(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} ({value!r})")
    return bool(value)


def distributed_split(rank: object, world_size: object) -> tuple[int, int] | None:
    """``(rank, world_size)`` checked, or None when neither is given (one process reads everything)."""
    if (rank is None) != (world_size is None):
        raise ValueError(
            f"rank and world_size: give both (a distributed split) or neither, got rank={rank!r}, "
            f"world_size={world_size!r}"
        )
    if world_size is None:
        return None
    size = integer("world_size", world_size, low=1)
    number = integer("rank", rank, low=0)
    if number >= size:
        raise ValueError(f"rank: must be in [0, world_size={size}), got {number}")
    return number, size


def index_out_of_range(index: int, length: int) -> IndexError:
    """The error for an Arrays index outside ``[-length, length)``: one wording whether the index came alone
    (``ds[i]``) or in a batch, so a gathered batch and a walked one fail alike."""
    return IndexError(f"Arrays: index {index} is out of range for a dataset of {length} samples")
