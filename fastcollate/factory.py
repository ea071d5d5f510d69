"""Moved to ``fastcollate.bench.factory``; kept only while ``fastcollate/doctor.py`` still imports it from
here (issue 12: repointed at the merge, then this file is deleted)."""

from .bench.factory import load_factory

__all__ = ["load_factory"]
