"""``fastcollate.ray``, the path users import ``ArrowCollate`` from, is the module
fastcollate.integrations.ray itself (one module under two names, never a copy)."""

import sys

from .integrations import ray

sys.modules[__name__] = ray
