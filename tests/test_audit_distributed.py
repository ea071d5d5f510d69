"""fastcollate.audit.check_distributed for real: two processes, the gloo backend, a file:// store.

Each rank runs the same scenarios (``python tests/test_audit_distributed.py RANK WORLD STORE OUT``
is one rank) and writes every report it got; the test checks that all ranks got the same reports and
that they name the right ids and ranks. Every wait is bounded, so a broken collective fails the test
instead of hanging it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 2
SIZE = 9  # odd: the sampler pads (or, with drop_last, drops)


def rank_main(rank: int, world: int, store: str, out: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    import fastcollate
    from fastcollate import audit
    from tests.helpers.audit_datasets import Records

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    dataset = Records(SIZE)

    def epoch(sampler) -> audit.Epoch:
        loader = DataLoader(dataset, batch_size=2, sampler=sampler, collate_fn=fastcollate.assemble)
        return audit.Ledger().run(loader)

    reports = {}
    sharded = epoch(DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0))
    reports["sharded"] = audit.check_distributed(sharded, expected=SIZE)
    reports["unsharded"] = audit.check_distributed(epoch(None), expected=SIZE)  # every rank reads all
    # a sampler told of one rank too many: what the missing rank would have read is lost
    reports["miscounted"] = audit.check_distributed(
        epoch(DistributedSampler(dataset, num_replicas=world + 1, rank=rank, shuffle=False)), expected=SIZE
    )
    cut = epoch(
        DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    )
    reports["drop_last"] = audit.check_distributed(cut, expected=SIZE, sampler_drop_last=True)
    reports["drop_last_unsaid"] = audit.check_distributed(cut, expected=SIZE)
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump({name: report.to_dict() for name, report in reports.items()}, file)


@pytest.mark.slow
def test_ranks_are_gathered_and_checked_against_the_dataset_with_gloo(tmp_path):
    store = tmp_path / "store"
    env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(rank), str(WORLD), str(store), str(tmp_path)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    outputs = []
    try:
        for process in ranks:
            outputs.append(process.communicate(timeout=90)[0])
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    assert all(p.returncode == 0 for p in ranks), "\n".join(outputs)

    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    assert all(r == reports[0] for r in reports)  # every rank gets the same verdict
    report = reports[0]

    sharded = report["sharded"]
    assert sharded["ok"] and sharded["delivered"] == 10  # 9 ids + the sampler's padding repeat
    assert sharded["padded"]["count"] == 1 and sharded["duplicated"]["count"] == 0

    unsharded = report["unsharded"]
    assert not unsharded["ok"] and unsharded["delivered"] == 18
    assert unsharded["duplicated"]["count"] == SIZE
    assert {"id": 4, "count": 2, "ranks": [0, 1]} in unsharded["duplicated"]["ids"]
    assert any("each of the 2 ranks delivered every sample" in note for note in unsharded["notes"])

    miscounted = report["miscounted"]
    assert miscounted["missing"]["ids"] == [2, 5, 8]  # what rank 2 of 3 would have read
    assert not miscounted["ok"]

    assert report["drop_last"]["ok"] and report["drop_last"]["dropped"]["count"] == 1
    assert report["drop_last_unsaid"]["missing"]["count"] == 1 and not report["drop_last_unsaid"]["ok"]


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
