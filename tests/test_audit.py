"""fastcollate.tools.audit: ledgers of delivered ids, and the checks that catch lost, duplicated, changed and
reordered samples across workers, epochs and configurations."""

from __future__ import annotations

import sys
import time
from collections import namedtuple

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, default_collate

import fastcollate
from fastcollate import audit
from fastcollate.tools.audit.column import GrowingColumn
from fastcollate.tools.audit.differences import dense_span
from tests.helpers import audit_datasets as data

Pair = namedtuple("Pair", "left right")


def loader(dataset, workers=0, batch_size=4, collate_fn=fastcollate.assemble, **options) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=collate_fn, **options)


def epoch_of(dataset, workers=0, target_key="y", **options) -> audit.Epoch:
    return audit.Ledger(target_key=target_key).run(loader(dataset, workers, **options))


# --- clean datasets pass ---------------------------------------------------------------------------


def test_two_workers_deliver_the_same_ids_and_targets_as_one_process():
    reference = epoch_of(data.Records(12))
    other = epoch_of(data.Records(12), workers=2)
    report = audit.compare(reference, other)
    assert report.ok, str(report)
    assert report.targets_compared
    assert (report.missing, report.duplicated, report.changed_targets) == ([], {}, [])
    assert not report.order_differs
    assert set(other.workers.tolist()) == {0, 1}  # watch tagged each batch with its worker
    assert set(reference.workers.tolist()) == {audit.MAIN_PROCESS}


def test_watch_passes_batches_through_unchanged_and_restores_the_collate_fn():
    dl = loader(data.Records(8), workers=2)
    ledger = audit.Ledger()
    batches = list(ledger.watch(dl))
    assert dl.collate_fn is fastcollate.assemble
    assert all(isinstance(b, dict) and set(b) == {"id", "x", "y"} for b in batches)
    assert torch.cat([b["id"] for b in batches]).tolist() == list(range(8))
    assert ledger.last.ids.tolist() == list(range(8))
    assert ledger.last.batches == 2 and ledger.last.complete
    assert (
        ledger.last.first_batch_seconds is not None
        and ledger.last.wait_seconds >= ledger.last.first_batch_seconds
    )


def test_a_sharded_stream_passes_with_workers():
    reference = epoch_of(data.ShardedStream(12))
    report = audit.compare(reference, epoch_of(data.ShardedStream(12), workers=2), order="any")
    assert report.ok, str(report)


def test_fastcollate_delivers_what_default_collate_delivers():
    report = audit.compare_loaders(
        lambda: loader(data.Records(10), collate_fn=default_collate),
        lambda: loader(data.Records(10), workers=2),
        target_key=("y", "x"),
    )
    assert report.ok, str(report)
    assert report.targets_compared


# --- each failure class, caught with the right ids -------------------------------------------------


def test_every_worker_reading_the_whole_stream_is_named_worker_by_worker():
    reference = epoch_of(data.WholeStream(12))
    report = audit.compare(reference, epoch_of(data.WholeStream(12), workers=3), order="any")
    assert not report.ok
    assert report.duplicated == {i: 3 for i in range(12)}
    assert report.duplicate_workers == {i: (0, 1, 2) for i in range(12)}
    assert report.missing == []
    assert any("whole stream" in note and "get_worker_info" in note for note in report.notes)
    assert "0 x3 (workers 0, 1, 2)" in str(report)


def test_whole_stream_duplicates_are_caught_without_a_reference_too():
    report = audit.check(epoch_of(data.WholeStream(6), workers=2), expected=range(6))
    assert report.duplicated == {i: 2 for i in range(6)}
    assert report.duplicate_workers[4] == (0, 1)


def test_a_stale_cache_in_workers_loses_one_id_and_duplicates_another():
    report = audit.compare(epoch_of(data.Records(12)), epoch_of(data.StaleCacheInWorkers(12), workers=2))
    assert report.missing == [7]
    assert report.duplicated == {6: 2}
    assert report.duplicate_workers == {6: (1, 1)}  # batch [4..7] went to worker 1
    assert report.order_differs and report.first_order_difference == (7, 7, 6)
    assert report.problems() == ["1 missing", "1 duplicated", "order differs"]


def test_a_target_changed_in_workers_is_named():
    report = audit.compare(epoch_of(data.Records(12)), epoch_of(data.TargetsChangeInWorkers(12), workers=2))
    assert report.changed_targets == [5]
    assert report.missing == [] and report.duplicated == {}
    assert not report.ok


def test_without_targets_a_changed_target_goes_unseen_and_the_report_says_so():
    reference = epoch_of(data.Records(12), target_key=None)
    report = audit.compare(reference, epoch_of(data.TargetsChangeInWorkers(12), workers=2, target_key=None))
    assert report.ok and not report.targets_compared
    assert "not compared" in str(report)


def test_a_different_order_fails_only_where_the_same_order_was_expected():
    reference = epoch_of(data.Records(12))
    shuffled = epoch_of(
        data.Records(12), sampler=RandomSampler(range(12), generator=torch.Generator().manual_seed(1))
    )
    same = audit.compare(reference, shuffled, order="same")
    assert not same.ok and same.problems() == ["order differs"]
    position, expected, got = same.first_order_difference
    assert reference.ids[position] == expected and shuffled.ids[position] == got != expected
    assert audit.compare(reference, shuffled, order="shuffled").ok


def test_drop_last_tail_is_accounted_not_reported_as_loss():
    reference = epoch_of(data.Records(10))
    dropped = epoch_of(data.Records(10), shuffle=True, drop_last=True)
    assert len(dropped) == 8
    report = audit.compare(
        reference, dropped, order="shuffled", drop_last=True, batch_size=4, dataset_size=10
    )
    assert report.ok, str(report)
    assert len(report.dropped) == 2 and set(report.dropped) == set(range(10)) - set(dropped.ids.tolist())
    # without saying drop_last, the same two ids are a loss
    assert sorted(audit.compare(reference, dropped, order="shuffled").missing) == sorted(report.dropped)


def test_drop_last_does_not_excuse_more_than_its_tail():
    reference = audit.Epoch(ids=np.arange(10))
    lost = audit.Epoch(ids=np.arange(5))  # 5 missing; drop_last with batch 4 drops at most 2
    report = audit.compare(reference, lost, drop_last=True, batch_size=4, dataset_size=10)
    assert report.missing == [5, 6, 7, 8, 9] and report.dropped == []
    assert any("at most 2" in note for note in report.notes)


def test_two_shuffled_epochs_have_the_same_set_in_a_new_order():
    ledger = audit.Ledger(target_key="y")
    dl = loader(data.Records(16), workers=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    first, second = ledger.run(dl), ledger.run(dl)
    report = audit.compare(first, second, order="shuffled")
    assert report.ok and report.order_differs
    assert len(ledger.epochs) == 2


def test_an_order_that_does_not_change_under_shuffling_is_noted():
    ledger = audit.Ledger()
    epochs = [
        ledger.run(loader(data.Records(16), shuffle=True, generator=torch.Generator().manual_seed(3)))
        for _ in range(2)
    ]  # the generator re-seeded every epoch: the same "shuffle" twice
    report = audit.compare(epochs[0], epochs[1], order="shuffled")
    assert report.ok and any("re-seeded" in note for note in report.notes)


def test_string_ids_are_reported_as_strings():
    reference = epoch_of(data.NamedRecords(6))
    ids = reference.ids.copy()
    ids[1] = ids[0]
    report = audit.compare(reference, audit.Epoch(ids=ids, names=reference.names))
    assert report.missing == ["rec-001"]
    assert report.duplicated == {"rec-000": 2}


def test_string_ids_name_changed_targets_and_duplicates_with_another_target():
    reference = epoch_of(data.NamedRecords(8))
    ids, digests = reference.ids.copy(), reference.digests.copy()
    digests[2] ^= np.uint64(1)  # rec-002 changed
    ids[5], digests[5] = ids[4], digests[3]  # rec-004 twice, the copy with rec-003's target; rec-005 lost
    report = audit.compare(reference, audit.Epoch(ids=ids, digests=digests, names=reference.names))
    assert report.changed_targets == ["rec-002", "rec-004"]
    assert report.duplicated == {"rec-004": 2}
    assert report.missing == ["rec-005"]


@pytest.mark.parametrize("seed", range(6))
def test_dense_and_sparse_ids_give_the_same_differences(seed):
    """Dataset indices take the bitmap path, hashed ids the sort path: same answers, renamed."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    reference = rng.permutation(n)
    delivered = rng.choice(n + 5, size=int(rng.integers(0, 2 * n)), replace=True)  # losses, repeats, extras
    ref_digests = rng.integers(0, 4, n).astype(np.uint64)
    by_id = dict(zip(reference.tolist(), ref_digests.tolist(), strict=True))
    digests = np.array([by_id.get(i, 0) ^ int(rng.random() < 0.1) for i in delivered.tolist()], np.uint64)
    spread = np.int64(0x9E3779B97F4A7C1)  # a bijection on int64: the same structure, sparse
    dense = audit.compare(
        audit.Epoch(ids=reference, digests=ref_digests),
        audit.Epoch(ids=delivered, digests=digests),
        order="any",
    )
    sparse = audit.compare(
        audit.Epoch(ids=reference * spread, digests=ref_digests),
        audit.Epoch(ids=delivered * spread, digests=digests),
        order="any",
    )
    assert dense_span(reference, delivered) is not None
    assert dense_span(reference * spread, delivered * spread) is None

    def rename(values):
        return sorted(int(v) * int(spread) % 2**64 for v in values)

    def wrap(values):
        return sorted(int(v) % 2**64 for v in values)

    assert wrap(sparse.missing) == rename(dense.missing)
    assert wrap(sparse.unexpected) == rename(dense.unexpected)
    assert wrap(sparse.changed_targets) == rename(dense.changed_targets)
    assert sorted(sparse.duplicated.values()) == sorted(dense.duplicated.values())
    assert wrap(sparse.duplicated) == rename(dense.duplicated)


def test_when_most_targets_changed_every_changed_id_is_still_named():
    reference = audit.Epoch(ids=np.arange(100) * 10**15, digests=np.zeros(100, np.uint64))  # sparse
    other = audit.Epoch(ids=reference.ids[::-1].copy(), digests=np.ones(100, np.uint64))
    other.digests[:3] = 0  # ids 99, 98, 97 (reversed) unchanged
    report = audit.compare(reference, other, order="any")
    assert sorted(report.changed_targets) == [i * 10**15 for i in range(97)]


def test_identified_samples_from_with_ids_are_audited_by_index():
    dataset = fastcollate.with_ids([(torch.zeros(2), i % 3) for i in range(7)])
    ledger = audit.Ledger(id_key="id", target_key="sample.1")
    epoch = ledger.run(loader(dataset, workers=2, batch_size=3))
    assert epoch.ids.tolist() == list(range(7))
    assert audit.check(epoch, expected=7).ok


def test_stopping_early_records_an_incomplete_epoch():
    ledger = audit.Ledger()
    for number, _ in enumerate(ledger.watch(loader(data.Records(12)))):
        if number == 1:
            break
    assert not ledger.last.complete and len(ledger.last) == 8
    report = audit.check(ledger.last, expected=12)
    assert report.missing == [8, 9, 10, 11]
    assert any("stopped before" in note for note in report.notes)


def test_batches_without_ids_say_how_to_add_them():
    with pytest.raises(KeyError, match="with_ids"):
        audit.Ledger().run(loader(data.Records(4, with_id=False)))


def test_persistent_workers_keep_their_collate_fn_so_workers_are_unnamed_unless_tagged():
    untagged = audit.Ledger().run(loader(data.WholeStream(4), workers=2, persistent_workers=True))
    assert untagged.workers is None
    report = audit.check(untagged, expected=4)
    assert report.duplicated == {i: 2 for i in range(4)} and report.duplicate_workers == {}
    assert any("TagWorker" in note for note in report.notes)
    tagged = audit.Ledger().run(
        loader(data.WholeStream(4), workers=2, persistent_workers=True, collate_fn=audit.TagWorker())
    )
    assert audit.check(tagged, expected=4).duplicate_workers == {i: (0, 1) for i in range(4)}


def test_check_against_the_dataset_names_missing_and_unexpected_ids():
    report = audit.check(audit.Epoch(ids=np.array([0, 1, 2, 2, 9])), expected=5)
    assert report.missing == [3, 4]
    assert report.unexpected == [9]
    assert report.duplicated == {2: 2}
    assert report.to_dict()["missing"] == {"count": 2, "ids": [3, 4]}


def test_check_distributed_without_a_process_group_checks_this_process():
    ledger = audit.Ledger()
    ledger.run(loader(data.Records(6)))
    report = audit.check_distributed(ledger, expected=6)
    assert report.ok and any("not initialized" in note for note in report.notes)


def test_the_names_bench_and_profiling_use_stay_importable_from_fastcollate_audit():
    from fastcollate.tools.audit import (  # noqa: F401
        MAIN_PROCESS,
        TARGET_KEYS,
        AuditReport,
        Epoch,
        Ledger,
        Order,
        TagWorker,
        WorkerTagged,
        check,
        check_distributed,
        compare,
        compare_loaders,
        digest_rows,
    )

    assert TARGET_KEYS[0] == "y" and MAIN_PROCESS == -1
    assert fastcollate.AuditReport is AuditReport and fastcollate.Ledger is Ledger
    assert callable(compare) and callable(check)  # the functions, not the modules holding them


# --- digests ---------------------------------------------------------------------------------------


def test_a_sample_digest_does_not_depend_on_its_batch_neighbours():
    rows = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    whole = audit.digest_rows(rows, 6)
    halves = np.concatenate([audit.digest_rows(rows[:3], 3), audit.digest_rows(rows[3:], 3)])
    assert np.array_equal(whole, halves)
    assert len(set(whole.tolist())) == 6


@pytest.mark.parametrize("width", [1, 3, 8, 13, 100])
def test_any_one_changed_byte_changes_the_digest(width):
    rows = torch.zeros((4, width), dtype=torch.uint8)
    base = audit.digest_rows(rows, 4)
    for column in range(width):
        changed = rows.clone()
        changed[2, column] = 1
        digest = audit.digest_rows(changed, 4)
        assert digest[2] != base[2] and np.array_equal(np.delete(digest, 2), np.delete(base, 2))


def test_the_same_values_in_another_dtype_are_a_change():
    assert (
        audit.digest_rows(torch.tensor([1, 2]), 2)[0]
        != audit.digest_rows(torch.tensor([1, 2], dtype=torch.int32), 2)[0]
    )


def nested_batch() -> dict:
    """A batch of three samples nesting every kind of field digest_rows takes."""
    return {
        "y": torch.tensor([3, 1, 4]),
        "boxes": [torch.arange(6, dtype=torch.float32).reshape(3, 2), ("a", "bb", "ccc")],
        "meta": {
            "lengths": np.array([5, 6, 7], dtype=np.int32),
            "pair": Pair(torch.ones(3, 1), [1.5, 2.5, 3.5]),
        },
    }


def test_the_digest_of_a_nested_batch_stays_the_value_other_processes_and_ranks_compute():
    # Ledgers made by other processes, ranks or saved runs compare these values: they must not drift.
    assert audit.digest_rows(nested_batch(), 3).tolist() == [
        10098722629439523234,
        5588060118754624885,
        10001083900609329366,
    ]
    assert audit.digest_rows(torch.tensor([1, 2]), 2).tolist() == [12723126774915341492, 12699252372561423264]
    ledger = audit.Ledger(target_key=("y", "meta"))
    ledger.record({**nested_batch(), "id": torch.tensor([0, 1, 2])})
    assert ledger.end_epoch().digests.tolist() == [
        8770118770034685849,
        15218446514977939919,
        9969461329737981088,
    ]


# --- storage ---------------------------------------------------------------------------------------


def test_the_column_keeps_every_value_across_block_boundaries():
    column = GrowingColumn(np.int64)
    expected = []
    for size in (1, 4095, 2, 10_000, 0, 7):
        values = np.arange(len(expected), len(expected) + size)
        column.append(values)
        expected.extend(values.tolist())
    out = column.finish()
    assert out.dtype == np.int64 and out.tolist() == expected
    assert column.blocks == []


def test_an_epoch_saved_and_loaded_compares_equal(tmp_path):
    epoch = epoch_of(data.NamedRecords(5), workers=2)
    epoch.save(tmp_path / "epoch.npz")
    loaded = audit.Epoch.load(tmp_path / "epoch.npz")
    assert audit.compare(epoch, loaded).ok
    assert loaded.names == epoch.names and np.array_equal(loaded.workers, epoch.workers)


def test_ten_million_ids_fit_in_under_200_mb_and_their_losses_are_found():
    n, chunk = 10_000_000, 1 << 20
    ledger = audit.Ledger(target_key="y")
    for start in range(0, n, chunk):
        ids = (np.arange(start, min(start + chunk, n), dtype=np.int64) * 7919) % n  # a permutation of 0..n-1
        ledger.record_ids(
            ids, digests=audit.digest_rows(torch.from_numpy(ids % 1000), ids.size), worker=start % 3
        )
    epoch = ledger.end_epoch()
    assert epoch.ids.nbytes == 80_000_000
    assert epoch.nbytes == 180_000_000 < 200_000_000  # ids, target digests and workers together

    other = audit.Epoch(ids=epoch.ids.copy(), digests=epoch.digests.copy(), workers=epoch.workers)
    lost, twice, changed = int(other.ids[5]), int(other.ids[6]), int(other.ids[9_999_999])
    other.ids[5] = twice
    other.digests[9_999_999] ^= np.uint64(1)
    report = audit.compare(epoch, other)
    assert report.missing == [lost]
    assert report.duplicated == {twice: 2}
    assert sorted(report.changed_targets) == sorted({twice, changed})
    assert audit.check(audit.Epoch(ids=other.ids), expected=n).missing == [lost]


def benchmark(n: int = 10_000_000, batch: int = 4096) -> None:
    """``python tests/test_audit.py``: the 10M-id figures (memory by array bytes and peak RSS; time)."""
    import resource

    def rss_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    base = rss_mb()
    ledger = audit.Ledger(target_key="y")
    started = time.perf_counter()
    for start in range(0, n, batch):
        ids = (torch.arange(start, min(start + batch, n)) * 7919) % n
        ledger.record({"id": ids, "y": ids % 1000}, worker=(start // batch) % 4)
    epoch = ledger.end_epoch()
    print(
        f"record {n:,} ids in batches of {batch}: {time.perf_counter() - started:.2f} s; arrays "
        f"{epoch.nbytes:,} bytes (ids {epoch.ids.nbytes:,}); peak RSS growth {rss_mb() - base:.0f} MB"
    )
    other = audit.Epoch(ids=epoch.ids.copy(), digests=epoch.digests.copy(), workers=epoch.workers)
    other.ids[5] = other.ids[6]
    shuffled = np.random.default_rng(0).permutation(n)
    sparse = epoch.ids * np.int64(0x9E3779B97F4A7C1)  # spread over the int64 range, as string codes are
    cases = [
        ("check ids against range(n)", lambda: audit.check(audit.Epoch(ids=other.ids), n)),
        (
            "compare ids only, same order",
            lambda: audit.compare(audit.Epoch(ids=epoch.ids), audit.Epoch(ids=other.ids)),
        ),
        ("compare ids + targets + workers, same order", lambda: audit.compare(epoch, other)),
        (
            "compare ids + targets, shuffled",
            lambda: audit.compare(
                epoch, audit.Epoch(ids=epoch.ids[shuffled], digests=epoch.digests[shuffled]), order="shuffled"
            ),
        ),
        (
            "compare sparse ids (64-bit codes, as string ids get) + targets, shuffled",
            lambda: audit.compare(
                audit.Epoch(ids=sparse, digests=epoch.digests),
                audit.Epoch(ids=sparse[shuffled], digests=epoch.digests[shuffled]),
                order="shuffled",
            ),
        ),
    ]
    for name, run in cases:
        started = time.perf_counter()
        report = run()
        print(f"{name}: {time.perf_counter() - started:.2f} s ({', '.join(report.problems()) or 'ok'})")
    print(f"peak RSS growth overall {rss_mb() - base:.0f} MB")


if __name__ == "__main__":
    benchmark(*(int(a) for a in sys.argv[1:]))
