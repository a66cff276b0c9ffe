#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site LIK_CACHE_DIR=/tmp/likcache TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0
mkdir -p $OUT/base $OUT/new
for r in 1 2; do
(cd .scratch/s12/base && TORCHINDUCTOR_CACHE_DIR=/tmp/ind_base timeout 200 python3 bench/suites/bench_train.py --torch-cells n32_32x80,n64_32x300 --jax-cells none --modes compile --contenders ours --steps 100 --rounds 3 --round-s 0.5 --out $OUT/base --tag r$r > $OUT/base_r$r.log 2>&1; echo base rc=$?)
(TORCHINDUCTOR_CACHE_DIR=/tmp/ind_new timeout 260 python3 bench/suites/bench_train.py --torch-cells n32_32x80,n64_32x300 --jax-cells none --modes compile$([ $r = 1 ] && echo ,eager) --contenders ours$([ $r = 1 ] && echo ,lik,flash,torch) --steps 100 --rounds 3 --round-s 0.5 --out $OUT/new --tag r$r > $OUT/new_r$r.log 2>&1; echo new rc=$?)
done
grep -h -E "n32|n64|ours|compile" $OUT/base_r*.log | tail -12; echo ----; grep -h -E "n32|n64|ours|compile|eager" $OUT/new_r*.log | tail -30
