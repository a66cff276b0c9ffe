"""FP8 ColPali tiles at more CTAs an SM: the dispatched tile (128 tokens, 2 stages, 2 CTAs) against
64-token tiles compiled for 2-4 CTAs an SM (min blocks and the launch plan's residency forced), one
variant per process (kernels are cached by name). argv: bn stages ctas (0 0 0: dispatch only)."""
import dataclasses, json, os, sys
sys.path.insert(0, os.getcwd())
import cupy
import lik_cupy
from lik_cupy._base.device import device_properties
from lik_cupy import _dispatch as dispatch
from lik_cupy._dispatch import plan as plan_mod
from bench.lib.forcing import forcing, rebind
from bench.lib.sweep import time_ms

bn, stages, ctas = (int(x) for x in sys.argv[1:4])
rng = cupy.random.default_rng(0)
rows = []
for lq, ld, b in ((1024, 1024, 1000), (1024, 1024, 10000)):
    q = rng.standard_normal((lq, 128), dtype=cupy.float32); q /= cupy.linalg.norm(q, axis=-1, keepdims=True)
    d = rng.standard_normal((b, ld, 128), dtype=cupy.float32); d /= cupy.linalg.norm(d, axis=-1, keepdims=True)
    q8, qs = lik_cupy.quantize_fp8(q)
    d8, ds = lik_cupy.quantize_fp8(d)
    q16, d16 = q.astype(cupy.float16), d.astype(cupy.float16)
    del d
    call = lambda: lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs)
    want = call().get()
    row = {"lq": lq, "ld": ld, "B": b}
    if bn == 0:
        row["fp16_ms"] = time_ms(lambda: lik_cupy.maxsim(q16, d16))
        row["fp8_ms"] = time_ms(call)
    else:
        props = device_properties(0)
        base = dispatch.choose_forward(props.cc, "float8_e4m3fn", 128, lq, False, True, True, 1, ld, False, True)
        cfg = dataclasses.replace(base, bn=bn, stages=stages)
        cfg.__dict__["min_blocks"] = ctas
        old = plan_mod.ctas_per_sm
        rebind(plan_mod, "ctas_per_sm", lambda c, cc, registers=None: ctas if c == cfg else old(c, cc, registers))
        dispatch.clear_caches()
        with forcing(cfg):
            got = call().get()
            row["same"] = bool((got == want).all())
            row["max_diff"] = float(abs(got - want).max())
            row["ms"] = time_ms(call)
        row["cfg"] = cfg.name
        rebind(plan_mod, "ctas_per_sm", old)
    print(bn, stages, ctas, row, flush=True)
    rows.append(row)
    cupy.get_default_memory_pool().free_all_blocks()
od = os.environ.get("OUT", ".")
json.dump(rows, open(os.path.join(od, f"fp8_occ_{bn}_{stages}_{ctas}.json"), "w"), indent=1)
