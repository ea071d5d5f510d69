"""The summary ``make demo`` ends with: at most 5 lines of 100 columns, each part's verdict as its own run
wrote it (ratios keep their ~), every output folder named, and a part that wrote nothing named missing."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "demo_summary.py"
_spec = importlib.util.spec_from_file_location("demo_summary", SCRIPT)
demo_summary = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = demo_summary
_spec.loader.exec_module(demo_summary)


def _write(folder: Path, report: dict) -> Path:
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(report))
    return folder


def _folders(tmp_path: Path, monkeypatch, workers_verdict: str) -> list[Path]:
    """The four parts' folders, named relative to the working folder as make demo names them."""
    monkeypatch.chdir(tmp_path)
    ratio = {"clears_noise": True}
    return [
        _write(Path("bench-out-workers"), {"results": [{"verdict": workers_verdict}]}),
        _write(Path("bench-out-loader"), {"verdicts": {
            "loader": "fastest correct: none faster beyond noise, every configuration's runs reach the lead "
                      "(best median: assemble + pinned copy, 0 workers (3.2k))",
            "integrated": "fastest correct: cannot tell"}}),
        _write(Path("bench-out-arrays"), {"cases": {
            "tabular": {"ratios": {"Arrays + assemble, sampler lists / batched-index idiom":
                                   {**ratio, "ratio": 12.34}, "x / y": {**ratio, "ratio": 1.0}}},
            "tokens": {"ratios": {"TokenWindows + assemble / nanoGPT get_batch":
                                  {"ratio": 1.04, "clears_noise": False}}}}}),
        _write(Path("bench-out-hf"), {"cases": {
            "packed": {"groups": [{"workers": 0, "batch_size": 16, "Arrays": {**ratio, "ratio": 10.23}},
                                  {"workers": 2, "batch_size": 16, "Arrays": {**ratio, "ratio": 13.9}}]},
            "tabular": {"groups": [{"workers": 0, "batch_size": 256, "Arrays": {**ratio, "ratio": 29.2}},
                                   {"workers": 0, "batch_size": 4096, "HF": {}}]}}}),
    ]


def test_each_parts_verdict_as_written_with_its_marks_in_5_lines_of_100(tmp_path, monkeypatch):
    folders = _folders(tmp_path, monkeypatch,
                       "fastest: assemble, slots on at workers=2, 3.12x default_collate there "
                       "(480 samples/s; its runs apart from every other cell's over 5 rounds)")
    lines = demo_summary.summary(folders)
    assert len(lines) == 5 and all(len(line) <= 100 for line in lines), lines
    assert all(f"{folder}/" in lines[0] for folder in folders)
    assert lines[1] == ("  workers, pre-decoded images: assemble, slots on at workers=2, 3.12x "
                        "default_collate there")
    assert lines[2] == ("  bench, PIL-bound images: none faster beyond noise, every configuration's runs "
                        "reach the lead")
    assert lines[3] == ("  arrays: gathered by index over tabular 12.3x batched-index idiom; tokens 1.0x ~ "
                        "nanoGPT get_batch")
    assert lines[4] == "  Hugging Face: from_hf over HF's path: packed 10.2x at 16; tabular 29.2x at 256"


def test_a_long_verdict_is_cut_to_the_width_and_a_missing_part_is_named(tmp_path, monkeypatch):
    folders = _folders(tmp_path, monkeypatch, "fastest: " + "a lead named at length " * 8 + "(details)")
    folders[3] = Path("never-written")
    lines = demo_summary.summary(folders)
    assert len(lines[1]) == 100 and lines[1].endswith("...") and "details" not in lines[1]
    assert lines[4].startswith("  Hugging Face: no result (FileNotFoundError") and len(lines[4]) <= 100
