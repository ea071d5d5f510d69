"""One rank of the jobs a test stops at a checkpoint and resumes on another world size; torchrun starts it
(gloo, on the CPU): ``python -m torch.distributed.run --nproc_per_node W elastic_job.py PLAN.json``, with
PLAN ``{"save": [job, ...], "saved": path, "wait_for": [path, ...], "resume": [job, ...]}``.

Each job of the plan trains on ``Indices(N)`` (sample i is i) with a StatefulDataLoader over
IndexBatches or TokenBudgetBatches split for this rank, either under Lightning's Trainer (DDP, with
``ExactResume``) or in a plain loop (the torchrun idiom: ``fastcollate.sampler_state``), and writes what
this rank delivered, epoch by epoch, to ``{out}.rank{R}.json``. A job with ``stop_at`` saves a checkpoint
after that many batches of epoch 0 and stops; one with ``resume`` starts from such a checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

# The checkout in place of this script's folder: the package and tests.helpers are imported from there.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastcollate import IndexBatches, TokenBudgetBatches, sampler_state  # noqa: E402
from tests.helpers.resume import Indices  # noqa: E402

N = 61
BATCH_SIZE = 4
MAX_TOKENS = 64
EPOCHS = 3


def token_lengths() -> torch.Tensor:
    return torch.randint(1, 40, (N,), generator=torch.Generator().manual_seed(0))


def make_sampler(kind: str, rank: int, world_size: int):
    """The sampler every rank of every job makes, for ``rank`` of ``world_size``."""
    if kind == "index":
        return IndexBatches(N, BATCH_SIZE, shuffle=True, seed=1, rank=rank, world_size=world_size)
    return TokenBudgetBatches(token_lengths(), MAX_TOKENS, shuffle=True, seed=1, rank=rank,
                              world_size=world_size)


def plain(job: dict, rank: int, world_size: int) -> dict:
    """The torchrun idiom without Lightning: the sampler's part of a StatefulDataLoader state, loaded into
    the new rank's sampler (any world size, any num_workers)."""
    sampler = make_sampler(job["sampler"], rank, world_size)
    if job.get("resume"):
        state = torch.load(job["resume"], weights_only=True)  # rank 0's: every rank's is the same
        sampler.load_state_dict(sampler_state(state))
    loader = StatefulDataLoader(Indices(N), batch_sampler=sampler, num_workers=job.get("workers", 0))
    delivered: dict[int, list] = {}
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        batches = delivered.setdefault(epoch, [])
        for batch in loader:
            batches.append(batch.tolist())
            if job.get("stop_at") == len(batches) and epoch == 0:
                if rank == 0:
                    torch.save(loader.state_dict(), job["save"])
                dist.barrier()
                return {"epochs": delivered}
    return {"epochs": delivered}


def lightning(job: dict, rank: int, world_size: int) -> dict:
    import lightning as L

    from fastcollate.lightning import DeviceLoaderCallback, ExactResume

    logging.getLogger("lightning").setLevel(logging.ERROR)
    record: dict = {"epochs": {}, "counts": {}, "bar": {}}

    class Recorder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def train_dataloader(self):
            sampler = make_sampler(job["sampler"], self.trainer.global_rank, self.trainer.world_size)
            return StatefulDataLoader(Indices(N), batch_sampler=sampler, num_workers=job.get("workers", 0))

        def training_step(self, batch, batch_idx):
            record["epochs"].setdefault(self.current_epoch, []).append(batch.tolist())
            return self.layer(batch.float()[:, None]).sum() * 0.0

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class Watch(L.Callback):
        """Stops at ``stop_at`` with a checkpoint, and records Lightning's own count of each epoch."""

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.current_epoch == 0 and batch_idx + 1 == job.get("stop_at"):
                trainer.save_checkpoint(job["save"])
                trainer.should_stop = True

        def on_train_epoch_end(self, trainer, module):
            epoch = trainer.current_epoch
            ran = trainer.fit_loop.epoch_loop.batch_idx + 1
            record["counts"][epoch] = [trainer.num_training_batches, ran]
            bar = getattr(trainer.progress_bar_callback, "train_progress_bar", None)
            if bar is not None and not bar.disable:
                record["bar"][epoch] = [bar.n, bar.total]
            record["global_step"] = trainer.global_step

    # Lightning's tqdm bar, after ExactResume (as a Trainer lists the bar it adds itself), updated only at
    # an epoch's end: its count then says where Lightning thought the epoch ended.
    callbacks = [ExactResume(), Watch(), L.pytorch.callbacks.TQDMProgressBar(refresh_rate=10_000)]
    if job.get("device_loader"):
        callbacks.append(DeviceLoaderCallback())
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy="ddp", max_epochs=EPOCHS, logger=False,
        enable_checkpointing=False, enable_model_summary=False, use_distributed_sampler=False,
        callbacks=callbacks, limit_train_batches=job.get("limit_train_batches", 1.0),
    )
    trainer.fit(Recorder(), ckpt_path=job.get("resume"))
    return record


def wait_for(paths: list[str], timeout_s: float = 240) -> None:
    """Waits until every file exists: the checkpoints other world sizes' jobs write."""
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(path) for path in paths):
        if time.monotonic() > deadline:
            missing = [path for path in paths if not os.path.exists(path)]
            raise TimeoutError(f"no {missing} after {timeout_s} s")
        time.sleep(0.1)


def main() -> None:
    """Runs the plan's "save" jobs and then writes the file "saved"; once the files in "wait_for" exist
    (written so by the jobs of other world sizes, started at the same time, when their checkpoints are
    whole), runs its "resume" jobs: one start (and one import of Lightning) a process for both."""
    warnings.filterwarnings("ignore")
    with open(sys.argv[1]) as file:
        plan = json.load(file)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    for stage in ("save", "resume"):
        if stage == "resume":
            if rank == 0:
                open(plan["saved"], "w").close()
            wait_for(plan["wait_for"])
        for job in plan[stage]:
            done = (lightning if job["kind"] == "lightning" else plain)(job, rank, world_size)
            with open(f"{job['out']}.rank{rank}.json", "w") as file:
                json.dump(done, file)
            dist.barrier()
    if dist.is_initialized():  # gloo's threads end here, not in the interpreter's exit
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
