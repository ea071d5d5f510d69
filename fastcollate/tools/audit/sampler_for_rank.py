"""The batch sampler a factory gave, for one rank of a world size the doctor tries: made by the sampler's
own ``for_rank``, else by its class again, with its own arguments and new rank ones. Never a sampler the
user did not give: a sampler that offers neither way is said to be unverifiable, with the reason."""

from __future__ import annotations

import inspect
from typing import Any

from .resume_check import Unresumable, length_or_none

__all__ = ["sampler_for_rank"]

WORLD_SIZE_NAMES = ("world_size", "num_replicas")
"""The constructor parameter that takes the world size: fastcollate's samplers' name, and
DistributedSampler's."""


def sampler_for_rank(batch_sampler: Any, rank: int, world_size: int) -> Any:
    """``batch_sampler`` as rank ``rank`` of ``world_size`` would make it.

    Its own ``for_rank(rank, world_size)`` when it has one. Otherwise its class is called again with
    ``rank`` and ``world_size`` (or ``num_replicas``) set and every other constructor parameter read
    from the attribute of the same name, as scikit-learn's ``get_params`` reads an estimator's.

    Raises:
        Unresumable: no batch sampler, ``for_rank`` refused, or the class cannot be made again that
            way; the message says why and what would work.
    """
    if batch_sampler is None:
        raise Unresumable(
            "another world size runs the factory's batch_sampler on each rank, and the factory gives none "
            "(the loader's own shuffling does not split by rank): give a batch_sampler that splits by rank, "
            "such as fastcollate.IndexBatches"
        )
    name = type(batch_sampler).__name__
    own = getattr(batch_sampler, "for_rank", None)
    if callable(own):
        try:
            made = own(rank, world_size)
        except Exception as error:  # the user's method: whatever it raises is the reason
            raise Unresumable(
                f"{name}.for_rank({rank}, {world_size}) refused: {type(error).__name__}: {error}"
            ) from error
        if made is None or not callable(getattr(made, "__iter__", None)):
            # A DataLoader given batch_sampler=None would batch with a sampler the user never gave.
            raise Unresumable(
                f"{name}.for_rank({rank}, {world_size}) gave {type(made).__name__}, not a batch sampler"
            )
        return made
    return _made_again(batch_sampler, rank, world_size)


def _made_again(batch_sampler: Any, rank: int, world_size: int) -> Any:
    kind = type(batch_sampler)
    name = kind.__name__
    try:
        parameters = inspect.signature(kind).parameters
    except (TypeError, ValueError):
        parameters = {}
    size_name = next((size for size in WORLD_SIZE_NAMES if size in parameters), None)
    if "rank" not in parameters or size_name is None:
        raise Unresumable(
            f"{name} has no for_rank(rank, world_size), and its constructor takes no rank and world_size "
            "(or num_replicas) to make it again for another rank: give it a for_rank, or use a sampler "
            "that splits by rank, such as fastcollate.IndexBatches"
        )
    rest = [p for p in parameters.values() if p.name not in ("rank", size_name)]
    variadic = [p.name for p in rest if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if variadic:
        raise Unresumable(
            f"{name} has no for_rank(rank, world_size), and its constructor takes *{variadic[0]}, whose "
            "arguments cannot be read back from the sampler: give it a for_rank"
        )
    unreadable = [p.name for p in rest if not hasattr(batch_sampler, p.name)]
    if unreadable:
        raise Unresumable(
            f"{name} has no for_rank(rank, world_size), and it cannot be made again for another rank: its "
            f"constructor takes {', '.join(unreadable)}, which it keeps in no attribute of that name. Keep "
            "each argument in an attribute of its name, or give it a for_rank"
        )
    positional = [getattr(batch_sampler, p.name) for p in rest if p.kind == p.POSITIONAL_ONLY]
    keywords = {p.name: getattr(batch_sampler, p.name) for p in rest if p.kind != p.POSITIONAL_ONLY}

    def made(rank: Any, world_size: Any) -> Any:
        try:
            return kind(*positional, **keywords, rank=rank, **{size_name: world_size})
        except Exception as error:  # the user's constructor: whatever it raises is the reason
            raise Unresumable(
                f"{name} made again with rank={rank}, {size_name}={world_size} and its other arguments read "
                f"from its attributes raised {type(error).__name__}: {error}"
            ) from error

    # An attribute may hold something else than the argument of its name (a batch size per rank where
    # the constructor takes the global one): made again for its own split, it must be the factory's.
    own_split = (getattr(batch_sampler, "rank", None), getattr(batch_sampler, size_name, None))
    if None not in own_split:
        length, again = length_or_none(batch_sampler), length_or_none(made(*own_split))
        if again != length:
            raise Unresumable(
                f"{name} has no for_rank(rank, world_size), and made again from its attributes for its own "
                f"rank={own_split[0]}, {size_name}={own_split[1]} it is another sampler ({again} "
                f"batches, not {length}): an attribute holds something else than the argument of its name. "
                "Give it a for_rank"
            )
    return made(rank, world_size)

