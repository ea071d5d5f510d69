"""``python -m fastcollate doctor``: the checklist names the failing sample and stage, catches lost,
duplicated and changed data between settings, makes a stuck worker visible, and passes clean datasets."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from collections import UserDict, namedtuple

import numpy as np
import pytest
import torch

from fastcollate.tools.audit import doctor
from fastcollate.tools.audit.epoch import Epoch
from fastcollate.tools.audit.record_sheet import speed_against
from fastcollate.tools.audit.setting_run import batch_signature, copy_to_device

DATASETS = "tests.helpers.audit_datasets"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(capsys, tmp_path, factory: str, *options: str) -> tuple[int, str, dict]:
    path = tmp_path / "report.json"
    status = doctor.main([f"{DATASETS}:{factory}", "--batch-size", "4", "--json", str(path), *options])
    out = capsys.readouterr().out
    return status, out, json.loads(path.read_text())


def row(report: dict, setting: str) -> dict:
    return next(r for r in report["table"] if r["setting"] == setting)


# --- clean datasets pass ---------------------------------------------------------------------------


def test_a_clean_dataset_passes_every_step(capsys, tmp_path):
    status, out, report = run(capsys, tmp_path, "clean")
    assert status == 0 and report["ok"] and report["exit_status"] == 0
    assert report["ids"] == "dataset indices (with_ids)"  # its samples carry no id
    assert report["targets"] == ["y"]
    assert [r["setting"] for r in report["table"]] == [
        "samples one by one",
        "workers=0, shuffle=False, batch 4",
        "transfer (reference batches)",
        "workers=2",
        "workers=2, second epoch",
    ]
    assert all(r["ok"] in (True, None) for r in report["table"])
    assert row(report, "workers=2")["conclusion"].startswith("same data")
    epochs = report["steps"][-1]["epochs"]
    assert [e["samples"] for e in epochs] == [12, 12]
    assert all(e["first_batch_seconds"] is not None for e in epochs)  # start-up shown apart
    for step in (
        "1. Representative",
        "2. Reference",
        "3. workers=2",
        "4. Same setting, second epoch",
        "5. Record sheet",
    ):
        assert step in out
    assert "Verdict: OK" in out


@pytest.mark.parametrize(
    "factory, last_step",
    [("one_channel_fourth", "2. Reference"), ("fails_in_workers", "3. workers=2")],
)
def test_after_a_failure_the_record_sheet_is_numbered_next_to_the_last_step_run(
    capsys, tmp_path, factory, last_step
):
    status, out, _ = run(capsys, tmp_path, factory)
    assert status == 1
    headings = re.findall(r"^(\d+)\. (.*)$", out, re.MULTILINE)
    assert [int(n) for n, _ in headings] == list(range(1, len(headings) + 1))  # no jump from 2 to 5
    assert f"{headings[-2][0]}. {headings[-2][1]}".startswith(last_step)
    assert headings[-1][1] == "Record sheet"


def test_more_workers_than_cpus_is_said_once_in_step_3_not_as_torchs_warnings(capsys, tmp_path):
    from fastcollate.tools.audit.setting_run import _cpus

    workers = _cpus() + 1  # as --workers 4 on 2 CPUs: torch warns at the DataLoader and each epoch
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        status, out, report = run(capsys, tmp_path, "clean", "--workers", str(workers))
    assert status == 0
    assert not [w for w in shown if "excessive worker creation" in str(w.message)]
    note = f"{workers} workers for {_cpus()} usable CPUs"
    assert out.count(note) == 1
    step3 = out.split("\n3. ")[1].split("\n4. ")[0]
    assert note in step3  # with the setting that starts the workers
    [kept] = report["steps"][-1]["notes"]  # and in the JSON, as said (the line wraps at 100 columns)
    assert kept.startswith(note) and f"note: {kept}" in " ".join(step3.split())


def test_only_torchs_worker_count_warning_is_caught():
    from fastcollate.tools.audit.setting_run import _worker_count_warning

    torch_text = (
        "This DataLoader will create 4 worker processes in total. Our suggested max number of worker in "
        "current system is 2, which is smaller than what this DataLoader is going to create."
    )
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with _worker_count_warning() as usable:
            warnings.warn(torch_text, UserWarning, stacklevel=1)
            warnings.warn(torch_text, UserWarning, stacklevel=1)
            warnings.warn("something else", UserWarning, stacklevel=1)
    assert usable == [2]
    assert [str(w.message) for w in shown] == ["something else"]  # shown as ever


def _epoch(samples: int, batches: int, first: float, wait: float) -> Epoch:
    return Epoch(ids=np.arange(samples), batches=batches, first_batch_seconds=first, wait_seconds=wait)


def test_a_gain_from_milliseconds_of_loading_is_too_little_data_to_tell():
    # the README's run: 12 samples in 2 batches, a ratio from well under 10 ms after start-up
    reference, workers = _epoch(12, 2, 0.001, 0.0015), _epoch(12, 2, 0.1, 0.10025)
    detail = speed_against(workers, reference)
    assert "too little data to tell" in detail and "gain" not in detail
    # as many batches, but too short; and long enough, but from too few batches
    assert "too little" in speed_against(_epoch(4000, 100, 0.1, 0.2), _epoch(4000, 100, 0.01, 0.21))
    assert "too little" in speed_against(_epoch(4000, 3, 0.1, 2.1), _epoch(4000, 3, 0.01, 4.01))


def test_a_gain_measured_long_enough_is_called_one():
    reference = _epoch(4000, 100, 0.01, 2.01)  # 2 s after start-up
    assert speed_against(_epoch(4000, 100, 0.2, 1.2), reference).endswith(  # x2.0
        ": faster (one epoch each, not checked against the machine's noise)")
    within_noise = speed_against(_epoch(4000, 100, 0.2, 2.2), reference)
    assert within_noise == "x1.00 ~ the reference's samples/s after start-up: no gain beyond noise"
    assert speed_against(_epoch(4000, 100, 0.2, 4.2), reference).endswith(
        ": slower (one epoch each, not checked against the machine's noise)")


def test_the_readmes_small_run_draws_no_conclusion_on_speed(capsys, tmp_path):
    _, _, report = run(capsys, tmp_path, "clean")
    assert "too little data to tell" in row(report, "workers=2")["conclusion"]


def test_string_ids_and_a_sharded_stream_pass(capsys, tmp_path):
    assert run(capsys, tmp_path, "named")[0] == 0
    status, out, report = run(capsys, tmp_path, "sharded_stream")
    assert status == 0, out
    assert report["kind"] == "iterable"


def test_transfer_is_skipped_without_a_gpu(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the transfer stage runs")
    _, _, report = run(capsys, tmp_path, "clean")
    assert row(report, "transfer (reference batches)")["conclusion"] == "skipped: no GPU"


# --- stages: the failing sample and the stage, never its content ------------------------------------


def test_fourth_record_with_one_channel_is_named_with_its_field_and_stage(capsys, tmp_path):
    status, out, report = run(capsys, tmp_path, "one_channel_fourth")
    assert status == 1 and not report["ok"]
    failure = report["failure"]
    assert failure["stage"] == "collate"
    assert failure["sample_id"] == 3
    assert failure["field"] == "x"
    assert "[1, 16, 16]" in failure["error"] and "[3, 16, 16]" in failure["error"]
    assert "collate failed at id 3, field 'x'" in out
    assert row(report, "workers=0, shuffle=False, batch 4")["ok"] is False
    assert "workers=2" not in [r["setting"] for r in report["table"]]  # fix it in one process first


def test_an_unreadable_file_is_a_raw_access_failure_whose_message_is_withheld(capsys, tmp_path):
    status, out, report = run(capsys, tmp_path, "broken_file")
    assert status == 1
    assert report["failure"]["stage"] == "raw access"
    assert report["failure"]["sample"] == "index 5"  # its own ids are unknown until it is read
    assert "OSError" in out and "secret-patient" not in out  # the message may quote the sample
    assert "secret-patient" not in json.dumps(report)


def test_show_errors_prints_the_message(capsys, tmp_path):
    _, out, _ = run(capsys, tmp_path, "broken_file", "--show-errors")
    assert "secret-patient-0005" in out


def test_a_failing_transform_is_told_apart_from_raw_access(capsys, tmp_path):
    status, out, report = run(capsys, tmp_path, "failing_transform")
    assert status == 1
    assert report["failure"]["stage"] == "transform"
    assert report["failure"]["sample_id"] == 6
    assert "transform failed at index 6" in out
    assert "pixel value" not in out


def test_a_failure_only_in_workers_names_the_worker_and_points_at_what_workers_receive(capsys, tmp_path):
    status, out, report = run(capsys, tmp_path, "fails_in_workers")
    assert status == 1
    failure = report["failure"]
    assert (failure["stage"], failure["sample"], failure["worker"]) == ("raw access", "index 9", 0)
    assert row(report, "workers=0, shuffle=False, batch 4")["ok"] is True
    assert "only with workers" in report["verdict"]


def test_batches_whose_shapes_differ_are_flagged(capsys, tmp_path):
    status, out, report = run(capsys, tmp_path, "shape_changes_by_batch")
    assert status == 0  # nothing lost or changed between settings: a warning, not a failure
    assert "batch 1 differs from batch 0 in 'x' (torch.uint8 [3, 16, 16] -> torch.uint8 [1, 16, 16])" in out
    assert "shapes vary" in row(report, "workers=0, shuffle=False, batch 4")["conclusion"]
    assert any("Contract" in note for note in report["notes"])


# --- data lost, duplicated or changed ---------------------------------------------------------------


def test_a_target_changed_in_workers_fails_with_its_id(capsys, tmp_path):
    status, out, report = run(capsys, tmp_path, "targets_change")
    assert status == 1 and report["failure"] is None
    first = report["steps"][-1]["epochs"][0]["report"]
    assert first["changed_targets"] == {"count": 1, "ids": [5]}
    assert row(report, "workers=2")["conclusion"].startswith("DATA DIFFERS: 1 with changed targets")


def test_targets_option_chooses_what_is_compared(capsys, tmp_path):
    status, out, report = run(capsys, tmp_path, "targets_change", "--targets", "x")
    assert status == 0 and report["targets"] == ["x"]  # y changes, but only x is compared
    status, _, report = run(capsys, tmp_path, "targets_change", "--targets", "all")
    assert status == 1 and report["targets"] == ["x", "y"]


def test_a_stale_cache_in_workers_is_a_loss_and_a_duplicate(capsys, tmp_path):
    status, _, report = run(capsys, tmp_path, "stale_cache")
    assert status == 1
    first = report["steps"][-1]["epochs"][0]["report"]
    assert first["missing"]["ids"] == [7]
    assert first["duplicated"]["ids"] == [{"id": 6, "count": 2, "workers": [1, 1]}]


def test_every_worker_reading_the_whole_stream_is_caught_with_worker_ids(capsys, tmp_path):
    status, out, report = run(capsys, tmp_path, "whole_stream")
    assert status == 1
    first = report["steps"][-1]["epochs"][0]["report"]
    assert first["duplicated"]["count"] == 12
    assert {"id": 0, "count": 2, "workers": [0, 1]} in first["duplicated"]["ids"]
    assert "each of the 2 workers delivered the whole stream" in out


def test_a_source_exhausted_in_kept_workers_fails_the_second_epoch(capsys, tmp_path):
    status, _, report = run(capsys, tmp_path, "exhausted_stream", "--persistent-workers")
    assert status == 1
    first, second = report["steps"][-1]["epochs"]
    assert first["report"]["ok"]
    assert second["samples"] == 0 and second["report"]["missing"]["count"] == 12
    assert row(report, "workers=2, second epoch")["ok"] is False
    assert run(capsys, tmp_path, "exhausted_stream")[0] == 0  # fresh workers each epoch hide it


# --- timeouts ---------------------------------------------------------------------------------------


def test_a_stuck_worker_is_shown_with_its_last_step_and_the_timeout_repairs_nothing(capsys, tmp_path):
    status, out, report = run(capsys, tmp_path, "stuck_in_workers", "--timeout", "1.5")
    assert status == 1
    failure = report["failure"]
    assert failure["stage"] == "timeout"
    assert failure["sample"] == "index 5 (raw access and transform) in worker 1"
    assert any(step.startswith("worker 1: reading index 5") for step in failure["last_steps"])
    assert "repairs nothing" in out and "repairs nothing" in report["verdict"]


def test_a_reference_stuck_in_the_main_process_times_out_too(capsys, tmp_path):
    status, out, report = run(capsys, tmp_path, "stuck_everywhere", "--timeout", "1")
    assert status == 1
    assert report["failure"]["sample"] == "index 2 (raw access and transform) in the main process"


# --- what cannot be verified, and the command line ---------------------------------------------------


def test_a_stream_without_ids_cannot_be_verified(capsys, tmp_path):
    status, out, report = run(capsys, tmp_path, "stream_without_ids")
    assert status == 2
    assert report["verdict"].startswith("NOT VERIFIED")


def test_a_factory_that_does_not_load_is_a_usage_error(capsys):
    assert doctor.main(["tests.helpers.audit_datasets:no_such_factory"]) == 2
    assert "cannot load" in capsys.readouterr().err


def test_a_factory_in_a_file_is_loaded_by_path(capsys, tmp_path):
    (tmp_path / "my_data.py").write_text(
        "from tests.helpers.audit_datasets import Records\n\ndef make():\n    return Records(6)\n"
    )
    assert doctor.main([f"{tmp_path / 'my_data.py'}:make", "--batch-size", "2", "--workers", "1"]) == 0
    assert "Records (map-style, 6 samples)" in capsys.readouterr().out


def test_the_data_set_is_named_by_dataset_as_bench_and_profile_take_it(capsys, tmp_path):
    spec = "tests.helpers.audit_datasets:no_such_factory"
    assert doctor.main(["--dataset", spec]) == 2
    assert "doctor: --dataset: cannot load" in capsys.readouterr().err
    (tmp_path / "my_data.py").write_text(
        "from tests.helpers.audit_datasets import Records\n\ndef make():\n    return Records(6)\n"
    )
    given = f"{tmp_path / 'my_data.py'}:make"
    assert doctor.main(["--dataset", given, "--batch-size", "2", "--workers", "1"]) == 0
    assert doctor.main([]) == 2
    assert "doctor: --dataset: required" in capsys.readouterr().err
    assert doctor.main(["--dataset", given, "other:make"]) == 2
    assert "given twice" in capsys.readouterr().err


def test_the_command_runs_from_python_dash_m(tmp_path):
    path = tmp_path / "report.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastcollate",
            "doctor",
            f"{DATASETS}:one_channel_fourth",
            "--json",
            str(path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "collate failed at id 3, field 'x'" in result.stdout
    assert json.loads(path.read_text())["failure"]["sample_id"] == 3


# --- the transfer step and the batch signature walk the batch as fastcollate.structure.tree does -----


class Batch(UserDict):
    """A Mapping that is not a dict, as Hugging Face's BatchEncoding is."""


Boxes = namedtuple("Boxes", "xyxy labels")


def test_the_transfer_step_keeps_a_mapping_subclass_and_a_namedtuple_batch_their_types():
    batch = Batch(x=torch.zeros(2, 3), boxes=Boxes(torch.ones(2, 4), [torch.arange(2)]), name=["a", "b"])
    moved = copy_to_device(batch, torch.device("meta"))  # a device every machine has, unlike a GPU
    assert type(moved) is Batch and type(moved["boxes"]) is Boxes and type(moved["boxes"].labels) is list
    assert moved["x"].device.type == "meta" and moved["boxes"].labels[0].device.type == "meta"
    assert moved["boxes"].xyxy.shape == (2, 4) and moved["name"] == ["a", "b"]
    assert batch["x"].device.type == "cpu"  # the batch itself is left as it was


def test_the_batch_signature_names_each_tensor_by_its_dotted_path():
    batch = Batch(x=torch.zeros(2, 3, dtype=torch.uint8), boxes=Boxes(torch.ones(2, 4), ["a", "b"]))
    assert batch_signature(batch) == {"x": "torch.uint8 [3]", "boxes.xyxy": "torch.float32 [4]"}
    assert batch_signature(torch.zeros(5, 2)) == {"<batch>": "torch.float32 [2]"}


def test_import_fastcollate_leaves_the_doctor_unimported():
    # The audit loads when it is named; even then the doctor, a command, stays unloaded.
    code = (
        "import sys, fastcollate; before = [m for m in sys.modules if m.startswith('fastcollate.tools')]; "
        "fastcollate.audit; "
        "print(before, [m for m in sys.modules if m.startswith('fastcollate.tools.audit')])"
    )
    command = [sys.executable, "-c", code]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("[] [")
    loaded = result.stdout.strip()
    assert "fastcollate.tools.audit.ledger" in loaded  # the audit itself, once named
    assert "doctor" not in loaded and "tracing" not in loaded and "setting_run" not in loaded


def test_an_arrays_dataset_passes_with_its_batches_gathered_by_index(capsys, tmp_path):
    status, out, report = run(capsys, tmp_path, "arrays", "--workers", "2")
    assert status == 0 and report["ok"], out
    assert report["targets"] == ["y"]
