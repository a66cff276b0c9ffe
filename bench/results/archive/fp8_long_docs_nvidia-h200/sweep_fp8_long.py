"""Probe: FP8 long documents (32-token query x 10,000 docs of 512-1,024 tokens): TMA or cp.async,
tokens and stages, against LIK's per-token FP8, alternating rounds in one process."""
import dataclasses, importlib, sys, json, os, statistics
from pathlib import Path
sys.path.insert(0, os.getcwd())
import cupy
import lik_cupy
from lik_cupy import _dispatch as dispatch
from bench.lib import baselines
from bench.lib.sweep import forced, sweep_setup, time_ms, write_sweep

out, props, rng = sweep_setup()
import torch
lik, _ = baselines.load(baselines.LIK)
f8 = importlib.import_module(lik.__name__ + ".fp8")
rows = []
for ld in (1024, 768, 512):
    lq, b = 32, 10_000
    q = rng.standard_normal((lq, 128), dtype=cupy.float32); q /= cupy.linalg.norm(q, axis=-1, keepdims=True)
    d = rng.standard_normal((b, ld, 128), dtype=cupy.float32); d /= cupy.linalg.norm(d, axis=-1, keepdims=True)
    q8, qs = lik_cupy.quantize_fp8(q); d8, ds = lik_cupy.quantize_fp8(d)
    tq, td = torch.as_tensor(q.astype(cupy.float16), device="cuda"), torch.as_tensor(d.astype(cupy.float16), device="cuda")
    del d
    lq8, lqs = f8.quantize_fp8_per_token(tq); ld8, lds = f8.quantize_fp8_per_token(td)
    del td
    base = dispatch.choose_forward(props.cc, "float8_e4m3fn", 128, lq, False, True, True, 1, ld, False, True)
    cands = {"dispatch": None, "lik": None}
    for tma in (False, True):
        for bn, st in ((64, 4), (64, 6), (128, 2), (128, 3), (128, 4), (256, 2), (256, 3)):
            if tma and bn + 4 > 256:
                continue
            cands[f"tma{int(tma)}_n{bn}s{st}"] = dataclasses.replace(base, bn=bn, stages=st, tma=tma)
    got = {k: [] for k in cands}
    fn = lambda: lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs)
    for rnd in range(3):
        for name, cfg in (cands.items() if rnd % 2 == 0 else reversed(list(cands.items()))):
            try:
                if name == "dispatch":
                    ms = time_ms(fn)
                elif name == "lik":
                    ms = time_ms(lambda: f8.maxsim_inference_fp8(lq8, ld8, scale_Q=lqs, scale_D=lds))
                else:
                    ms = forced(cfg, fn)
            except Exception as e:
                print(name, "failed", str(e)[:200], flush=True); ms = float("nan")
            got[name].append(ms)
    for name, v in got.items():
        m = statistics.median(v)
        rows.append({"ld": ld, "config": name if cands[name] is None else cands[name].name, "ms": m, "rounds": v})
        print(f"ld {ld} {name:16s} {m:.4f}  {[round(x,4) for x in v]}", flush=True)
    print("base:", base.name, flush=True)
    write_sweep(out, "sweep_fp8_long", props, rows)
