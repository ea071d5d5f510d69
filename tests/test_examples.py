"""The examples as users run them: ``examples/ddp_train.py`` and ``examples/ddp_arrays.py`` under
torchrun on the CPU (gloo, 2 ranks).

The runs are bounded, so a stuck collective fails the tests instead of hanging them.
"""

from __future__ import annotations

import re
import sys

import pytest

from tests.helpers.processes import ROOT, run_at_once

DDP_EXAMPLE = ROOT / "examples" / "ddp_train.py"
DDP_ARRAYS_EXAMPLE = ROOT / "examples" / "ddp_arrays.py"


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """The example as it is, and with the mistake its audit is there for (no DistributedSampler: both
    ranks read all 1000 samples), each on 2 ranks, both at once (torch's import dominates each run):
    {name: (exit status, output)}."""
    source = DDP_EXAMPLE.read_text()
    assert "sampler=sampler," in source
    unsharded = tmp_path_factory.mktemp("unsharded") / "ddp_train_unsharded.py"
    unsharded.write_text(source.replace("sampler=sampler,", "shuffle=True,"))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return run_at_once({"sharded": [*torchrun, str(DDP_EXAMPLE)], "unsharded": [*torchrun, str(unsharded)],
                        "arrays": [*torchrun, str(DDP_ARRAYS_EXAMPLE)]})


def documented_output() -> str:
    """The output docs/integrations.md shows for the torchrun example (its first epoch)."""
    integrations = (ROOT / "docs" / "integrations.md").read_text()
    return re.search(r"```\n(epoch 0: .*?)```", integrations, re.S).group(1)


@pytest.mark.slow
def test_the_ddp_example_delivers_every_id_once_per_epoch_across_two_gloo_ranks(ddp_runs):
    status, output = ddp_runs["sharded"]
    assert status == 0, output
    shown = documented_output()
    assert shown in output, (shown, output)  # as the docs show it
    assert shown.replace("epoch 0:", "epoch 1:") in output, output


@pytest.mark.slow
def test_the_ddp_examples_audit_fails_when_every_rank_reads_the_whole_dataset(ddp_runs):
    status, output = ddp_runs["unsharded"]
    assert status != 0
    assert "epoch 0: 2 ranks together against the dataset: FAILED: 1000 duplicated" in output, output
    assert "delivered 2000 samples" in output


@pytest.mark.slow
def test_the_arrays_ddp_example_shards_with_index_batches_and_every_id_comes_once(ddp_runs):
    status, output = ddp_runs["arrays"]
    assert status == 0, output
    for epoch in (0, 1):
        assert (f"epoch {epoch}: 2 ranks together against the dataset: OK\n"
                "  delivered 1000 samples; reference has 1000 ids") in output, output
