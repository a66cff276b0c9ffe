#!/usr/bin/env bash
# One GPU session: install the baseline wheels, run the GPU tests, run the
# forward benchmark, then the corpus benchmark (bench_corpus.py) with the time
# that is left, print a short summary last.
#
#   bash bench/tools/gpu_session.sh [bench_forward.py args...]      e.g.  bash bench/tools/gpu_session.sh --quick
#   ONLY_CORPUS=1 CORPUS_ARGS="--quick" bash bench/tools/gpu_session.sh   (corpus bench only)
#
# The suites it runs are bench/suites/bench_*.py; it works from any directory (it cd's to the repo root).
#
# Env knobs:
#   OUT              output dir (default: <repo>/bench/results)
#   SESSION_LIMIT_S  wall-clock limit of the whole call (default 570); the bench gets
#                    --time-budget = what is left minus a margin (a --time-budget you pass wins)
#   PYTEST_TIMEOUT_S hard cap on the pytest step (default 240)
#   SKIP_TESTS=1 / SKIP_BENCH=1 (SKIP_BENCH skips both benchmarks)
#   PYTEST_ARGS      extra pytest args (e.g. "-k maxsim")
#   ONLY_CORPUS=1    skip the tests and the forward bench; run only bench_corpus.py
#   SKIP_CORPUS=1    skip bench_corpus.py
#   SKIP_SPLIT_D=1   skip bench_split_d.py --no-candidates (wide dims against the baselines;
#                    it runs after the forward bench, before the corpus bench)
#   SKIP_BACKWARD=1  skip bench_backward.py (training step against the baselines; after split-d)
#   SKIP_INT8=1      skip bench_int8.py (INT8 speed and fidelity; after the backward bench)
#   CORPUS_ARGS      extra bench_corpus.py args (e.g. "--quick" or "--cells topk,ragged")
#   CORPUS_RESERVE_S seconds withheld from the forward bench's budget so the corpus bench
#                    still gets to run after it (default 0: the corpus bench gets what is left,
#                    and is skipped when that is under 60 s)
#   LIK_COMMIT       the commit this tree is, recorded in every JSON (bench/lib/provenance.py);
#                    this machine's .git is stale, so put the sha in the command from outside
#
# Files written to $OUT (flat, <= 8): pytest.log, bench.log (forward, split-d, backward, int8
#   and corpus output), forward_<gpu>.json, split_d_<gpu>.json, backward_<gpu>.json,
#   int8_<gpu>.json, corpus_<gpu>.json, summary.txt (forward_<gpu>.png is removed when the
#   int8 bench ran); pytest-junit.xml is read into the
#   summary and removed; forward_<gpu>.txt only when the split-d bench is skipped, and
#   corpus_<gpu>.txt with ONLY_CORPUS=1 (the device tool returns at most 8 files; those tables
#   are in summary.txt and bench.log anyway)
# The baseline wheels live in .whl/ which is git-ignored: the device run must carry it
# (run(..., carry=[".whl"])).

set -o pipefail
set -u
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export LIK_SUPPRESS_NORM_WARN=1

T0=$(date +%s)
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO" || exit 2
OUT="${OUT:-$REPO/bench/results}"
mkdir -p "$OUT"
SESSION_LIMIT_S="${SESSION_LIMIT_S:-570}"
PYTEST_TIMEOUT_S="${PYTEST_TIMEOUT_S:-240}"
CORPUS_RESERVE_S="${CORPUS_RESERVE_S:-0}"
SKIP_FORWARD=0
if [ "${ONLY_CORPUS:-0}" = "1" ]; then
    SKIP_TESTS=1
    SKIP_FORWARD=1
fi
RUN_CORPUS=1
if [ "${SKIP_BENCH:-0}" = "1" ] || [ "${SKIP_CORPUS:-0}" = "1" ]; then
    RUN_CORPUS=0
fi

echo "== gpu_session: repo=$REPO out=$OUT args: $*"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader 2>/dev/null || true
python3 --version

# ---------------------------------------------------------------- baseline wheels
SITE=/tmp/site
shopt -s nullglob
WHEELS=("$REPO"/.whl/*.whl)
shopt -u nullglob
if [ "${#WHEELS[@]}" -gt 0 ]; then
    rm -rf "$SITE"
    if python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${WHEELS[@]}"; then
        WHEEL_STATUS="installed: $(cd "$REPO/.whl" && ls *.whl | tr '\n' ' ')"
    else
        WHEEL_STATUS="pip install FAILED (baselines will show import errors)"
    fi
else
    WHEEL_STATUS="no .whl/*.whl found (carry .whl to the device); baselines will show import errors"
fi
echo "baseline wheels: $WHEEL_STATUS"
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"

# ---------------------------------------------------------------- tests
PYTEST_RC="skipped"
if [ "${SKIP_TESTS:-0}" != "1" ]; then
    echo "== pytest -m gpu -q tests  (timeout ${PYTEST_TIMEOUT_S}s)"
    # shellcheck disable=SC2086
    timeout -k 10 "$PYTEST_TIMEOUT_S" python3 -m pytest -m gpu -q --maxfail=25 -p no:cacheprovider \
        --junitxml="$OUT/pytest-junit.xml" ${PYTEST_ARGS:-} tests 2>&1 | tee "$OUT/pytest.log"
    PYTEST_RC=${PIPESTATUS[0]}
    echo "pytest exit code: $PYTEST_RC"
fi

# ---------------------------------------------------------------- portable kernels only, and the SASS check
if [ "${SKIP_TESTS:-0}" != "1" ]; then
    echo "== pytest -m gpu with the Hopper kernels forced off (LIK_DISABLE_WGMMA=1)"
    LIK_DISABLE_WGMMA=1 timeout -k 10 "$PYTEST_TIMEOUT_S" python3 -m pytest -m gpu -q --maxfail=25 \
        -p no:cacheprovider tests/test_forward_gpu.py tests/test_split_d_gpu.py 2>&1 | tail -n 3 | tee -a "$OUT/pytest.log"
    echo "== SASS check: tensor-core instructions in the compiled forward kernels"
    python3 - <<'PY' 2>&1 | tee -a "$OUT/pytest.log"
import concurrent.futures, json, os, subprocess
from lik_cupy._runtime.nvrtc import cache_dir
def one(meta):  # a few hundred kernels after the suite: one cuobjdump per core, listed in order
    info = json.loads(meta.read_text())
    name = info["defines"].get("LIK_NAME", "?")
    sass = subprocess.run(["cuobjdump", "--dump-sass", str(meta.with_suffix(".cubin"))], capture_output=True, text=True).stdout
    return f"{name:60s} sm_{info['arch']:4s} HGMMA={sass.count('HGMMA'):4d} IGMMA={sass.count('IGMMA'):4d} HMMA={sass.count('HMMA'):4d} IMMA={sass.count('IMMA'):4d}"
with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 4) as ex:
    for line in ex.map(one, sorted(cache_dir().glob("*.json"))):
        print(line)
PY
fi

# ---------------------------------------------------------------- bench
BENCH_RC="skipped"
if [ "${SKIP_BENCH:-0}" != "1" ] && [ "$SKIP_FORWARD" != "1" ]; then
    NOW=$(date +%s)
    LEFT=$(( SESSION_LIMIT_S - (NOW - T0) ))
    RESERVE=0
    [ "$RUN_CORPUS" = "1" ] && RESERVE=$CORPUS_RESERVE_S
    BUDGET=$(( LEFT - 75 - RESERVE )) # leave room for chart + summary + the last measurement (+ the corpus bench)
    [ "$BUDGET" -lt 30 ] && BUDGET=30
    HARD=$(( LEFT - 15 ))             # hard kill so the summary still prints
    [ "$HARD" -lt 40 ] && HARD=40
    echo "== bench_forward.py (time budget ${BUDGET}s, hard limit ${HARD}s)"
    timeout -k 10 "$HARD" python3 bench/suites/bench_forward.py --out "$OUT" --time-budget "$BUDGET" "$@" 2>&1 \
        | tee "$OUT/bench.log"
    BENCH_RC=${PIPESTATUS[0]}
    echo "bench exit code: $BENCH_RC"
fi

# ---------------------------------------------------------------- split-d and backward benches
# run_after_forward SCRIPT ARGS...: bench/suites/SCRIPT --out $OUT ARGS with the session time that is
# left (skipped under 150 s), output appended to bench.log; its exit code lands in AFTER_RC.
run_after_forward() {
    local left=$(( SESSION_LIMIT_S - ($(date +%s) - T0) ))
    AFTER_RC="skipped"
    if [ "$left" -lt 150 ]; then
        echo "== $1 skipped: only ${left}s left" | tee -a "$OUT/bench.log"
        return
    fi
    echo "== $*" | tee -a "$OUT/bench.log"
    timeout -k 10 $(( left - 60 )) python3 "bench/suites/$1" --out "$OUT" "${@:2}" 2>&1 | tee -a "$OUT/bench.log"
    AFTER_RC=${PIPESTATUS[0]}
}

SPLIT_RC="skipped"
if [ "${SKIP_BENCH:-0}" != "1" ] && [ "$SKIP_FORWARD" != "1" ] && [ "${SKIP_SPLIT_D:-0}" != "1" ]; then
    run_after_forward bench_split_d.py --no-candidates --time-budget $(( SESSION_LIMIT_S - ($(date +%s) - T0) - 120 ))
    SPLIT_RC=$AFTER_RC
    # keep $OUT at <= 8 files; the forward table is in summary.txt
    [ "$SPLIT_RC" != "skipped" ] && rm -f "$OUT"/forward_*.txt
fi

BACKWARD_RC="skipped"
if [ "${SKIP_BENCH:-0}" != "1" ] && [ "$SKIP_FORWARD" != "1" ] && [ "${SKIP_BACKWARD:-0}" != "1" ]; then
    run_after_forward bench_backward.py
    BACKWARD_RC=$AFTER_RC
fi

INT8_RC="skipped"
if [ "${SKIP_BENCH:-0}" != "1" ] && [ "$SKIP_FORWARD" != "1" ] && [ "${SKIP_INT8:-0}" != "1" ]; then
    run_after_forward bench_int8.py --time-budget $(( SESSION_LIMIT_S - ($(date +%s) - T0) - 150 ))
    INT8_RC=$AFTER_RC
    [ "$INT8_RC" != "skipped" ] && rm -f "$OUT"/forward_*.png  # keep $OUT at <= 8 files
fi

# ---------------------------------------------------------------- corpus bench (after the forward bench)
CORPUS_RC="skipped"
if [ "$RUN_CORPUS" = "1" ]; then
    NOW=$(date +%s)
    LEFT=$(( SESSION_LIMIT_S - (NOW - T0) ))
    CBUDGET=$(( LEFT - 60 ))          # room for the summary and the last (outofcore) measurement
    CHARD=$(( LEFT - 15 ))
    if [ "$CBUDGET" -lt 60 ]; then
        echo "== bench_corpus.py skipped: only ${LEFT}s of the session left (set CORPUS_RESERVE_S or ONLY_CORPUS=1)" \
            | tee -a "$OUT/bench.log"
        CORPUS_RC="skipped (no time)"
    else
        CORPUS_TXT=""
        TEE_A=""
        if [ "$BENCH_RC" != "skipped" ]; then
            CORPUS_TXT="--no-txt"     # keep $OUT at <= 8 files (the table goes to bench.log and summary.txt)
            TEE_A="-a"                # append to the forward bench's log
        fi
        echo "== bench_corpus.py (time budget ${CBUDGET}s, hard limit ${CHARD}s) ${CORPUS_ARGS:-}" | tee $TEE_A "$OUT/bench.log"
        # shellcheck disable=SC2086
        timeout -k 10 "$CHARD" python3 bench/suites/bench_corpus.py --out "$OUT" --budget-s "$CBUDGET" \
            $CORPUS_TXT ${CORPUS_ARGS:-} 2>&1 | tee -a "$OUT/bench.log"
        CORPUS_RC=${PIPESTATUS[0]}
        echo "corpus bench exit code: $CORPUS_RC"
    fi
fi

# ---------------------------------------------------------------- summary (last)
{
    echo
    echo "=================== SUMMARY ==================="
    echo "baseline wheels: $WHEEL_STATUS"
    if [ -f "$OUT/pytest-junit.xml" ] && [ "$PYTEST_RC" != "skipped" ]; then
        python3 - "$OUT/pytest-junit.xml" <<'PY' || echo "pytest: could not parse junit xml"
import sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
t = f = e = s = 0
bad = []
for su in suites:
    t += int(su.get("tests", 0)); f += int(su.get("failures", 0))
    e += int(su.get("errors", 0)); s += int(su.get("skipped", 0))
    for tc in su.iter("testcase"):
        for kind in ("failure", "error"):
            el = tc.find(kind)
            if el is not None:
                msg = (el.get("message") or "").replace("\n", " ")[:150]
                bad.append(f"  {kind.upper()}: {tc.get('classname')}::{tc.get('name')}: {msg}")
print(f"pytest: {t - f - e - s} passed, {f} failed, {e} errors, {s} skipped (of {t})")
print("\n".join(bad[:10]))
PY
    elif [ "$PYTEST_RC" != "skipped" ]; then
        echo "pytest: no junit xml; last line: $(tail -n 1 "$OUT/pytest.log" 2>/dev/null)"
    fi
    echo "pytest exit code: $PYTEST_RC   (0 ok, 1 failures, 5 no tests collected, 124 timeout)"
    echo "bench exit code:  $BENCH_RC   (124 = hit the hard time limit; partial JSON still written)"
    echo "corpus bench exit code: $CORPUS_RC"
    if [ "$SKIP_FORWARD" != "1" ]; then
        JSON=$(ls -t "$OUT"/forward_*.json 2>/dev/null | head -n 1)
        if [ -n "$JSON" ]; then
            echo "bench results: $JSON"
            python3 bench/suites/bench_forward.py --table-from "$JSON" || echo "(could not render table)"
        else
            echo "bench: no results JSON"
        fi
    fi
    SJSON=$(ls -t "$OUT"/split_d_*.json 2>/dev/null | head -n 1)
    if [ "$SPLIT_RC" != "skipped" ] && [ -n "$SJSON" ]; then
        echo
        echo "split-d results: $SJSON (exit code $SPLIT_RC)"
        python3 bench/suites/bench_split_d.py --table-from "$SJSON" || echo "(could not render split-d table)"
    fi
    BJSON=$(ls -t "$OUT"/backward_*.json 2>/dev/null | head -n 1)
    if [ "$BACKWARD_RC" != "skipped" ] && [ -n "$BJSON" ]; then
        echo
        echo "backward results: $BJSON (exit code $BACKWARD_RC)"
        python3 bench/suites/bench_backward.py --table-from "$BJSON" || echo "(could not render backward table)"
    fi
    IJSON=$(ls -t "$OUT"/int8_*.json 2>/dev/null | head -n 1)
    if [ "$INT8_RC" != "skipped" ] && [ -n "$IJSON" ]; then
        echo
        echo "int8 results: $IJSON (exit code $INT8_RC)"
        python3 bench/suites/bench_int8.py --table-from "$IJSON" || echo "(could not render int8 table)"
    fi
    case "$CORPUS_RC" in
        skipped*) ;;
        *)
            CJSON=$(ls -t "$OUT"/corpus_*.json 2>/dev/null | head -n 1)
            if [ -n "$CJSON" ]; then
                echo
                echo "corpus results: $CJSON"
                python3 bench/suites/bench_corpus.py --table-from "$CJSON" || echo "(could not render corpus table)"
            else
                echo "corpus bench: no results JSON"
            fi
            ;;
    esac
    echo "elapsed: $(( $(date +%s) - T0 ))s"
} 2>&1 | tee "$OUT/summary.txt"
rm -f "$OUT/pytest-junit.xml"  # its counts are in summary.txt; keeps $OUT within 8 files

# exit non-zero if either step failed, so a caller can tell at a glance
[ "$PYTEST_RC" = "0" ] || [ "$PYTEST_RC" = "skipped" ] || exit 1
[ "$BENCH_RC" = "0" ] || [ "$BENCH_RC" = "skipped" ] || exit 1
[ "$SPLIT_RC" = "0" ] || [ "$SPLIT_RC" = "skipped" ] || exit 1
[ "$BACKWARD_RC" = "0" ] || [ "$BACKWARD_RC" = "skipped" ] || exit 1
[ "$INT8_RC" = "0" ] || [ "$INT8_RC" = "skipped" ] || exit 1
case "$CORPUS_RC" in 0|skipped*) ;; *) exit 1 ;; esac
exit 0
