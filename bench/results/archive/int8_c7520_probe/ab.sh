# The branch's INT8 tiles against main's, three alternating rounds a tree, in one device call:
#   here:    mkdir -p .scratch/main_tree && git archive main cuda_src lik_cupy | tar -x -C .scratch/main_tree
#   device:  bash bench/results/archive/int8_c7520_probe/ab.sh   (carry .scratch; OUT set; wheels in /tmp/site)
set -u
[ -d .scratch/main_tree/lik_cupy ] || { echo "main's tree is not in .scratch/main_tree (see above)" >&2; exit 1; }
for r in 1 2 3; do
  for tree in .scratch/main_tree "$PWD"; do
    BENCH_ROOT=$PWD PYTHONPATH=/tmp/site:$tree timeout 120 python3 bench/results/archive/int8_c7520_probe/cells.py \
      "$(basename "$tree")" | tail -1 >> "$OUT/int8_c7520_ab.jsonl"
  done
done
python3 - "$OUT/int8_c7520_ab.jsonl" <<'PY'
import json, sys, statistics
runs = [json.loads(l) for l in open(sys.argv[1])]
trees = sorted({r["tree"] for r in runs})
for i, c in enumerate(runs[0]["cells"]):
    ms = {t: statistics.median(r["cells"][i]["ms"] for r in runs if r["tree"] == t) for t in trees}
    dig = {t: {r["cells"][i]["digest"] for r in runs if r["tree"] == t} for t in trees}
    print(f"{c['cell']:34s}", " ".join(f"{t}={v:.4f}" for t, v in ms.items()), "same" if len(set.union(*dig.values())) == 1 else "DIFFER")
PY
