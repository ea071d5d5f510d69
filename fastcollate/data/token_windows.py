"""TokenWindows: training windows over one flat token stream, as nanoGPT reads a corpus: an Arrays
whose two columns are strided views of the stream, gathered by index like any other."""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from .arrays import NOT_GIVEN, Arrays, renamed_index_as
from .columns import Column

__all__ = ["TokenWindows"]


class TokenWindows(Arrays):
    """Training windows over one flat token stream (a uint16 memmap, as nanoGPT stores a corpus): sample
    ``i`` is ``input_ids = tokens[i*step : i*step + length]`` and ``labels``, the same shifted by one.

    Both columns are strided views of ``tokens``, so nothing is copied until a batch is gathered; a
    contract's ``cast_from`` casts on the way (uint16 tokens to int64 ids). ``step`` defaults to
    ``length`` (windows that do not overlap). ``index_as`` as in Arrays. A memmap stream pickles as its file.
    """

    def __init__(
        self,
        tokens: Any,
        length: int,
        step: int | None = None,
        *,
        index_as: str | None = None,
        id_key: Any = NOT_GIVEN,
    ) -> None:
        index_as = renamed_index_as("TokenWindows", index_as, id_key)
        step = length if step is None else step
        if length < 1 or step < 1:
            raise ValueError(f"TokenWindows: length and step must be >= 1, got {length} and {step}")
        self.tokens = tokens if isinstance(tokens, Column) else Column("tokens", tokens)
        flat = self.tokens.rows
        if flat.dim() != 1 or (len(flat) > 1 and flat.stride(0) != 1):
            raise ValueError(
                f"TokenWindows: tokens must be one contiguous 1-D stream, got shape {tuple(flat.shape)} and "
                f"strides {flat.stride()}"
            )
        self.length, self.step = length, step
        windows = (len(flat) - length - 1) // step + 1 if len(flat) > length else 0
        if flat.is_meta:  # its file could not be mapped in this process: check_files says why, on every read
            self.index_as, self.columns, self._length = index_as, types.MappingProxyType({}), windows
            self.rows_of = None
            return
        offset = flat.storage_offset()
        super().__init__(
            input_ids=flat.as_strided((windows, length), (step, 1), offset),
            labels=flat.as_strided((windows, length), (step, 1), offset + 1),
            index_as=index_as,
        )

    def __reduce__(self) -> tuple:
        return (_token_windows, (self.tokens, self.length, self.step, self.index_as))

    def check_files(self, indices: int | np.ndarray | None = None) -> None:
        self.tokens.check_file()  # one stream, one file

    def _file_columns(self) -> list[Column]:
        return [self.tokens] if self.tokens.on_disk() else []

    def _sources_of(self, name: str) -> list[Column]:
        return self._file_columns()  # both columns are views of the stream


def _token_windows(tokens: Column, length: int, step: int, index_as: str | None) -> TokenWindows:
    return TokenWindows(tokens, length, step, index_as=index_as)
