"""FP8 ColPali tile variants (per-warp slot release for scaled tiles, 64-token tiles at 3-4 CTAs per SM):
kernel ms against the dispatched tile and fp16, scores compared bitwise."""
import dataclasses, functools, json, os, sys, time
sys.path.insert(0, '.')
import torch
import lik_cupy
from lik_cupy._dispatch.config import FwdConfig
from bench.lib.forcing import forcing, picked
from bench.lib.timing import per_call_ms

@dataclasses.dataclass(frozen=True, kw_only=True)
class Var(FwdConfig):
    tag: str = ""
    rel: bool = False
    ctas: int = 0  # 0: as dispatch plans; else CTAs per SM (registers capped to fit)
    @functools.cached_property
    def name(self):
        return FwdConfig.name.func(self) + "_" + self.tag
    @property
    def wide_registers(self):
        return bool(self.ctas) or FwdConfig.wide_registers.fget(self)
    @functools.cached_property
    def min_blocks(self):
        return self.ctas or FwdConfig.min_blocks.func(self)
    def defines(self):
        d = FwdConfig.defines(self)
        if self.rel:
            d["LIK_SCALED_RELEASE"] = 1
        d["LIK_NAME"] = self.name
        return d

VARIANTS = {"rel": dict(rel=True), "rel_s3": dict(rel=True, stages=3), "n64_c3": dict(bn=64, ctas=3),
            "n64_c4": dict(bn=64, ctas=4), "n64s3_c3_rel": dict(bn=64, stages=3, ctas=3, rel=True),
            "n64s3_c4_rel": dict(bn=64, stages=3, ctas=4, rel=True), "n64_c4_rel": dict(bn=64, ctas=4, rel=True)}
g = torch.Generator(device='cuda').manual_seed(0)
def unit(*s):
    return torch.nn.functional.normalize(torch.randn(*s, device='cuda', generator=g), dim=-1)
CELLS = {"colpali-1000": (1024, 1000, 1024), "colpali-10000": (1024, 10000, 1024), "visual": (512, 1000, 1024)}
rows = []
for cell, (lq, nd, ld) in CELLS.items():
    q, d = unit(lq, 128), unit(nd, ld, 128)
    q8, qs = lik_cupy.quantize_fp8(q)
    d8, ds = lik_cupy.quantize_fp8(d)
    f = lambda: lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs)
    base = picked(f)
    s0 = f().double()
    r = {"cell": cell, "cfg": base.name, "fp8": per_call_ms(torch, f, 20, spin_cycles=20_000_000)}
    qh, dh = q.half(), d.half()
    r["fp16"] = per_call_ms(torch, lambda: lik_cupy.maxsim(qh, dh), 20, spin_cycles=20_000_000)
    del qh, dh
    for tag, kw in VARIANTS.items():
        v = Var(**{k: getattr(base, k) for k in FwdConfig.__dataclass_fields__} | kw, tag=tag)
        try:
            with forcing(v):
                s = f().double()
                r[tag] = per_call_ms(torch, f, 20, spin_cycles=20_000_000)
            r[tag + "_diff"] = float((s - s0).abs().max())
        except Exception as e:
            r[tag] = None
            r[tag + "_error"] = str(e)[-300:]
    rows.append(r)
    print(json.dumps(r), flush=True)
    del q, d, q8, d8, ds
    torch.cuda.empty_cache()
json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows},
          open(os.path.join(os.environ.get("OUT", "/tmp"), "ab_fp8.json"), "w"), indent=1)
print(f"{'cell':14s} {'fp16':>7s} {'fp8':>7s} " + " ".join(f"{t:>12s}" for t in VARIANTS))
for r in rows:
    print(f"{r['cell']:14s} {r['fp16']:.4f} {r['fp8']:.4f} " + " ".join(f"{r[t]:12.4f}" if r[t] else f"{'err':>12s}" for t in VARIANTS))
