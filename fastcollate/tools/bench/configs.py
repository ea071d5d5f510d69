"""What a bench run measures: the variants (a collate function and a way to the device), and the set-up
resolved from the command line (data, worker counts, device, run lengths), with a note for every choice
the reader should know about."""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

import fastcollate

from ..cli import UsageError, at_least
from ..factory_spec import collate_name, load_factory_output, loader_arguments
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


def variants_for(baseline_collate: Callable) -> list[Variant]:
    """The variants, the baseline labelled by its collate's name (``default_collate`` or the user's)."""
    name = collate_name(baseline_collate)
    baseline = dataclasses.replace(VARIANTS[0], collate=name, label=f"{name} + pinned copy")
    return [baseline, *VARIANTS[1:]]


def first_batches(batch_sampler: Any, count: int, notes: list[str]) -> list[list[int]]:
    """The first ``count`` batches of one pass of ``batch_sampler`` (fewer if its epoch is shorter):
    every run reads these, so every run's ids can be checked against the reference's."""
    batches = []
    for batch in batch_sampler:
        batches.append([int(i) for i in batch])
        if len(batches) == count:
            break
    if not batches:
        raise UsageError("--dataset", f"the factory's batch_sampler ({type(batch_sampler).__name__}) "
                         "gave no batch")
    notes.append(
        f"batches from the factory's {type(batch_sampler).__name__}: its first {len(batches)}, the same in "
        f"every run, of up to {max(len(b) for b in batches)} samples"
    )
    return batches


def baseline_problem(dataset: Dataset, collate: Callable, first: list[int] | None) -> str | None:
    """Why ``collate`` cannot batch the samples at ``first`` (tried once, in this process), naming
    the ids and the first field that fails; None when it can, or for a stream.

    In a worker, ``default_collate`` stacks into a shared-memory tensor sized from the samples'
    total, and on samples of different lengths dies with "Trying to resize storage that is not
    resizable", naming neither the field nor the samples: this says it before any worker starts."""
    if not first or isinstance(dataset, IterableDataset):
        return None
    samples = [dataset[i] for i in first]
    try:
        collate(samples)
    except Exception as error:
        ids = [s.get("id", i) if isinstance(s, Mapping) else i for s, i in zip(samples, first, strict=True)]
        field = ""
        if all(isinstance(s, Mapping) for s in samples):
            for key in samples[0]:
                try:
                    collate([{key: s.get(key)} for s in samples])
                except Exception:
                    field = f", field {key!r}"
                    break
        message = " ".join(str(error).split())
        return (f"{collate_name(collate)} cannot batch this data set (the batch of ids {ids[:8]}"
                f"{' ...' if len(ids) > 8 else ''}{field}: {type(error).__name__}: {message})")
    return None


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
    batch_sampler: Any  # the factory's, or None: then batch_size makes the batches


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
    batches: list[list[int]] | None = None  # the batch_sampler's first batches, read by every run
    left_out: dict[str, str] = dataclasses.field(default_factory=dict)  # variant key -> why

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
    variants = variants_for(data.baseline_collate)
    tail = 0
    if not isinstance(data.dataset, IterableDataset):
        tail = max(tail_batches(v, w) for v in variants for w in workers)
    batches = indices = None
    if data.batch_sampler is not None:
        batches = first_batches(data.batch_sampler, warmup + steps + tail, notes)
        data.batch_size = max(len(b) for b in batches)
    else:
        indices = _fixed_subset(data.dataset, (warmup + steps + tail) * data.batch_size, args.seed, notes)
    left_out = {}
    if args.dataset:  # a preset's baseline batches its own data
        first = batches[0] if batches else indices[: data.batch_size] if indices else None
        problem = baseline_problem(data.dataset, data.baseline_collate, first)
        if problem is not None:
            left_out[variants[0].key] = problem
            notes.append(
                f"{variants[0].label} left out: {problem}; the factory's 'collate' (the collate your "
                "loader runs) sets the baseline"
            )
            variants = variants[1:]
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
        batches=batches,
        left_out=left_out,
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
        batch_sampler=None,
    )


def _user_data(args: argparse.Namespace, notes: list[str]) -> DataChoice:
    user = load_factory_output(args.dataset, size=args.size, seed=args.seed)
    dataset, contract = user.dataset, user.contract
    if not isinstance(dataset, IterableDataset) and not _has_id(dataset):
        dataset = fastcollate.with_ids(dataset)
        notes.append("samples have no 'id': fastcollate.with_ids attached dataset indices")
        if contract is not None and "id" not in contract.fields:
            # The ids are the bench's, for its audit: the contract takes them as it would the dataset's own.
            fields = {"id": fastcollate.Field(kind="number"), **contract.fields}
            contract = dataclasses.replace(contract, fields=fields, id="id")
    batching = loader_arguments(user, batch_size=args.batch_size, default_batch_size=256)
    return DataChoice(
        name=args.dataset,
        description=f"user data set from {args.dataset}",
        dataset=dataset,
        batch_size=batching.get("batch_size", 0),
        baseline_collate=user.collate or default_collate,
        assemble_fn=(
            fastcollate.assemble.using(contract) if contract is not None else fastcollate.assemble
        ),
        device_transforms=dict(user.extra.get("device_transforms") or {}),
        make_step=(lambda: user.step) if user.step is not None else None,
        model_note=f"user step {collate_name(user.step)}" if user.step is not None else "",
        unit=user.extra.get("unit", "bytes"),
        transforms_note=user.extra.get("transforms_note", "the data set's own"),
        batch_sampler=user.batch_sampler,
    )


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
