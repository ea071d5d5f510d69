"""fastcollate.ray.ArrowCollate under Ray Data: the collate of ``iter_torch_batches`` gives, for every
table Ray hands it, what ``assemble(Arrays.from_arrow(table)...)`` gives, and Ray Train's workers train
on its packed batches as on ``DataCollatorWithFlattening``'s. One local Ray (2 CPUs, no dashboard), shared
with the other Ray modules (conftest's local_ray)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import fastcollate
from fastcollate import Contract, Field, Packing

ray = pytest.importorskip("ray", reason="ray is not installed")  # a test dependency, like lightning
pa = pytest.importorskip("pyarrow")
from fastcollate.ray import ArrowCollate  # noqa: E402  (after the import checks)
from tests.test_assemble_dropin import assert_same  # noqa: E402

ROWS = 96


def token_rows(count: int = ROWS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 200, int(rng.integers(16, 64))).tolist() for _ in range(count)]


def packed_contract() -> Contract:
    tokens = dict(dtype=torch.int64, shape=("T",), pack=True)
    return Contract(
        {"id": Field(kind="number"), "input_ids": Field(**tokens), "labels": Field(**tokens, separator=-100)},
        packing=Packing(),
    )


def tokens_table(rows: list[list[int]]):
    tokens = pa.array(rows, type=pa.list_(pa.int64()))
    return pa.table({"id": np.arange(len(rows)), "input_ids": tokens, "labels": tokens})


def tabular_table(rows: int = ROWS, seed: int = 0):
    rng = np.random.default_rng(seed)
    columns = {f"f{i}": rng.standard_normal(rows, dtype=np.float32) for i in range(8)}
    return pa.table({"id": np.arange(rows), **columns, "label": rng.integers(0, 10, rows)})


def expression(table, contract=None):
    """What ArrowCollate must give for a table: the Arrays.from_arrow expression."""
    collate = fastcollate.assemble.using(contract) if contract is not None else fastcollate.assemble
    return collate(fastcollate.Arrays.from_arrow(table).__getitems__(list(range(table.num_rows))))


class Checked(ArrowCollate):
    """ArrowCollate, checked on the very table Ray hands it against the expression: Ray may call it from
    several threads, so what it sees is kept and judged after the iteration."""

    def __init__(self, contract=None):
        super().__init__(contract)
        self.contract = contract
        self.seen: list[tuple[int, str | None]] = []

    def __call__(self, table):
        got = super().__call__(table)
        try:
            assert_same(expression(table, self.contract), got)
            self.seen.append((table.num_rows, None))
        except AssertionError as error:
            self.seen.append((table.num_rows, str(error)))
        return got


def run_checked(dataset, collate, batch_size, **options):
    delivered = sum(
        len(batch["id"])
        for batch in dataset.iter_torch_batches(batch_size=batch_size, collate_fn=collate, **options)
    )
    assert [problem for _, problem in collate.seen if problem] == []
    assert sum(rows for rows, _ in collate.seen) == delivered
    return delivered


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_tabular_batch_through_ray_is_the_expression_s(local_ray, shuffle):
    dataset = ray.data.from_arrow(tabular_table())
    if shuffle:
        dataset = dataset.random_shuffle(seed=1)
    assert run_checked(dataset, Checked(), 32, prefetch_batches=2) == ROWS


def test_every_packed_batch_through_ray_is_the_expression_s(local_ray):
    contract = packed_contract()
    dataset = ray.data.from_arrow(tokens_table(token_rows())).map_batches(lambda t: t, batch_format="pyarrow")
    assert run_checked(dataset, Checked(contract), 16, local_shuffle_buffer_size=32) == ROWS


def _train(config):
    """Each Ray Train worker: two tiny Llamas from one initialisation, one trained on ArrowCollate's
    packed batches from its shard, one on DataCollatorWithFlattening's batch of the same rows."""
    import ray.train
    import ray.train.torch
    from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    llama = LlamaConfig(vocab_size=256, num_key_value_heads=2, max_position_embeddings=128, **shape)
    models = [LlamaForCausalLM(llama) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    models = [ray.train.torch.prepare_model(model) for model in models]
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in models]
    reference = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    losses: list[list[float]] = [[], []]
    shard = ray.train.get_dataset_shard("train")
    for batch in shard.iter_torch_batches(batch_size=8, collate_fn=ArrowCollate(packed_contract())):
        rows = [{"input_ids": config["tokens"][i]} for i in batch.pop("id").tolist()]
        for model, optimizer, inputs, kept in zip(
            models, optimizers, (batch, reference(rows)), losses, strict=True
        ):
            out = model(
                input_ids=inputs["input_ids"], labels=inputs["labels"], position_ids=inputs["position_ids"]
            )
            optimizer.zero_grad()
            out.loss.backward()
            optimizer.step()
            kept.append(out.loss.item())
    rank = ray.train.get_context().get_world_rank()
    with open(f"{config['out']}/rank{rank}.json", "w") as file:
        json.dump(losses, file)


def test_ray_train_workers_train_on_packed_batches_as_on_the_collator_s(local_ray, tmp_path):
    pytest.importorskip("transformers")
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    rows = token_rows(64)
    trainer = TorchTrainer(
        _train,
        train_loop_config={"tokens": rows, "out": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        torch_config=TorchConfig(backend="gloo"),
        datasets={"train": ray.data.from_arrow(tokens_table(rows))},
    )
    assert trainer.fit().error is None
    for rank in (0, 1):
        ours, collator = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(ours) >= 3, "a few steps on every worker"
        assert ours == pytest.approx(collator, rel=1e-6), "the same losses, step for step"


def test_rays_tensor_columns_arrive_as_rows_and_padded_tokens(local_ray):
    images = np.arange(ROWS * 6, dtype=np.float32).reshape(ROWS, 2, 3)
    batches = ray.data.from_numpy(images).iter_torch_batches(batch_size=20, collate_fn=ArrowCollate())
    assert torch.equal(torch.cat([batch["data"] for batch in batches]), torch.from_numpy(images))

    rows = token_rows(ROWS + 1)  # the last block holds one row: Ray stores it as a fixed-shape tensor

    def ragged(batch):  # rows of other lengths: Ray stores them as its ragged tensors
        tokens = np.empty(len(batch["id"]), dtype=object)
        tokens[:] = [np.array(rows[i]) for i in batch["id"]]
        return {"id": batch["id"], "input_ids": tokens}

    dataset = ray.data.range(ROWS + 1).map_batches(ragged, batch_format="numpy", batch_size=16)
    contract = Contract(
        {"id": Field(kind="number"), "input_ids": Field(dtype=torch.int64, shape=("T",), pad=0)}, id=None
    )
    seen = []
    for batch in dataset.iter_torch_batches(batch_size=24, collate_fn=ArrowCollate(contract)):
        for row, tokens, length in zip(
            batch["id"], batch["input_ids"], batch["input_ids_lengths"], strict=True
        ):
            assert tokens[:length].tolist() == rows[row] and not tokens[length:].any()
            seen.append(int(row))
    assert sorted(seen) == list(range(ROWS + 1))


@pytest.mark.parametrize("shape", [(2, 3), (0, 3)])
def test_a_tensor_column_in_several_blocks_gives_rays_default_batches(local_ray, shape):
    from ray.data.extensions import ArrowTensorArray

    images = np.arange(ROWS * int(np.prod(shape)), dtype=np.float32).reshape(ROWS, *shape)
    table = pa.table({"image": ArrowTensorArray.from_numpy(images), "label": np.arange(ROWS) % 10})
    dataset = ray.data.from_arrow(table).repartition(5).materialize()
    ours = list(dataset.iter_torch_batches(batch_size=40, collate_fn=ArrowCollate()))
    rays = list(dataset.iter_torch_batches(batch_size=40))
    assert [len(batch["label"]) for batch in ours] == [40, 40, 16]
    for got, expected in zip(ours, rays, strict=True):
        assert list(got) == list(expected)
        for key, value in expected.items():
            assert (got[key].dtype, got[key].shape) == (value.dtype, value.shape), key
            assert torch.equal(got[key], value), key
