"""``fastcollate.audit`` (``fastcollate.audit.compare``, ``check_distributed``, ``Ledger``) is the package
fastcollate.tools.audit itself. Importing fastcollate does not load it: the package's ``__getattr__``
imports this module when a program first names ``fastcollate.audit``."""

import sys

from .tools import audit

sys.modules[__name__] = audit
