"""Data-parallel training with fastcollate under torchrun: assemble in the workers, DeviceLoader to the
device, a DistributedSampler told each epoch through DeviceLoader.set_epoch, and an audit after each
epoch that every id was delivered once across the ranks.

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py   # CPU: gloo
    torchrun --standalone --nproc_per_node=8 examples/ddp_train.py   # GPUs: nccl, one per rank
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import fastcollate


class Points(Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, index):
        return {"id": index, "x": torch.randn(16), "y": index % 4}


cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4).to(device))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
dataset = Points()
sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # this rank's shard, reshuffled by epoch
batches = DataLoader(dataset, batch_size=50, sampler=sampler, num_workers=2, collate_fn=fastcollate.assemble)
loader = fastcollate.DeviceLoader(batches, device=device)
ledger = fastcollate.Ledger()  # the ids each batch brought, per epoch
for epoch in range(2):
    loader.set_epoch(epoch)
    for batch in ledger.watch(loader):
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    report = fastcollate.audit.check_distributed(ledger, len(dataset))  # a collective: every rank calls it
    if dist.get_rank() == 0:
        print(f"epoch {epoch}: {report}", flush=True)
    if not report.ok:
        raise SystemExit(1)
loader.close()
dist.destroy_process_group()
