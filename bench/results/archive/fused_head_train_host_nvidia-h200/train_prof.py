import cProfile, io, json, os, pstats, statistics, sys, time
import torch
sys.path.insert(0, os.getcwd())
from bench.suites import bench_fused_head as b
import late_interaction_kernels as lik
cont = b._contenders(torch, lik)
shapes = {"hidden": 768, "dim": 128, "lq": 32, "ld": 300}
out = {}
for cell, n in (("train32", 32), ("train64", 64)):
    leaves = b._inputs(torch, n, n, torch.bfloat16, True, "cuda", shapes)
    steps = {w: b._step(torch, cont[w], leaves, True) for w in ("ours", "lik", "unfused")}
    for s in steps.values():
        for _ in range(5): s()
    torch.cuda.synchronize()
    res = {w: [] for w in steps}
    for r in range(7):
        for w in list(steps)[r % 3:] + list(steps)[:r % 3]:
            t = time.perf_counter()
            for _ in range(50): steps[w]()
            torch.cuda.synchronize()
            res[w].append((time.perf_counter() - t) / 50 * 1e3)
    out[cell] = {w: statistics.median(v) for w, v in res.items()}
    print(cell, {w: round(v, 3) for w, v in out[cell].items()}, "ours/lik", round(out[cell]["ours"] / out[cell]["lik"], 3), flush=True)
leaves = b._inputs(torch, 32, 32, torch.bfloat16, True, "cuda", shapes)
step = b._step(torch, cont["ours"], leaves, True)
for _ in range(5): step()
torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(200): step()
torch.cuda.synchronize(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(45)
s2 = io.StringIO(); pstats.Stats(pr, stream=s2).sort_stats("cumulative").print_stats(60)
o = os.environ.get("OUT", "/tmp")
open(f"{o}/train32_cprofile.txt", "w").write(s.getvalue() + s2.getvalue())
json.dump(out, open(f"{o}/train_steps.json", "w"), indent=1)
print(s.getvalue()[:7000])
