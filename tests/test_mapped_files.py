"""Files under memory-mapped columns: a file that shrinks, vanishes or is replaced is named in an error (or,
where the mapping is intact, still read), never a crash and never other data. Cases that would kill the
process if the protection failed run in a subprocess, whose exit must be an error, not a signal."""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import fastcollate
from fastcollate import Arrays, Contract, Field, MappedFileError, Packing, Ragged, TokenBudgetBatches
from fastcollate.data.mapped_files import FileIdentity

from .helpers.processes import ROOT
from .test_faults import run_until_error


def _run(script: str, tmp_path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
    )


def _no_signal(result: subprocess.CompletedProcess) -> str:
    assert result.returncode >= 0, (
        f"killed by {signal.Signals(-result.returncode).name}:\n{result.stdout}\n{result.stderr}"
    )
    return result.stdout


_MAKE = """
    import os, threading, numpy as np, torch, fastcollate
    from fastcollate import Arrays, Contract, Field, MappedFileError, Ragged
    def make(name, rows=64, width=64, dtype=np.float32):
        np.arange(rows * width, dtype=dtype).tofile(name)
        return np.memmap(name, dtype=dtype, mode="r", shape=(rows, width))
    def outcome(label, call):
        print("trying", label, flush=True)
        try:
            call()
            print(label, "returned")
        except MappedFileError as error:
            print(label, "MappedFileError", error)
        except RuntimeError as error:  # straight from an op: a read fault, or something else
            print(label, "fault" if fastcollate.data.mapped_files.is_read_fault(error) else "other", error)
"""


def test_a_truncated_file_is_an_error_on_every_path_that_reads_it_never_sigbus(tmp_path):
    # The per-sample path (contracts the column path does not cover), ds[i] and np.asarray over a memmap
    # all check the file before reading it.
    result = _run(_MAKE + """
    x = make("x.bin")
    ds = Arrays(x=x, index_as="id")
    as_array = Arrays(x=np.asarray(make("y.bin")), index_as="id")
    os.truncate("x.bin", 1000)
    os.truncate("y.bin", 1000)
    per_sample = {
        "expand_from": Contract({"id": Field(kind="number"), "x": Field(shape=(64,), expand_from=((1,),))}),
        "float_to_int": Contract(
            {"id": Field(kind="number"), "x": Field(dtype=torch.int64, cast_from=(torch.float32,))}
        ),
        "text": Contract({"id": Field(kind="number"), "x": Field(kind="text")}),
        "pad_fixed_rows": Contract({"id": Field(kind="number"), "x": Field(shape=("T",), pad=0)}),
    }
    for label, contract in per_sample.items():
        outcome(label, lambda: fastcollate.assemble.using(contract)(ds.__getitems__([63, 0])))
    outcome("gathered", lambda: fastcollate.assemble(ds.__getitems__([63])))
    outcome("np.asarray", lambda: fastcollate.assemble(as_array.__getitems__([63])))
    outcome("ds[i]", lambda: ds[63]["x"].sum())
    outcome("samples walked", lambda: fastcollate.assemble(list(ds.__getitems__([63]))))
    """, tmp_path)
    out = _no_signal(result)
    assert result.returncode == 0, result.stderr
    for label in ("expand_from", "float_to_int", "text", "pad_fixed_rows", "gathered", "np.asarray", "ds[i]",
                  "samples walked"):
        assert f"{label} MappedFileError Arrays: column 'x': its file" in out, out
    assert "shrank to 1000 bytes, but the column needs 16384" in out


_GUARDED_OPS = """
    import faulthandler
    x = make("x.bin", rows=4096, width=1024)  # 16 MiB: the copies run on two threads
    ds = Arrays(x=x, index_as="id")
    stream = make("t.bin", rows=1, width=1 << 20, dtype=np.uint16).reshape(-1)
    windows = fastcollate.TokenWindows(stream, 1024)
    os.truncate("t.bin", 4096)
    rows = torch.from_numpy(np.asarray(x))  # not traced to its file: only the guard stands before SIGBUS
    os.truncate("x.bin", 4096)
    every = torch.arange(4096)
    faulthandler.enable()  # a handler installed after fastcollate's: the guard must still be the one
    torch.set_num_threads(2)
    outcome("gather_into", lambda: torch.ops.fastcollate.gather_into(rows, every, torch.empty(4096, 1024)))
    def out(dtype=torch.float32):
        return torch.empty(4096, 1024, dtype=dtype)
    outcome("gather_into cast", lambda: torch.ops.fastcollate.gather_into(rows, every, out(torch.float64)))
    outcome("gather_into narrowing",
            lambda: torch.ops.fastcollate.gather_into(rows.view(torch.int32), every, out(torch.int16)))
    flat, offsets = rows.reshape(-1), torch.arange(0, 4096 * 1024 + 1, 1024)
    outcome("gather_ragged_into", lambda: torch.ops.fastcollate.gather_ragged_into(
        flat, offsets, every, 0, out(), out(torch.bool), torch.empty(4096, dtype=torch.long)))
    outcome("gather_packed_into", lambda: torch.ops.fastcollate.gather_packed_into(
        flat, offsets, every, offsets.to(torch.int32), torch.empty(4096 * 1024)))
    outcome("walked", lambda: fastcollate.assemble([{"x": rows[i]} for i in range(4096)]))
    torch.set_num_threads(1)
    outcome("one thread", lambda: torch.ops.fastcollate.gather_into(rows, every, torch.empty(4096, 1024)))
    # Another SIGBUS handler installed just after a guarded op: the next op must put the guard back first.
    faulthandler.enable()
    outcome("faulthandler just before", lambda: torch.ops.fastcollate.gather_into(rows, every, out()))
    import signal
    signal.signal(signal.SIGBUS, lambda *_: None)  # returns: a fault it took would recur forever
    outcome("python handler just before", lambda: torch.ops.fastcollate.gather_into(rows, every, out()))
    outcome("untraced", lambda: fastcollate.assemble(Arrays(x=rows, index_as="id").__getitems__(every)))
    # its file intact: not to be blamed
    beside = Arrays(x=rows, traced=make("b.bin", rows=4096, width=4), index_as="id")
    outcome("untraced beside", lambda: fastcollate.assemble(beside.__getitems__(every)))
    # The file check passes (as when the file shrinks just after it): the guard names the column.
    fastcollate.data.mapped_files.MappedFile.unreadable = lambda self: None
    outcome("raced", lambda: fastcollate.assemble(ds.__getitems__(every)))
    outcome("windows", lambda: fastcollate.assemble(windows.__getitems__(every[:1000])))
    print("after", fastcollate.assemble(ds.__getitems__([0]))["x"].sum().item(), flush=True)
"""


def test_the_copies_from_a_file_that_shrank_raise_a_read_fault_instead_of_dying(tmp_path):
    result = _run(_MAKE + _GUARDED_OPS, tmp_path)
    out = _no_signal(result)
    assert result.returncode == 0, result.stderr
    for label in ("gather_into", "gather_into cast", "gather_into narrowing", "gather_ragged_into",
                  "gather_packed_into", "one thread", "faulthandler just before",
                  "python handler just before"):
        assert f"\n{label} fault fastcollate: a read from a memory-mapped file faulted" in out, out
    assert "walked MappedFileError fastcollate: a read from a memory-mapped file faulted" in out
    assert "nothing of the batch was handed out. A tensor of the batch lies in a memory-mapped file" in out
    assert "untraced MappedFileError Arrays: column 'x': a read faulted" in out
    assert "untraced beside MappedFileError Arrays: column 'x': a read faulted" in out
    raced = "MappedFileError Arrays: column {!r}: a read past the end of a mapped file faulted while the"
    assert "raced " + raced.format("x") in out
    assert "the file of 'x' was truncated or rewritten during the copy, and has grown back" in out
    assert "windows " + raced.format("input_ids") in out, "the stream's file, not an untraced tensor"
    assert "the file of 'tokens' was truncated" in out
    assert "after 523776.0" in out, "row 0 is still in the file: the guard leaves the process usable"


@pytest.mark.skipif(
    "libasan" in os.environ.get("LD_PRELOAD", ""), reason="AddressSanitizer reports SIGBUS itself and exits"
)
def test_a_read_the_guard_does_not_cover_still_dies_of_sigbus_as_without_fastcollate(tmp_path):
    # The handler is fastcollate's only inside its copies: elsewhere SIGBUS keeps its usual meaning.
    result = _run(_MAKE + """
    x = make("x.bin", rows=4096, width=1024)
    fastcollate.assemble(Arrays(x=x, index_as="id").__getitems__([0]))  # the handler is installed
    os.truncate("x.bin", 4096)
    print("reading", flush=True)
    print(np.asarray(x)[-1].sum())
    """, tmp_path)
    assert result.returncode == -signal.SIGBUS, (result.returncode, result.stdout, result.stderr)


def test_a_file_rewritten_in_place_during_gathers_gives_errors_or_right_batches_never_a_crash(tmp_path):
    result = _run(_MAKE + """
    import time
    x = make("x.bin", rows=2048, width=1024)  # 8 MiB
    expected = np.arange(2048 * 1024, dtype=np.float32)
    ds = Arrays(x=x, index_as="id")
    stop = threading.Event()
    def rewrite():
        while not stop.is_set():
            with open("x.bin", "r+b") as f:
                f.truncate(0)
                f.write(expected.tobytes())
    writer = threading.Thread(target=rewrite)
    writer.start()
    right = errors = 0
    deadline = time.monotonic() + 4
    try:
        while time.monotonic() < deadline:
            indices = np.random.randint(0, 2048, 256)
            try:
                batch = fastcollate.assemble(ds.__getitems__(indices))["x"]
            except MappedFileError as error:
                assert "Arrays: column 'x'" in str(error), error
                errors += 1
                continue
            assert torch.equal(batch, torch.from_numpy(expected.reshape(2048, 1024)[indices])), "other data"
            right += 1
    finally:
        stop.set()
        writer.join()
    print("right", right, "errors", errors)
    """, tmp_path)
    out = _no_signal(result)
    assert result.returncode == 0, result.stderr
    assert "errors" in out


def test_a_deleted_path_under_an_intact_mapping_goes_on_working(tmp_path):
    path = tmp_path / "x.bin"
    np.arange(64 * 8, dtype=np.float32).tofile(path)
    dataset = Arrays(x=np.memmap(path, dtype=np.float32, mode="r", shape=(64, 8)), index_as="id")
    before = fastcollate.assemble(dataset.__getitems__(list(range(64))))["x"].clone()
    os.remove(path)
    assert torch.equal(dataset[1]["x"], before[1])
    assert torch.equal(fastcollate.assemble(dataset.__getitems__(list(range(64))))["x"], before)
    for workers, context in ((0, None), (2, "fork")):
        loader = DataLoader(dataset, batch_size=16, num_workers=workers, multiprocessing_context=context,
                            collate_fn=fastcollate.assemble)
        assert torch.equal(torch.cat([batch["x"] for batch in loader]), before)


def test_a_file_replaced_by_a_smaller_one_leaves_the_old_mapping_readable(tmp_path):
    path = tmp_path / "x.bin"
    np.arange(64 * 8, dtype=np.float32).tofile(path)
    dataset = Arrays(x=np.memmap(path, dtype=np.float32, mode="r", shape=(64, 8)), index_as="id")
    np.zeros(10, dtype=np.float32).tofile(tmp_path / "small.bin")
    os.replace(tmp_path / "small.bin", path)
    assert fastcollate.assemble(dataset.__getitems__([63]))["x"][0, -1] == 64 * 8 - 1


@pytest.mark.parametrize("context", [None, "fork", "spawn", "forkserver"])
def test_a_file_replaced_under_its_path_is_read_as_made_or_refused_by_a_worker_that_maps_it_again(
    tmp_path, context
):
    path = tmp_path / "x.bin"
    np.zeros((16, 4), dtype=np.float32).tofile(path)
    dataset = Arrays(x=np.memmap(path, dtype=np.float32, mode="r", shape=(16, 4)), index_as="id")
    np.ones((16, 4), dtype=np.float32).tofile(tmp_path / "new.bin")
    os.replace(tmp_path / "new.bin", path)  # same size, other data
    assert dataset[0]["x"].sum() == 0
    loader = DataLoader(dataset, batch_size=16, num_workers=0 if context is None else 1,
                        multiprocessing_context=context, collate_fn=fastcollate.assemble)
    if context in (None, "fork"):
        assert next(iter(loader))["x"].sum() == 0, "the mapping the dataset was made from"
        return
    error = run_until_error(loader, [])
    assert isinstance(error, MappedFileError)
    assert re.search(r"column 'x': its path .*x\.bin now holds another file", str(error)), error


def test_a_pickled_dataset_whose_file_was_deleted_refuses_at_its_first_read(tmp_path):
    path = tmp_path / "t.u16"
    np.arange(1000, dtype=np.uint16).tofile(path)
    windows = fastcollate.TokenWindows(np.memmap(path, dtype=np.uint16, mode="r"), 10)
    sent = pickle.dumps(windows)
    os.remove(path)
    again = pickle.loads(sent)
    assert len(again) == len(windows)
    gone = r"column 'tokens': its file .*t\.u16 was deleted or renamed after the dataset was made"
    with pytest.raises(MappedFileError, match=gone):
        again[0]
    with pytest.raises(MappedFileError, match="column 'tokens'"):
        fastcollate.assemble(again.__getitems__([0, 1]))


def test_a_ragged_column_owns_its_offsets_so_the_callers_later_changes_change_nothing():
    values = np.arange(100, dtype=np.int64)
    offsets_np = np.arange(0, 101, 20)
    offsets_torch = torch.arange(0, 101, 20)
    contract = Contract({"id": Field(kind="number"), "t": Field(shape=("T",), pack=True)}, packing=Packing())
    for offsets in (offsets_np, offsets_torch):
        dataset = Arrays(t=Ragged(values, offsets), index_as="id")
        offsets[1] = 100  # a row of all 100 values, if the column still read the caller's array
        offsets[2:] = 0  # and decreasing offsets
        assert dataset[0]["t"].tolist() == list(range(20))
        assert dataset[3]["t"].tolist() == list(range(60, 80))
        packed = fastcollate.assemble.using(contract)(dataset.__getitems__([0, 3]))
        assert packed["t"][0].tolist() == list(range(20)) + list(range(60, 80))
        assert packed["cu_seq_lens_q"].tolist() == [0, 20, 40]


def test_an_op_error_on_a_column_names_the_column_and_the_row():
    dataset = Arrays(t=Ragged(np.arange(10), np.array([0, 4, 10])), index_as="id")
    dataset.columns["t"].offsets[1] = 11  # past the values: what a rewritten file of offsets could hold
    contract = Contract({"id": Field(kind="number"), "t": Field(shape=("T",), pad=0)})
    spans = r"^Arrays: column 't': row 0 \(batch position 0\) spans offsets 0\.\.11"
    with pytest.raises(IndexError, match=spans):
        fastcollate.assemble.using(contract)(dataset.__getitems__([0]))


def test_index_and_offset_errors_say_what_is_wrong_in_words_that_apply():
    dataset = Arrays(a=np.arange(6), index_as="id")
    with pytest.raises(IndexError, match=r"index 18446744073709551616 is out of range for a dataset of 6"):
        dataset.__getitems__([0, 2**64])
    with pytest.raises(IndexError, match=r"index -18446744073709551616 is out of range"):
        dataset.__getitems__([-(2**64)])
    offsets_words = r"offsets must be a torch.Tensor or a numpy array \(np.memmap included\), got list$"
    with pytest.raises(TypeError, match=offsets_words):
        Arrays(t=Ragged(np.arange(4), [0, 2, 4]), index_as="id")
    with pytest.raises(TypeError, match=r"or fastcollate.Ragged, got list"):
        Arrays(t=[1, 2], index_as="id")


def test_token_budget_batches_that_cannot_be_shared_evenly_by_the_ranks_are_refused_with_the_way_out():
    # Every sample nearly fills max_tokens, so each batch holds one and none can be split: DistributedSampler
    # would repeat samples to even the ranks out; this sampler refuses instead of repeating.
    batches = TokenBudgetBatches([90] * 14, 100, rank=0, world_size=8)
    refused = ("epoch 0's 14 samples fill 14 batches within max_tokens=100 .* 14 does not divide among 8 "
               "ranks.* Use 1, 2, 7 or 14 ranks, or raise max_tokens in a new run")
    with pytest.raises(ValueError, match=refused):
        list(batches)


def test_a_pickled_dataset_refuses_a_new_file_even_on_the_old_inode_and_reads_one_written_in_place(tmp_path):
    path = tmp_path / "x.bin"
    np.ones(64, dtype=np.float32).tofile(path)
    sent = pickle.dumps(Arrays(x=np.memmap(path, dtype=np.float32, mode="r", shape=(16, 4)), index_as="id"))
    os.remove(path)  # a new file of the same size may get the freed inode number: its generation differs
    np.full(64, 7, dtype=np.float32).tofile(path)
    changed = r"column 'x': its path .*x\.bin now holds another file than the one the dataset was made from"
    with pytest.raises(MappedFileError, match=changed + r" \(then inode"):
        pickle.loads(sent)[0]
    dataset = Arrays(x=np.memmap(path, dtype=np.float32, mode="r", shape=(16, 4)), index_as="id")
    sent = pickle.dumps(dataset)
    time.sleep(0.01)
    with open(path, "r+b") as f:  # in place: the same file, other bytes, as the dataset's own mapping sees
        f.write(np.full(4, 9, dtype=np.float32).tobytes())
    descriptor = os.open(path, os.O_RDONLY)
    generation = FileIdentity.of(descriptor).generation
    os.close(descriptor)
    if generation is None:  # the file system keeps no inode generation: the modification time decides
        with pytest.raises(MappedFileError, match="now holds another file"):
            pickle.loads(sent)[0]
    else:
        assert pickle.loads(sent)[0]["x"].tolist() == dataset[0]["x"].tolist() == [9.0] * 4


def _without_map_files(monkeypatch) -> None:
    """As for a user without CAP_CHECKPOINT_RESTORE: /proc/self/map_files cannot be opened."""
    opened = os.open

    def refuse_map_files(path, *args, **kwargs):
        if str(path).startswith("/proc/self/map_files/"):
            raise PermissionError(1, "Operation not permitted", path)
        return opened(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_map_files)


@pytest.mark.parametrize("map_files", [True, False], ids=["map_files", "path_only"])
def test_a_memmap_whose_path_was_replaced_or_deleted_before_the_dataset_is_read_as_mapped_or_refused(
    tmp_path, monkeypatch, map_files
):
    if not map_files:
        _without_map_files(monkeypatch)
    path = tmp_path / "x.bin"
    np.ones(64, dtype=np.float32).tofile(path)
    replaced = np.memmap(path, dtype=np.float32, mode="r", shape=(16, 4))
    np.full(64, 2, dtype=np.float32).tofile(tmp_path / "new.bin")
    os.replace(tmp_path / "new.bin", path)
    np.ones(64, dtype=np.float32).tofile(tmp_path / "gone.bin")
    deleted = np.memmap(tmp_path / "gone.bin", dtype=np.float32, mode="r", shape=(16, 4))
    os.remove(tmp_path / "gone.bin")
    if map_files and os.access("/proc/self/map_files", os.R_OK):
        dataset = Arrays(x=replaced, index_as="id")
        assert dataset[0]["x"].tolist() == [1.0] * 4, "the memmap's file, not the path's"
        assert Arrays(x=deleted, index_as="id")[0]["x"].tolist() == [1.0] * 4
        stale = r"its path .*x\.bin named another file, or none, already when the dataset was made"
        with pytest.raises(MappedFileError, match=stale + ".*make the np.memmap again from the path"):
            pickle.loads(pickle.dumps(dataset))[0]
        return
    other = r"column 'x': its path .*x\.bin names another file than the np\.memmap maps .*make the memmap"
    with pytest.raises(MappedFileError, match=other):
        Arrays(x=replaced, index_as="id")
    gone = r"column 'x': its file .*gone\.bin is no longer at its path .*keep the file in place until the"
    with pytest.raises(MappedFileError, match=gone):
        Arrays(x=deleted, index_as="id")


def test_running_out_of_descriptors_is_an_error_naming_the_column_and_the_limit(tmp_path):
    result = _run(_MAKE + """
    import resource
    x = make("x.bin", rows=4, width=4)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    kept = []
    try:
        for _ in range(100):
            kept.append(Arrays(x=x, index_as="id"))
    except MappedFileError as error:
        print("refused after", len(kept), error)
    """, tmp_path)
    out = _no_signal(result)
    assert result.returncode == 0, result.stderr
    assert "Arrays: column 'x': its file" in out and "raise the limit on open files (ulimit -n)" in out, out


def test_a_sigbus_sent_by_another_process_is_not_taken_for_a_read_fault(tmp_path):
    # kill -BUS goes to the handler that was there before fastcollate's: Python's, or the default (death).
    result = _run(_MAKE + """
    import signal
    ds = Arrays(x=make("x.bin"), index_as="id")
    signal.signal(signal.SIGBUS, lambda *_: print("python handler", flush=True))
    fastcollate.assemble(ds.__getitems__([0]))  # the guard's handler goes in front of Python's
    os.kill(os.getpid(), signal.SIGBUS)
    print("survived", flush=True)
    signal.signal(signal.SIGBUS, signal.SIG_DFL)
    fastcollate.assemble(ds.__getitems__([0]))
    os.kill(os.getpid(), signal.SIGBUS)
    print("not reached", flush=True)
    """, tmp_path)
    assert result.stdout.splitlines() == ["python handler", "survived"], result.stdout + result.stderr
    assert result.returncode == -signal.SIGBUS
