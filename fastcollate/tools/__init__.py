"""The tools around the product: ``audit`` (also ``fastcollate.audit``), ``bench`` (``python -m fastcollate
bench`` and ``profile``), the doctor (``audit.doctor``), ``cli``, ``terminal`` and ``factory_spec``.
``import fastcollate`` loads none of them."""
