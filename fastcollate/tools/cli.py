"""How the verbs (``bench``, ``profile``, ``doctor``) answer bad input on the command line: one line on
stderr, ``<verb>: <argument>: <what is wrong>``, exit status 2, and no traceback unless ``--debug``.

argparse already answers what it can see (an unknown option, a value outside ``choices``, a word where
a number goes) with the usage and one line, status 2: that is left to it. What it cannot see (a count
that must be positive, a device this machine lacks, a factory that does not load) the verbs check
before anything is measured and raise as ``UsageError``; ``run_verb`` prints it. A failure inside one
measured configuration is not bad input: the bench records it and goes on, as before.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

__all__ = ["EXIT_USAGE", "UsageError", "at_least", "loading", "output_folder", "run_verb"]

EXIT_USAGE = 2  # argparse's own status for bad input, so every kind of bad input reads the same


class UsageError(Exception):
    """Bad input on the command line: the argument (as the user typed it) and what is wrong with it."""

    def __init__(self, argument: str, problem: str) -> None:
        super().__init__(f"{argument}: {problem}")
        self.argument = argument
        self.problem = problem


def run_verb(
    verb: str, parser: argparse.ArgumentParser, argv: Sequence[str], body: Callable[[argparse.Namespace], int]
) -> int:
    """Parses ``argv`` (``parser`` gains ``--debug``) and returns ``body(args)``'s exit status; a
    ``UsageError`` from it becomes one line on stderr and status 2, or, with ``--debug``, propagates
    with its traceback (and the cause's: the import error behind a factory that does not load)."""
    parser.add_argument(
        "--debug", action="store_true", help="on bad input, show the traceback as well as the one-line error"
    )
    args = parser.parse_args(list(argv))
    try:
        return int(body(args) or 0)
    except UsageError as error:
        if args.debug:
            raise
        # One line even when the cause's message has several (a SyntaxError's, a user's exception).
        print(f"{verb}: " + " ".join(str(error).split()), file=sys.stderr)
        return EXIT_USAGE


def at_least(argument: str, value: int | float | None, minimum: int | float, meaning: str = "") -> None:
    """Raises ``UsageError`` when ``value`` (None: not given, the default applies) is below ``minimum``;
    ``meaning`` says what the smallest value does, e.g. ``" (0: load in the main process)"``."""
    if value is not None and value < minimum:
        raise UsageError(argument, f"must be at least {minimum}{meaning}, got {value}")


@contextlib.contextmanager
def loading(argument: str, spec: str) -> Iterator[None]:
    """Around loading and calling the ``module:factory`` that ``argument`` names: any exception from it
    (module missing, attribute missing, the module or the factory raising) becomes a ``UsageError``
    that names ``spec`` and the exception, chained to it for ``--debug``."""
    module, _, attribute = spec.rpartition(":")
    if not module or not attribute:
        raise UsageError(argument, f"want module:factory or path/to/file.py:factory, got {spec!r}")
    try:
        yield
    except UsageError:
        raise
    except Exception as error:
        raise UsageError(argument, f"cannot load {spec}: {type(error).__name__}: {error}") from error


def output_folder(argument: str, path: Path) -> Path:
    """``path``, created with its parents if missing; a file there, or a folder that cannot be made,
    is a ``UsageError`` rather than an OSError's traceback."""
    if path.exists() and not path.is_dir():
        raise UsageError(argument, f"{path} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(argument, f"cannot create {path}: {error.strerror or error}") from error
    return path
