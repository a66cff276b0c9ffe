"""Packed documents whose offsets are j * Ld: the dispatched packed tile against the same tile with every
offset computed (LIK_PROBE_STRIDE) and with only the per-document ones computed (the start's work-share
search still reads them), padded beside them; kernel ms, interleaved rounds, outputs compared bitwise."""
import dataclasses, functools, json, os, sys
sys.path.append(os.environ["BENCH_ROOT"])
import torch
import lik_cupy
from lik_cupy._dispatch.config import FwdConfig
from bench.lib.forcing import forcing, picked
from bench.lib.timing import per_call_ms


def probe(base, stride, docs_only):
    tag = "_pd" if docs_only else "_pa"

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Probe(FwdConfig):
        @functools.cached_property
        def name(self):
            return FwdConfig.name.func(self) + tag

        def defines(self):
            return FwdConfig.defines(self) | {"LIK_PROBE_STRIDE": stride, "LIK_PROBE_DOCS_ONLY": int(docs_only),
                                              "LIK_NAME": self.name}
    return Probe(**{k: getattr(base, k) for k in FwdConfig.__dataclass_fields__})


g = torch.Generator(device='cuda').manual_seed(0)
def unit(*s):
    return torch.nn.functional.normalize(torch.randn(*s, device='cuda', generator=g), dim=-1)
def outs(r):
    return [x.detach().clone() for x in (r if isinstance(r, tuple) else (r,))]
rows = []
def timed(label, fpad, fpack, ld, rounds=3, n=30):
    base = picked(fpack)
    vs = {"packed": None, "all_computed": probe(base, ld, False), "docs_computed": probe(base, ld, True)}
    ref = outs(fpack())
    same = {}
    for k, v in vs.items():
        if v is not None:
            with forcing(v):
                same[k] = all(torch.equal(x, y) for x, y in zip(ref, outs(fpack())))
    ms = {"padded": [], **{k: [] for k in vs}}
    for _ in range(rounds):
        ms["padded"].append(per_call_ms(torch, fpad, n, rounds=1, spin_cycles=20_000_000))
        for k, v in vs.items():
            if v is None:
                ms[k].append(per_call_ms(torch, fpack, n, rounds=1, spin_cycles=20_000_000))
            else:
                with forcing(v):
                    ms[k].append(per_call_ms(torch, fpack, n, rounds=1, spin_cycles=20_000_000))
    row = {"cell": label, "cfg": base.name, "ms": {t: sorted(x)[1] for t, x in ms.items()}, "all_ms": ms, "same_bits": same}
    rows.append(row)
    print(f"{label:28s} " + " ".join(f"{t}={v:.4f}" for t, v in row["ms"].items()), same, flush=True)

for lq, nd, ld, kinds in ((32, 1000, 300, ("fp16", "fp8")), (32, 10000, 180, ("fp16",)), (1024, 1000, 1024, ("fp16",)),
                          (32, 1000, 64, ("fp16",))):
    q, d = unit(1, lq, 128), unit(nd, ld, 128)
    off = torch.arange(0, (nd + 1) * ld, ld, device='cuda')
    for name in kinds:
        if name == "fp8":
            q8, qs = lik_cupy.quantize_fp8(q); d8, ds = lik_cupy.quantize_fp8(d)
            timed(f"fp8 {lq} x {nd} ({ld})", lambda: lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs),
                  lambda: lik_cupy.maxsim_fp8_varlen(q8, d8.reshape(-1, 128), ds.reshape(-1), off, q_scales=qs), ld)
        else:
            qq, dd = q.half(), d.half()
            timed(f"fp16 {lq} x {nd} ({ld})", lambda: lik_cupy.maxsim(qq, dd),
                  lambda: lik_cupy.maxsim_varlen(qq, dd.reshape(-1, 128), off), ld)
    torch.cuda.empty_cache()
json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows},
          open(os.path.join(os.environ.get("OUT", "/tmp"), "packed_offsets.json"), "w"), indent=1)
