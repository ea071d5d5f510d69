"""The examples as users run them: ``examples/ddp_train.py`` under torchrun on the CPU (gloo, 2 ranks).

Each run is bounded, so a stuck collective fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DDP_EXAMPLE = ROOT / "examples" / "ddp_train.py"


def torchrun(script: Path, ranks: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               str(script)]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_the_ddp_example_delivers_every_id_once_per_epoch_across_two_gloo_ranks():
    done = torchrun(DDP_EXAMPLE)
    assert done.returncode == 0, done.stdout + done.stderr
    for epoch in (0, 1):
        assert (f"epoch {epoch}: 2 ranks together against the dataset: OK\n"
                "  delivered 1000 samples; reference has 1000 ids") in done.stdout, done.stdout


@pytest.mark.slow
def test_the_ddp_examples_audit_fails_when_every_rank_reads_the_whole_dataset(tmp_path):
    # The mistake the audit is there for: no DistributedSampler, so both ranks read all 1000 samples.
    source = DDP_EXAMPLE.read_text()
    assert "sampler=sampler," in source
    unsharded = tmp_path / "ddp_train_unsharded.py"
    unsharded.write_text(source.replace("sampler=sampler,", "shuffle=True,"))
    done = torchrun(unsharded)
    assert done.returncode != 0
    failed = "epoch 0: 2 ranks together against the dataset: FAILED: 1000 duplicated"
    assert failed in done.stdout, done.stdout
    assert "delivered 2000 samples" in done.stdout
