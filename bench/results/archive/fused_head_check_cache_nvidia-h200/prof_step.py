"""cProfile of the fused head's train32 step (ours), and wall per step for ours / unfused / LIK."""
import sys, json, os, cProfile, pstats, io
sys.path.insert(0, "bench/suites"); sys.path.insert(0, ".")
import torch
import bench_fused_head as B
from bench.lib.timing import wall_ms
shapes = {"hidden": 768, "dim": 128, "lq": 32, "ld": 300}
from bench.lib import baselines
lik, err = baselines.load(baselines.LIK)
print("lik", err)
cont = B._contenders(torch, lik)
print("contenders", list(cont))
out = {}
for cell in ("train32", "train64"):
    nq, nd, train = B.CELLS[cell]
    leaves = B._inputs(torch, nq, nd, torch.bfloat16, train, "cuda", shapes)
    for who in [w for w in cont if w != "floor"]:
        step = B._step(torch, cont[who], leaves, train)
        for _ in range(10): step()
        torch.cuda.synchronize()
        out[f"{cell}/{who}"] = wall_ms(torch, step, 100, rounds=5)
        print(cell, who, round(out[f"{cell}/{who}"], 4), flush=True)
nq, nd, train = B.CELLS["train32"]
leaves = B._inputs(torch, nq, nd, torch.bfloat16, train, "cuda", shapes)
step = B._step(torch, cont["ours"], leaves, train)
for _ in range(20): step()
torch.cuda.synchronize()
pr = cProfile.Profile()
pr.enable()
for _ in range(300): step()
torch.cuda.synchronize()
pr.disable()
s = io.StringIO()
st = pstats.Stats(pr, stream=s)
st.sort_stats("tottime").print_stats(45)
st.sort_stats("cumtime").print_stats(45)
print(s.getvalue())
