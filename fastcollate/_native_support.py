"""The native walk's Python callback for the leaves it hands back to ``default_collate``.

The walk (csrc/collate/walk*.cpp) calls it once per field per batch at most, never per sample. Its other
callbacks are public elsewhere: ``fastcollate.collate.errors`` (make_error, kind_of) and
``fastcollate.structure.tree`` (rebuild_mapping, rebuild_sequence).
"""

from __future__ import annotations

from torch.utils.data import default_collate as _torch_default_collate

from .collate.errors import BUILTIN_ERRORS, ContractError, kind_of, make_error


def default_collate(values: list, path: str, batch, id_key: str):
    """Leaves the native walk does not take over (tensor subclasses, mixed dtypes, CUDA or sparse
    tensors, numpy scalars): exactly default_collate's result for them.

    Where default_collate refuses, the error is a ContractError of the same class (RuntimeError stays
    RuntimeError, ...) that names the field and the first sample it refuses next to sample 0.
    """
    try:
        return _torch_default_collate(values)
    except BUILTIN_ERRORS as error:
        if isinstance(error, ContractError):
            raise
        text = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        raise make_error(
            kind_of(error), batch, _first_refused(values), path or "<sample>",
            "a value default_collate takes (like sample 0)", text[:200],
            "convert the field in the dataset, or pass a collate_fn that handles it", id_key,
        ) from error


def _first_refused(values: list) -> int:
    """The first sample default_collate refuses alone or next to sample 0 (0 when it refuses sample 0)."""
    for position in range(len(values)):
        try:
            _torch_default_collate([values[0], values[position]] if position else [values[0]])
        except Exception:  # noqa: BLE001 - any refusal locates the sample
            return position
    return 0
