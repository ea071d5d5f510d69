"""``fastcollate.errors``, the path programs import the ContractError subclasses they catch from
(ContractTypeError, ContractValueError, ...), is the module fastcollate.collate.errors itself."""

import sys

from .collate import errors

sys.modules[__name__] = errors
