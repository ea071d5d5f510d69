"""What the verbs (``bench``, ``profile``, ``doctor``) print fits a terminal of 100 columns: tables are
built that narrow, and prose is wrapped here."""

from __future__ import annotations

import textwrap

__all__ = ["TERMINAL_COLUMNS", "fit_to_terminal"]

TERMINAL_COLUMNS = 100


def fit_to_terminal(text: str, width: int = TERMINAL_COLUMNS) -> str:
    """``text`` with each line longer than ``width`` wrapped at spaces, its continuation indented two
    more than the line (table rows are built narrower; this is for prose, and leaves a path whole)."""
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip()))
        out += textwrap.wrap(line, width, initial_indent="", subsequent_indent=indent + "  ",
                             break_long_words=False, break_on_hyphens=False) or [line]
    return "\n".join(out)
