"""The last lines of ``make demo``: each part's verdict as that part's own run wrote it, and its files.

    python -m benchmarks.demo_summary WORKERS_DIR LOADER_DIR ARRAYS_DIR HF_DIR

Each folder holds the results.json its part wrote. Nothing is measured or judged here: the verdicts and
ratios are read as written (``~``: not beyond the noise), so the summary claims only what this run
measured. A part that wrote nothing is named as missing. The Hugging Face part, the one the README's table
shows, has a line per worker count and says the rows it ran, and the full run's where they were fewer.
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


def hf_lines(report: dict) -> list[str]:
    """Arrays.from_hf over HF's own path: at each worker count the run had, each case's range over its
    batch sizes; then the rows each case ran and, where they are fewer (--quick), the full run's, which is
    the README's table, and its command."""
    cases = report["cases"]
    if not cases:
        return ["no case ran"]
    lines = ["Arrays.from_hf over HF's path, min-max over the batch sizes"]
    for workers in sorted({group["workers"] for result in cases.values() for group in result["groups"]}):
        parts = []
        for case, result in cases.items():
            cells = [g["Arrays"] for g in result["groups"] if g["workers"] == workers and "Arrays" in g]
            if cells:
                parts.append(f"{case} {_span(cells)}")
        lines.append(f"at {workers} workers: " + (", ".join(parts) or "no Arrays result"))
    lines.append("rows: " + ", ".join(f"{case} {result['rows']:,}" for case, result in cases.items()))
    if any(result["rows"] < result["full_rows"] for result in cases.values()):
        full = ", ".join(f"{case} {result['full_rows']:,}" for case, result in cases.items())
        lines.append(f"the README's table ran {full}: python -m benchmarks.hf_ratios")
    return lines


def _span(cells: list[dict]) -> str:
    """The range of paired ratios (``ratio``, as hf_ratios.py keeps them), ``~`` when any is in the noise."""
    low, high = (f"{r:.1f}" for r in (min(c["ratio"] for c in cells), max(c["ratio"] for c in cells)))
    mark = "" if all(c["clears_noise"] for c in cells) else f" {NOT_DIFFERENT}"
    return (f"{low}x" if low == high else f"{low}-{high}x") + mark


PARTS = (
    ("workers, pre-decoded images", workers_line),
    ("bench, PIL-bound images", loader_line),
    ("arrays", arrays_line),
    ("Hugging Face", hf_lines),
)


def summary(folders: list[Path]) -> list[str]:
    lines = ["summary (~: within noise) of " + " ".join(f"{folder}/" for folder in folders)]
    for (title, read), folder in zip(PARTS, folders, strict=True):
        try:
            said = read(json.loads((folder / "results.json").read_text()))
        except (OSError, ValueError, LookupError, TypeError, AttributeError, StopIteration) as error:
            said = f"no result ({type(error).__name__}: {error})"
        first, *more = [said] if isinstance(said, str) else said
        lines += [_fit(f"  {title}: {first}"), *(_fit(f"    {line}") for line in more)]
    return lines


def _fit(text: str) -> str:
    return text if len(text) <= WIDTH else text[: WIDTH - 3] + "..."


def main(argv: list[str]) -> int:
    if len(argv) != len(PARTS):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    print("\n".join(summary([Path(a) for a in argv])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
