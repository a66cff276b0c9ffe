mkdir -p $OUT/prec
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
git log --oneline -1 2>/dev/null
timeout 330 python -m pytest -m gpu -q -p no:cacheprovider tests/test_backward_gpu.py tests/test_zero_pad_gpu.py tests/test_torch_library.py tests/test_reliability_gpu.py tests/test_precision_gpu.py tests/test_integrations_gpu.py tests/test_jax.py tests/test_properties.py 2>&1 | tail -15 > $OUT/gpu_tests.txt
timeout 200 python bench/suites/bench_precision.py --cells train-32,train-64 --out $OUT/prec 2>&1 | grep -v -i warn | tail -12
cat $OUT/gpu_tests.txt
