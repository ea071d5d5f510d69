"""doctor --resume and --resume-world-size run the factory's own batch sampler (its class, its
generator, its arguments; split by its for_rank or by its class made again), check it at checkpoints
all over the epoch whatever --seed, and hold another world size to the sampler's own resume_allowance."""

from __future__ import annotations

import pytest

from tests.helpers.resume import doctor, factory, wrong_when_resumed

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")

DATA = """
import torch, fastcollate
from torch.utils.data import Sampler
from fastcollate import IndexBatches

def data(n):
    return fastcollate.with_ids([{"x": torch.tensor([float(i)])} for i in range(n)])
"""

MAKE_WRONG = """
def make():
    return {{"dataset": data({n}), "batch_sampler": {name}({n}, 4, shuffle=True, seed=1)}}
"""

WRONG_SAMPLERS = {
    # 25 batches (13 a rank on 2): more than --checkpoints, so --seed picks the middle ones.
    "repeats-at-even-positions": dict(
        name="RepeatsAtEven",
        wrong="is even",
        does="repeats",
        wrong_when='state["batches_done"] % 2 == 0',
        action="yield batch",
        n=100,
    ),
    # 8 batches (4 a rank on 2): every one is a checkpoint.
    "skips-at-position-3": dict(
        name="SkipsAtThree",
        wrong="is 3",
        does="skips",
        wrong_when='state["batches_done"] == 3',
        action="continue",
        n=32,
    ),
}


@pytest.mark.parametrize(
    "seeds", [range(3), pytest.param(range(3, 10), marks=pytest.mark.fuzz)],  # make fuzz: seven more
    ids=lambda seeds: f"seeds-{seeds.start}-{seeds.stop - 1}",
)
@pytest.mark.parametrize(
    "mode", [["--resume"], ["--resume-world-size", "2,2"], ["--resume-world-size", "2,3"]]
)
@pytest.mark.parametrize("wrong", list(WRONG_SAMPLERS))
def test_a_sampler_wrong_at_some_checkpoints_fails_whatever_the_seed(wrong, mode, seeds, tmp_path, capsys):
    sampler = WRONG_SAMPLERS[wrong]
    # Resumed after a batch count that is sampler["wrong"], it sampler["does"] its first batch.
    source = wrong_when_resumed("IndexBatches", sampler["wrong_when"], sampler["action"], sampler["name"])
    spec = factory(tmp_path, "wrong_when_resumed", DATA + source + MAKE_WRONG.format(**sampler))
    for seed in seeds:
        # The resumed loaders load in this process (--resume-workers 0): the test runs the check per seed.
        argv = [*mode, "--seed", str(seed), "--workers", "1", "--resume-workers", "0", "--dataset", spec]
        status, text = doctor(argv, capsys)
        assert status == 1, f"--seed {seed}:\n{text}"
        assert "FAILED after batch" in text


@pytest.mark.parametrize("drop", ["drop_last=True", "sampler_drop_last=True, rank=0, world_size=1"])
def test_fewer_ranks_deliver_what_the_larger_world_size_dropped(drop, tmp_path, capsys):
    # The uninterrupted 3-rank epoch drops samples the 2-rank resume rightly delivers: the data set,
    # not that epoch, is what the resume must cover.
    source = (
        DATA
        + f"""
def make():
    return {{"dataset": data(203), "batch_sampler": IndexBatches(203, 8, shuffle=True, {drop})}}
"""
    )
    spec = factory(tmp_path, "drops", source)
    for world_sizes in ("3,2", "2,3"):
        status, text = doctor(
            ["--resume-world-size", world_sizes, "--workers", "1", "--dataset", spec], capsys
        )
        assert status == 0, text
        assert "left out by drop_last" in text, "what the rule allows is counted, not hidden"


LOG = """
import os

def logged(*facts):
    with open(os.environ["SAMPLER_LOG"], "a") as log:
        log.write(" ".join(map(str, facts)) + "\\n")
"""

LOGGED = """
class Logged(IndexBatches):
    '''Writes, at the first batch of every epoch, its class, whether it has a generator, and its split.'''

    def __iter__(self):
        logged(type(self).__name__, self.generator is not None, self.rank, self.world_size)
        yield from super().__iter__()

def make():
    generator = torch.Generator().manual_seed(5) if GENERATOR else None
    return {"dataset": data(40), "batch_sampler": Logged(40, 4, shuffle=True, generator=generator)}
"""


def with_a_log(tmp_path, monkeypatch, name, source):
    """The factory, and the file its samplers write to."""
    log = tmp_path / "sampler.log"
    monkeypatch.setenv("SAMPLER_LOG", str(log))
    return factory(tmp_path, name, DATA + LOG + source), log


def test_the_factory_s_subclass_and_its_generator_are_what_the_resumes_run(tmp_path, capsys, monkeypatch):
    spec, log = with_a_log(tmp_path, monkeypatch, "logged", "GENERATOR = True\n" + LOGGED)
    status, text = doctor(["--resume", "--workers", "1", "--dataset", spec], capsys)
    assert status == 0, text
    used = log.read_text().splitlines()
    # The checkpointed epoch, then each of the 8 checkpoints resumed twice (1 worker, then 0).
    assert len(used) == 1 + 8 * 2 and set(used) == {"Logged True 0 1"}, used


def test_each_rank_runs_the_factory_s_subclass_split_by_its_for_rank(tmp_path, capsys, monkeypatch):
    spec, log = with_a_log(tmp_path, monkeypatch, "logged", "GENERATOR = False\n" + LOGGED)
    status, text = doctor(["--resume-world-size", "2,3", "--workers", "1", "--dataset", spec], capsys)
    assert status == 0, text
    assert set(log.read_text().splitlines()) == {f"Logged False {r} {w}" for w in (2, 3) for r in range(w)}


def test_a_generator_cannot_go_to_other_ranks_and_the_check_says_so_instead_of_dropping_it(
    tmp_path, capsys, monkeypatch
):
    spec, log = with_a_log(tmp_path, monkeypatch, "logged", "GENERATOR = True\n" + LOGGED)
    status, text = doctor(["--resume-world-size", "2,3", "--workers", "1", "--dataset", spec], capsys)
    assert status == 2, text
    assert "resume check: NOT VERIFIED (exit status 2)" in text
    refused = "Logged.for_rank(0, 2) refused: ValueError: generator: cannot be combined with rank and "
    refused += "world_size"
    assert refused in text
    assert not log.exists(), "no loader ran a sampler the factory did not give"


DELEGATING = """
class Delegating(Sampler):
    '''A user's batch sampler that splits by rank (DistributedSampler's names) and keeps its state in an
    IndexBatches, but has no for_rank.'''

    def __init__(self, n, batch_size, rank=0, num_replicas=1):
        self.n, self.batch_size, self.rank, self.num_replicas = n, batch_size, rank, num_replicas
        self.inner = IndexBatches(n, batch_size, shuffle=True, rank=rank, world_size=num_replicas)

    def __iter__(self):
        logged(type(self).__name__, self.rank, self.num_replicas)
        yield from self.inner

    def __len__(self):
        return len(self.inner)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)

def make():
    return {"dataset": data(48), "batch_sampler": Delegating(48, 3)}
"""

STATES_ITS_ALLOWANCE = """
def resume_allowance(self, world_size, resumed_world_size):
    return self.inner.resume_allowance(world_size, resumed_world_size)

Delegating.resume_allowance = resume_allowance
"""


def test_a_sampler_without_for_rank_is_made_again_by_its_class_with_new_rank_arguments(
    tmp_path, capsys, monkeypatch
):
    spec, log = with_a_log(tmp_path, monkeypatch, "delegating", DELEGATING + STATES_ITS_ALLOWANCE)
    status, text = doctor(["--resume-world-size", "2,4", "--workers", "1", "--dataset", spec], capsys)
    assert status == 0, text
    assert "repeated as accounted for" in text, "the repeats its resume_allowance states are accepted"
    assert set(log.read_text().splitlines()) == {f"Delegating {r} {w}" for w in (2, 4) for r in range(w)}


def test_a_sampler_without_resume_allowance_is_held_to_exactly_once_and_the_report_says_so(
    tmp_path, capsys, monkeypatch
):
    # 48 samples on 2 ranks, resumed on 4 after an odd number of batches of 3: 42, 30, 18 or 6 left,
    # padded to a multiple of 4. Padding the sampler does not state is a repeat like any other.
    spec, _ = with_a_log(tmp_path, monkeypatch, "delegating", DELEGATING)
    status, text = doctor(["--resume-world-size", "2,4", "--workers", "1", "--dataset", spec], capsys)
    assert status == 1, text
    assert (
        "note: Delegating has no resume_allowance(world_size, resumed_world_size): "
        "held to every sample exactly once"
    ) in text
    assert "duplicated (2)" in text


@pytest.mark.parametrize(
    "constructor, reason",
    [
        (
            "def __init__(self, n, batch_size):\n        self.n, self.batch_size = n, batch_size",
            "Unsplittable has no for_rank(rank, world_size), and its constructor takes no rank and "
            "world_size",
        ),
        (
            "def __init__(self, n, batch_size, rank=0, world_size=1):\n"
            "        self.size, self.batch_size = n, batch_size\n"
            "        self.rank, self.world_size = rank, world_size",
            "its constructor takes n, which it keeps in no attribute of that name",
        ),
        (
            "def __init__(self, *parts, rank=0, world_size=1):\n"
            "        self.rank, self.world_size = rank, world_size",
            "its constructor takes *parts, whose arguments cannot be read back",
        ),
    ],
    ids=["no-rank-arguments", "an-argument-kept-under-another-name", "variadic"],
)
def test_a_sampler_that_cannot_be_split_by_rank_is_not_verified_with_the_reason(
    constructor, reason, tmp_path, capsys
):
    source = (
        DATA
        + f"""
class Unsplittable(Sampler):
    {constructor}

    def __iter__(self):
        return iter([list(range(i, min(i + 4, 40))) for i in range(0, 40, 4)])

    def __len__(self):
        return 10

def make():
    return {{"dataset": data(40), "batch_sampler": Unsplittable(40, 4)}}
"""
    )
    spec = factory(tmp_path, "unsplittable", source)
    status, text = doctor(["--resume-world-size", "2,3", "--workers", "1", "--dataset", spec], capsys)
    assert status == 2, text
    assert "resume check: NOT VERIFIED (exit status 2)" in text and reason in text, text
