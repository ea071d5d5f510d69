"""``python -m fastcollate doctor module:factory``: the loader checklist, run on a dataset.

Representative samples one by one, then one process (the reference), then a few workers for two
epochs: the report says whether the faster setting delivers the same samples and targets, which stage
failed on which sample if one did, and how long each setting took. It never prints a sample's content.
The checklist itself is ``checklist.Doctor``; this module loads the dataset and reads the options.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from torch.utils.data import Dataset

from ..cli import UsageError, at_least, loading, run_verb
from ..factory_spec import load_factory
from .checklist import Doctor
from .failures import Failure

__all__ = ["Doctor", "Failure", "load_dataset", "main", "run_doctor"]


def load_dataset(spec: str) -> Dataset:
    """``module:factory`` (or ``path/to/file.py:factory``, see ``load_factory``): the factory's
    dataset. A factory is a callable returning a Dataset; a Dataset object there is taken as it is."""
    target = load_factory(spec)
    dataset = target if isinstance(target, Dataset) or not callable(target) else target()
    if not isinstance(dataset, Dataset) and not (
        hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    ):
        raise TypeError(f"{spec} gave a {type(dataset).__name__}, not a Dataset")
    return dataset


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
        help="module:factory (or file.py:factory), a callable returning a map-style or iterable Dataset, "
        "as bench and profile take it",
    )
    parser.add_argument("factory", nargs="?", help="the same, given without --dataset")
    parser.add_argument("--batch-size", type=int, default=8, help="batch size of every setting (default 8)")
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
    with loading(argument, spec):
        dataset = load_dataset(spec)
    report = run_doctor(
        dataset,
        batch_size=args.batch_size,
        workers=args.workers,
        timeout=args.timeout,
        id_key=args.id_key,
        targets=args.targets,
        persistent_workers=args.persistent_workers,
        show_errors=args.show_errors,
    )
    report["factory"] = spec
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=2, default=str)
    return int(report["exit_status"])


def _check_json_path(path: str) -> None:
    """A path ``--json`` can write to: not a folder, in a folder that exists."""
    folder = os.path.dirname(path) or "."
    if os.path.isdir(path):
        raise UsageError("--json", f"{path} is a folder: give a file path")
    if not os.path.isdir(folder):
        raise UsageError("--json", f"no folder {folder} to write {os.path.basename(path)} in")


if __name__ == "__main__":
    sys.exit(main())
