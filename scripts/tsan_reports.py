"""Splits a ThreadSanitizer log: reports with an OpenMP parallel region in their stacks go to
openmp-regions.<pid> (shown, not counted: libgomp is not instrumented); the rest stay."""
import os
import sys

report, logs = sys.argv[1], sys.argv[2]
blocks = [b for b in open(report).read().split("==================\n") if "WARNING: ThreadSanitizer" in b]
in_omp = [b for b in blocks if "._omp_fn." in b or "libgomp" in b]
others = [b for b in blocks if b not in in_omp]
if in_omp:
    with open(f"{logs}/openmp-regions.{report.rsplit('.', 1)[1]}", "w") as out:
        out.write("==================\n".join(in_omp))
    print(f"[sanitize] {len(in_omp)} ThreadSanitizer report(s) inside OpenMP parallel regions, not counted "
          f"(libgomp is not instrumented): {logs}/openmp-regions.*")
if others:
    with open(report, "w") as out:
        out.write("==================\n".join(others))
else:
    os.remove(report)
