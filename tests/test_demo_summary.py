"""The summary ``make demo`` ends with: lines of 100 columns at most, each part's verdict as its own run
wrote it (ratios keep their ~), every output folder named, and a part that wrote nothing named missing; the
Hugging Face part at each worker count it ran, with the rows it ran and the full run's where fewer."""

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


def _folders(tmp_path: Path, monkeypatch, arrays_case: str = "tabular") -> list[Path]:
    """The four parts' folders, named relative to the working folder as make demo names them."""
    monkeypatch.chdir(tmp_path)
    clear = {"clears_noise": True}
    on = "assemble, slots on at workers"
    return [
        _write(Path("bench-out-workers"), {"results": [{"ratios": {
            f"{on}=1 / default_collate at workers=1": {**clear, "median": 6.07},
            f"{on}=2 / default_collate at workers=2": {**clear, "median": 5.114},
            f"{on}=2 / assemble, slots off at workers=2": {**clear, "median": 4.62},
            f"{on}=2 / assemble, slots on at workers=0": {"median": 1.43, "clears_noise": False}}}]}),
        _write(Path("bench-out-loader"), {"configs": [
            {"observation": o, "variant": v, "workers": w, "ratio_to_default": None if v == "default" else
             {"median": 1.3 if v == "device_loader" else 1.02 + w / 100, "clears_noise": v != "assemble"}}
            for o in ("loader", "integrated") for v in ("default", "assemble", "device_loader")
            for w in (0, 2)
        ]}),
        _write(Path("bench-out-arrays"), {"cases": {
            arrays_case: {"ratios": {"Arrays + assemble, sampler lists / batched-index idiom":
                                   {**clear, "ratio": 12.34}, "x / y": {**clear, "ratio": 1.0}}},
            "tokens": {"ratios": {"TokenWindows + assemble / nanoGPT get_batch":
                                  {"ratio": 1.04, "clears_noise": False}}}}}),
        _write(Path("bench-out-hf"), {"cases": {
            "packed": {"rows": 20_000, "full_rows": 200_000, "groups": [
                {"workers": 0, "batch_size": 16, "Arrays": {**clear, "ratio": 10.23}},
                {"workers": 2, "batch_size": 16, "Arrays": {**clear, "ratio": 10.04}},
                {"workers": 0, "batch_size": 64, "Arrays": {**clear, "ratio": 28.6}},
                {"workers": 2, "batch_size": 64, "Arrays": {**clear, "ratio": 12.1}}]},
            "tabular": {"rows": 50_000, "full_rows": 500_000, "groups": [
                {"workers": 0, "batch_size": 256, "Arrays": {**clear, "ratio": 29.2}},
                {"workers": 2, "batch_size": 256, "Arrays": {**clear, "ratio": 21.0}},
                {"workers": 0, "batch_size": 4096, "Arrays": {"ratio": 1.2, "clears_noise": False}},
                {"workers": 2, "batch_size": 4096, "HF": {}}]}}}),
    ]


HF_FULL_RUN = "    the README's table ran packed 200,000, tabular 500,000: python -m benchmarks.hf_ratios"


def test_each_parts_result_as_written_with_its_marks_in_lines_of_100(tmp_path, monkeypatch):
    folders = _folders(tmp_path, monkeypatch)
    lines = demo_summary.summary(folders)
    assert all(len(line) <= 100 for line in lines), lines
    assert lines[0] == ("summary (~: within noise) of bench-out-workers/ bench-out-loader/ bench-out-arrays/ "
                        "bench-out-hf/")
    # the part's point at its most workers, not the overall fastest cell (on 2 cores a tie with workers=0)
    assert lines[1] == ("  workers, pre-decoded images: slots on at 2 workers: 5.11x default_collate, "
                        "4.62x slots off")
    # the collate swapped alone, loader only: what a PIL-bound loader is there to show
    assert lines[2] == ("  bench, PIL-bound images: assemble over default_collate 1.02x ~ at 0 workers, "
                        "1.04x ~ at 2 workers")
    assert lines[3] == ("  arrays: gathered by index over tabular 12.3x batched-index idiom; tokens 1.0x ~ "
                        "nanoGPT get_batch")
    assert lines[4:] == [
        "  Hugging Face: Arrays.from_hf over HF's path, min-max over the batch sizes",
        "    at 0 workers: packed 10.2-28.6x, tabular 1.2-29.2x ~",
        "    at 2 workers: packed 10.0-12.1x, tabular 21.0x",  # a batch size with no Arrays cell is left out
        "    rows: packed 20,000, tabular 50,000",
        HF_FULL_RUN,
    ]


def test_a_hugging_face_run_at_full_size_names_no_other_run(tmp_path, monkeypatch):
    folders = _folders(tmp_path, monkeypatch)
    report = json.loads((folders[3] / "results.json").read_text())
    for result in report["cases"].values():
        result["rows"] = result["full_rows"]
    (folders[3] / "results.json").write_text(json.dumps(report))
    lines = demo_summary.summary(folders)
    assert lines[-1] == "    rows: packed 200,000, tabular 500,000" and HF_FULL_RUN not in lines


def test_a_worker_count_or_a_run_with_no_from_hf_result_says_so(tmp_path, monkeypatch):
    folders = _folders(tmp_path, monkeypatch)
    report = json.loads((folders[3] / "results.json").read_text())
    for result in report["cases"].values():  # the Arrays path failed at 2 workers: HF's cells only
        result["groups"] = [g if g["workers"] == 0 else {"workers": 2, "HF": {}} for g in result["groups"]]
    (folders[3] / "results.json").write_text(json.dumps(report))
    assert demo_summary.summary(folders)[6] == "    at 2 workers: no Arrays result"
    (folders[3] / "results.json").write_text(json.dumps({"cases": {}}))
    assert demo_summary.summary(folders)[4:] == ["  Hugging Face: no case ran"]


def test_a_long_verdict_is_cut_to_the_width_and_a_missing_part_is_named(tmp_path, monkeypatch):
    folders = _folders(tmp_path, monkeypatch, arrays_case="a case named at length " * 4)
    folders[3] = Path("never-written")
    lines = demo_summary.summary(folders)
    assert len(lines[3]) == 100 and lines[3].endswith("...") and "nanoGPT" not in lines[3]
    assert lines[4].startswith("  Hugging Face: no result (FileNotFoundError") and len(lines[4]) <= 100
    assert len(lines) == 5


def test_a_part_whose_json_is_odd_or_empty_is_named_not_a_traceback(tmp_path, monkeypatch):
    folders = _folders(tmp_path, monkeypatch)
    (folders[0] / "results.json").write_text(json.dumps({"results": [{"ratios": {}}]}))  # workers=0 only
    (folders[1] / "results.json").write_text("null")
    (folders[2] / "results.json").write_text(json.dumps({"cases": {}}))
    (folders[3] / "results.json").write_text("[1, 2]")
    lines = demo_summary.summary(folders)
    assert lines[1] == "  workers, pre-decoded images: no slots-on pair: the run had no workers"
    assert lines[2].startswith("  bench, PIL-bound images: no result (TypeError")
    assert lines[3] == "  arrays: no case ran"
    assert lines[4].startswith("  Hugging Face: no result (TypeError") and len(lines) == 5
