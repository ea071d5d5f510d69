"""transformers.Trainer end to end on the CPU: a tiny Llama trained on Arrays.from_hf with assemble as
its data collator takes the same steps, loss for loss, as on the raw dataset with Hugging Face's
DataCollatorWithFlattening; and evaluating as it trains, one collator for both loaders, with persistent
workers writing into shared slots."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from fastcollate import Arrays, Contract, Field, Packing, assemble  # noqa: E402

PACKED = Contract(
    {
        "input_ids": Field(dtype=torch.int64, shape=("T",), pack=True, cast_from=(torch.int32,)),
        "labels": Field(dtype=torch.int64, shape=("T",), pack=True, separator=-100, cast_from=(torch.int32,)),
    },
    id=None,
    packing=Packing(),
)


def _history(train_dataset, collator, output_dir, eval_dataset=None, **arguments) -> list[dict]:
    """The Trainer's log: a ``loss`` entry per step, and an ``eval_loss`` one per evaluation."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    args = transformers.TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        max_steps=4,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        save_strategy="no",
        disable_tqdm=True,
        **arguments,
    )
    trainer = transformers.Trainer(
        model=transformers.LlamaForCausalLM(config),
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=collator,
    )
    trainer.train()
    return trainer.state.log_history


def _losses(train_dataset, collator, output_dir, **arguments) -> list[float]:
    history = _history(train_dataset, collator, output_dir, **arguments)
    return [entry["loss"] for entry in history if "loss" in entry]


def _saved_rows(path, count: int, seed: int):
    rng = np.random.default_rng(seed)
    rows = {"input_ids": [rng.integers(1, 500, rng.integers(4, 40)).tolist() for _ in range(count)]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(path))
    return datasets.load_from_disk(str(path))


def _packed(dataset) -> Arrays:
    return Arrays.from_hf(dataset, {"input_ids": "input_ids", "labels": "input_ids"})


def test_trainer_takes_hugging_face_s_steps_on_arrays_from_hf(tmp_path):
    dataset = _saved_rows(tmp_path / "data", 64, seed=0)
    theirs = _losses(
        dataset, transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True), tmp_path / "theirs"
    )
    ours = _losses(
        _packed(dataset),
        assemble.using(PACKED),
        tmp_path / "ours",
        remove_unused_columns=False,  # the Trainer's per-sample column filter: every key here is the model's
    )
    assert len(theirs) == 4
    assert ours == theirs


def test_trainer_evaluating_every_two_steps_on_persistent_workers_never_falls_back(tmp_path):
    # The train workers' prefetched batches wait in slots while the eval loader runs: with one bound for
    # both loaders the eval workers found it reached and fell back, with a RuntimeWarning.
    train = _saved_rows(tmp_path / "train", 64, seed=0)
    evaluation = _saved_rows(tmp_path / "eval", 48, seed=1)
    every_two_steps = dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8)
    theirs = _history(
        train, transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True), tmp_path / "theirs",
        eval_dataset=evaluation, **every_two_steps,
    )
    collator = assemble.using(PACKED)
    with warnings.catch_warnings():
        # Forked workers inherit the filter: a batch that fell back would raise through the Trainer.
        warnings.filterwarnings("error", message="fastcollate", category=RuntimeWarning)
        ours = _history(
            _packed(train), collator, tmp_path / "ours", eval_dataset=_packed(evaluation),
            remove_unused_columns=False, dataloader_num_workers=2, dataloader_persistent_workers=True,
            **every_two_steps,
        )
    evaluated = [entry["eval_loss"] for entry in ours if "eval_loss" in entry]
    assert len(evaluated) == 2
    assert evaluated == [entry["eval_loss"] for entry in theirs if "eval_loss" in entry]
    assert [entry["loss"] for entry in ours if "loss" in entry] == [e["loss"] for e in theirs if "loss" in e]
    stats = collator.shared_slot_stats()
    assert stats.fresh_fallbacks == 0 and stats.claims >= 4 + 2 * 6  # the train steps and each evaluation's
