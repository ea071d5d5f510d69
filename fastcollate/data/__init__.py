"""Data gathered by index: ``Arrays`` over tensors, memmaps and Arrow files (``arrays``, ``columns``,
``arrow_columns``, ``arrow_layout``, ``hf_formats``, ``mapped_files``, ``touched_files``,
``token_windows``) and the samplers that batch their indices (``index_batches``, ``token_batches``)."""

# Loaded with the package: it gives Arrays its from_hf and from_arrow (arrays.ARROW_FACTORIES).
from . import arrow_columns  # noqa: E402, F401
