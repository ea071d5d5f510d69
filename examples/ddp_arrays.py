"""Data-parallel training on data that already sits in arrays: fastcollate.Arrays gathered by index in
the workers, each rank's shard cut by IndexBatches (DistributedSampler's rules, one int64 array a
batch), DeviceLoader to the device, and the audit after each epoch that every id came once across ranks.

    torchrun --standalone --nproc_per_node=2 examples/ddp_arrays.py   # CPU: gloo
    torchrun --standalone --nproc_per_node=8 examples/ddp_arrays.py   # GPUs: nccl, one per rank
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

import fastcollate

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4).to(device))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
generator = torch.Generator().manual_seed(0)  # the same arrays on every rank
dataset = fastcollate.Arrays(x=torch.randn(1000, 16, generator=generator), y=torch.arange(1000) % 4,
                             index_as="id")  # each sample's index as its id, for the audit
shards = fastcollate.IndexBatches(len(dataset), 50, shuffle=True, seed=0, rank=dist.get_rank(),
                                  world_size=dist.get_world_size())
batches = DataLoader(dataset, batch_sampler=shards, num_workers=2, collate_fn=fastcollate.assemble)
loader = fastcollate.DeviceLoader(batches, device=device)
ledger = fastcollate.Ledger()  # the ids each batch brought, per epoch
for epoch in range(2):
    loader.set_epoch(epoch)  # IndexBatches reshuffles by epoch, as DistributedSampler does
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
