"""``python -m fastcollate doctor module:factory``: the loader checklist, run on a dataset with the
collate and batch sampler its factory gives (``factory_spec``, as ``bench`` and ``profile`` read it).

Representative samples one by one, then one process (the reference), then a few workers for two
epochs: the report says whether the faster setting delivers the same samples and targets, which stage
failed on which sample if one did, and how long each setting took. It never prints a sample's content.
The checklist itself is ``checklist.Doctor``; this module reads the options.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import Any

from torch.utils.data import Dataset, IterableDataset

from ...collate.errors import sample_id
from ...collate.ids import with_ids
from ..cli import UsageError, at_least, run_verb
from ..factory_spec import Factory, load_factory_output, loader_arguments
from .checklist import Doctor
from .failures import Failure
from .resume_check import DEFAULT_CHECKPOINTS, ResumeCheck, Unresumable
from .sampler_for_rank import sampler_for_rank

__all__ = ["DEFAULT_BATCH_SIZE", "Doctor", "Failure", "main", "run_doctor"]

DEFAULT_BATCH_SIZE = 8
"""Every setting's batch size when neither ``--batch-size`` nor the factory gives one."""


def run_doctor(dataset: Dataset, **options: Any) -> dict:
    """Runs the checklist on ``dataset`` (options as ``Doctor``'s) and returns the report as a dict;
    ``report["exit_status"]`` is 0 (same data), 1 (lost, duplicated, changed, or a stage failed) or 2
    (could not verify)."""
    return Doctor(dataset, **options).run()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fastcollate doctor",
        description="Check that a dataset's loader delivers every sample, once, unchanged, with a few "
        "workers as with none; name the failing sample and stage otherwise. Exit status: 0 same data, "
        "1 data lost/duplicated/changed or a stage failed, 2 could not verify.",
    )
    parser.add_argument(
        "--dataset",
        metavar="MODULE:FACTORY",
        help="module:factory (or file.py:factory), as bench and profile take it: a callable returning a "
        "map-style or iterable Dataset, or a dict with 'dataset' and optionally 'collate', 'contract', "
        "'batch_sampler', 'batch_size' (the collate and batch sampler are the ones checked)",
    )
    parser.add_argument("factory", nargs="?", help="the same, given without --dataset")
    parser.add_argument(
        "--batch-size",
        type=int,
        help=f"batch size of every setting (default: the factory's, else {DEFAULT_BATCH_SIZE}); "
        "not with a factory's batch_sampler",
    )
    parser.add_argument("--workers", type=int, default=2, help="the 'few workers' setting (default 2)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait for a batch before reporting the last step known (default 60; 0: none)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    parser.add_argument(
        "--id-key",
        default="id",
        help="the samples' id field (default 'id'; map-style samples without it are named by index)",
    )
    parser.add_argument(
        "--targets",
        action="append",
        metavar="KEY",
        help="field compared between settings (repeatable; 'all' for every field, 'none'); "
        "default: the first of y, label, labels, target, targets",
    )
    parser.add_argument(
        "--persistent-workers", action="store_true", help="keep workers between the two epochs"
    )
    parser.add_argument(
        "--show-errors",
        action="store_true",
        help="print exception messages (they may quote a sample's content)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="instead of the checklist: checkpoint the loader (a torchdata StatefulDataLoader over the "
        "factory's parts) after several batches of an epoch and resume fresh ones from each, with --workers "
        "and with --resume-workers; prove from the ids that the epoch went on as it would have",
    )
    parser.add_argument(
        "--resume-workers",
        type=int,
        metavar="N",
        help="with --resume: the workers of the second resume, through the batch sampler's state (default: "
        "0 when the batch sampler keeps state, else that resume is left out, with a note)",
    )
    parser.add_argument(
        "--resume-world-size",
        metavar="W,W2",
        help="with --resume: W rank loaders (in this process) take the checkpoints and W2 resume them; each "
        "rank runs the factory's batch_sampler made by its for_rank(rank, world_size), or by its class "
        "with rank and world_size (or num_replicas)",
    )
    parser.add_argument(
        "--checkpoints",
        type=int,
        default=DEFAULT_CHECKPOINTS,
        metavar="N",
        help=f"with --resume: checkpoints in the epoch (default {DEFAULT_CHECKPOINTS}): after the first "
        "batch, after the last, and others spread between; every batch when the epoch has no more",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="with --resume: picks the checkpoints in the middle of an epoch longer than --checkpoints",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_verb("doctor", _parser(), argv, run_command)


def run_command(args: argparse.Namespace) -> int:
    """The checklist on the parsed options; bad input raises ``UsageError`` (status 2, as "could not
    verify" is) before the checklist starts."""
    at_least("--batch-size", args.batch_size, 1)
    at_least("--workers", args.workers, 1, " (the few-workers setting set against the one process)")
    at_least("--timeout", args.timeout, 0, " (0: no limit)")
    if args.json:  # said now, not after the checklist has run for minutes
        _check_json_path(args.json)
    if args.dataset and args.factory and args.dataset != args.factory:
        raise UsageError("--dataset", f"given twice, as {args.dataset} and as {args.factory}: give one")
    spec = args.dataset or args.factory
    if not spec:
        raise UsageError("--dataset", "required: the data set to check, as module:factory")
    argument = "--dataset" if args.dataset else "factory"
    made = load_factory_output(spec, argument=argument)
    arguments = loader_arguments(made, batch_size=args.batch_size, default_batch_size=DEFAULT_BATCH_SIZE)
    if args.resume or args.resume_world_size:
        return _finish(args, spec, _resume(args, spec, argument, made))
    if made.collate is not None and made.contract is not None:
        print(
            f"note: {spec} gives a collate and a contract: the collate is checked, as your loader runs it "
            "(bench and profile give the contract to assemble)"
        )
    report = run_doctor(
        made.dataset,
        collate_fn=arguments["collate_fn"],
        contract=made.contract if made.collate is None else None,
        batch_sampler=arguments.get("batch_sampler"),
        batch_size=arguments.get("batch_size", DEFAULT_BATCH_SIZE),
        workers=args.workers,
        timeout=args.timeout,
        id_key=args.id_key,
        targets=args.targets,
        persistent_workers=args.persistent_workers,
        show_errors=args.show_errors,
    )
    return _finish(args, spec, report)


def _finish(args: argparse.Namespace, spec: str, report: dict) -> int:
    report["factory"] = spec
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=2, default=str)
    return int(report["exit_status"])


def _resume(args: argparse.Namespace, spec: str, argument: str, made: Factory) -> dict:
    """The resume check on StatefulDataLoaders made afresh from the factory for every loader (a resumed
    loader is a new process's: nothing carries over but the state), each with the factory's own batch
    sampler (split by rank by ``sampler_for_rank`` for another world size)."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        raise UsageError(
            "--resume",
            "needs torchdata (pip install torchdata): its StatefulDataLoader is the loader a "
            "checkpoint can hold",
        ) from None
    world_sizes = _world_sizes(args.resume_world_size)
    at_least("--checkpoints", args.checkpoints, 2, " (after the first batch and after the last)")
    if args.resume_workers is not None:
        at_least("--resume-workers", args.resume_workers, 0)
    iterable = isinstance(made.dataset, IterableDataset)
    shuffles = made.batch_sampler is None and not iterable
    if shuffles and world_sizes is None:
        print(
            "note: the factory gives no batch_sampler: the loader shuffles with StatefulDataLoader's own "
            "sampler (shuffle=True)"
        )
    other_workers = args.resume_workers
    if world_sizes is None and other_workers is None:
        if hasattr(made.batch_sampler, "load_state_dict"):
            other_workers = 0
        else:
            print(_workers_stay_note(made, iterable))

    def make_loader(workers: int, rank: int, world_size: int) -> Any:
        try:
            fresh = load_factory_output(spec, argument=argument)
        except UsageError as error:
            raise Unresumable(
                f"--resume calls the factory again for every loader (a resumed loader is a new process's), "
                f"and a later call failed: {error.problem}"
            ) from error
        arguments = loader_arguments(fresh, batch_size=args.batch_size, default_batch_size=DEFAULT_BATCH_SIZE)
        if world_sizes is not None:
            arguments["batch_sampler"] = sampler_for_rank(fresh.batch_sampler, rank, world_size)
        elif shuffles:
            arguments["shuffle"] = True
        return StatefulDataLoader(_identified(fresh.dataset, args.id_key), num_workers=workers, **arguments)

    check = ResumeCheck(
        make_loader,
        workers=args.workers,
        other_workers=other_workers,
        id_key=args.id_key,
        seed=args.seed,
        checkpoints=args.checkpoints,
        world_sizes=world_sizes,
        # Read inside the check, where a sample that fails to load is a failure it reports.
        dataset_ids=functools.partial(_dataset_ids, made.dataset, args.id_key) if world_sizes else None,
        timeout=args.timeout,
    )
    return check.run()


def _workers_stay_note(made: Factory, iterable: bool) -> str:
    """Why the resume on another worker count is left out unless ``--resume-workers`` asks for it."""
    if iterable:
        return (
            "note: an IterableDataset resumes on the same num_workers only (each worker reads its own part "
            "of the stream): another worker count is not checked (--resume-workers N tries it)"
        )
    given = f"its {type(made.batch_sampler).__name__}" if made.batch_sampler is not None else "its shuffling"
    return (
        "note: a resume on another worker count needs a batch sampler that keeps state, such as "
        f"fastcollate.IndexBatches, and {given} keeps none: not checked (--resume-workers N checks it)"
    )


def _world_sizes(given: str | None) -> tuple[int, int] | None:
    if given is None:
        return None
    try:
        world, world_after = (int(part) for part in given.split(","))
    except ValueError:
        raise UsageError(
            "--resume-world-size", f"want two world sizes as W,W2 (e.g. 2,3), got {given!r}"
        ) from None
    at_least("--resume-world-size", min(world, world_after), 1)
    return world, world_after


def _dataset_ids(dataset: Any, id_key: str) -> int | list | None:
    """The ids a resume on another world size must cover: N for the indices ``with_ids`` gives, else
    each sample's own (every sample read once, here); None for an IterableDataset (no ranks to split)."""
    if isinstance(dataset, IterableDataset):
        return None
    if not _has_own_ids(dataset, id_key):
        return len(dataset)
    return [sample_id(dataset[index], id_key) for index in range(len(dataset))]


def _has_own_ids(dataset: Any, id_key: str) -> bool:
    return len(dataset) > 0 and sample_id(dataset[0], id_key) is not None


def _identified(dataset: Any, id_key: str) -> Any:
    """The data set with ids to prove exactly-once with: its own, else its indices (``with_ids``)."""
    if isinstance(dataset, IterableDataset) or len(dataset) == 0:
        return dataset
    return dataset if _has_own_ids(dataset, id_key) else with_ids(dataset, id_key)


def _check_json_path(path: str) -> None:
    """A path ``--json`` can write to: not a folder, in a folder that exists."""
    folder = os.path.dirname(path) or "."
    if os.path.isdir(path):
        raise UsageError("--json", f"{path} is a folder: give a file path")
    if not os.path.isdir(folder):
        raise UsageError("--json", f"no folder {folder} to write {os.path.basename(path)} in")


if __name__ == "__main__":
    sys.exit(main())
