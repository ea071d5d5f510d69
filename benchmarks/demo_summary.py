"""The last lines of ``make demo``: each part's verdict as that part's own run wrote it, and its files.

    python benchmarks/demo_summary.py WORKERS_DIR LOADER_DIR ARRAYS_DIR HF_DIR

Each folder holds the results.json its part wrote. Nothing is measured or judged here: the verdicts and
ratios are read as written (``~``: not beyond the noise), so the summary claims only what this run
measured. A part that wrote nothing is named as missing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fastcollate.tools.bench.ratios import NOT_DIFFERENT

WIDTH = 100


def workers_line(report: dict) -> str:
    """What the part is for: slots on against default_collate and against slots off, at the most workers
    it ran (which cell is fastest overall is in its own output: on 2 cores the main process can tie)."""
    ratios = next(r["ratios"] for r in report["results"])
    if not ratios:
        return "no slots-on pair: the run had no workers"
    most = max(int(key.split(" / ")[0].rsplit("=", 1)[1]) for key in ratios)
    on = f"assemble, slots on at workers={most}"
    against = [(f"{on} / default_collate at workers={most}", "default_collate"),
               (f"{on} / assemble, slots off at workers={most}", "slots off")]
    return f"slots on at {most} workers: " + ", ".join(
        f"{_ratio(ratios[key])} {name}" for key, name in against if key in ratios)


def _ratio(ratio: dict) -> str:
    """A paired ratio as the JSON keeps it (``PairedRatio.to_json``), as the summary prints it."""
    return f"{ratio['median']:.2f}x" + ("" if ratio["clears_noise"] else f" {NOT_DIFFERENT}")


def loader_line(report: dict) -> str:
    """What the part is for: the collate swapped alone (assemble, same transfer) against default_collate,
    loader only, at each worker count (the bench's own verdict, which may name a transfer, is above)."""
    cells = [
        f"{_ratio(c['ratio_to_default'])} at {c['workers']} workers"
        for c in report["configs"]
        if c["observation"] == "loader" and c["variant"] == "assemble" and c["ratio_to_default"]
    ]
    return "assemble over default_collate " + (", ".join(cells) if cells else "not compared")


def arrays_line(report: dict) -> str:
    """Each case's first ratio (the one its table leads with), named by its baseline."""
    parts = []
    for case, result in report["cases"].items():
        pair, ratio = next(iter(result["ratios"].items()))
        mark = "" if ratio["clears_noise"] else f" {NOT_DIFFERENT}"
        parts.append(f"{case} {ratio['ratio']:.1f}x{mark} {pair.split(' / ')[1]}")
    return "gathered by index over " + "; ".join(parts) if parts else "no case ran"


def hf_line(report: dict) -> str:
    """Arrays.from_hf over HF's own path without workers: each case's range over its batch sizes."""
    parts = []
    for case, result in report["cases"].items():
        cells = [g["Arrays"] for g in result["groups"] if g["workers"] == 0 and "Arrays" in g]
        if cells:
            ratios = [c["ratio"] for c in cells]
            mark = "" if all(c["clears_noise"] for c in cells) else f" {NOT_DIFFERENT}"
            parts.append(f"{case} {min(ratios):.1f}-{max(ratios):.1f}x{mark}")
    return "from_hf over HF's path at every batch size: " + ", ".join(parts) if parts else "no case ran"


PARTS = (
    ("workers, pre-decoded images", workers_line),
    ("bench, PIL-bound images", loader_line),
    ("arrays", arrays_line),
    ("Hugging Face", hf_line),
)


def summary(folders: list[Path]) -> list[str]:
    lines = ["summary (~: within noise) of " + " ".join(f"{folder}/" for folder in folders)]
    for (title, read), folder in zip(PARTS, folders, strict=True):
        try:
            said = read(json.loads((folder / "results.json").read_text()))
        except (OSError, ValueError, LookupError, TypeError, AttributeError, StopIteration) as error:
            said = f"no result ({type(error).__name__}: {error})"
        text = f"  {title}: {said}"
        lines.append(text if len(text) <= WIDTH else text[: WIDTH - 3] + "...")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != len(PARTS):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    print("\n".join(summary([Path(a) for a in argv])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
