"""What failed where, as the doctor reports it: the stage, the sample as known before it was decoded,
and the error, without quoting the sample's content unless asked to."""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any

from ...collate.errors import ContractError
from .workers import MAIN_PROCESS

__all__ = ["Failure", "StageFailed", "error_text", "raised_at"]


@dataclasses.dataclass
class Failure:
    """A stage that failed on a sample.

    Attributes:
        stage: ``"raw access"``, ``"transform"``, ``"collate"``, ``"transfer"`` or ``"timeout"``.
        sample: which sample, as known before it was decoded (``"index 3"``, ``"id 'a7'"``,
            ``"position 12 of worker 1's stream"``).
        error: the exception's type; its message only where it cannot quote the sample (ContractError
            messages never do) or with ``--show-errors``.
        where: the innermost frame that raised (``file:line in function``).
        field: the field path, for collate failures.
        worker: the worker (``fastcollate.audit.MAIN_PROCESS`` for the main process), when known.
        sample_id: the sample's id or index, when known.
        last_steps: at a timeout, each process's last known step.
    """

    stage: str
    sample: str
    error: str
    where: str = ""
    field: str | None = None
    worker: int | None = None
    sample_id: Any = None
    last_steps: list[str] = dataclasses.field(default_factory=list)

    def lines(self) -> list[str]:
        if self.stage == "timeout":
            out = [f"stuck at {self.sample}"]
        else:
            out = [
                f"{self.stage} failed at {self.sample}" + (f", field {self.field!r}" if self.field else "")
            ]
        if self.worker is not None:
            out[0] += (
                " in the main process" if self.worker == MAIN_PROCESS else f" in worker {self.worker}"
            )
        out.append(f"error: {self.error}")
        if self.where:
            out.append(f"raised at {self.where}")
        out += [f"last step known: {step}" for step in self.last_steps]
        return out

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["sample_id"] = (
            self.sample_id if isinstance(self.sample_id, (int, str, type(None))) else repr(self.sample_id)
        )
        return data


def error_text(error: BaseException, show: bool) -> str:
    """The exception's type, and its message only where it cannot quote the sample (ContractError
    messages never do) or when ``show`` (``--show-errors``)."""
    if isinstance(error, ContractError) or show:
        return f"{type(error).__name__}: {error}"
    return f"{type(error).__name__} (message withheld: it may quote the sample; --show-errors prints it)"


def raised_at(error: BaseException) -> str:
    """The innermost frame that raised ``error``, as ``file:line in function``."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


class StageFailed(Exception):
    """Carries a traced ``Failure`` out of a setting's loop, to the step that reports it."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.stage)
        self.failure = failure
