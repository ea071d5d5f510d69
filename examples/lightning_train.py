"""Lightning DDP with fastcollate: the Trainer adds its DistributedSampler, DeviceLoaderCallback moves each
batch to the device in one pinned copy, and after every epoch the ids that reached training_step on all
ranks are audited against the dataset.

    python examples/lightning_train.py OUT [--accelerator cpu|gpu] [--devices 2] [--epochs 2]
                                           [--workers 0] [--without-callback]

Each rank writes OUT/rank{R}_epoch{E}.json: the ids it trained on, in order, and the audit's report
(``AuditReport.to_dict()``). The script exits 1 if an audit failed. ``--without-callback`` wraps the
DataLoader in a DeviceLoader by hand instead, which is what not to do: Lightning then adds no sampler,
every rank reads the whole dataset, and the audit reports the duplicates.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

import fastcollate
from fastcollate.audit import check_distributed
from fastcollate.lightning import DeviceLoaderCallback

DATASET_SIZE = 64  # a multiple of the ranks: DistributedSampler pads no rank with repeats


class Points(Dataset):
    """Points in 4-d, labelled by the sign of their coordinates' sum."""

    def __init__(self, size: int) -> None:
        self.x = torch.randn(size, 4, generator=torch.Generator().manual_seed(0))
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict:
        return {"x": self.x[index], "y": self.y[index]}


class Classifier(L.LightningModule):
    def __init__(self, dataset_size: int, out: Path) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.dataset_size = dataset_size
        self.out = out
        self.ledger = fastcollate.Ledger()  # the ids that reach training_step, epoch by epoch
        self.audits_passed: list[bool] = []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.ledger.record(batch)
        return torch.nn.functional.cross_entropy(self.layer(batch["x"]), batch["y"])

    def on_train_epoch_start(self) -> None:
        self.ledger.begin_epoch()

    def on_train_epoch_end(self) -> None:
        epoch = self.ledger.end_epoch()
        report = check_distributed(self.ledger, self.dataset_size)  # a collective: every rank calls it
        if self.global_rank == 0:
            print(f"epoch {self.current_epoch}: {report}", flush=True)
        record = {"ids": epoch.ids.tolist(), "report": report.to_dict()}
        (self.out / f"rank{self.global_rank}_epoch{self.current_epoch}.json").write_text(json.dumps(record))
        self.audits_passed.append(report.ok)
        # Every rank's file is written before any rank may exit: once one rank exits non-zero, Lightning
        # kills the others.
        self.trainer.strategy.barrier("audit written")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="folder for each rank's ids and audit reports")
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--devices", type=int, default=2, help="ranks (processes)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank")
    parser.add_argument("--without-callback", action="store_true",
                        help="wrap the DataLoader in a DeviceLoader by hand (unsharded: the audit fails)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    L.seed_everything(0, workers=True, verbose=False)  # the sampler's shuffling seed; seeded workers
    dataset = fastcollate.with_ids(Points(DATASET_SIZE))  # every sample carries its index as "id"
    loader = DataLoader(dataset, batch_size=8, shuffle=True, num_workers=args.workers,
                        collate_fn=fastcollate.assemble)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy="ddp",
        max_epochs=args.epochs,
        callbacks=[] if args.without_callback else [DeviceLoaderCallback(depth=2)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if args.without_callback:
        loader = fastcollate.DeviceLoader(loader, device=trainer.strategy.root_device)
    model = Classifier(len(dataset), args.out)
    trainer.fit(model, loader)
    return 0 if all(model.audits_passed) else 1


if __name__ == "__main__":
    sys.exit(main())
