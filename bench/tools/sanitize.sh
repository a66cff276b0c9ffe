#!/usr/bin/env bash
# compute-sanitizer over every kernel family: memcheck and racecheck on bench/tools/sanitize_driver.py
# (small calls through the forward, backward and top-k kernels, each checked bit for bit against
# the CPU path), then memcheck on the GPU property tests (tests/test_properties.py -m gpu: random
# shapes, masks, lengths and offsets, unvalidated bad offsets and argmax entries included).
#
#   bash bench/tools/sanitize.sh        (from anywhere; it runs in the repo root)
#
# Env knobs:
#   OUT          where the logs go (default: <repo>/bench/results/sanitize); 8 files: memcheck.log,
#                racecheck.log, memcheck_properties.log (the sanitizer's reports), memcheck.txt,
#                racecheck.txt, memcheck_properties.txt (the programs' own output under each),
#                plain.txt (the same programs without the sanitizer) and sanitize_summary.txt
#   SANITIZER    the compute-sanitizer binary (default: on PATH, else /usr/local/cuda/bin/compute-sanitizer)
#   PYTHON       default python3
#   SKIP_PROPERTIES=1   skip the property tests
#   PROPERTY_EXAMPLES   hypothesis examples per GPU property test (default 100)
# CuPy's memory pool is off in every sanitized run, so each array is its own allocation and memcheck
# sees its exact bounds. Everything runs once without the sanitizer first, which compiles the
# kernels (NVRTC is host code) and checks the results.
# Exit status: 0 only if every sanitized run reports 0 errors (racecheck: 0 hazards) and every check passes.

set -u -o pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO" || exit 2
OUT="${OUT:-$REPO/bench/results/sanitize}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
SAN="${SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false LIK_POISON=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export LIK_GPU_PROPERTY_EXAMPLES="${PROPERTY_EXAMPLES:-100}"
T0=$(date +%s)
STATUS=0
: > "$OUT/sanitize_summary.txt"

say() { echo "$*" | tee -a "$OUT/sanitize_summary.txt"; }

if [ ! -x "$SAN" ]; then
    say "sanitize: no compute-sanitizer at $SAN (set SANITIZER)"
    exit 2
fi
say "== sanitize: $("$SAN" --version | tail -n 1); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)"

# run NAME LOG TEXT -- CMD...: CMD's output goes to TEXT; the sanitizer's report (LOG) must end
# with 0 errors (or 0 hazards) and CMD must exit 0.
run() {
    local name=$1 log=$2 text=$3
    shift 4
    local t rc summary
    t=$(date +%s)
    "$@" > "$OUT/$text" 2>&1
    rc=$?
    summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$OUT/$log" 2>/dev/null | tail -n 1)
    say "$name: exit $rc, ${summary:-no sanitizer summary} ($(( $(date +%s) - t )) s; $(tail -n 1 "$OUT/$text"))"
    if [ "$rc" != 0 ] || ! grep -qE "SUMMARY: 0 (errors|hazards)" <<< "$summary"; then
        STATUS=1
    fi
}

PYTEST_PROPS=(-m pytest -q -p no:cacheprovider -m gpu tests/test_properties.py)
NO_POOL="import sys, cupy, pytest; cupy.cuda.set_allocator(None); cupy.cuda.set_pinned_memory_allocator(None); \
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-m', 'gpu', 'tests/test_properties.py']))"

say "== without the sanitizer (compiles every kernel and checks the results)"
"$PY" bench/tools/sanitize_driver.py > "$OUT/plain.txt" 2>&1 || STATUS=1
say "driver: $(tail -n 1 "$OUT/plain.txt")"
if [ "${SKIP_PROPERTIES:-0}" != "1" ]; then
    "$PY" "${PYTEST_PROPS[@]}" >> "$OUT/plain.txt" 2>&1 || STATUS=1
    say "property tests: $(tail -n 1 "$OUT/plain.txt")"
fi

say "== planted errors: each tool must report its own (else a clean run would prove nothing)"
for tool in memcheck racecheck; do
    "$SAN" --tool "$tool" --error-exitcode 99 "$PY" bench/tools/sanitize_driver.py --no-pool --planted "$tool" \
        > "$OUT/planted.txt" 2>&1
    rc=$?
    found=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$OUT/planted.txt" | tail -n 1)
    say "$tool: exit $rc, ${found:-no sanitizer summary}"
    if [ "$rc" != 99 ]; then
        say "$tool did not report the planted error: its clean runs below would mean nothing"
        STATUS=1
    fi
done
rm -f "$OUT/planted.txt"

say "== under compute-sanitizer"
run "memcheck  (forward, backward, top-k)" memcheck.log memcheck.txt -- \
    "$SAN" --tool memcheck --error-exitcode 99 --log-file "$OUT/memcheck.log" \
    "$PY" bench/tools/sanitize_driver.py --no-pool
run "racecheck (forward, top-k: the shared-memory pipelines)" racecheck.log racecheck.txt -- \
    "$SAN" --tool racecheck --error-exitcode 99 --log-file "$OUT/racecheck.log" \
    "$PY" bench/tools/sanitize_driver.py --no-pool --families forward,topk
if [ "${SKIP_PROPERTIES:-0}" != "1" ]; then
    run "memcheck  (GPU property tests)" memcheck_properties.log memcheck_properties.txt -- \
        "$SAN" --tool memcheck --error-exitcode 99 --log-file "$OUT/memcheck_properties.log" "$PY" -c "$NO_POOL"
fi

say "== sanitize: $([ "$STATUS" = 0 ] && echo "0 errors" || echo FAILED) in $(( $(date +%s) - T0 )) s; logs in $OUT"
exit "$STATUS"
