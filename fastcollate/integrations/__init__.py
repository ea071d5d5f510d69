"""fastcollate inside other frameworks: ``lightning`` and ``ray`` (also importable as
``fastcollate.lightning`` and ``fastcollate.ray``), and ``thread_pipelines`` (``fetch_batches``)."""
