"""FP8 short queries: the tile dispatch picks now (TMA; one-warpgroup argmax tiles at two CTAs an SM)
against the one it picked before (cp.async; those argmax tiles at one CTA), interleaved, bitwise compared."""
import json, os, sys
sys.path.append('.'); sys.path.append('bench/results/archive/wgmma_structure_probes_nvidia-h200')  # ab_var.py
import torch
import lik_cupy
from bench.lib.forcing import forcing, picked
from bench.lib.timing import per_call_ms
from ab_var import var

g = torch.Generator(device='cuda').manual_seed(0)
def unit(*s):
    return torch.nn.functional.normalize(torch.randn(*s, device='cuda', generator=g), dim=-1)
def outs(r):
    return [x.detach().clone() for x in (r if isinstance(r, tuple) else (r,))]
rows = []
def timed(label, f, q_len, rounds=3, n=30):
    now = picked(f)
    kw = {}
    if now.tma and q_len <= 128 and not now.multi:
        kw["tma"] = False
    if now.warps == 4 and now.argmax and (now.packed or now.multi or now.split):
        kw["ctas"] = 1
    vs = {"now": now, "before": var(now, "before", **kw) if kw else now}
    ref = outs(f())
    with forcing(vs["before"]):
        o = outs(f())
    same = all(torch.equal(x, y) for x, y in zip(ref, o))
    ms = {t: [] for t in vs}
    for _ in range(rounds):
        for t, v in vs.items():
            with forcing(v):
                ms[t].append(per_call_ms(torch, f, n, rounds=1, spin_cycles=20_000_000))
    row = {"cell": label, "ms": {t: sorted(x)[len(x) // 2] for t, x in ms.items()}, "all_ms": ms,
           "cfg": {t: v.name for t, v in vs.items()}, "changed": kw, "same_bits": same}
    rows.append(row)
    print(json.dumps(row), flush=True)

for nq, nd, ld in ((1, 1000, 300), (1, 10000, 180), (1, 1000, 1024), (2, 1000, 180)):
    q = unit(nq, 32, 128); d = unit(nd, ld, 128)
    off = torch.arange(0, (nd + 1) * ld, ld, device='cuda')
    q8, qs = lik_cupy.quantize_fp8(q); d8, ds = lik_cupy.quantize_fp8(d)
    for am in (False, True):
        timed(f"{nq} q (32) x {nd} ({ld}) padded argmax={am}",
              lambda: lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs, return_argmax=am), 32)
        timed(f"{nq} q (32) x {nd} ({ld}) packed argmax={am}",
              lambda: lik_cupy.maxsim_fp8_varlen(q8, d8.reshape(-1, 128), ds.reshape(-1), off, q_scales=qs, return_argmax=am), 32)
    del d, d8, ds
    torch.cuda.empty_cache()
json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, open(os.path.join(os.environ.get("OUT", "/tmp"), "fp8_short_tma.json"), "w"), indent=1)
for r in rows:
    print(f"{r['cell']:42s} now {r['ms']['now']:.4f} before {r['ms']['before']:.4f}  {r['changed']}  same {r['same_bits']}")
