"""``python -m fastcollate bench``: the JSON it keeps, the flag on a configuration that loses a sample,
the chart, the embedded data sets it measures, and the parts of the ``fastcollate.tools.bench`` package."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import types
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from fastcollate.collate.ids import IdentifiedSample, guess_target_path
from fastcollate.tools.bench import chart, command, configs
from fastcollate.tools.bench.batches import batch_len, ids_and_targets, tensor_bytes, to_device
from fastcollate.tools.bench.correctness import Delivered, compare_to_reference
from fastcollate.tools.bench.datasets import (
    FashionLike,
    ImageNetLike,
    ManyFields,
    TokenSequences,
    cache_dir,
)
from fastcollate.tools.bench.epoch import run_epoch
from fastcollate.tools.bench.pinned_copy import pinned_copy_gbps
from fastcollate.tools.bench.presets import PRESETS
from tests.helpers.charts import assert_legend_clear, kept_figures

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("brief_busy_sample")  # no test here reads the machine's load

HELPERS = Path(__file__).resolve().parent / "helpers" / "bench_datasets.py"
TINY = [
    "--preset",
    "fields",
    "--size",
    "256",
    "--batch-size",
    "32",
    "--steps",
    "3",
    "--warmup",
    "1",
    "--repeat",
    "2",
    "--workers",
    "0",
    "1",
    "--no-progress",
]


def assert_valid_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100
    crc = struct.unpack(">I", data[29:33])[0]
    assert crc == zlib.crc32(data[12:29]), "IHDR checksum"
    assert data[-12:-8] == b"\x00\x00\x00\x00" and data[-8:-4] == b"IEND"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The real command, in a subprocess, on the tiny fields preset: it must take seconds."""
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, XDG_CACHE_HOME=str(out / "cache"))
    proc = subprocess.run(
        [sys.executable, "-m", "fastcollate", "bench", *TINY, "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, json.loads((out / "results.json").read_text()), proc.stdout


def test_tiny_preset_results_json_has_the_machine_versions_and_every_config(tiny_run):
    _, result, _ = tiny_run
    for key in ("machine", "versions", "warmup_steps", "configs", "config"):
        assert key in result
    assert result["warmup_steps"] == 1
    assert result["versions"]["torch"] == torch.__version__
    assert result["machine"]["cpus_usable"] >= 1
    configs = result["configs"]
    variants = {c["variant"] for c in configs}
    assert {"default", "assemble"} <= variants
    assert len(configs) == 2 * len(variants) * 2  # observations x variants x workers
    for c in configs:
        for key in (
            "collate",
            "transfer",
            "workers",
            "samples_per_s",
            "bytes_per_s",
            "wait_ms_p50",
            "wait_ms_p95",
            "peak_rss_bytes",
            "ids_match_reference",
            "runs",
            "device_transforms_timed",
            "not_different_from_default",
        ):
            assert key in c, key
        assert c["device_transforms_timed"] is False, "the fields preset has no device transforms"
        if c["variant"] == "default":
            assert c["not_different_from_default"] is None, "the default is not compared with itself"
        else:
            assert isinstance(c["not_different_from_default"], bool), "two runs each: a spread to judge"
        assert c["ids_match_reference"] is True
        assert c["samples_per_s"] > 0 and c["bytes_per_s"] > 0
        assert c["wait_ms_p95"] >= c["wait_ms_p50"] >= 0
        assert c["peak_rss_bytes"] > 0
        assert len(c["runs"]) == 2, "every repetition is kept"
        for run in c["runs"]:
            assert run["measured_steps"] == 3, "warm-up batches are not measured"
            assert run["samples"] == 3 * 32
            assert len(run["wait_ms"]) == 3
    assert result["config"]["device_transforms_timed"] == {"loader": False, "integrated": False}


def test_a_run_too_small_to_time_marks_every_ratio_and_names_no_fastest(tiny_run):
    # 3 timed batches a round: whatever the spread says, no ratio is a result.
    _, result, stdout = tiny_run
    for c in result["configs"]:
        if c["variant"] != "default":
            assert c["ratio_to_default"]["too_small"].startswith("too small to time: 3 timed batches")
            assert c["ratio_to_default"]["clears_noise"] is False
    for observation, said in result["verdicts"].items():
        assert said.startswith("fastest correct: cannot tell, too small to time"), (observation, said)
    ratios = re.findall(r" (\d+(?:\.\d+)?x \([\d.]+-[\d.]+\))( ~)?", stdout)
    compared = [c for c in result["configs"] if c["variant"] != "default"]
    assert len(ratios) == len(compared) and all(mark for _, mark in ratios), stdout


def test_table_shows_the_median_not_the_best_run(tiny_run):
    _, result, _ = tiny_run
    for c in result["configs"]:
        rates = sorted(r["samples_per_s"] for r in c["runs"])
        assert c["samples_per_s"] == pytest.approx((rates[0] + rates[1]) / 2)  # median of two


def test_workers_are_reported_with_their_own_memory_and_start_up(tiny_run):
    _, result, _ = tiny_run
    with_worker = [c for c in result["configs"] if c["workers"] == 1]
    assert with_worker
    for c in with_worker:
        assert len(c["peak_rss_workers_bytes"]) == 1
        assert c["peak_rss_bytes"] > c["peak_rss_main_bytes"]
        assert c["startup_s"] is not None
        assert c["shm_bytes"] > 0, "batches in flight from the worker sit in /dev/shm"


def test_terminal_table_names_configs_and_says_no_gpu(tiny_run):
    _, _, stdout = tiny_run
    assert "default_collate + pinned copy" in stdout
    assert "assemble + pinned copy" in stdout
    if not torch.cuda.is_available():
        assert "no GPU" in stdout
    assert "warm-up batches (excluded from timing)" in stdout


def test_chart_is_a_valid_png(tiny_run):
    out, _, _ = tiny_run
    assert_valid_png(out / "chart.png")


def test_the_charts_legend_covers_no_panel_and_no_title(tiny_run, tmp_path, monkeypatch):
    _, result, _ = tiny_run
    setup = configs.resolve(bench_arguments(workers=[0, 1], steps=3, warmup=1, repeat=2))  # as TINY
    with kept_figures(monkeypatch) as figures:
        assert chart.write_chart(setup, result["configs"], tmp_path / "chart.png") is None
        [figure] = figures
        assert_legend_clear(figure)


def test_a_dataset_that_drops_a_sample_in_workers_is_flagged_and_not_ranked(tmp_path, capsys):
    status = command.main(
        [
            "--dataset",
            "tests.helpers.bench_datasets:drops_one_in_workers",
            "--batch-size",
            "16",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--repeat",
            "1",
            "--workers",
            "0",
            "1",
            "--observation",
            "loader",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    assert status == 1, "a flagged configuration makes the command fail"
    result = json.loads((tmp_path / "results.json").read_text())
    by_workers = {}
    for c in result["configs"]:
        by_workers.setdefault(c["workers"], []).append(c)
    assert all(c["ids_match_reference"] and c["ranked"] for c in by_workers[0])
    for c in by_workers[1]:
        assert c["ids_match_reference"] is False
        assert c["ranked"] is False
        assert c["lost"] == 1 and c["duplicated"] == 0
        assert c["runs"][0]["check"]["lost_ids"] == [5]
    out = capsys.readouterr().out
    assert " FLAGGED" in out and "FLAGGED, not ranked" in out and "workers: lost 1\n" in out


def test_a_map_style_dataset_that_swaps_a_sample_in_workers_is_flagged_as_lost_and_duplicated(tmp_path):
    status = command.main(
        [
            "--dataset",
            "tests.helpers.bench_datasets:wrong_id_in_workers",
            "--batch-size",
            "4",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--repeat",
            "1",
            "--workers",
            "0",
            "1",
            "--observation",
            "loader",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    assert status == 1
    result = json.loads((tmp_path / "results.json").read_text())
    for c in result["configs"]:
        if c["workers"] == 0:
            assert c["ids_match_reference"] and c["ranked"]
        else:  # each run asks for a prefix of the subset (its own untimed tail) that holds sample 3
            assert not c["ranked"] and c["lost"] == 1 and c["duplicated"] == 1
            assert c["runs"][0]["check"]["lost_ids"] == [3] and c["runs"][0]["check"]["duplicated_ids"] == [4]


def test_arrays_without_ids_under_an_id_less_contract_and_a_list_collate_are_audited_by_the_ids_attached(
    tmp_path,
):
    arguments = ["--steps", "2", "--warmup", "1", "--repeat", "1", "--workers", "0", "1", "--observation",
                 "loader", "--no-progress", "--out", str(tmp_path)]
    dataset = "tests.helpers.bench_datasets:arrays_with_own_collate_and_an_id_less_contract"
    assert command.main(["--dataset", dataset, *arguments]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert len(result["configs"]) == 6
    for c in result["configs"]:
        assert c["ids_match_reference"] and c["ranked"] and c["lost"] == c["duplicated"] == 0, c["config"]


def test_a_user_factory_returning_a_mapping_sets_the_batch_size(tmp_path):
    status = command.main(
        [
            "--dataset",
            f"{HELPERS}:tiny",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--repeat",
            "1",
            "--workers",
            "0",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    assert status == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["config"]["batch_size"] == 16
    assert result["config"]["observations"] == ["loader"], "no step given: no integrated observation"
    assert "integrated observation skipped" in " ".join(result["notes"])


def test_tokens_preset_reports_tokens_per_second_from_real_lengths(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    status = command.main(
        [
            "--preset",
            "tokens",
            "--size",
            "128",
            "--batch-size",
            "16",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--repeat",
            "1",
            "--workers",
            "0",
            "--observation",
            "loader",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    assert status == 0
    result = json.loads((tmp_path / "results.json").read_text())
    dataset = TokenSequences(size=128, seed=0)
    for c in result["configs"]:
        run = c["runs"][0]
        assert c["tokens_per_s"] > 0
        assert run["tokens"] <= 32 * dataset.max_len
        assert run["tokens"] / run["seconds"] == pytest.approx(run["tokens_per_s"])


def bench_arguments(**overrides) -> argparse.Namespace:
    base = dict(
        preset="fields",
        dataset=None,
        size=256,
        workers=None,
        batch_size=32,
        steps=None,
        warmup=None,
        repeat=None,
        quick=False,
        observation="both",
        no_model=False,
        device="cpu",
        model_width=None,
        seed=0,
    )
    base.update(overrides)
    return argparse.Namespace(**base)


def test_default_workers_are_capped_by_the_cpu_count_and_it_says_so(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    setup = configs.resolve(bench_arguments())
    assert setup.workers == [0, 1, 2]
    assert any("workers [4] skipped" in note and "2 usable CPUs" in note for note in setup.notes)


def test_explicit_workers_run_as_asked_even_past_the_cpu_count(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    setup = configs.resolve(bench_arguments(workers=[0, 4]))
    assert setup.workers == [0, 4]
    assert any("exceed" in note for note in setup.notes)


def test_quick_takes_few_steps_and_workers(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    setup = configs.resolve(bench_arguments(quick=True, size=1000))
    assert (setup.steps, setup.warmup, setup.repeat, setup.workers) == (4, 1, 5, [0, 2])
    assert setup.tail == 2 * 2 + 2, "the deepest pipeline: 2 workers x prefetch 2, + DeviceLoader depth 2"
    assert setup.indices is not None and len(setup.indices) == (4 + 1 + setup.tail) * 32


def test_fashion_like_is_deterministic_cached_under_xdg_and_picklable_without_its_pixels(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "fastcollate"
    a = FashionLike(size=500, seed=3, transform=None)
    b = FashionLike(size=500, seed=3, transform=None, cache=False)
    assert torch.equal(a[7]["image"], b[7]["image"]) and a[7]["target"] == b[7]["target"]
    assert list((tmp_path / "fastcollate").glob("fashionlike-v1-seed3-n500-*.npy"))
    c = FashionLike(size=500, seed=4, transform=None, cache=False)
    assert not torch.equal(a[7]["image"], c[7]["image"])
    sample = a[499]
    assert (
        sample["id"] == 499 and sample["image"].shape == (1, 28, 28) and sample["image"].dtype == torch.uint8
    )
    assert len(pickle.dumps(a)) < 10_000, "a worker maps the cache itself"
    targets = {a[i]["target"] for i in range(200)}
    assert targets == set(range(10))


def test_fashion_preset_applies_the_seed_study_transforms(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    sample = PRESETS["fashion"].make_dataset(300, 0)[5]
    assert sample["image"].dtype == torch.float32 and sample["image"].shape == (1, 28, 28)
    assert 0.0 <= float(sample["image"].min()) and float(sample["image"].max()) <= 1.0
    names = [type(t).__name__ for t in PRESETS["fashion"].make_dataset(300, 0).transform.transforms]
    assert names == ["RandomResizedCrop", "RandomRotation", "ToTensor"]


def test_other_presets_give_dict_samples_with_an_int_id_and_are_deterministic():
    for dataset in (ImageNetLike(size=50), TokenSequences(size=50), ManyFields(size=50)):
        first, again = dataset[17], pickle.loads(pickle.dumps(dataset))[17]
        assert first["id"] == 17 and isinstance(first["target"], int)
        for key, value in first.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, again[key]), key
    image = ImageNetLike(size=5)[3]["image"]
    assert image.dtype == torch.uint8 and image.shape == (3, 224, 224) and image.is_contiguous()
    tokens = TokenSequences(size=50)
    assert len(tokens[9]["tokens"]) == int(tokens.length_of(np.array([9]))[0])


def test_compare_to_reference_counts_lost_duplicated_and_changed_targets():
    ref = Delivered(ids=np.arange(6), targets=np.arange(6) % 2)
    run = Delivered(ids=np.array([0, 1, 2, 2, 4, 5]), targets=np.array([0, 1, 0, 0, 0, 0]))  # id 5 changed
    check = compare_to_reference(run, ref)
    assert (check["lost"], check["duplicated"], check["targets_mismatched"]) == (1, 1, 1)
    assert check["lost_ids"] == [3] and check["duplicated_ids"] == [2] and not check["match"]
    shuffled = Delivered(ids=ref.ids[::-1].copy(), targets=ref.targets[::-1].copy())
    check = compare_to_reference(shuffled, ref)
    assert check["match"] and not check["order_matches"]


def test_compare_to_reference_counts_ids_never_in_the_reference_as_unexpected_not_duplicated():
    ref = Delivered(ids=np.array([0, 1, 2]), targets=None)
    run = Delivered(ids=np.array([0, 1, 2, 99]), targets=None)
    check = compare_to_reference(run, ref)
    assert (check["lost"], check["duplicated"], check["unexpected"]) == (0, 0, 1)
    assert check["duplicated_ids"] == [] and check["unexpected_ids"] == [99] and not check["match"]


def test_compare_to_reference_compares_targets_by_value_across_dtypes():
    ref = Delivered(ids=np.arange(4), targets=np.array([0, 1, 2, 3], np.int64))
    run = Delivered(ids=np.arange(4), targets=np.array([0, 1, 2, 5], np.int32))
    check = compare_to_reference(run, ref)
    assert check["targets_mismatched"] == 1 and not check["match"]
    run.targets = np.array([0.0, 1.0, 2.0, 3.0], np.float32)
    assert compare_to_reference(run, ref)["match"]


def test_importing_the_bench_package_loads_none_of_its_commands_nor_matplotlib():
    code = (
        "import sys, fastcollate.tools.bench; "
        "print(sorted(m for m in sys.modules "
        "if m == 'matplotlib' or m.startswith('fastcollate.tools.bench.')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_core_and_the_doctor_load_nothing_of_the_bench():
    # The core and the audit stand without the measuring tools: the doctor shares only the factory
    # loader with the bench, and that lives outside both.
    code = (
        "import sys, fastcollate, fastcollate.audit, fastcollate.tools.audit.doctor, fastcollate.lightning, "
        "fastcollate.data.index_batches, fastcollate.data.token_batches, fastcollate.transfer.worker_slots, "
        "fastcollate.integrations.thread_pipelines; "
        "print(sorted(m for m in sys.modules if m.split('.')[:3] == ['fastcollate', 'tools', 'bench']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_bench_package_s_main_is_the_bench_command(capsys):
    from fastcollate.tools import bench

    with pytest.raises(SystemExit) as exited:
        bench.main(["--help"])
    assert exited.value.code == 0
    assert "python -m fastcollate bench" in capsys.readouterr().out


class _Encoding(dict):
    """A dict subclass that carries attributes of its own, as Hugging Face's BatchEncoding does."""


def test_to_device_keeps_every_container_type_and_a_mappings_own_attributes():
    point = IdentifiedSample(id=torch.tensor([1, 2]), sample=[torch.ones(2), (torch.zeros(1), "label")])
    encoding = _Encoding(ids=torch.arange(3))
    encoding.source = "tokenizer"  # set on this instance: calling the type again would lose it
    batch = {"point": point, "encoding": encoding, "name": "b0"}
    moved = to_device(batch, torch.device("cpu"))
    assert isinstance(moved["point"], IdentifiedSample) and isinstance(moved["point"].sample, list)
    assert isinstance(moved["point"].sample[1], tuple) and moved["point"].sample[1][1] == "label"
    assert type(moved["encoding"]) is _Encoding and moved["encoding"].source == "tokenizer"
    assert torch.equal(moved["encoding"]["ids"], torch.arange(3)) and moved["name"] == "b0"


def test_tensor_bytes_counts_every_nested_tensor_and_nothing_else():
    batch = {"x": torch.zeros(4, 3, dtype=torch.float32), "meta": [torch.zeros(5, dtype=torch.uint8), 7, "s"]}
    assert tensor_bytes(batch) == 4 * 3 * 4 + 5
    assert tensor_bytes("no tensors") == 0


def test_batch_len_is_the_first_dimension_of_the_first_leaf():
    assert batch_len({"meta": {"x": torch.zeros(6, 2)}, "y": torch.zeros(9)}) == 6
    assert batch_len([torch.tensor(3.0)]) == 1, "a 0-dimensional tensor is one sample"
    assert batch_len({"n": 5}) == 0


def test_ids_and_targets_take_an_identified_samples_last_field_as_targets_and_copy_both():
    ids, targets = torch.tensor([3, 4]), torch.tensor([1, 0])
    batch = IdentifiedSample(id=ids, sample=[torch.zeros(2, 5), targets])
    path = guess_target_path(batch)
    assert path == "sample.1"
    got_ids, got_targets = ids_and_targets(batch, path)
    assert torch.equal(got_ids, ids) and torch.equal(got_targets, targets)
    assert got_ids.data_ptr() != ids.data_ptr() and got_targets.data_ptr() != targets.data_ptr()
    assert ids_and_targets({"x": torch.zeros(2)}, "target") == (None, None)


RUN_KEYS = [
    "error",
    "epoch_s",
    "asked_samples",
    "batches",
    "measured_steps",
    "samples",
    "seconds",
    "samples_per_s",
    "bytes",
    "bytes_per_s",
    "wait_ms",
    "wait_ms_p50",
    "wait_ms_p95",
    "h2d_ms_p50",
    "h2d_call_ms_p50",
    "startup_s",
    "peak_rss_main_bytes",
    "peak_rss_workers_bytes",
    "pss_bytes",
    "shm_bytes",
    "shm_growth_system_bytes",
    "pinned_bytes",
    "pinned_allocations",
    "device_loader_stats",
]


def test_run_epoch_records_the_measured_steps_and_the_subsets_ids_in_a_record():
    setup = configs.resolve(bench_arguments(workers=[0], steps=2, warmup=1, repeat=1, observation="loader"))
    assemble_variant = next(v for v in configs.VARIANTS if v.key == "assemble")
    run = run_epoch(setup, assemble_variant, 0, "loader")
    assert run.error is None
    assert run.asked_samples == (1 + 2) * 32, "no tail: 0 workers and no DeviceLoader hold nothing ahead"
    assert (run.batches, run.measured_steps, run.samples) == (3, 2, 64)
    assert run.delivered.ids.tolist() == setup.indices[: run.asked_samples]
    assert run.delivered.targets is not None and run.delivered.targets.size == run.asked_samples
    assert setup.target_path == "target", "found in the first batch, kept for the runs after it"
    assert list(run.to_json()) == RUN_KEYS, "results.json's run keys, in their order, none private"


def test_a_configuration_that_raises_comes_back_with_its_error_instead_of_raising():
    setup = configs.resolve(
        bench_arguments(preset=None, dataset="tests.helpers.bench_datasets:raises_in_the_third_batch",
              size=None, batch_size=None, workers=[0], steps=4, warmup=1, observation="loader")
    )
    run = run_epoch(setup, configs.VARIANTS[0], 0, "loader", full=True)
    assert run.error is not None and run.error.startswith("ValueError") and "unreadable" in run.error
    assert run.batches < len(setup.indices) // setup.batch_size
    assert run.to_json()["error"] == run.error


def test_the_pinned_copy_is_measured_to_a_cuda_device_only():
    with pytest.raises(ValueError, match="CUDA device"):
        pinned_copy_gbps(1 << 20, torch.device("cpu"))


@pytest.mark.needs_cuda
def test_the_pinned_copy_returns_every_timed_run_in_gb_per_s():
    runs = pinned_copy_gbps(8 << 20, torch.device("cuda"), repeats=5, warmup=1)
    assert len(runs) == 5 and all(0 < gbps < 10_000 for gbps in runs)
    with pytest.raises(ValueError, match="at least one byte"):
        pinned_copy_gbps(0, torch.device("cuda"))


# --------------------------------------------------------------------------------------------------
# Loader-only times what the loader delivers; the table says which differences are noise.


def test_rounds_rotate_the_order_so_no_configuration_runs_twice_in_a_row(monkeypatch):
    # A slow spell of a noisy machine lasts seconds: two back-to-back runs of one configuration would
    # both fall in it and set that configuration apart from the rest.
    setup = configs.resolve(bench_arguments(workers=[0, 2], repeat=4, observation="loader"))
    order = []

    def fake_epoch(setup, variant, workers, observation, full=False):
        order.append((observation, variant.key, workers))
        return types.SimpleNamespace(delivered=None, round=None, check=None, asked_samples=0)

    monkeypatch.setattr(command, "run_epoch", fake_epoch)
    monkeypatch.setattr(command, "compare_to_reference", lambda *args: {"match": True})
    plan = [("loader", v.key, w) for w in (0, 2) for v in setup.variants]
    runs, _ = command.run_configs(setup, plan, disable_progress=True)
    assert all(len(r) == 4 for r in runs.values())
    assert all(a != b for a, b in zip(order, order[1:], strict=False)), order
    positions = {c: {order[r * len(plan):(r + 1) * len(plan)].index(c) for r in range(4)} for c in plan}
    assert all(len(p) == 4 for p in positions.values()), "each configuration in a new position each round"


def test_arrays_preset_runs_the_gathered_path_and_default_collate_gets_the_same_samples(tmp_path):
    status = command.main(["--preset", "arrays", "--size", "2048", "--batch-size", "256", "--steps", "2",
                           "--warmup", "1", "--repeat", "2", "--workers", "0", "2", "--no-progress",
                           "--out", str(tmp_path)])
    assert status == 0, "every configuration delivered the reference's ids and targets"
    result = json.loads((tmp_path / "results.json").read_text())
    assert {c["observation"] for c in result["configs"]} == {"loader", "integrated"}
    assert all(c["ids_match_reference"] for c in result["configs"])
    assert "tabular_mlp" in result["config"]["model"]


def test_the_memmap_example_runs_under_the_bench_with_workers_and_every_id_checked(tmp_path):
    """examples/memmap_bench.py: a memory-mapped Arrays dataset, as a user's --dataset factory."""
    status = command.main(["--dataset", "examples/memmap_bench.py:make", "--size", "12000",
                           "--batch-size", "1024",
                           "--steps", "2", "--warmup", "1", "--repeat", "1", "--workers", "0", "2",
                           "--observation", "loader", "--no-progress", "--out", str(tmp_path)])
    assert status == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert {c["workers"] for c in result["configs"]} == {0, 2}
    assert all(c["ids_match_reference"] and c["ranked"] for c in result["configs"])
