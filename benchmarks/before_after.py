"""Did a change move the ratios? Runs ``collate_ratios.py`` (or ``array_ratios.py``, ``guard_cost.py``,
``worker_ratios.py``) from two checkouts, alternating (before, after, before, after, ...), and sets each
ratio before against after.

    python -m benchmarks.before_after --before /path/to/old/checkout [--after .] [--runs 3]
                                      [--bench collate_ratios|array_ratios|guard_cost|worker_ratios]
                                      [--json PATH] [-- the bench's options, e.g. --threads 1]

Each checkout needs its extension built in place (``make build`` there, or a copied ``fastcollate/_C*.so``
for a change that touched no C++). A ratio is already a side-by-side measurement within one run
(assemble against default_collate, interleaved); alternating whole runs makes the machine's drift hit
both checkouts alike. Reported: per target, the median over runs of each checkout's ratio, and after /
before (1.00 is no change; above 1 is a higher ratio after). Every run's ratios go to the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def collate_ratios(report: dict) -> dict[str, float]:
    """Target name -> ratio, from a collate_ratios.py JSON."""
    return {f"{t['case']} @{t['threads']}t: {t['rule']}": t["ratio"] for t in report["targets"]}


def worker_ratios(report: dict) -> dict[str, float]:
    """Each contender's samples/s over default_collate's at each worker count (median of the per-round
    paired ratios, warm-up left out), from a worker_ratios.py JSON."""
    ratios = {}
    for result in report["results"]:
        by_round: dict[tuple[int, int], dict[str, float]] = {}
        for run in result["runs"]:
            if not run["warmup"]:
                rates = by_round.setdefault((run["workers"], run["round"]), {})
                rates[run["contender"]] = run["samples_per_s"]
        paired: dict[str, list[float]] = {}
        for (workers, _), rates in sorted(by_round.items()):
            for contender, rate in rates.items():
                if contender != "default_collate":
                    name = f"{result['dataset']} workers={workers}: {contender} / default_collate"
                    paired.setdefault(name, []).append(rate / rates["default_collate"])
        ratios.update({name: statistics.median(values) for name, values in paired.items()})
    return ratios


def array_ratios(report: dict) -> dict[str, float]:
    """Each case's side-by-side ratios (the gathered batch against the idiom, the floor, the per-sample
    path), from an array_ratios.py JSON."""
    return {
        f"{case}: {pair}": value["ratio"]
        for case, result in report["cases"].items()
        for pair, value in result["ratios"].items()
    }


def guard_cost(report: dict) -> dict[str, float]:
    """gather_into / index_select per batch shape, from a guard_cost.py JSON."""
    return {f"{r['rows']} x {r['width']}: gather_into / index_select": r["ratio"] for r in report["results"]}


BENCHES = {"array_ratios": array_ratios, "collate_ratios": collate_ratios, "guard_cost": guard_cost,
           "worker_ratios": worker_ratios}


def run_once(checkout: Path, bench: str, extra: list[str], scratch: Path, label: str) -> dict[str, float]:
    """One run of ``bench`` from ``checkout``: ratio name -> ratio."""
    out = scratch / f"{label}.json"
    command = [sys.executable, str(checkout / "benchmarks" / f"{bench}.py"), "--json", str(out), *extra]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    subprocess.run(command, cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL)
    return BENCHES[bench](json.loads(out.read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", type=Path, required=True, help="the checkout before the change")
    parser.add_argument("--after", type=Path, default=HERE.parent, help="the checkout after it (this one)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each checkout, alternating")
    parser.add_argument("--bench", choices=sorted(BENCHES), default="collate_ratios")
    parser.add_argument("--json", type=Path, default=None, help="write every run's ratios here")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: options for collate_ratios.py")
    args = parser.parse_args(argv)
    extra = [a for a in args.extra if a != "--"]
    checkouts = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(args.runs):
            for label, checkout in checkouts.items():
                print(f"run {index + 1}/{args.runs}: {label} ({checkout})", flush=True)
                runs[label].append(run_once(checkout, args.bench, extra, Path(scratch), f"{label}-{index}"))
    rows = []
    print(f"\n{'target':<78} {'before':>7} {'after':>7} {'after/before':>13}")
    for target in runs["before"][0]:
        before = statistics.median(run[target] for run in runs["before"])
        after = statistics.median(run[target] for run in runs["after"] if target in run)
        rows.append({"target": target, "before_median": before, "after_median": after,
                     "after_over_before": after / before})
        print(f"{target:<78} {before:7.2f} {after:7.2f} {after / before:13.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        command = " ".join([os.path.basename(sys.executable), *sys.argv])
        payload = {"benchmark": "before_after", "command": command,
                   "checkouts": {k: str(v) for k, v in checkouts.items()}, "runs": runs, "summary": rows}
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
