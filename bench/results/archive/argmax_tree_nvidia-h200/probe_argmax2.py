import json, os, sys
sys.path.insert(0, os.getcwd())
import torch
import lik_cupy
from bench.lib.timing import queued_call_ms, wall_ms
torch.manual_seed(0)
res = {}
def t(name, fn):
    fn(); torch.cuda.synchronize()
    w = wall_ms(torch, fn, 10)
    res[name] = round(queued_call_ms(torch, fn, 60, w), 4)
    print(name, res[name], flush=True)
for dt in (torch.float16, torch.float32):
    tag = "fp16" if dt == torch.float16 else "tf32"
    prec = "tf32" if dt == torch.float32 else None
    Q = torch.randn(1024, 128, device="cuda"); Q /= Q.norm(dim=-1, keepdim=True)
    D = torch.randn(1000, 1024, 128, device="cuda"); D /= D.norm(dim=-1, keepdim=True)
    Q, D = Q.to(dt), D.to(dt)
    t(f"{tag}_colpali", lambda: lik_cupy.maxsim(Q, D, precision=prec))
    t(f"{tag}_colpali_argmax", lambda: lik_cupy.maxsim(Q, D, precision=prec, return_argmax=True))
    Qb = torch.randn(64, 1024, 128, device="cuda").to(dt); Db = torch.randn(64, 1024, 128, device="cuda").to(dt)
    t(f"{tag}_train64_fwd", lambda: lik_cupy.maxsim(Qb, Db, precision=prec))
    t(f"{tag}_train64_fwd_argmax", lambda: lik_cupy.maxsim(Qb, Db, precision=prec, return_argmax=True))
    s, a = lik_cupy.maxsim(Qb, Db, precision=prec, return_argmax=True)
    g = torch.randn_like(s)
    t(f"{tag}_train64_bwd", lambda: lik_cupy.maxsim_backward(g, Qb, Db, a))
    Q32 = torch.randn(32, 32, 128, device="cuda").to(dt); D32 = torch.randn(1000, 180, 128, device="cuda").to(dt)
    t(f"{tag}_32q", lambda: lik_cupy.maxsim(Q32, D32, precision=prec))
    t(f"{tag}_32q_argmax", lambda: lik_cupy.maxsim(Q32, D32, precision=prec, return_argmax=True))
out = os.environ.get("OUT", ".")
json.dump({"gpu": torch.cuda.get_device_name(), "ms": res}, open(f"{out}/probe_argmax2.json", "w"), indent=1)
