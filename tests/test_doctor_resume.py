"""doctor --resume's check: loaders resumed from checkpoints all over an epoch go on as the loader they
were checkpointed from, or the ids lost and repeated are named (exit 1); a loader no checkpoint can hold
is exit 2, with the reason."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

import fastcollate
from fastcollate import IndexBatches
from fastcollate.tools.audit.resume_check import ResumeCheck, checkpoint_positions
from tests.helpers.resume import doctor

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


def test_index_batches_resume_exactly_once_at_every_checkpoint_on_the_same_and_another_worker_count():
    lines = []
    report = check(stateful(lambda r, w: IndexBatches(N, 7, shuffle=True, seed=1).for_rank(r, w)), lines)
    assert report["exit_status"] == 0, lines
    positions = report["checkpoints"]
    assert len(positions) == 8 and positions[0] == 1 and positions[-1] == 9, (
        "the first batch and the epoch done"
    )
    resumed = [(run["what"][:14], run["after_batch"], run["report"]["delivered"]) for run in report["runs"]]
    assert resumed == [(what, k, N) for what in ("workers 1 -> 1", "workers 1 -> 0") for k in positions]
    assert (
        "  workers 1 -> 0 (the sampler's part of it): OK at 8 checkpoints, "
        "every one of 60 samples delivered once" in lines
    )


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize(
    "batches, count", [(2, 8), (8, 8), (9, 8), (32, 8), (1000, 8), (40, 2), (40, 3), (40, 5)]
)
def test_checkpoints_take_every_batch_of_a_short_epoch_else_both_ends_and_one_in_each_stretch(
    batches, count, seed
):
    positions = checkpoint_positions(batches, count, seed)
    if batches <= count:
        assert positions == list(range(1, batches + 1))
        return
    assert len(positions) == count == len(set(positions)) and positions == sorted(positions)
    assert positions[0] == 1 and positions[-1] == batches, "after the first batch, and the epoch done"
    if count >= 5:
        # An even and an odd position at either end, and 3: a sampler wrong every second or third is caught.
        assert {2, 3, batches - 1} <= set(positions)
        middle = positions[3:-2]  # one in each equal stretch of 4 .. batches - 2
        stretch = (batches - 5) / len(middle) if middle else 0
        assert all(4 + i * stretch - 1 < k < 4 + (i + 1) * stretch for i, k in enumerate(middle)), middle


def test_the_seed_picks_other_middle_checkpoints_in_a_long_epoch():
    assert len({tuple(checkpoint_positions(100, 8, seed)) for seed in range(10)}) > 5


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
    resumed = next(run["report"] for run in report["runs"] if not run["report"]["ok"])
    assert resumed["duplicated"]["count"] + resumed["missing"]["count"] > 0
    named = [entry["id"] for entry in resumed["duplicated"]["ids"]] + resumed["missing"]["ids"]
    text = "\n".join(lines)
    assert "FAILED" in text
    assert "TagWorker" not in text, "a resume compares what jobs delivered; its workers are not the point"
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
    report = check(
        stateful(lambda r, w: IndexBatches(N + 1, 4, shuffle=True).for_rank(r, w), N + 1),
        lines,
        world_sizes=world_sizes,
        dataset_ids=N + 1,
        other_workers=None,
    )
    assert report["exit_status"] == 0, lines
    assert [run["after_batch"] for run in report["runs"]] == report["checkpoints"], "one resume a checkpoint"
    assert lines[1].startswith(f"  {world_sizes[0]} ranks -> {world_sizes[1]} rank"), lines


def test_a_resume_on_another_world_size_without_the_data_set_s_ids_is_not_verified():
    lines = []
    report = check(stateful(lambda r, w: IndexBatches(N, 4).for_rank(r, w)), lines, world_sizes=(2, 3))
    assert report["exit_status"] == 2 and "the data set's ids" in report["unverified"], lines


class CountsTwoMore(IndexBatches):
    """A sampler whose len() says more batches than it hands out: a training loop counting on it waits."""

    def __len__(self):
        return super().__len__() + 2


def test_a_loader_whose_len_says_more_batches_than_its_epoch_has_fails_saying_so():
    lines = []
    report = check(stateful(lambda r, w: CountsTwoMore(N, 7, shuffle=True)), lines)
    assert report["exit_status"] == 1, lines
    assert "  the checkpointed epoch: FAILED" in lines
    assert "    the epoch ran 9 batches a rank, not the 11 its len() says" in lines
    assert max(report["checkpoints"]) <= 9, "no resume from a checkpoint never taken"


def test_ranks_that_resume_unevenly_fail():
    class Uneven(IndexBatches):
        def load_state_dict(self, state):
            super().load_state_dict(state)
            if self.rank == 0:
                self.set_epoch(self.epoch + 1)  # rank 0 starts the next epoch whole: more steps

    lines = []
    report = check(stateful(lambda r, w: Uneven(N, 4, rank=r, world_size=w)), lines, world_sizes=(2, 2),
                   dataset_ids=N)
    assert report["exit_status"] == 1
    assert "different numbers of steps" in "\n".join(lines)


EXAMPLE = "examples/padded_text.py"


def test_padded_text_from_its_factory_resumes_exactly_once_through_the_command(capsys):
    status, text = doctor(["--resume", "--workers", "1", "--dataset", f"{EXAMPLE}:make_resumable"], capsys)
    assert status == 0, text
    assert (
        "workers 1 -> 0 (the sampler's part of it): OK at 8 checkpoints, "
        "every one of 512 samples delivered once" in text
    )
    assert re.search(r"^resume check: OK \(exit status 0\) in \d+\.\d s, 8 checkpoints$", text, re.M), text


def test_the_command_resumes_ranks_on_another_world_size(capsys):
    argv = ["--resume-world-size", "3,2", "--workers", "1", "--dataset", f"{EXAMPLE}:make_resumable"]
    status, text = doctor(argv, capsys)
    assert status == 0, text
    assert "3 ranks -> 2 ranks, workers 1: OK at 8 checkpoints" in text


def test_the_loader_s_own_shuffling_resumes_on_its_worker_count_and_says_how_to_check_another(capsys):
    status, text = doctor(["--resume", "--workers", "1", "--dataset", f"{EXAMPLE}:make"], capsys)
    assert status == 0, text
    assert "workers 1 -> 1 (the loader's own state): OK at 8 checkpoints" in text
    assert (
        "note: a resume on another worker count needs a batch sampler that keeps state, such as "
        "fastcollate.IndexBatches, and its shuffling keeps none: not checked (--resume-workers N checks it)"
    ) in text
    assert "workers 1 -> 0" not in text


def test_another_worker_count_asked_of_the_loader_s_own_shuffling_is_not_verified_and_says_why(capsys):
    argv = ["--resume", "--workers", "1", "--resume-workers", "2", "--dataset", f"{EXAMPLE}:make"]
    status, text = doctor(argv, capsys)
    assert status == 2, text
    assert "workers 1 -> 1 (the loader's own state): OK" in text
    assert (
        "workers 1 -> 2 (the sampler's part of it): NOT VERIFIED: "
        "its batch sampler (BatchSampler) keeps no state" in text
    )
    assert "resume check: NOT VERIFIED (exit status 2) in " in text


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
        (["--resume", "--checkpoints", "1"], "--checkpoints: must be at least 2"),
        (["--resume", "--resume-workers", "-1"], "--resume-workers: must be at least 0"),
    ],
)
def test_bad_resume_options_are_usage_errors(argv, message, capsys):
    status, text = doctor([*argv, "--dataset", f"{EXAMPLE}:make_resumable"], capsys)
    assert status == 2 and message in text, text


def test_world_sizes_without_a_batch_sampler_are_not_verified_and_say_what_would_work(capsys):
    status, text = doctor(["--resume-world-size", "2,3", "--dataset", f"{EXAMPLE}:make"], capsys)
    assert status == 2, text
    assert "resume check: NOT VERIFIED (exit status 2)" in text
    assert "the factory gives none" in text and "such as fastcollate.IndexBatches" in text


def shown_without_the_time(text):
    return re.sub(r" in \d+\.\d s,", " in (time) s,", text.split("resume check: 8 checkpoints", 1)[1]).strip()


def test_the_resume_check_the_docs_show_is_what_the_command_prints(capsys):
    page = (Path(__file__).resolve().parent.parent / "docs" / "measuring.md").read_text()
    shown = page.split("resume check: 8 checkpoints", 1)[1].split("```", 1)[0]
    status, text = doctor(["--resume", "--dataset", f"{EXAMPLE}:make_resumable"], capsys)
    assert status == 0
    assert shown_without_the_time(text) == shown_without_the_time("resume check: 8 checkpoints" + shown)
