"""What a bench run reports: one entry per configuration (medians over its runs, never the best run, and
every run kept), the terminal table, and the JSON-safe form of it all."""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .configs import VARIANTS, Setup, tail_batches
from .ratios import NOT_DIFFERENT, PairedRatio, paired_ratio, runs_apart, too_small_to_time

if TYPE_CHECKING:  # epoch.py imports this module for jsonable
    from .epoch import EpochRun

__all__ = [
    "NOT_DIFFERENT",
    "fmt_bytes",
    "fmt_ms",
    "fmt_rate",
    "format_table",
    "jsonable",
    "mark_not_different",
    "not_different",
    "summarize",
    "verdict",
]

def jsonable(value: Any) -> Any:
    """``value`` with everything json.dumps refuses turned into what it takes (numbers, or their text)."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return str(value)


def _median(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return float(statistics.median(kept)) if kept else None


def _max(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return max(kept) if kept else None


def summarize(setup: Setup, key: tuple[str, str, int], runs: list[EpochRun]) -> dict[str, Any]:
    """One configuration's entry: medians over its runs (never the best), every run kept."""
    observation, variant_key, workers = key
    variant = next(v for v in setup.variants if v.key == variant_key)
    rates = [r.samples_per_s for r in runs if r.samples_per_s]
    errors = [r.error for r in runs if r.error]
    checks = [r.check for r in runs if r.check is not None]
    ok = not errors and all(c["match"] for c in checks)
    median_rate = _median(rates)
    memory = [r.memory for r in runs]
    entry: dict[str, Any] = {
        "observation": observation,
        "variant": variant.key,
        "label": variant.label,
        "collate": variant.collate,
        "transfer": variant.transfer,
        "workers": workers,
        "device": setup.device.type,
        "samples_per_s": median_rate,
        "samples_per_s_min": min(rates) if rates else None,
        "samples_per_s_max": max(rates) if rates else None,
        "samples_per_s_rel_spread": ((max(rates) - min(rates)) / median_rate)
        if rates and median_rate
        else None,
        "bytes_per_s": _median(r.bytes_per_s for r in runs),
        "wait_ms_p50": _median(r.wait_ms_p50 for r in runs),
        "wait_ms_p95": _median(r.wait_ms_p95 for r in runs),
        "h2d_ms_p50": _median(r.h2d_ms_p50 for r in runs),
        "h2d_call_ms_p50": _median(r.h2d_call_ms_p50 for r in runs),
        "startup_s": _median(r.startup_s for r in runs),
        "peak_rss_bytes": _max((m.peak_rss_main_bytes or 0) + sum(m.peak_rss_workers_bytes) for m in memory),
        "peak_rss_main_bytes": _max(m.peak_rss_main_bytes for m in memory),
        "peak_rss_workers_bytes": max((m.peak_rss_workers_bytes for m in memory), key=sum, default=[]),
        "pss_bytes": _max(m.pss_bytes for m in memory),
        "shm_bytes": _max(m.shm_bytes for m in memory),
        "shm_growth_system_bytes": _max(m.shm_growth_system_bytes for m in memory),
        "pinned_bytes": _max(m.pinned_bytes for m in memory),
        "pinned_allocations": _max(m.pinned_allocations for m in memory),
        "ids_match_reference": ok,
        **{name: max((c[name] for c in checks), default=0) for name in _PROBLEMS},
        "errors": errors,
        "ranked": ok,
        "tail_batches": tail_batches(variant, workers),
        "device_transforms_timed": setup.times_device_transforms(observation),
    }
    for unit in ("pixels", "tokens"):
        values = [r.second_unit.get(f"{unit}_per_s") for r in runs]
        if any(v is not None for v in values):
            entry[f"{unit}_per_s"] = _median(values)
    entry["runs"] = [r.to_json() for r in runs]
    return entry


_PROBLEMS = ("lost", "duplicated", "unexpected", "targets_mismatched")  # a check's counts, worst run kept


def not_different(a: dict[str, Any], b: dict[str, Any]) -> bool | None:
    """Whether two entries' runs overlap (:func:`.ratios.runs_apart`, negated): then the machine's noise
    covers the difference, and the table says so. None when either has fewer than two runs or no rate."""
    apart = runs_apart(_rates(a), _rates(b)) if a["samples_per_s"] and b["samples_per_s"] else None
    return None if apart is None else not apart


def _rates(e: dict[str, Any]) -> list[float]:
    return list(_rates_by_round(e).values())


def _rates_by_round(e: dict[str, Any]) -> dict[int, float]:
    return {r.get("round", i): r["samples_per_s"] for i, r in enumerate(e.get("runs", []))
            if r.get("samples_per_s")}


def mark_not_different(entries: list[dict[str, Any]]) -> None:
    """Sets each ranked entry's ``not_different_from_default`` (:func:`not_different` against the default
    path of the same observation and worker count) and ``ratio_to_default`` (the paired ratio, as JSON,
    with the reason the runs were too small to time, if they were: then every ratio is marked). Both None
    for the default itself, and where either side is unranked; the first also with one run."""
    too_small = {o: _too_small([e for e in entries if e["observation"] == o])
                 for o in {e["observation"] for e in entries}}  # as the observation's verdict judges it
    baselines = {(e["observation"], e["workers"]): e for e in entries if e["variant"] == "default"}
    for e in entries:
        baseline = baselines.get((e["observation"], e["workers"]))
        comparable = baseline is not None and e is not baseline and e["ranked"] and baseline["ranked"]
        e["not_different_from_default"] = not_different(e, baseline) if comparable else None
        ratio = (paired_ratio(_rates_by_round(e), _rates_by_round(baseline), too_small[e["observation"]])
                 if comparable else None)
        e["ratio_to_default"] = ratio.to_json() if ratio else None


def _too_small(entries: list[dict[str, Any]]) -> str | None:
    """Why the ranked entries' runs are too small to time (a run that timed nothing counts as 0 batches),
    or None; None too when no entry is ranked or none has a run."""
    runs = [r for e in entries if e["ranked"] for r in e.get("runs", [])]
    return too_small_to_time(r.get("measured_steps", 0) for r in runs) if runs else None


def fmt_rate(value: float | None) -> str:
    if value is None:
        return "-"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.2f}{suffix}"
    return f"{value:.0f}"


def fmt_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for scale, suffix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if value >= scale:
            return f"{value / scale:.1f} {suffix}"
    return f"{value:.0f} B"


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else (f"{value:.2f}" if value < 10 else f"{value:.1f}")


# Two tables an observation, so that each fits in 100 columns: speed, then memory (and the transfer
# columns, on a GPU only: without one they cannot apply, and one line says so).
_SPEED = ("w", "config", "samples/s", "{unit}/s", "x dflt (min-max)", "p50 ms", "p95 ms", "check")
_MEMORY = ("w", "config", "start-up s", "peak RSS main+workers", "PSS", "shm")
_TRANSFER = ("w", "config", "h2d ms", "pinned")


def format_table(setup: Setup, entries: list[dict[str, Any]]) -> str:
    """The terminal table: one block per observation, medians over runs, flagged configs marked."""
    lines = []
    titles = {
        "loader": "loader-only: samples per second that next(loader) delivers (and moves), no model",
        "integrated": f"integrated: the model ({setup.model_note}) consuming every batch",
    }
    for observation in setup.observations:
        block = [e for e in entries if e["observation"] == observation]
        if not block:
            continue
        lines.append("")
        lines.append(titles[observation] + _transforms_in_title(setup, observation))
        order = [v.key for v in VARIANTS]
        ordered = sorted(block, key=lambda e: (e["workers"], order.index(e["variant"])))
        on_gpu = setup.device.type == "cuda"
        lines += _aligned([[h.format(unit=setup.unit) for h in _SPEED]]
                          + [_speed_row(setup, e) for e in ordered])
        lines += _verdicts(block)
        lines.append("")
        lines += _aligned([list(_MEMORY)] + [_memory_row(setup, e) for e in ordered])
        if not on_gpu:
            lines.append("(no GPU: the host-to-device and pinned-memory columns do not apply, left out)")
            continue
        lines.append("")
        lines += _aligned([list(_TRANSFER)] + [_transfer_row(e) for e in ordered])
        if any(e["transfer"] == "DeviceLoader" for e in block):
            lines.append("* DeviceLoader's copy runs on its own stream, overlapping the step")
    return "\n".join(lines)


def _transforms_in_title(setup: Setup, observation: str) -> str:
    if not setup.device_transforms:
        return ""
    if setup.times_device_transforms(observation):
        return "; device transforms timed"
    return "; device transforms left out (no GPU)"


def _speed_row(setup: Setup, e: dict[str, Any]) -> list[str]:
    """One configuration's speed cells, in ``_SPEED``'s order (w: DataLoader workers; x dflt: samples/s
    over the baseline collate's (default_collate, or the factory's collate) at the same workers, the
    median of the per-round ratios and their min-max; p50, p95: next(loader)'s wait)."""
    ratio = e.get("ratio_to_default")
    shown = "-"
    if ratio:
        shown = PairedRatio.from_json(ratio).text()
        shown += "" if shown.endswith(NOT_DIFFERENT) else "  "  # the numbers stay aligned
    return [
        str(e["workers"]),
        e["label"],
        fmt_rate(e["samples_per_s"]),
        fmt_rate(e.get(f"{setup.unit}_per_s")),
        shown,
        fmt_ms(e["wait_ms_p50"]),
        fmt_ms(e["wait_ms_p95"]),
        _check_cell(e),
    ]


def _memory_row(setup: Setup, e: dict[str, Any]) -> list[str]:
    """One configuration's memory cells, in ``_MEMORY``'s order."""
    workers_rss = e["peak_rss_workers_bytes"]
    rss = fmt_bytes(e["peak_rss_main_bytes"])
    if workers_rss:
        rss += f" + {len(workers_rss)}x{fmt_bytes(max(workers_rss))}"
    cells = [
        str(e["workers"]),
        e["label"],
        "-" if e["startup_s"] is None else f"{e['startup_s']:.2f}",
        rss,
        fmt_bytes(e["pss_bytes"]),
        fmt_bytes(e["shm_bytes"]),
    ]
    return cells


def _transfer_row(e: dict[str, Any]) -> list[str]:
    """One configuration's transfer cells (a GPU's only), in ``_TRANSFER``'s order."""
    h2d = fmt_ms(e["h2d_ms_p50"])
    if e["transfer"] == "DeviceLoader":
        h2d += " *"  # the note under the table: on its own stream
    return [str(e["workers"]), e["label"], h2d, fmt_bytes(e["pinned_bytes"])]


def _check_cell(e: dict[str, Any]) -> str:
    """``ids ok``, or one word (the counts and errors go on the FLAGGED line under the table, which keeps
    every row within 100 columns)."""
    if e["ids_match_reference"]:
        return "ids ok"
    return "ERROR" if e["errors"] else "FLAGGED"


def _aligned(rows: list[list[str]]) -> list[str]:
    """The rows as text columns: the two name columns and the speed table's check left-aligned, numbers
    right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    check_last = rows[0][-1] == "check"
    lines = []
    for n, row in enumerate(rows):
        lines.append(
            "  ".join(
                c.ljust(w) if i < 2 or (check_last and i == len(row) - 1) else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def _verdicts(block: list[dict[str, Any]]) -> list[str]:
    """Why ratios are marked, the fastest correct configuration of a block, then each flagged one with
    why."""
    lines = []
    ratios = [e["ratio_to_default"] for e in block if e.get("ratio_to_default")]
    too_small = _too_small(block)
    if too_small:
        lines.append(f"{NOT_DIFFERENT} on every ratio: {too_small}")
    elif any(r["apart"] is None for r in ratios):
        lines.append(f"{NOT_DIFFERENT} where the two compared share fewer than two timed rounds: no spread, "
                     "so no difference can be told from noise")
    elif any(not r["clears_noise"] for r in ratios):
        lines.append(
            f"{NOT_DIFFERENT} after x dflt: its runs and the baseline collate's at the same workers overlap: "
            "not a real difference on this machine"
        )
    if block:
        lines.append(verdict(block))
    for e in block:
        if e["ranked"]:
            continue
        # Each distinct error once, as its exception line (a worker's traceback repeats in every run, and
        # CUDA's messages end in advice; results.json keeps them whole), or the check's nonzero counts.
        errors = dict.fromkeys(_exception_line(error) for error in e["errors"] if error.strip())
        counts = [f"{name.replace('_', ' ')} {e[name]}" for name in _PROBLEMS if e[name]]
        why = "; ".join(errors) or ", ".join(counts) or "its runs failed"
        lines.append(f"FLAGGED, not ranked: {e['label']}, {e['workers']} workers: {why}")
    return lines


def verdict(block: list[dict[str, Any]]) -> str:
    """The line that names the fastest correct configuration of one observation's entries (marked by
    :func:`mark_not_different`), or says why none can be named."""
    if not any(e["ranked"] for e in block):
        return "fastest correct: none, every configuration was flagged"
    ranked = [e for e in block if e["ranked"] and e["samples_per_s"]]
    if _too_small(block) or not ranked:
        best = f" (best median: {_name(max(ranked, key=lambda e: e['samples_per_s']))})" if ranked else ""
        return f"fastest correct: cannot tell, too small to time{best}"
    return _fastest(ranked)


def _fastest(ranked: list[dict[str, Any]]) -> str:
    """The fastest correct configuration, named only when its runs are apart from every other's.

    The verdict comes from the runs' ranges alone, never from the order of the medians: the lead is every
    configuration whose fastest run reaches the highest slowest run of any. One in the lead is named; a
    lead that is all of one worker count's configurations names the count; otherwise the lead is listed,
    or none is faster when it holds them all. A gap about the size of the noise can still land either way.
    """
    best = max(ranked, key=lambda e: e["samples_per_s"])
    if any(not_different(e, best) is None for e in ranked if e is not best):
        return f"fastest correct: cannot tell with one run each (best median: {_name(best)})"
    floor = max(e["samples_per_s_min"] for e in ranked)
    lead = [e for e in ranked if e["samples_per_s_max"] >= floor]
    if len(lead) == 1:
        return (
            f"fastest correct: {best['label']}, {_workers(best['workers'])}: "
            f"{fmt_rate(best['samples_per_s'])} samples/s (median)"
        )
    best_median = f"best median: {_name(best)}"
    if len(lead) == len(ranked):
        return (
            "fastest correct: none faster beyond noise, every configuration's runs reach the lead "
            f"({best_median})"
        )
    counts = {e["workers"] for e in lead}
    if len(counts) == 1 and len(lead) == sum(e["workers"] in counts for e in ranked):
        return (
            f"fastest correct: {_workers(lead[0]['workers'])}, with any of its {len(lead)} configurations "
            f"(their runs overlap: no difference beyond noise; {best_median})"
        )
    lead_names = ", ".join(map(_name, lead))
    return f"fastest correct: none alone beyond noise; the lead, whose runs overlap: {lead_names}"


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*")


def _exception_line(error: str) -> str:
    """The last ``SomeError: message`` line of an error's text, else its last line."""
    lines = error.strip().splitlines()
    return next((line for line in reversed(lines) if _EXCEPTION_LINE.match(line)), lines[-1])


def _workers(count: int) -> str:
    return f"{count} worker" + ("" if count == 1 else "s")


def _name(e: dict[str, Any]) -> str:
    return f"{e['label']}, {_workers(e['workers'])} ({fmt_rate(e['samples_per_s'])})"
