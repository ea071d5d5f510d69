"""fastcollate's benchmarks, run from the repository's root as ``python -m benchmarks.NAME`` (their shared
parts are ``benchmarks.shared``); ``make bench`` runs the pytest-benchmark suites (``test_*.py``)."""
