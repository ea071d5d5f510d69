"""The build's progress, from pip -v's output as it arrives (the Makefile keeps the whole of it in
.stamp-build.log): setup.py's own lines once each (pip runs setup.py twice), then a line per compiled file
(ninja's "[n/N]" kept), one for the link and one for the install. Python rather than awk: mawk, Debian's
awk, reads a pipe in blocks, so its lines arrived minutes late.

    pip install -v ... 2>&1 | python scripts/build_progress.py
"""

import re
import sys


def shown(line: str) -> str | None:
    """What the progress shows for one line of pip's output, if anything."""
    words = line.split()
    flags = [i for i, word in enumerate(words[:-1]) if word == "-c"]  # torch's commands hold "-c -c FILE"
    compiled = words[flags[-1] + 1] if flags else ""
    compiled = re.sub(r".*/csrc/", "csrc/", compiled)
    if words and re.fullmatch(r"\[\d+/\d+\]", words[0]) and compiled:
        return f"  {words[0]} {compiled}"
    if compiled.endswith((".cpp", ".cu")):  # without ninja: setuptools' own compiler commands
        return f"  compiling {compiled}"
    if "-shared" in words and re.search(r"_C\S*\.so", line):
        return "  linking fastcollate._C"
    if line.startswith("Successfully installed fastcollate"):
        return "  installed (editable)"
    return None


def main() -> None:
    seen = set()
    for line in sys.stdin:
        line = line.strip()
        if line.startswith("[fastcollate build]"):
            if line not in seen:
                seen.add(line)
                print(line, flush=True)
        elif (text := shown(line)) is not None:
            print(text, flush=True)


if __name__ == "__main__":
    main()
