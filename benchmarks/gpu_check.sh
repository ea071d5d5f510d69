#!/usr/bin/env bash
# The GPU check: on a machine with a GPU and torch already installed (no network needed), build with the
# given interpreter, run the CUDA tests, compute-sanitizer on a short CUDA run, the GPU benchmark and the
# profiler, and write JSON and logs to OUT_DIR. Budget: under 8 minutes on an H200.
#
#   PYTHON=python3 benchmarks/gpu_check.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0
step() { echo; echo "=== $* ($(date +%T))"; }

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"

step "build"
"$PY" -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }
grep "fastcollate build" "$OUT/build.log"

step "CUDA tests"
timeout 240 "$PY" -m pytest tests -q -m needs_cuda -p no:cacheprovider --junitxml="$OUT/cuda_tests.xml" || status=1

step "compute-sanitizer (memcheck, racecheck, synccheck) on a short CUDA run"
short="tests/test_ops.py tests/test_device_loader.py::test_no_slot_is_reused_while_its_copy_is_pending tests/test_device_loader.py::test_normalize_on_the_gpu_matches_the_cpu"
if command -v compute-sanitizer > /dev/null; then
  for tool in memcheck racecheck synccheck; do
    timeout 150 compute-sanitizer --tool "$tool" --error-exitcode 99 --target-processes all \
      "$PY" -m pytest $short -q -m needs_cuda -p no:cacheprovider > "$OUT/sanitizer-$tool.log" 2>&1
    code=$?
    echo "$tool: exit $code; $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer-$tool.log" | tail -1)"
    [ "$code" = 0 ] || status=1
  done
else
  echo "compute-sanitizer not found: skipped"
fi

step "GPU benchmark"
timeout 240 "$PY" benchmarks/gpu_bench.py --out "$OUT" || status=1

step "profile"
timeout 90 "$PY" -m fastcollate profile --out "$OUT/profile" || status=1

echo; echo "gpu_check: $([ $status = 0 ] && echo passed || echo FAILED) ($(date +%T))"
exit $status
