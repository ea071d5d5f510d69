"""fastcollate.lightning: DeviceLoaderCallback under Lightning's Trainer, on the CPU (one check on a GPU).

On the CPU the callback's DeviceLoaders pass batches through, so "no second copy" is checked as: the
tensors that reach training_step are the very ones a DeviceLoader handed out (same data_ptr and device).
A DeviceLoader subclass put in the callback's module records what it hands out. DDP runs as
examples/lightning_train.py in subprocesses: Lightning's launcher re-executes sys.argv for the other rank.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import multiprocessing
import os
import pickle
import subprocess
import sys
from functools import partial

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import fastcollate
from fastcollate import DeviceLoader

L = pytest.importorskip("lightning")
from lightning.fabric.utilities.seed import pl_worker_init_function  # noqa: E402  (after the skip)
from lightning.pytorch.callbacks import BasePredictionWriter  # noqa: E402

import fastcollate.integrations.lightning as fastcollate_lightning  # noqa: E402
from fastcollate.integrations.lightning import DeviceLoaderCallback  # noqa: E402
from tests.helpers.processes import run_at_once  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "lightning_train.py")
EXAMPLE_SEED = 0  # its seed_everything(0): Lightning's DistributedSampler shuffles with it


def _load_example():
    """examples/lightning_train.py as a module (its main() runs only as a script): the tests use its
    dataset and size, so the example and the tests cannot drift apart."""
    spec = importlib.util.spec_from_file_location("lightning_train_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _load_example()
Points = example.Points
EXAMPLE_DATASET_SIZE = example.DATASET_SIZE


def loader(size: int = 40, shuffle: bool = True, **kwargs) -> DataLoader:
    return DataLoader(fastcollate.with_ids(Points(size)), batch_size=8, shuffle=shuffle,
                      collate_fn=fastcollate.assemble, **kwargs)


def pointers(batch: dict) -> tuple:
    """Where each of the batch's tensors lives: a copy anywhere on the way would change it."""
    return tuple((batch[key].data_ptr(), str(batch[key].device)) for key in ("x", "y", "id"))


class Recorder(L.LightningModule):
    """Records every batch that reaches training_step and validation_step."""

    def __init__(self, fail_at_batch: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.fail_at_batch = fail_at_batch
        self.trained: list[tuple[int, list[int], tuple]] = []  # (epoch, ids, pointers) per batch
        self.validated: list[tuple] = []
        self.workers_seen: set[int] = set()

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at_batch:
            raise RuntimeError("training_step failed on purpose")
        self.trained.append((self.current_epoch, batch["id"].tolist(), pointers(batch)))
        self.workers_seen |= {child.pid for child in multiprocessing.active_children()}
        return torch.nn.functional.cross_entropy(self.layer(batch["x"]), batch["y"])

    def validation_step(self, batch, batch_idx):
        self.validated.append(pointers(batch))

    def predict_step(self, batch, batch_idx):
        return batch["id"]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(accelerator: str = "cpu", callbacks=None, max_epochs: int = 2, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator=accelerator, devices=1, max_epochs=max_epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[DeviceLoaderCallback()] if callbacks is None else callbacks, **kwargs,
    )


@pytest.fixture
def made(monkeypatch) -> list:
    """Every DeviceLoader the callback makes, each recording the pointers of the batches it hands out."""
    made: list[DeviceLoader] = []

    class RecordingDeviceLoader(DeviceLoader):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.handed_out: list[tuple] = []
            made.append(self)

        def __iter__(self):
            for batch in super().__iter__():
                self.handed_out.append(pointers(batch))
                yield batch

    monkeypatch.setattr(fastcollate_lightning, "DeviceLoader", RecordingDeviceLoader)
    return made


def assert_closed(device_loaders) -> None:
    for device_loader in device_loaders:
        with pytest.raises(RuntimeError, match="after close"):
            next(iter(device_loader))  # next: the recording subclass's __iter__ is a generator


def assert_hook_restored(fitted: L.Trainer) -> None:
    # the callback set process_dataloader on the strategy instance; the class's method applies again
    assert "process_dataloader" not in vars(fitted.strategy)


# ---- Lightning stays optional ---------------------------------------------------------------------


def test_import_fastcollate_imports_no_lightning():
    names = "sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', " \
            "'lightning_fabric'))"
    result = subprocess.run(
        [sys.executable, "-c", f"import sys, fastcollate; print({names})"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_without_lightning_the_import_says_how_to_install_it(monkeypatch):
    for name in [name for name in sys.modules if name == "lightning" or name.startswith("lightning.")]:
        monkeypatch.setitem(sys.modules, name, None)  # None: "import lightning" raises ImportError
    monkeypatch.delitem(sys.modules, "fastcollate.integrations.lightning")
    with pytest.raises(ImportError, match=r"fastcollate.lightning needs Lightning.*pip install lightning"):
        importlib.import_module("fastcollate.integrations.lightning")


# ---- One process ----------------------------------------------------------------------------------


def test_batches_reach_training_step_as_the_device_loader_handed_them_out(made):
    model = Recorder()
    fitted = trainer()
    train, val = loader(40), loader(16, shuffle=False)  # val: 2 batches, the sanity check's 2 steps
    fitted.fit(model, train, val)

    train_loader, val_loader = fitted.train_dataloader, fitted.val_dataloaders
    assert isinstance(train_loader, DeviceLoader) and isinstance(val_loader, DeviceLoader)
    assert type(train_loader.loader) is DataLoader and train_loader.loader.dataset is train.dataset
    assert train_loader.device == fitted.strategy.root_device == torch.device("cpu")
    # Lightning's transfer_batch_to_device copied nothing: the same tensors, batch for batch
    assert [seen for _, _, seen in model.trained] == train_loader.handed_out
    assert len(train_loader.handed_out) == 2 * 5
    assert model.validated == val_loader.handed_out and len(model.validated) == 3 * 2  # sanity + 2 epochs
    for epoch in (0, 1):
        ids = [i for e, batch_ids, _ in model.trained if e == epoch for i in batch_ids]
        assert sorted(ids) == list(range(40))
    assert_hook_restored(fitted)
    assert sorted(map(id, made)) == sorted(map(id, (train_loader, val_loader)))
    assert_closed(made)


def test_reloaded_dataloaders_are_wrapped_again_and_all_closed(made):
    model = Recorder()
    model.train_dataloader = lambda: loader(24)  # a fresh DataLoader each time Lightning asks
    fitted = trainer(reload_dataloaders_every_n_epochs=1)
    fitted.fit(model)

    assert len(made) == 2 and made[0].loader is not made[1].loader  # one DeviceLoader per epoch's loader
    for epoch, device_loader in enumerate(made):
        assert [seen for e, _, seen in model.trained if e == epoch] == device_loader.handed_out
        assert sorted(i for e, ids, _ in model.trained if e == epoch for i in ids) == list(range(24))
    assert_hook_restored(fitted)
    assert_closed(made)


class BatchIndexWriter(BasePredictionWriter):
    """What Lightning tells a prediction writer: each batch's dataset indices, and its prediction."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self.written: list[tuple[list[int], list[int]]] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx,
                           dataloader_idx):
        self.written.append((batch_indices, prediction.tolist()))


def test_predict_loaders_are_wrapped_and_writers_still_get_each_batchs_indices(made):
    writer = BatchIndexWriter()
    fitted = trainer(callbacks=[DeviceLoaderCallback(), writer])
    predictions = fitted.predict(Recorder(), loader(20, shuffle=False))
    assert isinstance(fitted.predict_dataloaders, DeviceLoader)
    # Lightning reads the indices through DeviceLoader's batch_sampler, by batch: the batches the
    # DeviceLoader fetched ahead do not shift them
    expected = [list(range(start, min(start + 8, 20))) for start in (0, 8, 16)]
    assert writer.written == [(ids, ids) for ids in expected]
    assert [p.tolist() for p in predictions] == expected
    assert_hook_restored(fitted)
    assert_closed(made)


def test_seed_everything_workers_seeds_the_wrapped_dataloader(monkeypatch):
    monkeypatch.setenv("PL_SEED_WORKERS", "1")  # what seed_everything(workers=True) sets
    fitted = trainer(max_epochs=1, limit_train_batches=1)
    fitted.fit(Recorder(), loader(16))
    worker_init_fn = fitted.train_dataloader.loader.worker_init_fn
    assert isinstance(worker_init_fn, partial) and worker_init_fn.func is pl_worker_init_function
    assert worker_init_fn.keywords == {"rank": fitted.global_rank}


def test_without_lightnings_seeding_helper_seeded_workers_are_refused_not_lost(monkeypatch):
    monkeypatch.setattr(fastcollate_lightning, "_auto_add_worker_init_fn", None)
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)
    unseeded = loader(8)
    fastcollate_lightning._seed_workers(unseeded, rank=0)  # not asked for: nothing to do
    assert unseeded.worker_init_fn is None

    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    with pytest.raises(RuntimeError, match="worker_init_fn=functools.partial"):
        fastcollate_lightning._seed_workers(loader(8), rank=0)

    def own_init(worker_id: int) -> None:
        pass

    seeded_by_its_owner = loader(8, worker_init_fn=own_init)
    fastcollate_lightning._seed_workers(seeded_by_its_owner, rank=0)  # Lightning leaves it too
    assert seeded_by_its_owner.worker_init_fn is own_init


def test_persistent_workers_end_with_the_run():
    model = Recorder()
    fitted = trainer(max_epochs=1)
    fitted.fit(model, loader(16, num_workers=1, persistent_workers=True))
    assert model.workers_seen  # the DataLoader's worker was alive while training
    alive = {child.pid for child in multiprocessing.active_children()}
    assert not model.workers_seen & alive


def test_an_exception_in_training_restores_the_hook_and_closes(made):
    fitted = trainer()
    with pytest.raises(RuntimeError, match="failed on purpose"):
        fitted.fit(Recorder(fail_at_batch=1), loader(24))
    assert_hook_restored(fitted)
    assert len(made) == 1
    assert_closed(made)


def test_a_device_loader_given_to_the_trainer_is_refused():
    fitted = trainer()
    with pytest.raises(TypeError, match="Give it the DataLoader itself"):
        fitted.fit(Recorder(), DeviceLoader(loader(16), device="cpu"))
    assert_hook_restored(fitted)


def test_the_callback_pickles_for_ddp_spawn_and_checks_depth():
    copy = pickle.loads(pickle.dumps(DeviceLoaderCallback(depth=3, transforms={"x": torch.neg})))
    assert (copy.depth, copy.transforms) == (3, {"x": torch.neg})
    with pytest.raises(ValueError, match="depth must be >= 1"):
        DeviceLoaderCallback(depth=0)


# ---- Two processes: DDP on gloo -------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """examples/lightning_train.py with 2 ranks, with the callback (2 epochs) and, at the same time,
    wrapped by hand without it (1 epoch): {name: (exit status, output, folder of the ranks' files)}.
    Both at once: Lightning's import dominates, and each run imports it twice, one rank after the other."""
    flags = {"with_callback": ["--epochs", "2"], "without_callback": ["--epochs", "1", "--without-callback"]}
    folders = {name: tmp_path_factory.mktemp(name) for name in flags}
    done = run_at_once({
        name: [sys.executable, EXAMPLE, str(folders[name]), "--accelerator", "cpu", "--devices", "2", *extra]
        for name, extra in flags.items()
    })
    return {name: (status, output, folders[name]) for name, (status, output) in done.items()}


def rank_files(out, epochs: int) -> list[list[dict]]:
    """[rank][epoch] -> {"ids", "report"}, as each rank wrote them."""
    return [[json.loads((out / f"rank{rank}_epoch{epoch}.json").read_text()) for epoch in range(epochs)]
            for rank in range(2)]


def sampler_order(rank: int, epoch: int) -> list[int]:
    sampler = DistributedSampler(range(EXAMPLE_DATASET_SIZE), num_replicas=2, rank=rank, shuffle=True,
                                 seed=EXAMPLE_SEED)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.slow
def test_under_ddp_each_rank_trains_on_its_own_shard_in_each_epochs_order(ddp_runs):
    status, output, out = ddp_runs["with_callback"]
    assert status == 0, output
    ranks = rank_files(out, epochs=2)
    for epoch in (0, 1):
        ids = [ranks[rank][epoch]["ids"] for rank in (0, 1)]
        assert set(ids[0]).isdisjoint(ids[1])
        assert sorted(ids[0] + ids[1]) == list(range(EXAMPLE_DATASET_SIZE))  # every id once
        for rank in (0, 1):
            # Lightning's DistributedSampler, told the epoch through the DeviceLoader
            assert ids[rank] == sampler_order(rank, epoch)
            report = ranks[rank][epoch]["report"]
            assert report["ok"] and report["delivered"] == EXAMPLE_DATASET_SIZE, report
            assert report == ranks[0][epoch]["report"]  # every rank got the same verdict
    for rank in (0, 1):
        assert ranks[rank][0]["ids"] != ranks[rank][1]["ids"]  # a new order each epoch


@pytest.mark.slow
def test_ddp_without_the_callback_reads_everything_on_every_rank_and_the_audit_fails(ddp_runs):
    status, output, out = ddp_runs["without_callback"]
    assert status != 0, output  # 1, or killed by Lightning once rank 1 exited with 1
    for (epoch,) in rank_files(out, epochs=1):
        assert sorted(epoch["ids"]) == list(range(EXAMPLE_DATASET_SIZE))  # the whole dataset, unsharded
        report = epoch["report"]
        assert not report["ok"] and report["delivered"] == 2 * EXAMPLE_DATASET_SIZE
        assert report["duplicated"]["count"] == EXAMPLE_DATASET_SIZE
        assert any("each of the 2 ranks delivered every sample" in note for note in report["notes"])


# ---- On a GPU -------------------------------------------------------------------------------------


@pytest.mark.needs_cuda
def test_on_a_gpu_the_batch_in_training_step_is_the_device_loaders_copy(made):
    model = Recorder()
    fitted = trainer(accelerator="gpu", max_epochs=1)
    fitted.fit(model, loader(40))
    train_loader = fitted.train_dataloader
    assert train_loader.device == fitted.strategy.root_device and train_loader.device.type == "cuda"
    assert [seen for _, _, seen in model.trained] == train_loader.handed_out
    assert all(device.startswith("cuda") for _, _, seen in model.trained for _, device in seen)
    assert sorted(i for _, ids, _ in model.trained for i in ids) == list(range(40))
    assert_closed(made)


def test_arrays_gathered_with_index_batches_reach_training_step_once_per_epoch(made):
    generator = torch.Generator().manual_seed(0)
    dataset = fastcollate.Arrays(x=torch.randn(40, 4, generator=generator), y=torch.arange(40) % 2,
                                 index_as="id")
    train = DataLoader(dataset, batch_sampler=fastcollate.IndexBatches(40, 8, shuffle=True, seed=0),
                       collate_fn=fastcollate.assemble)
    model = Recorder()
    fitted = trainer()
    fitted.fit(model, train)
    assert [seen for _, _, seen in model.trained] == fitted.train_dataloader.handed_out
    orders = []
    for epoch in (0, 1):
        ids = [i for e, batch_ids, _ in model.trained if e == epoch for i in batch_ids]
        assert sorted(ids) == list(range(40))
        orders.append(ids)
    assert orders[0] != orders[1], "IndexBatches was told the epoch (set_epoch) and reshuffled"
    assert_closed(made)


# ---- ExactResume ----------------------------------------------------------------------------------


class Indexed(L.LightningModule):
    """Records the indices of every batch, epoch by epoch, and Lightning's count of each epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.epochs: dict[int, list[int]] = {}
        self.counts: dict[int, int] = {}

    def training_step(self, batch, batch_idx):
        self.epochs.setdefault(self.current_epoch, []).extend(int(i) for i in batch)
        self.counts[self.current_epoch] = self.trainer.num_training_batches
        return self.layer(batch.float()[:, None]).sum() * 0.0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_token_budget_epochs_of_differing_length_each_deliver_every_sample_with_exact_resume():
    lengths = torch.randint(1, 40, (61,), generator=torch.Generator().manual_seed(0))
    sampler = fastcollate.TokenBudgetBatches(lengths, 64, shuffle=True, seed=0)
    epoch_lengths = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        epoch_lengths.append(len(sampler))
    assert len(set(epoch_lengths)) > 1, "the test needs epochs of differing length"
    model = Indexed()
    trainer(callbacks=[fastcollate_lightning.ExactResume()], max_epochs=3).fit(
        model, DataLoader(range(61), batch_sampler=sampler))
    for epoch in range(3):
        assert sorted(model.epochs[epoch]) == list(range(61)), f"epoch {epoch}"
        assert model.counts[epoch] == epoch_lengths[epoch]


def test_exact_resume_on_a_lightning_without_what_it_recounts_with_says_so(monkeypatch):
    from fastcollate.integrations import lightning_counts

    monkeypatch.setattr(lightning_counts, "_parse_num_batches", None)
    fitting = trainer(callbacks=[fastcollate_lightning.ExactResume()])
    with pytest.raises(RuntimeError, match="this Lightning version lacks .* remove the callback"):
        fitting.fit(Indexed(), DataLoader(range(8), batch_size=4))
