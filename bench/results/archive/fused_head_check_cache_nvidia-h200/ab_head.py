"""A/B of the fused head's torch path, old tree against this one: one process per (tree, round), alternating."""
import json, os, subprocess, sys
CHILD = r'''
import sys, json
sys.path.insert(0, "bench/suites")
import torch
import bench_fused_head as B
from bench.lib.timing import wall_ms, per_call_ms
import lik_cupy, os
assert os.path.realpath(lik_cupy.__file__).startswith(os.path.realpath(sys.argv[1])), lik_cupy.__file__
shapes = {"hidden": 768, "dim": 128, "lq": 32, "ld": 300}
cont = B._contenders(torch, None)
out = {}
for cell in ("train32", "train64"):
    nq, nd, train = B.CELLS[cell]
    leaves = B._inputs(torch, nq, nd, torch.bfloat16, train, "cuda", shapes)
    for who in ("ours", "unfused"):
        step = B._step(torch, cont[who], leaves, train)
        for _ in range(10): step()
        torch.cuda.synchronize()
        out[f"{cell}/{who}"] = wall_ms(torch, step, 100, rounds=5)
    s = B._step(torch, cont["ours"], leaves, train)()
    out[f"{cell}/check"] = float(s.float().sum())
print("RESULT", json.dumps(out))
'''
res = {"old": [], "new": []}
root = os.getcwd()
trees = {"old": os.path.join(root, ".scratch/s17/old"), "new": root}
for r in range(8):
    for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
        env = {**os.environ, "PYTHONPATH": trees[name] + os.pathsep + os.environ.get("PYTHONPATH", "")}
        p = subprocess.run([sys.executable, "-c", CHILD, trees[name]], capture_output=True, text=True, env=env, cwd=trees[name])
        line = [l for l in p.stdout.splitlines() if l.startswith("RESULT")]
        if not line:
            print(name, "failed", p.stderr[-2000:]); continue
        res[name].append(json.loads(line[0][7:]))
        print(name, r, res[name][-1], flush=True)
import statistics
summary = {}
for k in res["new"][0]:
    if k.endswith("check"): continue
    o = statistics.median(x[k] for x in res["old"]); n = statistics.median(x[k] for x in res["new"])
    summary[k] = {"old_ms": o, "new_ms": n, "new_over_old": n / o}
    print(f"{k:16s} old {o:.4f} new {n:.4f} ms  new/old {n/o:.3f}")
os.makedirs(os.environ["OUT"], exist_ok=True)
json.dump({"gpu": subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip(),
           "rounds": res, "summary": summary}, open(os.path.join(os.environ["OUT"], "ab_head_host.json"), "w"), indent=1)
