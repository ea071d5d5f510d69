"""``python -m fastcollate <command>`` (or the ``fastcollate`` console script): bench, profile, doctor.
Each command lives in its own module; how they answer bad input is ``fastcollate.tools.cli``."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {  # name: (module with main(argv), one-line summary)
    "bench": ("fastcollate.tools.bench.command",
              "compare default_collate, assemble and DeviceLoader side by side"),
    "profile": ("fastcollate.tools.bench.profile",
                "trace batch_wait / h2d_transfer / compute and draw the timeline"),
    "doctor": ("fastcollate.tools.audit.doctor",
               "check that a dataset's loader delivers every sample, once, unchanged"),
}


def usage() -> str:
    lines = ["usage: python -m fastcollate [--version] [--debug] <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += [
        "",
        "'python -m fastcollate <command> --help' describes each command's options.",
        "Bad input is answered in one line, exit status 2; --debug (here or after the command) adds the "
        "traceback.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = bool(argv) and argv[0] == "--debug"
    if debug:  # handed on to the command, which owns the option (its --help lists it)
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        from . import __version__

        print(f"fastcollate {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(["--debug", *rest] if debug else rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
