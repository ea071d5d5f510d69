"""A user's ``--dataset module:factory`` (or ``path/to/file.py:factory``), loaded one way for ``bench``,
``profile`` and ``doctor``: the object it names, what calling it made (``Factory``), and the DataLoader
keyword arguments that follow from it (``loader_arguments``). Apart from the bench, so that the audit
does not import it."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from torch.utils.data import (
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

from .cli import UsageError, loading

__all__ = ["KNOWN_KEYS", "Factory", "collate_name", "load_factory", "load_factory_output", "loader_arguments"]

KNOWN_KEYS = (
    "dataset",
    "collate",
    "contract",
    "batch_sampler",
    "batch_size",
    "step",
    "device_transforms",
    "unit",
    "transforms_note",
)
"""What a factory's mapping may hold; ``dataset`` is required. The last three only the bench reads."""

_INDEX_SAMPLERS = (
    SequentialSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    DistributedSampler,
)
"""Samplers of single indices, which a DataLoader takes as ``sampler=``, never as ``batch_sampler=``."""


def load_factory(spec: str) -> Any:
    """The object ``spec`` names, not called: what to do with it is the caller's business.

    A module path is imported by name, with the working directory on ``sys.path``; a file path
    (ending in ``.py`` or holding a path separator) puts the file's folder on ``sys.path`` and imports
    the file by its stem, so that forked or spawned workers can import it by name too.

    Args:
        spec: ``module:attribute`` or ``path/to/file.py:attribute``; the attribute may be dotted
            (``module:Class.factory``).

    Raises:
        ValueError: ``spec`` lacks the module or the attribute.
        FileNotFoundError: ``spec`` names a file that does not exist.
        ImportError: the module cannot be imported.
        AttributeError: the module has no such attribute.
    """
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise ValueError(f"expected module:factory or path/to/file.py:factory, got {spec!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        path = os.path.abspath(module_name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no file {module_name}")
        sys.path.insert(0, os.path.dirname(path))
        module_name = os.path.splitext(os.path.basename(path))[0]
    elif os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


@dataclasses.dataclass(frozen=True)
class Factory:
    """What a factory made, checked: the data set and how the user's own loader batches it.

    ``collate`` is the collate the user's loader runs: ``doctor`` checks it, ``bench`` and ``profile``
    time it as the baseline. ``contract`` is what ``fastcollate.assemble`` enforces: the fastcollate
    paths of ``bench`` and ``profile`` use it, and ``doctor`` collates with it when no ``collate`` is
    given. Given both, the collate wins in ``doctor``.

    Attributes:
        spec: the ``module:factory`` it came from.
        dataset: a map-style or iterable Dataset.
        collate, contract, batch_sampler, batch_size, step: as the mapping gave them, or None.
        extra: the bench's keys (``device_transforms``, ``unit``, ``transforms_note``) that were given.
    """

    spec: str
    dataset: Dataset
    collate: Callable[[list], Any] | None = None
    contract: Any = None
    batch_sampler: Any = None
    batch_size: int | None = None
    step: Callable[[Any], Any] | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def collate_fn(self) -> Callable[[list], Any]:
        """The collate the user's loader runs: theirs, else ``assemble`` under their contract."""
        if self.collate is not None:
            return self.collate
        from ..assembler import assemble  # late: the spec loads without the native extension

        return assemble.using(self.contract) if self.contract is not None else assemble


def load_factory_output(
    spec: str, *, argument: str = "--dataset", size: int | None = None, seed: int | None = None
) -> Factory:
    """Loads ``spec``, calls it (with ``size=`` and ``seed=`` when it takes them and they are given),
    and checks what it made: a Dataset, or a mapping of ``KNOWN_KEYS`` holding ``dataset``.

    Raises:
        UsageError: against ``argument``: the factory does not load or raises, or what it made is not
            a data set the commands can read (each problem named, with what to do).
    """
    with loading(argument, spec):
        factory = load_factory(spec)
        made = factory
        if callable(factory) and not isinstance(factory, Dataset):
            params = inspect.signature(factory).parameters
            kwargs = {
                name: value
                for name, value in (("size", size), ("seed", seed))
                if value is not None and name in params
            }
            made = factory(**kwargs)
    given = dict(made) if isinstance(made, Mapping) else {"dataset": made}
    unknown = [key for key in given if key not in KNOWN_KEYS]
    if unknown:
        raise UsageError(
            argument,
            f"{spec} returned unknown keys {', '.join(map(repr, unknown))}: "
            f"a factory's mapping holds {', '.join(map(repr, KNOWN_KEYS))}",
        )
    if "dataset" not in given:
        raise UsageError(
            argument,
            f"{spec} returned a mapping without 'dataset' (its keys: "
            f"{', '.join(map(repr, given))}): add the data set under 'dataset'",
        )
    _check_dataset(argument, spec, given["dataset"])
    for key in ("collate", "step"):
        if given.get(key) is not None and not callable(given[key]):
            raise UsageError(
                argument, f"{spec}: {key!r} must be a callable, got a {type(given[key]).__name__}"
            )
    _check_contract(argument, spec, given.get("contract"))
    _check_batching(argument, spec, given.get("batch_sampler"), given.get("batch_size"))
    return Factory(
        spec=spec,
        dataset=given["dataset"],
        collate=given.get("collate"),
        contract=given.get("contract"),
        batch_sampler=given.get("batch_sampler"),
        batch_size=given.get("batch_size"),
        step=given.get("step"),
        extra={k: given[k] for k in ("device_transforms", "unit", "transforms_note") if k in given},
    )


def loader_arguments(
    made: Factory,
    *,
    batch_size: int | None = None,
    default_batch_size: int = 8,
    collate_fn: Callable[[list], Any] | None = None,
    argument: str = "--batch-size",
) -> dict[str, Any]:
    """The DataLoader keyword arguments every command builds its loader with: ``collate_fn`` (the one
    given, else ``made.collate_fn()``) and either the factory's ``batch_sampler`` or a ``batch_size``
    (``batch_size`` as the command line gave it, else the factory's, else ``default_batch_size``).

    Raises:
        UsageError: ``batch_size`` given for a factory whose batch_sampler fixes the batches.
    """
    arguments: dict[str, Any] = {"collate_fn": collate_fn or made.collate_fn()}
    if made.batch_sampler is not None:
        if batch_size is not None:
            raise UsageError(
                argument,
                f"{made.spec} gives a batch_sampler "
                f"({type(made.batch_sampler).__name__}), which makes the batches: leave "
                f"{argument} out, or drop the factory's batch_sampler",
            )
        arguments["batch_sampler"] = made.batch_sampler
    else:
        arguments["batch_size"] = batch_size or made.batch_size or default_batch_size
    return arguments


def collate_name(fn: Callable) -> str:
    """What a collate function is called in tables, charts and JSON: its ``__name__``, a callable
    object's class name, the wrapped function's name for a ``functools.partial``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) else type(fn).__name__


def _check_dataset(argument: str, spec: str, dataset: Any) -> None:
    """A data set every command can read: a Dataset, and, map-style, a length above zero (the sample
    order is drawn from ``len()``)."""
    if isinstance(dataset, IterableDataset):
        return
    if not isinstance(dataset, Dataset) and not hasattr(dataset, "__getitem__"):
        raise UsageError(argument, f"{spec} gave a {type(dataset).__name__}, not a Dataset")
    try:
        size = len(dataset)
    except TypeError:
        raise UsageError(
            argument,
            f"{spec} gave a map-style {type(dataset).__name__} without len(): "
            "define __len__, or make it an IterableDataset",
        ) from None
    if size == 0:
        raise UsageError(argument, f"{spec} gave an empty data set (len 0)")


def _check_contract(argument: str, spec: str, contract: Any) -> None:
    if contract is None:
        return
    from ..collate.contract import Contract  # late: the spec loads without the native extension

    if not isinstance(contract, Contract):
        raise UsageError(
            argument, f"{spec}: 'contract' must be a fastcollate.Contract, got a {type(contract).__name__}"
        )


def _check_batching(argument: str, spec: str, batch_sampler: Any, batch_size: Any) -> None:
    """A batch sampler that yields batches of indices, and a batch size only without one."""
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
    ):
        raise UsageError(
            argument, f"{spec}: 'batch_size' must be a whole number of at least 1, got {batch_size!r}"
        )
    if batch_sampler is None:
        return
    name = type(batch_sampler).__name__
    if isinstance(batch_sampler, _INDEX_SAMPLERS):
        raise UsageError(
            argument,
            f"{spec}: 'batch_sampler' is a {name}, which yields one index at a "
            f"time: wrap it, BatchSampler({name}(...), batch_size, drop_last=False)",
        )
    if isinstance(batch_sampler, (str, bytes, Mapping, Dataset)) or not hasattr(batch_sampler, "__iter__"):
        raise UsageError(
            argument,
            f"{spec}: 'batch_sampler' must yield lists of indices (a "
            f"BatchSampler, fastcollate.IndexBatches), got a {name}",
        )
    if batch_size is not None:
        raise UsageError(
            argument,
            f"{spec} gives both 'batch_sampler' and 'batch_size': the batch "
            "sampler makes the batches, leave 'batch_size' out",
        )
