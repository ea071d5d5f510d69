"""Lets ``pytest benchmarks`` import the in-place build and ``collate_cases`` from a plain checkout."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE.parent, HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
