"""The parts of benchmarks/ that its scripts and tests share, imported as a package: the report header
(``report_header``), the collate cases and their contenders (``collate_cases``, ``collate_contenders``)
and how they are timed (``collate_timing``), the array and Hugging Face contenders (``array_contenders``,
``hf_paths``), and the rounds a ratio is measured in (``rounds``). The scripts run from the repository's
root as ``python -m benchmarks.NAME``."""
