"""benchmarks/gpu_check.sh on the CPU path: what it leaves in its output folder, of which the GPU
machine's device tool brings back 8 files at most (any one beyond may be dropped, the bench's JSON too)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
def test_gpu_check_leaves_at_most_eight_files(tmp_path):
    # The steps that write into the folder: the bench's JSON, the profile (whose profiler.log made a
    # ninth file), and the sanitizers' log (made even when they skip, as here). The build and the CUDA
    # tests write nothing there but build.log, made whether or not the build runs.
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_STEPS": "bench profile sanitizers",
           "GPU_CHECK_PROFILE_ARGS": "--steps 2 --warmup 1 --no-model --size 2000", "CHECK_BUDGET_S": "240"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    files = sorted(str(path.relative_to(out)) for path in out.rglob("*") if path.is_file())
    assert len(files) <= 8, files
    assert {"check.log", "build.log", "sanitizers.log", "profile/profile.json", "profile/timeline.png",
            "profile/trace_default.json", "profile/trace_device_loader.json"} <= set(files)
    assert [name for name in files if name.endswith(".json") and "/" not in name], "no bench JSON"
    check_log = (out / "check.log").read_text()
    # What torch's profiler writes to stderr is its own (and differs between versions); ours is to keep
    # it in profiler.log and fold that file into check.log, not leave it as a ninth file.
    assert "profile/profiler.log" not in files
    assert "--- profile/profiler.log, folded in here and removed" in check_log
    assert f"files in {out}: {len(files)} (at most 8)" in check_log
