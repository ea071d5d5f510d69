"""fastcollate inside other frameworks: ``lightning`` (also importable as ``fastcollate.lightning``) and
``thread_pipelines`` (``fetch_batches``)."""
