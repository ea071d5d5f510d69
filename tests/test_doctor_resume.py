"""doctor --resume's check: a loader resumed from a checkpoint at a random batch delivers the epoch
exactly once, or the ids lost and repeated are named (exit 1); a loader no checkpoint can hold is
exit 2, with the reason."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

import fastcollate
from fastcollate import IndexBatches
from fastcollate.tools.audit.resume_check import ResumeCheck

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")

N = 60


def dataset(n=N):
    return fastcollate.with_ids([{"x": torch.tensor([float(i)])} for i in range(n)])


def stateful(batch_sampler, n=N):
    def make(workers, rank, world_size):
        sampler = batch_sampler(rank, world_size)
        return StatefulDataLoader(
            dataset(n), batch_sampler=sampler, num_workers=workers, collate_fn=fastcollate.assemble
        )

    return make


def check(make_loader, lines, **options):
    options = {"workers": 1, "other_workers": 0, "seed": 3} | options
    return ResumeCheck(make_loader, out=lines.append, **options).run()


def test_index_batches_resume_exactly_once_on_the_same_and_another_worker_count():
    lines = []
    report = check(stateful(lambda r, w: IndexBatches(N, 7, shuffle=True, seed=1).for_rank(r, w)), lines)
    assert report["exit_status"] == 0, lines
    assert [run["report"]["delivered"] for run in report["runs"]] == [N, N]
    assert "  workers 1 -> 0 (the sampler's part of it): OK, every one of 60 samples delivered once" in lines


class Reshuffled(Sampler):
    """A user's batch sampler without state, drawing a new order every epoch from the global RNG."""

    def __init__(self, n, batch_size):
        self.n, self.batch_size = n, batch_size

    def __len__(self):
        return -(-self.n // self.batch_size)

    def __iter__(self):
        order = list(range(self.n))
        random.shuffle(order)
        return iter([order[i : i + self.batch_size] for i in range(0, self.n, self.batch_size)])


class ForgetsThePosition(IndexBatches):
    """A stateful sampler whose state keeps the epoch and nothing of how far it went."""

    def state_dict(self):
        return {"epoch": self.epoch}

    def load_state_dict(self, state):
        self.set_epoch(state["epoch"])


@pytest.mark.parametrize(
    "batch_sampler",
    [
        lambda r, w: Reshuffled(N, 7),
        lambda r, w: BatchSampler(RandomSampler(range(N)), 7, drop_last=False),  # no generator
        lambda r, w: ForgetsThePosition(N, 7, shuffle=True),
    ],
    ids=["sampler-without-state", "random-sampler-without-generator", "state-without-position"],
)
def test_a_loader_that_resumes_wrong_fails_naming_the_ids_lost_and_repeated(batch_sampler):
    lines = []
    report = check(stateful(batch_sampler), lines)
    assert report["exit_status"] == 1, lines
    resumed = report["runs"][0]["report"]
    assert resumed["duplicated"]["count"] + resumed["missing"]["count"] > 0
    named = [entry["id"] for entry in resumed["duplicated"]["ids"]] + resumed["missing"]["ids"]
    text = "\n".join(lines)
    assert "FAILED" in text
    assert (
        f"duplicated ({resumed['duplicated']['count']}): {named[0]} x" in text
        or f"missing ({resumed['missing']['count']}): {named[0]}" in text
    ), "the ids and their count are named"


def test_a_loader_without_state_is_not_verified_and_says_why():
    lines = []
    report = check(
        lambda w, r, s: DataLoader(dataset(), batch_size=7, num_workers=w, collate_fn=fastcollate.assemble),
        lines,
    )
    assert report["exit_status"] == 2
    assert "has no state_dict: use torchdata's StatefulDataLoader" in "\n".join(lines)


def test_an_epoch_too_short_to_checkpoint_is_not_verified():
    lines = []
    report = check(stateful(lambda r, w: IndexBatches(N, 60)), lines)
    assert report["exit_status"] == 2 and "1 batches a rank" in report["unverified"]


@pytest.mark.parametrize("world_sizes", [(2, 3), (4, 1), (3, 3)])
def test_ranks_resumed_on_another_world_size_deliver_the_epoch_once(world_sizes):
    lines = []
    world, world_after = world_sizes
    report = check(
        stateful(lambda r, w: IndexBatches(N + 1, 4, shuffle=True).for_rank(r, w), N + 1),
        lines,
        world_sizes=world_sizes,
        allowed_repeats=(world - 1) + (world_after - 1),
    )
    assert report["exit_status"] == 0, lines
    assert len(report["runs"]) == 1


def test_ranks_that_resume_unevenly_fail():
    class Uneven(IndexBatches):
        def load_state_dict(self, state):
            super().load_state_dict(state)
            if self.rank == 0:
                self.set_epoch(self.epoch + 1)  # rank 0 starts the next epoch whole: more steps

    lines = []
    report = check(stateful(lambda r, w: Uneven(N, 4, rank=r, world_size=w)), lines, world_sizes=(2, 2))
    assert report["exit_status"] == 1
    assert "different numbers of steps" in "\n".join(lines)


def doctor(argv, capsys):
    from fastcollate.tools.audit.doctor import main

    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out + captured.err


EXAMPLE = "examples/padded_text.py"


def test_padded_text_from_its_factory_resumes_exactly_once_through_the_command(capsys):
    status, text = doctor(["--resume", "--workers", "1", "--dataset", f"{EXAMPLE}:make_resumable"], capsys)
    assert status == 0, text
    assert "workers 1 -> 0 (the sampler's part of it): OK, every one of 512 samples delivered once" in text


def test_the_command_resumes_ranks_on_another_world_size(capsys):
    argv = ["--resume-world-size", "3,2", "--workers", "1", "--dataset", f"{EXAMPLE}:make_resumable"]
    status, text = doctor(argv, capsys)
    assert status == 0, text
    assert "3 ranks -> 2 ranks, workers 1: OK" in text


def test_a_loader_whose_sampler_keeps_no_state_is_not_verified_across_worker_counts(capsys):
    status, text = doctor(["--resume", "--workers", "1", "--dataset", f"{EXAMPLE}:make"], capsys)
    assert status == 2, text
    assert "workers 1 -> 1 (the loader's own state): OK" in text
    assert "NOT VERIFIED: its batch sampler (BatchSampler) keeps no state" in text


def test_a_factory_whose_sampler_resumes_wrong_fails_through_the_command(capsys, tmp_path):
    factory = tmp_path / "reshuffled_text.py"
    factory.write_text(
        "from torch.utils.data import BatchSampler, RandomSampler\n"
        "import fastcollate\n"
        "def make():\n"
        "    data = fastcollate.with_ids([{'x': float(i)} for i in range(40)])\n"
        "    return {'dataset': data, 'batch_sampler': BatchSampler(RandomSampler(data), 5, False)}\n"
    )
    status, text = doctor(["--resume", "--workers", "1", "--dataset", f"{factory}:make"], capsys)
    assert status == 1, text
    assert "FAILED" in text and "duplicated (" in text and "missing (" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--resume-world-size", "2"], "want two world sizes as W,W2"),
        (["--resume-world-size", "0,2"], "must be at least 1"),
    ],
)
def test_bad_world_sizes_are_usage_errors(argv, message, capsys):
    status, text = doctor([*argv, "--dataset", f"{EXAMPLE}:make_resumable"], capsys)
    assert status == 2 and message in text


def test_world_sizes_need_a_batch_sampler_that_splits_by_rank(capsys):
    status, text = doctor(["--resume-world-size", "2,3", "--dataset", f"{EXAMPLE}:make"], capsys)
    assert status == 2 and "gives no batch_sampler that splits by rank" in text


def test_the_resume_check_the_docs_show_is_what_the_command_prints(capsys):
    page = (Path(__file__).resolve().parent.parent / "docs" / "measuring.md").read_text()
    shown = page.split("resume check: a checkpoint after batch", 1)[1].split("```", 1)[0]
    status, text = doctor(["--resume", "--dataset", f"{EXAMPLE}:make_resumable"], capsys)
    assert status == 0
    printed = text.split("resume check: a checkpoint after batch", 1)[1]
    assert printed.strip() == shown.strip()
