"""benchmarks/hf_ratios.py: its smallest configuration runs in-process and writes every part of its
report; a path whose batch is not HF's stops the run (its ratio would compare unequal work), and a path
that raises is reported as failed while the others still run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("datasets", reason="datasets is not installed")
pytest.importorskip("transformers", reason="transformers is not installed")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "hf_ratios.py"
_spec = importlib.util.spec_from_file_location("hf_ratios", SCRIPT)
hf_ratios = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = hf_ratios  # its dataclasses look their module up there
_spec.loader.exec_module(hf_ratios)

from benchmarks.shared import hf_paths  # noqa: E402  (after datasets is known to be there)


def test_the_smallest_configuration_reports_every_path_of_both_cases(tmp_path):
    out = tmp_path / "hf.json"
    code = hf_ratios.main(["--rows", "600", "--batch-sizes", "8", "--workers", "0", "--rounds", "1",
                           "--batches", "2", "--data-dir", str(tmp_path / "data"), "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    header = {"date", "command", "torch", "machine", "malloc", "versions", "start_method", "fastcollate_path"}
    assert header <= set(report)
    assert report["malloc"].startswith("mmap threshold 64 MiB")
    assert report["versions"]["datasets"] and report["versions"]["pyarrow"]
    for name in ("tokens", "tabular"):
        described = report["datasets"][name]
        assert described["rows"] == 600 and len(described["files"]) == hf_paths.SHARDS
        assert described["record_batches"] >= hf_paths.SHARDS  # one at least per file: mapped, not merged
    for case, full_rows in (("packed", 200_000), ("tabular", 500_000)):
        assert (report["cases"][case]["rows"], report["cases"][case]["full_rows"]) == (600, full_rows)
        cost = report["cases"][case]["from_hf"]
        assert cost["rows"] == 600 and cost["pyarrow_allocated_bytes"] == 0  # the values are not copied
        assert 0 < cost["build_seconds"] and 0 < cost["pickled_bytes"] < 64 << 10 and cost["column_bytes"] > 0
        (group,) = report["cases"][case]["groups"]
        assert (group["batch_size"], group["workers"], group["batches_per_round"]) == (8, 0, 2)
        assert 0 < group["HF"]["min"] <= group["HF"]["median"] <= group["HF"]["max"]
        assert group["failures"] == {}, "every path ran"
        for name in ("swapped", "Arrays"):
            assert group[name]["ratio_min"] <= group[name]["ratio"] <= group[name]["ratio_max"]
            assert group[name]["too_small"].startswith("too small to time: 2 timed batches")
            assert group[name]["clears_noise"] is False, "2 batches a round tell nothing"
        timed = set(hf_ratios.PATHS)
        # Every round of every path that ran, the warm-up (round 0) included.
        assert {(r["path"], r["round"]) for r in group["runs"]} == {(n, k) for n in timed for k in (0, 1)}
        assert all(r["units"] > 0 and r["batches"] == 2 for r in group["runs"])
        assert group["rounds_of_unequal_work"] == []  # the same seeded shuffle: the same batches


def test_the_many_files_case_reports_its_batches_and_its_rows_read_one_by_one(tmp_path):
    out = tmp_path / "hf.json"
    code = hf_ratios.main(["--cases", "many_files", "--files", "30", "--rows", "600", "--batch-sizes", "8",
                           "--workers", "0", "--rounds", "1", "--batches", "2", "--data-dir",
                           str(tmp_path / "data"), "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert list(report["datasets"]) == ["tokens, 30 files"]
    assert len(report["datasets"]["tokens, 30 files"]["files"]) == 30
    case = report["cases"]["many_files"]
    assert case["from_hf"]["chunks"] == 30, "a record batch a file"
    (group,) = case["groups"]
    assert group["failures"] == {} and {"HF", "swapped", "Arrays"} <= set(group)
    reads = case["row_reads"]
    assert reads["failures"] == {} and reads["rows_per_round"] == hf_ratios.CASES["many_files"].row_reads
    assert reads["Arrays"]["ratio_min"] <= reads["Arrays"]["ratio"] <= reads["Arrays"]["ratio_max"]
    rounds = {(n, k) for n in ("HF", "Arrays") for k in (0, 1)}  # the warm-up (round 0) included
    assert {(r["path"], r["round"]) for r in reads["runs"]} == rounds


def test_the_many_files_case_runs_only_when_named():
    assert hf_ratios.parse([]).cases == hf_ratios.parse(["--quick"]).cases == ["packed", "tabular"]
    assert hf_ratios.parse(["--quick", "--cases", "many_files"]).cases == ["many_files"]


def test_a_batch_unlike_hf_names_each_difference():
    reference = {"input_ids": torch.arange(6)[None], "cu_seq_lens_q": torch.tensor([0, 6], dtype=torch.int32),
                 "max_length_q": 6}
    hf_paths.check_same_batch("same", reference, {k: v for k, v in reference.items()})
    wrong = dict(reference, input_ids=torch.tensor([[0, 1, 99, 3, 4, 5]]))
    with pytest.raises(hf_paths.BatchMismatch, match=r"input_ids: differs first at \[0, 2\]"):
        hf_paths.check_same_batch("wrong", reference, wrong)
    wider = dict(reference, cu_seq_lens_q=reference["cu_seq_lens_q"].long())
    with pytest.raises(hf_paths.BatchMismatch, match="cu_seq_lens_q: torch.int64"):
        hf_paths.check_same_batch("wider", reference, wider)
    as_tensor = dict(reference, max_length_q=torch.tensor(6))
    with pytest.raises(hf_paths.BatchMismatch, match=r"max_length_q: tensor\(6\) \(Tensor\), not 6 \(int\)"):
        hf_paths.check_same_batch("as a tensor", reference, as_tensor)
    with pytest.raises(hf_paths.BatchMismatch, match=r"missing \['max_length_q'\], extra \['id'\]"):
        hf_paths.check_same_batch("keys", reference, {"id": 0, "input_ids": reference["input_ids"],
                                                       "cu_seq_lens_q": reference["cu_seq_lens_q"]})


def test_a_path_that_makes_another_batch_stops_the_run_and_one_that_raises_is_reported_failed():
    ds = hf_paths.build_dataset("tokens", 40, seed=0)
    paths = hf_paths.make_paths("packed", ds)
    paths["swapped"] = hf_paths.Contender(failed="failed: left out, this test feeds the Arrays path")
    arrays = paths["Arrays"]
    right = arrays.make_collate()

    def off_by_one(samples):
        batch = right(samples)
        batch["labels"][0, 1] += 1
        return batch

    def raising(samples):
        raise RuntimeError("no such contract option")

    arrays.make_collate = lambda: off_by_one
    with pytest.raises(hf_paths.BatchMismatch, match=r"Arrays: .*\n  labels: differs first at \[0, 1\]"):
        hf_paths.check_paths(paths, [3, 1, 4, 1, 5])
    arrays.make_collate = lambda: raising
    hf_paths.check_paths(paths, [3, 1, 4, 1, 5])
    assert arrays.failed == "failed: RuntimeError: no such contract option"
    arrays.failed, arrays.make_collate = None, lambda: right
    hf_paths.check_paths(paths, [3, 1, 4, 1, 5])  # the right collate passes
