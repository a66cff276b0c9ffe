"""ColPali 1 x 1000 (1024 x 1024, d 128) scores in fp16, FP8 and TF32: one warm-up call each, then one call each (profiled)."""
import sys
import torch, lik_cupy
g = torch.Generator(device='cuda').manual_seed(0)
unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, device='cuda', generator=g), dim=-1)
q, d = unit(1, 1024, 128), unit(1000, 1024, 128)
q16, d16 = q.half(), d.half()
q8, qs = lik_cupy.quantize_fp8(q); d8, ds = lik_cupy.quantize_fp8(d)
calls = {"fp16": lambda: lik_cupy.maxsim(q16, d16), "fp8": lambda: lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs),
         "tf32": lambda: lik_cupy.maxsim(q, d, precision="tf32")}
which = sys.argv[1:] or list(calls)
for k in which:
    calls[k]()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for k in which:
    calls[k]()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
