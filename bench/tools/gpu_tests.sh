#!/usr/bin/env bash
# The GPU test suite on one GPU in one device call (about eight minutes): four groups side by side,
# then the corpus tests, which fill most of the GPU's memory on purpose (out-of-memory handling),
# alone. Logs and JUnit XML go to $OUT/gpu_tests.tar.gz, a summary to $OUT/gpu_tests.txt and stdout.
#   bash bench/tools/gpu_tests.sh        (T: seconds for the side-by-side part, default 330;
#                                         T_ALONE: for the corpus part, default 220)
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench/results}
LOGS=$(mktemp -d)
T=${T:-330}
T_ALONE=${T_ALONE:-220}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$LOGS/gpu.txt"
run() {
    local name=$1 limit=$2
    shift 2
    timeout -k 10 "$limit" python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=20 --durations=5 \
        --junitxml="$LOGS/junit_$name.xml" "$@" > "$LOGS/pytest_$name.log" 2>&1
    echo "$name rc=$?" >> "$LOGS/rc.txt"
}
A=(tests/test_forward_gpu.py tests/test_tma_gpu.py tests/test_split_d_gpu.py tests/test_padded_split_gpu.py)
B=(tests/test_int8_gpu.py tests/test_backward_gpu.py tests/test_zero_pad_gpu.py)
C=(tests/test_fp8_gpu.py tests/test_fused_head_gpu.py tests/test_precision_gpu.py)
ALONE=(tests/test_corpus_gpu.py tests/test_int8_corpus_gpu.py tests/test_corpus_object_gpu.py)
REST=()
for f in "${A[@]}" "${B[@]}" "${C[@]}" "${ALONE[@]}"; do REST+=(--ignore="$f"); done
run forward "$T" "${A[@]}" &
run int8_backward "$T" "${B[@]}" &
run fp8_head_precision "$T" "${C[@]}" &
run rest "$T" tests "${REST[@]}" &
wait
run corpus "$T_ALONE" "${ALONE[@]}"
{
    cat "$LOGS/rc.txt"
    for f in "$LOGS"/pytest_*.log; do
        echo "== $(basename "$f")"
        grep -E "^(FAILED|ERROR)" "$f" | head -15
        grep -E "(passed|failed|error).* in [0-9.]+s" "$f" | tail -1
    done
} > "$LOGS/summary.txt"
mkdir -p "$OUT"
cp "$LOGS/summary.txt" "$OUT/gpu_tests.txt"
tar -czf "$OUT/gpu_tests.tar.gz" -C "$LOGS" .
cat "$LOGS/summary.txt"
