#!/usr/bin/env bash
# The GPU test suite on one GPU, groups side by side where GPU memory allows, logs and JUnit XML
# under $OUT:  bash bench/tools/gpu_tests.sh   (T: seconds per group, default 520)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
T=${T:-520}
run() { local name=$1; shift; timeout -k 10 $T python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=20 \
  --junitxml=$OUT/junit_$name.xml "$@" > $OUT/pytest_$name.log 2>&1; echo "$name rc=$?" >> $OUT/rc.txt; }
# g2 and g4 fill most of the GPU's memory on purpose (out-of-memory handling): they run alone.
run g1 tests/test_forward_gpu.py tests/test_tma_gpu.py tests/test_split_d_gpu.py &
run g3 tests/test_int8_gpu.py tests/test_backward_gpu.py &
wait
run g2 tests/test_corpus_gpu.py tests/test_int8_corpus_gpu.py
run g4 tests --ignore=tests/test_forward_gpu.py --ignore=tests/test_tma_gpu.py --ignore=tests/test_split_d_gpu.py \
  --ignore=tests/test_corpus_gpu.py --ignore=tests/test_int8_corpus_gpu.py --ignore=tests/test_int8_gpu.py \
  --ignore=tests/test_backward_gpu.py
cat $OUT/rc.txt
for f in $OUT/pytest_*.log; do echo "== $f"; grep -E "passed|failed|error" $f | tail -2; grep -E "^(FAILED|ERROR)" $f | head -15; done
