"""Reading back the Chrome trace ``python -m fastcollate profile`` exports, and drawing it: where each
profiled step's time went (``batch_wait``, ``h2d_transfer``, ``compute``), and on a GPU the copy and
compute streams, one panel per path on one time axis."""

from __future__ import annotations

import json
import statistics
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["RANGES", "draw_timeline", "panel_title", "range_summary", "read_trace"]

RANGES = ("batch_wait", "h2d_transfer", "compute")
NOT_THROUGHPUT = (
    "profiled step times include the profiler's overhead: they show where time goes, they are "
    "not throughput figures (python -m fastcollate bench measures those, profiler off)"
)
COLORS = {
    "batch_wait": "tab:blue",
    "h2d_transfer": "tab:orange",
    "compute": "tab:green",
    "copy": "tab:orange",
    "kernel": "tab:green",
}
TITLE_CHARACTERS = 140  # a line of the timeline's title: the figure's width at its font size, less the legend


def read_trace(path: Path) -> dict[str, Any]:
    """The ranges and GPU activity of an exported trace, in ms from the first range's start.

    Returns ``{"cpu": {tid: [(name, start_ms, dur_ms)]}, "gpu": {stream: [(kind, start_ms, dur_ms)]}}``
    where ``kind`` is ``"copy"`` (memcpy) or ``"kernel"``.
    """
    events = json.loads(Path(path).read_text()).get("traceEvents", [])
    ranges = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("name") in RANGES
        and e.get("cat") in ("user_annotation", "cpu_op", "python_function")
    ]
    t0 = min((float(e["ts"]) for e in ranges), default=0.0)
    cpu: dict[str, list[tuple[str, float, float]]] = {}
    for e in ranges:
        cpu.setdefault(str(e.get("tid")), []).append(
            (e["name"], (float(e["ts"]) - t0) / 1e3, float(e.get("dur", 0)) / 1e3)
        )
    gpu: dict[str, list[tuple[str, float, float]]] = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            stream = str((e.get("args") or {}).get("stream", e.get("tid")))
            kind = "copy" if cat == "gpu_memcpy" else "kernel"
            gpu.setdefault(stream, []).append(
                (kind, (float(e["ts"]) - t0) / 1e3, float(e.get("dur", 0)) / 1e3)
            )
    for rows in (cpu, gpu):
        for key in rows:
            rows[key].sort(key=lambda r: r[1])
    return {"cpu": cpu, "gpu": gpu}


def range_summary(trace: dict[str, Any]) -> dict[str, Any]:
    """Per range: count, median and 95th percentile of its duration, in ms (profiled)."""
    out: dict[str, Any] = {}
    for name in RANGES:
        durations = sorted(d for rows in trace["cpu"].values() for n, _, d in rows if n == name)
        if durations:
            out[name] = {
                "count": len(durations),
                "median_ms": statistics.median(durations),
                "p95_ms": durations[min(len(durations) - 1, int(round(0.95 * (len(durations) - 1))))],
            }
    return out


def panel_title(
    label: str, trace: dict[str, Any], profiled: int | None = None, why: str | None = None
) -> str:
    """A panel's title: the path, its profiled steps and their median ranges; and why it has fewer steps
    than asked, or none (an empty panel says why it is empty rather than leaving the reader to guess)."""
    head = label if profiled is None else f"{label}, {count_of(profiled, 'profiled step')}"
    if profiled == 0:
        return f"{head}: nothing to show" + (" (why: below)" if why else "")
    summary = range_summary(trace)
    parts = [f"{n} {summary[n]['median_ms']:.2f} ms" for n in RANGES if n in summary]
    text = f"{head}: median per step (profiled): " + ", ".join(parts)
    return f"{text}\n({why})" if why else text


def count_of(n: int, noun: str, plural: str | None = None) -> str:
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def draw_timeline(
    panels: list[tuple[str, dict[str, Any]]],
    path: Path,
    title: str,
    steps: Sequence[tuple[int | None, str | None]] | None = None,
) -> str | None:
    """One panel per path: the main thread's ranges, then each GPU stream's copies and kernels. The
    panels share one time axis, as they are there to be set side by side; the legend sits between the
    title and the panels, over no bar.

    ``steps``: per panel, its profiled steps and why they are fewer than asked (None: all ran).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return "matplotlib is not installed: no timeline (pip install matplotlib)"
    heights = [max(1, len(t["cpu"]) + len(t["gpu"])) for _, t in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(13, 1.6 + sum(0.8 * h + 0.9 for h in heights)),
        squeeze=False,
        sharex=True,
        layout="constrained",
        gridspec_kw={"height_ratios": [h + 1 for h in heights]},
    )
    steps = list(steps) if steps is not None else [(None, None)] * len(panels)
    for ax, (label, trace), (profiled, why) in zip(axes[:, 0], panels, steps, strict=True):
        if profiled == 0:
            # The trace then holds only the wait that found the epoch over, no step: the panel says
            # why it is empty instead.
            trace = {"cpu": {}, "gpu": {}}
        rows: list[tuple[str, list[tuple[str, float, float]]]] = []
        for tid, ranges in sorted(trace["cpu"].items(), key=lambda kv: -len(kv[1])):
            rows.append((f"CPU thread {tid}", ranges))
        for stream, items in sorted(trace["gpu"].items()):
            copies = sum(d for k, _, d in items if k == "copy")
            kernels = sum(d for k, _, d in items if k == "kernel")
            role = "copy" if copies > kernels else "compute"
            rows.append((f"GPU stream {stream} ({role})", items))
        for y, (_, items) in enumerate(rows):
            for name, start, dur in items:
                ax.broken_barh(
                    [(start, max(dur, 1e-3))],
                    (y - 0.35, 0.7),
                    facecolors=COLORS.get(name, "gray"),
                    edgecolor="black" if name in RANGES else "none",
                    linewidth=0.3,
                )
        waits = [s for rows_ in trace["cpu"].values() for n, s, _ in rows_ if n == "batch_wait"]
        for start in waits:  # each step starts with its wait
            ax.axvline(start, color="black", linewidth=0.3, alpha=0.4)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([r[0] for r in rows], fontsize=8)
        ax.set_ylim(-0.8, len(rows) - 0.2)
        ax.invert_yaxis()
        ax.set_title(panel_title(label, trace, profiled, why), fontsize=9)
        if profiled == 0 and why:
            ax.text(0.5, 0.5, why, transform=ax.transAxes, ha="center", va="center", fontsize=9, wrap=True)
        ax.tick_params(axis="x", labelbottom=True)  # every panel keeps its ticks; the scale is one
    axes[-1, 0].set_xlabel("ms since each path's first profiled step, one scale for every panel", fontsize=8)
    legend = [Patch(facecolor=COLORS[n], edgecolor="black", linewidth=0.3, label=n) for n in RANGES]
    if any(trace["gpu"] for _, trace in panels):
        legend += [
            Patch(color=COLORS["copy"], label="GPU memcpy"),
            Patch(color=COLORS["kernel"], label="GPU kernel"),
        ]
    fig.suptitle("\n".join(textwrap.wrap(title, TITLE_CHARACTERS)), fontsize=9, x=0.01, ha="left")
    fig.legend(handles=legend, loc="outside right upper", fontsize=8)
    fig.supxlabel(f"Note: {NOT_THROUGHPUT}.", fontsize=8, x=0.01, ha="left", color="darkred")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
