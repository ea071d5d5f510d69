"""scripts/build_progress.py, the filter ``make build`` shows pip -v's output through: setup.py's lines once
each, a short line per compiled file and for the link, each as it comes (a line held until more input
arrives would show the build's progress late), the rest of pip's output left out."""

from __future__ import annotations

import select
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_progress.py"
DECISION = "[fastcollate build] CUDA build: off (this torch is a CPU-only build)"
NINJA = "[2/22] c++ -MMD -MF build/t/csrc/ops/x.o.d -O3 -I/src/csrc -c -c /src/csrc/ops/x.cpp -o build/t/x.o"
NVCC = "[3/22] /usr/local/cuda/bin/nvcc -I/src/csrc -c /src/csrc/ops/cuda/y.cu -o build/t/y.o -O3"
SETUPTOOLS = "g++ -fPIC -O3 -Icsrc -c csrc/fill/z.cpp -o build/t/csrc/fill/z.o"  # no ninja: no [n/N]
LINK = "g++ -shared build/t/x.o build/t/y.o -o build/lib/fastcollate/_C.cpython-311-x86_64-linux-gnu.so"


def next_line(process: subprocess.Popen, seconds: float) -> str | None:
    ready, _, _ = select.select([process.stdout], [], [], seconds)
    return process.stdout.readline().rstrip("\n") if ready else None


def test_each_line_of_the_build_shows_before_the_next_arrives():
    process = subprocess.Popen([sys.executable, str(SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, bufsize=1)
    fed = [
        (f"  {DECISION}", DECISION),
        ("  Collecting numpy (from fastcollate==0.1.0)", None),
        (f"  {NINJA}", "  [2/22] csrc/ops/x.cpp"),
        (f"  {NVCC}", "  [3/22] csrc/ops/cuda/y.cu"),
        (f"  {SETUPTOOLS}", "  compiling csrc/fill/z.cpp"),
        (f"  {LINK}", "  linking fastcollate._C"),
        (f"  {DECISION}", None),  # pip runs setup.py a second time, for the build: its decisions again
        ("Successfully installed fastcollate-0.1.0", "  installed (editable)"),
    ]
    try:
        for given, shown in fed:
            process.stdin.write(given + "\n")
            process.stdin.flush()
            assert next_line(process, 10.0 if shown else 0.5) == shown, given
    finally:
        process.stdin.close()
        process.wait(timeout=10)
    assert process.stdout.read() == ""
