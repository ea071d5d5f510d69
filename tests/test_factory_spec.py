"""One factory for every command: ``--dataset module:factory`` loaded one way (``factory_spec``) for
``bench``, ``profile`` and ``doctor``, each using the collate, contract and batch sampler it gives, the
mistakes in a factory's mapping named, and a user's collate named by its name."""

from __future__ import annotations

import functools
import json
import textwrap

import pytest
import torch
from torch.utils.data import default_collate

import fastcollate
from fastcollate.tools.audit import doctor
from fastcollate.tools.bench import command as bench_command
from fastcollate.tools.bench import profile
from fastcollate.tools.cli import UsageError
from fastcollate.tools.factory_spec import collate_name, load_factory_output, loader_arguments

from .helpers.processes import ROOT

pytestmark = pytest.mark.usefixtures("brief_busy_sample")  # no test here reads the machine's load

PADDED_TEXT = f"{ROOT / 'examples' / 'padded_text.py'}:make"

FACTORIES = '''
import torch
from torch.utils.data import BatchSampler, Dataset, RandomSampler, SequentialSampler, default_collate

import fastcollate
from fastcollate import Contract, Field


class Rows(Dataset):
    def __init__(self, size=12):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return {"id": index, "x": torch.full((3,), float(index)), "label": index % 2}


def sized(size=5, seed=0):
    return Rows(size + seed)


def without_dataset():
    return {"collate": default_collate, "batch_size": 4}


def unknown_keys():
    return {"dataset": Rows(), "colate": default_collate, "shuffle": True}


def sampler_of_single_indices():
    return {"dataset": Rows(), "batch_sampler": RandomSampler(range(12))}


def sampler_a_number():
    return {"dataset": Rows(), "batch_sampler": 4}


def sampler_and_batch_size():
    return {"dataset": Rows(), "batch_sampler": BatchSampler(SequentialSampler(range(12)), 4, False),
            "batch_size": 4}


def contract_a_dict():
    return {"dataset": Rows(), "contract": {"x": "float32"}}


def stack_rows(samples):
    if any(s["id"] == 5 for s in samples):
        raise ValueError("row 5 is not a row")
    return default_collate(samples)


def collate_failing_on_five():
    return {"dataset": Rows(), "collate": stack_rows}


def reversed_batches():
    return {"dataset": Rows(), "collate": stack_rows_unless_none,
            "batch_sampler": [[11, 10, 9], [8, 7, 6, 5], [4, 3, 2, 1, 0]]}


def stack_rows_unless_none(samples):
    return default_collate(samples)


class PadBatch:
    def __call__(self, samples):
        return default_collate(samples)


def named_collate_object():
    return {"dataset": Rows(16), "collate": PadBatch(), "batch_size": 4}
'''


@pytest.fixture(scope="module")
def factories(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("user") / "factory_spec_factories.py"
    path.write_text(textwrap.dedent(FACTORIES))
    return str(path)


def problem(spec: str, **options) -> str:
    with pytest.raises(UsageError) as caught:
        load_factory_output(spec, **options)
    return str(caught.value)


# --- the mapping, checked once for every command --------------------------------------------------


def test_a_mapping_without_dataset_names_the_keys_it_has(factories):
    text = problem(f"{factories}:without_dataset")
    assert "without 'dataset'" in text and "'collate', 'batch_size'" in text


def test_unknown_keys_are_named_with_the_known_ones(factories):
    text = problem(f"{factories}:unknown_keys")
    assert "unknown keys 'colate', 'shuffle'" in text
    assert "'dataset', 'collate', 'contract', 'batch_sampler', 'batch_size', 'step'" in text


def test_a_sampler_of_single_indices_is_no_batch_sampler_and_says_how_to_wrap_it(factories):
    text = problem(f"{factories}:sampler_of_single_indices")
    assert "RandomSampler, which yields one index at a time" in text and "BatchSampler(RandomSampler" in text
    assert "must yield lists of indices" in problem(f"{factories}:sampler_a_number")


def test_a_batch_sampler_with_a_batch_size_is_refused_in_the_factory_and_on_the_command_line(factories):
    assert "both 'batch_sampler' and 'batch_size'" in problem(f"{factories}:sampler_and_batch_size")
    made = load_factory_output(f"{factories}:reversed_batches")
    with pytest.raises(UsageError, match="--batch-size: .* gives a batch_sampler .* leave --batch-size out"):
        loader_arguments(made, batch_size=4)
    assert loader_arguments(made)["batch_sampler"] == [[11, 10, 9], [8, 7, 6, 5], [4, 3, 2, 1, 0]]


def test_a_contract_must_be_a_contract(factories):
    assert "'contract' must be a fastcollate.Contract, got a dict" in problem(f"{factories}:contract_a_dict")


def test_size_and_seed_are_passed_when_the_factory_takes_them(factories):
    assert len(load_factory_output(f"{factories}:sized", size=7, seed=2).dataset) == 9
    assert len(load_factory_output(f"{factories}:sized").dataset) == 5


def test_loader_arguments_take_the_factorys_collate_else_assemble_under_its_contract(factories):
    own = load_factory_output(f"{factories}:collate_failing_on_five")
    assert loader_arguments(own)["collate_fn"].__name__ == "stack_rows"
    padded = load_factory_output(PADDED_TEXT)
    arguments = loader_arguments(padded)
    assert arguments["batch_size"] == 16  # the factory's, as no --batch-size was given
    assert loader_arguments(padded, batch_size=3)["batch_size"] == 3
    batch = arguments["collate_fn"]([padded.dataset[0], padded.dataset[1]])
    longest = max(len(padded.dataset[i]["input_ids"]) for i in (0, 1))
    assert batch["input_ids"].shape == (2, longest) and batch["attention_mask"].dtype == torch.int64


def test_a_collate_is_named_by_its_function_its_class_or_what_a_partial_wraps():
    class Collator:
        def __call__(self, samples):
            return samples

    assert collate_name(default_collate) == "default_collate"
    assert collate_name(Collator()) == "Collator"
    assert collate_name(functools.partial(functools.partial(default_collate))) == "default_collate"
    assert collate_name(fastcollate.assemble) == "Assembler"


# --- doctor ---------------------------------------------------------------------------------------


def run_doctor(capsys, tmp_path, spec: str, *options: str) -> tuple[int, str, dict]:
    path = tmp_path / "doctor.json"
    status = doctor.main(["--dataset", spec, "--workers", "1", "--json", str(path), *options])
    out = capsys.readouterr().out
    return status, out, json.loads(path.read_text()) if path.exists() else {}


def test_padded_text_passes_doctor_with_its_contract(capsys, tmp_path):
    status, out, report = run_doctor(capsys, tmp_path, PADDED_TEXT, "--batch-size", "8")
    assert status == 0, out
    assert "the factory's contract" in out and "Verdict: OK" in out
    assert report["batch_size"] == 8 and report["collate"] == "Assembler"


def test_doctor_runs_the_factorys_collate_and_names_the_sample_it_fails_on(capsys, tmp_path, factories):
    status, out, report = run_doctor(capsys, tmp_path, f"{factories}:collate_failing_on_five",
                                     "--batch-size", "4")
    assert status == 1
    assert report["collate"] == "stack_rows"
    assert report["failure"]["stage"] == "collate"
    assert report["failure"]["sample_id"] == 5
    assert "id 5 (fails alone)" in report["failure"]["sample"]


def test_doctor_batches_with_the_factorys_batch_sampler(capsys, tmp_path, factories):
    status, out, report = run_doctor(capsys, tmp_path, f"{factories}:reversed_batches")
    assert status == 0, out
    assert report["batch_sampler"] == "list" and report["batch_size"] is None
    assert [s.get("batches") for s in report["steps"][1:2]] == [3]
    assert all(e["batches"] == 3 for e in report["steps"][2]["epochs"])
    assert doctor.main(["--dataset", f"{factories}:reversed_batches", "--batch-size", "4"]) == 2
    assert "leave --batch-size out" in capsys.readouterr().err


def test_doctor_refuses_a_mapping_it_cannot_use_in_one_line(capsys, factories):
    assert doctor.main(["--dataset", f"{factories}:unknown_keys"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("doctor: --dataset: ") and "unknown keys 'colate'" in err


# --- bench and profile ----------------------------------------------------------------------------


def test_bench_runs_padded_text_and_leaves_out_default_collate_saying_why(capsys, tmp_path):
    options = ["--quick", "--dataset", PADDED_TEXT, "--size", "96", "--no-model", "--repeat", "1",
               "--workers", "0", "1", "--no-progress", "--out", str(tmp_path)]
    status = bench_command.main(options)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "default_collate cannot batch this data set" in out and "field 'input_ids'" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert {e["variant"] for e in results["configs"]} == {"assemble", "device_loader"}
    assert all(e["ranked"] for e in results["configs"])
    assert "resize storage" not in out


def test_bench_labels_a_factorys_collate_by_its_name(capsys, tmp_path, factories):
    options = ["--quick", "--dataset", f"{factories}:named_collate_object", "--no-model", "--repeat", "1",
               "--workers", "0", "--no-progress", "--out", str(tmp_path)]
    assert bench_command.main(options) == 0
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "results.json").read_text())
    labels = {e["variant"]: e["label"] for e in results["configs"]}
    assert labels["default"] == "PadBatch + pinned copy"
    assert "PadBatch + pinned copy" in out and "default_collate" not in (tmp_path / "table.txt").read_text()
    assert results["reference"]["config"].startswith("PadBatch + pinned copy")


def test_bench_reads_the_factorys_batches_in_every_run(capsys, tmp_path, factories):
    options = ["--quick", "--dataset", f"{factories}:reversed_batches", "--no-model", "--repeat", "1",
               "--workers", "0", "1", "--no-progress", "--out", str(tmp_path)]
    assert bench_command.main(options) == 0
    out = capsys.readouterr().out
    assert "batches from the factory's list: its first 3" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["reference"]["samples"] == 12
    assert all(e["ranked"] for e in results["configs"])
    assert bench_command.main([*options, "--batch-size", "4"]) == 2
    assert "leave --batch-size out" in capsys.readouterr().err


def test_profile_runs_padded_text_on_the_contract_path(capsys, tmp_path):
    options = ["--dataset", PADDED_TEXT, "--size", "64", "--steps", "2", "--warmup", "1", "--workers", "1",
               "--no-model", "--out", str(tmp_path)]
    assert profile.main(options) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "profile.json").read_text())
    assert record["paths"]["device_loader"]["profiled_steps"] == 2
    assert "default" not in record["paths"]
    assert "skipped default_collate + pin_memory" in out and "cannot batch this data set" in out
