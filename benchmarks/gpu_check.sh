#!/usr/bin/env bash
# The GPU check: on a machine with a GPU and torch already installed (no network needed), build with the
# given interpreter, run the CUDA tests, the GPU benchmark, the profiler, then compute-sanitizer on a
# short CUDA run, and write each result to OUT_DIR as soon as it exists.
#
#   PYTHON=python3 benchmarks/gpu_check.sh OUT_DIR
#
# The whole check is bounded to 8 minutes (CHECK_BUDGET_S): each step gets its own budget (they add up to
# it) and never more than what is left. The results that matter most come first, so a run cut short
# still leaves them. Exactly these 8 files go to OUT_DIR (the device tool brings back no more; the
# script fails if it finds more there at the end), each made whether or not its step runs:
#   check.log  build.log  sanitizers.log  <device>-<date>.json
#   profile/{profile.json,timeline.png,trace_default.json,trace_device_loader.json}
# (profile's own profiler.log is folded into check.log). Without a GPU it runs end to end on the CPU
# path (tiny sizes; CUDA tests and sanitizers skip). GPU_CHECK_STEPS="bench profile ..." runs only the
# steps named (of: build tests bench profile ddp sanitizers), as tests/test_gpu_check.py does.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee "$OUT/check.log") 2>&1
tee_pid=$!
export PYTHONUNBUFFERED=1

# Per-step budgets in seconds; they add up to CHECK_BUDGET_S: 135+80+100+35+40+3*30 = 480. DDP has 40 s
# for torchrun, NCCL's set-up and two forked epochs; the build (16 cores there) and the sanitizers' short
# run gave that time up.
CHECK_BUDGET_S=${CHECK_BUDGET_S:-480}
BUILD_S=135 TESTS_S=80 BENCH_S=100 PROFILE_S=35 DDP_S=40 SANITIZER_S=30
# A test still running after this many seconds has its stack dumped (faulthandler) before the step's
# timeout kills it; -v names each test as it starts, so the last lines of a cut step name the one hung.
HANG_S=25
STEPS=" ${GPU_CHECK_STEPS:-build tests bench profile ddp sanitizers} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
started=$SECONDS
status=0
notes=""
step() { echo; echo "=== $* ($(date +%T), $((SECONDS - started)) s into the check)"; }
# The budget of a step: its own, or what is left of the whole check if that is less (at least 1 s).
budget() {
  local left=$((CHECK_BUDGET_S - (SECONDS - started)))
  local wanted=$1
  [ "$left" -lt "$wanted" ] && wanted=$left
  [ "$wanted" -lt 1 ] && wanted=1
  echo "$wanted"
}
fail() { echo "FAILED: $*"; status=1; }

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi: none"
"$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"
gpu=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

# The package is imported from this checkout.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Every log this check leaves exists from the start, so a run that skips or loses a step leaves the same
# set of files (and the CPU path's count is the GPU's).
echo "skipped: not run (GPU_CHECK_STEPS)" > "$OUT/build.log"
echo "skipped: no GPU, no compute-sanitizer, or not run (see check.log)" > "$OUT/sanitizers.log"

if want build; then
  step "build (CUDA forced: a CPU-only fallback must fail here, not pass silently)"
  # In place, with ninja's objects kept in build/: a second check on the same tree rebuilds only what
  # changed (pip's editable install compiles everything again in a temporary folder).
  FASTCOLLATE_CUDA=1 timeout "$(budget $BUILD_S)" "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; echo "gpu_check: FAILED (build)"; exit 1; }
  grep "\[fastcollate build\]" "$OUT/build.log"
  "$PY" - <<'EOF' || { echo "gpu_check: FAILED (the build is not the CUDA build it should be)"; exit 1; }
import torch
from fastcollate import _C
version = _C.built_cuda_version  # e.g. 13000
built = f"{version // 1000}.{version % 1000 // 10}"
print(f"fastcollate._C: built_with_cuda={_C.built_with_cuda}, CUDA runtime {built}; torch.version.cuda={torch.version.cuda}")
assert _C.built_with_cuda, "fastcollate._C was built without CUDA"
assert torch.version.cuda and built == ".".join(torch.version.cuda.split(".")[:2]), \
    f"toolkit CUDA {built} does not match torch's CUDA {torch.version.cuda}"
EOF
fi

# The CUDA tests live in these files; naming them keeps an unrelated test module's missing import from
# failing collection (and with it every CUDA test).
cuda_tests="tests/test_ops.py tests/test_staging.py tests/test_device_loader.py tests/test_faults.py tests/test_concurrency.py tests/test_shared_slots.py tests/test_tree.py tests/test_lightning.py tests/test_thread_pipelines.py tests/test_packed.py tests/test_ray_collate.py tests/test_ray_collate_options.py"
pytest_args=(-v -o "faulthandler_timeout=$HANG_S" -m needs_cuda -p no:cacheprovider)

if want tests; then
  step "imports the CUDA tests need"
  "$PY" -c "import pytest, numpy; print('pytest', pytest.__version__, 'numpy', numpy.__version__)" || fail "test imports"
  "$PY" -m pytest $cuda_tests -q --collect-only -p no:cacheprovider > /dev/null || fail "collecting $cuda_tests"

  step "CUDA tests"
  timeout "$(budget $TESTS_S)" "$PY" -m pytest $cuda_tests "${pytest_args[@]}" -rs || fail "CUDA tests"
fi

if want bench; then
  step "GPU benchmark (writes its JSON after every configuration)"
  bench_budget=$(budget $BENCH_S)
  timeout "$bench_budget" "$PY" -m benchmarks.gpu_bench --out "$OUT" --time-budget $((bench_budget - 10))
  code=$?
  rm -f "$OUT"/*.json.partial  # a write the timeout cut: the JSON before it is whole (replaced by rename)
  # What the bench's JSON holds; empty when there is none or it does not parse.
  held=$("$PY" - "$OUT" 2>/dev/null <<'EOF'
import glob, json, sys
path = glob.glob(f"{sys.argv[1]}/*.json")[0]
result = json.load(open(path))
print(f"{path}: {len(result['runs'])} configurations, {len(result['skipped_for_time'])} skipped for time")
EOF
  )
  if [ "$code" = 0 ]; then
    :
  elif [ "$code" = 124 ] && [ -n "$held" ]; then
    # Killed while a configuration ran: that one is lost, every one before it is in the JSON.
    echo "GPU benchmark: cut by its ${bench_budget} s budget, not failed; its JSON is complete: $held"
    notes="$notes; benchmark cut by its budget"
  else
    fail "GPU benchmark (exit $code${held:+; $held})"
  fi
fi

if want profile; then
  step "profile"
  # GPU_CHECK_PROFILE_ARGS: extra options (tests/test_gpu_check.py shrinks the run with them).
  timeout "$(budget $PROFILE_S)" "$PY" -m fastcollate profile --out "$OUT/profile" ${GPU_CHECK_PROFILE_ARGS:-} \
    || fail "profile"
  # torch.profiler's own lines (kineto's markers) go here, not into a ninth file of $OUT.
  if [ -f "$OUT/profile/profiler.log" ]; then
    echo "--- profile/profiler.log, folded in here and removed (\$OUT keeps 8 files at most):"
    cat "$OUT/profile/profiler.log"
    rm -f "$OUT/profile/profiler.log"
  fi
fi

if want ddp; then
  step "examples/ddp_train.py under torchrun: one rank per GPU (nccl), at most 2"
  ranks=$("$PY" -c "import torch; print(min(max(torch.cuda.device_count(), 1), 2))" 2>/dev/null || echo 1)
  timeout "$(budget $DDP_S)" "$PY" -m torch.distributed.run --standalone --nproc_per_node="$ranks" examples/ddp_train.py \
    || fail "examples/ddp_train.py on $ranks rank(s)"
fi

if want sanitizers; then
  step "compute-sanitizer (memcheck, racecheck, synccheck) on a short CUDA run"
  short="tests/test_ops.py tests/test_device_loader.py::test_no_slot_is_reused_while_its_copy_is_pending tests/test_device_loader.py::test_normalize_on_the_gpu_matches_the_cpu"
  if [ "$gpu" != 1 ]; then
    echo "no GPU: skipped"
  elif ! command -v compute-sanitizer > /dev/null; then
    echo "compute-sanitizer not found: skipped"
  else
    : > "$OUT/sanitizers.log"
    for tool in memcheck racecheck synccheck; do
      echo "--- $tool" >> "$OUT/sanitizers.log"
      # Without the caching allocator every tensor is its own allocation, so memcheck sees writes past a
      # tensor's end that would otherwise land inside a cached segment.
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$(budget $SANITIZER_S)" compute-sanitizer --tool "$tool" \
        --error-exitcode 99 --target-processes all "$PY" -m pytest $short "${pytest_args[@]}" \
        >> "$OUT/sanitizers.log" 2>&1
      code=$?
      section=$(sed -n "/^--- $tool\$/,\$p" "$OUT/sanitizers.log")
      summary=$(grep -E 'ERROR SUMMARY' <<< "$section" | tail -1)
      # What the tool found (one summary a process), apart from how the tests under it ended.
      found=$(grep -oE 'ERROR SUMMARY: [0-9]+' <<< "$section" | awk '{n += $3} END {print n + 0}')
      reported=$(grep -cE '^========= (Invalid|Race|Barrier|Uninitialized|Error|Program hit)' <<< "$section")
      if [ "$code" = 0 ]; then
        echo "$tool: clean; $summary"
      elif grep -qiE "device not supported|not supported on this" <<< "$section"; then
        echo "$tool: compute-sanitizer does not support this machine's GPU runtime: not checked"
      elif [ "$code" = 99 ] || [ "$found" != 0 ] || [ "$reported" != 0 ]; then
        fail "compute-sanitizer $tool: the tool found errors (exit $code; $summary)"
      elif [ "$code" = 124 ]; then
        echo "$tool: timed out after its budget: not checked to the end (no error reported before)"
      else
        # The tool found nothing, but a test failed under it: launches are slower or serialised there,
        # so a timing-dependent assertion can miss (the same tests ran without the tool above).
        echo "NOTE: $tool: tests failed under the tool (exit $code), which found no error; see sanitizers.log"
        notes="$notes; tests failed under $tool, which found no error"
      fi
    done
  fi
fi

# The device tool brings back 8 files of $OUT at most, and which it drops is not ours to choose.
files=$(cd "$OUT" && find . -type f | sed 's|^\./||' | sort)
count=$(grep -c . <<< "$files")
echo; echo "files in $OUT: $count (at most 8): $(tr '\n' ' ' <<< "$files")"
[ "$count" -le 8 ] || fail "$OUT holds $count files; at most 8 come back from the GPU machine"

echo; echo "gpu_check: $([ $status = 0 ] && echo passed || echo FAILED)${notes:+ (${notes#; })} in $((SECONDS - started)) s ($(date +%T))"
exec >&- 2>&-
wait "$tee_pid"  # check.log holds the last line too
exit $status
