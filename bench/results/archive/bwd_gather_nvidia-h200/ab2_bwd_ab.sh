set -e
mkdir -p $OUT; cp .scratch/bwd_ab.py .scratch/bwd_ab.sh $OUT/
for r in 1 2; do
  for v in old g2 g4; do
    f=maxsim_bwd_$v.cu; 
    BWD_FILE=$f TAG=$v ROUND=$r python .scratch/bwd_ab.py 2>&1 | grep -v -i warn > $OUT/log_${v}_$r.txt || { echo "FAIL $v"; tail -20 $OUT/log_${v}_$r.txt; }
  done
done
rm -f $OUT/bwd/*.npy.x; python - <<'PY'
import json, glob, os, numpy as np, collections
o = os.environ["OUT"] + "/bwd"
rows = [r for f in sorted(glob.glob(o + "/*_?.json")) for r in json.load(open(f))]
by = collections.defaultdict(dict)
for r in rows: by[r["cell"]].setdefault(r["tag"], []).append(r)
print(f"{'cell':34s} " + " ".join(f"{t:>17s}" for t in ("old", "g2", "g4")) + "   (step ms / dq us, best of rounds)  dQ bitwise, dD maxdiff vs old")
for cell, t in by.items():
    cols = []
    for tg in ("old", "g2", "g4"):
        rr = t.get(tg, [])
        cols.append(f"{min(x['step_gpu_ms'] for x in rr):.4f}/{min(x['dq_us'] or 0 for x in rr):6.2f}" if rr else "-")
    eq = []
    a = np.load(f"{o}/old_1_{cell}_dq.npy"); ad = np.load(f"{o}/old_1_{cell}_dd.npy")
    for tg in ("g2", "g4"):
        p = f"{o}/{tg}_1_{cell}_dq.npy"
        if os.path.exists(p):
            b = np.load(p); bd = np.load(f"{o}/{tg}_1_{cell}_dd.npy")
            eq.append(f"{tg}:{np.array_equal(a, b, equal_nan=True)},{np.abs(ad - bd).max():.1e}")
    print(f"{cell:34s} " + " ".join(f"{c:>17s}" for c in cols) + "  " + " ".join(eq))
PY
rm -f $OUT/bwd/*.npy
