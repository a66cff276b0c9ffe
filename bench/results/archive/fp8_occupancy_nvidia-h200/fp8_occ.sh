export PYTHONPATH=/tmp/site:$PWD LIK_CACHE_DIR=/tmp/likcache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
for v in "0 0 0" "128 2 2" "64 4 2" "64 3 3" "64 4 3" "64 3 4" "64 4 4" "64 2 4"; do
  timeout 120 python3 .scratch/s13/fp8_occ.py $v 2>&1 | grep -v Warn | tail -3
done
