"""Two accumulator sets (LIK_PIPE): tile k+1's wgmma issued before tile k is folded, against the dispatched
tile. Kernel ms (queued behind a spin kernel), scores compared bitwise."""
import dataclasses, json, os, sys
sys.path.insert(0, '.')
import torch
import lik_cupy
from lik_cupy._dispatch.config import FwdConfig
from bench.lib.forcing import forcing, picked
from bench.lib.timing import per_call_ms

VARIANTS = {"pipe_n128s3": dict(pipe=True, bn=128, stages=3), "pipe_n128s4": dict(pipe=True, bn=128, stages=4),
            "pipe_n64s4": dict(pipe=True, bn=64, stages=4)}
g = torch.Generator(device='cuda').manual_seed(0)
def unit(*s):
    return torch.nn.functional.normalize(torch.randn(*s, device='cuda', generator=g), dim=-1)
CELLS = [("fp8", "colpali-1000", 1024, 1000, 1024), ("fp8", "colpali-10000", 1024, 10000, 1024),
         ("fp8", "visual", 512, 1000, 1024), ("fp8", "textual", 32, 10000, 300),
         ("fp16", "colpali-1000", 1024, 1000, 1024), ("bf16", "colpali-1000", 1024, 1000, 1024),
         ("fp16", "textual", 32, 10000, 300)]
rows = []
for dtype, cell, lq, nd, ld in CELLS:
    q, d = unit(lq, 128), unit(nd, ld, 128)
    if dtype == "fp8":
        q8, qs = lik_cupy.quantize_fp8(q)
        d8, ds = lik_cupy.quantize_fp8(d)
        f = lambda: lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs)
    else:
        dt = torch.float16 if dtype == "fp16" else torch.bfloat16
        qh, dh = q.to(dt), d.to(dt)
        f = lambda: lik_cupy.maxsim(qh, dh)
    base = picked(f)
    s0 = f().double()
    r = {"dtype": dtype, "cell": cell, "cfg": base.name, "dispatch": per_call_ms(torch, f, 20, spin_cycles=20_000_000)}
    for tag, kw in VARIANTS.items():
        v = dataclasses.replace(base, **kw)
        try:
            with forcing(v):
                s = f().double()
                r[tag] = per_call_ms(torch, f, 20, spin_cycles=20_000_000)
            r[tag + "_bitwise"] = bool(torch.equal(s, s0))
        except Exception as e:
            r[tag] = None
            r[tag + "_error"] = str(e)[-300:]
    rows.append(r)
    print(json.dumps(r), flush=True)
    del q, d, f
    torch.cuda.empty_cache()
json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows},
          open(os.path.join(os.environ.get("OUT", "/tmp"), "pipe_ab.json"), "w"), indent=1)
print(f"{'dtype':5s} {'cell':14s} {'dispatch':>9s} " + " ".join(f"{t:>12s}" for t in VARIANTS))
for r in rows:
    print(f"{r['dtype']:5s} {r['cell']:14s} {r['dispatch']:9.4f} " + " ".join(f"{r[t]:12.4f}" if r[t] else f"{'err':>12s}" for t in VARIANTS))
