"""The backward's dQ pass (lik_bwd_dq) built from BWD_FILE: in-batch training steps (GPU ms per step, queued
behind a spin kernel), the dQ kernel's own time (torch profiler), and the step's gradients saved for comparison."""
import collections, dataclasses, json, os, sys
sys.path.insert(0, '.')
import numpy as np
import torch
import lik_cupy._runtime.backward as B
B.BACKWARD = dataclasses.replace(B.BACKWARD, file=os.environ["BWD_FILE"])
import lik_cupy.torch as lt
from bench.lib.timing import per_call_ms
tag, rnd = os.environ["TAG"], os.environ["ROUND"]
out_dir = os.path.join(os.environ["OUT"], "bwd"); os.makedirs(out_dir, exist_ok=True)
CELLS = [("float32", None, 32, 32, 80), ("float32", "tf32", 32, 32, 80), ("float32", None, 64, 32, 300),
         ("float32", "tf32", 64, 32, 300), ("float16", None, 32, 32, 80), ("float16", None, 64, 32, 300),
         ("bfloat16", None, 128, 32, 180), ("float32", "tf32", 256, 32, 180), ("float16", None, 16, 1024, 1024)]
rows = []
for dt, prec, n, lq, ld in CELLS:
    g = torch.Generator(device='cuda').manual_seed(n * 7 + lq)
    dtype = getattr(torch, dt)
    q = torch.nn.functional.normalize(torch.randn(n, lq, 128, device='cuda', generator=g), dim=-1).to(dtype).requires_grad_(True)
    d = torch.nn.functional.normalize(torch.randn(n, ld, 128, device='cuda', generator=g), dim=-1).to(dtype).requires_grad_(True)
    labels = torch.arange(n, device='cuda')
    kw = {"precision": prec} if prec else {}
    def step():
        q.grad = d.grad = None
        torch.nn.functional.cross_entropy(lt.maxsim(q, d, **kw), labels).backward()
    for _ in range(5): step()
    torch.cuda.synchronize()
    name = f"{dt}{'-' + prec if prec else ''}-N{n}-{lq}x{ld}"
    np.save(os.path.join(out_dir, f"{tag}_{rnd}_{name}_dq.npy"), q.grad.float().cpu().numpy())
    np.save(os.path.join(out_dir, f"{tag}_{rnd}_{name}_dd.npy"), d.grad.float().cpu().numpy())
    gpu = per_call_ms(torch, step, 50, rounds=5, spin_cycles=300_000_000)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20): step()
        torch.cuda.synchronize()
    us = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            us[ev.name] += ev.device_time_total / 20
    r = {"tag": tag, "round": rnd, "cell": name, "step_gpu_ms": gpu, "dq_us": us.get("lik_bwd_dq"),
         "cast_us": us.get("lik_bwd_cast"), "step_busy_us": sum(us.values())}
    rows.append(r)
    print(json.dumps(r), flush=True)
json.dump(rows, open(os.path.join(out_dir, f"{tag}_{rnd}.json"), "w"), indent=1)
