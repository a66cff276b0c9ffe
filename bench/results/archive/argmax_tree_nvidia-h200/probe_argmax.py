import json, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
import lik_cupy
from bench.lib.timing import queued_call_ms, wall_ms
torch.manual_seed(0)
cells = {"colpali": (0, 1024, 1024, 1000), "visual": (0, 512, 1024, 1000), "medium": (0, 128, 1024, 1000),
         "32q-1000": (32, 32, 180, 1000), "few-long-256": (0, 1024, 1024, 256)}
res = {}
for name, (nq, lq, ld, b) in cells.items():
    Q = torch.randn(*((nq,) if nq else ()), lq, 128, device="cuda"); Q /= Q.norm(dim=-1, keepdim=True)
    D = torch.randn(b, ld, 128, device="cuda"); D /= D.norm(dim=-1, keepdim=True)
    row = {}
    for prec in ("tf32", None):
        for am in (False, True):
            fn = lambda: lik_cupy.maxsim(Q, D, precision=prec, return_argmax=am)
            fn(); torch.cuda.synchronize()
            w = wall_ms(torch, fn, 20)
            k = queued_call_ms(torch, fn, 100, w)
            row[f"{prec or 'default'}{'_argmax' if am else ''}"] = round(k, 4)
    res[name] = row
    print(name, row, flush=True)
out = os.environ.get("OUT", ".")
json.dump({"gpu": torch.cuda.get_device_name(), "cells": res}, open(f"{out}/probe_argmax.json", "w"), indent=1)
