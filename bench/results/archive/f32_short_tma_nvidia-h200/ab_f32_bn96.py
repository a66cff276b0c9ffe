"""A/B of float32 (TF32) forward tiles, forced, interleaved rounds, device ms per call."""
import json, os, sys, time
from dataclasses import replace
sys.path.insert(0, os.getcwd())
import torch
import lik_cupy
from lik_cupy._dispatch import choose_forward
from bench.lib.forcing import forcing
from bench.lib.timing import per_call_ms

g = torch.Generator(device="cuda").manual_seed(0)
def unit(*s): return torch.nn.functional.normalize(torch.randn(*s, device="cuda", generator=g), dim=-1)
rows = []
def cell(name, nq, lq, nd, ld, argmax=False, packed=False, variants=(), precision="tf32", rounds=5):
    q, d = unit(nq, lq, 128), unit(nd, ld, 128)
    if packed:
        off = torch.arange(0, (nd + 1) * ld, ld, device="cuda", dtype=torch.int64); tok = d.reshape(-1, 128)
        call = lambda: lik_cupy.maxsim_varlen(q, tok, off, precision=precision, return_argmax=argmax)
    else:
        call = lambda: lik_cupy.maxsim(q, d, precision=precision, return_argmax=argmax)
    base = choose_forward(90, "float32", 128, lq, argmax, True, True, nq, ld, packed, True, precision == "fp32")
    cfgs = {"dispatch": base}
    for k, kw in variants: cfgs[k] = replace(base, **kw)
    ref = call(); ref = ref[0] if isinstance(ref, tuple) else ref
    T = {k: [] for k in cfgs}
    for r in range(rounds):
        for k in (list(cfgs) if r % 2 == 0 else list(cfgs)[::-1]):
            with forcing(cfgs[k]):
                out = call(); out = out[0] if isinstance(out, tuple) else out
                assert float((out - ref).abs().max()) == 0.0 or precision == "tf32", k
                T[k].append(per_call_ms(torch, call, 20, rounds=1, spin_cycles=20_000_000))
    res = {k: (cfgs[k].name, sorted(v)[len(v) // 2], min(v)) for k, v in T.items()}
    rows.append({"cell": name, "precision": precision, "argmax": argmax, "packed": packed, "results": res})
    print(name, precision, {k: "%s %.4f/%.4f" % (n[-28:], m, b) for k, (n, m, b) in res.items()}, flush=True)

bn = [("n96s2", dict(bn=96, stages=2)), ("n128s2", dict(bn=128, stages=2)), ("n64s3", dict(bn=64, stages=3))]
for lq in (80, 100, 128):
    for ld in (512, 1024, 2048):
        cell(f"1q{lq}x{1000 if ld < 2048 else 500}x{ld}", 1, lq, 1000 if ld < 2048 else 500, ld, variants=bn)
cell("1q128x1000x768", 1, 128, 1000, 768, variants=bn)
cell("1q128x10000x1024", 1, 128, 10000, 1024, variants=bn, rounds=3)
cell("1q128x1000x1024 packed", 1, 128, 1000, 1024, packed=True, variants=bn)
json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, open(os.path.join(os.environ.get("OUT", "."), "ab_f32_bn96.json"), "w"), indent=1)
