"""Packed documents that the plan does not split over CTAs: the dispatched tile (compiled with the token
split's piece handling, TSPLIT) against the same tile built without it (LIK_NO_TSPLIT), padded beside
them; kernel ms, interleaved rounds, outputs compared bitwise. Not yet run (branch s10-packed-tsplit)."""
import dataclasses, functools, json, os, sys
sys.path.append('.')
import torch
import lik_cupy
from lik_cupy._dispatch.config import FwdConfig
from bench.lib.forcing import forcing, picked
from bench.lib.timing import per_call_ms


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoSplit(FwdConfig):
    @functools.cached_property
    def name(self):
        return FwdConfig.name.func(self) + "_nots"

    @property
    def token_split(self):
        return False

    def defines(self):
        return FwdConfig.defines(self) | {"LIK_NO_TSPLIT": 1, "LIK_NAME": self.name}


g = torch.Generator(device='cuda').manual_seed(0)
def unit(*s):
    return torch.nn.functional.normalize(torch.randn(*s, device='cuda', generator=g), dim=-1)
def outs(r):
    return [x.detach().clone() for x in (r if isinstance(r, tuple) else (r,))]
rows = []
def timed(label, fpad, fpack, rounds=3, n=30):
    base = picked(fpack)
    nots = NoSplit(**{k: getattr(base, k) for k in FwdConfig.__dataclass_fields__})
    ref = outs(fpack())
    with forcing(nots):
        same = all(torch.equal(x, y) for x, y in zip(ref, outs(fpack())))
    ms = {"padded": [], "packed": [], "packed_no_tsplit": []}
    for _ in range(rounds):
        ms["padded"].append(per_call_ms(torch, fpad, n, rounds=1, spin_cycles=20_000_000))
        ms["packed"].append(per_call_ms(torch, fpack, n, rounds=1, spin_cycles=20_000_000))
        with forcing(nots):
            ms["packed_no_tsplit"].append(per_call_ms(torch, fpack, n, rounds=1, spin_cycles=20_000_000))
    row = {"cell": label, "cfg": base.name, "ms": {t: sorted(x)[1] for t, x in ms.items()}, "all_ms": ms, "same_bits": same}
    rows.append(row)
    print(json.dumps(row), flush=True)

for lq, nd, ld in ((32, 1000, 300), (32, 10000, 180), (1024, 1000, 1024)):
    q, d = unit(1, lq, 128), unit(nd, ld, 128)
    off = torch.arange(0, (nd + 1) * ld, ld, device='cuda')
    for name, dt, prec in (("fp16", torch.float16, None), ("tf32", torch.float32, "tf32")):
        qq, dd = q.to(dt), d.to(dt)
        timed(f"{name} {lq} x {nd} ({ld})", lambda: lik_cupy.maxsim(qq, dd, precision=prec),
              lambda: lik_cupy.maxsim_varlen(qq, dd.reshape(-1, 128), off, precision=prec))
    q8, qs = lik_cupy.quantize_fp8(q); d8, ds = lik_cupy.quantize_fp8(d)
    timed(f"fp8 {lq} x {nd} ({ld})", lambda: lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs),
          lambda: lik_cupy.maxsim_fp8_varlen(q8, d8.reshape(-1, 128), ds.reshape(-1), off, q_scales=qs))
    del d, dd, d8, ds
    torch.cuda.empty_cache()
json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows},
          open(os.path.join(os.environ.get("OUT", "/tmp"), "packed_tsplit.json"), "w"), indent=1)
for r in rows:
    print(f"{r['cell']:28s} " + " ".join(f"{t}={v:.4f}" for t, v in r["ms"].items()), r["same_bits"])
