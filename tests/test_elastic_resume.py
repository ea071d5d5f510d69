"""Real DDP jobs (gloo, on the CPU, started by torchrun) stopped at a checkpoint on W ranks and resumed on
W' ranks, under Lightning's Trainer (``trainer.fit(..., ckpt_path=...)`` with ``ExactResume``) and in the
plain torchrun idiom (``fastcollate.sampler_state``), for W -> W' in 2 -> 1, 1 -> 2, 2 -> 3, 3 -> 2, with
IndexBatches and TokenBudgetBatches, from the middle of an epoch and from its last batch. Some read
ahead of the training step (workers, or DeviceLoaderCallback's staged batches), and the plain idiom
resumes 2 -> 3 on another num_workers too.

Each is judged twice: by the ids, counted per epoch across the ranks (every sample the interrupted
epoch had not consumed comes, TokenBudgetBatches' once, IndexBatches' within its stated allowance, and
every later epoch delivers all samples), and batch for batch against what the sampler gives each rank.
Under Lightning, the Trainer's own counts (``num_training_batches``, the batch index, the progress bar,
the global step) must agree with what was delivered. The jobs are in tests/helpers/elastic_job.py.
"""

from __future__ import annotations

import collections
import json
import sys

import pytest

from tests.helpers.elastic_job import EPOCHS, N, make_sampler
from tests.helpers.processes import ROOT, run_at_once
from tests.helpers.resume import assert_every_sample, state_after

pytest.importorskip("lightning")
pytestmark = pytest.mark.slow

CHANGES = [(2, 1), (1, 2), (2, 3), (3, 2)]
KINDS = ["lightning", "plain"]
SAMPLERS = ["index", "tokens"]
PLACES = ["mid", "last"]
MID = 3  # batches a rank runs before a mid-epoch checkpoint


def stop_at(sampler: str, world: int, place: str) -> int:
    return MID if place == "mid" else len(make_sampler(sampler, 0, world))


def torchrun(world: int, plan: str) -> list[str]:
    job = str(ROOT / "tests" / "helpers" / "elastic_job.py")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", job,
            plan]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every job, checkpointed then resumed: {(kind, sampler, W, W', place): (before, after)}, each a
    list over ranks of {"epochs": {epoch: [batch, ...]}, ...} as the ranks wrote them."""
    folder = tmp_path_factory.mktemp("elastic")
    cases = [(kind, sampler, w, w2, place) for kind in KINDS for sampler in SAMPLERS for w, w2 in CHANGES
             for place in PLACES]

    def name(*parts) -> str:
        return str(folder / "-".join(map(str, parts)))

    # One start a world size: its job saves the checkpoints it takes on W ranks, waits for the others',
    # then resumes on W' ranks the checkpoints taken on W.
    worlds = {w for change in CHANGES for w in change}
    plans = {w: {"save": {}, "saved": name("saved", w), "wait_for": set(), "resume": []} for w in worlds}
    for kind, sampler, w, w2, place in cases:
        saved = name(kind, sampler, w, place)
        # Loaders that read ahead of the training step: workers prefetching, and DeviceLoader's staged
        # batches; the plain idiom also changes num_workers with the world size.
        ahead = {"workers": 2 * (kind == "lightning" and w == 1),
                 "device_loader": kind == "lightning" and w == 3}
        plans[w]["save"][saved] = {"kind": kind, "sampler": sampler, "stop_at": stop_at(sampler, w, place),
                                   "save": saved + ".ckpt", "out": saved, **ahead}  # serves every W'
        plans[w2]["wait_for"].add(plans[w]["saved"])
        if kind == "plain" and w2 == 3:
            ahead = {"workers": 2}
        plans[w2]["resume"].append({"kind": kind, "sampler": sampler, "resume": saved + ".ckpt",
                                    "out": name(kind, sampler, w, w2, place), **ahead})
    commands = {}
    for world, plan in plans.items():
        path = folder / f"plan-{world}.json"
        plan |= {"save": list(plan["save"].values()), "wait_for": sorted(plan["wait_for"])}
        path.write_text(json.dumps(plan))
        commands[f"{world} ranks"] = torchrun(world, str(path))
    for what, (status, output) in run_at_once(commands, timeout_s=300).items():
        assert status == 0, f"{what}:\n{output[-4000:]}"

    def ranks(out: str, world: int) -> list[dict]:
        return [json.loads(open(f"{out}.rank{rank}.json").read()) for rank in range(world)]

    return {
        (kind, sampler, w, w2, place): (ranks(name(kind, sampler, w, place), w),
                                        ranks(name(kind, sampler, w, w2, place), w2))
        for kind, sampler, w, w2, place in cases
    }


def expected_after(sampler: str, world: int, world_after: int, place: str) -> list[dict[int, list]]:
    """What each of the W' ranks' samplers hands out once loaded with rank 0's state at the checkpoint:
    the rest of epoch 0, then the ordinary later epochs."""
    state = state_after(make_sampler(sampler, 0, world), stop_at(sampler, world, place))
    ranks = []
    for rank in range(world_after):
        resumed = make_sampler(sampler, rank, world_after)
        resumed.load_state_dict(state)
        epochs = {0: [list(map(int, batch)) for batch in resumed]}
        for epoch in range(1, EPOCHS):
            resumed.set_epoch(epoch)
            epochs[epoch] = [list(map(int, batch)) for batch in resumed]
        ranks.append(epochs)
    return ranks


def ids(ranks: list[dict], epoch: int) -> collections.Counter:
    batches = [batch for rank in ranks for batch in rank["epochs"].get(str(epoch), [])]
    return collections.Counter(i for batch in batches for i in batch)


CASES = [(kind, sampler, w, w2, place) for kind in KINDS for sampler in SAMPLERS for w, w2 in CHANGES
         for place in PLACES]


@pytest.mark.parametrize("kind,sampler,world,world_after,place", CASES,
                         ids=lambda value: str(value))
def test_every_sample_comes_in_the_resumed_epoch_and_every_later_one(runs, kind, sampler, world, world_after,
                                                                      place):
    before, after = runs[kind, sampler, world, world_after, place]
    what = f"{kind} {sampler} {world} -> {world_after} ranks, checkpoint at the epoch's {place}"
    for rank in before:
        assert len(rank["epochs"]["0"]) == stop_at(sampler, world, place)  # each rank stopped there
    # IndexBatches pads the epoch, as DistributedSampler does, before and after the checkpoint.
    assert_every_sample(ids(before, 0) + ids(after, 0), sampler, (world - 1) + (world_after - 1),
                        f"{what}, epoch 0", n=N)
    for epoch in range(1, EPOCHS):
        assert_every_sample(ids(after, epoch), sampler, world_after - 1, f"{what}, epoch {epoch}", n=N)
    expected = expected_after(sampler, world, world_after, place)
    for rank, (delivered, wanted) in enumerate(zip(after, expected, strict=True)):
        for epoch in range(EPOCHS):
            got = delivered["epochs"].get(str(epoch), [])
            assert got == wanted[epoch], f"{what}: rank {rank}, epoch {epoch}"


@pytest.mark.parametrize("sampler,world,world_after,place",
                         [(s, w, w2, p) for s in SAMPLERS for w, w2 in CHANGES for p in PLACES],
                         ids=lambda value: str(value))
def test_lightnings_counts_agree_with_what_was_delivered(runs, sampler, world, world_after, place):
    before, after = runs["lightning", sampler, world, world_after, place]
    run = 0
    for rank, record in enumerate(after):
        for epoch in range(EPOCHS):
            batches = len(record["epochs"].get(str(epoch), []))
            if epoch == 0:
                batches += stop_at(sampler, world, place)  # run before the checkpoint
            run += batches if rank == 0 else 0
            if str(epoch) in record["counts"]:  # an epoch resumed at its last batch is closed, not ended
                assert record["counts"][str(epoch)] == [batches, batches], f"rank {rank}, epoch {epoch}"
            # The epoch a restart continues gets no on_train_epoch_start, so no bar total (Lightning's
            # own): after a checkpoint at the last batch that is the next epoch.
            if epoch > (place == "last") and rank == 0:
                assert record["bar"][str(epoch)] == [batches, batches], f"epoch {epoch}'s progress bar"
        assert record["global_step"] == after[0]["global_step"]
    assert after[0]["global_step"] == run

