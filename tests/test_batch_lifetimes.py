"""Batch lifetimes: keeping a batch's small fields (ids and labels, kept for metrics)
keeps only their own bytes, not the batch's images, on the ring path (workers=0) and over the shared
slots (workers=2); the large fields are still views of one buffer, and small batches stay whole."""

from __future__ import annotations

import io

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from fastcollate import assemble
from fastcollate._ext import _C
from fastcollate.transfer.small_fields import LARGE_BATCH_BYTES, SMALL_FIELD_BYTES, needs_own_storage
from tests.test_assemble_dropin import assert_same
from tests.test_shared_slots import RECEIVED, settled_stats


class Images(Dataset):
    """``n`` samples of a 3x64x64 uint8 image (12 KiB), an int label and an id: batches of 64 are 768 KiB
    of images, 1 KiB of labels and 512 B of ids."""

    def __init__(self, n: int = 512) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        return {"id": index, "image": torch.full((3, 64, 64), index % 251, dtype=torch.uint8),
                "label": index % 10, "weight": torch.tensor([index / 7], dtype=torch.float64)}


def storage_bytes(tensors) -> int:
    """The bytes of the distinct storages behind ``tensors``: what keeping them keeps alive."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("workers", [0, 2])
def test_keeping_every_batchs_ids_and_labels_keeps_only_their_own_bytes(workers):
    collate = assemble.using()
    loader = DataLoader(Images(), batch_size=128, num_workers=workers, collate_fn=collate)  # 1.5 MiB batches
    kept = []
    for batch in loader:
        assert batch["image"].nbytes + batch["label"].nbytes >= LARGE_BATCH_BYTES
        if workers:
            assert _C.shared_slot_kind(batch["image"]) == RECEIVED
        kept += [batch["id"], batch["label"], batch["weight"]]
    del batch
    own = sum(t.nbytes for t in kept)
    assert storage_bytes(kept) == own  # 4 batches x (1 KiB ids + 1 KiB labels + 1 KiB weights)
    buffer = io.BytesIO()
    torch.save(kept[1], buffer)
    assert buffer.tell() < 4 * kept[1].nbytes  # its own bytes, not the batch's 1.5 MiB
    if workers:
        stats = settled_stats(collate)
        assert stats.lent == 0  # no slot is held by the kept fields


def test_a_kept_small_field_is_the_same_as_default_collates():
    reference = default_collate([Images()[i] for i in range(128)])
    for workers in (0, 2):
        batch = next(iter(DataLoader(Images(), batch_size=128, num_workers=workers, collate_fn=assemble)))
        assert_same(batch, reference)
        label = batch["label"]
        assert label.untyped_storage().nbytes() == label.nbytes
        label.add_(1)  # its own storage is writable, as default_collate's is
        assert torch.equal(label, reference["label"] + 1)


def test_the_large_fields_of_a_batch_share_its_buffer_and_small_batches_stay_whole():
    samples = [Images()[i] for i in range(128)]
    big = assemble(samples)
    assert big["image"].untyped_storage().nbytes() >= big["image"].nbytes
    assert big["label"].untyped_storage().data_ptr() != big["image"].untyped_storage().data_ptr()
    small = assemble(samples[:8])  # 96 KiB: under LARGE_BATCH_BYTES, one buffer
    assert small["label"].untyped_storage().data_ptr() == small["image"].untyped_storage().data_ptr()


def test_the_rule():
    assert needs_own_storage(SMALL_FIELD_BYTES, LARGE_BATCH_BYTES)
    assert not needs_own_storage(SMALL_FIELD_BYTES + 1, LARGE_BATCH_BYTES)  # a large field stays a view
    assert not needs_own_storage(8, LARGE_BATCH_BYTES - 1)  # a small batch stays whole
