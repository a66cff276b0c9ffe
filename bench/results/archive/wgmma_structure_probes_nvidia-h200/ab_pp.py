"""Warpgroup ping-pong A/B: kernel ms of the dispatched tile against the same tile with the two warpgroups
taking turns on the tensor cores (LIK_PINGPONG), and stage/CTA variants; outputs compared bitwise."""
import dataclasses, functools, json, os, sys, time
sys.path.append('.')
import torch
import lik_cupy
from lik_cupy._dispatch.config import FwdConfig
from bench.lib.forcing import forcing, picked
from bench.lib.timing import per_call_ms

sys.path.append('bench/results/archive/wgmma_structure_probes_nvidia-h200')  # ab_var.py
from ab_var import Var, var

g = torch.Generator(device='cuda').manual_seed(0)
def unit(*s):
    return torch.nn.functional.normalize(torch.randn(*s, device='cuda', generator=g), dim=-1)

def outs(r):
    return [x.detach().clone() for x in (r if isinstance(r, tuple) else (r,))]

def same(a, b):
    return all(torch.equal(x, y) or (x.dtype.is_floating_point and torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))) for x, y in zip(a, b))

V16 = {"wgq": dict(wgq=True)}
VA = {"wgq": dict(wgq=True), "wgq_c1": dict(wgq=True, ctas=1), "c1": dict(ctas=1)}
V8 = {"wgq": dict(wgq=True)}
V32 = {"wgq": dict(wgq=True)}

report = {"gpu": torch.cuda.get_device_name(), "correct": [], "timed": []}

# Correctness first: awkward shapes, every variant bitwise against the dispatched tile.
def check(label, f, variants):
    base = picked(f)
    ref = outs(f())
    for tag, kw in variants.items():
        v = var(base, tag, **kw)
        try:
            with forcing(v):
                o = outs(f())
            torch.cuda.synchronize()
            ok = same(ref, o)
        except Exception as e:
            ok = "error: " + str(e)[-400:]
        report["correct"].append({"case": label, "base": base.name, "var": tag, "same": ok})
        print("check", label, base.name, tag, ok, flush=True)

if not os.environ.get('SKIP_CHECKS'):
    lens = torch.randint(0, 334, (37,), generator=torch.Generator().manual_seed(1)); lens[3] = 0; lens[5] = 333
    for dt, name, prec, vs in ((torch.float16, "f16", None, V16), (torch.float32, "tf32", "tf32", V32)):
        Q = unit(3, 100, 128).to(dt); D = unit(37, 333, 128).to(dt)
        D[4, 7] = D[4, 9]  # exact tie inside a document
        dl = lens.cuda()
        check(f"{name} padded 3x100 / 37x333 lengths, argmax",
              lambda: lik_cupy.maxsim(Q, D, d_lengths=dl, return_argmax=True, precision=prec), vs)
        check(f"{name} padded scores", lambda: lik_cupy.maxsim(Q, D, d_lengths=dl, precision=prec), vs)
        off = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).cuda()
        T = int(off[-1]); Dt = unit(T, 128).to(dt)
        check(f"{name} packed argmax", lambda: lik_cupy.maxsim_varlen(Q, Dt, off, return_argmax=True, precision=prec), vs)
        Q1 = unit(1, 1024, 128).to(dt); Dp = unit(3, 1500, 128).to(dt)
        offp = torch.tensor([0, 1500, 3000, 4500], device='cuda')
        check(f"{name} few long packed (token split)", lambda: lik_cupy.maxsim_varlen(Q1, Dp.reshape(-1, 128), offp, return_argmax=True, precision=prec), vs)
    q = unit(3, 100, 128); d = unit(37, 333, 128)
    q8, qs = lik_cupy.quantize_fp8(q); d8, ds = lik_cupy.quantize_fp8(d)
    check("fp8 padded", lambda: lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs), V8)
    check("fp8 padded argmax", lambda: lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs, return_argmax=True), V8)
    i8, iqs = lik_cupy.quantize_int8(q); j8, jds = lik_cupy.quantize_int8(d)
    check("int8 padded", lambda: lik_cupy.maxsim_int8(i8, j8, jds, q_scales=iqs), V8)
    check("int8 padded argmax", lambda: lik_cupy.maxsim_int8(i8, j8, jds, q_scales=iqs, return_argmax=True), V8)

# Timing: variants interleaved over rounds, median of the rounds.
def timed(label, f, variants, rounds=3, n=20):
    base = picked(f)
    ref = outs(f())
    vs = {"base": base} | {t: var(base, t, **kw) for t, kw in variants.items()}
    ms = {t: [] for t in vs}
    eq = {}
    for t, v in list(vs.items()):
        try:
            with forcing(v):
                eq[t] = same(ref, outs(f()))
        except Exception as e:
            print("skip", label, t, str(e)[-300:], flush=True)
            del vs[t], ms[t]
    for _ in range(rounds):
        for t, v in vs.items():
            with forcing(v):
                ms[t].append(per_call_ms(torch, f, n, rounds=1, spin_cycles=20_000_000))
    row = {"cell": label, "base": base.name, "ms": {t: sorted(x)[len(x) // 2] for t, x in ms.items()}, "all_ms": ms, "same": eq}
    report["timed"].append(row)
    print("timed", json.dumps(row), flush=True)

qh = unit(1, 1024, 128).half(); dh = unit(1000, 1024, 128).half()
timed("f16 ColPali 1x1000", lambda: lik_cupy.maxsim(qh, dh), V16)
timed("f16 ColPali 1x1000 argmax", lambda: lik_cupy.maxsim(qh, dh, return_argmax=True), VA)
i8, iqs = lik_cupy.quantize_int8(qh); j8, jds = lik_cupy.quantize_int8(dh)
timed("int8 ColPali 1x1000", lambda: lik_cupy.maxsim_int8(i8, j8, jds, q_scales=iqs), {"qm": dict(tokm=False), "qm_wgq": dict(tokm=False, wgq=True)})
del j8, jds
q8, qs = lik_cupy.quantize_fp8(qh.float()); d8, ds = lik_cupy.quantize_fp8(dh.float())
timed("fp8 ColPali 1x1000", lambda: lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs), V8)
del dh, d8, ds
torch.cuda.empty_cache()
qf = unit(1, 1024, 128); df = unit(1000, 1024, 128)
timed("tf32 ColPali 1x1000", lambda: lik_cupy.maxsim(qf, df, precision="tf32"), V32)
timed("tf32 ColPali 1x1000 argmax", lambda: lik_cupy.maxsim(qf, df, precision="tf32", return_argmax=True), V32)
qs32 = unit(32, 32, 128).half(); ds32 = unit(1000, 180, 128).half()
timed("f16 32q x 1000 (180)", lambda: lik_cupy.maxsim(qs32, ds32), V16)
del df
torch.cuda.empty_cache()
d = unit(10000, 1024, 128, ).half()
d8, ds = lik_cupy.quantize_fp8(d)
timed("f16 ColPali 1x10000", lambda: lik_cupy.maxsim(qh, d), V16, n=5)
timed("fp8 ColPali 1x10000", lambda: lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs), V8, n=5)

json.dump(report, open(os.path.join(os.environ.get("OUT", "/tmp"), "ab_wgq.json"), "w"), indent=1)
print(f"{'cell':28s} " + " ".join(f"{t:>10s}" for t in ["base", "wgq", "wgq_c1", "c1"]))
for r in report["timed"]:
    print(f"{r['cell']:28s} " + " ".join(f"{r['ms'][t]:10.4f}" if t in r['ms'] else f"{'':>10s}" for t in ["base", "wgq", "wgq_c1", "c1"]))
bad = [c for c in report["correct"] if c["same"] is not True] + [r for r in report["timed"] if not all(v is True for v in r["same"].values())]
print("mismatches:", len(bad))
