"""FP8 / fp16 ColPali: the dispatched two-warpgroup tile against one-warpgroup tiles at more CTAs an SM."""
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
def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))
rows = []
def timed(label, f, variants, rounds=3, n=20):
    base = picked(f)
    ref = outs(f())
    vs = {"base": base} | {t: var(base, t, **kw) for t, kw in variants.items()}
    ms, eq = {t: [] for t in vs}, {}
    for t, v in list(vs.items()):
        try:
            with forcing(v):
                o = outs(f())
            eq[t] = same(ref, o) if t != "base" else True
            if not eq[t]:
                eq[t] = float(max((x.double() - y.double()).abs().max() for x, y in zip(ref, o) if x.dtype.is_floating_point))
        except Exception as e:
            print("skip", label, t, str(e)[-300:], flush=True)
            del vs[t], ms[t]
    for _ in range(rounds):
        for t, v in vs.items():
            with forcing(v):
                ms[t].append(per_call_ms(torch, f, n, rounds=1, spin_cycles=20_000_000))
    row = {"cell": label, "base": base.name, "ms": {t: sorted(x)[len(x) // 2] for t, x in ms.items()}, "same": eq}
    rows.append(row)
    print(json.dumps(row), flush=True)

W1 = {"w4c2": dict(warps=4), "w4c3": dict(warps=4, ctas=3), "w4c4": dict(warps=4, ctas=4),
      "w4n64s4c4": dict(warps=4, bn=64, stages=4, ctas=4), "w4s3c3": dict(warps=4, stages=3, ctas=3)}
qh = unit(1, 1024, 128).half(); dh = unit(1000, 1024, 128).half()
q8, qs = lik_cupy.quantize_fp8(qh); d8, ds = lik_cupy.quantize_fp8(dh)
timed("fp8 ColPali 1x1000", lambda: lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs), W1)
timed("f16 ColPali 1x1000", lambda: lik_cupy.maxsim(qh, dh), {"w4c2": dict(warps=4), "w4s3c2": dict(warps=4, stages=3)})
timed("fp8 ColPali 1x1000 argmax", lambda: lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs, return_argmax=True), {"w4c3": dict(warps=4, ctas=3), "w4c4": dict(warps=4, ctas=4)})
i8, iqs = lik_cupy.quantize_int8(qh); j8, jds = lik_cupy.quantize_int8(dh)
timed("int8 ColPali 1x1000", lambda: lik_cupy.maxsim_int8(i8, j8, jds, q_scales=iqs), {"qm": dict(tokm=False, stages=2), "qm_w4c4": dict(tokm=False, warps=4, stages=2, ctas=4)})
json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, open(os.path.join(os.environ.get("OUT", "/tmp"), "ab_wg1.json"), "w"), indent=1)
for r in rows:
    print(f"{r['cell']:28s} " + " ".join(f"{t}={v:.4f}" for t, v in r["ms"].items()), r["same"])
