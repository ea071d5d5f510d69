"""A batch's structure, below both the collate and the transfer: ``tree`` (what is a container, how one is
rebuilt, how a leaf is named) and ``jagged`` (packed fields as ``torch.nested`` jagged tensors)."""
