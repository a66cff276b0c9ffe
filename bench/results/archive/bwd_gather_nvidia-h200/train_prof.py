"""float32 in-batch training steps: GPU ms per step (queued behind a spin kernel) and the kernels each step runs."""
import json, os, sys, collections
sys.path.insert(0, '.'); sys.path.insert(0, '/tmp/site')
import torch
import lik_cupy.torch as lt
from bench.lib.timing import per_call_ms
mods = {}
try:
    import late_interaction_kernels as lik; mods["lik"] = lik
except Exception as e: print("no lik", e)
try:
    import flash_maxsim as fm; mods["flash"] = fm
except Exception as e: print("no flash", e)
g = torch.Generator(device='cuda').manual_seed(0)
def unit(*s): return torch.nn.functional.normalize(torch.randn(*s, device='cuda', generator=g), dim=-1)
out = {"gpu": torch.cuda.get_device_name(), "cells": []}
for n, lq, ld in [(32, 32, 80), (64, 32, 300)]:
    q0, d0 = unit(n, lq, 128), unit(n, ld, 128)
    labels = torch.arange(n, device='cuda')
    scorers = {"ours_default": lambda q, d: lt.maxsim(q, d), "ours_tf32": lambda q, d: lt.maxsim(q, d, precision="tf32")}
    if "lik" in mods: scorers["lik_f32"] = lambda q, d: mods["lik"].maxsim(q, d)
    if "flash" in mods: scorers["flash_f32"] = lambda q, d: mods["flash"].flash_maxsim_batched_train(q, d, shared_docs=True)
    s_only = torch.randn(n, n, device='cuda', requires_grad=True)
    def ce_only():
        s_only.grad = None
        torch.nn.functional.cross_entropy(s_only, labels).backward()
    steps = {"ce_only": ce_only}
    for k, f in scorers.items():
        q, d = q0.clone().requires_grad_(True), d0.clone().requires_grad_(True)
        def step(f=f, q=q, d=d):
            q.grad = d.grad = None
            s = f(q, d)
            torch.nn.functional.cross_entropy(s, labels).backward()
        steps[k] = step
    for k, st in steps.items():
        for _ in range(5): st()
        torch.cuda.synchronize()
        gpu = per_call_ms(torch, st, 50, rounds=5, spin_cycles=200_000_000)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20): st()
            torch.cuda.synchronize()
        kern = collections.defaultdict(lambda: [0, 0.0])
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                kern[ev.name][0] += 1; kern[ev.name][1] += ev.device_time_total if hasattr(ev, 'device_time_total') else ev.cuda_time_total
        kl = sorted(((nm, c / 20, t / 20) for nm, (c, t) in kern.items()), key=lambda x: -x[2])
        r = {"n": n, "lq": lq, "ld": ld, "who": k, "gpu_ms": gpu, "kernels": kl}
        out["cells"].append(r)
        print(f"N={n} {k:13s} gpu {gpu:.4f} ms  launches/step {sum(c for _, c, _ in kl):.1f}  busy {sum(t for *_, t in kl):.1f} us", flush=True)
        for nm, c, t in kl: print(f"     {c:4.1f} x {t:7.2f} us  {nm[:110]}")
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "train_prof.json"), "w"), indent=1)
