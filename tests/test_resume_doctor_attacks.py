"""A hostile review of doctor --resume / --resume-world-size, the samplers' for_rank, TokenBudgetBatches'
split to a multiple of the world size and ResumableEpochs.__len__.

Each test is one attack, asserting what the user is promised.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import random
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

from fastcollate import IndexBatches, TokenBudgetBatches
from fastcollate.data.token_batches import _fill, _split_to_multiple
from tests.helpers.resume import doctor, factory, wrong_when_resumed

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DATA = """
import os
import numpy as np
import torch, fastcollate
from torch.utils.data import BatchSampler, Dataset, IterableDataset, Sampler
from fastcollate import IndexBatches, TokenBudgetBatches

def data(n):
    return fastcollate.with_ids([{"x": torch.tensor([float(i)])} for i in range(n)])

def logged(*facts):
    with open(os.environ["SAMPLER_LOG"], "a") as log:
        log.write(" ".join(map(str, facts)) + "\\n")
"""

def wrong(base, wrong_when, action, make=""):
    """The Wrong sampler's source, then ``make`` (dedented on its own)."""
    return wrong_when_resumed(base, wrong_when, action) + textwrap.dedent(make)


def spec_of(tmp_path, name, source, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setenv("SAMPLER_LOG", str(tmp_path / "sampler.log"))
    return factory(tmp_path, name, DATA + textwrap.dedent(source))


def report_of(tmp_path):
    with open(tmp_path / "report.json") as file:
        return json.load(file)


# ----------------------------------------------------------------------------------------------------
# doctor --resume-world-size: what breaks
# ----------------------------------------------------------------------------------------------------

TOKENS_ONE_A_BATCH = """
def make():
    # 12 samples of max_tokens each: one a batch, none can be split. On 2 ranks, 6 batches a rank; on 3
    # ranks only the checkpoints that leave a multiple of 3 samples (after batch 3 and 6) can resume.
    return {"dataset": data(12), "batch_sampler": Wrong([10] * 12, 10)}
"""


def test_a_refusal_at_one_checkpoint_does_not_hide_a_wrong_resume_at_another(tmp_path, capsys):
    source = wrong("TokenBudgetBatches", 'state["batches_done"] == 3', "continue") + TOKENS_ONE_A_BATCH
    spec = spec_of(tmp_path, "refuses_then_wrong", source)
    status, text = doctor(["--resume-world-size", "2,3", "--workers", "1", "--dataset", spec], capsys)
    assert status == 1, text
    assert "FAILED after batch 3" in text, text


def test_the_report_lists_only_the_checkpoints_it_resumed_from(tmp_path, capsys):
    source = wrong("TokenBudgetBatches", "False", "pass") + TOKENS_ONE_A_BATCH
    spec = spec_of(tmp_path, "refuses_report", source)
    argv = ["--resume-world-size", "2,3", "--workers", "1", "--json", str(tmp_path / "report.json")]
    status, text = doctor([*argv, "--dataset", spec], capsys)
    assert status == 2, text
    report = report_of(tmp_path)
    resumed = sorted({run["after_batch"] for run in report["runs"] if run["after_batch"] is not None})
    assert report["checkpoints"] == resumed, (report["checkpoints"], resumed)
    assert f"{len(resumed)} checkpoint" in text.splitlines()[-1], text


OWN_IDS_FAILING_AT_17 = """
class Files(Dataset):
    '''Its own ids; the file behind sample 17 is corrupt.'''

    def __len__(self):
        return 30

    def __getitem__(self, index):
        if index == 17:
            raise OSError("corrupt file")
        return {"id": int(index), "x": torch.tensor([float(index)])}

def make():
    return {"dataset": Files(), "batch_sampler": IndexBatches(30, 4, shuffle=True)}
"""


def test_a_sample_that_fails_on_one_world_size_is_a_failed_loader(tmp_path, capsys):
    spec = spec_of(tmp_path, "fails_at_17", OWN_IDS_FAILING_AT_17)
    status, text = doctor(["--resume", "--workers", "1", "--dataset", spec], capsys)
    assert status == 1 and "the loader raised OSError" in text, text


def test_a_sample_that_fails_is_a_failed_loader_on_another_world_size_too(tmp_path, capsys):
    spec = spec_of(tmp_path, "fails_at_17", OWN_IDS_FAILING_AT_17)
    argv = ["--resume-world-size", "2,3", "--workers", "1", "--json", str(tmp_path / "report.json")]
    status, text = doctor([*argv, "--dataset", spec], capsys)
    assert status == 1, text
    assert report_of(tmp_path)["exit_status"] == 1


DUPLICATE_OWN_IDS = """
class Clips(Dataset):
    '''30 clips of 25 videos: a clip's id is its video's, so 5 ids come twice.'''

    def __len__(self):
        return 30

    def __getitem__(self, index):
        return {"id": int(index) % 25, "x": torch.tensor([float(index)])}

def make():
    return {"dataset": Clips(), "batch_sampler": IndexBatches(30, 4, shuffle=True)}
"""


def test_a_data_set_with_duplicate_own_ids_resumes_on_the_same_world_size(tmp_path, capsys):
    spec = spec_of(tmp_path, "duplicate_ids", DUPLICATE_OWN_IDS)
    status, text = doctor(["--resume", "--workers", "1", "--dataset", spec], capsys)
    assert status == 0, text


def test_a_data_set_with_duplicate_own_ids_resumes_on_another_world_size(tmp_path, capsys):
    spec = spec_of(tmp_path, "duplicate_ids", DUPLICATE_OWN_IDS)
    status, text = doctor(["--resume-world-size", "2,3", "--workers", "1", "--dataset", spec], capsys)
    assert status == 0, text


def test_the_ok_line_does_not_call_the_data_set_s_duplicates_padding(tmp_path, capsys):
    spec = spec_of(tmp_path, "duplicate_ids", DUPLICATE_OWN_IDS)
    status, text = doctor(["--resume", "--workers", "1", "--dataset", spec], capsys)
    assert status == 0, text
    assert "padding" not in text, text


def test_a_for_rank_that_returns_nothing_is_not_replaced_by_the_loader_s_own_sampler(tmp_path, capsys):
    source = """
    class Forgets(IndexBatches):
        def for_rank(self, rank, world_size):
            return None

    def make():
        return {"dataset": data(40), "batch_sampler": Forgets(40, 4, shuffle=True)}
    """
    spec = spec_of(tmp_path, "for_rank_none", source)
    status, text = doctor(["--resume-world-size", "1,1", "--workers", "1", "--dataset", spec], capsys)
    assert status == 2, text
    assert "40 batches" not in text, "the loader's default batch_size=1 ran instead of the sampler"


@pytest.mark.parametrize("error", ["NotImplementedError", "RuntimeError"])
def test_a_for_rank_that_refuses_with_any_exception_is_not_verified(error, tmp_path, capsys):
    source = f"""
    class Unsplittable(IndexBatches):
        def for_rank(self, rank, world_size):
            raise {error}("this sampler cannot be split by rank")

    def make():
        return {{"dataset": data(40), "batch_sampler": Unsplittable(40, 4, shuffle=True)}}
    """
    spec = spec_of(tmp_path, "for_rank_raises", source)
    status, text = doctor(["--resume-world-size", "2,3", "--workers", "1", "--dataset", spec], capsys)
    assert status == 2, text
    assert "NOT VERIFIED" in text and "cannot be split by rank" in text, text


@pytest.mark.parametrize(
    "n, options, said",
    [(128, ["--seed", "7"], "8 checkpoints"), (96, ["--checkpoints", "40"], "24 checkpoints")],
    ids=["seed-7", "every-checkpoint"],
)
def test_a_sampler_wrong_at_every_third_position_fails(n, options, said, tmp_path, capsys):
    source = wrong(
        "IndexBatches",
        'state["batches_done"] % 3 == 0',
        "continue",
        make=f"""
    def make():
        return {{"dataset": data({n}), "batch_sampler": Wrong({n}, 4, shuffle=True, seed=1)}}
    """,
    )
    spec = spec_of(tmp_path, f"every_third_{n}", source)
    argv = ["--resume", "--workers", "1", "--resume-workers", "0", *options, "--dataset", spec]
    status, text = doctor(argv, capsys)
    assert status == 1 and said in text, text


def test_every_seed_checkpoints_after_batch_3():
    from fastcollate.tools.audit.resume_check import checkpoint_positions

    assert all(3 in checkpoint_positions(32, 8, seed) for seed in range(10))


def test_a_sampler_that_loses_a_sample_a_rank_within_the_drop_last_allowance_fails(tmp_path, capsys):
    source = wrong(
        "IndexBatches",
        'state["batches_done"] % 2 == 0',
        "batch = batch[:-1]",
        make="""
    def make():
        return {"dataset": data(100), "batch_sampler": Wrong(100, 4, shuffle=True, seed=1, drop_last=True)}
    """,
    )
    spec = spec_of(tmp_path, "loses_within_allowance", source)
    argv = ["--resume-world-size", "2,3", "--workers", "1", "--seed", "1", "--dataset", spec]
    status, text = doctor(argv, capsys)
    assert status == 1, text


BAD_SPLITS = {
    # Every rank reads the whole data set: a 2-rank job trains on everything twice.
    "every-rank-reads-everything": "return self._fresh_copy()",
    # Every rank takes rank 0's share: half the data set is never read, the other half twice.
    "every-rank-takes-rank-0-s-share": "return super().for_rank(0, world_size)",
}


@pytest.mark.parametrize("worlds", ["2,2", "2,3"], ids=["same-world-size", "another-world-size"])
@pytest.mark.parametrize("split", list(BAD_SPLITS))
def test_a_bad_rank_split_fails(split, worlds, tmp_path, capsys):
    source = f"""
    class BadSplit(IndexBatches):
        def for_rank(self, rank, world_size):
            {BAD_SPLITS[split]}

    def make():
        return {{"dataset": data(40), "batch_sampler": BadSplit(40, 4, shuffle=True)}}
    """
    spec = spec_of(tmp_path, "bad_split", source)
    status, text = doctor(["--resume-world-size", worlds, "--workers", "1", "--dataset", spec], capsys)
    assert status == 1 and "FAILED" in text, text


def test_a_sampler_made_again_is_the_factory_s_own_or_not_verified(tmp_path, capsys, monkeypatch):
    source = """
    class GlobalBatch(IndexBatches):
        '''batch_size is the global batch; each rank takes batch_size // world_size.'''

        for_rank = None  # made again by its class

        def __init__(self, n, batch_size, rank=0, world_size=1):
            super().__init__(n, batch_size // world_size, shuffle=True, rank=rank, world_size=world_size)

        def __iter__(self):
            logged(self.batch_size)
            yield from super().__iter__()

    def make():
        return {"dataset": data(64), "batch_sampler": GlobalBatch(64, 8, rank=0, world_size=2)}
    """
    spec = spec_of(tmp_path, "global_batch", source, monkeypatch)
    argv = ["--resume-world-size", "2,2", "--workers", "1", "--checkpoints", "2", "--dataset", spec]
    status, text = doctor(argv, capsys)
    ran = (
        set((tmp_path / "sampler.log").read_text().split()) if (tmp_path / "sampler.log").exists() else set()
    )
    assert status == 2 or ran == {"4"}, (status, ran, text)


FD_LIMITED = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
from fastcollate.tools.audit.doctor import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_large_resumed_world_size_does_not_fail_a_correct_sampler_for_want_of_files(tmp_path):
    spec = spec_of(
        tmp_path,
        "many_ranks",
        """
    def make():
        return {"dataset": data(40), "batch_sampler": IndexBatches(40, 4, shuffle=True)}
    """,
    )
    argv = ["--resume-world-size", "2,32", "--workers", "1", "--checkpoints", "2", "--timeout", "10"]
    done = subprocess.run(
        [sys.executable, "-c", FD_LIMITED, *argv, "--dataset", spec],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode in (0, 2), done.stdout + done.stderr[-2000:]


def test_a_resumed_sampler_whose_len_counts_only_the_rest_fails(tmp_path, capsys):
    source = """
    class CountsTheRest(IndexBatches):
        done = 0

        def load_state_dict(self, state):
            super().load_state_dict(state)
            self.done = state["batches_done"]

        def __len__(self):
            return super().__len__() - self.done

    def make():
        return {"dataset": data(40), "batch_sampler": CountsTheRest(40, 4, shuffle=True)}
    """
    spec = spec_of(tmp_path, "counts_the_rest", source)
    argv = ["--resume", "--workers", "1", "--resume-workers", "0", "--dataset", spec]
    status, text = doctor(argv, capsys)
    assert status == 1, text
    assert "len() says" in text and "a training loop counting by len()" in text


def test_the_first_line_credits_seed_only_when_it_picked_something(tmp_path, capsys):
    spec = spec_of(
        tmp_path,
        "three_checkpoints",
        """
    def make():
        return {"dataset": data(80), "batch_sampler": IndexBatches(80, 4, shuffle=True)}
    """,
    )
    argv = ["--resume", "--workers", "1", "--checkpoints", "3", "--dataset", spec]
    status, text = doctor(argv, capsys)
    assert status == 0, text
    assert "after batch 1, 2, 20 of 20" in text and "picked" not in text, text


# ----------------------------------------------------------------------------------------------------
# doctor --resume / --resume-world-size: what holds
# ----------------------------------------------------------------------------------------------------


def test_string_ids_of_the_data_set_s_own_resume_on_another_world_size(tmp_path, capsys):
    source = """
    class Named(Dataset):
        def __len__(self):
            return 30

        def __getitem__(self, index):
            return {"id": f"doc-{index:03d}", "x": torch.tensor([float(index)])}

    def make():
        return {"dataset": Named(), "batch_sampler": IndexBatches(30, 4, shuffle=True)}
    """
    spec = spec_of(tmp_path, "string_ids", source)
    status, text = doctor(["--resume-world-size", "2,3", "--workers", "1", "--dataset", spec], capsys)
    assert status == 0 and "every one of 30 samples delivered once" in text, text


STREAM = """
class Stream(IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for i in range(worker, 40, workers):
            yield {"id": i, "x": torch.tensor([float(i)])}

def make():
    return {"dataset": Stream(), "batch_size": 4}
"""


@pytest.mark.parametrize(
    "argv, expected, said",
    [
        (["--resume", "--workers", "2"], 0, "an IterableDataset resumes on the same num_workers only"),
        (["--resume", "--workers", "2", "--resume-workers", "1"], 2, "NOT VERIFIED"),
        (["--resume-world-size", "2,3", "--workers", "1"], 2, "the factory gives none"),
    ],
    ids=["same-workers", "other-workers", "other-world-size"],
)
def test_an_iterable_dataset(argv, expected, said, tmp_path, capsys):
    spec = spec_of(tmp_path, "stream", STREAM)
    status, text = doctor([*argv, "--dataset", spec], capsys)
    assert status == expected and said in text, text


@pytest.mark.parametrize(
    "n, argv, expected",
    [
        (4, ["--resume"], 2),  # 1 batch
        (8, ["--resume"], 0),  # 2 batches: after the first and after the last
        (8, ["--resume-world-size", "2,3"], 2),  # 1 batch a rank
        (16, ["--resume-world-size", "2,3"], 0),  # 2 batches a rank, 3 ranks padded
        (16, ["--resume-world-size", "2,12"], 0),  # more ranks than samples left: padded in rounds
        (0, ["--resume"], 2),  # an empty data set: refused before any loader
    ],
)
def test_tiny_epochs(n, argv, expected, tmp_path, capsys):
    source = f"""
    def make():
        return {{"dataset": data({n}), "batch_sampler": IndexBatches({n}, 4, shuffle=True)}}
    """
    spec = spec_of(tmp_path, "tiny", source)
    status, text = doctor([*argv, "--workers", "1", "--dataset", spec], capsys)
    assert status == expected, text
    if expected == 2:
        said = "gave an empty data set" if n == 0 else "a checkpoint needs one before it and one after"
        assert said in text, text


@pytest.mark.parametrize("checkpoints, status_expected", [("0", 2), ("1", 2), ("1000000000", 0)])
def test_checkpoints_out_of_range(checkpoints, status_expected, tmp_path, capsys):
    spec = spec_of(
        tmp_path,
        "checkpoints",
        """
    def make():
        return {"dataset": data(40), "batch_sampler": IndexBatches(40, 4, shuffle=True)}
    """,
    )
    argv = ["--resume", "--workers", "1", "--checkpoints", checkpoints, "--dataset", spec]
    status, text = doctor(argv, capsys)
    assert status == status_expected, text
    if status_expected == 0:
        assert "10 checkpoints, after batch 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 of 10" in text, text
    else:
        assert "--checkpoints: must be at least 2" in text, text


def test_a_factory_that_makes_another_sampler_every_call_is_not_ok(tmp_path, capsys):
    source = """
    import random

    def make():
        seed = random.randrange(10**9)
        return {"dataset": data(40), "batch_sampler": IndexBatches(40, 4, shuffle=True, seed=seed)}
    """
    spec = spec_of(tmp_path, "nondeterministic", source)
    status, text = doctor(["--resume", "--workers", "1", "--dataset", spec], capsys)
    assert status == 1 and "the state was made for another sampler: seed=" in text, text


@pytest.mark.parametrize("lie", ["+ 1", "- 1"])
def test_a_sampler_whose_len_lies_fails_saying_so(lie, tmp_path, capsys):
    source = f"""
    class Lies(IndexBatches):
        def __len__(self):
            return super().__len__() {lie}

    def make():
        return {{"dataset": data(40), "batch_sampler": Lies(40, 4, shuffle=True)}}
    """
    spec = spec_of(tmp_path, "len_lies", source)
    status, text = doctor(["--resume", "--workers", "1", "--dataset", spec], capsys)
    said = f"the epoch ran 10 batches a rank, not the {10 + (1 if lie == '+ 1' else -1)} its len() says"
    assert status == 1 and said in text, text


def test_a_sample_slower_than_the_timeout_is_a_failed_loader(tmp_path, capsys):
    source = """
    import time

    class Slow(Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, index):
            time.sleep(1.2 if index == 5 else 0)
            return int(index)

    def make():
        return {"dataset": Slow(), "batch_sampler": IndexBatches(40, 4)}
    """
    spec = spec_of(tmp_path, "slow", source)
    status, text = doctor(["--resume", "--workers", "1", "--timeout", "0.4", "--dataset", spec], capsys)
    assert status == 1 and "no batch came within --timeout 0.4 s" in text, text


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_killed_worker_is_a_failed_loader(tmp_path, capsys):
    source = """
    class Kills(Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, index):
            if index == 23 and torch.utils.data.get_worker_info() is not None:
                os._exit(9)
            return int(index)

    def make():
        return {"dataset": Kills(), "batch_sampler": IndexBatches(40, 4, shuffle=True)}
    """
    spec = spec_of(tmp_path, "killed", source)
    status, text = doctor(["--resume", "--workers", "1", "--timeout", "20", "--dataset", spec], capsys)
    # torch tells a worker's death as "exited unexpectedly" or, racing the pipe's end, as a bare EOFError
    assert status == 1 and ("exited unexpectedly" in text or "the loader raised EOFError" in text), text


RLIMIT_AS_RUN = """
import resource, sys
import numpy, torch, torchdata.stateful_dataloader
from fastcollate.tools.audit.doctor import main
size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024 + 300 * 2**20
resource.setrlimit(resource.RLIMIT_AS, (size, size))
sys.exit(main(sys.argv[1:]))
"""


def test_a_sample_over_the_address_space_limit_is_a_failed_loader(tmp_path):
    spec = spec_of(
        tmp_path,
        "rlimit_as",
        """
    class Huge(Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, index):
            if index == 23:
                return {"x": torch.from_numpy(np.ones(2**30, np.uint8))}  # 1 GiB, over the limit
            return {"x": torch.tensor([float(index)])}

    def make():
        return {"dataset": Huge(), "batch_sampler": IndexBatches(40, 4, shuffle=True)}
    """,
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            RLIMIT_AS_RUN,
            "--resume",
            "--workers",
            "1",
            "--timeout",
            "20",
            "--dataset",
            spec,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "Caught MemoryError in DataLoader worker" in done.stdout, (
        done.stdout + done.stderr
    )


def test_a_distributed_sampler_batch_sampler_resumes_on_its_world_size_only(tmp_path, capsys):
    source = """
    from torch.utils.data import DistributedSampler

    class DistributedBatches(BatchSampler):
        def __init__(self, dataset, batch_size, rank=0, num_replicas=1, shuffle=True, seed=0):
            sampler = DistributedSampler(dataset, num_replicas, rank, shuffle=shuffle, seed=seed)
            super().__init__(sampler, batch_size, False)
            self.dataset, self.rank, self.num_replicas = dataset, rank, num_replicas
            self.shuffle, self.seed = shuffle, seed

    def make():
        dataset = data(40)
        return {"dataset": dataset, "batch_sampler": DistributedBatches(dataset, 4)}
    """
    spec = spec_of(tmp_path, "distributed_batches", source)
    status, text = doctor(["--resume-world-size", "2,2", "--workers", "1", "--dataset", spec], capsys)
    assert status == 0, text
    status, text = doctor(["--resume-world-size", "2,3", "--workers", "1", "--dataset", spec], capsys)
    assert status == 2 and "its batch sampler (DistributedBatches) keeps no state" in text, text


def test_a_for_rank_that_reads_torch_distributed_is_not_verified(tmp_path, capsys):
    source = """
    import torch.distributed as dist

    class FromTheGroup(IndexBatches):
        def for_rank(self, rank, world_size):
            return super().for_rank(dist.get_rank(), dist.get_world_size())

    def make():
        return {"dataset": data(40), "batch_sampler": FromTheGroup(40, 4, shuffle=True)}
    """
    spec = spec_of(tmp_path, "from_the_group", source)
    status, text = doctor(["--resume-world-size", "2,3", "--workers", "1", "--dataset", spec], capsys)
    assert status == 2 and "FromTheGroup.for_rank(0, 2) refused" in text, text


def test_a_subclass_with_its_own_arguments_and_properties_runs_on_every_rank(tmp_path, capsys, monkeypatch):
    source = """
    class Tempered(IndexBatches):
        def __init__(self, n, batch_size, *, temperature, **options):
            super().__init__(n, batch_size, **options)
            self.temperature = temperature

        @property
        def label(self):
            return f"T={self.temperature}"

        def __iter__(self):
            logged(type(self).__name__, self.label, self.rank, self.world_size)
            yield from super().__iter__()

    def make():
        return {"dataset": data(48), "batch_sampler": Tempered(48, 4, temperature=0.5, shuffle=True)}
    """
    spec = spec_of(tmp_path, "tempered", source, monkeypatch)
    status, text = doctor(["--resume-world-size", "2,3", "--workers", "1", "--dataset", spec], capsys)
    assert status == 0, text
    ran = set((tmp_path / "sampler.log").read_text().splitlines())
    assert ran == {f"Tempered T=0.5 {r} {w}" for w in (2, 3) for r in range(w)}, ran


def test_the_report_is_what_ran(tmp_path, capsys):
    spec = spec_of(
        tmp_path,
        "reported",
        """
    def make():
        return {"dataset": data(203), "batch_sampler": IndexBatches(203, 8, shuffle=True)}
    """,
    )
    argv = [
        "--resume-world-size",
        "3,2",
        "--workers",
        "1",
        "--seed",
        "4",
        "--json",
        str(tmp_path / "report.json"),
    ]
    status, text = doctor([*argv, "--dataset", spec], capsys)
    report = report_of(tmp_path)
    assert status == 0 == report["exit_status"], text
    assert report["world_sizes"] == [3, 2] and report["batches_a_rank"] == 9
    assert [run["after_batch"] for run in report["runs"]] == report["checkpoints"]
    assert len(report["checkpoints"]) == 8 and {1, 2, 8, 9} <= set(report["checkpoints"])
    assert all(run["report"]["expected"] == 203 and not run["problems"] for run in report["runs"])
    last = text.splitlines()[-1]
    assert last.startswith("resume check: OK (exit status 0) in ") and last.endswith(" s, 8 checkpoints"), (
        last
    )
    said = float(last.split(" in ")[1].split(" s")[0])
    assert abs(said - report["seconds"]) <= 0.051, (said, report["seconds"])


@pytest.mark.parametrize(
    "name, argv",
    [
        ("make", ["--resume"]),
        ("make_resumable", ["--resume"]),
        ("make_resumable", ["--resume-world-size", "2,3"]),
    ],
)
def test_the_default_run_on_the_bundled_example_is_quick(name, argv, tmp_path, capsys):
    example = os.path.join(ROOT, "examples", "padded_text.py")
    argv = [*argv, "--json", str(tmp_path / "report.json"), "--dataset", f"{example}:{name}"]
    status, text = doctor(argv, capsys)
    report = report_of(tmp_path)
    assert status == 0 and len(report["checkpoints"]) == 8, text
    assert report["seconds"] < 30, report["seconds"]
    if name == "make":
        assert "needs a batch sampler that keeps state" in text and "--resume-workers N checks it" in text, (
            text
        )


# ----------------------------------------------------------------------------------------------------
# for_rank
# ----------------------------------------------------------------------------------------------------


class Tagged(IndexBatches):
    """A subclass with an extra required constructor argument and a property."""

    def __init__(self, n, batch_size, *, tag, **options):
        super().__init__(n, batch_size, **options)
        self.tag = tag

    @property
    def label(self):
        return f"{self.tag}:{self.rank}/{self.world_size}"


def test_for_rank_keeps_the_subclass_and_resets_the_split_and_the_epoch():
    sampler = Tagged(50, 4, tag="t", shuffle=True, seed=3)
    sampler.set_epoch(5)
    it = iter(sampler)
    next(it)  # an epoch under way
    state = sampler.state_dict()
    loaded = Tagged(50, 4, tag="t", shuffle=True, seed=3)
    loaded.load_state_dict(state)
    for source in (sampler, loaded):
        split = source.for_rank(1, 3)
        assert type(split) is Tagged and split.tag == "t" and split.label == "t:1/3"
        assert split.epoch == 0 and split.state_dict()["batches_done"] == 0
        expected = IndexBatches(50, 4, shuffle=True, seed=3, rank=1, world_size=3)
        assert len(split) == len(expected)
        assert [b.tolist() for b in split] == [b.tolist() for b in expected]
    # the original goes on where it was
    assert sampler.rank == 0 and sampler.world_size == 1 and sampler.epoch == 5
    assert len(list(it)) == len(sampler) - 1 and sampler.state_dict()["batches_done"] == len(sampler)


def test_for_rank_refuses_a_generator_and_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="generator"):
        IndexBatches(10, 2, shuffle=True, generator=torch.Generator()).for_rank(0, 2)
    for sampler in (IndexBatches(10, 2), TokenBudgetBatches([1] * 10, 3)):
        with pytest.raises(ValueError, match="rank"):
            sampler.for_rank(2, 2)


def test_a_sampler_after_for_rank_pickles_and_resumes():
    index = IndexBatches(60, 4, shuffle=True, seed=2).for_rank(1, 3)
    tokens = TokenBudgetBatches(np.arange(1, 61) % 7 + 1, 12, shuffle=True, seed=2).for_rank(1, 3)
    for split in (index, tokens):
        len(split)  # a cached layout rides along
        copy = pickle.loads(pickle.dumps(split))
        assert type(copy) is type(split) and (copy.rank, copy.world_size) == (1, 3)
        assert [list(map(int, b)) for b in copy] == [list(map(int, b)) for b in split]
        it = iter(split)
        next(it)
        state = split.state_dict()
        again = pickle.loads(pickle.dumps(split.for_rank(1, 3)))
        again.load_state_dict(state)
        assert [list(map(int, b)) for b in again] == [list(map(int, b)) for b in it]


# ----------------------------------------------------------------------------------------------------
# TokenBudgetBatches: split to a multiple of the world size
# ----------------------------------------------------------------------------------------------------


def contiguous_counts(lengths, max_tokens):
    """Every count of batches a cut of ``lengths`` (in order) gives, each batch within max_tokens and with
    a sample that has tokens."""
    counts = set()
    for mask in range(1 << (len(lengths) - 1)):
        cuts = [i + 1 for i in range(len(lengths) - 1) if mask >> i & 1]
        parts = np.split(np.asarray(lengths), cuts)
        if all(part.sum() <= max_tokens and np.count_nonzero(part) for part in parts):
            counts.add(len(parts))
    return counts


def test_split_to_multiple_refuses_exactly_where_no_cut_divides():
    draw = random.Random(53)
    for _ in range(1500):
        n, max_tokens, world = draw.randint(1, 8), draw.randint(1, 12), draw.randint(1, 6)
        lengths = np.array([min(draw.choice([0, 0, 1, 2, 3, 5, 8, 12]), max_tokens) for _ in range(n)])
        if not lengths.any():
            continue
        got = _split_to_multiple(_fill(np.arange(n), lengths, max_tokens), lengths, world)
        possible = any(count % world == 0 for count in contiguous_counts(lengths, max_tokens))
        assert (got is not None) == possible, (lengths.tolist(), max_tokens, world)
        if got is not None:
            assert len(got) % world == 0 and np.array_equal(np.concatenate(got), np.arange(n))
            assert all(lengths[b].sum() <= max_tokens and np.count_nonzero(lengths[b]) for b in got)


def test_a_refused_world_size_names_world_sizes_that_resume():
    lengths = [10] * 12
    ranks = [TokenBudgetBatches(lengths, 10, rank=r, world_size=2) for r in range(2)]
    iterators = [iter(s) for s in ranks]
    for it in iterators:
        next(it)
    state = ranks[0].state_dict()
    with pytest.raises(ValueError, match=r"Resume on 1, 2, 5 or 10 ranks") as refused:
        TokenBudgetBatches(lengths, 10, rank=0, world_size=3).load_state_dict(state)
    assert "3 ranks" in str(refused.value)
    for world in (1, 2, 5, 10):
        delivered = [0, 1]  # ranks 0 and 1 took samples 0 and 1 between them
        for rank in range(world):
            sampler = TokenBudgetBatches(lengths, 10, rank=rank, world_size=world)
            sampler.load_state_dict(state)
            delivered += [i for batch in sampler for i in batch]
        assert sorted(delivered) == list(range(12)), world


# ----------------------------------------------------------------------------------------------------
# ResumableEpochs: len(), iterators, states
# ----------------------------------------------------------------------------------------------------


def two_rank_state(batches, cls=IndexBatches, n=100):
    ranks = [cls(n, 4, shuffle=True, rank=r, world_size=2) for r in range(2)]
    iterators = [iter(s) for s in ranks]
    for _ in range(batches):
        for it in iterators:
            next(it, None)
    if batches > len(ranks[0]):
        for it in iterators:
            list(it)
    return ranks[0].state_dict()


def test_len_keeps_the_epoch_s_count_after_its_iteration_ran_out_and_until_set_epoch():
    state = two_rank_state(5)
    for rank in range(3):
        sampler = IndexBatches(100, 4, shuffle=True, rank=rank, world_size=3)
        sampler.load_state_dict(state)
        counted = len(sampler)
        ran = sum(1 for _ in sampler)
        assert counted == 5 + ran == len(sampler), (counted, ran)
        sampler.set_epoch(1)
        assert len(sampler) == len(IndexBatches(100, 4, rank=rank, world_size=3)) == 9


def test_a_loaded_state_whose_iteration_ended_counts_the_ordinary_epoch():
    state = two_rank_state(99)  # the whole epoch, iteration ended
    assert state["iteration_ended"] and state["batches_done"] == 13
    sampler = IndexBatches(100, 4, shuffle=True, rank=0, world_size=3)
    sampler.load_state_dict(state)
    assert len(sampler) == 9
    assert sum(1 for _ in sampler) == 9 == len(sampler)


class SlowDraw(IndexBatches):
    """Its epoch's permutation takes a while to draw (a large n): the gate lets a thread in meanwhile."""

    gate: tuple | None = None

    def _order(self, epoch):
        if self.gate is not None:
            started, go_on = self.gate
            started.set()
            go_on.wait(5)
        return super()._order(epoch)


def test_len_read_by_another_thread_while_the_next_iteration_starts():
    ranks = [SlowDraw(100, 4, shuffle=True, rank=r, world_size=2) for r in range(2)]
    for sampler in ranks:
        list(sampler)
    state = ranks[0].state_dict()
    sampler = SlowDraw(100, 4, shuffle=True, rank=0, world_size=3)
    sampler.load_state_dict(state)
    before = len(sampler)
    seen = []
    sampler.gate = (threading.Event(), threading.Event())

    def read():
        sampler.gate[0].wait(5)
        seen.append(len(sampler))
        sampler.gate[1].set()

    thread = threading.Thread(target=read)
    thread.start()
    next(iter(sampler))
    thread.join()
    assert seen == [before] == [len(sampler)] == [9], (before, seen, len(sampler))


def test_an_iterator_kept_across_set_epoch_does_not_move_the_new_epoch():
    sampler = IndexBatches(40, 4, shuffle=True, rank=0, world_size=2)
    old = iter(sampler)
    first = next(old)
    sampler.set_epoch(1)
    new = iter(sampler)
    next(new)
    next(new)
    rest_of_old = list(old)  # epoch 0's batches, to their end
    assert len(rest_of_old) == len(sampler) - 1
    epoch0 = list(IndexBatches(40, 4, shuffle=True, rank=0, world_size=2))
    assert [b.tolist() for b in [first, *rest_of_old]] == [b.tolist() for b in epoch0]
    state = sampler.state_dict()
    assert (state["epoch"], state["batches_done"], state["iteration_ended"]) == (1, 2, False)
    assert len(sampler) == 5


def test_a_state_taken_after_set_epoch_mid_iteration_is_the_new_epoch_s_start():
    sampler = IndexBatches(40, 4, shuffle=True, seed=2)
    old = iter(sampler)
    for _ in range(3):
        next(old)
    sampler.set_epoch(1)  # epoch 0's iteration still under way
    state = sampler.state_dict()
    assert (state["epoch"], state["batches_done"], state["samples_done"]) == (1, 0, 0)
    assert len(list(old)) == 7 and sampler.state_dict() == state, "epoch 0's iterator moves nothing"
    resumed = IndexBatches(40, 4, shuffle=True, seed=2)
    resumed.load_state_dict(state)
    fresh = IndexBatches(40, 4, shuffle=True, seed=2)
    fresh.set_epoch(1)
    assert [b.tolist() for b in resumed] == [b.tolist() for b in fresh]


def test_load_state_dict_twice_the_second_wins_with_a_generator():
    def run(n_batches):
        sampler = IndexBatches(30, 4, shuffle=True, generator=torch.Generator().manual_seed(7))
        it = iter(sampler)
        for _ in range(n_batches):
            next(it)
        return sampler.state_dict(), [b.tolist() for b in it], sampler.generator.get_state()

    first, _, _ = run(2)
    second, rest, generator_after = run(5)
    sampler = IndexBatches(30, 4, shuffle=True, generator=torch.Generator().manual_seed(99))
    sampler.load_state_dict(first)
    sampler.load_state_dict(second)
    assert len(sampler) == 8
    assert [b.tolist() for b in sampler] == rest
    assert torch.equal(sampler.generator.get_state(), generator_after)


def test_a_state_loaded_while_another_epoch_is_being_iterated():
    taken = IndexBatches(40, 4, shuffle=True, seed=1)
    taken.set_epoch(3)
    it = iter(taken)
    for _ in range(4):
        next(it)
    state = taken.state_dict()
    rest = [b.tolist() for b in it]

    busy = IndexBatches(40, 4, shuffle=True, seed=1)
    running = iter(busy)
    first = next(running)
    busy.load_state_dict(state)
    assert len(busy) == 10 and busy.epoch == 3
    assert [b.tolist() for b in [first, *running]] == [
        b.tolist() for b in IndexBatches(40, 4, shuffle=True, seed=1)
    ]
    assert busy.state_dict() == state, "the old iteration does not move the loaded position"
    assert [b.tolist() for b in busy] == rest


def test_index_batches_stay_within_their_resume_allowance():
    for n in range(1, 20):
        for batch_size in (1, 3):
            for world, resumed in ((2, 3), (3, 2), (1, 4)):
                for drop_last, sampler_drop_last in ((False, False), (True, False), (False, True)):
                    options = dict(
                        shuffle=True, seed=3, drop_last=drop_last, sampler_drop_last=sampler_drop_last
                    )

                    def make(rank, size, n=n, batch_size=batch_size, options=options):
                        return IndexBatches(n, batch_size, rank=rank, world_size=size, **options)

                    ranks = [make(r, world) for r in range(world)]
                    iterators = [iter(s) for s in ranks]
                    allowance = ranks[0].resume_allowance(world, resumed)
                    before = []
                    for k in range(len(ranks[0]) + 1):
                        if k:
                            before += [i for it in iterators for i in next(it).tolist()]
                        state = ranks[0].state_dict()
                        after = []
                        for rank in range(resumed):
                            sampler = make(rank, resumed)
                            sampler.load_state_dict(state)
                            after += [i for b in sampler for i in b.tolist()]
                        counts = collections.Counter(before + after)
                        repeats, drops = sum(counts.values()) - len(counts), n - len(counts)
                        where = (n, batch_size, world, resumed, drop_last, sampler_drop_last, k)
                        assert repeats <= allowance.repeats and drops <= allowance.drops, where
