"""ContractError: the one exception a batch that breaks its contract raises.

It names the sample (by id, or by batch position when samples carry none), the field path, what was
expected and what arrived, and what to do. It never includes the sample's values, which may be
sensitive. Code written for ``default_collate`` keeps working: where that raised ``RuntimeError``
(sizes differ), ``TypeError`` (unsupported element) or ``KeyError`` (missing key), the ContractError
raised here is also an instance of that class.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["ERROR_KINDS", "ContractError", "kind_of", "make_error", "sample_id"]


class ContractError(Exception):
    """A sample does not fit the batch's contract.

    Attributes:
        sample_id: the sample's id, or ``None`` when samples carry none (see ``position``).
        position: the sample's position in the batch.
        field: the field path, e.g. ``"meta.boxes"`` (``"<sample>"`` for the sample itself).
        expected: what the contract or the batch's first sample requires.
        got: what this sample has.
        hint: what to do about it.
    """

    def __init__(
        self,
        message: str | None = None,
        *,
        sample_id: Any = None,
        position: int | None = None,
        field: str = "<sample>",
        expected: str = "",
        got: str = "",
        hint: str = "",
        id_key: str = "id",
    ) -> None:
        if message is not None:
            # DataLoader re-raises a worker's exception as type(exc)(text): recover the fields from it.
            self._init_from_text(message)
            return
        self.sample_id = sample_id
        self.position = position
        self.field = field
        self.expected = expected
        self.got = got
        self.hint = hint
        unnamed = (
            f"sample at batch position {position} (samples carry no {id_key!r}; "
            "wrap the dataset in fastcollate.with_ids to name them)"
        )
        super().__init__(self._message(unnamed, repr(field)))

    def _message(self, unnamed: str, field: str) -> str:
        """The text of this error's fields: ``unnamed`` names a sample without an id."""
        if self.sample_id is not None:
            who = f"sample id={self.sample_id!r}"
            if self.position is not None:
                who += f" (batch position {self.position})"
        elif self.position is None:
            who = "the batch"  # a rule of the whole batch (it is empty): no sample to name, nor ids to add
        else:
            who = unnamed
        message = f"{who}, field {field}: expected {self.expected}, got {self.got}"
        if self.hint:
            message += f". {self.hint[0].upper()}{self.hint[1:]}"
        return message

    def restated(self, caller: str, unnamed: str, column: str | None = None) -> ContractError:
        """This error (its class and fields) as ``caller``, a collate over something other than a dataset,
        says it: ``unnamed`` names the sample without an id (``"row 3 of the table"``: there is no dataset
        to wrap in with_ids), and the field is followed by the ``column`` it was read from."""
        field = repr(self.field) if column in (None, self.field) else f"{self.field!r} (column {column!r})"
        restated = type(self).__new__(type(self))
        restated.__dict__.update(self.__dict__)
        super(ContractError, restated).__init__(f"{caller}: {self._message(unnamed, field)}")
        return restated

    def _init_from_text(self, text: str) -> None:
        self.sample_id = self.position = None
        self.field = self.expected = self.got = self.hint = ""
        match = _MESSAGE.search(text)
        if match:
            if match["id"] is not None:
                try:
                    self.sample_id = ast.literal_eval(match["id"])
                except (ValueError, SyntaxError):
                    self.sample_id = match["id"]
            position = match["position"] or match["position2"]
            self.position = int(position) if position else None
            self.field = ast.literal_eval(match["field"])  # written with !r: any key survives the trip
            self.expected, self.got = match["expected"], match["got"]
        super().__init__(text)

    def __str__(self) -> str:  # KeyError would otherwise print the message quoted
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):  # picklable across DataLoader workers, whatever class it is mixed into
        fields = (self.sample_id, self.position, self.field, self.expected, self.got, self.hint)
        return (_rebuild, (type(self).__name__, *fields))


_MESSAGE = re.compile(
    r"sample (?:id=(?P<id>.+?) \(batch position (?P<position>\d+)\)|at batch position (?P<position2>\d+)"
    r"(?: \(samples carry no .*?; wrap the dataset in fastcollate\.with_ids to name them\))?)"
    r", field (?P<field>'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\")"
    r": expected (?P<expected>.*?), got (?P<got>.*?)"
    r"(?:\. [A-Z]|$)",
    re.MULTILINE,
)


class ContractSizeError(ContractError, RuntimeError):
    """Shapes, lengths or sizes differ (``default_collate`` raised RuntimeError)."""


class ContractTypeError(ContractError, TypeError):
    """A value of an unsupported or different type (``default_collate`` raised TypeError)."""


class ContractKeyError(ContractError, KeyError):
    """A field missing or extra (``default_collate`` raised KeyError or dropped it)."""


class ContractValueError(ContractError, ValueError):
    """A value outside its declared range."""


class ContractEmptyError(ContractError, IndexError):
    """An empty batch without a contract to give it a structure (``default_collate`` raised IndexError)."""


# The one table of error kinds. The native walk raises by kind name (make_error) and asks kind_of for the
# kind of a Python error torch raised; _native_support does the same for default_collate's refusals.
# Each class is also its built-in counterpart, so the kind of a built-in error is the kind whose class
# shares it; the first match wins, and RuntimeError's "size" takes whatever matches none. "value" comes
# before "key" and "empty": numpy's AxisError (a ValueError and an IndexError) is a bad value, not an
# empty batch.
ERROR_KINDS: dict[str, type[ContractError]] = {
    "type": ContractTypeError,
    "value": ContractValueError,
    "key": ContractKeyError,
    "empty": ContractEmptyError,
    "size": ContractSizeError,
}
_BUILTIN_OF = {kind: cls.__bases__[1] for kind, cls in ERROR_KINDS.items()}  # (ContractError, <built-in>)
BUILTIN_ERRORS: tuple[type[Exception], ...] = tuple(_BUILTIN_OF.values())
"""The built-in error classes the kinds stand for (``default_collate`` raises these)."""
_BY_NAME = {cls.__name__: cls for cls in ERROR_KINDS.values()} | {"ContractError": ContractError}


def kind_of(error: BaseException) -> str:
    """The kind whose ContractError class shares ``error``'s built-in class (a TypeError is ``"type"``)."""
    return next((kind for kind, builtin in _BUILTIN_OF.items() if isinstance(error, builtin)), "size")


def _rebuild(name, sample_id, position, field, expected, got, hint):
    return _BY_NAME[name](
        sample_id=sample_id, position=position, field=field, expected=expected, got=got, hint=hint
    )


def sample_id(sample: Any, id_key: str) -> Any:
    """The id a sample carries under ``id_key`` (a mapping key or an attribute), else None."""
    try:  # a sample's own code runs here: whatever it raises must not replace the error being built
        value = sample.get(id_key) if isinstance(sample, Mapping) else getattr(sample, id_key, None)
    except Exception:  # noqa: BLE001
        return None
    if hasattr(value, "item"):  # a 0-d tensor or numpy scalar: show the number
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            return None
    return value if isinstance(value, (int, str, bytes)) else None


def make_error(kind: str, batch, position: int, field: str, expected: str, got: str, hint: str, id_key: str):
    """Builds the ContractError for sample ``batch[position]``: the class for ``kind``, its id looked up."""
    return ERROR_KINDS[kind](
        sample_id=sample_id(batch[position], id_key) if batch is not None else None,
        position=position,
        field=field or "<sample>",
        expected=expected,
        got=got,
        hint=hint,
        id_key=id_key,
    )
