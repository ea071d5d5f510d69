"""One contract rule broken in one row of one column of an Arrays dataset: the same batch gathered by
column (``assemble(arrays.__getitems__(idx))``) and walked (``assemble([arrays[i] for i in idx])``) must
then give the same batch, or fail with the same error type and text."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from hypothesis import strategies as st

from fastcollate import Arrays, Contract, Field, Ragged, assemble

from .batches import assert_same_batch
from .chunks import chunked, cuts

DTYPES = [torch.int64, torch.int32, torch.float32]
RULES = ["dtype", "shape", "range", "pad", "number kind", "missing key", "extra key", "id", "index"]
PACKED_RULES = ["dtype", "shape", "range", "separator", "missing key", "extra key", "id", "index"]


@dataclasses.dataclass
class Broken:
    dataset: Arrays
    contract: Contract
    indices: list[int]
    rule: str
    must_fail: bool


def _other(dtype: torch.dtype) -> torch.dtype:
    return DTYPES[(DTYPES.index(dtype) + 1) % len(DTYPES)]


def _bad_fill(dtype: torch.dtype) -> float:
    """A pad or separator the dtype cannot hold."""
    return 1e39 if dtype.is_floating_point else 2.5


@st.composite
def broken_columns(draw, packed: bool = False) -> Broken:
    """Columns of rows, numbers and ragged rows (padded, or packed), one rule broken in one of them."""
    rows = draw(st.integers(2, 10))
    kinds = ["packed"] * draw(st.integers(1, 2)) if packed else draw(
        st.lists(st.sampled_from(["rows", "number", "ragged"]), min_size=1, max_size=3)
    )
    lengths = draw(st.lists(st.integers(0, 4), min_size=rows, max_size=rows))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    indices = draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=8))
    rule = draw(st.sampled_from(PACKED_RULES if packed else RULES))
    target = f"c{draw(st.integers(0, len(kinds) - 1))}"
    position = draw(st.integers(0, len(indices) - 1))
    row = indices[position]
    columns: dict = {}
    fields = {"id": Field(kind="number")}
    for k, kind in enumerate(kinds):
        dtype = draw(st.sampled_from(DTYPES))
        key = f"c{k}"
        if kind == "rows":
            values = torch.randint(0, 10, (rows, 3)).to(dtype)
            fields[key] = Field(dtype=dtype, shape=(3,), range=(0, 10))
        elif kind == "number":
            values = torch.randint(0, 10, (rows,)).to(dtype)
            fields[key] = Field(kind="number", dtype=dtype, range=(0, 10))
        else:
            values = torch.randint(0, 10, (int(offsets[-1]),)).to(dtype)
            fill = {"pack": True} if packed else {"pad": 0}
            fields[key] = Field(dtype=dtype, shape=("T",), range=(0, 10), **fill)
        if key == target and rule in ("range", "id"):
            outside = [-1, 10, float("nan")] if dtype.is_floating_point else [-1, 10]
            low_or_high = draw(st.sampled_from(outside))
            if kind == "rows":
                values[row, draw(st.integers(0, 2))] = low_or_high
            elif kind == "number":
                values[row] = low_or_high
            elif lengths[row]:
                values[int(offsets[row]) + draw(st.integers(0, lengths[row] - 1))] = low_or_high
        column = values if kind in ("rows", "number") else Ragged(values, offsets)
        columns[key] = chunked(column, draw(cuts(rows)))
    field, kind = fields[target], kinds[int(target[1:])]
    must_fail = True
    id_key = "id"
    if rule == "dtype":
        fields[target] = dataclasses.replace(field, dtype=_other(field.dtype))
    elif rule == "shape":
        shape = {"rows": (4,), "number": (2,), "ragged": ("T", 1), "packed": ("T", 1)}[kind]
        fields[target] = Field(dtype=field.dtype, shape=shape, pack=packed)
    elif rule == "range" or rule == "id":
        must_fail = kind in ("rows", "number") or lengths[row] > 0
        if rule == "id":  # the dataset names its ids apart from the collate's id key
            id_key = "idx"
            fields["idx"] = fields.pop("id")
    elif rule == "pad":
        shape = ("T",) if kind in ("ragged", "packed") else ("T", 3) if kind == "rows" else ("T",)
        fields[target] = Field(shape=shape, pad=_bad_fill(field.dtype or torch.int64))
    elif rule == "separator":
        fields[target] = Field(shape=("T",), pack=True, separator=_bad_fill(field.dtype))
    elif rule == "number kind":
        declared = field.dtype if kind != "number" else _other(field.dtype)
        fields[target] = Field(kind="number", dtype=declared)
    elif rule == "missing key":
        del fields[target]
    elif rule == "extra key":
        fields["extra"] = Field(kind="number")
    elif rule == "index":
        indices[position] = draw(st.sampled_from([rows, -rows - 1]))
    return Broken(Arrays(columns, id_key=id_key), Contract(fields), indices, rule, must_fail)


def _outcome(make_batch, contract):
    try:
        return assemble.using(contract)(make_batch())
    except Exception as error:  # noqa: BLE001 (the failure itself is compared)
        return error


def assert_same_outcome(case: Broken) -> None:
    """The batch gathered and walked: equal, or the same error type and text."""
    dataset, indices = case.dataset, case.indices
    gathered = _outcome(lambda: dataset.__getitems__(indices), case.contract)
    walked = _outcome(lambda: [dataset[i] for i in indices], case.contract)
    if isinstance(gathered, Exception) or isinstance(walked, Exception):
        assert (type(gathered), str(gathered)) == (type(walked), str(walked)), case.rule
    else:
        assert_same_batch(gathered, walked)
    assert not case.must_fail or isinstance(walked, Exception), f"{case.rule}: nothing refused"
