"""What a bench run measures: the variants (a collate function and a way to the device), and the set-up
resolved from the command line (data, worker counts, device, run lengths), with a note for every choice
the reader should know about."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

import fastcollate

from ..cli import UsageError, at_least, loading
from ..factory_spec import load_factory
from .machine import cuda_available, usable_cpus
from .models import TrainStep
from .presets import PRESETS

__all__ = [
    "DEFAULT_WORKERS",
    "DEVICE_LOADER_DEPTH",
    "PREFETCH_FACTOR",
    "VARIANTS",
    "DataChoice",
    "Setup",
    "Variant",
    "resolve",
    "tail_batches",
]

DEFAULT_WORKERS = (0, 1, 2, 4)
PREFETCH_FACTOR = 2  # DataLoader's default, stated in the results
DEVICE_LOADER_DEPTH = 2


@dataclasses.dataclass(frozen=True)
class Variant:
    """A collate function and a way to the device."""

    key: str
    collate: str
    transfer: str
    label: str


VARIANTS = (
    Variant("default", "default_collate", "pin_memory+to", "default_collate + pinned copy"),
    Variant("assemble", "assemble", "pin_memory+to", "assemble + pinned copy"),
    Variant("device_loader", "assemble", "DeviceLoader", "assemble + DeviceLoader"),
)


def tail_batches(variant: Variant, workers: int) -> int:
    """Batches a configuration can hold in flight past the one being consumed: a DataLoader keeps
    ``prefetch_factor * workers`` outstanding, a DeviceLoader ``depth`` more. Without that many after
    the measured batches, the epoch would end inside the measured interval with its last batches made
    before it began, and the deepest pipeline would look fastest for no reason."""
    return PREFETCH_FACTOR * workers + (DEVICE_LOADER_DEPTH if variant.transfer == "DeviceLoader" else 0)


@dataclasses.dataclass
class DataChoice:
    """The data side of a run, from a preset or a user's factory: the data set and how every
    configuration batches, checks and consumes it."""

    name: str
    description: str
    dataset: Dataset
    batch_size: int
    baseline_collate: Callable
    assemble_fn: Callable
    device_transforms: dict[str, Callable]
    make_step: Callable[[], Callable[[Any], Any]] | None
    model_note: str
    unit: str
    transforms_note: str


@dataclasses.dataclass
class Setup(DataChoice):
    """Everything a run needs, resolved from the command line: the data choice and how it is run."""

    indices: list[int] | None
    steps: int
    warmup: int
    repeat: int
    workers: list[int]
    device: torch.device
    observations: list[str]
    variants: list[Variant]
    seed: int
    notes: list[str]
    pin_memory: bool
    target_path: str | None = None  # found in the first batch, for the runs after it
    tail: int = 0  # untimed batches after the measured ones

    def times_device_transforms(self, observation: str) -> bool:
        """Whether ``observation``'s timed loop runs the device transforms.

        On a GPU they are queued device work, part of what the loader hands over, so both observations
        keep them. Without one they would be CPU work inside the timed loop (ImageNet's uint8 -> float
        Normalize is ~95% of a 64-image step), and loader-only would time a float conversion instead
        of the loader: it leaves them out. Integrated keeps them: they are part of a training step.
        """
        if not self.device_transforms:
            return False
        return observation == "integrated" or self.device.type == "cuda"

    def device_transforms_note(self) -> str:
        """One line for the header: the device transforms and in which observations they are timed."""
        if not self.device_transforms:
            return "device transforms: none"
        names = ", ".join(f"{field}: {type(fn).__name__}" for field, fn in self.device_transforms.items())
        timed = [o for o in self.observations if self.times_device_transforms(o)]
        skipped = [o for o in self.observations if not self.times_device_transforms(o)]
        parts = []
        if timed:
            parts.append(f"timed in {', '.join(_OBSERVATION_NAMES[o] for o in timed)}")
        if skipped:
            parts.append(
                f"left out of {', '.join(_OBSERVATION_NAMES[o] for o in skipped)} "
                "(no GPU: they would be CPU work inside the timed loop, not the loader's)"
            )
        return f"device transforms ({names}): {'; '.join(parts)}"


_OBSERVATION_NAMES = {"loader": "loader-only", "integrated": "integrated"}


def resolve(args: argparse.Namespace) -> Setup:
    """The run's set-up, with a note for every choice the reader should know about.

    Raises:
        UsageError: an option a user can get wrong is wrong (a count out of range, a device this machine
            lacks, a ``--dataset`` that does not load or is empty): checked before anything runs.
    """
    _check_counts(args)
    notes: list[str] = []
    quick = args.quick
    steps = args.steps if args.steps is not None else (4 if quick else 20)
    warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    repeat = args.repeat if args.repeat is not None else 5  # the ~ mark: see report.not_different
    workers = _worker_counts(args, notes)
    device = _device(args, notes)
    observations = {"loader": ["loader"], "integrated": ["integrated"], "both": ["loader", "integrated"]}[
        "loader" if args.no_model else args.observation
    ]
    variants = list(VARIANTS)
    if args.dataset:
        data = _user_data(args, notes)
        if data.make_step is None and "integrated" in observations:
            observations = [o for o in observations if o != "integrated"]
            notes.append(
                "integrated observation skipped: the factory gave no 'step' (a callable on the batch)"
            )
    else:
        data = _preset_data(args, device)
    if not observations:
        raise UsageError(
            "--observation", f"integrated needs a model step, and {args.dataset} gave no 'step' (a callable "
            "on the device batch): add one, or run --observation loader"
        )
    tail = 0
    if not isinstance(data.dataset, IterableDataset):
        tail = max(tail_batches(v, w) for v in variants for w in workers)
    indices = _fixed_subset(data.dataset, (warmup + steps + tail) * data.batch_size, args.seed, notes)
    chosen = {f.name: getattr(data, f.name) for f in dataclasses.fields(data)}
    chosen["make_step"] = data.make_step if "integrated" in observations else None
    return Setup(
        **chosen,
        indices=indices,
        steps=steps,
        warmup=warmup,
        repeat=repeat,
        workers=workers,
        device=device,
        observations=observations,
        variants=variants,
        seed=args.seed,
        notes=notes,
        pin_memory=device.type == "cuda",
        tail=tail,
    )


def _check_counts(args: argparse.Namespace) -> None:
    """The counts argparse reads as any int: each within the range a run can use (None: the default)."""
    for worker_count in args.workers or ():
        at_least("--workers", worker_count, 0, " (0: load in the main process)")
    at_least("--batch-size", args.batch_size, 1)
    at_least("--steps", args.steps, 1)
    at_least("--warmup", args.warmup, 0)
    at_least("--repeat", args.repeat, 1)
    at_least("--size", args.size, 1)
    at_least("--model-width", args.model_width, 1)


def _worker_counts(args: argparse.Namespace, notes: list[str]) -> list[int]:
    """The worker counts asked for (run as asked), or the defaults that fit this machine's CPUs."""
    cpus = usable_cpus()
    if args.workers is not None:
        workers = sorted(set(args.workers))
        over = [w for w in workers if w > cpus]
        if over:
            notes.append(f"workers {over} exceed this machine's {cpus} usable CPUs (run as asked)")
        return workers
    wanted = (0, 2) if args.quick else DEFAULT_WORKERS
    workers = [w for w in wanted if w <= cpus]
    if args.quick and cpus < 2:
        workers = [0, 1]
    capped = [w for w in wanted if w > cpus]
    if capped:
        notes.append(
            f"workers {capped} skipped: this machine has {cpus} usable CPUs "
            f"(--workers {' '.join(map(str, wanted))} runs them anyway)"
        )
    return workers


def _device(args: argparse.Namespace, notes: list[str]) -> torch.device:
    if args.device:
        device = _asked_device(args.device)
    else:
        device = torch.device("cuda" if cuda_available() else "cpu")
    if device.type != "cuda":
        notes.append(
            "no GPU: pin_memory is left off (DataLoader only warns and pins nothing without one), "
            "the transfer columns are left out and the model runs on the CPU"
        )
    return device


def _asked_device(asked: str) -> torch.device:
    """``--device`` as given, if this machine can run the bench there: cpu, cuda or cuda:N."""
    try:
        device = torch.device(asked)
    except (RuntimeError, ValueError):  # torch's words for a string it cannot read as a device
        raise UsageError("--device", f"unknown device {asked!r}: cuda, cuda:N or cpu") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError("--device", f"{asked!r}: the bench runs on cuda (cuda:N) or cpu")
    if device.type == "cuda" and not cuda_available():
        raise UsageError("--device", f"{asked}: no CUDA GPU is visible on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError("--device", f"{asked}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def _preset_data(args: argparse.Namespace, device: torch.device) -> DataChoice:
    preset = PRESETS[args.preset]
    width = args.model_width or (32 if device.type == "cuda" else 8)
    make_step = functools.partial(TrainStep, preset.model, device, width=width, seed=args.seed)
    return DataChoice(
        name=preset.name,
        description=preset.description,
        dataset=preset.make_dataset(args.size or preset.size, args.seed),
        batch_size=args.batch_size or preset.batch_size,
        baseline_collate=preset.default_collate,
        assemble_fn=(
            fastcollate.assemble.using(preset.contract()) if preset.contract else fastcollate.assemble
        ),
        device_transforms=dict(preset.device_transforms() if preset.device_transforms else {}),
        make_step=make_step,
        model_note=make_step().describe(),
        unit=preset.unit,
        transforms_note=preset.transforms_note,
    )


def _user_data(args: argparse.Namespace, notes: list[str]) -> DataChoice:
    user = _user_factory_output(args.dataset, args)
    dataset = user["dataset"]
    _check_user_dataset(args.dataset, dataset)
    contract = user.get("contract")
    user_step = user.get("step")
    if not isinstance(dataset, IterableDataset) and not _has_id(dataset):
        dataset = fastcollate.with_ids(dataset)
        notes.append("samples have no 'id': fastcollate.with_ids attached dataset indices")
    return DataChoice(
        name=args.dataset,
        description=f"user data set from {args.dataset}",
        dataset=dataset,
        batch_size=args.batch_size or int(user.get("batch_size", 256)),
        baseline_collate=user.get("collate", default_collate),
        assemble_fn=fastcollate.assemble.using(contract) if contract is not None else fastcollate.assemble,
        device_transforms=dict(user.get("device_transforms") or {}),
        make_step=(lambda: user_step) if user_step is not None else None,
        model_note=(
            f"user step {getattr(user_step, '__name__', type(user_step).__name__)}" if user_step else ""
        ),
        unit=user.get("unit", "bytes"),
        transforms_note=user.get("transforms_note", "the data set's own"),
    )


def _user_factory_output(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    """What ``--dataset module:factory`` makes, as a mapping with at least ``"dataset"``; a factory
    that does not load, raises, or returns a mapping without ``"dataset"`` is a ``UsageError``."""
    with loading("--dataset", spec):
        factory = load_factory(spec)
        kwargs = {}
        params = inspect.signature(factory).parameters if callable(factory) else {}
        if args.size is not None and "size" in params:
            kwargs["size"] = args.size
        if "seed" in params:
            kwargs["seed"] = args.seed
        made = factory(**kwargs) if callable(factory) and not isinstance(factory, Dataset) else factory
    spec_dict = dict(made) if isinstance(made, Mapping) else {"dataset": made}
    if "dataset" not in spec_dict:
        keys = ", ".join(map(repr, spec_dict))
        raise UsageError("--dataset", f"{spec} returned a mapping without 'dataset' (its keys: {keys})")
    return spec_dict


def _check_user_dataset(spec: str, dataset: Any) -> None:
    """A data set every configuration can read: a Dataset, and, map-style, a length above zero
    (the sample order is drawn from ``len()``)."""
    if isinstance(dataset, IterableDataset):
        return
    if not isinstance(dataset, Dataset) and not hasattr(dataset, "__getitem__"):
        raise UsageError("--dataset", f"{spec} gave a {type(dataset).__name__}, not a Dataset")
    try:
        size = len(dataset)
    except TypeError:
        raise UsageError(
            "--dataset", f"{spec} gave a map-style {type(dataset).__name__} without len(): "
            "define __len__, or make it an IterableDataset"
        ) from None
    if size == 0:
        raise UsageError("--dataset", f"{spec} gave an empty data set (len 0)")


def _has_id(dataset: Dataset) -> bool:
    try:
        sample = dataset[0]
    except Exception:
        return False
    return isinstance(sample, Mapping) and "id" in sample


def _fixed_subset(dataset: Dataset, wanted: int, seed: int, notes: list[str]) -> list[int] | None:
    """The seeded sample order every run reads a prefix of (None: an iterable data set, read whole)."""
    if isinstance(dataset, IterableDataset):
        return None
    if wanted > len(dataset):
        notes.append(
            f"the data set has {len(dataset)} samples, fewer than warm-up + steps + tail need "
            f"({wanted}): the epoch is the whole data set"
        )
        wanted = len(dataset)
    order = np.random.default_rng(seed).permutation(len(dataset))[:wanted]
    return [int(i) for i in order]
