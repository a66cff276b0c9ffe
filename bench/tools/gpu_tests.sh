#!/usr/bin/env bash
# The GPU test suite on one GPU in one device call: six groups side by side. On an H200 all six
# together finished within 229 s (corpus 229, forward 201, the other files' group with the
# corpus-object tests 192). A group past its limit is stopped with SIGINT, so pytest still writes its summary and
# JUnit XML. Logs and XML go to $OUT/gpu_tests.tar.gz, a summary to $OUT/gpu_tests.txt and stdout.
#   bash bench/tools/gpu_tests.sh        (T: seconds per group, default 420)
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench/results}
LOGS=$(mktemp -d)
T=${T:-420}
# One seed for the six groups, kept in the summary: LIK_TEST_SEED=<it> replays a failure's inputs
# (pytest -q prints no header, where tests/conftest.py names the seed it drew).
export LIK_TEST_SEED=${LIK_TEST_SEED:-$(( (RANDOM << 15) | RANDOM ))}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$LOGS/gpu.txt"
run() {
    local name=$1 start
    shift
    start=$(date +%s)
    # Each group its own temporary directory, not pytest's numbered ones under /tmp/pytest-of-<user>,
    # which six sessions at once would clean up among themselves. (The shard read back with NUL bytes
    # in its header, twice in five runs, was not that: an NVRTC compile with an empty log had written
    # a NUL into CPython's shared b" ", fixed in lik_cupy/_runtime/nvrtc.py.)
    timeout -s INT -k 20 "$T" python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=40 --durations=8 \
        --basetemp="$LOGS/tmp_$name" --junitxml="$LOGS/junit_$name.xml" "$@" > "$LOGS/pytest_$name.log" 2>&1
    echo "$name rc=$? $(( $(date +%s) - start ))s" >> "$LOGS/rc.txt"
}
A=(tests/test_forward_gpu.py tests/test_tma_gpu.py tests/test_split_d_gpu.py tests/test_padded_split_gpu.py)
B=(tests/test_int8_gpu.py tests/test_backward_gpu.py tests/test_zero_pad_gpu.py)
C=(tests/test_fp8_gpu.py tests/test_fused_head_gpu.py tests/test_precision_gpu.py)
CORPUS=(tests/test_corpus_gpu.py tests/test_int8_corpus_gpu.py)
FILES=(tests/test_residual_gpu.py tests/test_nan_contract_gpu.py tests/test_reliability_gpu.py
       tests/test_integrations_gpu.py tests/test_serve_gpu.py tests/test_corpus_object_gpu.py)
REST=()  # the GPU tests of the other files
for f in "${A[@]}" "${B[@]}" "${C[@]}" "${CORPUS[@]}" "${FILES[@]}"; do REST+=(--ignore="$f"); done
run forward "${A[@]}" &
run int8_backward "${B[@]}" &
run fp8_head_precision "${C[@]}" &
run corpus "${CORPUS[@]}" &
run gpu_files "${FILES[@]}" &
run rest tests "${REST[@]}" &
wait
{
    echo "LIK_TEST_SEED=$LIK_TEST_SEED"
    cat "$LOGS/rc.txt"
    for f in "$LOGS"/pytest_*.log; do
        echo "== $(basename "$f")"
        grep -E "^(FAILED|ERROR)" "$f" | head -25
        grep -E "(passed|failed|error).* in [0-9.]+s" "$f" | tail -1
    done
} > "$LOGS/summary.txt"
mkdir -p "$OUT"
cp "$LOGS/summary.txt" "$OUT/gpu_tests.txt"
tar --exclude="./tmp_*" -czf "$OUT/gpu_tests.tar.gz" -C "$LOGS" .
cat "$LOGS/summary.txt"
