"""How a Hugging Face dataset hands out its rows, as far as ``Arrays.from_hf`` follows it: its format's
dtypes are followed, and what Arrays cannot give (a transform, a format that hands out no tensors,
encoded media) is refused, naming it and saying what to do, rather than read as the stored columns.

Hugging Face's formats (``datasets/formatting``): ``None`` (Python objects) hands out Python numbers,
which its collators make int64 and float32 tensors, as the torch format does; ``"numpy"`` widens lists
and arrays to int64 or float32 and keeps scalars as stored; ``"torch"`` widens every integer to int64
and every float to float32; either takes a ``dtype=`` that applies to every column it formats
(``dtype=None`` hands out the stored dtypes, the torch format's uint16 and uint32 as int64). Columns
outside ``with_format(columns=...)`` are Python objects, as with no format.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["dtypes_handed_out", "refuse_encoded_media", "refuse_what_arrays_cannot_hand_out"]

_AS_STORED = (None, "python")
_FOLLOWED = ("numpy", "torch")
_WHAT_TO_DO = (
    "apply it with Dataset.map first (its output is stored in the dataset's files, where Arrays reads "
    "it), or keep it and collate Hugging Face's rows with fastcollate.assemble "
    "(DataLoader(dataset, collate_fn=assemble))"
)


def refuse_what_arrays_cannot_hand_out(dataset: Any) -> list[str] | None:
    """Refuses a dataset with a transform or a format Arrays cannot follow; returns the format's columns
    (None: every column)."""
    form = dataset.format
    kind, options = form.get("type"), dict(form.get("format_kwargs") or {})
    transform = options.pop("transform", None)
    if transform is not None or kind == "custom":
        name = getattr(transform, "__qualname__", None) or repr(transform)
        raise TypeError(
            f"Arrays.from_hf: the dataset has a transform ({name}, from set_transform, with_transform or "
            "set_format(transform=...)), which Hugging Face applies to each row as it is read, while Arrays "
            f"reads the stored columns: {_WHAT_TO_DO}"
        )
    if kind not in _AS_STORED + _FOLLOWED:
        raise TypeError(
            f"Arrays.from_hf: the dataset's format is {kind!r}, whose rows are not tensors: Arrays hands out "
            "torch tensors. Pass dataset.with_format(None), 'numpy' or 'torch'"
        )
    unknown = sorted(set(options) - {"dtype"})
    if unknown:
        raise TypeError(
            f"Arrays.from_hf: the dataset's {kind!r} format has options {unknown} that Arrays does not "
            "follow (it hands out CPU tensors, and follows dtype= alone): set the format without them, and "
            "move batches with fastcollate.DeviceLoader"
        )
    return form.get("columns")


def refuse_encoded_media(features: Any, chosen: dict[str, str]) -> None:
    """Refuses a chosen column that holds encoded media (an Image or Audio feature, or a list of them):
    its rows are file bytes or paths that Hugging Face decodes when a row is read."""
    for key, name in chosen.items():
        media = _media(features.get(name))
        if media is not None:
            raise TypeError(
                f"Arrays.from_hf: column {name!r} (for key {key!r}) holds encoded media ({media}): each "
                "row is a file's bytes or path, which Hugging Face decodes as a row is read. Decode it into "
                "arrays with "
                "Dataset.map (e.g. {'pixels': np.asarray(row['image'])}, stored as an Array3D feature), or "
                "leave it out (columns=[...]) and collate decoded rows with fastcollate.assemble"
            )


def _media(feature: Any) -> str | None:
    """The name of the encoded-media feature in ``feature`` (at any depth), or None."""
    if feature is None:
        return None
    if hasattr(feature, "decode_example") and hasattr(feature, "decode"):
        return type(feature).__name__  # Image, Audio, Video, Pdf, Nifti: decoded on read
    if isinstance(feature, dict):
        return next((m for m in map(_media, feature.values()) if m), None)
    if isinstance(feature, (list, tuple)):
        return next((m for m in map(_media, feature) if m), None)
    return _media(getattr(feature, "feature", None))  # List, LargeList, Sequence


def dtypes_handed_out(
    dataset: Any, chosen: dict[str, str], arrays: Any, stored_dtypes: bool = False
) -> dict[str, torch.dtype]:
    """{key: dtype} for the chosen keys whose rows go out in another dtype than the stored one: the
    format's, or for a column no format covers the dtypes Hugging Face's collators make of its rows
    (Python numbers: integers as int64, floats as float32, as the torch format's); none with
    ``stored_dtypes``."""
    if stored_dtypes:
        return {}
    form = dataset.format
    kind = form.get("type")
    formatted = set() if kind in _AS_STORED else set(form.get("columns") or dataset.column_names)
    options = form.get("format_kwargs") or {}
    forced = _forced(kind, options.get("dtype")) if formatted else None
    if "dtype" not in options:
        widen = _widened
    elif kind == "torch":  # dtype=None given replaces Hugging Face's default dtypes: the stored ones go out
        widen = _kept
    else:
        widen = _as_stored
    out = {}
    for key, name in chosen.items():
        column = arrays.columns[key]
        stored = column.first.dtype
        is_array = column.ragged or column.first.dim() > 1
        if name not in formatted:
            held = _widened(stored)  # Python objects, as with no format (or outside with_format(columns=))
        elif kind == "numpy" and not is_array:
            continue  # numpy scalars are handed out as they are stored
        else:
            held = forced or widen(stored)
        if held != stored:
            out[key] = held
    return out


def _forced(kind: str, dtype: Any) -> torch.dtype | None:
    """The torch dtype of a format's ``dtype=`` (None: not given), refused where Hugging Face's rows would
    be no tensors, or fail (its torch format takes a torch.dtype alone)."""
    if dtype is None:
        return None
    if kind == "torch":
        if isinstance(dtype, torch.dtype):
            return dtype
        why = "which is no torch.dtype (torch.tensor(..., dtype=) takes torch.float16, not numpy's or a str)"
    else:
        try:
            # A byte order is not a tensor's: '>i4' rows hold int32 values
            return torch.from_numpy(np.empty(0, dtype=np.dtype(dtype).newbyteorder("="))).dtype
        except TypeError as error:
            why = f"which has no tensor dtype ({error})"
    raise TypeError(
        f"Arrays.from_hf: the dataset's {kind!r} format has dtype={dtype!r}, {why}: set the format with the "
        "dtype of a number (e.g. dataset.with_format('torch', dtype=torch.float32)), or without dtype="
    )


def _kept(dtype: torch.dtype) -> torch.dtype:
    """What the torch format hands out with dtype=None: the stored dtype, but uint16 and uint32 widened to
    int64 before they become tensors."""
    return torch.int64 if dtype in (torch.uint16, torch.uint32) else dtype


def _as_stored(dtype: torch.dtype) -> torch.dtype:
    return dtype


def _widened(dtype: torch.dtype) -> torch.dtype:
    """The dtype Hugging Face's numpy (arrays) and torch formats give a stored dtype, as torch.tensor gives
    Python's numbers (Arrays refuses Arrow's booleans)."""
    if dtype.is_floating_point:
        return torch.float32
    return torch.int64
