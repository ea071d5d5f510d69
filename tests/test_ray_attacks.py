"""fastcollate.ray.ArrowCollate attacked as a hostile Ray user would: shuffles and map_batches before it,
prefetch threads, drop_last, empty blocks, a one-row last batch, Ray's own pinning, writes to the object
store, and bad input that must be refused naming its column with nothing half-built delivered. Every
batch is checked against the expression on the very table Ray hands the collate, and every batch kept
against the source rows it names. One local Ray (2 CPUs, no dashboard), shared with the other Ray modules
(conftest's local_ray)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from fastcollate import Contract, Field

ray = pytest.importorskip("ray", reason="ray is not installed")  # a test dependency, like lightning
pa = pytest.importorskip("pyarrow")
from ray.data.collate_fn import is_tensor_batch_type  # noqa: E402  (after the import checks)

from fastcollate.ray import ArrowCollate  # noqa: E402
from tests.conftest import CUDA  # noqa: E402
from tests.test_assemble_dropin import assert_same  # noqa: E402
from tests.test_ray import (  # noqa: E402
    Checked,
    expression,
    packed_contract,
    run_checked,
    tabular_table,
    token_rows,
    tokens_table,
)

ROWS = 97  # 3 batches of 32 and a last one of a single row


class CheckedOnThreads(Checked):
    """Checked, also keeping which threads called it. Each call lingers a little so that Ray's other
    prefetch threads take the next tables meanwhile: the collate runs on several threads at once."""

    def __init__(self, contract=None):
        super().__init__(contract)
        self.threads: set[int] = set()

    def __call__(self, table):
        self.threads.add(threading.get_ident())
        time.sleep(0.005)
        return super().__call__(table)


def blocks(table, sizes):
    """``table`` as a Ray dataset of blocks of these row counts."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    assert starts[-1] == table.num_rows
    return ray.data.from_arrow(
        [table.slice(int(a), int(b - a)) for a, b in zip(starts[:-1], starts[1:], strict=True)]
    )


def assert_kept_batches_are_their_rows(batches, source, contract=None):
    """Each batch, read after the iteration, equals the expression on the source rows its ids name, and
    the batches together hold every source row once."""
    ids = []
    for batch in batches:
        rows = batch["id"]
        assert_same(batch, expression(source.take(pa.array(rows.numpy())), contract))
        ids.extend(rows.tolist())
    assert sorted(ids) == list(range(source.num_rows)), "every row once"


def delivered_until_refused(dataset, collate, **options):
    """The batches delivered before the iteration raised, and what it raised."""
    delivered = []
    with pytest.raises(Exception) as refused:  # noqa: PT011 - each caller matches the type and column
        for batch in dataset.iter_torch_batches(collate_fn=collate, **options):
            delivered.append(batch)
    return delivered, refused.value


def tabular_contract(*extra: str) -> Contract:
    names = [f"f{i}" for i in range(8)] + list(extra)
    fields = {"id": Field(kind="number"), **{name: Field() for name in names}, "label": Field(kind="number")}
    return Contract(fields)


# --- Ray's reshaping before the collate ----------------------------------------------------------------


def test_batches_after_random_shuffle_and_map_batches_are_the_expression_of_each_table(local_ray):
    source = tabular_table(ROWS)

    def scaled(table):
        return table.set_column(1, "f0", pa.compute.multiply(table["f0"], pa.scalar(2.0, pa.float32())))

    dataset = blocks(source, [40, 30, 27]).random_shuffle(seed=7)
    dataset = dataset.map_batches(scaled, batch_format="pyarrow", batch_size=25)
    collate = Checked()
    kept = list(dataset.iter_torch_batches(batch_size=16, collate_fn=collate, prefetch_batches=2))
    assert [problem for _, problem in collate.seen if problem] == []
    assert_kept_batches_are_their_rows(kept, scaled(source))


def test_a_local_shuffle_buffer_gives_packed_batches_of_every_row_once(local_ray):
    rows = token_rows(ROWS, seed=5)
    source = tokens_table(rows)
    collate = Checked(packed_contract())
    kept = list(
        blocks(source, [50, 47]).iter_torch_batches(
            batch_size=16,
            collate_fn=collate,
            local_shuffle_buffer_size=40,
            local_shuffle_seed=3,
        )
    )
    assert [problem for _, problem in collate.seen if problem] == []
    ids = torch.cat([batch["id"] for batch in kept]).tolist()
    assert ids != sorted(ids), "the buffer shuffled the rows"
    assert_kept_batches_are_their_rows(kept, source, packed_contract())


@pytest.mark.parametrize("prefetch", [3, 4])
def test_prefetch_threads_share_one_collate_and_every_batch_kept_stays_its_rows(local_ray, prefetch):
    source = tabular_table(ROWS, seed=prefetch)
    collate = CheckedOnThreads()
    kept = list(
        blocks(source, [20, 20, 20, 20, 17]).iter_torch_batches(
            batch_size=8,
            collate_fn=collate,
            prefetch_batches=prefetch,
        )
    )
    assert len(collate.threads) > 1, "Ray called the collate from one thread: the attack did not run"
    assert [problem for _, problem in collate.seen if problem] == []
    assert_kept_batches_are_their_rows(kept, source)


def test_drop_last_leaves_out_the_short_batch_and_nothing_else(local_ray):
    source = tabular_table(ROWS)
    collate = Checked()
    dataset = ray.data.from_arrow(source)
    kept = list(dataset.iter_torch_batches(batch_size=32, collate_fn=collate, drop_last=True))
    assert [len(batch["id"]) for batch in kept] == [32, 32, 32]
    assert [problem for _, problem in collate.seen if problem] == []
    assert torch.cat([batch["id"] for batch in kept]).tolist() == list(range(96))


def test_empty_blocks_from_a_union_and_a_filter_hand_the_collate_no_empty_table(local_ray):
    source = tabular_table(ROWS)
    empty = ray.data.from_arrow(source.slice(0, 0))
    unioned = blocks(source, [40, 57]).union(empty)
    filtered = blocks(source, [40, 57]).filter(lambda row: row["id"] >= 40)  # empties the first block
    for dataset, rows in ((unioned, ROWS), (filtered, ROWS - 40)):
        collate = Checked(tabular_contract())
        assert run_checked(dataset, collate, 32) == rows
        assert all(count > 0 for count, _ in collate.seen)


def test_an_empty_dataset_gives_no_batch_and_no_error(local_ray):
    collate = Checked()
    dataset = ray.data.from_arrow(tabular_table(4).slice(0, 0))
    assert list(dataset.iter_torch_batches(collate_fn=collate)) == []
    assert collate.seen == []


def test_a_last_batch_of_one_row_is_the_expression_s_tabular_and_packed(local_ray):
    tabular = Checked()
    kept = list(blocks(tabular_table(ROWS), [60, 37]).iter_torch_batches(batch_size=32, collate_fn=tabular))
    assert [len(batch["id"]) for batch in kept][-1] == 1
    assert [problem for _, problem in tabular.seen if problem] == []

    rows = token_rows(ROWS, seed=2)
    packed = Checked(packed_contract())
    kept = list(ray.data.from_arrow(tokens_table(rows)).iter_torch_batches(batch_size=32, collate_fn=packed))
    last = kept[-1]
    assert last["id"].tolist() == [ROWS - 1]
    assert last["cu_seq_lens_q"].tolist() == [0, len(rows[-1])]
    assert last["input_ids"][0].tolist() == rows[-1]
    assert [problem for _, problem in packed.seen if problem] == []


# --- pinning and the device move -----------------------------------------------------------------------


def test_rays_own_pinning_pins_a_tabular_batch_or_says_there_is_no_gpu(local_ray):
    dataset = ray.data.from_arrow(tabular_table(64))
    batches = dataset.iter_torch_batches(batch_size=32, collate_fn=Checked(), pin_memory=True)
    if CUDA:
        assert all(tensor.is_pinned() for batch in batches for tensor in batch.values())
    else:
        with pytest.raises(RuntimeError, match="NVIDIA driver|GPU|CUDA"):
            list(batches)


def test_a_packed_batch_holds_python_ints_so_rays_move_and_pinning_skip_it(local_ray):
    # Ray's finalize (the device move) and its pin_memory act only on batches is_tensor_batch_type accepts:
    # a packed batch's max_length_q/k are ints, as flash attention takes them. ArrowCollate's device moves
    # it instead (below, on a GPU).
    dataset = ray.data.from_arrow(tokens_table(token_rows(40)))
    for batch in dataset.iter_torch_batches(batch_size=16, collate_fn=ArrowCollate(packed_contract())):
        assert not is_tensor_batch_type(batch)
        assert type(batch["max_length_q"]) is int


@pytest.mark.needs_cuda
@pytest.mark.parametrize("pin_memory", [False, True], ids=["ray_pins_nothing", "ray_pins_too"])
def test_a_packed_batch_moved_by_the_collate_reaches_the_training_loop_on_the_device(local_ray, pin_memory):
    device = torch.device("cuda", torch.cuda.current_device())
    rows = token_rows(40)
    dataset = ray.data.from_arrow(tokens_table(rows))
    collate = ArrowCollate(packed_contract(), device=device)
    batches = list(dataset.iter_torch_batches(batch_size=16, collate_fn=collate, pin_memory=pin_memory))
    assert sum(batch["cu_seq_lens_q"].numel() - 1 for batch in batches) == len(rows)
    for batch in batches:
        assert all(value.device == device for value in batch.values() if torch.is_tensor(value))
        assert type(batch["max_length_q"]) is int


# --- Ray's object store written meanwhile ---------------------------------------------------------------


@pytest.mark.parametrize("gathered", [True, False], ids=["gathered", "the_long_way"])
def test_writes_to_the_object_store_during_streaming_map_batches_refuse_no_batch(local_ray, gathered):
    source = tabular_table(400)
    if gathered:
        contract, columns = tabular_contract(), None
    else:  # a float-to-int cast goes the long way, through Arrays.from_arrow on Ray's table
        source = source.set_column(1, "f0", pa.array(np.arange(400, dtype=np.float32)))
        cast = Field(dtype=torch.int64, cast_from=(torch.float32,))
        contract = Contract({"id": Field(kind="number"), "f0": cast})
        columns = ["id", "f0"]
    collate = ArrowCollate(contract, columns)
    dataset = ray.data.from_arrow(source)
    dataset = dataset.map_batches(lambda table: table, batch_format="pyarrow", batch_size=50)
    stop = threading.Event()

    def write():
        held = []
        while not stop.is_set():
            held = [*held[-8:], ray.put(np.ones(100_000))]
            time.sleep(0.001)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        kept = list(dataset.iter_torch_batches(batch_size=32, collate_fn=collate, prefetch_batches=2))
    finally:
        stop.set()
        writer.join()
    read = source.select(columns) if columns else source
    for batch in kept:
        assert_same(batch, expression(read.take(pa.array(batch["id"].numpy())), contract))
    assert sum(len(batch["id"]) for batch in kept) == 400


# --- bad input through Ray: refused naming the column, nothing half-built delivered -----------------------


def test_a_string_column_is_refused_through_ray_before_any_batch(local_ray):
    table = pa.table({"id": np.arange(8), "text": pa.array(list("abcdefgh"))})
    delivered, error = delivered_until_refused(ray.data.from_arrow(table), ArrowCollate(), batch_size=4)
    assert delivered == []
    assert isinstance(error, TypeError) and "column 'text'" in str(error)


def test_a_null_in_a_later_block_is_refused_naming_the_column_after_whole_batches(local_ray):
    source = tabular_table(64)
    values = [*source["f1"].to_pylist()[:40], None, *[0.5] * 23]
    nulled = source.set_column(2, "f1", pa.array(values, pa.float32()))
    delivered, error = delivered_until_refused(blocks(nulled, [32, 32]), ArrowCollate(), batch_size=16)
    assert isinstance(error, ValueError) and "column 'f1' has a missing value (null)" in str(error)
    assert len(delivered) < 4
    assert all(batch["id"].max() < 40 for batch in delivered), "no batch with the null row was delivered"
    for batch in delivered:
        assert_same(batch, expression(source.take(pa.array(batch["id"].numpy()))))


def test_lists_deeper_than_the_contract_declares_are_refused_naming_the_column(local_ray):
    nested = pa.array([[[1], [2, 3]], [[4]], [[5, 6]], [[7]]], pa.list_(pa.list_(pa.int32())))
    table = pa.table({"id": np.arange(4), "ids": nested})
    contract = Contract({"id": Field(kind="number"), "ids": Field(shape=("T",), pad=0)})
    dataset = ray.data.from_arrow(table)
    delivered, error = delivered_until_refused(dataset, ArrowCollate(contract), batch_size=2)
    assert delivered == []
    assert isinstance(error, TypeError)
    assert "column 'ids'" in str(error) and "lists within lists" in str(error)


def test_a_column_the_contract_names_but_the_table_lacks_is_named(local_ray):
    dataset = ray.data.from_arrow(tabular_table(32))
    delivered, error = delivered_until_refused(dataset, ArrowCollate(tabular_contract("mask")), batch_size=16)
    assert delivered == []
    assert isinstance(error, KeyError) and "field 'mask': expected a value" in str(error)


def test_a_dtype_changed_between_blocks_by_map_batches_is_refused_naming_the_column(local_ray):
    source = tabular_table(64)

    def widened_from_row_32(table):
        if table["id"][0].as_py() < 32:
            return table
        return table.set_column(1, "f0", table["f0"].cast(pa.float64()))

    dataset = blocks(source, [32, 32])
    dataset = dataset.map_batches(widened_from_row_32, batch_format="pyarrow", batch_size=None)
    delivered, error = delivered_until_refused(dataset, ArrowCollate(), batch_size=16)
    assert isinstance(error, TypeError)
    assert "column 'f0' was float" in str(error) and "is double" in str(error)
    assert len(delivered) < 4
    for batch in delivered:
        assert batch["f0"].dtype == torch.float32
        assert_same(batch, expression(source.take(pa.array(batch["id"].numpy()))))
