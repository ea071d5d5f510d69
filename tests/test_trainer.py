"""transformers.Trainer end to end on the CPU: a tiny Llama trained on Arrays.from_hf with assemble as
its data collator takes the same steps, loss for loss, as on the raw dataset with Hugging Face's
DataCollatorWithFlattening."""

from __future__ import annotations

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


def _losses(train_dataset, collator, output_dir, **arguments) -> list[float]:
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
        data_collator=collator,
    )
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_takes_hugging_face_s_steps_on_arrays_from_hf(tmp_path):
    rng = np.random.default_rng(0)
    rows = {"input_ids": [rng.integers(1, 500, rng.integers(4, 40)).tolist() for _ in range(64)]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "data"))
    dataset = datasets.load_from_disk(str(tmp_path / "data"))
    theirs = _losses(
        dataset, transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True), tmp_path / "theirs"
    )
    ours = _losses(
        Arrays.from_hf(dataset, {"input_ids": "input_ids", "labels": "input_ids"}),
        assemble.using(PACKED),
        tmp_path / "ours",
        remove_unused_columns=False,  # the Trainer's per-sample column filter: every key here is the model's
    )
    assert len(theirs) == 4
    assert ours == theirs
