"""``fastcollate.lightning``, the path users import the Lightning callback from, is the module
fastcollate.integrations.lightning itself (one module under two names, never a copy)."""

import sys

from .integrations import lightning

sys.modules[__name__] = lightning
