"""benchmarks/resume_cost.py times resumes that are right: every contender's resumed first batch is the
uninterrupted run's batch k, a wrong resume stops the run, and the JSON holds every cell."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "resume_cost.py"
_spec = importlib.util.spec_from_file_location("resume_cost", SCRIPT)
resume_cost = importlib.util.module_from_spec(_spec)
sys.modules["resume_cost"] = resume_cost  # its dataclasses look their module up while being made
_spec.loader.exec_module(resume_cost)

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")

SETUP = resume_cost.Setup(n=203, batch_size=8, seed=5)  # 26 batches, the last one short
AT = resume_cost.positions(26)


@pytest.mark.parametrize("contender", resume_cost.CONTENDERS, ids=lambda c: c.name)
def test_each_contender_resumes_on_the_uninterrupted_run_s_batch_k(contender):
    source = next(c for c in resume_cost.CONTENDERS if c.name == contender.source)
    uninterrupted = [batch.tolist() for batch in source.make(SETUP, 0)]
    taken = resume_cost.take_states(source, SETUP, 0, AT)
    for position, k in AT.items():
        assert taken[position]["batch_k"].tolist() == uninterrupted[k], position
        assert resume_cost.timed_resume(contender, SETUP, 0, taken[position]) >= 0
    assert sorted(sum(uninterrupted, [])) == list(range(SETUP.n)), "one shuffled epoch, each sample once"


def test_a_resume_that_ignores_the_state_stops_the_run_naming_the_contender_and_k():
    make = resume_cost.CONTENDERS[0].make
    ignores = resume_cost.Contender(
        "starts over", make, resumes_by=lambda setup, workers, state: make(setup, workers)
    )
    taken = resume_cost.take_states(resume_cost.CONTENDERS[0], SETUP, 0, AT)
    with pytest.raises(AssertionError, match=r"starts over at workers=0: the resume after 13 batches"):
        resume_cost.timed_resume(ignores, SETUP, 0, taken["middle"])


def test_the_replay_contender_s_state_holds_no_sampler_state_so_the_loader_replays():
    replay = next(c for c in resume_cost.CONTENDERS if c.name == "replay")
    state = resume_cost.take_states(replay, SETUP, 0, AT)["last"]["state"]
    assert state["_index_sampler_state"] is None and state["_sampler_iter_state"] is None
    assert state["_sampler_iter_yielded"] == AT["last"]


def test_an_epoch_without_a_middle_is_refused_with_the_advice():
    with pytest.raises(ValueError, match="an epoch of 2 batches has no middle: use a larger --n"):
        resume_cost.positions(2)


def test_the_script_writes_every_cell_every_round_with_its_resume_checked(tmp_path):
    out = tmp_path / "resume.json"
    done = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-m",
            "benchmarks.resume_cost",
            "--n",
            "600",
            "--batch-size",
            "8",
            "--rounds",
            "1",
            "--workers",
            "0",
            "2",
            "--json",
            str(out),
        ],
        cwd=SCRIPT.parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert {"command", "malloc", "torch", "fastcollate", "machine"} <= set(report)
    assert report["positions"] == {"first": 1, "middle": 37, "last": 74}
    cells = {(name, workers) for name, workers in report["cells"]}
    names = [c.name for c in resume_cost.CONTENDERS]
    assert cells == {(name, 0) for name in names} | {("IndexBatches", 2), ("replay", 2)}
    runs = report["runs"]
    assert len(runs) == 2 * len(cells) * 3
    assert all(r["batches_before"] == report["positions"][r["position"]] for r in runs)
    assert {(r["contender"], r["workers"], r["position"]) for r in runs if not r["warmup"]} == {
        (name, workers, position) for name, workers in cells for position in resume_cost.POSITIONS
    }
    for name, workers in cells:
        key = f"{name} @ workers={workers}"
        assert set(report["medians_s"][key]) == set(resume_cost.POSITIONS)
        assert report["ratios"][f"{key}: last / first"]["rounds"] == 1
        assert 0 < report["state_bytes"][key] < 64 * 1024
    assert "last / first" in done.stdout
