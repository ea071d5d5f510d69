"""Exactly once across a checkpoint, through the loaders users run: torchdata's StatefulDataLoader (the
same num_workers, or another through fastcollate.sampler_state), torchdata.nodes' SamplerWrapper, and
ranks resumed on another world size; each with prefetched batches in flight when the state is taken."""

from __future__ import annotations

import collections
import random

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from fastcollate import IndexBatches, TokenBudgetBatches, sampler_state
from tests.helpers.resume import Indices, through_disk

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")


def loader_for(sampler, workers):
    return StatefulDataLoader(
        Indices(sampler.n if hasattr(sampler, "n") else len(sampler.lengths)),
        batch_sampler=sampler,
        num_workers=workers,
    )


def run_out(loader, k=None):
    """Up to k batches (all when None) of the loader's current iteration, as lists of ints."""
    got = []
    for batch in loader:
        got.append(batch.tolist())
        if k is not None and len(got) == k:
            break
    return got


def resumed_epoch(make_sampler, workers, workers_after, k, world=1, world_after=1):
    """Ranks (one loader each, in this process) take k batches of epoch 1; their states go through
    torch.save; fresh loaders on world_after ranks resume. Returns (ids before, each new rank's
    batches, the new samplers, the new loaders)."""
    samplers = [make_sampler(r, world) for r in range(world)]
    loaders = [loader_for(s, workers) for s in samplers]
    for s in samplers:
        s.set_epoch(1)
    iterators = [iter(loader) for loader in loaders]
    consumed = []
    for _ in range(k):
        for it in iterators:
            batch = next(it, None)
            if batch is not None:
                consumed.extend(batch.tolist())
    states = [through_disk(loader.state_dict()) for loader in loaders]
    del iterators, loaders  # the checkpointed job is gone
    after = [make_sampler(r, world_after) for r in range(world_after)]
    new_loaders = [loader_for(s, workers_after) for s in after]
    for rank, (sampler, loader) in enumerate(zip(after, new_loaders, strict=True)):
        if workers_after == workers and world_after == world:
            loader.load_state_dict(states[rank])
        else:
            sampler.load_state_dict(sampler_state(states[0]))
    return consumed, [run_out(loader) for loader in new_loaders], after, new_loaders


def index_sampler(n, batch_size, shuffle, drop_last):
    def make(rank, world):
        return IndexBatches(
            n, batch_size, shuffle=shuffle, seed=3, drop_last=drop_last, rank=rank, world_size=world
        )

    return make


def token_sampler(n, max_tokens, shuffle):
    lengths = [(i * 7919) % 37 + 1 for i in range(n)]

    def make(rank, world):
        return TokenBudgetBatches(lengths, max_tokens, shuffle=shuffle, seed=3, rank=rank, world_size=world)

    return make


WORKER_CHANGES = [(0, 0), (1, 1), (2, 2), (0, 2), (2, 0), (2, 1)]


def scenario(seed):
    rng = random.Random(seed)
    return dict(
        n=rng.randint(20, 90),
        batch_size=rng.randint(1, 7),
        shuffle=rng.random() < 0.7,
        drop_last=rng.random() < 0.3,
        k=rng.randint(0, 6),
    )


@pytest.mark.parametrize("workers, workers_after", WORKER_CHANGES)
@pytest.mark.parametrize("seed", [0, 1])
def test_a_stateful_dataloader_resumes_index_batches_exactly_once_under_any_worker_count(
    workers, workers_after, seed
):
    case = scenario(seed * 10 + workers * 3 + workers_after)
    make = index_sampler(case["n"], case["batch_size"], case["shuffle"], case["drop_last"])
    consumed, (rest,), (sampler,), (loader,) = resumed_epoch(make, workers, workers_after, case["k"])
    uninterrupted = IndexBatches(
        case["n"],
        case["batch_size"],
        shuffle=case["shuffle"],
        seed=3,
        drop_last=case["drop_last"],
        rank=0,
        world_size=1,
    )
    uninterrupted.set_epoch(1)
    whole = [b.tolist() for b in uninterrupted]
    assert rest == whole[min(case["k"], len(whole)) :], "the uninterrupted run's batches, from batch k on"
    assert sorted(consumed + sum(rest, [])) == sorted(sum(whole, []))
    sampler.set_epoch(2)
    uninterrupted.set_epoch(2)
    assert run_out(loader) == [b.tolist() for b in uninterrupted], "the next epoch is the ordinary one"


@pytest.mark.parametrize("workers, workers_after", [(0, 0), (2, 2), (2, 0), (0, 1)])
def test_a_stateful_dataloader_resumes_token_budget_batches_exactly_once(workers, workers_after):
    make = token_sampler(70, 80, shuffle=True)
    consumed, (rest,), _, _ = resumed_epoch(make, workers, workers_after, k=4)
    delivered = collections.Counter(consumed + sum(rest, []))
    assert sorted(delivered) == list(range(70)) and set(delivered.values()) == {1}


@pytest.mark.parametrize(
    "world, world_after, workers, workers_after", [(2, 3, 0, 0), (4, 1, 1, 0), (3, 2, 0, 2), (2, 2, 2, 2)]
)
def test_ranks_resumed_on_another_world_size_deliver_the_rest_once_in_lockstep(
    world, world_after, workers, workers_after
):
    n, batch_size, k = 61, 4, 3
    make = index_sampler(n, batch_size, shuffle=True, drop_last=False)
    consumed, rests, _, _ = resumed_epoch(make, workers, workers_after, k, world, world_after)
    assert len({len(r) for r in rests}) == 1, "every rank runs as many steps"
    delivered = collections.Counter(consumed + [i for r in rests for b in r for i in b])
    assert sorted(delivered) == list(range(n))
    assert sum(delivered.values()) - n <= (world - 1) + (world_after - 1)


def test_a_sampler_without_state_is_named_when_its_part_is_asked_for():
    loader = StatefulDataLoader(Indices(10), batch_size=2)
    next(iter(loader))
    with pytest.raises(ValueError, match="kept no state"):
        sampler_state(loader.state_dict())


def test_a_state_taken_between_snapshots_is_refused_rather_than_replayed():
    loader = StatefulDataLoader(
        Indices(40), batch_sampler=IndexBatches(40, 2), num_workers=1, snapshot_every_n_steps=4
    )
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    with pytest.raises(ValueError, match="snapshot_every_n_steps=1"):
        sampler_state(loader.state_dict())


def test_torchdata_nodes_sampler_wrapper_resumes_exactly_once():
    from torchdata.nodes import Loader, SamplerWrapper

    def make():
        sampler = IndexBatches(53, 5, shuffle=True, seed=2)
        return Loader(SamplerWrapper(sampler)), sampler

    loader, _ = make()
    iterator = iter(loader)
    consumed = [int(i) for _ in range(4) for i in next(iterator)]
    state = through_disk(loader.state_dict())
    resumed, _ = make()
    resumed.load_state_dict(state)
    rest = [int(i) for batch in resumed for i in batch]
    assert sorted(consumed + rest) == list(range(53))
    following = [int(i) for batch in resumed for i in batch]
    fresh, sampler = make()
    sampler.set_epoch(1)
    assert following == [int(i) for batch in sampler for i in batch], "the next epoch is the ordinary one"


@pytest.mark.parametrize("workers", [0, 2])
def test_lightning_resumes_from_a_mid_epoch_checkpoint_as_the_uninterrupted_run_goes_on(workers, tmp_path):
    L = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Linear(1, 1)
            self.seen = []

        def training_step(self, batch, index):
            self.seen.append(batch.tolist())
            return self.weight(batch.float()[:, None]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def fit(module, checkpoints=None, ckpt_path=None):
        loader = StatefulDataLoader(
            Indices(50), batch_sampler=IndexBatches(50, 4, shuffle=True, seed=1), num_workers=workers
        )
        callbacks = [ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=5, save_top_k=-1)]
        trainer = L.Trainer(
            max_epochs=2,
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=checkpoints is not None,
            callbacks=callbacks if checkpoints else None,
        )
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return module.seen

    uninterrupted = fit(Recorder(), checkpoints=tmp_path)
    resumed = fit(Recorder(), ckpt_path=str(tmp_path / "epoch=0-step=5.ckpt"))
    assert len(uninterrupted) == 2 * 13
    assert uninterrupted[:5] + resumed == uninterrupted, "the rest of epoch 0, then epoch 1, batch for batch"
