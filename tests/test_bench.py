"""``python -m fastcollate bench``: the JSON it keeps, the flag on a configuration that loses a sample,
the chart, and the embedded data sets it measures."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from fastcollate.bench import command, configs
from fastcollate.bench.correctness import Delivered, compare_to_reference
from fastcollate.bench.datasets import (
    PRESETS,
    FashionLike,
    ImageNetLike,
    ManyFields,
    TokenSequences,
    cache_dir,
)

ROOT = Path(__file__).resolve().parent.parent
HELPERS = Path(__file__).resolve().parent / "bench_datasets.py"
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


def test_tiny_preset_results_json_has_every_field_the_issue_names(tiny_run):
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
        ):
            assert key in c, key
        assert c["ids_match_reference"] is True
        assert c["samples_per_s"] > 0 and c["bytes_per_s"] > 0
        assert c["wait_ms_p95"] >= c["wait_ms_p50"] >= 0
        assert c["peak_rss_bytes"] > 0
        assert len(c["runs"]) == 2, "every repetition is kept"
        for run in c["runs"]:
            assert run["measured_steps"] == 3, "warm-up batches are not measured"
            assert run["samples"] == 3 * 32
            assert len(run["wait_ms"]) == 3


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
    assert "default_collate + pin_memory + .to()" in stdout
    assert "assemble + pin_memory + .to()" in stdout
    if not torch.cuda.is_available():
        assert "no GPU" in stdout
    assert "warm-up batches (excluded from timing)" in stdout


def test_chart_is_a_valid_png(tiny_run):
    out, _, _ = tiny_run
    assert_valid_png(out / "chart.png")


def test_a_dataset_that_drops_a_sample_in_workers_is_flagged_and_not_ranked(tmp_path, capsys):
    status = command.main(
        [
            "--dataset",
            "tests.bench_datasets:drops_one_in_workers",
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
    assert "LOST 1" in out and "FLAGGED, not ranked" in out


def test_a_map_style_dataset_that_swaps_a_sample_in_workers_is_flagged_as_lost_and_duplicated(tmp_path):
    status = command.main(
        [
            "--dataset",
            "tests.bench_datasets:wrong_id_in_workers",
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


def _args(**overrides) -> argparse.Namespace:
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
    setup = configs.resolve(_args())
    assert setup.workers == [0, 1, 2]
    assert any("workers [4] skipped" in note and "2 usable CPUs" in note for note in setup.notes)


def test_explicit_workers_run_as_asked_even_past_the_cpu_count(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    setup = configs.resolve(_args(workers=[0, 4]))
    assert setup.workers == [0, 4]
    assert any("exceed" in note for note in setup.notes)


def test_quick_takes_few_steps_and_workers(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    setup = configs.resolve(_args(quick=True, size=1000))
    assert (setup.steps, setup.warmup, setup.repeat, setup.workers) == (4, 1, 3, [0, 2])
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
