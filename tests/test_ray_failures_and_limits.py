"""fastcollate.ray.ArrowCollate where the process around it dies or runs short: a Ray worker that dies
mid-iteration (an actor of a map_batches pool, a task) must leave every row delivered once after Ray's
retry, or Ray's own error, never a wrong batch; a collate under a low address-space or page-lock limit
refuses a batch it cannot hold, saying so, and goes on. One local Ray, shared with the other Ray modules
(conftest's local_ray)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed")  # a test dependency, like lightning
pa = pytest.importorskip("pyarrow")

from fastcollate.ray import ArrowCollate  # noqa: E402
from tests.test_ray import packed_contract, tabular_table, token_rows, tokens_table  # noqa: E402
from tests.test_ray_attacks import assert_kept_batches_are_their_rows, blocks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class DiesOnceAt:
    """A map_batches step whose process exits (as a killed worker does) the first time it meets the row
    ``fatal``, anywhere in the cluster: the marker file says it already died once."""

    def __init__(self, marker: str, fatal: int) -> None:
        self.marker = marker
        self.fatal = fatal

    def __call__(self, table):
        if self.fatal in table["id"].to_pylist() and not os.path.exists(self.marker):
            Path(self.marker).touch()
            os._exit(1)
        return table


def kept_or_rays_error(dataset, collate, **options):
    """The batches of the whole iteration, or (None, the error) where Ray gave up: then the batches it did
    deliver are still checked by the caller."""
    batches = []
    try:
        for batch in dataset.iter_torch_batches(collate_fn=collate, **options):
            batches.append(batch)
    except Exception as error:  # noqa: BLE001 - Ray's own error is an allowed outcome, judged by the caller
        return batches, error
    return batches, None


def test_a_map_batches_task_that_dies_once_is_retried_and_every_row_comes_once(local_ray, tmp_path):
    source = tabular_table(96)
    step = DiesOnceAt(str(tmp_path / "died"), fatal=40)
    dataset = blocks(source, [16] * 6).map_batches(step, batch_format="pyarrow", batch_size=None)
    batches, error = kept_or_rays_error(dataset, ArrowCollate(), batch_size=16)
    assert (tmp_path / "died").exists(), "the task died once"
    assert error is None, f"Ray retries a task whose worker died: {error!r}"
    assert_kept_batches_are_their_rows(batches, source)


def test_an_actor_of_a_map_batches_pool_that_dies_leaves_every_packed_row_once_or_rays_error(
    local_ray, tmp_path
):
    rows = token_rows(64, seed=3)
    source = tokens_table(rows)
    marker, fatal = str(tmp_path / "died"), 30

    class Step:
        def __call__(self, table):
            return DiesOnceAt(marker, fatal)(table)

    dataset = blocks(source, [8] * 8).map_batches(
        Step, batch_format="pyarrow", batch_size=None, compute=ray.data.ActorPoolStrategy(size=1)
    )
    batches, error = kept_or_rays_error(dataset, ArrowCollate(packed_contract()), batch_size=8)
    assert Path(marker).exists(), "the actor died once"
    ids = [i for batch in batches for i in batch["id"].tolist()]
    assert len(ids) == len(set(ids)), "no row twice, even where Ray gave up"
    for batch in batches:  # each batch delivered is its own rows, packed
        assert batch["cu_seq_lens_q"][-1].item() == sum(len(rows[i]) for i in batch["id"].tolist())
    if error is None:
        assert_kept_batches_are_their_rows(batches, source, packed_contract())
    else:
        assert "ArrowCollate" not in str(error), f"Ray's error, not the collate's: {error!r}"


def run_limited(script: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter that has made ``small`` (1,000 rows) and ``big`` (128 Mi rows of
    float32, 512 MiB) and whose ``limit(name, value)`` sets a resource limit, as a worker of a shared
    cluster may have one."""
    head = textwrap.dedent(
        """
        import resource
        import numpy as np, pyarrow as pa, torch
        from fastcollate.ray import ArrowCollate

        def limit(name, value):
            which = getattr(resource, name)
            resource.setrlimit(which, (value, resource.getrlimit(which)[1]))

        def address_space():
            with open("/proc/self/statm") as statm:
                return int(statm.read().split()[0]) * resource.getpagesize()

        small = pa.table({"x": pa.array(np.arange(1000, dtype=np.float32))})
        big = pa.table({"x": pa.array(np.ones(1 << 27, dtype=np.float32))})
        """
    )
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", head + textwrap.dedent(script)],
        capture_output=True, text=True, timeout=120, env=environment, check=False,
    )


def test_a_batch_past_the_address_space_limit_is_refused_and_the_next_small_one_is_whole():
    done = run_limited(
        """
        collate = ArrowCollate(max_slots=2)
        assert torch.equal(collate(small)["x"], torch.arange(1000, dtype=torch.float32))
        in_two_chunks = pa.concat_tables([big.slice(0, 1 << 26), big.slice(1 << 26)])  # gathered, not viewed
        limit("RLIMIT_AS", address_space() + (128 << 20))  # room for a small batch, not for big's 512 MiB
        assert collate(big)["x"].shape == (1 << 27,)  # in one chunk: handed out as it lies, no memory taken
        try:
            collate(in_two_chunks)
            print("DELIVERED")
        except (MemoryError, RuntimeError) as error:
            print("REFUSED", type(error).__name__, str(error).splitlines()[0][:300])
        batch = collate(small)
        assert torch.equal(batch["x"], torch.arange(1000, dtype=torch.float32))
        print("SMALL OK")
        """
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "REFUSED" in done.stdout and "SMALL OK" in done.stdout, done.stdout


def test_a_collate_in_host_memory_needs_no_page_locked_memory():
    done = run_limited(
        """
        limit("RLIMIT_MEMLOCK", 0)
        collate = ArrowCollate(max_slots=2)
        for table in (small, big.slice(3, 1 << 20), small):
            batch = collate(table)
            assert torch.equal(batch["x"], torch.from_numpy(table["x"].to_numpy()))
        print("OK")
        """
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "OK"
