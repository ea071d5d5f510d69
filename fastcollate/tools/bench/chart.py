"""The bench's chart: samples/s by worker count for each configuration, and the next(loader) wait.
matplotlib is imported when a chart is drawn, not before (it is an optional dependency)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from .configs import Setup, Variant

__all__ = ["write_chart"]

COLORS = {"default": "tab:gray", "assemble": "tab:blue", "device_loader": "tab:green"}
TITLE_CHARACTERS = 120  # a line of the title: short of the legend at the figure's right


def write_chart(setup: Setup, entries: list[dict[str, Any]], path: Path) -> str | None:
    """Throughput by workers per configuration, and next(loader) wait; returns why not, if not. One
    legend for every panel (a configuration has its colour in each), beside them, over no point."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        return "matplotlib is not installed: no chart (pip install matplotlib)"
    observations = [o for o in setup.observations if any(e["observation"] == o for e in entries)]
    fig, axes = plt.subplots(
        len(observations), 2, figsize=(14, 4.2 * len(observations)), squeeze=False, layout="constrained"
    )
    for row, observation in enumerate(observations):
        ax_rate, ax_wait = axes[row]
        for variant in setup.variants:
            block = sorted(
                (e for e in entries if e["observation"] == observation and e["variant"] == variant.key),
                key=lambda e: e["workers"],
            )
            if block:
                _plot_variant(ax_rate, ax_wait, variant, block)
        _label_axes(ax_rate, ax_wait, observation, setup.workers)
    title = (
        f"fastcollate bench: {setup.name}, batch {setup.batch_size}, {setup.steps} steps x "
        f"{setup.repeat} runs, {setup.warmup} warm-up excluded, device {setup.device.type}"
        + _transforms_left_out(setup)
    )
    fig.suptitle("\n".join(textwrap.wrap(title, TITLE_CHARACTERS)), fontsize=10, x=0.01, ha="left")
    drawn = [v for v in setup.variants if any(e["variant"] == v.key for e in entries)]
    legend = [Line2D([], [], color=COLORS.get(v.key), marker="o", label=v.label) for v in drawn]
    legend += [
        Line2D([], [], color="black", marker="o", label="wait p50"),
        Line2D([], [], color="black", marker="^", linestyle="--", label="wait p95"),
    ]
    fig.legend(handles=legend, loc="outside right upper", fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _transforms_left_out(setup: Setup) -> str:
    """The observations the device transforms are not timed in, as the table's titles say."""
    left_out = [o for o in setup.observations if not setup.times_device_transforms(o)]
    if not setup.device_transforms or not left_out:
        return ""
    return f"; device transforms left out of: {', '.join(left_out)} (no GPU)"


def _plot_variant(ax_rate: Any, ax_wait: Any, variant: Variant, block: list[dict[str, Any]]) -> None:
    """One variant's line on both axes: median samples/s with min-max bars (flagged points crossed),
    and its p50 / p95 waits."""
    color = COLORS.get(variant.key)
    xs = [e["workers"] for e in block]
    ys = [e["samples_per_s"] or 0 for e in block]
    lo = [max(0.0, y - (e["samples_per_s_min"] or y)) for y, e in zip(ys, block, strict=True)]
    hi = [max(0.0, (e["samples_per_s_max"] or y) - y) for y, e in zip(ys, block, strict=True)]
    ax_rate.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=variant.label, color=color)
    for x, y, e in zip(xs, ys, block, strict=True):
        if not e["ranked"]:
            ax_rate.annotate("FLAGGED", (x, y), color="red", fontsize=8, ha="center", va="bottom")
            ax_rate.plot([x], [y], marker="x", color="red", markersize=10)
    p50 = [e["wait_ms_p50"] or 0 for e in block]
    p95 = [e["wait_ms_p95"] or 0 for e in block]
    ax_wait.plot(xs, p50, marker="o", color=color, label=f"{variant.label} p50")
    ax_wait.plot(xs, p95, marker="^", linestyle="--", color=color, label=f"{variant.label} p95")


def _label_axes(ax_rate: Any, ax_wait: Any, observation: str, workers: list[int]) -> None:
    for ax, title, unit in (
        (ax_rate, "samples/s (median, bars: min-max over runs)", "samples/s"),
        (ax_wait, "next(loader) wait, ms (median of per-run p50 / p95)", "ms"),
    ):
        ax.set_title(f"{observation}: {title}", fontsize=10)
        ax.set_xlabel("DataLoader workers")
        ax.set_ylabel(unit)
        ax.set_xticks(workers)
        ax.set_ylim(bottom=0)
