"""FP8 (and fp16 for scale) queries-on-M tiles at ring depths 2-5, forced, interleaved rounds, bitwise compared."""
import dataclasses, json, os, sys
sys.path.append('.')
import torch
import lik_cupy
from bench.lib.forcing import forcing, picked
from bench.lib.timing import per_call_ms

g = torch.Generator(device='cuda').manual_seed(0)
def unit(*s):
    return torch.nn.functional.normalize(torch.randn(*s, device='cuda', generator=g), dim=-1)
def outs(r):
    return [x.detach().clone() for x in (r if isinstance(r, tuple) else (r,))]
rows = []
def timed(label, f, stages, rounds=3, n=20):
    base = picked(f)
    vs = {s: dataclasses.replace(base, stages=s) for s in stages}
    ref = outs(f())
    same = {}
    for s, v in vs.items():
        with forcing(v):
            same[s] = all(torch.equal(x, y) for x, y in zip(ref, outs(f())))
    ms = {s: [] for s in vs}
    for _ in range(rounds):
        for s, v in vs.items():
            with forcing(v):
                ms[s].append(per_call_ms(torch, f, n, rounds=1, spin_cycles=20_000_000))
    row = {"cell": label, "base": base.name, "ms": {s: sorted(x)[len(x) // 2] for s, x in ms.items()},
           "all_ms": ms, "same_bits": same, "min_blocks": {s: v.min_blocks for s, v in vs.items()}}
    rows.append(row)
    print(label, base.name, " ".join(f"s{s}={m:.4f}{'' if same[s] else '!'}" for s, m in row["ms"].items()), flush=True)

for lq, nd, ld, packed, am in ((1024, 1000, 1024, False, False), (1024, 1000, 1024, False, True), (1024, 1000, 1024, True, False),
                               (512, 2000, 512, False, False), (256, 4000, 256, False, False)):
    q, d = unit(1, lq, 128), unit(nd, ld, 128)
    q8, qs = lik_cupy.quantize_fp8(q); d8, ds = lik_cupy.quantize_fp8(d)
    if packed:
        off = torch.arange(0, (nd + 1) * ld, ld, device='cuda')
        f = lambda: lik_cupy.maxsim_fp8_varlen(q8, d8.reshape(-1, 128), ds.reshape(-1), off, q_scales=qs, return_argmax=am)
    else:
        f = lambda: lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs, return_argmax=am)
    timed(f"fp8 {lq} x {nd} ({ld}){' packed' if packed else ''}{' argmax' if am else ''}", f, (2, 3, 4, 5))
    if not packed and not am and lq == 1024:
        q16, d16 = q.half(), d.half()
        timed(f"fp16 {lq} x {nd} ({ld})", lambda: lik_cupy.maxsim(q16, d16), (2, 3))
    del d, d8, ds
    torch.cuda.empty_cache()
json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, open(os.path.join(os.environ.get("OUT", "/tmp"), "fp8_stages.json"), "w"), indent=1)
