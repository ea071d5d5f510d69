"""Times fastcollate.assemble against torch's default_collate (and the other baselines: plain copies,
pad_sequence) on the cases of ``benchmarks.shared.collate_cases``, interleaved in one process.

    python -m benchmarks.collate_ratios [--threads 1 2] [--json PATH] [--repeat N] [--cases ...]
                                        [--gc young|full] [--samples same|fresh] [--no-targets]

Method: per thread count (``torch.set_num_threads``), per case: one equality check of every contender's
output against the reference, a warm-up, then N rounds; each round calls every contender once, in a
freshly shuffled order (seeded), so drift hits all alike and no contender always follows the same one
(a fixed or rotated order does: whoever runs after default_collate finds the caches it left). Each
call's batch is dropped before the next call, as a training loop does, so assemble's staging ring stays
warm. The garbage collector is off inside the timed calls (as in timeit) and run between rounds: the
youngest generation by default, as a running program mostly does; ``--gc full`` collects the whole heap,
which also evicts the samples' objects from the caches before every round. By default every call
collates the same sample objects (the conditions of design.md's reference times, e.g. default_collate
at about 0.93 ms on the small-field batch); ``--samples fresh`` makes the samples again before every
call, untimed, as a DataLoader worker's ``__getitem__`` does (new objects at new addresses; the plain
copies' sources are not remade). Times are of the collate call alone (freeing default_collate's fresh
output is not counted: conservative for assemble).
Every ratio follows fastcollate/bench/ratios.py: the median of the per-round ratios, with their min-max,
and ``~`` unless it clears the noise. Each case prints the lead of assemble (assemble+contract where the
case has no plain assemble) over every other contender: that contender's time over assemble's, in each
round, so above 1 means assemble is faster. The rounds time single calls, not a loader, so none is too
small to time. A contender's own spread is the 25th-75th percentile of its times. Each speed-up target
also gets the same baseline against a plain copy (``copy_``, ordinary stores) of the batch's bytes into
a reused buffer: the speed-up of a collate that did nothing but that copy (assemble writes batches of
8 MiB and more with streaming stores, and can beat it). With two or more
thread counts the ImageNet case is timed once more with the counts interleaved call by call, beside a
compute-bound control (torch.exp) that shows whether the extra cores were free at all. Every
repetition's raw time goes to the JSON. For each case the JSON also keeps each call's minor page faults
(the process's, read just outside the timed span so that they cover the call; the median is printed per
contender): a contender whose fresh output malloc must fault in pays for the faults as well as for the
copy, and whether it must depends on what malloc was left holding, which changes from call to call.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import textwrap
from pathlib import Path

import numpy as np
import torch

from benchmarks.shared.collate_cases import CASES, FLOOR, Case, build_case, outputs_equal
from benchmarks.shared.collate_timing import machine, time_case
from fastcollate.tools.bench.ratios import NOT_DIFFERENT, PairedRatio, paired_ratio
from fastcollate.transfer.staging import main_process_ring

CONTROL = "exp(4M floats), compute-bound control"


def check_outputs(case: Case) -> dict[str, list[str]]:
    """Every contender's batch against the reference's, once (so we never time a wrong result)."""
    reference = case.contenders[case.reference](case.samples)
    problems = {}
    for name in case.checked:
        out = case.contenders[name](case.samples)
        problems[name] = outputs_equal(reference, out)
        del out
    if "stack(out=reused)" in case.contenders:
        stacked = case.contenders["stack(out=reused)"](case.samples)
        same = torch.equal(stacked, reference["image"])
        problems["stack(out=reused)"] = [] if same else ["image: values differ"]
    return problems


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def time_over(numerator: list[float], denominator: list[float]) -> PairedRatio:
    """The first contender's time over the second's, paired round by round: the second's lead."""
    ratio = paired_ratio(dict(enumerate(numerator)), dict(enumerate(denominator)))
    if ratio is None:
        raise ValueError("no round with two usable times")
    return ratio


def ratio_json(ratio: PairedRatio) -> dict:
    return {"ratio": ratio.median, "min": ratio.low, "max": ratio.high, "rounds": ratio.rounds,
            "clears_noise": ratio.clears_noise}


def lead_subject(case: Case) -> str:
    """Whose lead a case's ratios give: assemble, or assemble+contract where there is no plain one."""
    return "assemble" if "assemble" in case.contenders else "assemble+contract"


def case_leads(case: Case, times: dict[str, list[float]]) -> dict[str, PairedRatio]:
    """The lead of the case's subject (lead_subject) over every other contender."""
    subject = lead_subject(case)
    return {name: time_over(times[name], times[subject]) for name in times if name != subject}


def summarize(case: Case, times: dict[str, list[float]], threads: int, leads: dict[str, PairedRatio],
              faults: dict[str, list[int]] | None = None) -> dict:
    contenders = {}
    for name, values in times.items():
        median = statistics.median(values)
        contenders[name] = {
            "minor_faults_median": statistics.median(faults[name]) if faults else None,
            "median_s": median,
            "p25_s": percentile(values, 25),
            "p75_s": percentile(values, 75),
            "min_s": min(values),
            "samples_per_s": len(case.samples) / median,
            "bytes_per_s": case.nbytes / median,
            **({"tokens_per_s": case.tokens / median} if case.tokens else {}),
        }
    targets = []
    for target in case.targets:
        subject_s, baseline_s = times[target.subject], times[target.baseline]
        # Target.ratio's direction: the baseline's time over the subject's for a speed-up, the subject's
        # over the baseline's for an overhead.
        ratio = (time_over(baseline_s, subject_s) if target.kind == "faster"
                 else time_over(subject_s, baseline_s))
        # The speed-up of a collate that did nothing but copy the bytes (with ordinary stores).
        plain_copy = (time_over(baseline_s, times[FLOOR]).median
                      if target.kind == "faster" and FLOOR in times else None)
        targets.append({
            "case": case.key,
            "threads": threads,
            "target": target.label,
            "rule": target.describe(),
            **ratio_json(ratio),
            "bound": target.bound,
            "met": target.met(ratio.median),
            "baseline_vs_plain_copy": plain_copy,
        })
    return {
        "contenders": contenders,
        "lead_of": lead_subject(case),
        "leads": {name: ratio_json(ratio) for name, ratio in leads.items()},
        "targets": targets,
    }


def say(text: str) -> None:
    """One line of the report, wrapped at 100 columns (a long path or command may not fit one)."""
    print(textwrap.fill(text, 100, subsequent_indent="    ", break_long_words=False, break_on_hyphens=False))


def fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:8.1f} us"


def fmt_rate(value: float, unit: str) -> str:
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:7.2f} {prefix}{unit}"
    return f"{value:7.2f} {unit}"


def print_case(case: Case, threads: int, summary: dict, leads: dict[str, PairedRatio],
               problems: dict[str, list[str]], load: float) -> None:
    print()
    say(f"== {case.key}: {case.title}")
    print(f"   threads={threads}, {len(case.samples)} samples, {case.nbytes / 1e6:.2f} MB/batch, "
          f"load average {load:.2f}")
    tokens = f"{'tokens/s':>13s}  " if case.tokens else ""
    print(f"  {'median time, p25-p75':>58s}  {'bytes/s':>11s}  {tokens}faults")
    for name, row in summary["contenders"].items():
        scale, unit, digits = (1e3, "ms", 3) if row["median_s"] >= 1e-4 else (1e6, "us", 1)
        spread = f"{row['p25_s'] * scale:.{digits}f}-{row['p75_s'] * scale:.{digits}f} {unit}"
        rates = fmt_rate(row["bytes_per_s"], "B/s")
        if "tokens_per_s" in row:
            rates += f"  {fmt_rate(row['tokens_per_s'], 'tok/s')}"
        faults = f"  {row['minor_faults_median']:6g}" if row["minor_faults_median"] is not None else ""
        print(f"  {name:26s} {fmt_time(row['median_s'])} {spread:>18s}  {rates}{faults}")
    print(f"  {summary['lead_of']}'s lead, the other's time over its own per round, median (min-max):")
    for name, ratio in leads.items():
        print(f"    over {name:27s} {ratio.text()}")
    for name, issues in problems.items():
        if issues:
            print(f"  !! {name} output differs from {case.reference}: {'; '.join(issues[:5])}")


def print_targets(rows: list[dict]) -> None:
    print("\n== targets (median of the per-round ratios, min-max; ~: does not clear the noise)")
    print("  copy_: the same baseline against copy_ of the batch's bytes into a reused buffer (ordinary")
    print("  stores), i.e. the speed-up of a collate that did nothing but that copy")
    print(f"    {'target':42s} {'ratio (min-max)':25s} {'copy_':>5s}  result")
    group = None
    for row in rows:
        if group != (row["case"], row["threads"]):
            group = (row["case"], row["threads"])
            print(f"  {row['case']}, {row['threads']} thread{'s' if row['threads'] > 1 else ''}:")
        shown = f"{row['ratio']:.2f}x ({row['min']:.2f}-{row['max']:.2f})"
        shown += "" if row["clears_noise"] else f" {NOT_DIFFERENT}"
        plain_copy = f"{row['baseline_vs_plain_copy']:.1f}" if row.get("baseline_vs_plain_copy") else "-"
        result = "MET" if row["met"] else "NOT MET"
        print(f"    {row['target']:42s} {shown:25s} {plain_copy:>5s}  {result}")


def thread_scaling(case: Case, rounds: int, warmup: int, thread_counts: list[int]) -> dict:
    """assemble and the flat copy at each thread count, interleaved call by call (set_num_threads each time),
    with a compute-bound control (``torch.exp`` of 4M floats) that shows whether the extra cores were free."""
    control = torch.rand(4_000_000, generator=torch.Generator().manual_seed(2))
    fns = {name: case.contenders[name] for name in ("assemble", FLOOR) if name in case.contenders}
    fns[CONTROL] = lambda samples: torch.exp(control)
    contenders = {}
    for name, fn in fns.items():
        for threads in thread_counts:

            def run(samples, fn=fn, threads=threads):
                torch.set_num_threads(threads)
                return fn(samples)

            contenders[f"{name} @{threads}t"] = run
    scaling_case = Case(case.key, case.title, case.samples, contenders, (), case.nbytes)
    times = time_case(scaling_case, rounds, warmup)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {"raw_s": times, "median_s": medians}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="intra-op threads, in order")
    parser.add_argument("--repeat", type=int, default=None, help="rounds per case (default: 60-400 by case)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed rounds first")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--json", type=Path, default=None, help="write every repetition and the summary here")
    parser.add_argument(
        "--gc", choices=("young", "full"), default="young",
        help="collection between rounds: the youngest generation (default, as a running program mostly does) "
             "or the whole heap, which also evicts the samples' objects from the caches before every round",
    )
    parser.add_argument(
        "--samples", choices=("same", "fresh"), default="same",
        help="every call collates the same sample objects (default), or samples made again just before it, "
             "untimed (as in a DataLoader worker, where __getitem__ made them)",
    )
    parser.add_argument(
        "--no-targets", action="store_true", help="leave the performance targets out of the output"
    )
    args = parser.parse_args(argv)

    info = machine()
    say(f"machine: {info['cpu']}, {info['logical_cpus']} logical CPUs, {info['memory_gib']} GiB; "
        f"python {info['python']}, torch {info['torch']}, numpy {info['numpy']}; fastcollate "
        f"{info['fastcollate']} @ {info['git_commit'][:10]}")
    say(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}; malloc: {info['malloc']}")
    say(f"extension: {info['fastcollate_path']} sha256 {info['extension_sha256_16']} "
        f"built {info['extension_mtime']}; load average {os.getloadavg()[0]:.2f} "
        f"on {info['logical_cpus']} CPUs")
    cases = [build_case(key) for key in args.cases]
    ring = main_process_ring()
    initial_threads = torch.get_num_threads()

    results: list[dict] = []
    target_rows: list[dict] = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for case in cases:
            problems = check_outputs(case)
            rounds = args.repeat or case.repeat
            before = ring.stats()
            load_before = os.getloadavg()
            faults: dict[str, list[int]] = {}
            times = time_case(case, rounds, args.warmup, gc_generation=2 if args.gc == "full" else 0,
                              fresh=args.samples == "fresh", faults=faults)
            load_after = os.getloadavg()
            after = ring.stats()
            leads = case_leads(case, times)
            summary = summarize(case, times, threads, leads, faults)
            print_case(case, threads, summary, leads, problems, load_after[0])
            target_rows.extend(summary["targets"])
            results.append({
                "case": case.key,
                "title": case.title,
                "threads": threads,
                "batch": len(case.samples),
                "nbytes": case.nbytes,
                "tokens": case.tokens,
                "rounds": rounds,
                "warmup_rounds": args.warmup,
                "order": "shuffled each round (random.Random(0))",
                "loadavg_1min_before_after": [load_before[0], load_after[0]],
                "output_problems": problems,
                "ring": {"slot_allocations": after.slot_allocations - before.slot_allocations,
                         "reuses": after.reuses - before.reuses,
                         "overflow_allocations": after.overflow_allocations - before.overflow_allocations},
                "raw_s": times,
                "minor_faults_per_call": faults,
                **summary,
            })
    if not args.no_targets:
        print_targets(target_rows)

    scaling = None
    if "imagenet_uint8" in args.cases and len(args.threads) > 1:
        case = next(c for c in cases if c.key == "imagenet_uint8")
        scaling = thread_scaling(case, args.repeat or case.repeat, args.warmup, args.threads)
        print("\n== imagenet_uint8 thread scaling (thread counts interleaved call by call)")
        base = scaling["median_s"]
        for name, median in base.items():
            rate = "" if name.startswith(CONTROL) else fmt_rate(case.nbytes / median, "B/s")
            print(f"  {name:42s} {fmt_time(median)}  {rate}".rstrip())
        first, last = args.threads[0], args.threads[-1]
        scaling["lead_of_last_thread_count"] = {}
        for name in ("assemble", FLOOR, CONTROL):
            if f"{name} @{first}t" in scaling["raw_s"]:
                lead = time_over(scaling["raw_s"][f"{name} @{first}t"], scaling["raw_s"][f"{name} @{last}t"])
                print(f"  {name}: {last} threads' lead over {first}: {lead.text()}")
                scaling["lead_of_last_thread_count"][name] = ratio_json(lead)
    torch.set_num_threads(initial_threads)

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "benchmark": "collate_ratios",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "method": __doc__.split("Method: ", 1)[1].strip(),
            "machine": info,
            "threads": args.threads,
            "gc_between_rounds": args.gc,
            "samples": args.samples,
            "targets": target_rows,
            "cases": results,
            "thread_scaling_imagenet": scaling,
        }
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
