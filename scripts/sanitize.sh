#!/usr/bin/env bash
# Builds fastcollate._C with AddressSanitizer and UndefinedBehaviorSanitizer (FASTCOLLATE_SANITIZE=1) in a
# copy of the tree, so the normal in-place build is left alone, runs the CPU tests against it and says
# whether the run was clean: pytest passed and neither sanitizer reported anything.
#
#   scripts/sanitize.sh                   the CPU test files below
#   scripts/sanitize.sh tests/test_ops.py other pytest arguments instead
#   SANITIZER=thread scripts/sanitize.sh  ThreadSanitizer instead (FASTCOLLATE_SANITIZE=thread), on the
#                                         thread tests without DataLoader workers (TSan does not follow a
#                                         multi-threaded process into fork())
#
# Under ThreadSanitizer every copy runs on its caller's thread (OMP_NUM_THREADS=1,
# FASTCOLLATE_COPY_THREADS=1): libgomp, which torch loads, is not instrumented, so TSan cannot see the
# barrier that ends an OpenMP region (at::parallel_for's split of one copy) and would call every such
# copy a race. The threads the tests start themselves are all checked, and every report counts.
#
# Environment: PYTHON (default .venv/bin/python), SANITIZE_DIR (default: a fresh temporary folder, kept
# when the run is not clean), FASTCOLLATE_FUZZ_EXAMPLES (default 100 here: everything runs slower).
set -euo pipefail
SANITIZER="${SANITIZER:-address}"
case "$SANITIZER" in
  address) BUILD_FLAG=1; LIBS="libasan libubsan"; NAMES="AddressSanitizer or UndefinedBehaviorSanitizer" ;;
  thread) BUILD_FLAG=thread; LIBS="libtsan"; NAMES="ThreadSanitizer" ;;
  *) echo "[sanitize] SANITIZER must be address or thread, got $SANITIZER"; exit 2 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")"
WORK="${SANITIZE_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/fastcollate-sanitize.XXXXXX")}"
TESTS=("$@")
if [ ${#TESTS[@]} -eq 0 ] && [ "$SANITIZER" = thread ]; then
  TESTS=(tests/test_thread_pipelines.py tests/test_concurrency.py -k "not workers2")
elif [ ${#TESTS[@]} -eq 0 ]; then
  TESTS=(tests/test_assemble_dropin.py tests/test_contract.py tests/test_staging.py tests/test_device_loader.py
         tests/test_workers.py tests/test_ops.py tests/test_fuzz.py tests/test_faults.py tests/test_lifetimes.py
         tests/test_concurrency.py tests/test_shared_slots.py tests/test_slot_faults.py tests/test_batch_lifetimes.py
         tests/test_tree.py tests/test_arrays.py tests/test_mapped_files.py tests/test_index_batches.py
         tests/test_thread_pipelines.py)
fi

say() { echo "[sanitize] $*"; }

# The source tree, without builds, the venv or git's objects (tracked and untracked, as in the checkout).
say "copying $ROOT to $WORK/src"
mkdir -p "$WORK/src" "$WORK/logs"
tar -C "$ROOT" --exclude=./.venv --exclude=./.git --exclude=./build --exclude='*.so' --exclude='*.egg-info' \
    --exclude=__pycache__ --exclude=.hypothesis --exclude=.pytest_cache --exclude='./bench-out*' -cf - . |
  tar -C "$WORK/src" -xf -

say "building with FASTCOLLATE_SANITIZE=$BUILD_FLAG (CPU-only: the CUDA code is checked by compute-sanitizer on a GPU)"
(cd "$WORK/src" && FASTCOLLATE_SANITIZE=$BUILD_FLAG FASTCOLLATE_CUDA=0 "$PYTHON" setup.py build_ext --inplace -q \
   > "$WORK/logs/build.log" 2>&1) || { cat "$WORK/logs/build.log"; say "NOT CLEAN: the build failed"; exit 1; }
SO="$(ls "$WORK"/src/fastcollate/_C*.so)"
# Into a file first: grep -q stops reading at its match, and under pipefail ldd's broken pipe would
# fail the check.
ldd "$SO" > "$WORK/logs/ldd.txt"
for lib in $LIBS; do
  grep -q "$lib" "$WORK/logs/ldd.txt" || { say "NOT CLEAN: $SO is not linked against $lib"; exit 1; }
done

# Python is not built with ASan: its runtime has to be loaded first. Leaks are not checked (the
# interpreter keeps objects alive at exit by design); each report goes to its own file. An allocation
# too large to satisfy fails as it does under glibc (the tests ask for a petabyte to check that failure
# path) instead of aborting the run.
LIBASAN="$(gcc -print-file-name=libasan.so)"
LIBUBSAN="$(gcc -print-file-name=libubsan.so)"
LIBTSAN="$(gcc -print-file-name=libtsan.so)"
if [ "$SANITIZER" = thread ]; then
  export LD_PRELOAD="$LIBTSAN"
  # exitcode=0: a report must not turn pytest's own status into 66; the reports are counted below.
  export TSAN_OPTIONS="log_path=$WORK/logs/tsan:second_deadlock_stack=1:exitcode=0"
  export OMP_NUM_THREADS=1 FASTCOLLATE_COPY_THREADS=1
else
  export LD_PRELOAD="$LIBASAN:$LIBUBSAN"
fi
export ASAN_OPTIONS="detect_leaks=0:protect_shadow_gap=0:allocator_may_return_null=1:log_path=$WORK/logs/asan:print_summary=1"
export UBSAN_OPTIONS="print_stacktrace=1:log_path=$WORK/logs/ubsan"
export FASTCOLLATE_FUZZ_EXAMPLES="${FASTCOLLATE_FUZZ_EXAMPLES:-100}"
export PYTHONDONTWRITEBYTECODE=1

cd "$WORK/src"
"$PYTHON" - <<EOF
import fastcollate, os
assert fastcollate.__file__.startswith("$WORK/src/"), f"imported {fastcollate.__file__}, not the sanitized copy"
print("[sanitize] importing", fastcollate._C.__file__)
EOF
say "running: pytest ${TESTS[*]}"
set +e
"$PYTHON" -m pytest -q -p no:cacheprovider "${TESTS[@]}" 2>&1 | tee "$WORK/logs/pytest.log"
status=${PIPESTATUS[0]}
set -e

# A report file that only says an allocation was refused (the tests' petabyte request, returned as a
# failure by allocator_may_return_null) is not a finding; it is shown, and not counted. With both
# sanitizers loaded the warning may land in UBSan's log file instead of ASan's.
for report in $(ls "$WORK"/logs/asan.* "$WORK"/logs/ubsan.* 2>/dev/null || true); do
  if ! grep -qv "WARNING: AddressSanitizer failed to allocate" "$report"; then
    say "refused allocation, as the tests intend: $(cat "$report")"
    mv "$report" "$WORK/logs/refused-allocation.${report##*.}"
  fi
done
reports=$(ls "$WORK"/logs/asan.* "$WORK"/logs/ubsan.* "$WORK"/logs/tsan.* 2>/dev/null || true)
if [ -n "$reports" ]; then
  for report in $reports; do
    say "report $report:"; head -60 "$report"
  done
fi
if [ "$status" -eq 0 ] && [ -z "$reports" ]; then
  say "CLEAN: pytest passed, no $NAMES report (${TESTS[*]})"
  [ -n "${SANITIZE_DIR:-}" ] || rm -rf "$WORK"
  exit 0
fi
say "NOT CLEAN: pytest exit status $status, $(echo "$reports" | grep -c . || true) sanitizer report file(s); kept $WORK"
exit 1
