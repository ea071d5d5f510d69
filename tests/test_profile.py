"""``python -m fastcollate profile``: the traces carry batch_wait / h2d_transfer / compute, the timeline
is drawn (CPU here; GPU stream rows from a synthetic trace), and the output says that profiled step
times are not throughput figures."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from fastcollate.tools.bench import profile, timeline
from tests.helpers.charts import assert_legend_clear, kept_figures
from tests.helpers.processes import run_side_by_side
from tests.test_bench import assert_valid_png

pytestmark = pytest.mark.usefixtures("brief_busy_sample")  # no test here reads the machine's load

TINY = [
    "--preset",
    "fields",
    "--size",
    "512",
    "--batch-size",
    "32",
    "--steps",
    "3",
    "--warmup",
    "1",
    "--workers",
    "0",
]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    assert profile.main([*TINY, "--out", str(out)]) == 0
    return out


def _range_names(trace_path: Path) -> set[str]:
    events = json.loads(trace_path.read_text())["traceEvents"]
    return {e.get("name") for e in events if e.get("ph") == "X"}


@pytest.mark.parametrize("path", ["default", "device_loader"])
def test_each_path_writes_a_chrome_trace_with_the_three_ranges(profiled, path):
    names = _range_names(profiled / f"trace_{path}.json")
    assert {"batch_wait", "h2d_transfer", "compute"} <= names


def test_every_profiled_step_has_its_wait_and_its_compute(profiled):
    summary = json.loads((profiled / "profile.json").read_text())
    for path in ("default", "device_loader"):
        ranges = summary["paths"][path]["ranges_ms"]
        assert ranges["compute"]["count"] == 3
        assert ranges["batch_wait"]["count"] >= 3
        assert ranges["h2d_transfer"]["count"] >= 1


def test_timeline_is_a_valid_png(profiled):
    assert_valid_png(profiled / "timeline.png")


def test_output_and_json_say_profiled_step_times_are_not_throughput(tmp_path, capsys):
    assert profile.main([*TINY, "--paths", "default", "--no-model", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "not throughput figures" in out
    assert "not throughput figures" in json.loads((tmp_path / "profile.json").read_text())["note"]


KINETO_LINE = re.compile(r"^(USDT|STAGE|ERROR|WARNING|INFO):\d{4}-\d\d-\d\d ", re.MULTILINE)
REPO = Path(__file__).resolve().parents[1]


# A bare torch.profiler run, whose stderr holds kineto's own lines if this torch writes any.
BARE_PROFILER = (
    "import torch\nfrom torch.profiler import profile\n"
    "with profile(activities=[torch.profiler.ProfilerActivity.CPU]):\n    torch.ones(3) + 1\n"
)


def test_the_profilers_own_log_lines_go_to_a_file_and_the_output_names_it(tmp_path):
    # The command and a bare profiler run, each in a fresh process, side by side.
    done = run_side_by_side({
        "bare": [sys.executable, "-c", BARE_PROFILER],
        "profile": [sys.executable, "-m", "fastcollate", "profile", *TINY, "--paths", "default", "--no-model",
                    "--out", str(tmp_path)],
    }, cwd=REPO, timeout_s=600)
    bare, run = done["bare"].stderr, done["profile"]
    assert run.returncode == 0, run.stderr
    assert not KINETO_LINE.search(run.stdout + run.stderr), run.stdout + run.stderr
    assert "activities: CPU" in run.stdout
    log = tmp_path / profile.PROFILER_LOG
    if KINETO_LINE.search(bare):  # this torch writes them (2.14 on a machine without a GPU does)
        assert KINETO_LINE.search(log.read_text())
        assert "torch.profiler's own log" in run.stdout and str(log) in run.stdout


def _synthetic_gpu_trace(path: Path) -> None:
    """What a CUDA run's trace holds: CPU ranges, memcpys on a copy stream, kernels on the compute stream."""
    events = []
    for step in range(3):
        t = 1_000_000 + step * 10_000
        events += [
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": "batch_wait",
                "pid": 1,
                "tid": 5,
                "ts": t,
                "dur": 1000,
            },
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": "h2d_transfer",
                "pid": 1,
                "tid": 5,
                "ts": t + 1000,
                "dur": 200,
            },
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": "compute",
                "pid": 1,
                "tid": 5,
                "ts": t + 1200,
                "dur": 8000,
            },
            {
                "ph": "X",
                "cat": "gpu_memcpy",
                "name": "Memcpy HtoD (Pinned -> Device)",
                "pid": 0,
                "tid": 13,
                "ts": t + 1100,
                "dur": 3000,
                "args": {"stream": 13},
            },
            {
                "ph": "X",
                "cat": "kernel",
                "name": "conv",
                "pid": 0,
                "tid": 7,
                "ts": t + 1500,
                "dur": 7000,
                "args": {"stream": 7},
            },
        ]
    path.write_text(json.dumps({"traceEvents": events}))


def test_gpu_trace_is_read_as_copy_and_compute_streams_and_drawn(tmp_path):
    trace_path = tmp_path / "trace.json"
    _synthetic_gpu_trace(trace_path)
    trace = timeline.read_trace(trace_path)
    assert set(trace["gpu"]) == {"13", "7"}
    assert {kind for kind, _, _ in trace["gpu"]["13"]} == {"copy"}
    assert {kind for kind, _, _ in trace["gpu"]["7"]} == {"kernel"}
    assert trace["cpu"]["5"][0] == ("batch_wait", 0.0, 1.0)
    summary = timeline.range_summary(trace)
    assert summary["compute"]["median_ms"] == pytest.approx(8.0) and summary["compute"]["count"] == 3
    assert (
        timeline.draw_timeline([("default", trace), ("DeviceLoader", trace)], tmp_path / "t.png", "t")
        is None
    )
    assert_valid_png(tmp_path / "t.png")


def test_the_timeline_sets_its_panels_on_one_scale_under_a_title_the_legend_leaves_whole(
    tmp_path, monkeypatch
):
    trace_path = tmp_path / "trace.json"
    _synthetic_gpu_trace(trace_path)
    trace = timeline.read_trace(trace_path)  # 30 ms
    tenth = {kind: {row: [(name, start / 10, length / 10) for name, start, length in items]
                    for row, items in rows.items()} for kind, rows in trace.items()}  # 3 ms
    title = "fastcollate profile: fashion, batch 256, " + "a title as long as one that names both paths, " * 3
    with kept_figures(monkeypatch) as figures:
        panels = [("default", trace), ("assemble + DeviceLoader", tenth)]
        assert timeline.draw_timeline(panels, tmp_path / "t.png", title) is None
        [figure] = figures
        assert_legend_clear(figure)
        [scale] = {ax.get_xlim() for ax in figure.axes}  # one scale for both
        assert scale[1] > 29, "the longer path's 30 ms sets it"


# --- a data set too small for --warmup + --steps: the title, the JSON and the panels say what ran ---

SMALL = ["--preset", "fields", "--size", "512", "--batch-size", "256", "--steps", "5", "--workers", "0",
         "--no-model"]  # 512 samples at batch 256: 2 batches for 1 or 2 warm-up + 5 profiled steps


def test_title_and_json_give_the_steps_profiled_and_why_fewer_than_asked(tmp_path, capsys):
    assert profile.main([*SMALL, "--warmup", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "profile.json").read_text())
    assert record["config"]["profiled_steps_asked"] == 5
    for path in ("default", "device_loader"):
        ran = record["paths"][path]
        assert (ran["warmup_steps"], ran["profiled_steps"]) == (1, 1)
        assert ran["ranges_ms"]["compute"]["count"] == 1  # the JSON's count is the trace's
        assert "512 samples at batch 256 make 2 batches, 1 used by --warmup 1" in ran["fewer_because"]
    title = record["timeline_title"]  # the chart's title as drawn
    assert "1 profiled step (5 asked: the data set ran out)" in title and "5 profiled steps" not in title
    assert "make 2 batches" in " ".join(out.split())  # said on the terminal too (wrapped to its width)


def test_a_path_with_no_profiled_step_says_why_in_its_panel(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    written: list[str] = []
    text = Axes.text
    def recorded(self, x, y, s, *args, **kwargs):
        written.append(s)
        return text(self, x, y, s, *args, **kwargs)

    monkeypatch.setattr(Axes, "text", recorded)
    assert profile.main([*SMALL, "--warmup", "2", "--paths", "device_loader", "--out", str(tmp_path)]) == 0
    ran = json.loads((tmp_path / "profile.json").read_text())["paths"]["device_loader"]
    assert ran["profiled_steps"] == 0
    assert ran["fewer_because"] in written  # the empty panel carries the reason, not a blank
    assert_valid_png(tmp_path / "timeline.png")
    assert "nothing to show (why: below)" in timeline.panel_title("assemble + DeviceLoader", {}, 0, "x")


@pytest.mark.parametrize("option", ["--preset", "--batch-size", "--model-width", "--seed"])
def test_options_have_help_naming_their_default(option):
    action = next(a for a in profile.build_parser()._actions if option in a.option_strings)
    assert action.help and "default" in action.help
    if option == "--preset":
        assert "default: fashion" in action.help
