"""What a chart's reader meets first, checked on the figure as drawn: a legend over no panel and no title.

The chart functions close their figure once saved; ``kept_figures`` keeps it open instead, for the test
to measure, and closes it at the end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.figure import Figure  # noqa: E402


@contextlib.contextmanager
def kept_figures(monkeypatch) -> Iterator[list[Figure]]:
    """The figures the code under test closes, kept open while the block runs."""
    close = plt.close
    kept: list[Figure] = []
    monkeypatch.setattr(plt, "close", kept.append)
    try:
        yield kept
    finally:
        for figure in kept:
            close(figure)


def assert_legend_clear(figure: Figure) -> None:
    """``figure`` has a legend, and none overlaps a panel (its axes), a panel's title, the figure's title."""
    renderer = figure.canvas.get_renderer()
    legends = list(figure.legends) + [ax.get_legend() for ax in figure.axes if ax.get_legend() is not None]
    assert legends, "no legend"
    covered = {f"panel {n}": ax.get_window_extent(renderer) for n, ax in enumerate(figure.axes)}
    covered |= {f"title of panel {n}": ax.title.get_window_extent(renderer)
                for n, ax in enumerate(figure.axes) if ax.get_title()}
    title = figure._suptitle  # the Text itself: get_suptitle() gives only its string
    if title is not None:
        covered["the figure's title"] = title.get_window_extent(renderer)
    for legend in legends:
        box = legend.get_window_extent(renderer)
        over = [name for name, other in covered.items() if box.overlaps(other)]
        assert not over, f"the legend covers {', '.join(over)}"
