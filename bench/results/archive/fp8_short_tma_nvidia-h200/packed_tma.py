"""Short single queries against packed documents: the dispatched cp.async tile against the same tile on TMA,
with padded documents beside them (both stagings)."""
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
def timed(label, fns, rounds=3, n=30):
    vs = {}
    for tag, (f, kw) in fns.items():
        base = picked(f)
        vs[tag] = (f, var(base, tag.replace(":", "_"), **kw) if kw else base)
    ref = {}
    for tag, (f, v) in vs.items():
        with forcing(v):
            ref[tag] = outs(f())
    same = {tag: all(torch.equal(x, y) for x, y in zip(ref[tag], ref[k])) for tag in vs for k in [tag.split(":")[0] + ":cpasync"] if k in ref}
    ms = {t: [] for t in vs}
    for _ in range(rounds):
        for tag, (f, v) in vs.items():
            with forcing(v):
                ms[tag].append(per_call_ms(torch, f, n, rounds=1, spin_cycles=20_000_000))
    row = {"cell": label, "ms": {t: sorted(x)[len(x) // 2] for t, x in ms.items()}, "cfg": {t: v.name for t, (f, v) in vs.items()}, "same_bits": same}
    rows.append(row)
    print(json.dumps(row), flush=True)

for nd, ld in ((1000, 300), (10000, 180), (1000, 1024)):
    q = unit(1, 32, 128); d = unit(nd, ld, 128)
    off = torch.arange(0, (nd + 1) * ld, ld, device='cuda')
    qh, dh = q.half(), d.half(); dth = dh.reshape(-1, 128)
    q8, qs = lik_cupy.quantize_fp8(q); d8, ds = lik_cupy.quantize_fp8(d)
    for am in (False, True):
        timed(f"fp16 1 q (32) x {nd} ({ld}) argmax={am}", {
            "padded:cpasync": (lambda: lik_cupy.maxsim(qh, dh, return_argmax=am), None),
            "padded:tma": (lambda: lik_cupy.maxsim(qh, dh, return_argmax=am), dict(tma=True)),
            "packed:cpasync": (lambda: lik_cupy.maxsim_varlen(qh, dth, off, return_argmax=am), None),
            "packed:tma": (lambda: lik_cupy.maxsim_varlen(qh, dth, off, return_argmax=am), dict(tma=True))})
        timed(f"fp8 1 q (32) x {nd} ({ld}) argmax={am}", {
            "padded:cpasync": (lambda: lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs, return_argmax=am), None),
            "padded:tma": (lambda: lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs, return_argmax=am), dict(tma=True)),
            "packed:cpasync": (lambda: lik_cupy.maxsim_fp8_varlen(q8, d8.reshape(-1, 128), ds.reshape(-1), off, q_scales=qs, return_argmax=am), None),
            "packed:tma": (lambda: lik_cupy.maxsim_fp8_varlen(q8, d8.reshape(-1, 128), ds.reshape(-1), off, q_scales=qs, return_argmax=am), dict(tma=True))})
    del d, dh, dth, d8, ds
    torch.cuda.empty_cache()
json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, open(os.path.join(os.environ.get("OUT", "/tmp"), "packed_tma.json"), "w"), indent=1)
for r in rows:
    print(f"{r['cell']:40s} " + " ".join(f"{t}={v:.4f}" for t, v in r["ms"].items()), r["same_bits"])
